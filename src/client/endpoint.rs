//! A rank's endpoint on its NIC: the attached client with its job, registered memory (and the
//! bounce region for buffers outside it), requests and their completions, and the job
//! barrier. Every API (gni, Portals, the GASNet conduits) sits on one; a process that uses
//! several APIs hands the same endpoint from one to the other (`into_endpoint`).

use rustc_hash::FxHashMap as HashMap;
use std::sync::Arc;

use super::region::{MemHandle, MemRegion};
use super::{Client, ClientError};
use crate::job::{JobError, JobInfo};
use crate::nic::memory::Perms;
use crate::shm::{Command, CommandKind, FailedOp, Mapping, PeerFailure, CMD_IMPLICIT};
use crate::wire::Status;

/// What a NIC operation can meet (the gni API calls it `GniError`).
#[derive(Debug, thiserror::Error)]
pub enum NicError {
    #[error(transparent)]
    Job(#[from] JobError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("cannot create registered memory: {0}")]
    Memory(#[from] std::io::Error),
    #[error("remote operation failed: {0:?} — {}", explain(*.0))]
    Remote(Status),
    #[error("rank {0} is not in this job of {1} ranks")]
    NoSuchRank(u32, u32),
    #[error("local range [{off}, {off}+{len}) lies outside the {region_len}-byte region")]
    LocalBounds {
        off: u64,
        len: u64,
        region_len: usize,
    },
    #[error("unknown or already completed sync id {0}")]
    BadSyncId(u64),
    #[error(
        "{} failed after {waited_ms} ms: host {host}{} stopped answering or restarted \
         (is its softnicd running? `softnic stat --host` it)",
        op.map_or("operation".to_string(), |o| o.to_string()),
        name.as_ref().map_or(String::new(), |n| format!(" ({n})"))
    )]
    PeerFailed {
        host: u16,
        /// The host's name in the cluster config, when the job knows its config.
        name: Option<String>,
        op: Option<FailedOp>,
        waited_ms: u64,
    },
}

fn explain(s: Status) -> &'static str {
    match s {
        Status::Ok => "no error",
        Status::OutOfBounds => "the remote range lies outside the target region",
        Status::Permission => "the target region does not grant this access",
        Status::NoSuchRegion => {
            "the target has no region with that handle (register in the same order on every rank)"
        }
        Status::NoSuchEndpoint => "the target rank is not attached (exited or killed)",
        Status::PeerDead => "the target host's daemon stopped answering",
        Status::BadRequest => "malformed request (misaligned AMO, bad size)",
        Status::Fault => "local memory reached by copy is gone (unmapped, or its process exited)",
    }
}

enum Slot {
    /// Waiting; the bytes the operation moves (how its waiter backs off).
    Pending(u64),
    /// The raw completion status (a Gemini `Status`, or a Portals return code) and value.
    Done(u32, u64),
}

const SYS_LEN: usize = 4096;
/// The bounce region: buffers outside registered memory are staged through it in pieces of
/// this size.
pub const BOUNCE_LEN: usize = 4 << 20;
const BARRIER_WORDS: usize = 64;

/// Request ids with this bit set are implicit (nbi) operations.
const IMPLICIT: u64 = 1 << 63;
/// Request ids with this bit carry their poster's note in bits 32..61 and complete into the
/// noted list ([`Endpoint::take_noted`]) instead of a slot: for APIs that keep their own
/// per-operation state (VELO's credits per destination).
const NOTED: u64 = 1 << 61;
const NOTE_MASK: u64 = (1 << 29) - 1;
/// The note of requests whose completion only returns their credit (the operation reports
/// itself some other way, as RMA through notifications).
pub const NOTE_DISCARD: u32 = NOTE_MASK as u32;

/// One rank's attachment to its NIC.
pub struct Endpoint {
    client: Client,
    job: JobInfo,
    next_req: u64,
    explicit: HashMap<u64, Slot>,
    implicit: u64,
    /// The first failure among implicit operations: status and completion value.
    implicit_error: Option<(Status, u64)>,
    outstanding: usize,
    regions: Vec<MemRegion>,
    sys: MemRegion,
    bounce: MemRegion,
    barrier_epoch: u64,
    /// Completions of noted requests not yet taken: (note, raw status, value).
    noted: Vec<(u32, u32, u64)>,
    /// Hosts that implicit puts went to since the last gsync: their targets acknowledge
    /// lazily, so a gsync asks them to hurry (see [`Endpoint::gsync_wait`]).
    lazy_hosts: Vec<u16>,
}

impl Endpoint {
    /// Attaches to this rank's daemon as the launcher described it in the environment.
    pub fn init() -> Result<Endpoint, NicError> {
        Self::attach(JobInfo::from_env()?)
    }

    /// Attaches (collective: once it returns, every rank is attached with its library
    /// regions, so remote operations find their targets).
    pub fn attach(job: JobInfo) -> Result<Endpoint, NicError> {
        let client = Client::attach(&job.daemon, job.job_id, job.job_key, job.rank, job.size)?;
        let sys = register_with(&client, SYS_LEN, Perms::READ_WRITE)?;
        let bounce = register_with(&client, BOUNCE_LEN, Perms(0))?;
        let mut ep = Endpoint {
            client,
            job,
            next_req: 1,
            explicit: HashMap::with_capacity_and_hasher(256, Default::default()),
            implicit: 0,
            implicit_error: None,
            outstanding: 0,
            regions: Vec::new(),
            sys,
            bounce,
            barrier_epoch: 0,
            lazy_hosts: Vec::new(),
            noted: Vec::new(),
        };
        ep.barrier_inner(true)?;
        // Every rank is attached: the clients' count the daemon published is the job's.
        crate::shm::cores::start_placing();
        Ok(ep)
    }

    pub fn rank(&self) -> u32 {
        self.job.rank
    }
    pub fn size(&self) -> u32 {
        self.job.size
    }
    pub fn job(&self) -> &JobInfo {
        &self.job
    }
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The host index rank `rank` lives on.
    pub fn rank_host(&self, rank: u32) -> Result<u16, NicError> {
        self.job
            .rank_hosts
            .get(rank as usize)
            .copied()
            .ok_or(NicError::NoSuchRank(rank, self.job.size))
    }

    /// Registers `len` bytes of fresh zeroed memory with remote permissions `perms`.
    pub fn mem_register(&mut self, len: usize, perms: Perms) -> Result<MemRegion, NicError> {
        let r = register_with(&self.client, len, perms)?;
        self.regions.push(r.clone());
        Ok(r)
    }

    pub fn mem_deregister(&mut self, r: &MemRegion) -> Result<(), NicError> {
        self.client.deregister(r.handle.0)?;
        self.regions.retain(|x| x.handle != r.handle);
        Ok(())
    }

    /// The registered region holding `[p, p+len)` and the offset of `p` in it.
    pub fn registered(&self, p: *const u8, len: usize) -> Option<(&MemRegion, u64)> {
        self.regions
            .iter()
            .find_map(|r| r.contains(p, len).map(|off| (r, off)))
    }

    /// The region registered here under `h`.
    pub fn region(&self, h: MemHandle) -> Option<&MemRegion> {
        self.regions.iter().find(|r| r.handle == h)
    }

    /// The bounce region (no remote access) for buffers outside registered memory.
    pub fn bounce(&self) -> &MemRegion {
        &self.bounce
    }

    // ------------------------------------------------------------ completions

    fn new_req(&mut self, implicit: bool, bytes: u64) -> u64 {
        let r = self.next_req;
        self.next_req += 1;
        if implicit {
            self.implicit += 1;
            r | IMPLICIT
        } else {
            self.explicit.insert(r, Slot::Pending(bytes));
            r
        }
    }

    /// A request id that is already complete (successfully, value 0): for operations that
    /// had to finish synchronously but hand out a handle.
    pub fn done_req(&mut self) -> u64 {
        let req = self.new_req(false, 0);
        self.explicit.insert(req, Slot::Done(Status::Ok as u32, 0));
        req
    }

    fn on_completion(&mut self, req: u64, status: u32, value: u64) {
        self.outstanding -= 1;
        if req & NOTED != 0 && req & IMPLICIT == 0 {
            let note = ((req >> 32) & NOTE_MASK) as u32;
            if note != NOTE_DISCARD {
                self.noted.push((note, status, value));
            }
            return;
        }
        let raw = status;
        let status = Status::from_u32(status);
        if req & IMPLICIT != 0 {
            self.implicit -= 1;
            if !status.is_ok() && self.implicit_error.is_none() {
                self.implicit_error = Some((status, value));
            }
        } else if let Some(s) = self.explicit.get_mut(&req) {
            *s = Slot::Done(raw, value);
        }
    }

    /// Processes every completion already posted.
    pub fn progress(&mut self) {
        while let Some(e) = self.client.poll() {
            self.on_completion(e.client_req, e.status, e.value);
        }
    }

    fn wait_one(&mut self) -> Result<(), NicError> {
        self.wait_one_for(0)
    }

    /// [`Endpoint::wait_one`] for an operation moving `bytes`: a large one does not spin
    /// first (see [`crate::client::Client::wait_for`]).
    fn wait_one_for(&mut self, bytes: u64) -> Result<(), NicError> {
        let e = self.client.wait_for(bytes)?;
        self.on_completion(e.client_req, e.status, e.value);
        Ok(())
    }

    /// Submits `cmd` (with `inline` bytes) and returns its request id; an implicit one
    /// completes only towards [`Endpoint::gsync_wait`].
    pub fn post(
        &mut self,
        mut cmd: Command,
        inline: &[u8],
        implicit: bool,
    ) -> Result<u64, NicError> {
        // Credits: never more operations in flight than completion-queue entries.
        while self.outstanding >= self.client.cq_capacity() {
            self.wait_one()?;
        }
        let req = self.new_req(implicit, cmd.len);
        cmd.client_req = req;
        if implicit {
            cmd.flags |= CMD_IMPLICIT;
            let put = matches!(
                cmd.kind,
                CommandKind::PutInline | CommandKind::PutFrom | CommandKind::PutV
            );
            if put && !self.lazy_hosts.contains(&cmd.host) {
                self.lazy_hosts.push(cmd.host);
            }
        }
        self.outstanding += 1;
        self.client.submit(&cmd, inline)?;
        Ok(req)
    }

    /// Submits `cmd` as a noted request: its completion comes back through
    /// [`Endpoint::take_noted`] with `note` (at most 2^29 − 1) rather than to a waiter.
    pub fn post_noted(
        &mut self,
        mut cmd: Command,
        inline: &[u8],
        note: u32,
    ) -> Result<(), NicError> {
        while self.outstanding >= self.client.cq_capacity() {
            self.wait_one()?;
        }
        let seq = self.next_req & 0xffff_ffff;
        self.next_req += 1;
        cmd.client_req = NOTED | (note as u64 & NOTE_MASK) << 32 | seq;
        self.outstanding += 1;
        self.client.submit(&cmd, inline)?;
        Ok(())
    }

    /// Completions of noted requests since the last call, in completion order.
    pub fn take_noted(&mut self) -> std::vec::Drain<'_, (u32, u32, u64)> {
        self.progress();
        self.noted.drain(..)
    }

    /// Waits until some completion arrives (then handled as usual).
    pub fn wait_any(&mut self) -> Result<(), NicError> {
        self.wait_one()
    }

    /// Waits for `req`; its value, or the error its status names.
    pub fn finish(&mut self, req: u64) -> Result<u64, NicError> {
        let (s, v) = self.finish_raw(req)?;
        let s = Status::from_u32(s);
        if s.is_ok() {
            Ok(v)
        } else {
            Err(self.error_of(s, v))
        }
    }

    /// The error for a failed completion: a peer failure names host, operation and wait.
    fn error_of(&self, s: Status, value: u64) -> NicError {
        if s != Status::PeerDead {
            return NicError::Remote(s);
        }
        let f = PeerFailure::unpack(value);
        let name = self
            .job
            .config
            .as_deref()
            .and_then(|p| crate::config::Config::load(p).ok())
            .and_then(|c| c.hosts.get(f.host as usize).map(|h| h.name.clone()));
        NicError::PeerFailed {
            host: f.host,
            name,
            op: f.op,
            waited_ms: f.waited_ms,
        }
    }

    /// Waits for `req` and returns its raw status and value.
    pub fn finish_raw(&mut self, req: u64) -> Result<(u32, u64), NicError> {
        loop {
            match self.explicit.get(&req) {
                Some(Slot::Done(s, v)) => {
                    let r = (*s, *v);
                    self.explicit.remove(&req);
                    return Ok(r);
                }
                Some(&Slot::Pending(bytes)) => self.wait_one_for(bytes)?,
                None => return Err(NicError::BadSyncId(req)),
            }
        }
    }

    /// Whether explicit request `req` has completed (successfully or not), from the
    /// completions already processed.
    pub fn is_done(&self, req: u64) -> bool {
        matches!(self.explicit.get(&req), Some(Slot::Done(..)))
    }

    /// `Some(value)` once `req` completed (successfully), `None` while pending.
    pub fn test(&mut self, req: u64) -> Result<Option<u64>, NicError> {
        self.progress();
        match self.explicit.get(&req) {
            Some(Slot::Pending(_)) => Ok(None),
            Some(Slot::Done(..)) => self.finish(req).map(Some),
            None => Err(NicError::BadSyncId(req)),
        }
    }

    /// Posts a command and waits for its completion; returns the raw status and value (for
    /// APIs whose calls return codes of their own, such as Portals).
    pub fn call_raw(&mut self, cmd: Command, inline: &[u8]) -> Result<(u32, u64), NicError> {
        let req = self.post(cmd, inline, false)?;
        self.finish_raw(req)
    }

    /// Posts a command that completes no entry (`client_req` 0): one-way, no credit held.
    pub fn post_oneway(&mut self, mut cmd: Command, inline: &[u8]) -> Result<(), NicError> {
        cmd.client_req = 0;
        self.client.submit(&cmd, inline)?;
        Ok(())
    }

    /// Waits for every implicit (nbi) operation; reports the first failure among them.
    ///
    /// Implicit puts are acknowledged lazily (the target waits a little to piggyback the ack
    /// on other traffic); a waiting gsync sends each host it put to an eager empty put, whose
    /// prompt acknowledgement carries the lazy ones along (one transport, in order).
    pub fn gsync_wait(&mut self) -> Result<(), NicError> {
        if self.implicit > 0 {
            self.progress();
        }
        if self.implicit > 0 {
            self.hurry_lazy_acks()?;
        }
        self.lazy_hosts.clear();
        while self.implicit > 0 {
            self.wait_one()?;
        }
        match self.implicit_error.take() {
            Some((s, v)) => Err(self.error_of(s, v)),
            None => Ok(()),
        }
    }

    /// Posts an empty eager put to the system region of a rank on every host implicit puts
    /// went to, not waiting for them (their completions are simply consumed).
    fn hurry_lazy_acks(&mut self) -> Result<(), NicError> {
        let hosts = std::mem::take(&mut self.lazy_hosts);
        for host in hosts {
            let Some(rank) = self.job.rank_hosts.iter().position(|h| *h == host) else {
                continue;
            };
            let cmd = Command {
                kind: CommandKind::PutInline,
                host,
                rank: rank as u32,
                remote_region: self.sys.handle.0,
                remote_off: 0,
                len: 0,
                ..Default::default()
            };
            // One-way: no completion entry, no credit held.
            self.post_oneway(cmd, &[])?;
        }
        Ok(())
    }

    pub fn gsync_test(&mut self) -> Result<bool, NicError> {
        self.progress();
        if self.implicit > 0 {
            return Ok(false);
        }
        self.gsync_wait().map(|_| true)
    }

    // ------------------------------------------------------------ barrier

    /// Completes this rank's implicit operations, then a dissemination barrier over the NIC:
    /// in round k each rank puts the barrier epoch into rank+2^k's flag k and waits for its own.
    pub fn barrier(&mut self) -> Result<(), NicError> {
        self.barrier_inner(false)
    }

    /// `wire_up`: peers may not be attached yet, so retry puts they refuse for that reason;
    /// and a peer's daemon may have restarted just before (its new incarnation was noticed by
    /// failing what went to the old one, this put among them). The flag put is idempotent, so
    /// it is simply sent again, to the new incarnation.
    fn barrier_inner(&mut self, wire_up: bool) -> Result<(), NicError> {
        self.gsync_wait()?;
        self.barrier_epoch += 1;
        let (n, me, epoch) = (self.job.size, self.job.rank, self.barrier_epoch);
        let mut k = 0;
        while (1u32 << k) < n {
            let partner = (me + (1 << k)) % n;
            let cmd = Command {
                kind: CommandKind::PutInline,
                host: self.rank_host(partner)?,
                rank: partner,
                remote_region: self.sys.handle.0,
                remote_off: (k * 8) as u64,
                len: 8,
                ..Default::default()
            };
            let flag = epoch.to_le_bytes();
            if wire_up {
                let t = std::time::Instant::now();
                loop {
                    let req = self.post(cmd, &flag, false)?;
                    match self.finish(req) {
                        Err(
                            NicError::Remote(Status::NoSuchEndpoint | Status::NoSuchRegion)
                            | NicError::PeerFailed { .. },
                        ) if t.elapsed() < std::time::Duration::from_secs(30) => {
                            std::thread::sleep(std::time::Duration::from_millis(1))
                        }
                        r => break r.map(|_| ())?,
                    };
                }
            } else {
                self.post(cmd, &flag, true)?;
            }
            let sys = self.sys.clone();
            let w = self.client.waiter();
            wait_until(&w, || sys.read_u64(k * 8) >= epoch, || self.progress());
            k += 1;
            assert!(k < BARRIER_WORDS);
        }
        self.gsync_wait()
    }
}

fn register_with(client: &Client, len: usize, perms: Perms) -> Result<MemRegion, NicError> {
    let map = Arc::new(Mapping::create("softnic-region", len)?);
    let h = client.register(&map, perms)?;
    Ok(MemRegion::new(MemHandle(h), map, len))
}

/// Polls spent spinning before a waiter starts yielding its core (here and in Portals' waits).
/// Kept short: on a small machine the ranks and the daemon outnumber the cores, and a
/// spinning waiter holds the core the daemon (or the peer rank) needs to make the progress
/// it waits for — measured, MPI send/recv 8 B half round trip on 2 cores, 2 ranks and the
/// daemon: 256 spins 16.8–27.4 µs, 64 6.9–9.7, 16 6.5–8.2, 4 5.5–5.7.
pub(crate) const SPIN_BEFORE_YIELD: u32 = 4;

/// After this long a waiter stops yielding and naps, leaving the cores to those at work.
const YIELD_FOR: std::time::Duration = std::time::Duration::from_millis(1);

/// Waits for `cond` the adaptive way (spin, then yield through `waiter`, then nap), calling
/// `between` now and then.
pub fn wait_until(
    waiter: &crate::shm::control::Waiter,
    mut cond: impl FnMut() -> bool,
    mut between: impl FnMut(),
) {
    let mut spins = 0u64;
    let mut since: Option<std::time::Instant> = None;
    while !cond() {
        spins += 1;
        if spins.is_multiple_of(16) {
            between();
        }
        if spins < u64::from(SPIN_BEFORE_YIELD) || waiter.keep_core() {
            std::hint::spin_loop();
        } else if since.get_or_insert_with(std::time::Instant::now).elapsed() < YIELD_FOR {
            waiter.yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}
