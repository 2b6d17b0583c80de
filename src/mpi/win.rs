//! MPI-3 one-sided communication on Portals (seed 003 §3.2). A window dups its communicator
//! (its context id names the window) and is two match entries on the RMA portal: the window's
//! memory (match bits `2 * id`) and its control words (`2 * id + 1`: lock word, post and
//! complete counters). Operations go from a staging region through an MD that counts ACKs and
//! REPLYs into one counting event; each operation bumps a counter, so what is outstanding is
//! the counter minus the CT, and every flush waits for the CT to reach the counter.
//!
//! Locks follow the seed: a 64-bit lock word, the low half counting shared holders, the high
//! half exclusive. Shared: fetch-add 1, and a result ≥ 2^32 means an exclusive holder: add −1
//! and retry. Exclusive: CSWAP 0 → 2^32, retry. Unlock: add −1, or an MSWAP clearing bit 32.

use std::time::{Duration, Instant};

use crate::client::MemRegion;
use crate::nic::memory::Perms;
use crate::portals::{
    md_opt, me_opt, AckReq, AtomicOp, Buffer, Datatype, List, Md, Me, ProcessId, Target,
};

use super::coll::{bytes, bytes_mut, Op, Type};
use super::comm::Comm;
use super::error::{err, ErrorClass, MpiError};
use super::state::{State, RMA_PT};

const LOCK: u64 = 0;
const POST: u64 = 8;
const COMPLETE: u64 = 16;
const CTRL_LEN: usize = 64;
const EXCL: u64 = 1 << 32;
/// Staging for origin buffers and fetched results.
const STAGING: usize = 4 << 20;

/// Lock types (MPI_LOCK_SHARED, MPI_LOCK_EXCLUSIVE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockType {
    Shared,
    Exclusive,
}

/// Assertions (MPI_MODE_*), as bits.
pub mod mode {
    pub const NOCHECK: u32 = 1;
}

/// What access to each target is allowed now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    None,
    Lock(LockType),
    /// lock_all's shared lock (or NOCHECK).
    All,
}

/// An RMA window (MPI_Win) over memory it allocated (MPI_Win_allocate).
pub struct Win {
    comm: Comm,
    mem: MemRegion,
    ctrl: MemRegion,
    staging: MemRegion,
    staged: usize,
    sizes: Vec<u64>,
    ct: u32,
    md: u32,
    me: [u32; 2],
    issued: u64,
    fence: bool,
    access: Vec<Access>,
    lock_all: Option<bool>,
    /// PSCW: the access group (started) and exposure group (posted), with the counts seen.
    started: Option<Vec<u32>>,
    posted: Option<Vec<u32>>,
    posts_seen: u64,
    completes_seen: u64,
    freed: bool,
}

impl Win {
    /// MPI_Win_allocate: `size` bytes at every member (sizes may differ), zeroed. Collective.
    pub fn allocate(comm: &Comm, size: usize) -> Result<Win, MpiError> {
        let comm = comm.dup()?;
        let id = comm.context_id();
        let (mem, ctrl, staging, ct, md, me) = {
            let mut st = comm.st.borrow_mut();
            let st = &mut *st;
            let ni = st.ni;
            let mem =
                st.p.endpoint()
                    .mem_register(size.max(8), Perms::READ_WRITE)?;
            let ctrl = st.p.endpoint().mem_register(CTRL_LEN, Perms::READ_WRITE)?;
            let staging = st.p.endpoint().mem_register(STAGING, Perms(0))?;
            let ct = st.p.ct_alloc(ni)?;
            let md = st.p.md_bind(
                ni,
                &Md {
                    region: staging.handle,
                    segments: vec![(0, STAGING as u64)],
                    options: md_opt::EVENT_CT_ACK
                        | md_opt::EVENT_CT_REPLY
                        | md_opt::EVENT_SUCCESS_DISABLE
                        | md_opt::EVENT_SEND_DISABLE,
                    eq: None,
                    ct: Some(ct),
                },
            )?;
            let entry = |region: &MemRegion, len: usize, bits: u64| {
                let mut e = Me::new(
                    Buffer {
                        region: region.handle,
                        offset: 0,
                        len: len as u64,
                    },
                    bits,
                );
                e.options = me_opt::OP_PUT
                    | me_opt::OP_GET
                    | me_opt::EVENT_COMM_DISABLE
                    | me_opt::EVENT_LINK_DISABLE;
                e
            };
            let a = st.p.me_append(
                ni,
                RMA_PT,
                &entry(&mem, size, 2 * id as u64),
                List::Priority,
                0,
            )?;
            let b = st.p.me_append(
                ni,
                RMA_PT,
                &entry(&ctrl, CTRL_LEN, 2 * id as u64 + 1),
                List::Priority,
                0,
            )?;
            (mem, ctrl, staging, ct, md, [a, b])
        };
        let n = comm.size() as usize;
        let mut sizes = vec![0u64; n];
        comm.allgather(&[size as u64], &mut sizes)?;
        // Every member's entries exist before anyone leaves (the seed's barrier).
        comm.barrier()?;
        Ok(Win {
            comm,
            mem,
            ctrl,
            staging,
            staged: 0,
            sizes,
            ct,
            md,
            me,
            issued: 0,
            fence: false,
            access: vec![Access::None; n],
            lock_all: None,
            started: None,
            posted: None,
            posts_seen: 0,
            completes_seen: 0,
            freed: false,
        })
    }

    /// This rank's window memory (MPI_Win_shared_query of itself). Remote operations change
    /// it at any time within the epochs the program's synchronisation allows.
    #[allow(clippy::mut_from_ref)]
    pub fn local(&self) -> &mut [u8] {
        &mut self.mem.bytes()[..self.sizes[self.comm.rank() as usize] as usize]
    }

    /// The window's communicator (a dup of the one it was created over).
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    fn id(&self) -> u64 {
        self.comm.context_id() as u64
    }

    fn target(&self, rank: u32, ctrl: bool, off: u64) -> Target {
        Target {
            id: ProcessId::Logical {
                rank: self.comm.group[rank as usize],
            },
            pt_index: RMA_PT,
            match_bits: 2 * self.id() + ctrl as u64,
            remote_offset: off,
        }
    }

    /// Checks an access of `len` bytes at `disp` of `rank`'s window within an epoch.
    fn check(&self, rank: u32, disp: u64, len: u64) -> Result<(), MpiError> {
        if self.freed {
            return err(ErrorClass::Win, "the window was freed");
        }
        if rank >= self.comm.size() {
            return err(
                ErrorClass::Rank,
                format!(
                    "rank {rank} is not in this window's group of {}",
                    self.comm.size()
                ),
            );
        }
        let open = self.fence
            || self.access[rank as usize] != Access::None
            || self.started.as_ref().is_some_and(|g| g.contains(&rank));
        if !open {
            return err(
                ErrorClass::RmaSync,
                format!("no access epoch to rank {rank}: fence, lock, lock_all or start first"),
            );
        }
        if disp
            .checked_add(len)
            .is_none_or(|e| e > self.sizes[rank as usize])
        {
            return err(
                ErrorClass::RmaRange,
                format!(
                    "[{disp}, +{len}) lies outside rank {rank}'s window of {} bytes",
                    self.sizes[rank as usize]
                ),
            );
        }
        Ok(())
    }

    /// Room for `len` bytes in the staging region (waiting for earlier operations to finish
    /// when it is spent).
    fn stage(&mut self, len: usize) -> Result<u64, MpiError> {
        let len8 = len.next_multiple_of(8);
        if self.staged + len8 > STAGING {
            self.flush_all()?;
            self.staged = 0;
        }
        let at = self.staged;
        self.staged += len8;
        Ok(at as u64)
    }

    fn with_st<R>(&self, f: impl FnOnce(&mut State) -> Result<R, MpiError>) -> Result<R, MpiError> {
        let mut st = self.comm.st.borrow_mut();
        f(&mut st)
    }

    /// MPI_Put: `origin` to `disp` bytes into `rank`'s window (copied: reusable at once).
    pub fn put(&mut self, origin: &[u8], rank: u32, disp: u64) -> Result<(), MpiError> {
        self.check(rank, disp, origin.len() as u64)?;
        for (i, chunk) in origin.chunks(STAGING / 2).enumerate() {
            let at = self.stage(chunk.len())?;
            self.staging.bytes()[at as usize..at as usize + chunk.len()].copy_from_slice(chunk);
            let t = self.target(rank, false, disp + (i * STAGING / 2) as u64);
            let md = self.md;
            self.with_st(|st| {
                st.p.put(st.ni, md, at, chunk.len() as u64, AckReq::CtAck, t, 0, 0)?;
                Ok(())
            })?;
            self.issued += 1;
        }
        Ok(())
    }

    /// MPI_Get, completed before it returns (the result is in `origin`).
    pub fn get(&mut self, origin: &mut [u8], rank: u32, disp: u64) -> Result<(), MpiError> {
        self.check(rank, disp, origin.len() as u64)?;
        let step = STAGING / 2;
        for (i, chunk) in origin.chunks_mut(step).enumerate() {
            let at = self.stage(chunk.len())?;
            let t = self.target(rank, false, disp + (i * step) as u64);
            let md = self.md;
            self.with_st(|st| {
                st.p.get(st.ni, md, at, chunk.len() as u64, t, 0)?;
                Ok(())
            })?;
            self.issued += 1;
            self.flush_all()?;
            chunk.copy_from_slice(&self.staging.bytes()[at as usize..at as usize + chunk.len()]);
        }
        Ok(())
    }

    /// MPI_Accumulate: element-wise `op` into `rank`'s window by the target's NIC (atomic per
    /// element; REPLACE is a put).
    pub fn accumulate<T: Type>(
        &mut self,
        origin: &[T],
        rank: u32,
        disp: u64,
        op: Op,
    ) -> Result<(), MpiError> {
        if op == Op::Replace {
            return self.put(bytes(origin), rank, disp);
        }
        let a = op.atomic(T::DT)?;
        let b = bytes(origin);
        self.check(rank, disp, b.len() as u64)?;
        let w = std::mem::size_of::<T>();
        let step = (STAGING / 2) / w * w;
        for (i, chunk) in b.chunks(step).enumerate() {
            let at = self.stage(chunk.len())?;
            self.staging.bytes()[at as usize..at as usize + chunk.len()].copy_from_slice(chunk);
            let t = self.target(rank, false, disp + (i * step) as u64);
            let md = self.md;
            let n = self.with_st(|st| {
                // The library splits at max_atomic_size: one ACK per piece.
                let piece = (st.limits.max_atomic_size / w as u64 * w as u64).max(w as u64);
                st.p.atomic(
                    st.ni,
                    md,
                    at,
                    chunk.len() as u64,
                    AckReq::CtAck,
                    t,
                    0,
                    0,
                    a,
                    T::DT,
                )?;
                Ok((chunk.len() as u64).div_ceil(piece))
            })?;
            self.issued += n;
        }
        Ok(())
    }

    /// One fetching atomic of one element: the old value (waits for it).
    #[allow(clippy::too_many_arguments)]
    fn fetch_one(
        &mut self,
        rank: u32,
        ctrl: bool,
        disp: u64,
        data: &[u8],
        operand: &[u8],
        op: AtomicOp,
        dt: Datatype,
    ) -> Result<Vec<u8>, MpiError> {
        let w = data.len();
        let src = self.stage(w)?;
        let dst = self.stage(w)?;
        self.staging.bytes()[src as usize..src as usize + w].copy_from_slice(data);
        let t = self.target(rank, ctrl, disp);
        let md = self.md;
        self.with_st(|st| {
            if op.is_swap() {
                st.p.swap(st.ni, md, dst, md, src, w as u64, t, 0, 0, operand, op, dt)?;
            } else {
                st.p.fetch_atomic(st.ni, md, dst, md, src, w as u64, t, 0, 0, op, dt)?;
            }
            Ok(())
        })?;
        self.issued += 1;
        self.flush_all()?;
        Ok(self.staging.bytes()[dst as usize..dst as usize + w].to_vec())
    }

    /// MPI_Fetch_and_op: the target's old value; `op` may be REPLACE (a swap) or NO_OP.
    pub fn fetch_and_op<T: Type>(
        &mut self,
        value: T,
        rank: u32,
        disp: u64,
        op: Op,
    ) -> Result<T, MpiError> {
        let w = std::mem::size_of::<T>();
        self.check(rank, disp, w as u64)?;
        let (a, v) = match op {
            Op::Replace => (AtomicOp::Swap, value),
            // A value-preserving fetch: +0 (integers) or +(-0.0) (floats keep every value).
            Op::NoOp => (AtomicOp::Sum, neutral::<T>()),
            _ => (op.atomic(T::DT)?, value),
        };
        let old = self.fetch_one(rank, false, disp, bytes(&[v]), &[], a, T::DT)?;
        let mut out = [T::default()];
        bytes_mut(&mut out).copy_from_slice(&old);
        Ok(out[0])
    }

    /// MPI_Compare_and_swap: stores `value` if the target equals `compare`; the old value.
    pub fn compare_and_swap<T: Type>(
        &mut self,
        value: T,
        compare: T,
        rank: u32,
        disp: u64,
    ) -> Result<T, MpiError> {
        let w = std::mem::size_of::<T>();
        self.check(rank, disp, w as u64)?;
        let old = self.fetch_one(
            rank,
            false,
            disp,
            bytes(&[value]),
            bytes(&[compare]),
            AtomicOp::Cswap,
            T::DT,
        )?;
        let mut out = [T::default()];
        bytes_mut(&mut out).copy_from_slice(&old);
        Ok(out[0])
    }

    // ------------------------------------------------------------ synchronisation

    /// Waits until every operation issued so far completed at its target (CT = counter).
    fn flush_all_inner(&mut self) -> Result<(), MpiError> {
        let (ct, issued) = (self.ct, self.issued);
        let v = self.with_st(|st| Ok(st.p.ct_wait(st.ni, ct, issued)?))?;
        if v.failure > 0 {
            return err(
                ErrorClass::RmaRange,
                format!("{} one-sided operations failed at their targets", v.failure),
            );
        }
        self.staged = 0;
        Ok(())
    }

    /// MPI_Win_flush_all (remote completion of everything issued).
    pub fn flush_all(&mut self) -> Result<(), MpiError> {
        if self.freed {
            return err(ErrorClass::Win, "the window was freed");
        }
        self.flush_all_inner()
    }

    /// MPI_Win_flush: completion at `rank` (one counting event: everything completes).
    pub fn flush(&mut self, rank: u32) -> Result<(), MpiError> {
        self.check_epoch(rank)?;
        self.flush_all()
    }

    /// MPI_Win_flush_local: the origin buffers are reusable (they always are: operations are
    /// staged) and, as the seed does, remote completion too.
    pub fn flush_local(&mut self, rank: u32) -> Result<(), MpiError> {
        self.flush(rank)
    }

    fn check_epoch(&self, rank: u32) -> Result<(), MpiError> {
        if rank >= self.comm.size() {
            return err(
                ErrorClass::Rank,
                format!("rank {rank} is not in this window's group"),
            );
        }
        if self.access[rank as usize] == Access::None && !self.fence && self.started.is_none() {
            return err(
                ErrorClass::RmaSync,
                format!("no passive-target epoch to rank {rank}"),
            );
        }
        Ok(())
    }

    /// MPI_Win_fence: everything issued completes, then a barrier. Opens (or continues) an
    /// active-target epoch on every member.
    pub fn fence(&mut self) -> Result<(), MpiError> {
        if self.freed {
            return err(ErrorClass::Win, "the window was freed");
        }
        if self.access.iter().any(|a| *a != Access::None) || self.started.is_some() {
            return err(ErrorClass::RmaSync, "fence inside a lock or PSCW epoch");
        }
        self.flush_all_inner()?;
        self.comm.barrier()?;
        self.fence = true;
        Ok(())
    }

    fn ctrl_atomic(&mut self, rank: u32, off: u64, v: u64, op: AtomicOp) -> Result<u64, MpiError> {
        let old = self.fetch_one(rank, true, off, &v.to_le_bytes(), &[], op, Datatype::Uint64)?;
        Ok(u64::from_le_bytes(old.try_into().expect("8 bytes")))
    }

    fn ctrl_add(&mut self, rank: u32, off: u64, v: u64) -> Result<(), MpiError> {
        let at = self.stage(8)?;
        self.staging.bytes()[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes());
        let t = self.target(rank, true, off);
        let md = self.md;
        self.with_st(|st| {
            st.p.atomic(
                st.ni,
                md,
                at,
                8,
                AckReq::CtAck,
                t,
                0,
                0,
                AtomicOp::Sum,
                Datatype::Uint64,
            )?;
            Ok(())
        })?;
        self.issued += 1;
        Ok(())
    }

    fn acquire(&mut self, kind: LockType, rank: u32) -> Result<(), MpiError> {
        let start = Instant::now();
        let mut backoff = Duration::from_micros(1);
        loop {
            let got = match kind {
                LockType::Shared => {
                    let old = self.ctrl_atomic(rank, LOCK, 1, AtomicOp::Sum)?;
                    if old >= EXCL {
                        self.ctrl_add(rank, LOCK, u64::MAX)?;
                        false
                    } else {
                        true
                    }
                }
                LockType::Exclusive => {
                    let old = self.fetch_one(
                        rank,
                        true,
                        LOCK,
                        &EXCL.to_le_bytes(),
                        &0u64.to_le_bytes(),
                        AtomicOp::Cswap,
                        Datatype::Uint64,
                    )?;
                    u64::from_le_bytes(old.try_into().expect("8 bytes")) == 0
                }
            };
            if got {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(120) {
                return err(
                    ErrorClass::Other,
                    format!("lock on rank {rank} not granted in 120 s"),
                );
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_micros(200));
        }
    }

    fn release(&mut self, kind: LockType, rank: u32) -> Result<(), MpiError> {
        match kind {
            LockType::Shared => self.ctrl_add(rank, LOCK, u64::MAX)?,
            LockType::Exclusive => {
                // MSWAP with mask 2^32: bit 32 takes the data's (0), the rest stays.
                self.fetch_one(
                    rank,
                    true,
                    LOCK,
                    &0u64.to_le_bytes(),
                    &EXCL.to_le_bytes(),
                    AtomicOp::Mswap,
                    Datatype::Uint64,
                )?;
            }
        }
        self.flush_all_inner()
    }

    /// MPI_Win_lock: a passive-target epoch to `rank`.
    pub fn lock(&mut self, kind: LockType, rank: u32, assert: u32) -> Result<(), MpiError> {
        if self.freed {
            return err(ErrorClass::Win, "the window was freed");
        }
        if rank >= self.comm.size() {
            return err(
                ErrorClass::Rank,
                format!("rank {rank} is not in this window's group"),
            );
        }
        if self.access[rank as usize] != Access::None {
            return err(
                ErrorClass::RmaSync,
                format!("rank {rank} is already locked"),
            );
        }
        if assert & mode::NOCHECK == 0 {
            self.acquire(kind, rank)?;
        }
        self.access[rank as usize] = if assert & mode::NOCHECK == 0 {
            Access::Lock(kind)
        } else {
            Access::All
        };
        self.fence = false;
        Ok(())
    }

    /// MPI_Win_unlock: everything to `rank` completes, then the lock goes.
    pub fn unlock(&mut self, rank: u32) -> Result<(), MpiError> {
        if rank >= self.comm.size() {
            return err(
                ErrorClass::Rank,
                format!("rank {rank} is not in this window's group"),
            );
        }
        let a = self.access[rank as usize];
        if self.lock_all.is_some() {
            return err(
                ErrorClass::RmaSync,
                "unlock inside lock_all: use unlock_all",
            );
        }
        self.flush_all_inner()?;
        match a {
            Access::None => {
                return err(ErrorClass::RmaSync, format!("rank {rank} is not locked"));
            }
            Access::Lock(k) => self.release(k, rank)?,
            Access::All => {}
        }
        self.access[rank as usize] = Access::None;
        Ok(())
    }

    /// MPI_Win_lock_all: a shared lock at every member (none with NOCHECK).
    pub fn lock_all(&mut self, assert: u32) -> Result<(), MpiError> {
        if self.lock_all.is_some() || self.access.iter().any(|a| *a != Access::None) {
            return err(ErrorClass::RmaSync, "lock_all inside another passive epoch");
        }
        let check = assert & mode::NOCHECK == 0;
        for r in 0..self.comm.size() {
            if check {
                self.acquire(LockType::Shared, r)?;
            }
            self.access[r as usize] = Access::All;
        }
        self.lock_all = Some(check);
        self.fence = false;
        Ok(())
    }

    /// MPI_Win_unlock_all.
    pub fn unlock_all(&mut self) -> Result<(), MpiError> {
        let Some(check) = self.lock_all.take() else {
            return err(ErrorClass::RmaSync, "unlock_all without lock_all");
        };
        self.flush_all_inner()?;
        for r in 0..self.comm.size() {
            if check {
                self.ctrl_add(r, LOCK, u64::MAX)?;
            }
            self.access[r as usize] = Access::None;
        }
        self.flush_all_inner()
    }

    fn check_group(&self, group: &[u32]) -> Result<(), MpiError> {
        if let Some(r) = group.iter().find(|&&r| r >= self.comm.size()) {
            return err(
                ErrorClass::Group,
                format!("rank {r} is not in this window's group"),
            );
        }
        Ok(())
    }

    /// MPI_Win_post: exposes this window to `group` (each origin's post counter goes up).
    pub fn post(&mut self, group: &[u32]) -> Result<(), MpiError> {
        self.check_group(group)?;
        if self.posted.is_some() {
            return err(
                ErrorClass::RmaSync,
                "post inside an exposure epoch: wait first",
            );
        }
        for &r in group {
            self.ctrl_add(r, POST, 1)?;
        }
        self.flush_all_inner()?;
        self.posted = Some(group.to_vec());
        Ok(())
    }

    /// MPI_Win_start: an access epoch to `group`, once each of them posted.
    pub fn start(&mut self, group: &[u32]) -> Result<(), MpiError> {
        self.check_group(group)?;
        if self.started.is_some() {
            return err(
                ErrorClass::RmaSync,
                "start inside an access epoch: complete first",
            );
        }
        self.posts_seen += group.len() as u64;
        let want = self.posts_seen;
        self.wait_word(POST, want)?;
        self.started = Some(group.to_vec());
        self.fence = false;
        Ok(())
    }

    /// MPI_Win_complete: the access epoch's operations complete, then each target is told.
    pub fn complete(&mut self) -> Result<(), MpiError> {
        let Some(group) = self.started.take() else {
            return err(ErrorClass::RmaSync, "complete without start");
        };
        self.flush_all_inner()?;
        for r in group {
            self.ctrl_add(r, COMPLETE, 1)?;
        }
        self.flush_all_inner()
    }

    /// MPI_Win_wait: the exposure epoch ends once every origin completed.
    pub fn wait(&mut self) -> Result<(), MpiError> {
        let Some(group) = self.posted.take() else {
            return err(ErrorClass::RmaSync, "wait without post");
        };
        self.completes_seen += group.len() as u64;
        self.wait_word(COMPLETE, self.completes_seen)
    }

    /// MPI_Win_test: whether `wait` would return at once (and if so, it has ended the epoch).
    pub fn test(&mut self) -> Result<bool, MpiError> {
        let Some(group) = self.posted.as_ref() else {
            return err(ErrorClass::RmaSync, "test without post");
        };
        let want = self.completes_seen + group.len() as u64;
        if self.ctrl.read_u64(COMPLETE as usize) >= want {
            self.posted = None;
            self.completes_seen = want;
            return Ok(true);
        }
        Ok(false)
    }

    fn wait_word(&mut self, off: u64, want: u64) -> Result<(), MpiError> {
        let start = Instant::now();
        let mut spins = 0u32;
        while self.ctrl.read_u64(off as usize) < want {
            spins += 1;
            if spins > 1000 {
                self.with_st(|st| st.wait_event(Duration::from_micros(200)))?;
            }
            if start.elapsed() > Duration::from_secs(120) {
                return err(
                    ErrorClass::RmaSync,
                    "PSCW: the peers did not post/complete in 120 s",
                );
            }
        }
        Ok(())
    }

    /// MPI_Win_free (collective): completes everything, then a barrier, then the entries go.
    pub fn free(mut self) -> Result<(), MpiError> {
        self.free_inner()
    }

    fn free_inner(&mut self) -> Result<(), MpiError> {
        if self.freed {
            return Ok(());
        }
        let r = self.flush_all_inner();
        self.comm.barrier()?;
        self.freed = true;
        let (me, md, ct) = (self.me, self.md, self.ct);
        let regions = [self.mem.clone(), self.ctrl.clone(), self.staging.clone()];
        self.with_st(|st| {
            let ni = st.ni;
            for h in me {
                let _ = st.p.me_unlink(ni, h);
            }
            let _ = st.p.md_release(ni, md);
            let _ = st.p.ct_free(ni, ct);
            for m in &regions {
                let _ = st.p.endpoint().mem_deregister(m);
            }
            Ok(())
        })?;
        r
    }
}

impl Drop for Win {
    fn drop(&mut self) {
        if !self.freed && !std::thread::panicking() {
            let _ = self.free_inner();
        }
    }
}

/// The element that leaves any value unchanged under Sum: 0, or -0.0 for floats.
fn neutral<T: Type>() -> T {
    let mut v = [T::default()];
    match T::DT {
        Datatype::Float => bytes_mut(&mut v).copy_from_slice(&(-0.0f32).to_le_bytes()),
        Datatype::Double => bytes_mut(&mut v).copy_from_slice(&(-0.0f64).to_le_bytes()),
        _ => {}
    }
    v[0]
}
