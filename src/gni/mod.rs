//! The Gemini-level API, after Cray's uGNI/DMAPP completion styles: registered memory,
//! put/get and the ten 64-bit AMOs, each blocking, non-blocking with a sync id
//! (`*_nb` + [`Nic::sync_wait`]/[`Nic::sync_test`]), or non-blocking implicit
//! (`*_nbi` + [`Nic::gsync_wait`]/[`Nic::gsync_test`]).
//!
//! Payloads up to the FMA threshold (default 4 KiB, `SOFTNIC_FMA_THRESHOLD`) travel inline in
//! the command descriptor; larger ones are streamed by the daemon straight from registered
//! memory (BTE). A buffer outside registered memory is staged through a bounce region.
//! Region handles count up from 0 in registration order on every rank; handle 0 is the
//! library's own, so ranks that register alike address each other's regions by the same handle.

use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::client::{Client, ClientError};
use crate::job::{JobError, JobInfo};
use crate::nic::memory::Perms;
use crate::shm::{Command, CommandKind, FailedOp, Mapping, PeerFailure, CMD_IMPLICIT};
use crate::wire::{AmoOp, Status};

pub use crate::wire::AmoOp as Amo;

#[derive(Debug, thiserror::Error)]
pub enum GniError {
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

/// A region's handle; the same on every rank that registered in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemHandle(pub u32);

/// A remote address: rank, region handle, byte offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote {
    pub rank: u32,
    pub handle: MemHandle,
    pub offset: u64,
}

/// Registered memory, shared with the daemon (and through it with the job).
#[derive(Clone)]
pub struct MemRegion {
    pub handle: MemHandle,
    map: Arc<Mapping>,
    len: usize,
}

impl MemRegion {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }
    /// The region's bytes. Remote puts and AMOs may change them at any time (that is the
    /// point); synchronise through flags or atomics as with any NIC memory.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes(&self) -> &mut [u8] {
        // SAFETY: the mapping lives as long as self; concurrent remote writes are the contract.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr(), self.len) }
    }
    /// The 8-byte word at `off` (8-aligned), for atomics coherent with the NIC's AMOs.
    pub fn word(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "word offset {off} unaligned or out of range"
        );
        // SAFETY: aligned, in bounds, mapped while self lives.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) }
    }
    /// Reads the u64 at `off` (volatile: it may be changed by remote puts).
    pub fn read_u64(&self, off: usize) -> u64 {
        self.word(off).load(Ordering::Acquire)
    }
    /// This region as the NIC's memory model sees it (for rings shared with the NIC).
    pub fn nic_region(&self) -> crate::nic::memory::Region {
        crate::nic::memory::Region::new(self.map.clone(), Perms::READ_WRITE)
    }

    fn contains(&self, p: *const u8, len: usize) -> Option<u64> {
        let base = self.map.as_ptr() as usize;
        let a = p as usize;
        (a >= base && a + len <= base + self.len).then(|| (a - base) as u64)
    }
}

/// A non-blocking operation's sync id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SyncId(u64);

enum Slot {
    Pending,
    /// The raw completion status (a Gemini `Status`, or a Portals return code) and value.
    Done(u32, u64),
}

const SYS_LEN: usize = 4096;
const BOUNCE_LEN: usize = 4 << 20;
const BARRIER_WORDS: usize = 64;

/// The NIC as one rank uses it.
pub struct Nic {
    client: Client,
    job: JobInfo,
    fma_threshold: usize,
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
    scatter_buf: Vec<u8>,
}

/// Request ids with this bit set are implicit (nbi) operations.
const IMPLICIT: u64 = 1 << 63;

impl Nic {
    /// Attaches to this rank's daemon as the launcher described it in the environment.
    pub fn init() -> Result<Nic, GniError> {
        Self::attach(JobInfo::from_env()?)
    }

    pub fn attach(job: JobInfo) -> Result<Nic, GniError> {
        let client = Client::attach(&job.daemon, job.job_id, job.job_key, job.rank, job.size)?;
        let fma_threshold = std::env::var("SOFTNIC_FMA_THRESHOLD")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4096usize)
            .min(client.max_inline());
        let sys = Self::register_with(&client, SYS_LEN, Perms::READ_WRITE)?;
        let bounce = Self::register_with(&client, BOUNCE_LEN, Perms(0))?;
        let mut nic = Nic {
            client,
            job,
            fma_threshold,
            next_req: 1,
            explicit: HashMap::with_capacity_and_hasher(256, Default::default()),
            implicit: 0,
            implicit_error: None,
            outstanding: 0,
            regions: Vec::new(),
            sys,
            bounce,
            barrier_epoch: 0,
            scatter_buf: Vec::new(),
        };
        // Collective wire-up: once it returns, every rank is attached with its library regions.
        nic.barrier_inner(true)?;
        Ok(nic)
    }

    fn register_with(client: &Client, len: usize, perms: Perms) -> Result<MemRegion, GniError> {
        let map = Arc::new(Mapping::create("softnic-region", len)?);
        let h = client.register(&map, perms)?;
        Ok(MemRegion {
            handle: MemHandle(h),
            map,
            len,
        })
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

    /// Sets the FMA/BTE switch-over size for this process.
    pub fn set_fma_threshold(&mut self, bytes: usize) {
        self.fma_threshold = bytes.min(self.client.max_inline());
    }

    /// Registers `len` bytes of fresh zeroed memory with remote permissions `perms`.
    pub fn mem_register(&mut self, len: usize, perms: Perms) -> Result<MemRegion, GniError> {
        let r = Self::register_with(&self.client, len, perms)?;
        self.regions.push(r.clone());
        Ok(r)
    }

    pub fn mem_deregister(&mut self, r: &MemRegion) -> Result<(), GniError> {
        self.client.deregister(r.handle.0)?;
        self.regions.retain(|x| x.handle != r.handle);
        Ok(())
    }

    fn host_of(&self, rank: u32) -> Result<u16, GniError> {
        self.job
            .rank_hosts
            .get(rank as usize)
            .copied()
            .ok_or(GniError::NoSuchRank(rank, self.job.size))
    }

    /// Finds a registered region holding `[p, p+len)`.
    fn registered(&self, p: *const u8, len: usize) -> Option<(u32, u64)> {
        self.regions
            .iter()
            .find_map(|r| r.contains(p, len).map(|off| (r.handle.0, off)))
    }

    // ------------------------------------------------------------ completion plumbing

    fn new_req(&mut self, implicit: bool) -> u64 {
        let r = self.next_req;
        self.next_req += 1;
        if implicit {
            self.implicit += 1;
            r | IMPLICIT
        } else {
            self.explicit.insert(r, Slot::Pending);
            r
        }
    }

    fn on_completion(&mut self, req: u64, status: u32, value: u64) {
        self.outstanding -= 1;
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

    fn wait_one(&mut self) -> Result<(), GniError> {
        let e = self.client.wait()?;
        self.on_completion(e.client_req, e.status, e.value);
        Ok(())
    }

    fn post(&mut self, mut cmd: Command, inline: &[u8], implicit: bool) -> Result<u64, GniError> {
        // Credits: never more operations in flight than completion-queue entries.
        while self.outstanding >= self.client.cq_capacity() {
            self.wait_one()?;
        }
        let req = self.new_req(implicit);
        cmd.client_req = req;
        if implicit {
            cmd.flags |= CMD_IMPLICIT;
        }
        self.outstanding += 1;
        self.client.submit(&cmd, inline)?;
        Ok(req)
    }

    fn finish(&mut self, req: u64) -> Result<u64, GniError> {
        let (s, v) = self.finish_raw(req)?;
        let s = Status::from_u32(s);
        if s.is_ok() {
            Ok(v)
        } else {
            Err(self.error_of(s, v))
        }
    }

    /// The error for a failed completion: a peer failure names host, operation and wait.
    fn error_of(&self, s: Status, value: u64) -> GniError {
        if s != Status::PeerDead {
            return GniError::Remote(s);
        }
        let f = PeerFailure::unpack(value);
        let name = self
            .job
            .config
            .as_deref()
            .and_then(|p| crate::config::Config::load(p).ok())
            .and_then(|c| c.hosts.get(f.host as usize).map(|h| h.name.clone()));
        GniError::PeerFailed {
            host: f.host,
            name,
            op: f.op,
            waited_ms: f.waited_ms,
        }
    }

    /// Waits for `req` and returns its raw status and value.
    fn finish_raw(&mut self, req: u64) -> Result<(u32, u64), GniError> {
        loop {
            match self.explicit.get(&req) {
                Some(Slot::Done(s, v)) => {
                    let r = (*s, *v);
                    self.explicit.remove(&req);
                    return Ok(r);
                }
                Some(Slot::Pending) => self.wait_one()?,
                None => return Err(GniError::BadSyncId(req)),
            }
        }
    }

    /// Posts a command and waits for its completion; returns the raw status and value (for
    /// APIs whose calls return codes of their own, such as Portals).
    pub fn call_raw(&mut self, cmd: Command, inline: &[u8]) -> Result<(u32, u64), GniError> {
        let req = self.post(cmd, inline, false)?;
        self.finish_raw(req)
    }

    /// Posts a command that completes no entry (`client_req` 0): one-way, no credit held.
    pub fn post_oneway(&mut self, mut cmd: Command, inline: &[u8]) -> Result<(), GniError> {
        cmd.client_req = 0;
        self.client.submit(&cmd, inline)?;
        Ok(())
    }

    /// The host index rank `rank` lives on.
    pub fn rank_host(&self, rank: u32) -> Result<u16, GniError> {
        self.host_of(rank)
    }

    /// Waits for a non-blocking operation; returns the fetched value of a fetching AMO (else 0).
    pub fn sync_wait(&mut self, id: SyncId) -> Result<u64, GniError> {
        self.finish(id.0)
    }

    /// `Some(value)` once the operation completed (successfully), `None` while pending.
    pub fn sync_test(&mut self, id: SyncId) -> Result<Option<u64>, GniError> {
        self.progress();
        match self.explicit.get(&id.0) {
            Some(Slot::Pending) => Ok(None),
            Some(Slot::Done(..)) => self.finish(id.0).map(Some),
            None => Err(GniError::BadSyncId(id.0)),
        }
    }

    /// Waits for every implicit (nbi) operation; reports the first failure among them.
    pub fn gsync_wait(&mut self) -> Result<(), GniError> {
        while self.implicit > 0 {
            self.wait_one()?;
        }
        match self.implicit_error.take() {
            Some((s, v)) => Err(self.error_of(s, v)),
            None => Ok(()),
        }
    }

    pub fn gsync_test(&mut self) -> Result<bool, GniError> {
        self.progress();
        if self.implicit > 0 {
            return Ok(false);
        }
        self.gsync_wait().map(|_| true)
    }

    // ------------------------------------------------------------ put

    fn cmd(&self, kind: CommandKind, dst: Remote, len: usize) -> Result<Command, GniError> {
        Ok(Command {
            kind,
            host: self.host_of(dst.rank)?,
            rank: dst.rank,
            remote_region: dst.handle.0,
            remote_off: dst.offset,
            len: len as u64,
            ..Default::default()
        })
    }

    /// Posts a put of `src` to `dst`; `None` when it had to complete synchronously.
    fn post_put(
        &mut self,
        dst: Remote,
        src: &[u8],
        implicit: bool,
    ) -> Result<Option<u64>, GniError> {
        if src.len() <= self.fma_threshold {
            let c = self.cmd(CommandKind::PutInline, dst, src.len())?;
            return self.post(c, src, implicit).map(Some);
        }
        if let Some((region, off)) = self.registered(src.as_ptr(), src.len()) {
            let mut c = self.cmd(CommandKind::PutFrom, dst, src.len())?;
            c.local_region = region;
            c.local_off = off;
            return self.post(c, &[], implicit).map(Some);
        }
        // Outside registered memory: stage through the bounce region, chunk by chunk.
        let mut done = 0;
        while done < src.len() {
            let n = (src.len() - done).min(BOUNCE_LEN);
            self.bounce.bytes()[..n].copy_from_slice(&src[done..done + n]);
            let mut c = self.cmd(
                CommandKind::PutFrom,
                Remote {
                    offset: dst.offset + done as u64,
                    ..dst
                },
                n,
            )?;
            c.local_region = self.bounce.handle.0;
            let req = self.post(c, &[], false)?;
            self.finish(req)?;
            done += n;
        }
        Ok(None)
    }

    /// Blocking put: returns once the data is in the target's memory.
    pub fn put(&mut self, dst: Remote, src: &[u8]) -> Result<(), GniError> {
        match self.post_put(dst, src, false)? {
            Some(req) => self.finish(req).map(|_| ()),
            None => Ok(()),
        }
    }

    /// Non-blocking put. `src` may be reused at once when it is at most the FMA threshold or
    /// outside registered memory; a registered source must stay unchanged until the sync.
    pub fn put_nb(&mut self, dst: Remote, src: &[u8]) -> Result<SyncId, GniError> {
        match self.post_put(dst, src, false)? {
            Some(req) => Ok(SyncId(req)),
            None => {
                let req = self.new_req(false);
                self.explicit.insert(req, Slot::Done(Status::Ok as u32, 0));
                Ok(SyncId(req))
            }
        }
    }

    /// Non-blocking implicit put, completed by [`Nic::gsync_wait`].
    pub fn put_nbi(&mut self, dst: Remote, src: &[u8]) -> Result<(), GniError> {
        self.post_put(dst, src, true).map(|_| ())
    }

    // ------------------------------------------------------------ get

    fn post_get(
        &mut self,
        local: &MemRegion,
        local_off: u64,
        src: Remote,
        len: usize,
        implicit: bool,
    ) -> Result<u64, GniError> {
        if local_off
            .checked_add(len as u64)
            .is_none_or(|e| e > local.len as u64)
        {
            return Err(GniError::LocalBounds {
                off: local_off,
                len: len as u64,
                region_len: local.len,
            });
        }
        let mut c = self.cmd(CommandKind::Get, src, len)?;
        c.local_region = local.handle.0;
        c.local_off = local_off;
        self.post(c, &[], implicit)
    }

    /// Blocking get into any buffer (staged through the bounce region when not registered).
    pub fn get(&mut self, dst: &mut [u8], src: Remote) -> Result<(), GniError> {
        if let Some((region, off)) = self.registered(dst.as_ptr(), dst.len()) {
            let r = self
                .regions
                .iter()
                .find(|r| r.handle.0 == region)
                .cloned()
                .expect("found above");
            let req = self.post_get(&r, off, src, dst.len(), false)?;
            return self.finish(req).map(|_| ());
        }
        let bounce = self.bounce.clone();
        let mut done = 0;
        while done < dst.len() || (dst.is_empty() && done == 0) {
            let n = (dst.len() - done).min(BOUNCE_LEN);
            let req = self.post_get(
                &bounce,
                0,
                Remote {
                    offset: src.offset + done as u64,
                    ..src
                },
                n,
                false,
            )?;
            self.finish(req)?;
            dst[done..done + n].copy_from_slice(&bounce.bytes()[..n]);
            done += n;
            if n == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Non-blocking get into registered memory.
    pub fn get_nb(
        &mut self,
        local: &MemRegion,
        local_off: u64,
        src: Remote,
        len: usize,
    ) -> Result<SyncId, GniError> {
        self.post_get(local, local_off, src, len, false).map(SyncId)
    }

    /// Non-blocking implicit get into registered memory.
    pub fn get_nbi(
        &mut self,
        local: &MemRegion,
        local_off: u64,
        src: Remote,
        len: usize,
    ) -> Result<(), GniError> {
        self.post_get(local, local_off, src, len, true).map(|_| ())
    }

    // ------------------------------------------------------------ AMOs

    fn amo_cmd(
        &self,
        op: AmoOp,
        dst: Remote,
        operand: u64,
        operand2: u64,
    ) -> Result<Command, GniError> {
        let mut c = self.cmd(CommandKind::Amo, dst, 8)?;
        c.amo = Some(op);
        c.operand = operand;
        c.operand2 = operand2;
        Ok(c)
    }

    /// Blocking AMO; returns the previous value for fetching AMOs (0 otherwise).
    /// `operand2` is AFAX's xor mask and ACSWAP's comperand.
    pub fn amo(
        &mut self,
        op: AmoOp,
        dst: Remote,
        operand: u64,
        operand2: u64,
    ) -> Result<u64, GniError> {
        let c = self.amo_cmd(op, dst, operand, operand2)?;
        let req = self.post(c, &[], false)?;
        self.finish(req)
    }

    pub fn amo_nb(
        &mut self,
        op: AmoOp,
        dst: Remote,
        operand: u64,
        operand2: u64,
    ) -> Result<SyncId, GniError> {
        let c = self.amo_cmd(op, dst, operand, operand2)?;
        self.post(c, &[], false).map(SyncId)
    }

    /// Non-blocking implicit AMO (its fetched value, if any, is discarded).
    pub fn amo_nbi(
        &mut self,
        op: AmoOp,
        dst: Remote,
        operand: u64,
        operand2: u64,
    ) -> Result<(), GniError> {
        let c = self.amo_cmd(op, dst, operand, operand2)?;
        self.post(c, &[], true).map(|_| ())
    }

    /// Non-blocking implicit vector of non-fetching AMOs (AADD AAND AOR AXOR) on one rank's
    /// region: `updates` are `(byte offset, operand)` pairs, applied by the target NIC with
    /// CPU atomics. One command and one completion for the whole vector: the aggregation that
    /// bucketed RandomAccess and similar irregular update codes need. Failures surface at
    /// [`Nic::gsync_wait`].
    pub fn amo_scatter_nbi(
        &mut self,
        op: AmoOp,
        rank: u32,
        handle: MemHandle,
        updates: &[(u64, u64)],
    ) -> Result<(), GniError> {
        if op.is_fetching() {
            return Err(GniError::Remote(Status::BadRequest));
        }
        let per = (self.client.max_inline() / 16).max(1);
        let mut buf = std::mem::take(&mut self.scatter_buf);
        for chunk in updates.chunks(per) {
            buf.clear();
            for &(off, v) in chunk {
                buf.extend_from_slice(&off.to_le_bytes());
                buf.extend_from_slice(&v.to_le_bytes());
            }
            let mut c = self.cmd(
                CommandKind::AmoScatter,
                Remote {
                    rank,
                    handle,
                    offset: 0,
                },
                buf.len(),
            )?;
            c.amo = Some(op);
            let r = self.post(c, &buf, true);
            if let Err(e) = r {
                self.scatter_buf = buf;
                return Err(e);
            }
        }
        self.scatter_buf = buf;
        Ok(())
    }

    pub fn afadd(&mut self, dst: Remote, v: u64) -> Result<u64, GniError> {
        self.amo(AmoOp::Afadd, dst, v, 0)
    }

    /// Compare-and-swap: if the word equals `compare`, store `swap`; returns the old value.
    pub fn acswap(&mut self, dst: Remote, swap: u64, compare: u64) -> Result<u64, GniError> {
        self.amo(AmoOp::Acswap, dst, swap, compare)
    }

    // ------------------------------------------------------------ barrier

    /// Completes this rank's implicit operations, then a dissemination barrier over the NIC:
    /// in round k each rank puts the barrier epoch into rank+2^k's flag k and waits for its own.
    pub fn barrier(&mut self) -> Result<(), GniError> {
        self.barrier_inner(false)
    }

    /// `wire_up`: peers may not be attached yet, so retry puts they refuse for that reason.
    fn barrier_inner(&mut self, wire_up: bool) -> Result<(), GniError> {
        self.gsync_wait()?;
        self.barrier_epoch += 1;
        let (n, me, epoch) = (self.job.size, self.job.rank, self.barrier_epoch);
        let mut k = 0;
        while (1u32 << k) < n {
            let partner = (me + (1 << k)) % n;
            let dst = Remote {
                rank: partner,
                handle: self.sys.handle,
                offset: (k * 8) as u64,
            };
            if wire_up {
                let t = std::time::Instant::now();
                loop {
                    match self.put(dst, &epoch.to_le_bytes()) {
                        Err(GniError::Remote(Status::NoSuchEndpoint | Status::NoSuchRegion))
                            if t.elapsed() < std::time::Duration::from_secs(30) =>
                        {
                            std::thread::sleep(std::time::Duration::from_millis(1))
                        }
                        r => break r?,
                    }
                }
            } else {
                self.put_nbi(dst, &epoch.to_le_bytes())?;
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

/// Polls spent spinning before a waiter starts yielding its core. Kept short: on a small
/// machine the ranks and the daemon outnumber the cores, and a spinning waiter would hold the
/// core the daemon (or the peer rank) needs to make the progress it waits for.
const SPIN_BEFORE_YIELD: u64 = 64;

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
        if spins < SPIN_BEFORE_YIELD {
            std::hint::spin_loop();
        } else if since.get_or_insert_with(std::time::Instant::now).elapsed() < YIELD_FOR {
            waiter.yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}
