//! `softnic run` on the local default: a failing or killed rank ends the job naming it, Ctrl-C
//! ends it, and nothing (processes, sockets, runtime files) is left behind.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn run(test: &str, n: u32) -> (std::process::ExitStatus, String, u32) {
    let child = Command::new(env!("CARGO_BIN_EXE_softnic"))
        .args(["run", "-n", &n.to_string(), "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
        pid,
    )
}

fn leftovers(launcher_pid: u32) -> Vec<String> {
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("softnic-{launcher_pid}-")))
        .collect()
}

#[test]
fn failing_rank_ends_the_job_with_its_status() {
    if in_job() {
        let mut nic = init();
        if nic.rank() == 1 {
            std::process::exit(3);
        }
        // Rank 0 would wait forever: the launcher must end it.
        nic.barrier().unwrap();
        return;
    }
    let t = Instant::now();
    let (st, err, pid) = run("failing_rank_ends_the_job_with_its_status", 2);
    assert_eq!(st.code(), Some(3), "{err}");
    assert!(err.contains("rank 1 exited with status 3"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(20));
    assert!(
        leftovers(pid).is_empty(),
        "runtime files left: {:?}",
        leftovers(pid)
    );
}

#[test]
fn killed_rank_ends_the_job_naming_it() {
    if in_job() {
        let mut nic = init();
        if nic.rank() == 2 {
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::Kill)
                .unwrap();
        }
        nic.barrier().unwrap();
        return;
    }
    let (st, err, pid) = run("killed_rank_ends_the_job_naming_it", 3);
    assert_eq!(st.code(), Some(128 + 9), "{err}");
    assert!(err.contains("rank 2 was killed by signal 9"), "{err}");
    assert!(leftovers(pid).is_empty());
}

/// `--timeout`: a job that would run for ever (here a rank that never joins the barrier) ends
/// after the limit with exit code 124, first leaving what its daemons count, and nothing stays.
#[test]
fn a_job_past_its_timeout_ends_with_its_daemons_counters() {
    if in_job() {
        let mut nic = init();
        if nic.rank() == 1 {
            std::thread::sleep(Duration::from_secs(120));
        }
        nic.barrier().unwrap();
        return;
    }
    let t = Instant::now();
    let test = "a_job_past_its_timeout_ends_with_its_daemons_counters";
    let out = Command::new(env!("CARGO_BIN_EXE_softnic"))
        .args(["run", "-n", "2", "--timeout", "1.5", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "{err}");
    assert!(
        err.contains("the job ran past its time limit of 1.5 s"),
        "{err}"
    );
    assert!(
        err.contains("host h0 at the time limit") && err.contains("packets_sent"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    let bad = Command::new(env!("CARGO_BIN_EXE_softnic"))
        .args(["run", "-n", "1", "--timeout=0", "--", "true"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--timeout 0: a positive number"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

#[test]
fn interrupt_stops_every_rank_and_cleans_up() {
    if in_job() {
        let _nic = init();
        let dir = std::env::var("SOFTNIC_TEST_PIDS").unwrap();
        std::fs::write(format!("{dir}/{}", std::process::id()), b"").unwrap();
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    let dir = std::env::temp_dir().join(format!("softnic-test-pids-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_softnic"))
        .args(["run", "-n", "3", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "interrupt_stops_every_rank_and_cleans_up",
            "--nocapture",
        ])
        .env("SOFTNIC_TEST_PIDS", &dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::fs::read_dir(&dir).unwrap().count() < 3 {
        assert!(t.elapsed() < Duration::from_secs(30), "ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::Int).unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(130));
    assert!(t.elapsed() < Duration::from_secs(30));
    for e in std::fs::read_dir(&dir).unwrap() {
        let rank_pid: i32 = e.unwrap().file_name().to_string_lossy().parse().unwrap();
        assert!(
            !std::path::Path::new(&format!("/proc/{rank_pid}")).exists(),
            "rank {rank_pid} survived"
        );
    }
    assert!(leftovers(child.id()).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `name`'s value in the environment of process `pid`, if set.
fn environ_var(pid: u32, name: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let key = format!("{name}=");
    env.split(|&b| b == 0)
        .find_map(|v| v.strip_prefix(key.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// Asserts that process `pid` runs one thread.
fn assert_single_threaded(pid: u32) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status.lines().any(|l| l == "Threads:\t1"),
        "the daemon process {pid} has more than one thread:\n{status}"
    );
}

/// Rank 0's side: notes `daemons` in the directory the test named (`SOFTNIC_TEST_PIDS`).
fn record_daemons(daemons: &[u32]) {
    let dir = std::env::var("SOFTNIC_TEST_PIDS").unwrap();
    for pid in daemons {
        std::fs::write(format!("{dir}/{pid}"), b"").unwrap();
    }
}

/// The test's side: `want` daemons were noted in `dir`, none outlived the job; `dir` goes.
fn recorded_daemons_ended(dir: &std::path::Path, want: usize) {
    let pids: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(pids.len(), want, "rank 0 found the daemon processes");
    for p in &pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{p}")).exists(),
            "the daemon process {p} outlived its job"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The process (a child of the launcher, like the ranks) that runs the job's daemons.
fn daemon_process_of(launcher: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The parent pid is the second field after the command's closing parenthesis.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(launcher) && environ_var(pid, "SOFTNIC_LOCAL_DAEMON").is_some() {
            found.push(pid);
        }
    }
    found
}

#[test]
fn daemons_run_in_one_single_threaded_process_that_ends_with_the_job() {
    if in_job() {
        let mut nic = init();
        if nic.rank() == 0 {
            let launcher = rustix::process::getppid().unwrap().as_raw_nonzero().get() as u32;
            let daemons = daemon_process_of(launcher);
            assert_eq!(daemons.len(), 1, "daemon processes: {daemons:?}");
            assert_single_threaded(daemons[0]);
            record_daemons(&daemons);
        }
        nic.barrier().unwrap();
        return;
    }
    let dir = std::env::temp_dir().join(format!("softnic-test-daemon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    launch_ok_env(
        "daemons_run_in_one_single_threaded_process_that_ends_with_the_job",
        2,
        2,
        &[],
        &[("SOFTNIC_TEST_PIDS", dir.to_str().unwrap())],
    );
    recorded_daemons_ended(&dir, 1);
}

/// `--daemon-per-host`: each simulated host's NIC in a process of its own, pinned to a core of
/// its own where there are enough, as on a LAN; ranks on different hosts talk through them;
/// all end with the job.
#[test]
fn a_daemon_process_per_host_serves_each_host_and_ends_with_the_job() {
    if in_job() {
        let mut nic = init();
        let mem = nic
            .mem_register(4096, softnic::nic::memory::Perms::READ_WRITE)
            .unwrap();
        nic.barrier().unwrap();
        if nic.rank() == 0 {
            let launcher = rustix::process::getppid().unwrap().as_raw_nonzero().get() as u32;
            let mut daemons = daemon_process_of(launcher);
            daemons.sort_unstable();
            assert_eq!(daemons.len(), 3, "daemon processes: {daemons:?}");
            let mut served = Vec::new();
            for &pid in &daemons {
                assert_single_threaded(pid);
                let hosts = environ_var(pid, "SOFTNIC_LOCAL_DAEMON_HOSTS");
                served.push(hosts.expect("names its hosts"));
            }
            served.sort();
            assert_eq!(served, ["0", "1", "2"], "one host each");
            record_daemons(&daemons);
        }
        // Every rank puts its number to the next rank (on the next host) through the daemons.
        let (me, n) = (nic.rank(), nic.size());
        let to = (me + 1) % n;
        nic.put(
            remote(to, mem.handle, 8 * me as u64),
            &(me as u64 + 100).to_le_bytes(),
        )
        .unwrap();
        nic.barrier().unwrap();
        let from = (me + n - 1) % n;
        let at = 8 * from as usize;
        let got = u64::from_le_bytes(mem.bytes()[at..at + 8].try_into().unwrap());
        assert_eq!(got, from as u64 + 100, "from rank {from}");
        nic.barrier().unwrap();
        return;
    }
    let dir = std::env::temp_dir().join(format!("softnic-test-perhost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    launch_ok_env(
        "a_daemon_process_per_host_serves_each_host_and_ends_with_the_job",
        3,
        3,
        &["--daemon-per-host"],
        &[("SOFTNIC_TEST_PIDS", dir.to_str().unwrap())],
    );
    recorded_daemons_ended(&dir, 3);
}

#[test]
fn softnicd_is_single_threaded_and_stops_on_sigterm_and_sigint() {
    for signal in [rustix::process::Signal::Term, rustix::process::Signal::Int] {
        let daemons = Daemons::start(1);
        let pid = daemons.pids()[0];
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        assert!(
            status.lines().any(|l| l == "Threads:\t1"),
            "softnicd has more than one thread:\n{status}"
        );
        let t = Instant::now();
        let st = daemons.signal_and_wait(signal);
        assert!(st.success(), "softnicd ended with {st} on {signal:?}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
}

/// The local default's daemons use the packet transport where the launcher may open packet
/// sockets (root, CAP_NET_RAW), else UDP; `--transport` and `SOFTNIC_TRANSPORT` choose.
#[test]
fn local_default_picks_the_packet_transport_when_permitted() {
    if in_job() {
        let path = std::env::var("SOFTNIC_CONFIG").expect("the launcher names the config");
        let cfg = softnic::config::Config::load(std::path::Path::new(&path)).unwrap();
        let want = match std::env::var("WANT_TRANSPORT").as_deref() {
            Ok("udp") => softnic::config::TransportKind::Udp,
            Ok("tcp") => softnic::config::TransportKind::Tcp,
            _ => softnic::config::TransportKind::best_local(),
        };
        assert_eq!(cfg.cluster.transport, want);
        let mut nic = init();
        nic.barrier().unwrap();
        return;
    }
    let test = "local_default_picks_the_packet_transport_when_permitted";
    launch_ok(test, 2, 2, &[]);
    let want = |t| ("WANT_TRANSPORT", t);
    launch_ok_env(
        test,
        2,
        2,
        &[],
        &[("SOFTNIC_TRANSPORT", "udp"), want("udp")],
    );
    launch_ok_env(test, 2, 2, &["--transport", "tcp"], &[want("tcp")]);
}
