//! Sessions of the host core: attached processes, the job each belongs to, and the memory
//! they register. Who may attach at all (uid, group) is the driver's check; which job and
//! rank a session may speak as is decided here.

use crate::nic::memory::Region;
use crate::wire::Status;

use super::HostCore;

/// The rank a session speaks as. `job` is the job's tag (see [`job_tag`]): what its ops carry
/// and its endpoints are filed under; `raw_job` the id the launcher gave.
pub(super) struct SessionInfo {
    pub job: u32,
    pub raw_job: u32,
    pub rank: u32,
}

/// The identity a job's ops carry between hosts: its id and key hashed together, so ranks
/// that present another key — on a host where the job has no rank yet, where nobody could
/// compare keys — form a job apart and reach none of this one's endpoints or memory (as a
/// Cray protection tag does, with 2^32 values).
pub fn job_tag(job: u32, key: u64) -> u32 {
    let h = blake3::hash(
        &[
            &b"softnic job tag v1"[..],
            &job.to_le_bytes(),
            &key.to_le_bytes(),
        ]
        .concat(),
    );
    let b = h.as_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Why an attach was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttachError {
    #[error("session {0:#x} is already attached")]
    AlreadyAttached(u64),
    #[error("rank {rank} is not below the job size {size}")]
    RankOutOfRange { rank: u32, size: u32 },
    #[error("wrong key for job {0}: another job with this id runs here")]
    WrongJobKey(u32),
    #[error("rank {rank} of job {job} is already attached to this host")]
    RankTaken { job: u32, rank: u32 },
}

impl HostCore {
    /// The job a session's process runs in, as the engines name it (the tag that
    /// [`HostCore::poll_addressed`] reports).
    pub fn session_job(&self, session: u64) -> Option<u32> {
        self.sessions.get(&session).map(|s| s.job)
    }

    /// Attaches `session` as rank `rank` of `job` (of `size` ranks). The first session of a
    /// job fixes its key; later ones must present the same.
    pub fn attach(
        &mut self,
        session: u64,
        job: u32,
        job_key: u64,
        rank: u32,
        size: u32,
    ) -> Result<(), AttachError> {
        if self.sessions.contains_key(&session) {
            return Err(AttachError::AlreadyAttached(session));
        }
        if rank >= size {
            return Err(AttachError::RankOutOfRange { rank, size });
        }
        if let Some((k, _)) = self.jobs.get(&job) {
            if *k != job_key {
                self.stats.attach_refused += 1;
                return Err(AttachError::WrongJobKey(job));
            }
        }
        let tag = job_tag(job, job_key);
        if !self.endpoints.insert(tag, rank, session) {
            return Err(AttachError::RankTaken { job, rank });
        }
        self.jobs.entry(job).or_insert((job_key, 0)).1 += 1;
        self.sessions.insert(
            session,
            SessionInfo {
                job: tag,
                raw_job: job,
                rank,
            },
        );
        self.stats.clients_attached += 1;
        tracing::info!(host = %self.name, job, rank, "client attached");
        Ok(())
    }

    /// Registers memory of `session`'s process; returns its handle.
    pub fn register(&mut self, session: u64, region: Region) -> Result<u32, Status> {
        let s = self.sessions.get(&session).ok_or(Status::NoSuchEndpoint)?;
        self.endpoints.register(s.job, s.rank, region)
    }

    /// Withdraws a registration: remote accesses to it fail from now on.
    pub fn deregister(&mut self, session: u64, region: u32) -> Result<(), Status> {
        let s = self.sessions.get(&session).ok_or(Status::NoSuchEndpoint)?;
        self.endpoints.deregister(s.job, s.rank, region)
    }

    /// Drops a session: its memory becomes unreachable (remote ops get NoSuchEndpoint), its
    /// outstanding operations are forgotten, the host goes on serving the others.
    pub fn detach(&mut self, session: u64) {
        self.initiator.drop_session(session);
        self.groups.retain(|_, g| g.session() != session);
        let Some(s) = self.sessions.remove(&session) else {
            return;
        };
        self.portals.remove(&(s.job, s.rank));
        self.velo_close(s.job, s.rank);
        self.rma_close(s.job, s.rank);
        self.endpoints.remove(s.job, s.rank);
        if let Some(e) = self.jobs.get_mut(&s.raw_job) {
            e.1 -= 1;
            if e.1 == 0 {
                self.jobs.remove(&s.raw_job);
            }
        }
        self.stats.clients_detached += 1;
        tracing::info!(host = %self.name, job = s.raw_job, rank = s.rank, "client detached");
    }

    /// Sessions attached now.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }
}
