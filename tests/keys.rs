//! Per-host keys end to end: `softnic keygen` makes each host's key pair; daemons with per-host
//! keys run a job; a daemon given another host's private key, or a key file others may read,
//! refuses to start saying which; a datagram from a real host of the cluster that claims
//! another host's identity is dropped and counted against the host it claimed.

mod common;

use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use softnic::config::Config;
use softnic::nic::memory::Perms;

/// `softnic keygen --out PATH`; returns the public key it printed.
fn keygen(path: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_softnic"))
        .args(["keygen", "--out"])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    line.strip_prefix("public_key = \"")
        .and_then(|l| l.strip_suffix('"'))
        .unwrap_or_else(|| panic!("keygen printed {line:?}"))
        .to_string()
}

/// A three-host loopback config with per-host keys (host i's key in `dir/hi.key`).
fn keyed_config(dir: &Path) -> (Config, Vec<PathBuf>) {
    let port = 10_000 + rand::random::<u16>() % 10_000;
    let mut cfg = Config::local_default(3, port, dir.join("run"));
    cfg.cluster.secret = None;
    let mut files = Vec::new();
    for (i, h) in cfg.hosts.iter_mut().enumerate() {
        let f = dir.join(format!("h{i}.key"));
        h.public_key = Some(keygen(&f));
        h.private_key_file = Some(f.clone());
        files.push(f);
    }
    cfg.validate().unwrap();
    (cfg, files)
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "softnic-keys-{tag}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn keyed_job_body() {
    let mut nic = init();
    let mem = nic.mem_register(4096, Perms::READ_WRITE).unwrap();
    nic.barrier().unwrap();
    let peer = (nic.rank() + 1) % nic.size();
    nic.put(remote(peer, mem.handle, 8), &[nic.rank() as u8 + 1; 8])
        .unwrap();
    assert_eq!(nic.afadd(remote(peer, mem.handle, 64), 1).unwrap(), 0);
    nic.barrier().unwrap();
    let prev = (nic.rank() + nic.size() - 1) % nic.size();
    assert_eq!(mem.bytes()[8..16], [prev as u8 + 1; 8]);
    nic.barrier().unwrap();
}

#[test]
fn per_host_keys_run_a_job_and_a_forged_identity_is_counted() {
    if in_job() {
        return keyed_job_body();
    }
    let dir = temp_dir("ok");
    let (cfg, files) = keyed_config(&dir);
    let d = Daemons::start_config(cfg.clone(), &[]);
    d.run_job_ok(
        "per_host_keys_run_a_job_and_a_forged_identity_is_counted",
        3,
    );

    let host2 = softnic::keys::HostKey::load(&files[2]).unwrap();
    let publics: Vec<[u8; 32]> = cfg
        .hosts
        .iter()
        .map(|h| softnic::keys::parse_hex32(h.public_key.as_ref().unwrap(), "pk").unwrap())
        .collect();
    let mut t = softnic::transport::Transport::new(
        2,
        3,
        host2.pair_keys(2, &publics),
        Default::default(),
        7,
    );
    let mut forged = t.poll_transmit(0).unwrap().1.to_vec();
    forged[4..6].copy_from_slice(&1u16.to_le_bytes());
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.send_to(&forged, cfg.hosts[0].addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let counted = |stat: &str| {
        stat.lines()
            .any(|l| l.starts_with("auth_failures_by_claimed_host") && l.contains("host1=1"))
    };
    while !counted(&d.stat()) {
        assert!(Instant::now() < deadline, "not counted:\n{}", d.stat());
        std::thread::sleep(Duration::from_millis(20));
    }
    d.run_job_ok(
        "per_host_keys_run_a_job_and_a_forged_identity_is_counted",
        3,
    );
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts softnicd for `host` of `cfg` and returns what it said when it refused to start.
fn refused(cfg: &Config, dir: &Path, host: &str) -> String {
    let path = dir.join("cluster.toml");
    std::fs::write(&path, cfg.to_toml()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_softnicd"))
        .arg("--config")
        .arg(&path)
        .args(["--host", host])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(!st.success());
            let out = child.wait_with_output().unwrap();
            return String::from_utf8_lossy(&out.stderr).into_owned();
        }
        if t.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("softnicd for {host} started with a bad key");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_wrong_or_exposed_private_key_is_refused_naming_the_host() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("bad");
    let (mut cfg, files) = keyed_config(&dir);
    cfg.hosts[1].private_key_file = Some(files[2].clone());
    let msg = refused(&cfg, &dir, "h1");
    assert!(msg.contains("is not host h1's"), "{msg}");

    cfg.hosts[1].private_key_file = Some(files[1].clone());
    std::fs::set_permissions(&files[1], std::fs::Permissions::from_mode(0o644)).unwrap();
    let msg = refused(&cfg, &dir, "h1");
    assert!(
        msg.contains("readable by others") && msg.contains("chmod 600"),
        "{msg}"
    );

    std::fs::remove_file(&files[1]).unwrap();
    let msg = refused(&cfg, &dir, "h1");
    assert!(msg.contains("cannot read the private key file"), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}
