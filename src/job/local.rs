//! The launcher: `softnic run`. On the local default it starts the NICs of H simulated hosts
//! (127.0.0.2, .3, …, one socket each: packet where permitted, else UDP) in one
//! single-threaded daemon process (the launcher's binary started again, see
//! [`super::daemon_process`]; a launcher that cannot be started so runs them in a thread of its
//! own), or with `--daemon-per-host` in one process per host, as a LAN runs them (see
//! `spread_nic_cpus`); health-checks them, starts N ranks spread round-robin over the hosts, and stops
//! everything at the end. A rank that fails or is killed ends the job with a message naming it;
//! Ctrl-C ends it too; no process, socket or file is left behind.

use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::daemon_process::{self, DaemonProcess};
use super::placement::{place, Map};
use super::pmi::{PmiEvent, PmiServer};
use super::supervise::{
    deadline_news, install_signal_handler, kill_all, supervise, timeout_report,
};
use crate::config::{Config, ConfigError, Fault, TransportKind};
use crate::daemon::Daemon;
use crate::shm::attach::{self, Request, Response};

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot start the daemons: {0}")]
    Daemon(String),
    #[error("daemon for host {0} did not answer at {1} within 5 s")]
    Health(String, PathBuf),
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        rank: u32,
        program: String,
        source: std::io::Error,
    },
    #[error("-n must be at least 1 and --hosts between 1 and 250")]
    Size,
    #[error("the daemon refused: {0}")]
    Refused(String),
    #[error("the {0} spawner needs --config: the cluster's hosts and daemons")]
    NeedConfig(&'static str),
    #[error("cannot run {command} (the ssh command; set SOFTNIC_SSH_CMD): {source}")]
    Ssh {
        command: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Placement(#[from] super::placement::PlacementError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What to launch.
#[derive(Debug, Clone, Default)]
pub struct Launch {
    pub ranks: u32,
    /// Hosts of the local default (ignored with `config`).
    pub hosts: usize,
    pub config: Option<PathBuf>,
    /// Use daemons that are already running (softnicd) instead of starting them.
    pub attach: bool,
    /// Daemons started here: a process per host (its NIC on a core of its own while cores
    /// remain for the ranks), as on a LAN, instead of one process serving every host.
    pub daemon_per_host: bool,
    /// Fault injection for the daemons this launcher starts.
    pub fault: Option<Fault>,
    /// The local default's transport (unset: packet where permitted, else UDP);
    /// `SOFTNIC_TRANSPORT` overrides either.
    pub transport: Option<TransportKind>,
    /// Exported to the ranks as SOFTNIC_CONDUIT.
    pub conduit: Option<String>,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    /// Launcher variables (by name) to pass to the ranks (`--env`).
    pub forward: Vec<String>,
    /// The config's hosts to use, by name (`--hosts a,b`, `--hostfile`; empty: all).
    pub host_names: Vec<String>,
    /// At most this many ranks per host (`--ppn`).
    pub ppn: Option<u32>,
    pub map: Map,
    /// Prefix every output line with its rank (`--label`).
    pub label: bool,
    /// End the job after this long (`--timeout`, as mpiexec's `-timeout`): the ranks are
    /// stopped and the launcher exits with 124, after printing what the job's daemons count.
    pub timeout: Option<Duration>,
}

impl Launch {
    /// The config host indices this job may use: those named, or all.
    pub fn host_indices(&self, cfg: &Config) -> Result<Vec<u16>, LaunchError> {
        if self.host_names.is_empty() {
            return Ok((0..cfg.hosts.len() as u16).collect());
        }
        self.host_names
            .iter()
            .map(|n| cfg.host_index(n).map_err(LaunchError::from))
            .collect()
    }
}

/// Where the daemons of a job run.
enum Runner {
    Process(DaemonProcess),
    Thread(JoinHandle<()>),
}

/// The daemons of a job, stopped when dropped.
struct LocalDaemons {
    stop: Arc<AtomicBool>,
    runners: Vec<Runner>,
    runtime_dir: Option<PathBuf>,
}

impl LocalDaemons {
    /// Starts the NICs of every host of `cfg`: in one process, or in one each (`per_host`).
    fn start(cfg: &Config, per_host: bool) -> Result<LocalDaemons, String> {
        let all: Vec<u16> = (0..cfg.hosts.len() as u16).collect();
        let groups: Vec<Vec<u16>> = if per_host {
            all.iter().map(|&h| vec![h]).collect()
        } else {
            vec![all]
        };
        let mut d = LocalDaemons {
            stop: Arc::new(AtomicBool::new(false)),
            runners: Vec::new(),
            runtime_dir: None,
        };
        for hosts in groups {
            // A failure stops those already started (on drop).
            let r = if daemon_process::can_spawn() {
                Runner::Process(DaemonProcess::start(cfg, &hosts)?)
            } else {
                Runner::Thread(Self::thread(cfg, hosts, d.stop.clone())?)
            };
            d.runners.push(r);
        }
        Ok(d)
    }

    /// The NICs of `hosts` in a thread of this process; returns once they serve.
    fn thread(
        cfg: &Config,
        hosts: Vec<u16>,
        stop: Arc<AtomicBool>,
    ) -> Result<JoinHandle<()>, String> {
        let (tx, rx) = mpsc::channel();
        let c = cfg.clone();
        let thread = std::thread::Builder::new()
            .name("softnicd".into())
            .spawn(move || match Daemon::new(&c, &hosts, stop) {
                Ok(mut d) => {
                    let _ = tx.send(Ok(()));
                    if let Err(e) = d.run() {
                        tracing::error!("daemon loop failed: {e}");
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                }
            })
            .map_err(|e| e.to_string())?;
        match rx.recv() {
            Ok(Ok(())) => Ok(thread),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err("daemon thread died while starting".into())
            }
        }
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for r in self.runners.drain(..) {
            match r {
                Runner::Process(mut p) => {
                    p.stop();
                }
                Runner::Thread(t) => {
                    let _ = t.join();
                }
            }
        }
        if let Some(dir) = self.runtime_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Drop for LocalDaemons {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Whether a daemon answers at `path` now (one ping).
pub fn daemon_answers(path: &Path) -> bool {
    matches!(daemon_health(path, Duration::ZERO), Ok(true))
}

/// Pings a daemon's attach socket until it answers or `within` passes.
pub fn health_check(path: &Path, within: Duration) -> bool {
    matches!(daemon_health(path, within), Ok(true))
}

/// Pings a daemon's attach socket until it answers (`Ok(true)`) or `within` passes
/// (`Ok(false)`); a daemon that refuses this user is an error at once, with its reason.
pub fn daemon_health(path: &Path, within: Duration) -> Result<bool, String> {
    let t = Instant::now();
    loop {
        if let Ok(s) = attach::connect(path) {
            match attach::call(&s, &Request::Ping, &[]) {
                Ok((Response::Pong, _)) => return Ok(true),
                Ok((Response::Error(why), _)) => return Err(why),
                _ => {}
            }
        }
        if t.elapsed() >= within {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the local default's daemons on a free port; returns them and the config.
fn start_local_default(l: &Launch) -> Result<(LocalDaemons, Config), LaunchError> {
    let mut last = String::new();
    for _ in 0..20 {
        let tag: u32 = rand::random();
        let dir = std::env::temp_dir().join(format!("softnic-{}-{tag:08x}", std::process::id()));
        // Below the ranks' baseline ports (`JobInfo::rank_addrs`: 20000–31999) and the
        // kernel's ephemeral range (32768–60999), so neither can hold it already.
        let port = 10_000 + (rand::random::<u16>() % 10_000);
        let mut cfg = Config::local_default(l.hosts, port, dir.clone());
        cfg.cluster.transport = l.transport.unwrap_or_else(TransportKind::best_local);
        cfg.fault = l.fault.clone();
        if l.daemon_per_host {
            spread_nic_cpus(&mut cfg);
        }
        cfg.apply_env();
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("cluster.toml"), cfg.to_toml())?;
        match LocalDaemons::start(&cfg, l.daemon_per_host) {
            Ok(mut d) => {
                d.runtime_dir = Some(dir);
                return Ok((d, cfg));
            }
            Err(e) => {
                last = e;
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    Err(LaunchError::Daemon(last))
}

/// For a daemon process per host: each host that names no core of its own gets one, from the
/// last CPU down (the one-process default's core first) — NICs with silicon of their own. Not
/// where the cluster pins no daemon, nor under `SOFTNIC_NIC_CPU`, which names every daemon's
/// core. Where the NICs would take every core the CPUs this process may use, none is pinned:
/// the ranks would have no core left (two hosts on two cores, gni 1 MiB put_nbi, five rounds:
/// pinned 2259 MB/s, unpinned 3146).
fn spread_nic_cpus(cfg: &mut Config) {
    if cfg.cluster.nic_cpu.is_none() || std::env::var_os("SOFTNIC_NIC_CPU").is_some() {
        return;
    }
    spread_over(cfg, crate::shm::cores::allowed().map_or(1, |c| c.len()));
}

/// [`spread_nic_cpus`] over `ncpus` CPUs.
fn spread_over(cfg: &mut Config, ncpus: usize) {
    if cfg.hosts.len() >= ncpus {
        cfg.cluster.nic_cpu = None;
        return;
    }
    for (i, h) in cfg.hosts.iter_mut().enumerate() {
        h.nic_cpu.get_or_insert(-1 - i as i64);
    }
}

/// Runs the job; returns the exit status to exit with (0, or that of the first failing rank).
pub fn run(l: &Launch) -> Result<i32, LaunchError> {
    if l.ranks == 0 || !(1..=250).contains(&l.hosts) {
        return Err(LaunchError::Size);
    }
    install_signal_handler();
    let (daemons, cfg, cfg_path) = match &l.config {
        None => {
            let (d, c) = start_local_default(l)?;
            let p = c.cluster.runtime_dir.join("cluster.toml");
            (Some(d), c, p)
        }
        Some(p) => {
            let mut c = Config::load(p)?;
            if l.fault.is_some() {
                c.fault = l.fault.clone();
            }
            // Daemons that already serve every host are used, as with --attach.
            let running = || (0..c.hosts.len() as u16).all(|i| daemon_answers(&c.socket_path(i)));
            let d = if l.attach || running() {
                None
            } else {
                if l.daemon_per_host {
                    spread_nic_cpus(&mut c);
                }
                Some(LocalDaemons::start(&c, l.daemon_per_host).map_err(LaunchError::Daemon)?)
            };
            (d, c, p.clone())
        }
    };
    let nhosts = cfg.hosts.len();
    for i in 0..nhosts as u16 {
        let path = cfg.socket_path(i);
        match daemon_health(&path, Duration::from_secs(5)) {
            Ok(true) => {}
            Ok(false) => {
                return Err(LaunchError::Health(
                    cfg.hosts[i as usize].name.clone(),
                    path,
                ))
            }
            Err(why) => return Err(LaunchError::Refused(why)),
        }
    }
    let job_id: u32 = rand::random::<u32>() >> 1;
    let job_key: u64 = rand::random();
    let rank_hosts = place(l.ranks, &l.host_indices(&cfg)?, l.ppn, l.map)?;
    // PMI-1 for ranks that bootstrap through it (an unmodified PMI-1 program): one socket
    // pair each, served by a thread until the job ends.
    let (pmi, pmi_fds) = PmiServer::new(l.ranks, &format!("softnic-{job_id}"))?;
    let pmi = PmiThread::start(pmi);
    let mut children: Vec<(u32, Child)> = Vec::new();
    for (r, pmi_fd) in (0..l.ranks).zip(pmi_fds) {
        let h = rank_hosts[r as usize];
        let mut cmd = Command::new(&l.program);
        // The rank inherits its end (only it: the descriptor is closed here right after).
        rustix::io::fcntl_setfd(&pmi_fd, rustix::io::FdFlags::empty())
            .map_err(std::io::Error::from)?;
        cmd.env("PMI_FD", pmi_fd.as_raw_fd().to_string())
            .env("PMI_RANK", r.to_string())
            .env("PMI_SIZE", l.ranks.to_string());
        let job = super::JobInfo {
            rank: r,
            size: l.ranks,
            job_id,
            job_key,
            daemon: cfg.socket_path(h),
            rank_hosts: rank_hosts.clone(),
            config: Some(cfg_path.clone()),
        };
        cmd.args(&l.args)
            .envs(job.env())
            .env("SOFTNIC_HOST", &cfg.hosts[h as usize].name);
        if let Some(c) = &l.conduit {
            cmd.env("SOFTNIC_CONDUIT", c);
        }
        for (k, v) in &l.env {
            cmd.env(k, v);
        }
        let spawned = cmd.spawn();
        drop(pmi_fd);
        match spawned {
            Ok(c) => children.push((r, c)),
            Err(source) => {
                kill_all(&mut children);
                return Err(LaunchError::Spawn {
                    rank: r,
                    program: l.program.to_string_lossy().into(),
                    source,
                });
            }
        }
    }
    // A job past its time limit leaves, first, what its daemons count (a hang's evidence).
    let job_hosts = l.host_indices(&cfg)?;
    let mut timed_out = deadline_news(l.timeout, || {
        for &h in &job_hosts {
            match daemon_stat(&cfg.socket_path(h), Some(Duration::from_secs(2))) {
                Ok(t) => eprintln!(
                    "softnic: host {} at the time limit:\n{t}",
                    cfg.hosts[h as usize].name
                ),
                Err(e) => eprintln!(
                    "softnic: host {}: no counters ({e})",
                    cfg.hosts[h as usize].name
                ),
            }
        }
    });
    let code = supervise(
        &mut children,
        |r, _, what| timeout_report(r, what).or_else(|| Some(format!("rank {r} {what}"))),
        || {
            if let Some(t) = timed_out() {
                return Some(t);
            }
            let mut failed = None;
            for e in pmi.events() {
                match e {
                    PmiEvent::Abort { rank, code, msg } => {
                        let what = match msg.is_empty() {
                            true => format!("called PMI_Abort({code})"),
                            false => format!("called PMI_Abort({code}): {msg}"),
                        };
                        failed = failed.or(Some((rank, code.clamp(1, 255), what)));
                    }
                    PmiEvent::Bad { rank, why } => {
                        eprintln!("softnic: rank {rank}'s PMI connection closed: {why}")
                    }
                }
            }
            failed
        },
    );
    drop(pmi);
    drop(daemons);
    Ok(code)
}

/// A daemon's counters (`softnic stat`), asked over its socket; with `within`, a daemon that
/// does not answer in time (it may be what hangs) is an error, not a wait.
pub fn daemon_stat(sock: &Path, within: Option<Duration>) -> Result<String, String> {
    let s = attach::connect(sock).map_err(|e| e.to_string())?;
    rustix::net::sockopt::set_socket_timeout(&s, rustix::net::sockopt::Timeout::Recv, within)
        .map_err(|e| e.to_string())?;
    match attach::call(&s, &Request::Stat, &[])
        .map_err(|e| e.to_string())?
        .0
    {
        Response::Stat(t) => Ok(t),
        other => Err(format!("unexpected answer: {other:?}")),
    }
}

/// The PMI-1 server of a job on a thread of its own, stopped when dropped.
struct PmiThread {
    stop: Arc<AtomicBool>,
    events: mpsc::Receiver<PmiEvent>,
    thread: Option<JoinHandle<()>>,
}

impl PmiThread {
    fn start(mut srv: PmiServer) -> PmiThread {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, events) = mpsc::channel();
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                srv.serve(Duration::from_millis(20));
                for e in srv.take_events() {
                    let _ = tx.send(e);
                }
            }
        });
        PmiThread {
            stop,
            events,
            thread: Some(thread),
        }
    }

    /// What the ranks told the server since the last look.
    fn events(&self) -> Vec<PmiEvent> {
        self.events.try_iter().collect()
    }
}

impl Drop for PmiThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launcher_that_cannot_start_itself_runs_its_daemons_in_a_thread() {
        // A test binary never calls `serve_if_asked`: starting it again would run the tests.
        assert!(!daemon_process::can_spawn());
        let l = Launch {
            hosts: 2,
            ..Default::default()
        };
        let (d, cfg) = start_local_default(&l).unwrap();
        assert!(
            matches!(d.runners[..], [Runner::Thread(_)]),
            "one daemon for both hosts"
        );
        for i in 0..2 {
            assert!(health_check(&cfg.socket_path(i), Duration::from_secs(5)));
        }
        let dir = cfg.cluster.runtime_dir.clone();
        assert!(dir.exists());
        drop(d);
        assert!(!dir.exists(), "the runtime directory outlived its daemons");
        assert!(!health_check(
            &cfg.socket_path(0),
            Duration::from_millis(100)
        ));
    }

    #[test]
    fn a_daemon_per_host_serves_its_host_on_a_core_of_its_own() {
        let l = Launch {
            hosts: 3,
            daemon_per_host: true,
            ..Default::default()
        };
        let (d, cfg) = start_local_default(&l).unwrap();
        assert_eq!(d.runners.len(), 3, "a daemon each");
        for i in 0..3 {
            assert!(health_check(&cfg.socket_path(i), Duration::from_secs(5)));
        }
        let ncpus = crate::shm::cores::allowed().unwrap().len();
        let mut want = Config::local_default(3, 1, "/tmp".into());
        spread_over(&mut want, ncpus);
        let cores = |c: &Config| c.hosts.iter().map(|h| h.nic_cpu).collect::<Vec<_>>();
        assert_eq!(
            cores(&cfg),
            cores(&want),
            "the cores as spread_over gives them"
        );
        assert_eq!(cfg.cluster.nic_cpu, want.cluster.nic_cpu);
        // The one-process default keeps the cluster's single core.
        let one = Config::local_default(3, 1, "/tmp".into());
        assert!(one.hosts.iter().all(|h| h.nic_cpu.is_none()));
        assert_eq!(one.cluster.nic_cpu, Some(-1));
        // Cores to spare: a core each from the last down; a host's own core stands.
        let mut c = Config::local_default(3, 1, "/tmp".into());
        c.hosts[1].nic_cpu = Some(0);
        spread_over(&mut c, 4);
        assert_eq!(cores(&c), [Some(-1), Some(0), Some(-3)]);
        // NICs on every core would leave the ranks none: nobody pinned.
        let mut c = Config::local_default(3, 1, "/tmp".into());
        spread_over(&mut c, 3);
        assert_eq!(c.cluster.nic_cpu, None);
        assert!(c.hosts.iter().all(|h| h.nic_cpu.is_none()));
        // A cluster that pins nothing stays so.
        let mut c = Config::local_default(3, 1, "/tmp".into());
        c.cluster.nic_cpu = None;
        spread_nic_cpus(&mut c);
        assert!(c.hosts.iter().all(|h| h.nic_cpu.is_none()));
        let dir = cfg.cluster.runtime_dir.clone();
        drop(d);
        assert!(!dir.exists());
        for i in 0..3 {
            assert!(!health_check(
                &cfg.socket_path(i),
                Duration::from_millis(100)
            ));
        }
    }
}
