//! The ssh spawner's agent on each host (`softnic host-spawn`, started over ssh by the
//! launcher): makes sure a softnicd serves this host — the running one, or one it starts
//! detached, logging to the runtime directory — starts this host's ranks, and supervises them.
//! It ends when its ranks do; when its ssh session goes (the launcher ended, was interrupted or
//! killed) the kernel tells it (parent-death signal) and it stops its ranks, which in turn die
//! with it if it is killed outright.

use std::ffi::OsString;
use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::local::{health_check, LaunchError};
use super::supervise::{die_with_parent, install_signal_handler, supervise};
use crate::config::Config;

/// One host's part of a job, as the launcher hands it over.
#[derive(Debug, Clone)]
pub struct HostSpawn {
    pub config: PathBuf,
    pub host: String,
    pub job_id: u32,
    pub job_key: u64,
    /// Host index of every rank of the job.
    pub rank_hosts: Vec<u16>,
    pub label: bool,
    pub conduit: Option<String>,
    pub env: Vec<(String, String)>,
    pub program: OsString,
    pub args: Vec<OsString>,
}

/// Runs this host's ranks; returns the exit code for the launcher (the first failing rank's).
pub fn run(h: &HostSpawn) -> Result<i32, LaunchError> {
    // The ssh session is our parent: when it goes, so do we (and our ranks, below).
    install_signal_handler();
    watch_parent();
    let cfg = Config::load(&h.config)?;
    let me = cfg.host_index(&h.host)?;
    ensure_daemon(&cfg, &h.config, me)?;
    if super::supervise::interrupted() {
        return Ok(130);
    }
    let size = h.rank_hosts.len() as u32;
    let mut children: Vec<(u32, Child)> = Vec::new();
    let mut copiers = Vec::new();
    for r in (0..size).filter(|&r| h.rank_hosts[r as usize] == me) {
        let mut cmd = Command::new(&h.program);
        let job = super::JobInfo {
            rank: r,
            size,
            job_id: h.job_id,
            job_key: h.job_key,
            daemon: cfg.socket_path(me),
            rank_hosts: h.rank_hosts.clone(),
            config: Some(h.config.clone()),
        };
        cmd.args(&h.args)
            .envs(h.env.iter().map(|(k, v)| (k, v)))
            .envs(job.env())
            .env("SOFTNIC_HOST", &h.host);
        if let Some(c) = &h.conduit {
            cmd.env("SOFTNIC_CONDUIT", c);
        }
        // stdin goes to rank 0 only.
        if r != 0 {
            cmd.stdin(Stdio::null());
        }
        if h.label {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        // A rank dies with this agent.
        die_with_parent(&mut cmd, rustix::process::Signal::Kill);
        match cmd.spawn() {
            Ok(mut c) => {
                if h.label {
                    copiers.extend(label(r, c.stdout.take(), false));
                    copiers.extend(label(r, c.stderr.take(), true));
                }
                children.push((r, c))
            }
            Err(source) => {
                super::supervise::kill_all(&mut children);
                return Err(LaunchError::Spawn {
                    rank: r,
                    program: h.program.to_string_lossy().into(),
                    source,
                });
            }
        }
    }
    let host = h.host.clone();
    let code = supervise(
        &mut children,
        |r, _, what| Some(format!("rank {r} on {host} {what}")),
        || None,
    );
    // The ranks are gone and their pipes closed: the last lines are on their way out.
    for c in copiers {
        let _ = c.join();
    }
    Ok(code)
}

/// Ends this agent (as a SIGTERM would) when its ssh session goes: the kernel's parent-death
/// signal, and — for a session that went before that was armed, or a signal that got lost — a
/// look at the parent every 100 ms.
fn watch_parent() {
    use rustix::process::{getpid, getppid, kill_process, set_parent_process_death_signal, Signal};
    let _ = set_parent_process_death_signal(Some(Signal::Term));
    let parent = getppid();
    let orphan = |p: Option<rustix::process::Pid>| p.is_none_or(|p| p.is_init());
    if orphan(parent) {
        let _ = kill_process(getpid(), Signal::Term);
        return;
    }
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(100));
        if getppid() != parent {
            let _ = kill_process(getpid(), Signal::Term);
            return;
        }
    });
}

/// Copies a rank's output line by line, each prefixed with `[rank] `.
fn label(
    rank: u32,
    from: Option<impl std::io::Read + Send + 'static>,
    err: bool,
) -> Option<std::thread::JoinHandle<()>> {
    let from = from?;
    Some(std::thread::spawn(move || {
        for line in std::io::BufReader::new(from).split(b'\n') {
            let Ok(line) = line else { break };
            let mut out: Box<dyn Write> = match err {
                true => Box::new(std::io::stderr().lock()),
                false => Box::new(std::io::stdout().lock()),
            };
            let _ = write!(out, "[{rank}] ");
            let _ = out.write_all(&line);
            let _ = out.write_all(b"\n");
        }
    }))
}

/// Makes sure host `me`'s daemon answers: if none does, starts `softnicd` (beside this
/// binary) detached in a session of its own, logging to `<runtime_dir>/<host>.log`.
pub fn ensure_daemon(cfg: &Config, config: &Path, me: u16) -> Result<(), LaunchError> {
    let sock = cfg.socket_path(me);
    if health_check(&sock, Duration::from_millis(300)) {
        return Ok(());
    }
    let name = &cfg.hosts[me as usize].name;
    std::fs::create_dir_all(&cfg.cluster.runtime_dir)?;
    let log_path = cfg.cluster.runtime_dir.join(format!("{name}.log"));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    let softnicd = std::env::current_exe()?.with_file_name("softnicd");
    let mut cmd = Command::new(&softnicd);
    cmd.arg("--config")
        .arg(config)
        .args(["--host", name])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: between fork and exec only the async-signal-safe setsid is called.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::setsid()
                .map(|_| ())
                .map_err(std::io::Error::from)
        });
    }
    cmd.spawn()
        .map_err(|e| LaunchError::Daemon(format!("cannot start {}: {e}", softnicd.display())))?;
    if health_check(&sock, Duration::from_secs(10)) {
        Ok(())
    } else {
        Err(LaunchError::Daemon(format!(
            "softnicd for host {name} did not come up within 10 s; see {}",
            log_path.display()
        )))
    }
}
