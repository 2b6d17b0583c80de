//! Direct operations of the portals conduit: Extended puts, gets and remote atomics as Portals
//! put, get and (fetching) atomics on RAR, completed from their ACK and REPLY events on
//! SAFE_EQ. Local memory outside the segment goes through the bounce region, in pieces, up to
//! `SOFTNIC_PORTALS_COPY_MAX` (every size by default) and through the registration cache
//! (firehose.rs) above it; a non-bulk put sent from in place returns only at local completion
//! (its SEND event: the NIC has taken the bytes).

use super::firehose::{Registrar, Use};
use super::{
    err, Pieces, PortalsConduit, Rma, BOUNCE_LEN, CHUNK, COPY_MAX, IMPLICIT_SLOTS, MAX_RMA, RMA_TAG,
};
use crate::gasnet::atomic::PortalsCall;
use crate::gasnet::backoff::Backoff;
use crate::gasnet::conduit::{staging, GetDest, RmaDone};
use crate::gasnet::{AdOp, GasnetError};
use crate::portals::{AckReq, EventKind, NiFail};

/// Pieces of one direct operation at most: a piece's index has 16 bits in its `user_ptr`.
const PIECES_MAX: usize = 1 << 16;

impl PortalsConduit {
    /// Starts tracking a direct operation of `pieces` pieces.
    fn begin_rma(&mut self, op: u64, pieces: usize) -> &mut Rma {
        self.rma
            .entry(op)
            .insert_entry(Rma {
                remaining: pieces,
                ok: true,
                unsent: 0,
                dest: None,
                data: None,
                pieces: Pieces::new(pieces),
                cached: None,
            })
            .into_mut()
    }

    /// A direct piece's event: SEND (local completion), ACK of a put, REPLY of a get.
    pub(super) fn rma_event(&mut self, user_ptr: u64, kind: EventKind, fail: NiFail) {
        let (op, piece) = ((user_ptr & !RMA_TAG) >> 16, (user_ptr & 0xffff) as usize);
        let Some(r) = self.rma.get_mut(&op) else {
            return;
        };
        if kind == EventKind::Send {
            r.unsent = r.unsent.saturating_sub(1);
            return;
        }
        if kind != EventKind::Ack && kind != EventKind::Reply {
            return;
        }
        self.rma_in_flight -= 1;
        r.ok &= fail == NiFail::Ok;
        if let Some(b) = r.pieces.get(piece) {
            let at = piece * CHUNK;
            if let Some(data) = r.data.as_mut() {
                let n = (data.len() - at).min(CHUNK);
                data[at..at + n].copy_from_slice(&self.bounce.bytes()[b as usize..b as usize + n]);
            } else if let Some((dest, len)) = r.dest {
                let n = (len - at).min(CHUNK);
                let from = &self.bounce.bytes()[b as usize..b as usize + n];
                // SAFETY: `dest` is the caller's buffer of `len` bytes, valid and untouched
                // until this operation completes (the contract of GetDest::Local).
                unsafe {
                    std::ptr::copy_nonoverlapping(from.as_ptr(), (dest as *mut u8).add(at), n)
                };
            }
            self.ring.free(b);
        }
        r.remaining -= 1;
        if r.remaining == 0 {
            let r = self.rma.remove(&op).expect("present");
            if let Some(id) = r.cached {
                self.firehose.release(id);
            }
            self.finished.push(RmaDone {
                op,
                ok: r.ok,
                data: r.data.unwrap_or_default(),
            });
        }
    }

    /// `len` bytes of bounce space (at most a piece), waiting for the oldest pieces to finish
    /// when it is short.
    pub(super) fn bounce_alloc(&mut self, len: usize) -> Result<u64, GasnetError> {
        debug_assert!(len <= CHUNK && CHUNK <= BOUNCE_LEN);
        self.wait_room(|c| c.ring.alloc(len))
    }

    /// Waits until `take` finds room for more bulk data (see [`Backoff::for_room`]).
    fn wait_room<T>(
        &mut self,
        mut take: impl FnMut(&mut Self) -> Option<T>,
    ) -> Result<T, GasnetError> {
        let mut b = Backoff::for_room(self.room_slept);
        loop {
            if let Some(t) = take(self) {
                self.room_slept = b.slept();
                return Ok(t);
            }
            if self.poll_safe()? || self.drain_am()? || self.drain_raram()? {
                b.progressed();
                continue;
            }
            // Completions and messages collected for the caller do not end this wait.
            b.idle_then(self, |c, max| c.sleep_on_events(max))?;
        }
    }

    /// Bounce space for piece `piece` of direct operation `op`, released when it completes.
    fn bounce_piece(&mut self, op: u64, piece: usize, len: usize) -> Result<u64, GasnetError> {
        let b = self.bounce_alloc(len)?;
        if let Some(r) = self.rma.get_mut(&op) {
            r.pieces.set(piece, b);
        }
        Ok(b)
    }

    /// Waits for room for one more direct piece.
    fn rma_slot(&mut self) -> Result<(), GasnetError> {
        self.wait_room(|c| (c.rma_in_flight < MAX_RMA).then_some(()))?;
        self.rma_in_flight += 1;
        Ok(())
    }

    /// `[addr, addr+len)` of this process through the registration cache, registering (and
    /// releasing what the cache gives up) on a miss; `None` when the daemon cannot reach this
    /// process's memory, after which the bounce region serves everything.
    fn cached(&mut self, addr: u64, len: u64) -> Option<Use> {
        if !self.firehose_on {
            return None;
        }
        if let Some(u) = self.firehose.lookup(addr, len) {
            return Some(u);
        }
        let miss = self.firehose.plan(addr, len)?;
        match self.registrar().register_miss(
            &mut self.firehose,
            &mut self.p,
            self.ni,
            miss,
            (addr, len),
        ) {
            Ok(u) => Some(u),
            Err(e) => {
                tracing::warn!("registration cache off, bounce buffers only: {e}");
                self.firehose_on = false;
                None
            }
        }
    }

    /// How the cache registers: readable by nobody remote, SEND events on (a non-bulk put
    /// from a registered buffer completes locally on its SEND).
    fn registrar(&self) -> Registrar {
        Registrar {
            perms: crate::nic::memory::Perms(0),
            md_options: 0,
            eq: Some(self.safe_eq),
        }
    }

    /// A put of `src` to `node`'s segment. `bulk`: the caller keeps `src` unchanged until the
    /// operation completes, so it may be sent from in place without waiting; otherwise `src`
    /// may be reused when this returns (copied when small, local completion awaited when not).
    pub(super) fn direct_put(
        &mut self,
        node: u32,
        dest_offset: u64,
        src: &[u8],
        op: u64,
        bulk: bool,
    ) -> Result<(), GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let (addr, base) = (src.as_ptr() as u64, self.seg.as_ptr() as u64);
        let in_seg = addr >= base && addr + src.len() as u64 <= base + self.seg.len() as u64;
        let copied = if in_seg {
            !bulk && src.len() <= COPY_MAX
        } else {
            src.len() <= self.copy_max
        };
        // A copy goes in growing pieces, each put once copied and filling whole datagrams
        // (see `staging`).
        let first = if copied { staging::FIRST } else { CHUNK };
        let cuts = staging::pieces(src.len(), first, CHUNK, self.put_quantum);
        let pieces = cuts.clone().count();
        if pieces > PIECES_MAX {
            return Err(GasnetError::TransferTooLarge(src.len()));
        }
        // Where the bytes go from: (MD, offset of src in it), or the bounce region.
        let (from, cached) = if copied {
            (None, None)
        } else if in_seg {
            let md = if bulk { self.seg_md } else { self.seg_send_md };
            (Some((md, addr - base)), None)
        } else {
            let u = self.cached(addr, src.len() as u64);
            (u.map(|u| (u.reg.md, u.offset)), u.map(|u| u.id))
        };
        let r = self.begin_rma(op, pieces);
        r.cached = cached;
        if from.is_some() && !bulk {
            r.unsent = pieces;
        }
        for (i, (at0, n)) in cuts.enumerate() {
            let part = &src[at0..at0 + n];
            self.rma_slot()?;
            let (md, off) = match from {
                Some((md, at)) => (md, at + at0 as u64),
                None => {
                    let b = self.bounce_piece(op, i, part.len())?;
                    self.bounce.bytes()[b as usize..b as usize + part.len()].copy_from_slice(part);
                    (self.bounce_md, b)
                }
            };
            let t = self.rar(node, dest_offset + at0 as u64);
            self.p
                .put(
                    self.ni,
                    md,
                    off,
                    part.len() as u64,
                    AckReq::Ack,
                    t,
                    RMA_TAG | (op << 16) | i as u64,
                    0,
                )
                .map_err(err)?;
        }
        // Local completion: the NIC has taken every byte of a source the caller may reuse.
        while self.rma.get(&op).is_some_and(|r| r.unsent > 0) {
            self.wait_step()?;
        }
        Ok(())
    }

    pub(super) fn direct_get(
        &mut self,
        node: u32,
        src_offset: u64,
        len: usize,
        dest: GetDest,
        op: u64,
    ) -> Result<(), GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let pieces = len.div_ceil(CHUNK).max(1);
        if pieces > PIECES_MAX {
            return Err(GasnetError::TransferTooLarge(len));
        }
        // Where the reply lands: (MD, offset), or bounce pieces copied out at completion.
        let (to, cached) = match dest {
            GetDest::Segment(base) => (Some((self.seg_md, base)), None),
            GetDest::Local(_) if len <= self.copy_max => (None, None),
            GetDest::Local(addr) => {
                let u = self.cached(addr, len as u64);
                (u.map(|u| (u.reg.md, u.offset)), u.map(|u| u.id))
            }
        };
        let r = self.begin_rma(op, pieces);
        r.cached = cached;
        if let (None, GetDest::Local(addr)) = (to, dest) {
            r.dest = Some((addr, len));
        }
        for i in 0..pieces {
            let n = (len - (i * CHUNK).min(len)).min(CHUNK);
            self.rma_slot()?;
            let (md, off) = match to {
                Some((md, at)) => (md, at + (i * CHUNK) as u64),
                None => (self.bounce_md, self.bounce_piece(op, i, n)?),
            };
            let t = self.rar(node, src_offset + (i * CHUNK) as u64);
            self.p
                .get(
                    self.ni,
                    md,
                    off,
                    n as u64,
                    t,
                    RMA_TAG | (op << 16) | i as u64,
                )
                .map_err(err)?;
        }
        Ok(())
    }

    /// The caller gives up waiting for `op`: nothing may be copied into its buffer any more.
    pub(super) fn abandon_rma(&mut self, op: u64) {
        if let Some(r) = self.rma.get_mut(&op) {
            r.dest = None;
        }
    }

    pub(super) fn direct_atomic(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        [a, b]: [u64; 2],
        op: u64,
    ) -> Result<(), GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let p = atomic.portals(a, b);
        let fetch = p.call != PortalsCall::Atomic;
        self.begin_rma(op, 1).data = fetch.then(|| vec![0; 8]);
        self.rma_slot()?;
        // Bounce bytes [prior value | operand]: the NIC reads the operand and writes the prior
        // value back, which completion copies out.
        let at = self.bounce_piece(op, 0, 16)?;
        self.bounce.bytes()[at as usize + 8..at as usize + 16]
            .copy_from_slice(&p.operand.to_le_bytes());
        let (t, up, md) = (self.rar(node, offset), RMA_TAG | (op << 16), self.bounce_md);
        match p.call {
            PortalsCall::Atomic => {
                self.p
                    .atomic(self.ni, md, at + 8, 8, AckReq::Ack, t, up, 0, p.op, p.dt)
            }
            PortalsCall::Fetch => {
                self.p
                    .fetch_atomic(self.ni, md, at, md, at + 8, 8, t, up, 0, p.op, p.dt)
            }
            PortalsCall::Swap { compare } => self.p.swap(
                self.ni,
                md,
                at,
                md,
                at + 8,
                8,
                t,
                up,
                0,
                &compare.to_le_bytes(),
                p.op,
                p.dt,
            ),
        }
        .map_err(err)?;
        Ok(())
    }

    /// A non-fetching atomic of the implicit puts (PtlAtomic from IMP_MD, counting ACKs on
    /// IMP_CT): no per-operation state and no event unless it fails — the difference between
    /// one event handled per update and none, for update-heavy codes like RandomAccess.
    /// `Ok(false)` for the operations that are swaps (Set, Cas): those are tracked.
    ///
    /// Operand slot `k mod IMPLICIT_SLOTS` is reused by op `k`; the NIC read the previous
    /// user's operand when it started that op. It has once fewer than `IMPLICIT_SLOTS` are
    /// outstanding: the NIC starts commands in the order posted and gathers local bytes at
    /// start, so `c` completions (of distinct ops) mean the first `c` ops have all started.
    pub(super) fn implicit_atomic(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        [a, b]: [u64; 2],
    ) -> Result<bool, GasnetError> {
        let p = atomic.portals(a, b);
        if p.call != PortalsCall::Atomic {
            return Ok(false);
        }
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        // Failures are only counted here; a later sync reports them.
        while self.imp_issued - self.imp_completions()?.0 >= IMPLICIT_SLOTS as u64 {
            self.wait_step()?;
        }
        let at = (self.imp_issued % IMPLICIT_SLOTS as u64) * 8;
        self.imp.bytes()[at as usize..at as usize + 8].copy_from_slice(&p.operand.to_le_bytes());
        let t = self.rar(node, offset);
        self.p
            .atomic(
                self.ni,
                self.imp_md,
                at,
                8,
                // A full ACK, of which the MD posts failures only (EVENT_SUCCESS_DISABLE): a
                // counting one (CT_ACK) would leave the failure's reason untold.
                AckReq::Ack,
                t,
                node as u64,
                0,
                p.op,
                p.dt,
            )
            .map_err(err)?;
        self.imp_issued += 1;
        Ok(true)
    }

    /// Implicit atomics completed (successes and failures) and, of them, failures.
    pub(super) fn imp_completions(&self) -> Result<(u64, u64), GasnetError> {
        let c = self.p.ct_get(self.ni, self.imp_ct).map_err(err)?;
        Ok((c.success + c.failure, c.failure))
    }

    /// Whether every implicit atomic has completed; failures not reported yet are an error
    /// (once), naming the first one's target node and reason.
    pub(super) fn implicit_check(&mut self) -> Result<bool, GasnetError> {
        let (done, failed) = self.imp_completions()?;
        if failed > self.imp_failed {
            let new = failed - self.imp_failed;
            self.imp_failed = failed;
            let mut first = None;
            while let Ok((e, _)) = self.p.eq_get(self.ni, self.imp_eq) {
                first.get_or_insert((e.user_ptr, e.ni_fail));
            }
            let why = match first {
                Some((node, fail)) => format!(" (the first to node {node}: {fail:?})"),
                None => String::new(),
            };
            return Err(GasnetError::Wait(format!(
                "{new} implicit remote atomic(s) failed at their target{why}"
            )));
        }
        Ok(done >= self.imp_issued)
    }
}
