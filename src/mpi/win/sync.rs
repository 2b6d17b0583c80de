//! Synchronisation: flushes, fence, passive-target locks and PSCW.

use std::time::{Duration, Instant};

use crate::portals::{AckReq, AtomicOp, Datatype};

use super::super::error::{err, ErrorClass, MpiError};
use super::super::state::PING_AFTER;
use super::mode;
use super::{Access, LockType, Win, COMPLETE, EXCL, LOCK, POST, WAITER};

impl Win {
    /// Waits until every operation issued so far completed at its target (CT = counter),
    /// and every request-based one took its event (fetched results copied out), so staging
    /// is free again.
    pub(super) fn flush_all_inner(&mut self) -> Result<(), MpiError> {
        let (ct, issued) = (self.ct, self.issued);
        // Not PtlCTWait: it returns at the first failure, and this waits for every
        // operation, failed or not.
        let v = self.with_st(|st| {
            let (ni, start, mut spins) = (st.ni, Instant::now(), 0);
            loop {
                let v = st.p.ct_get(ni, ct)?;
                if v.success + v.failure >= issued {
                    return Ok(v);
                }
                st.p.idle(&mut spins, start, Some((ni, &[], &[ct], &[issued])))?;
            }
        })?;
        self.rq.borrow_mut().settle()?;
        self.staged = 0;
        let new = v.failure - self.failures.min(v.failure);
        self.failures = v.failure;
        if new > 0 {
            return err(
                ErrorClass::RmaRange,
                format!("{new} one-sided operations failed at their targets"),
            );
        }
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
        let t = self.ctrl_target(rank, off);
        let old = self.fetch_one(t, &v.to_le_bytes(), &[], op, Datatype::Uint64)?;
        Ok(u64::from_le_bytes(old.try_into().expect("8 bytes")))
    }

    fn ctrl_add(&mut self, rank: u32, off: u64, v: u64) -> Result<(), MpiError> {
        let at = self.stage(8)?;
        self.staging.bytes()[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes());
        let t = self.ctrl_target(rank, off);
        let md = self.md;
        self.issue(None, |st| {
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
            )
        })
    }

    /// The seed's lock: shared is a fetch-add of 1 (backed out and retried if the result
    /// shows any exclusive bit), exclusive a CSWAP 0 → 2^32. An exclusive locker that fails
    /// once announces itself (adds 2^33) and from then on swaps "no holder, these waiters"
    /// for "held, one waiter fewer". Newcomers' CSWAP 0 and shared fetch-adds fail while
    /// anyone waits, so an origin locking in a loop cannot take the word straight back:
    /// without this one rank held it alone for 40 ms while seven others retried.
    fn acquire(&mut self, kind: LockType, rank: u32) -> Result<(), MpiError> {
        if kind == LockType::Shared {
            return self.retry(rank, "the lock", |w| {
                let old = w.ctrl_atomic(rank, LOCK, 1, AtomicOp::Sum)?;
                if old >= EXCL {
                    w.ctrl_add(rank, LOCK, u64::MAX)?;
                    Ok(false)
                } else {
                    Ok(true)
                }
            });
        }
        // What the word holds when it is free to this waiter (0 until it announces itself).
        let mut expect: Option<u64> = None;
        let got = self.retry(rank, "the lock", |w| {
            let (from, to) = match expect {
                None => (0, EXCL),
                Some(e) => (e, e.saturating_sub(WAITER) | EXCL),
            };
            let t = w.ctrl_target(rank, LOCK);
            let old = w.fetch_one(
                t,
                &to.to_le_bytes(),
                &from.to_le_bytes(),
                AtomicOp::Cswap,
                Datatype::Uint64,
            )?;
            let old = u64::from_le_bytes(old.try_into().expect("8 bytes"));
            if old == from {
                return Ok(true);
            }
            let waiting = match expect {
                Some(_) => old,
                // Fetched, so the next try's guess already counts this waiter.
                None => w
                    .ctrl_atomic(rank, LOCK, WAITER, AtomicOp::Sum)?
                    .wrapping_add(WAITER),
            };
            expect = Some(waiting & !(EXCL | u64::from(u32::MAX)));
            Ok(false)
        });
        if got.is_err() && expect.is_some() {
            // Giving up (120 s): stop blocking the others. The error says why already.
            let _ = self.ctrl_add(rank, LOCK, WAITER.wrapping_neg());
        }
        got
    }

    /// A shared lock at every member: every fetch-add in flight at once, then the members
    /// an exclusive holder refused are taken back and retried one by one.
    fn acquire_all_shared(&mut self) -> Result<(), MpiError> {
        let n = self.comm.size();
        let mut results = Vec::with_capacity(n as usize);
        // All the room at once: the results stay where they land until read below.
        let base = self.stage(16 * n as usize)?;
        for r in 0..n {
            let t = self.ctrl_target(r, LOCK);
            let src = base + 16 * r as u64;
            let dst = src + 8;
            self.staging.bytes()[src as usize..src as usize + 8]
                .copy_from_slice(&1u64.to_le_bytes());
            let md = self.md;
            self.issue(None, |st| {
                st.p.fetch_atomic(
                    st.ni,
                    md,
                    dst,
                    md,
                    src,
                    8,
                    t,
                    0,
                    0,
                    AtomicOp::Sum,
                    Datatype::Uint64,
                )
            })?;
            results.push((r, dst));
        }
        self.flush_all_inner()?;
        let refused: Vec<u32> = results
            .into_iter()
            .filter(|&(_, at)| {
                let b = &self.staging.bytes()[at as usize..at as usize + 8];
                u64::from_le_bytes(b.try_into().expect("8 bytes")) >= EXCL
            })
            .map(|(r, _)| r)
            .collect();
        for &r in &refused {
            self.ctrl_add(r, LOCK, u64::MAX)?;
        }
        for r in refused {
            self.acquire(LockType::Shared, r)?;
        }
        Ok(())
    }

    /// Gives the lock back without waiting for the target to confirm it: the epoch's
    /// operations completed before (`unlock` flushes first), so only other lockers wait on
    /// the release, and this origin's next flush (its next lock's, a fence, `free`) collects
    /// its acknowledgement. A release overtaken by this origin's next attempt on the same word
    /// only makes that attempt retry.
    fn release(&mut self, kind: LockType, rank: u32) -> Result<(), MpiError> {
        match kind {
            LockType::Shared => self.ctrl_add(rank, LOCK, u64::MAX),
            LockType::Exclusive => {
                // MSWAP with mask 2^32: bit 32 takes the data's (0), the rest stays. The old
                // value lands in staging, which stays put until the flush that collects it.
                let src = self.stage(16)?;
                let dst = src + 8;
                self.staging.bytes()[src as usize..src as usize + 8]
                    .copy_from_slice(&0u64.to_le_bytes());
                let (t, md) = (self.ctrl_target(rank, LOCK), self.md);
                self.issue(None, |st| {
                    st.p.swap(
                        st.ni,
                        md,
                        dst,
                        md,
                        src,
                        8,
                        t,
                        0,
                        0,
                        &EXCL.to_le_bytes(),
                        AtomicOp::Mswap,
                        Datatype::Uint64,
                    )
                })
            }
        }
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
        if check {
            self.acquire_all_shared()?;
        }
        self.access.fill(Access::All);
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
        // The releases are not waited for (see `release`).
        for r in 0..self.comm.size() {
            if check {
                self.ctrl_add(r, LOCK, u64::MAX)?;
            }
            self.access[r as usize] = Access::None;
        }
        Ok(())
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
        // Not waited for: each origin's start waits for its own count, and this process's
        // next flush (its wait, if an origin is gone) collects the acknowledgements.
        for &r in group {
            self.ctrl_add(r, POST, 1)?;
        }
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
        self.wait_word(POST, want, group)?;
        self.started = Some(group.to_vec());
        self.fence = false;
        Ok(())
    }

    /// MPI_Win_complete: the access epoch's operations complete, then each target is told
    /// (not waiting for the telling to be acknowledged, as a lock's release does not: the
    /// next flush collects it).
    pub fn complete(&mut self) -> Result<(), MpiError> {
        let Some(group) = self.started.take() else {
            return err(ErrorClass::RmaSync, "complete without start");
        };
        self.flush_all_inner()?;
        for r in group {
            self.ctrl_add(r, COMPLETE, 1)?;
        }
        Ok(())
    }

    /// MPI_Win_wait: the exposure epoch ends once every origin completed.
    pub fn wait(&mut self) -> Result<(), MpiError> {
        let Some(group) = self.posted.take() else {
            return err(ErrorClass::RmaSync, "wait without post");
        };
        self.completes_seen += group.len() as u64;
        self.wait_word(COMPLETE, self.completes_seen, &group)
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

    /// Waits until the control word at `off` reaches `want` (counts from `peers`), sleeping on
    /// the NIC between arrivals at the control words (their counting event). A wait that
    /// lasts asks after the peers, so one that is gone fails it (MPI_ERR_PROC_FAILED)
    /// instead of 120 s of waiting for its count.
    fn wait_word(&mut self, off: u64, want: u64, peers: &[u32]) -> Result<(), MpiError> {
        let start = Instant::now();
        let mut spins = 0u32;
        let ct = self.ctrl_ct;
        // Filled once the wait has lasted: the common, quick wait neither allocates nor runs
        // point-to-point progress.
        let mut world: Vec<u32> = Vec::new();
        loop {
            let seen = self.with_st(|st| {
                let c = st.p.ct_get(st.ni, ct)?;
                Ok(c.success + c.failure)
            })?;
            if self.ctrl.read_u64(off as usize) >= want {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited > Duration::from_secs(120) {
                return err(
                    ErrorClass::RmaSync,
                    "PSCW: the peers did not post/complete in 120 s",
                );
            }
            if waited >= PING_AFTER {
                // A post or complete this process sent failed (the peer is gone): say so.
                let failed = self.with_st(|st| Ok(st.p.ct_get(st.ni, self.ct)?.failure))?;
                if failed > self.failures {
                    self.flush_all_inner()?;
                }
                if world.is_empty() {
                    world = peers.iter().map(|&r| self.comm.group[r as usize]).collect();
                }
                self.with_st(|st| {
                    st.progress()?;
                    st.ask_after(&world, start)
                })?;
            }
            self.with_st(|st| {
                let ni = st.ni;
                Ok(st
                    .p
                    .idle(&mut spins, start, Some((ni, &[], &[ct], &[seen + 1])))?)
            })?;
        }
    }
}
