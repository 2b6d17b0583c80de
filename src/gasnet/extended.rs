//! GASNet Extended over Active Messages (the reference-extended approach every conduit can
//! use): put = Long requests answered by a short ack; get = short requests answered by Medium
//! replies; memset = a short request; barrier = split-phase, central at node 0, with ids and
//! mismatch detection. Sources are copied into the AM at once, so both the bulk and non-bulk
//! local-completion rules hold when a call returns.

use std::cell::RefCell;
// Keys are this process's own operation ids and barrier phases: a fast non-keyed hash is safe.
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::rc::Rc;

use super::conduit::GetDest;
use super::core::{fits, Core, Handler, Msg, Token};
use super::{Gasnet, GasnetError};

const H_PUT: u8 = 1;
/// The reply that finishes one part of an operation (a put's chunk, a memset, a get's Long
/// chunk, whose payload has landed by then); its third argument flags a failure.
const H_PART_DONE: u8 = 2;
const H_GET: u8 = 3;
const H_GET_REPLY: u8 = 4;
const H_MEMSET: u8 = 5;
const H_BAR_NOTIFY: u8 = 6;
const H_BAR_DONE: u8 = 7;
/// A get chunk into the requester's segment, answered by a Long reply to `H_PART_DONE`.
const H_GET_LONG: u8 = 10;

/// An explicit handle (`gasnet_handle_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle(u64);

/// Barrier flags (GASNET_BARRIERFLAG_*).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BarrierFlags(pub u32);

impl BarrierFlags {
    pub const NONE: BarrierFlags = BarrierFlags(0);
    /// This node does not supply an id to compare.
    pub const ANONYMOUS: BarrierFlags = BarrierFlags(1);
    /// Forces a mismatch for everyone.
    pub const MISMATCH: BarrierFlags = BarrierFlags(2);
}

#[derive(Default)]
pub struct ExtState {
    next_op: u64,
    /// Acks or replies still due per operation (removed when none are).
    remaining: HashMap<u64, usize>,
    /// Operations finished so far: an NBI sync rescans its lists only when this moved.
    finished_ops: u64,
    /// Operations that failed at the target (out of segment).
    pub(super) failed: HashSet<u64>,
    /// Gets into a caller's buffer: data assembled here.
    pub(super) get_data: HashMap<u64, Vec<u8>>,
    /// Gets into this node's segment: the base offset.
    get_to_segment: HashMap<u64, u64>,
    /// Access regions and implicit operations.
    regions: HashMap<u64, Vec<u64>>,
    pub(super) open_region: Option<Vec<u64>>,
    pub(super) nbi_puts: Vec<u64>,
    nbi_gets: Vec<u64>,
    // Barrier.
    phase: u32,
    notified: Option<(u32, u32)>,
    done: HashMap<u32, bool>,
    /// At node 0: per phase, arrivals, the first named id, whether ids mismatched, broadcast.
    arrivals: HashMap<u32, (u32, Option<u32>, bool, bool)>,
}

impl ExtState {
    pub(super) fn new_op(&mut self, parts: usize) -> u64 {
        self.next_op += 1;
        let op = self.next_op;
        self.remaining.insert(op, parts.max(1));
        op
    }

    pub(super) fn part_done(&mut self, op: u64) {
        if let Some(n) = self.remaining.get_mut(&op) {
            *n -= 1;
            if *n == 0 {
                self.remaining.remove(&op);
                self.finished_ops += 1;
            }
        }
    }

    /// Moves the finished operations of the implicit puts (or gets) to `finished`.
    fn retire_nbi(&mut self, gets: bool, finished: &mut Vec<u64>) {
        let mut list = std::mem::take(match gets {
            true => &mut self.nbi_gets,
            false => &mut self.nbi_puts,
        });
        list.retain(|&o| {
            let done = self.done(o);
            if done {
                finished.push(o);
            }
            !done
        });
        match gets {
            true => self.nbi_gets = list,
            false => self.nbi_puts = list,
        }
    }

    fn done(&self, op: u64) -> bool {
        match self.regions.get(&op) {
            Some(ops) => ops.iter().all(|o| !self.remaining.contains_key(o)),
            None => !self.remaining.contains_key(&op),
        }
    }
}

pub(super) fn split(op: u64) -> [u32; 2] {
    [op as u32, (op >> 32) as u32]
}

pub(super) fn join(lo: u32, hi: u32) -> u64 {
    lo as u64 | ((hi as u64) << 32)
}

pub(super) fn handler(f: impl FnMut(&mut Token<'_>, Msg<'_>) + 'static) -> Handler {
    Box::new(f)
}

pub(super) fn register_handlers(
    core: &mut Core,
    st: &Rc<RefCell<ExtState>>,
) -> Result<(), GasnetError> {
    core.register_unviewed(
        H_PUT,
        handler(|t, m| {
            let _ = t.reply_short(H_PART_DONE, &[m.args[0], m.args[1], 0]);
        }),
    )?;
    let s = st.clone();
    core.register_unviewed(
        H_PART_DONE,
        handler(move |_, m| {
            let op = join(m.args[0], m.args[1]);
            let mut s = s.borrow_mut();
            if m.args.get(2).copied().unwrap_or(0) != 0 {
                s.failed.insert(op);
            }
            s.part_done(op);
        }),
    )?;
    core.register(
        H_GET,
        handler(|t, m| {
            let (off, len, chunk) = (
                join(m.args[2], m.args[3]),
                m.args[4] as u64,
                [m.args[5], m.args[6]],
            );
            let seg = t.segment();
            let ok = fits(seg.len(), off, len);
            let data = if ok {
                seg[off as usize..(off + len) as usize].to_vec()
            } else {
                Vec::new()
            };
            let _ = t.reply_medium(
                H_GET_REPLY,
                &data,
                &[m.args[0], m.args[1], chunk[0], chunk[1], !ok as u32],
            );
        }),
    )?;
    core.register(
        H_GET_LONG,
        handler(|t, m| {
            let (off, len, dest) = (
                join(m.args[2], m.args[3]),
                m.args[4] as u64,
                join(m.args[5], m.args[6]),
            );
            // Segments (and landing areas) are symmetric: the requester's destination is
            // checked against ours.
            let seg_len = t.segment().len();
            let op = [m.args[0], m.args[1]];
            let sent = fits(seg_len, off, len)
                && t.reply_fits(dest, len)
                && t.reply_long_from_segment(
                    H_PART_DONE,
                    off as usize,
                    len as usize,
                    dest,
                    &[op[0], op[1], 0],
                )
                .is_ok();
            if !sent {
                let _ = t.reply_short(H_PART_DONE, &[op[0], op[1], 1]);
            }
        }),
    )?;
    let s = st.clone();
    core.register(
        H_GET_REPLY,
        handler(move |t, m| {
            let op = join(m.args[0], m.args[1]);
            let at = join(m.args[2], m.args[3]) as usize;
            let mut s = s.borrow_mut();
            if m.args[4] != 0 {
                s.failed.insert(op);
            } else if let Some(&base) = s.get_to_segment.get(&op) {
                let seg = t.segment();
                let start = base as usize + at;
                if start + m.payload.len() <= seg.len() {
                    seg[start..start + m.payload.len()].copy_from_slice(m.payload);
                }
            } else if let Some(buf) = s.get_data.get_mut(&op) {
                if at + m.payload.len() <= buf.len() {
                    buf[at..at + m.payload.len()].copy_from_slice(m.payload);
                }
            }
            s.part_done(op);
        }),
    )?;
    core.register(
        H_MEMSET,
        handler(|t, m| {
            let (off, len, value) = (
                join(m.args[2], m.args[3]),
                join(m.args[4], m.args[5]),
                m.args[6] as u8,
            );
            let seg = t.segment();
            let ok = fits(seg.len(), off, len);
            if ok {
                seg[off as usize..(off + len) as usize].fill(value);
            }
            let _ = t.reply_short(H_PART_DONE, &[m.args[0], m.args[1], !ok as u32]);
        }),
    )?;
    let s = st.clone();
    core.register(
        H_BAR_NOTIFY,
        handler(move |_, m| {
            let (phase, id, flags) = (m.args[0], m.args[1], m.args[2]);
            let mut s = s.borrow_mut();
            let e = s.arrivals.entry(phase).or_insert((0, None, false, false));
            e.0 += 1;
            if flags & BarrierFlags::MISMATCH.0 != 0 {
                e.2 = true;
            } else if flags & BarrierFlags::ANONYMOUS.0 == 0 {
                match e.1 {
                    None => e.1 = Some(id),
                    Some(x) if x != id => e.2 = true,
                    _ => {}
                }
            }
        }),
    )?;
    let s = st.clone();
    core.register(
        H_BAR_DONE,
        handler(move |_, m| {
            s.borrow_mut().done.insert(m.args[0], m.args[1] != 0);
        }),
    )?;
    super::atomic::register_handlers(core, st)
}

impl Gasnet {
    /// Accounts the direct operations the conduit finished since the last poll.
    pub(crate) fn account_rma(&mut self) {
        // Drained in place: the poll refills the same buffer, no allocation per poll.
        let mut s = self.ext.borrow_mut();
        for d in self.core.rma_done.drain(..) {
            if !d.ok {
                s.failed.insert(d.op);
            } else if let Some(buf) = s.get_data.get_mut(&d.op) {
                let n = buf.len().min(d.data.len());
                buf[..n].copy_from_slice(&d.data[..n]);
            }
            s.part_done(d.op);
        }
    }

    pub(super) fn check_remote(&mut self, offset: u64, len: u64) -> Result<(), GasnetError> {
        // Segments are symmetric (one size for the job): check against ours.
        match fits(self.core.conduit.segment().len(), offset, len) {
            true => Ok(()),
            false => Err(GasnetError::OutOfSegment(offset, len)),
        }
    }

    pub(super) fn track(&mut self, op: u64) {
        if let Some(r) = self.ext.borrow_mut().open_region.as_mut() {
            r.push(op);
        }
    }

    /// Payload room of one Medium AM after the most arguments (what one get reply carries).
    fn chunk(&self) -> usize {
        self.core.max_payload(super::am::MAX_ARGS).max(1)
    }

    /// AMMaxLong: what one put request carries (reference implementation: puts are Long
    /// requests chunked at AMMaxLong).
    fn long_chunk(&self) -> usize {
        self.core.conduit.max_long().max(1)
    }

    /// A put; `bulk`: the caller leaves `src` unchanged until the operation completes.
    fn put_op(
        &mut self,
        node: u32,
        dest_offset: u64,
        src: &[u8],
        bulk: bool,
    ) -> Result<u64, GasnetError> {
        self.check_remote(dest_offset, src.len() as u64)?;
        let op = self.ext.borrow_mut().new_op(1);
        // Straight through the network where the conduit can (Portals put, ACK completes it).
        if self
            .core
            .conduit
            .rma_put(node, dest_offset, src, op, bulk)?
        {
            self.track(op);
            return Ok(op);
        }
        let chunk = self.long_chunk();
        let parts = src.len().div_ceil(chunk).max(1);
        self.ext.borrow_mut().remaining.insert(op, parts);
        let [lo, hi] = split(op);
        if src.is_empty() {
            self.am_request_long(node, H_PUT, &[], dest_offset, &[lo, hi])?;
        }
        for (i, c) in src.chunks(chunk).enumerate() {
            self.am_request_long(node, H_PUT, c, dest_offset + (i * chunk) as u64, &[lo, hi])?;
        }
        self.track(op);
        Ok(op)
    }

    /// A get into this node's segment, or into the caller's memory (`GetDest::Local`, which
    /// must stay valid until the operation completes; over Active Messages the data waits in
    /// the operation's `get_data` instead).
    fn get_op(
        &mut self,
        node: u32,
        src_offset: u64,
        len: usize,
        dest: GetDest,
    ) -> Result<u64, GasnetError> {
        self.check_remote(src_offset, len as u64)?;
        let into_segment = match dest {
            GetDest::Segment(base) => {
                self.check_remote(base, len as u64)?;
                Some(base)
            }
            GetDest::Local(_) => None,
        };
        let direct = self.ext.borrow_mut().new_op(1);
        if self
            .core
            .conduit
            .rma_get(node, src_offset, len, dest, direct)?
        {
            self.track(direct);
            return Ok(direct);
        }
        self.ext.borrow_mut().remaining.remove(&direct);
        self.get_by_am(node, src_offset, len, into_segment)
    }

    /// A get over Active Messages; `into_segment`: where its data lands here (a segment
    /// offset, or the landing area's), else it waits in the operation's `get_data`.
    fn get_by_am(
        &mut self,
        node: u32,
        src_offset: u64,
        len: usize,
        into_segment: Option<u64>,
    ) -> Result<u64, GasnetError> {
        // Into the segment and more than a Medium holds: Long replies land in place, AMMaxLong
        // at a time (the reference implementation); else Medium replies, copied out here.
        let medium = self.chunk();
        let long = into_segment.filter(|_| len > medium && self.long_chunk() > medium);
        let chunk = match long {
            Some(_) => self.long_chunk(),
            None => medium,
        };
        let parts = len.div_ceil(chunk).max(1);
        let op = {
            let mut s = self.ext.borrow_mut();
            let op = s.new_op(parts);
            match (long, into_segment) {
                (Some(_), _) => {}
                (None, Some(base)) => {
                    s.get_to_segment.insert(op, base);
                }
                (None, None) => {
                    s.get_data.insert(op, vec![0; len]);
                }
            }
            op
        };
        let [lo, hi] = split(op);
        let mut at = 0;
        loop {
            let n = (len - at).min(chunk);
            let [o1, o2] = split(src_offset + at as u64);
            if let Some(base) = long {
                let [d1, d2] = split(base + at as u64);
                self.am_request_short(node, H_GET_LONG, &[lo, hi, o1, o2, n as u32, d1, d2])?;
            } else {
                let [c1, c2] = split(at as u64);
                self.am_request_short(node, H_GET, &[lo, hi, o1, o2, n as u32, c1, c2])?;
            }
            at += n;
            if at >= len {
                break;
            }
        }
        self.track(op);
        Ok(op)
    }

    /// Waits for operation `op`, which moves `bytes` (0 when unknown: waited for as a small
    /// one).
    pub(super) fn wait_op(&mut self, op: u64, bytes: usize) -> Result<(), GasnetError> {
        let st = self.ext.clone();
        self.block_until_op(bytes, || st.borrow().done(op))?;
        self.finish_op(op)
    }

    /// Clears what an operation left behind; its failure, if any.
    fn finish_op(&mut self, op: u64) -> Result<(), GasnetError> {
        let mut s = self.ext.borrow_mut();
        let region = s.regions.remove(&op);
        let mut failed = false;
        for &o in region.as_deref().unwrap_or(&[op]) {
            failed |= s.failed.remove(&o);
            s.get_to_segment.remove(&o);
        }
        if failed {
            Err(GasnetError::OutOfSegment(0, 0))
        } else {
            Ok(())
        }
    }

    // ---------------------------------------------------------------- blocking

    /// gasnet_put: returns when the data is in `node`'s segment.
    pub fn put(&mut self, node: u32, dest_offset: u64, src: &[u8]) -> Result<(), GasnetError> {
        // `src` is borrowed until the put completes: bulk rules hold.
        let op = self.put_op(node, dest_offset, src, true)?;
        self.wait_op(op, src.len())
    }

    /// gasnet_get into any local buffer (the network writes it in place where it can).
    pub fn get(&mut self, dst: &mut [u8], node: u32, src_offset: u64) -> Result<(), GasnetError> {
        match self.landing_for(dst.len(), node) {
            Some((base, piece)) => self.get_via_landing(dst, node, src_offset, base, piece),
            None => self.get_private(dst, node, src_offset),
        }
    }

    /// [`Gasnet::get`] as the conduit does it: straight into `dst`, or Medium replies copied in.
    fn get_private(
        &mut self,
        dst: &mut [u8],
        node: u32,
        src_offset: u64,
    ) -> Result<(), GasnetError> {
        let at = GetDest::Local(dst.as_mut_ptr() as u64);
        let op = self.get_op(node, src_offset, dst.len(), at)?;
        let st = self.ext.clone();
        if let Err(e) = self.block_until_op(dst.len(), || st.borrow().done(op)) {
            self.core.conduit.abandon(op);
            return Err(e);
        }
        let data = self.ext.borrow_mut().get_data.remove(&op);
        self.finish_op(op)?;
        if let Some(data) = data {
            dst.copy_from_slice(&data);
        }
        Ok(())
    }

    /// Where a blocking get of `len` bytes into private memory lands, a piece at a time, when
    /// the conduit has a landing area (see [`crate::gasnet::conduit::Conduit::landing`]) and
    /// the get is more than a Medium holds: (the area's offset, the piece's size).
    fn landing_for(&self, len: usize, node: u32) -> Option<(u64, usize)> {
        let (base, cap) = self.core.conduit.landing()?;
        let medium = self.chunk();
        let piece = cap.min(self.long_chunk());
        (len > medium && piece > medium && node < self.core.conduit.nodes())
            .then_some((base, piece))
    }

    /// A blocking get by Long replies into the landing area at `base`, `piece` bytes at a time,
    /// each copied out once — instead of Medium replies (over EXTOLL 147 VELO messages per
    /// 8 KiB: a 1 MiB get took 3.7 ms).
    fn get_via_landing(
        &mut self,
        dst: &mut [u8],
        node: u32,
        src_offset: u64,
        base: u64,
        piece: usize,
    ) -> Result<(), GasnetError> {
        self.check_remote(src_offset, dst.len() as u64)?;
        for (i, part) in dst.chunks_mut(piece).enumerate() {
            let from = src_offset + (i * piece) as u64;
            // A last piece a Medium holds comes as one.
            if part.len() <= self.chunk() {
                return self.get_private(part, node, from);
            }
            let op = self.get_by_am(node, from, part.len(), Some(base))?;
            self.wait_op(op, part.len())?;
            part.copy_from_slice(&self.core.conduit.landing_bytes()[..part.len()]);
        }
        Ok(())
    }

    /// gasnet_memset.
    pub fn memset(
        &mut self,
        node: u32,
        dest_offset: u64,
        value: u8,
        len: u64,
    ) -> Result<(), GasnetError> {
        let h = self.memset_nb(node, dest_offset, value, len)?;
        self.wait_syncnb(h)
    }

    // ---------------------------------------------------------------- explicit handles

    /// gasnet_put_nb: `src` may be reused as soon as this returns.
    pub fn put_nb(
        &mut self,
        node: u32,
        dest_offset: u64,
        src: &[u8],
    ) -> Result<Handle, GasnetError> {
        self.put_op(node, dest_offset, src, false).map(Handle)
    }

    /// gasnet_put_nb_bulk: the caller leaves `src` unchanged (and allocated) until the handle
    /// is synchronised, so large sources are sent from in place without waiting.
    pub fn put_nb_bulk(
        &mut self,
        node: u32,
        dest_offset: u64,
        src: &[u8],
    ) -> Result<Handle, GasnetError> {
        self.put_op(node, dest_offset, src, true).map(Handle)
    }

    /// gasnet_get_nb into this node's segment at `local_offset`.
    pub fn get_nb(
        &mut self,
        local_offset: u64,
        node: u32,
        src_offset: u64,
        len: usize,
    ) -> Result<Handle, GasnetError> {
        self.get_op(node, src_offset, len, GetDest::Segment(local_offset))
            .map(Handle)
    }

    pub fn get_nb_bulk(
        &mut self,
        local_offset: u64,
        node: u32,
        src_offset: u64,
        len: usize,
    ) -> Result<Handle, GasnetError> {
        self.get_nb(local_offset, node, src_offset, len)
    }

    /// gasnet_memset_nb.
    pub fn memset_nb(
        &mut self,
        node: u32,
        dest_offset: u64,
        value: u8,
        len: u64,
    ) -> Result<Handle, GasnetError> {
        self.check_remote(dest_offset, len)?;
        let op = self.ext.borrow_mut().new_op(1);
        let [lo, hi] = split(op);
        let [o1, o2] = split(dest_offset);
        let [l1, l2] = split(len);
        self.am_request_short(node, H_MEMSET, &[lo, hi, o1, o2, l1, l2, value as u32])?;
        self.track(op);
        Ok(Handle(op))
    }

    /// gasnet_try_syncnb: `Ok(true)` once complete (polls once).
    pub fn try_syncnb(&mut self, h: Handle) -> Result<bool, GasnetError> {
        self.poll_once()?;
        if self.ext.borrow().done(h.0) {
            self.finish_op(h.0)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// gasnet_wait_syncnb.
    pub fn wait_syncnb(&mut self, h: Handle) -> Result<(), GasnetError> {
        self.wait_op(h.0, 0)
    }

    /// gasnet_wait_syncnb_all.
    pub fn wait_syncnb_all(&mut self, hs: &[Handle]) -> Result<(), GasnetError> {
        let mut r = Ok(());
        for &h in hs {
            if let Err(e) = self.wait_syncnb(h) {
                r = Err(e);
            }
        }
        r
    }

    /// gasnet_try_syncnb_all.
    pub fn try_syncnb_all(&mut self, hs: &[Handle]) -> Result<bool, GasnetError> {
        self.poll_once()?;
        if hs.iter().all(|h| self.ext.borrow().done(h.0)) {
            self.wait_syncnb_all(hs)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// gasnet_try_syncnb_some: the completed handles are synchronised and returned.
    pub fn try_syncnb_some(&mut self, hs: &[Handle]) -> Result<Vec<Handle>, GasnetError> {
        self.poll_once()?;
        let done: Vec<Handle> = hs
            .iter()
            .copied()
            .filter(|h| self.ext.borrow().done(h.0))
            .collect();
        for &h in &done {
            self.finish_op(h.0)?;
        }
        Ok(done)
    }

    /// gasnet_wait_syncnb_some: waits until at least one completes; returns those that did.
    pub fn wait_syncnb_some(&mut self, hs: &[Handle]) -> Result<Vec<Handle>, GasnetError> {
        loop {
            let d = self.try_syncnb_some(hs)?;
            if !d.is_empty() || hs.is_empty() {
                return Ok(d);
            }
        }
    }

    // ---------------------------------------------------------------- implicit handles

    /// gasnet_put_nbi: `src` may be reused as soon as this returns.
    pub fn put_nbi(&mut self, node: u32, dest_offset: u64, src: &[u8]) -> Result<(), GasnetError> {
        let op = self.put_op(node, dest_offset, src, false)?;
        self.ext.borrow_mut().nbi_puts.push(op);
        Ok(())
    }

    /// gasnet_put_nbi_bulk: the caller leaves `src` unchanged (and allocated) until the
    /// implicit operations are synchronised.
    pub fn put_nbi_bulk(
        &mut self,
        node: u32,
        dest_offset: u64,
        src: &[u8],
    ) -> Result<(), GasnetError> {
        let op = self.put_op(node, dest_offset, src, true)?;
        self.ext.borrow_mut().nbi_puts.push(op);
        Ok(())
    }

    /// gasnet_get_nbi into this node's segment.
    pub fn get_nbi(
        &mut self,
        local_offset: u64,
        node: u32,
        src_offset: u64,
        len: usize,
    ) -> Result<(), GasnetError> {
        let op = self.get_op(node, src_offset, len, GetDest::Segment(local_offset))?;
        self.ext.borrow_mut().nbi_gets.push(op);
        Ok(())
    }

    /// Retires finished implicit operations (so each poll looks only at those still open) and
    /// reports whether none of the chosen kinds are left; a failed one is the error.
    fn sync_nbi(&mut self, puts: bool, gets: bool, wait: bool) -> Result<bool, GasnetError> {
        let mut r = Ok(());
        let mut b = super::backoff::Backoff::default();
        let mut seen = None;
        loop {
            let polled = self.poll_once()?;
            let finished = {
                let mut s = self.ext.borrow_mut();
                let mut finished = Vec::new();
                // Thousands may be outstanding: look again only when some operation finished.
                if seen != Some(s.finished_ops) {
                    seen = Some(s.finished_ops);
                    if puts {
                        s.retire_nbi(false, &mut finished);
                    }
                    if gets {
                        s.retire_nbi(true, &mut finished);
                    }
                }
                finished
            };
            let progressed = polled || !finished.is_empty();
            for o in finished {
                if let Err(e) = self.finish_op(o) {
                    r = Err(e);
                }
            }
            // Atomics the conduit counts rather than tracks belong to the implicit puts.
            let counted_open = puts
                && match self.core.conduit.implicit_done() {
                    Ok(done) => !done,
                    Err(e) => {
                        r = Err(e);
                        false
                    }
                };
            {
                let s = self.ext.borrow();
                let open = counted_open
                    || (puts && !s.nbi_puts.is_empty())
                    || (gets && !s.nbi_gets.is_empty());
                if !open {
                    return r.map(|_| true);
                }
                if !wait {
                    return r.map(|_| false);
                }
            }
            match progressed {
                true => b.progressed(),
                false => b.idle(self.core.conduit.as_mut())?,
            }
        }
    }

    /// gasnet_wait_syncnbi_all.
    pub fn wait_syncnbi_all(&mut self) -> Result<(), GasnetError> {
        self.sync_nbi(true, true, true).map(|_| ())
    }

    pub fn wait_syncnbi_puts(&mut self) -> Result<(), GasnetError> {
        self.sync_nbi(true, false, true).map(|_| ())
    }

    pub fn wait_syncnbi_gets(&mut self) -> Result<(), GasnetError> {
        self.sync_nbi(false, true, true).map(|_| ())
    }

    /// gasnet_try_syncnbi_all.
    pub fn try_syncnbi_all(&mut self) -> Result<bool, GasnetError> {
        self.sync_nbi(true, true, false)
    }

    pub fn try_syncnbi_puts(&mut self) -> Result<bool, GasnetError> {
        self.sync_nbi(true, false, false)
    }

    pub fn try_syncnbi_gets(&mut self) -> Result<bool, GasnetError> {
        self.sync_nbi(false, true, false)
    }

    /// gasnet_begin_nbi_accessregion.
    pub fn begin_nbi_accessregion(&mut self) {
        self.ext.borrow_mut().open_region = Some(Vec::new());
    }

    /// gasnet_end_nbi_accessregion: one handle for every implicit operation started since.
    pub fn end_nbi_accessregion(&mut self) -> Handle {
        let mut s = self.ext.borrow_mut();
        let ops = s.open_region.take().unwrap_or_default();
        s.nbi_puts.retain(|o| !ops.contains(o));
        s.nbi_gets.retain(|o| !ops.contains(o));
        s.next_op += 1;
        let h = s.next_op;
        s.regions.insert(h, ops);
        Handle(h)
    }

    // ---------------------------------------------------------------- barrier

    /// gasnet_barrier_notify.
    pub fn barrier_notify(&mut self, id: u32, flags: BarrierFlags) -> Result<(), GasnetError> {
        let phase = {
            let mut s = self.ext.borrow_mut();
            if s.notified.is_some() {
                return Err(GasnetError::BarrierState);
            }
            s.phase += 1;
            s.notified = Some((id, flags.0));
            s.phase
        };
        self.am_request_short(0, H_BAR_NOTIFY, &[phase, id, flags.0])
    }

    /// gasnet_barrier_try: `Ok(true)` once every node notified; `Err(BarrierMismatch)` then if
    /// ids disagreed.
    pub fn barrier_try(&mut self, id: u32, flags: BarrierFlags) -> Result<bool, GasnetError> {
        let phase = {
            let s = self.ext.borrow();
            match s.notified {
                Some((nid, nf))
                    if nf & BarrierFlags::ANONYMOUS.0 != 0
                        || flags.0 & BarrierFlags::ANONYMOUS.0 != 0
                        || nid == id =>
                {
                    s.phase
                }
                _ => return Err(GasnetError::BarrierState),
            }
        };
        self.poll_once()?;
        if self.mynode() == 0 {
            let ready = {
                let mut s = self.ext.borrow_mut();
                let n = self.core.conduit.nodes();
                match s.arrivals.get_mut(&phase) {
                    Some(e) if e.0 == n && !e.3 => {
                        e.3 = true;
                        Some(e.2)
                    }
                    _ => None,
                }
            };
            if let Some(mismatch) = ready {
                for node in 0..self.nodes() {
                    self.am_request_short(node, H_BAR_DONE, &[phase, mismatch as u32])?;
                }
                self.ext.borrow_mut().arrivals.remove(&phase);
                self.poll_once()?;
            }
        }
        let mut s = self.ext.borrow_mut();
        match s.done.remove(&phase) {
            Some(mismatch) => {
                s.notified = None;
                if mismatch {
                    Err(GasnetError::BarrierMismatch)
                } else {
                    Ok(true)
                }
            }
            None => Ok(false),
        }
    }

    /// gasnet_barrier_wait.
    pub fn barrier_wait(&mut self, id: u32, flags: BarrierFlags) -> Result<(), GasnetError> {
        let mut b = super::backoff::Backoff::default();
        loop {
            let before = self.core.delivered();
            if self.barrier_try(id, flags)? {
                return Ok(());
            }
            if self.core.delivered() != before {
                b.progressed();
            } else {
                b.idle(self.core.conduit.as_mut())?;
            }
        }
    }

    /// An anonymous barrier (notify + wait).
    pub fn barrier(&mut self) -> Result<(), GasnetError> {
        self.barrier_notify(0, BarrierFlags::ANONYMOUS)?;
        self.barrier_wait(0, BarrierFlags::ANONYMOUS)
    }
}
