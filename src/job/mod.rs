//! Bootstrap: who am I in the job (rank, size, job id and key, my daemon, where every rank
//! lives), read from the `SOFTNIC_*` environment the launcher sets; and the launchers.

pub mod daemon_process;
pub mod local;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(
        "{0} is not set: run the program under `softnic run` (or set the SOFTNIC_* job variables)"
    )]
    Missing(&'static str),
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

impl JobInfo {
    /// Whether this process runs inside a job.
    pub fn in_job() -> bool {
        std::env::var_os("SOFTNIC_RANK").is_some()
    }

    pub fn from_env() -> Result<JobInfo, JobError> {
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

    /// The cluster's datagram size (the daemons' MTU): from the job's config file, or the
    /// default when the job names none.
    pub fn mtu(&self) -> Result<usize, crate::config::ConfigError> {
        match &self.config {
            Some(p) => Ok(crate::config::Config::load(p)?.cluster.mtu),
            None => Ok(crate::config::DEFAULT_MTU),
        }
    }
}
