//! Bootstrap: who am I in the job (rank, size, job id and key, my daemon, where every rank
//! lives) — from the `SOFTNIC_*` environment `softnic run` sets, or through a PMI-1 process
//! manager (`mpiexec.hydra`, `srun --mpi=pmi2`) with the daemon found from `SOFTNIC_CONFIG`
//! and `SOFTNIC_HOST`; and the launchers.

pub mod daemon_process;
pub mod doctor;
pub mod host_spawn;
pub mod local;
pub mod placement;
pub mod pmi;
pub mod slurm;
pub mod ssh;
pub mod supervise;

use std::path::PathBuf;

/// The variables a launcher sets for each rank itself ([`JobInfo::env`], the rank's host
/// name and conduit): never forwarded from a launcher's own environment.
pub const JOB_VARS: &[&str] = &[
    "SOFTNIC_RANK",
    "SOFTNIC_SIZE",
    "SOFTNIC_JOB_ID",
    "SOFTNIC_JOB_KEY",
    "SOFTNIC_DAEMON",
    "SOFTNIC_HOST",
    "SOFTNIC_RANK_HOSTS",
    "SOFTNIC_CONFIG",
    "SOFTNIC_CONDUIT",
];

/// Whether `ip` is an address of this machine (a socket can be bound to it).
pub fn is_local_ip(ip: std::net::IpAddr) -> bool {
    std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// How `softnic run` starts ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Spawner {
    /// On this machine (the local default, or a config whose hosts are all here).
    Local,
    /// On the config's hosts over ssh.
    Ssh,
    /// Inside a Slurm allocation: `srun` starts a daemon per node where none runs, then the
    /// ranks, which bootstrap through Slurm's PMI (`--mpi=pmi2`).
    Slurm,
}

impl Spawner {
    /// `--spawner`, else `SOFTNIC_SPAWNER`, else slurm inside an allocation (`SLURM_JOB_ID`),
    /// else ssh when the config has a host that is not
    /// on this machine and whose daemon does not answer here either, else local (every host
    /// is here, or reachable from here: daemons in network namespaces of this machine).
    pub fn choose(
        asked: Option<Spawner>,
        config: Option<&crate::config::Config>,
    ) -> Result<Spawner, JobError> {
        if let Some(s) = asked {
            return Ok(s);
        }
        if let Ok(v) = std::env::var("SOFTNIC_SPAWNER") {
            use clap::ValueEnum;
            return Spawner::from_str(&v, true).map_err(|why| JobError::Invalid {
                name: "SOFTNIC_SPAWNER",
                value: v,
                why,
            });
        }
        if std::env::var_os("SLURM_JOB_ID").is_some() && config.is_some() {
            return Ok(Spawner::Slurm);
        }
        let remote = config.is_some_and(|c| {
            (0..c.hosts.len() as u16).any(|i| {
                !is_local_ip(c.hosts[i as usize].addr.ip())
                    && !local::daemon_answers(&c.socket_path(i))
            })
        });
        Ok(if remote { Spawner::Ssh } else { Spawner::Local })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(
        "{0} is not set: run the program under `softnic run`, or under a PMI-1 process manager \
         (mpiexec.hydra, srun --mpi=pmi2) with SOFTNIC_CONFIG naming the cluster config"
    )]
    Missing(&'static str),
    #[error(transparent)]
    Pmi(#[from] pmi::PmiError),
    #[error("SOFTNIC_CONFIG: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("which host of {config} is this? {why}; set SOFTNIC_HOST to its name in the config")]
    Host { config: String, why: String },
    #[error("{name} has an invalid value {value:?}: {why}")]
    Invalid {
        name: &'static str,
        value: String,
        why: String,
    },
}

/// The job as one rank sees it.
#[derive(Debug, Clone)]
pub struct JobInfo {
    pub rank: u32,
    pub size: u32,
    pub job_id: u32,
    pub job_key: u64,
    /// This rank's daemon attach socket.
    pub daemon: PathBuf,
    /// Host index of every rank.
    pub rank_hosts: Vec<u16>,
    /// The cluster config file, when known (for `softnic stat`).
    pub config: Option<PathBuf>,
}

fn var(name: &'static str) -> Result<String, JobError> {
    std::env::var(name).map_err(|_| JobError::Missing(name))
}

fn num<T: std::str::FromStr>(name: &'static str) -> Result<T, JobError>
where
    T::Err: std::fmt::Display,
{
    let v = var(name)?;
    v.parse().map_err(|e: T::Err| JobError::Invalid {
        name,
        value: v.clone(),
        why: e.to_string(),
    })
}

/// Where [`JobInfo::rank_addrs`]'s ports start, and how many there are.
const RANK_PORT_BASE: u16 = 20_000;
const RANK_PORTS: u64 = 12_000;

impl JobInfo {
    /// Whether this process runs inside a job (started by `softnic run` or by a PMI-1
    /// process manager).
    pub fn in_job() -> bool {
        std::env::var_os("SOFTNIC_RANK").is_some() || pmi::PmiClient::available()
    }

    /// The job as `softnic run` describes it in the environment, or else as a PMI-1 process
    /// manager and the cluster config say ([`JobInfo::from_pmi`]).
    pub fn from_env() -> Result<JobInfo, JobError> {
        if std::env::var_os("SOFTNIC_RANK").is_none() && pmi::PmiClient::available() {
            return Self::from_pmi();
        }
        let rank: u32 = num("SOFTNIC_RANK")?;
        let size: u32 = num("SOFTNIC_SIZE")?;
        let map = var("SOFTNIC_RANK_HOSTS")?;
        let rank_hosts = map
            .split(',')
            .map(|s| s.parse::<u16>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| JobError::Invalid {
                name: "SOFTNIC_RANK_HOSTS",
                value: map.clone(),
                why: e.to_string(),
            })?;
        if rank_hosts.len() != size as usize || rank >= size {
            return Err(JobError::Invalid {
                name: "SOFTNIC_RANK_HOSTS",
                value: map,
                why: format!("needs one host index per rank (size {size}, rank {rank})"),
            });
        }
        Ok(JobInfo {
            rank,
            size,
            job_id: num("SOFTNIC_JOB_ID")?,
            job_key: num("SOFTNIC_JOB_KEY")?,
            daemon: var("SOFTNIC_DAEMON")?.into(),
            rank_hosts,
            config: std::env::var_os("SOFTNIC_CONFIG").map(Into::into),
        })
    }

    /// The environment a launcher gives this rank: what [`JobInfo::from_env`] reads back.
    pub fn env(&self) -> Vec<(&'static str, std::ffi::OsString)> {
        let map = self
            .rank_hosts
            .iter()
            .map(|h| h.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let mut v: Vec<(&'static str, std::ffi::OsString)> = vec![
            ("SOFTNIC_RANK", self.rank.to_string().into()),
            ("SOFTNIC_SIZE", self.size.to_string().into()),
            ("SOFTNIC_JOB_ID", self.job_id.to_string().into()),
            ("SOFTNIC_JOB_KEY", self.job_key.to_string().into()),
            ("SOFTNIC_DAEMON", self.daemon.clone().into()),
            ("SOFTNIC_RANK_HOSTS", map.into()),
        ];
        if let Some(c) = &self.config {
            v.push(("SOFTNIC_CONFIG", c.clone().into()));
        }
        v
    }

    /// Where each rank can be reached by a socket of its own process (the baselines without
    /// the NIC: the udp conduit, netbench's raw-UDP floor): its host's address in the config
    /// and a port made of the job id, `salt` (one per user of this scheme) and the rank, so no
    /// exchange is needed and ranks sharing a host differ. Without a config: loopback
    /// addresses 127.1.x.y. The ports (20000–31999) stay below Linux's default ephemeral range
    /// (32768–60999): a port there may already be taken by any socket the kernel numbered itself
    /// on that address (a daemon's sending socket: CI once saw the udp conduit's bind fail
    /// with `Address already in use`).
    pub fn rank_addrs(&self, salt: u16) -> Result<Vec<std::net::SocketAddr>, JobError> {
        let ips: Vec<std::net::IpAddr> = match &self.config {
            Some(p) => {
                let cfg = crate::config::Config::load(p)?;
                self.rank_hosts
                    .iter()
                    .map(|&h| {
                        cfg.hosts
                            .get(h as usize)
                            .map(|h| h.addr.ip())
                            .ok_or_else(|| JobError::Invalid {
                                name: "SOFTNIC_RANK_HOSTS",
                                value: h.to_string(),
                                why: "names no host of the config".into(),
                            })
                    })
                    .collect::<Result<_, _>>()?
            }
            None => (0..self.size)
                .map(|r| std::net::Ipv4Addr::new(127, 1, (r >> 8) as u8, r as u8).into())
                .collect(),
        };
        let base = self.job_id as u64 * 997 + salt as u64 * 13_331;
        Ok(ips
            .into_iter()
            .enumerate()
            .map(|(r, ip)| {
                let port = RANK_PORT_BASE + ((base + r as u64) % RANK_PORTS) as u16;
                std::net::SocketAddr::new(ip, port)
            })
            .collect())
    }

    /// The cluster's datagram size (the daemons' MTU): from the job's config file, or the
    /// default when the job names none.
    pub fn mtu(&self) -> Result<usize, crate::config::ConfigError> {
        match &self.config {
            Some(p) => Ok(crate::config::Config::load(p)?.cluster.mtu),
            None => Ok(crate::config::DEFAULT_MTU),
        }
    }
}

/// The PMI connection of a rank that bootstrapped through one, kept until the process exits.
static PMI: std::sync::Mutex<Option<pmi::PmiClient>> = std::sync::Mutex::new(None);
/// The job a PMI bootstrap found: a process bootstraps once, however many of its layers ask
/// (netbench and then GASNet, or a program using two APIs). A second bootstrap would connect
/// to the manager again, draw another job id, and close the first connection, after which
/// the process's PMI_Finalize fails and Hydra kills the job's other ranks as it exits.
static PMI_JOB: std::sync::Mutex<Option<JobInfo>> = std::sync::Mutex::new(None);

/// Tells the PMI process manager, if this rank bootstrapped through one, that it is done.
pub fn pmi_finalize() {
    if let Ok(mut g) = PMI.lock() {
        if let Some(mut c) = g.take() {
            let _ = c.finalize();
        }
    }
}

impl JobInfo {
    /// Bootstraps under a PMI-1 process manager: rank and size from it; this rank's daemon
    /// from `SOFTNIC_CONFIG` and `SOFTNIC_HOST` (default: the config's only host whose address
    /// is on this machine); rank 0 draws the job id and key, every rank publishes its host, and
    /// one PMI barrier later every rank knows the job.
    pub fn from_pmi() -> Result<JobInfo, JobError> {
        let mut known = PMI_JOB.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(job) = known.as_ref() {
            return Ok(job.clone());
        }
        let job = Self::bootstrap_pmi()?;
        *known = Some(job.clone());
        Ok(job)
    }

    fn bootstrap_pmi() -> Result<JobInfo, JobError> {
        let config: PathBuf = var("SOFTNIC_CONFIG")?.into();
        let cfg = crate::config::Config::load(&config)?;
        let host = this_host(&cfg, &config)?;
        let mut c = pmi::PmiClient::connect()?;
        let (rank, size) = (c.rank, c.size);
        if rank == 0 {
            let id: u32 = rand::random::<u32>() >> 1;
            let key: u64 = rand::random();
            c.put("softnic-job", &format!("{id}.{key}"))?;
        }
        c.put(&format!("softnic-host-{rank}"), &host.to_string())?;
        c.barrier()?;
        let bad = |name: &'static str, value: String| JobError::Invalid {
            name,
            value,
            why: "published by the job's rank 0 over PMI".into(),
        };
        let job = c.get("softnic-job")?;
        let (job_id, job_key) = job
            .split_once('.')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .ok_or_else(|| bad("softnic-job", job.clone()))?;
        let mut rank_hosts = Vec::with_capacity(size as usize);
        for r in 0..size {
            let v = c.get(&format!("softnic-host-{r}"))?;
            match v.parse::<u16>() {
                Ok(h) if (h as usize) < cfg.hosts.len() => rank_hosts.push(h),
                _ => return Err(bad("softnic-host", v)),
            }
        }
        if let Ok(mut g) = PMI.lock() {
            *g = Some(c);
        }
        // Whatever the program does, the process manager hears PMI_Finalize when it exits
        // (Hydra counts an exit without it as a failure and kills the job's other ranks).
        extern "C" fn finalize_at_exit() {
            pmi_finalize();
        }
        // SAFETY: registers a plain function with no captured state; it runs once at exit.
        unsafe {
            libc::atexit(finalize_at_exit);
        }
        Ok(JobInfo {
            rank,
            size,
            job_id,
            job_key,
            daemon: cfg.socket_path(host),
            rank_hosts,
            config: Some(config),
        })
    }
}

/// The `softnic` binary: this one, or the one beside it when another program (netbench)
/// launches jobs; `SOFTNIC_REMOTE_SOFTNIC` names it on the hosts the ssh spawner reaches.
pub fn softnic_binary() -> std::io::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let beside = me.with_file_name("softnic");
    Ok(if beside.exists() { beside } else { me })
}

/// Which host of `cfg` this process runs on: `SOFTNIC_HOST`, else the Slurm node's name
/// (`SLURMD_NODENAME`) when the config has a host of that name, else the config's only host
/// whose address is on this machine.
pub fn this_host(cfg: &crate::config::Config, config: &std::path::Path) -> Result<u16, JobError> {
    let host_err = |why: String| JobError::Host {
        config: config.display().to_string(),
        why,
    };
    if let Ok(name) = std::env::var("SOFTNIC_HOST") {
        return cfg
            .host_index(&name)
            .map_err(|_| host_err(format!("SOFTNIC_HOST={name} names none of its hosts")));
    }
    if let Some(i) = std::env::var("SLURMD_NODENAME")
        .ok()
        .and_then(|n| cfg.host_index(&n).ok())
    {
        return Ok(i);
    }
    local_host(cfg).map_err(host_err)
}

/// The config's one host whose address belongs to this machine (binding a socket to it
/// succeeds), or why there is none or several.
fn local_host(cfg: &crate::config::Config) -> Result<u16, String> {
    let local: Vec<usize> = (0..cfg.hosts.len())
        .filter(|&i| is_local_ip(cfg.hosts[i].addr.ip()))
        .collect();
    match local[..] {
        [i] => Ok(i as u16),
        [] => Err("no host's address is on this machine".into()),
        _ => Err(format!(
            "several are on this machine ({})",
            local
                .iter()
                .map(|&i| cfg.hosts[i].name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}
