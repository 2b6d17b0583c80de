//! Helpers for multi-process tests: a test re-executes its own binary as the ranks of a job.
#![allow(dead_code)]

pub mod netns;
pub mod ssh_hosts;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};

use softnic::gni::{MemHandle, Nic, Remote};
use softnic::job::JobInfo;

/// An example program as cargo built it with the tests (`target/<profile>/examples/NAME`).
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let p = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .join("examples")
        .join(name);
    assert!(
        p.exists(),
        "{} missing: cargo builds the examples with the tests",
        p.display()
    );
    p
}

/// A finished command's stdout and stderr, for assertions and their messages.
pub fn output_text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub fn in_job() -> bool {
    JobInfo::in_job()
}

/// Runs this test (by exact name) as `n` ranks over `hosts` simulated hosts with `softnic run`.
pub fn launch(test: &str, n: u32, hosts: usize, extra: &[&str]) -> Output {
    launch_env(test, n, hosts, extra, &[])
}

/// [`launch`] with extra environment for the launcher (e.g. `SOFTNIC_TRANSPORT=tcp`).
pub fn launch_env(
    test: &str,
    n: u32,
    hosts: usize,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Output {
    let exe = std::env::current_exe().expect("test exe");
    let out = Command::new(env!("CARGO_BIN_EXE_softnic"))
        .envs(env.iter().copied())
        .args(["run", "-n", &n.to_string(), "--hosts", &hosts.to_string()])
        // Ends a hung job before the test runner's limit (180 s), with the daemons' counters.
        .args(["--timeout", "150"])
        .args(extra)
        .arg("--")
        .arg(exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .output()
        .expect("softnic run starts");
    out
}

/// Like [`launch`], and asserts that every rank succeeded.
pub fn launch_ok(test: &str, n: u32, hosts: usize, extra: &[&str]) {
    launch_ok_env(test, n, hosts, extra, &[])
}

pub fn launch_ok_env(test: &str, n: u32, hosts: usize, extra: &[&str], env: &[(&str, &str)]) {
    let out = launch_env(test, n, hosts, extra, env);
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "job failed ({:?}):\n{text}",
        out.status
    );
    assert!(
        text.contains("1 passed"),
        "ranks did not run the test body:\n{text}"
    );
}

pub fn remote(rank: u32, handle: MemHandle, offset: u64) -> Remote {
    Remote {
        rank,
        handle,
        offset,
    }
}

/// A pattern that differs per byte, per size and per writer.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| {
            ((i as u64)
                .wrapping_mul(31)
                .wrapping_add(seed * 7 + (i as u64 >> 8))
                % 251) as u8
        })
        .collect()
}

pub fn init() -> Nic {
    Nic::init().expect("attach to the local daemon")
}

/// One `softnicd` process per host on a fresh config (for tests that need daemons outliving
/// ranks, or raw access to their UDP ports).
pub struct Daemons {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub cfg: softnic::config::Config,
    children: Vec<Child>,
    /// The network namespace of each host's daemon (none: this one).
    netns: Vec<String>,
    /// More softnicd arguments.
    args: Vec<String>,
}

impl Daemons {
    pub fn start(hosts: usize) -> Daemons {
        Self::start_with(hosts, softnic::config::TransportKind::Udp)
    }

    pub fn start_with(hosts: usize, transport: softnic::config::TransportKind) -> Daemons {
        let dir = std::env::temp_dir().join(format!(
            "softnic-test-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let port = 10_000 + rand::random::<u16>() % 10_000;
        let mut cfg = softnic::config::Config::local_default(hosts, port, dir.clone());
        cfg.cluster.transport = transport;
        Self::start_config(cfg, &[])
    }

    /// Starts one softnicd per host of `cfg`, host `i` inside network namespace `netns[i]`
    /// when given (`ip netns exec`).
    pub fn start_config(cfg: softnic::config::Config, netns: &[String]) -> Daemons {
        Self::start_config_args(cfg, netns, &[])
    }

    /// [`Daemons::start_config`] with more softnicd arguments.
    pub fn start_config_args(
        cfg: softnic::config::Config,
        netns: &[String],
        args: &[&str],
    ) -> Daemons {
        let dir = cfg.cluster.runtime_dir.clone();
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("cluster.toml");
        std::fs::write(&config, cfg.to_toml()).unwrap();
        let mut d = Daemons {
            dir,
            config,
            cfg,
            children: Vec::new(),
            netns: netns.to_vec(),
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        d.children = (0..d.cfg.hosts.len()).map(|i| d.spawn_daemon(i)).collect();
        for i in 0..d.cfg.hosts.len() {
            d.wait_up(i);
        }
        d
    }

    fn spawn_daemon(&self, i: usize) -> Child {
        let mut c = match self.netns.get(i) {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_softnicd")]);
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_softnicd")),
        };
        c.arg("--config")
            .arg(&self.config)
            .args(["--host", &self.cfg.hosts[i].name])
            .args(&self.args)
            .spawn()
            .expect("softnicd starts")
    }

    fn wait_up(&self, i: usize) {
        assert!(
            softnic::job::local::health_check(
                &self.cfg.socket_path(i as u16),
                std::time::Duration::from_secs(5)
            ),
            "daemon up"
        );
    }

    /// SIGKILLs host `i`'s daemon (a crash: no goodbye to anyone).
    pub fn kill(&mut self, i: usize) {
        let c = &mut self.children[i];
        rustix::process::kill_process(
            rustix::process::Pid::from_child(c),
            rustix::process::Signal::Kill,
        )
        .unwrap();
        c.wait().unwrap();
    }

    /// Starts host `i`'s daemon again and waits until it takes clients.
    pub fn restart(&mut self, i: usize) {
        self.children[i] = self.spawn_daemon(i);
        self.wait_up(i);
    }

    pub fn stat(&self) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_softnic"))
            .arg("stat")
            .arg("--config")
            .arg(&self.config)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "softnic stat failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Sum of a counter over all hosts in `softnic stat`.
    pub fn counter(&self, name: &str) -> u64 {
        self.stat()
            .lines()
            .filter_map(|l| {
                l.strip_prefix(name)
                    .filter(|r| r.starts_with(' '))
                    .map(|r| r.trim().parse::<u64>().unwrap())
            })
            .sum()
    }

    /// Spawns this test as rank `rank` of a `size`-rank job on these daemons (ranks round-robin).
    pub fn spawn_rank(&self, test: &str, rank: u32, size: u32, job: u32, key: u64) -> Child {
        let n = self.cfg.hosts.len() as u32;
        let map: Vec<String> = (0..size).map(|r| (r % n).to_string()).collect();
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env("SOFTNIC_RANK", rank.to_string())
            .env("SOFTNIC_SIZE", size.to_string())
            .env("SOFTNIC_JOB_ID", job.to_string())
            .env("SOFTNIC_JOB_KEY", key.to_string())
            .env("SOFTNIC_DAEMON", self.cfg.socket_path((rank % n) as u16))
            .env("SOFTNIC_RANK_HOSTS", map.join(","))
            .env("SOFTNIC_CONFIG", &self.config)
            .spawn()
            .unwrap()
    }

    /// Runs this test binary's `test` as an `n`-rank job on these daemons; asserts success.
    pub fn run_job_ok(&self, test: &str, n: u32) {
        self.run_job_with(test, n, &[], &[]);
    }

    /// [`Daemons::run_job_ok`] with launcher flags (`--conduit portals`) and environment;
    /// asserts that every rank ran the test body.
    pub fn run_job_with(&self, test: &str, n: u32, extra: &[&str], env: &[(&str, &str)]) {
        let out = Command::new(env!("CARGO_BIN_EXE_softnic"))
            .envs(env.iter().copied())
            .args(["run", "-n", &n.to_string(), "--attach", "--config"])
            .arg(&self.config)
            .args(extra)
            .arg("--")
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .output()
            .unwrap();
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{test} failed:\n{text}");
        assert!(text.contains("1 passed"), "{test}: no rank ran it:\n{text}");
    }

    pub fn path(&self) -> &Path {
        &self.config
    }

    /// The daemons' process ids.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|c| c.id()).collect()
    }

    /// Sends `signal` to the first daemon and waits for it to end (killing it after 5 s).
    pub fn signal_and_wait(mut self, signal: rustix::process::Signal) -> std::process::ExitStatus {
        let mut c = self.children.remove(0);
        rustix::process::kill_process(rustix::process::Pid::from_child(&c), signal).unwrap();
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_secs(5) {
            if let Some(st) = c.try_wait().unwrap() {
                return st;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let _ = c.kill();
        c.wait().unwrap()
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_child(c),
                rustix::process::Signal::Term,
            );
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
