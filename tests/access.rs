//! Who may attach: a process of another user is refused at once with a message saying why
//! (not a five-second wait ending in "did not answer"); `cluster.allowed_gid` admits a group's
//! members, whose jobs then run beside the daemon user's — and cannot join another job without
//! its key. Runs processes as `nobody` with `setpriv`, so it needs root (CI is root).

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;
use softnic::client::{Client, ClientError};
use softnic::nic::memory::Perms;

const NOBODY: u32 = 65_534;

/// `softnic run --attach` on `d`'s daemons as uid/gid `NOBODY`, running this test's `phase`.
fn run_as_nobody(d: &Daemons, test: &str, phase: &str) -> Output {
    Command::new("setpriv")
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "--",
        ])
        .arg(env!("CARGO_BIN_EXE_softnic"))
        .args(["run", "-n", "2", "--attach", "--config"])
        .arg(d.path())
        .arg("--")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env("ACCESS_PHASE", phase)
        .output()
        .unwrap()
}

fn job_body() {
    let mut nic = init();
    let mem = nic.mem_register(4096, Perms::READ_WRITE).unwrap();
    nic.barrier().unwrap();
    let peer = 1 - nic.rank();
    nic.put(remote(peer, mem.handle, 0), &[7; 64]).unwrap();
    nic.barrier().unwrap();
    assert_eq!(mem.bytes()[..64], [7; 64]);
    nic.barrier().unwrap();
}

/// Tries to join job 4242 (the daemon user's, waiting on host 0 for its second rank) with a
/// key of its own at host 0: refused, whoever asks.
fn intruder_body() {
    let path = std::path::PathBuf::from(std::env::var("SOFTNIC_CONFIG").unwrap());
    let cfg = softnic::config::Config::load(&path).unwrap();
    match Client::attach(&cfg.socket_path(0), 4242, 1, 1, 2) {
        Err(ClientError::Refused(why)) => {
            assert!(why.contains("wrong key for job 4242"), "{why}")
        }
        Err(e) => panic!("refused for the wrong reason: {e}"),
        Ok(_) => panic!("joined another user's job without its key"),
    }
}

fn root() -> bool {
    if rustix::process::geteuid().is_root()
        && Command::new("setpriv").arg("--help").output().is_ok()
    {
        return true;
    }
    eprintln!("skipped: running processes as another user needs root and setpriv (CI is root)");
    false
}

#[test]
fn another_user_is_refused_at_once_saying_why() {
    if in_job() {
        return job_body();
    }
    if !root() {
        return;
    }
    let d = Daemons::start(2);
    let t = Instant::now();
    let out = run_as_nobody(&d, "another_user_is_refused_at_once_saying_why", "job");
    assert!(!out.status.success(), "{}", output_text(&out));
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "refused after {:?}",
        t.elapsed()
    );
    let msg = output_text(&out);
    assert!(
        msg.contains("permission denied")
            && msg.contains(&format!("this process is uid {NOBODY}"))
            && msg.contains("cluster.allowed_gid"),
        "{msg}"
    );
    assert!(d.counter("attach_refused") > 0, "{}", d.stat());
}

#[test]
fn an_allowed_group_attaches_and_reaches_only_its_own_job() {
    if in_job() {
        return match std::env::var("ACCESS_PHASE").as_deref() {
            Ok("intruder") => intruder_body(),
            _ => job_body(),
        };
    }
    if !root() {
        return;
    }
    let port = 10_000 + rand::random::<u16>() % 10_000;
    let dir = std::env::temp_dir().join(format!(
        "softnic-access-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let mut cfg = softnic::config::Config::local_default(2, port, dir);
    cfg.cluster.allowed_gid = Some(NOBODY);
    cfg.cluster.nic_cpu = None;
    let d = Daemons::start_config(cfg, &[]);
    // The daemon user's job 4242: rank 0 waits for a rank 1 that never comes.
    let mut waiting = d.spawn_rank(
        "an_allowed_group_attaches_and_reaches_only_its_own_job",
        0,
        2,
        4242,
        77,
    );
    std::thread::sleep(Duration::from_millis(300));
    let test = "an_allowed_group_attaches_and_reaches_only_its_own_job";
    let out = run_as_nobody(&d, test, "job");
    assert!(out.status.success(), "{}", output_text(&out));
    let out = run_as_nobody(&d, test, "intruder");
    assert!(out.status.success(), "{}", output_text(&out));
    let _ = waiting.kill();
    let _ = waiting.wait();
}
