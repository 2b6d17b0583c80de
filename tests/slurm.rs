//! Slurm on this machine, made by the test (munged, slurmctld, slurmd; one node named as the
//! host): `srun --mpi=pmi2 -n 4 ring` over a running daemon bootstraps through Slurm's PMI, and
//! `softnic run` inside `salloc -n 4` has srun start the node's daemon, then the ranks. Root
//! only, and Slurm and munge must be installed (`.ci/run` installs slurm-wlm and munge).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

struct Slurm {
    dir: PathBuf,
    conf: PathBuf,
    children: Vec<Child>,
}

impl Slurm {
    fn start() -> Slurm {
        let dir = std::env::temp_dir().join(format!("softnic-slurm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["munge", "spool", "state"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let host = hostname();
        let port = 10_000 + rand::random::<u16>() % 10_000;
        let d = dir.display();
        let conf = dir.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=softnic\nSlurmctldHost={host}\nAuthType=auth/munge\nCredType=cred/munge\n\
                 AuthInfo=socket={d}/munge/munge.socket.2\nProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n\
                 SchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 SlurmctldPidFile={d}/ctld.pid\nSlurmdPidFile={d}/d.pid\nSlurmdSpoolDir={d}/spool\n\
                 StateSaveLocation={d}/state\nSlurmUser=root\nSlurmdUser=root\nReturnToService=2\n\
                 MpiDefault=none\nSlurmdParameters=config_overrides\nSlurmctldPort={port}\n\
                 SlurmdPort={}\nNodeName={host} CPUs=8 State=UNKNOWN\n\
                 PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8\n",
                port + 1
            ),
        )
        .unwrap();
        let mut s = Slurm {
            dir: dir.clone(),
            conf: conf.clone(),
            children: Vec::new(),
        };
        let log = |name: &str| std::fs::File::create(dir.join(name)).unwrap();
        s.children.push(
            Command::new("munged")
                .args(["--foreground", "--force"])
                .arg(format!("--socket={d}/munge/munge.socket.2"))
                .arg(format!("--pid-file={d}/munge/munged.pid"))
                .arg(format!("--seed-file={d}/munge/munged.seed"))
                .arg(format!("--log-file={d}/munge/munged.log"))
                .stdout(log("munged.out"))
                .stderr(log("munged.err"))
                .spawn()
                .expect("munged"),
        );
        std::thread::sleep(Duration::from_millis(300));
        for (bin, out) in [("slurmctld", "ctld.out"), ("slurmd", "d.out")] {
            s.children.push(
                Command::new(bin)
                    .arg("-D")
                    .arg("-f")
                    .arg(&conf)
                    .env("SLURM_CONF", &conf)
                    .stdout(log(out))
                    .stderr(Stdio::from(log(&format!("{out}.err"))))
                    .spawn()
                    .expect(bin),
            );
        }
        let t = Instant::now();
        loop {
            let out = s.cmd("sinfo").args(["-h", "-o", "%T"]).output().unwrap();
            if String::from_utf8_lossy(&out.stdout).trim() == "idle" {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the Slurm node did not come up: {}",
                std::fs::read_to_string(dir.join("d.out.err")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        s
    }

    fn cmd(&self, bin: &str) -> Command {
        let mut c = Command::new(bin);
        c.env("SLURM_CONF", &self.conf);
        c
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn hostname() -> String {
    let out = Command::new("hostname").arg("-s").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs `c` (a 4-rank ring) and asserts that it passed.
fn ring_ok(c: &mut Command) {
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("ring ok 4 ranks"),
        "{}",
        output_text(&out)
    );
}

/// A one-host config whose host is named as the Slurm node.
fn node_config(dir: &Path) -> softnic::config::Config {
    let port = 10_000 + rand::random::<u16>() % 10_000;
    let mut cfg = softnic::config::Config::local_default(1, port, dir.to_path_buf());
    cfg.hosts[0].name = hostname();
    cfg.cluster.nic_cpu = None;
    cfg
}

#[test]
fn slurm_srun_pmi2_and_softnic_run_inside_salloc() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: a Slurm controller and node daemon need root (CI runs as root)");
        return;
    }
    for bin in [
        "/usr/sbin/slurmctld",
        "/usr/sbin/slurmd",
        "/usr/sbin/munged",
    ] {
        if !Path::new(bin).exists() {
            eprintln!(
                "skipped: {bin} not installed (apt install slurm-wlm munge; CI installs them)"
            );
            return;
        }
    }
    let slurm = Slurm::start();

    // srun straight from the allocation's shell, over a running daemon: PMI bootstrap.
    let dir = slurm.dir.join("softnic-a");
    let d = Daemons::start_config(node_config(&dir), &[]);
    ring_ok(
        slurm
            .cmd("srun")
            .args(["--mpi=pmi2", "-n", "4"])
            .arg(example("ring"))
            .env("SOFTNIC_CONFIG", d.path()),
    );
    drop(d);

    // softnic run inside salloc: srun starts the node's daemon, then the ranks.
    let dir = slurm.dir.join("softnic-b");
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = node_config(&dir.join("run"));
    let config = dir.join("cluster.toml");
    std::fs::write(&config, cfg.to_toml()).unwrap();
    ring_ok(
        slurm
            .cmd("salloc")
            .args(["-n", "4"])
            .arg(env!("CARGO_BIN_EXE_softnic"))
            .args(["run", "--config"])
            .arg(&config)
            .args(["-n", "4", "--"])
            .arg(example("ring")),
    );
    // The daemon srun started, detached, still serves the node: stop it.
    let pids = Command::new("pgrep")
        .args(["-f", &format!("softnicd --config {}", config.display())])
        .output()
        .unwrap();
    let pids = String::from_utf8_lossy(&pids.stdout).into_owned();
    assert!(!pids.trim().is_empty(), "no daemon was started on the node");
    for p in pids.split_whitespace() {
        let _ = Command::new("kill").arg(p).status();
    }
}
