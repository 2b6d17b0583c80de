//! The portals conduit: Active Messages through the soft NIC's Portals engine, after the
//! GASNet-over-Portals design. Matching, data placement and events happen in the NIC; the
//! process only handles the events.
//!
//! - ReqRB: two locally managed receive buffers on the AM portal (`MANAGE_LOCAL`, `min_free`
//!   = one maximal AM) with their own event queue (AM_EQ). Messages pack into them; a full one
//!   unlinks itself (PTL_EVENT_AUTO_UNLINK) and is re-posted once its events are handled, so
//!   one is always linked (double buffering).
//! - ReqSB: a ring of send slots in one MD reporting to SAFE_EQ. Each AM is a put with ACK from
//!   a slot; the ACK frees the slot, so a slot is a send token (no more AMs in flight than slots).
//! - Flow control: an AM the target could not take (no receive buffer linked: DROPPED) is sent
//!   again from its slot, which still holds it.
//! - RAR: the segment, registered with the NIC, is exposed on its own portal (ignore-all match
//!   bits, puts and gets, no target events). Extended puts and gets go straight to Portals put
//!   and get — from or into the segment directly, else through a bounce region — and complete
//!   from their ACK and REPLY events on SAFE_EQ, never through Active Messages. Remote
//!   atomics are Portals atomics on the same portal, run by the target's NIC.
//! - Long: payloads up to `PACKED_MAX` ride in the AM (packed Long). Larger ones are put
//!   straight into the target's segment through RARAM (the segment again, on its own portal,
//!   with PUT events on its own EQ) with a Long id (Lid) in `hdr_data`, and the header follows
//!   as an AM naming the Lid and length; the target runs the handler once both have arrived,
//!   in whichever order they came.

use std::collections::VecDeque;

use rustc_hash::FxHashMap as HashMap;

use super::{Conduit, GetDest, RmaDone};
use crate::gasnet::atomic::PortalsCall;
use crate::gasnet::{AdOp, GasnetError};
use crate::nic::memory::Perms;
use crate::portals::{
    AckReq, Buffer, EventKind, List, Md, Me, NiFail, NiHandle, Portals, ProcessId, Target,
};

const AM_PT: u32 = 10;
const MAX_AM: usize = 16 * 1024;
const RB_LEN: usize = 2 << 20;
const RBS: usize = 2;
const SLOTS: usize = 256;
const BITS_AM: u64 = 0xa11;
const RAR_PT: u32 = 11;
/// Largest piece of one direct transfer, and the bounce region (two pieces).
const CHUNK: usize = 1 << 20;
const BOUNCE_LEN: usize = 2 * CHUNK;
/// Most direct pieces in flight (SAFE_EQ holds their completions).
const MAX_RMA: usize = 256;
/// `user_ptr` of direct pieces: tag | op << 16 | piece.
const RMA_TAG: u64 = 1 << 63;
/// `user_ptr` of Long payload puts: tag | bounce offset.
const LONG_TAG: u64 = 1 << 62;
/// The portal of Long payloads (RARAM).
const RARAM_PT: u32 = 12;
/// Long payloads up to this ride inside the AM.
const PACKED_MAX: usize = 8 * 1024;
/// Largest Long payload (AMMaxLongRequest/Reply): one piece of the bounce region.
const MAX_LONG: usize = CHUNK;
/// RARAM's event queue: one event per Long payload not yet matched with its header.
const RARAM_EQ_LEN: usize = 16_384;

/// A direct operation in flight.
struct Rma {
    remaining: usize,
    ok: bool,
    /// Gets into a caller's buffer: the data, and per piece its bounce offset.
    data: Option<Vec<u8>>,
    pieces: Vec<Option<u64>>,
}

pub struct PortalsConduit {
    p: Portals,
    ni: NiHandle,
    am_eq: u32,
    safe_eq: u32,
    rb: crate::gni::MemRegion,
    sb: crate::gni::MemRegion,
    md: u32,
    free_slots: Vec<usize>,
    /// (dest, length) of each slot in flight.
    in_flight: Vec<Option<(u32, usize)>>,
    me: u32,
    n: u32,
    retries: u64,
    /// Slots whose AM must go again.
    pending: VecDeque<usize>,
    seg: crate::gni::MemRegion,
    seg_md: u32,
    bounce: crate::gni::MemRegion,
    bounce_md: u32,
    bounce_used: usize,
    bounce_refs: usize,
    rma: HashMap<u64, Rma>,
    rma_in_flight: usize,
    finished: Vec<RmaDone>,
    /// AMs taken out of ReqRB while a send waited for a slot, for the next poll to deliver.
    arrived: VecDeque<(u32, Vec<u8>)>,
    raram_eq: u32,
    next_lid: u64,
    /// Long payload bytes landed per (source, Lid) whose header has not come yet.
    landed: HashMap<(u32, u64), u64>,
    /// Long headers whose payload has not fully landed yet: (source, AM, Lid, length).
    parked: Vec<(u32, Vec<u8>, u64, u64)>,
}

fn err<E: std::fmt::Display>(e: E) -> GasnetError {
    GasnetError::Setup(format!("portals conduit: {e}"))
}

impl PortalsConduit {
    pub fn new(segment_len: usize) -> Result<PortalsConduit, GasnetError> {
        let mut p = Portals::init().map_err(err)?;
        let (ni, _) = p.ni_init(true, true).map_err(err)?;
        let am_eq = p.eq_alloc(ni, 16_384).map_err(err)?;
        let safe_eq = p.eq_alloc(ni, SLOTS + MAX_RMA + 64).map_err(err)?;
        p.pt_alloc(ni, 0, Some(am_eq), Some(AM_PT)).map_err(err)?;
        let rb = p
            .nic()
            .mem_register(RB_LEN * RBS, Perms::WRITE)
            .map_err(err)?;
        let sb = p
            .nic()
            .mem_register(MAX_AM * SLOTS, Perms(0))
            .map_err(err)?;
        let md = p
            .md_bind(
                ni,
                &Md {
                    region: sb.clone(),
                    segments: vec![(0, (MAX_AM * SLOTS) as u64)],
                    options: crate::portals::md_opt::EVENT_SEND_DISABLE,
                    eq: Some(safe_eq),
                    ct: None,
                },
            )
            .map_err(err)?;
        let seg = p
            .nic()
            .mem_register(segment_len.max(8), Perms::READ_WRITE)
            .map_err(err)?;
        let bounce = p.nic().mem_register(BOUNCE_LEN, Perms(0)).map_err(err)?;
        let quiet = crate::portals::md_opt::EVENT_SEND_DISABLE;
        let seg_md = p
            .md_bind(
                ni,
                &Md {
                    region: seg.clone(),
                    segments: vec![(0, seg.len() as u64)],
                    options: quiet,
                    eq: Some(safe_eq),
                    ct: None,
                },
            )
            .map_err(err)?;
        let bounce_md = p
            .md_bind(
                ni,
                &Md {
                    region: bounce.clone(),
                    segments: vec![(0, BOUNCE_LEN as u64)],
                    options: quiet,
                    eq: Some(safe_eq),
                    ct: None,
                },
            )
            .map_err(err)?;
        p.pt_alloc(ni, 0, Some(safe_eq), Some(RAR_PT))
            .map_err(err)?;
        let mut rar = Me::new(
            Buffer {
                region: seg.clone(),
                offset: 0,
                len: seg.len() as u64,
            },
            0,
        );
        rar.ignore_bits = u64::MAX;
        rar.options |=
            crate::portals::me_opt::EVENT_COMM_DISABLE | crate::portals::me_opt::EVENT_LINK_DISABLE;
        p.me_append(ni, RAR_PT, &rar, List::Priority, 0)
            .map_err(err)?;
        let raram_eq = p.eq_alloc(ni, RARAM_EQ_LEN).map_err(err)?;
        p.pt_alloc(ni, 0, Some(raram_eq), Some(RARAM_PT))
            .map_err(err)?;
        let mut raram = rar.clone();
        raram.options &= !crate::portals::me_opt::EVENT_COMM_DISABLE;
        p.me_append(ni, RARAM_PT, &raram, List::Priority, 0)
            .map_err(err)?;
        let me = p.nic().rank();
        let n = p.nic().size();
        let mut c = PortalsConduit {
            p,
            ni,
            am_eq,
            safe_eq,
            rb,
            sb,
            md,
            free_slots: (0..SLOTS).rev().collect(),
            in_flight: vec![None; SLOTS],
            me,
            n,
            retries: 0,
            pending: VecDeque::new(),
            seg,
            seg_md,
            bounce,
            bounce_md,
            bounce_used: 0,
            bounce_refs: 0,
            rma: HashMap::default(),
            rma_in_flight: 0,
            finished: Vec::new(),
            arrived: VecDeque::new(),
            raram_eq,
            next_lid: 0,
            landed: HashMap::default(),
            parked: Vec::new(),
        };
        for i in 0..RBS {
            c.post_rb(i)?;
        }
        // Everyone's receive buffers are posted before anyone sends.
        c.p.nic().barrier().map_err(err)?;
        Ok(c)
    }

    fn post_rb(&mut self, i: usize) -> Result<(), GasnetError> {
        let mut e = Me::new(
            Buffer {
                region: self.rb.clone(),
                offset: (i * RB_LEN) as u64,
                len: RB_LEN as u64,
            },
            0,
        );
        e.ignore_bits = u64::MAX;
        e.options = crate::portals::me_opt::OP_PUT
            | crate::portals::me_opt::MANAGE_LOCAL
            | crate::portals::me_opt::EVENT_LINK_DISABLE;
        e.min_free = MAX_AM as u64;
        self.p
            .me_append(self.ni, AM_PT, &e, List::Priority, i as u64)
            .map_err(err)?;
        Ok(())
    }

    fn put_slot(&mut self, slot: usize) -> Result<(), GasnetError> {
        let (dest, len) = self.in_flight[slot].expect("slot in flight");
        let t = Target {
            id: ProcessId::Logical { rank: dest },
            pt_index: AM_PT,
            match_bits: BITS_AM,
            remote_offset: 0,
        };
        self.p
            .put(
                self.ni,
                self.md,
                (slot * MAX_AM) as u64,
                len as u64,
                AckReq::Ack,
                t,
                slot as u64,
                0,
            )
            .map_err(err)
    }

    /// Moves the AMs that landed in ReqRB to `arrived` and re-posts the buffers that filled up.
    fn drain_am(&mut self) -> Result<bool, GasnetError> {
        let mut any = false;
        let mut repost = Vec::new();
        while let Ok((e, _)) = self.p.eq_get(self.ni, self.am_eq) {
            any = true;
            match e.kind {
                EventKind::Put if e.ni_fail == NiFail::Ok => {
                    let ProcessId::Logical { rank } = e.initiator else {
                        continue;
                    };
                    let at = e.start as usize;
                    match at.checked_add(e.mlength as usize) {
                        Some(end) if end <= self.rb.len() => {
                            let data = self.rb.bytes()[at..end].to_vec();
                            self.arrive(rank, data);
                        }
                        _ => {}
                    }
                }
                EventKind::AutoUnlink => repost.push(e.user_ptr as usize),
                _ => {}
            }
        }
        for i in repost {
            self.post_rb(i)?;
        }
        Ok(any)
    }

    /// An AM out of ReqRB: ready for delivery, or — a Long header whose payload is still on
    /// its way — parked until RARAM reports it.
    fn arrive(&mut self, rank: u32, am: Vec<u8>) {
        match crate::gasnet::am::decode(&am) {
            Some((h, p)) if h.in_place => {
                let (len, lid) = crate::gasnet::am::in_place_fields(p);
                self.parked.push((rank, am, lid, len as u64));
            }
            _ => self.arrived.push_back((rank, am)),
        }
    }

    /// Takes RARAM's PUT events and releases the Long headers whose payload is complete.
    fn drain_raram(&mut self) -> Result<bool, GasnetError> {
        let mut any = false;
        while let Ok((e, dropped)) = self.p.eq_get(self.ni, self.raram_eq) {
            if dropped {
                return Err(GasnetError::Wait(format!(
                    "RARAM event queue overflowed ({RARAM_EQ_LEN}): Long payloads lost track of"
                )));
            }
            any = true;
            if let (EventKind::Put, NiFail::Ok, ProcessId::Logical { rank }) =
                (e.kind, e.ni_fail, e.initiator)
            {
                *self.landed.entry((rank, e.hdr_data)).or_default() += e.mlength;
            }
        }
        if !self.parked.is_empty() {
            let parked = std::mem::take(&mut self.parked);
            for (rank, am, lid, len) in parked {
                match self.landed.get(&(rank, lid)) {
                    Some(&got) if got >= len => {
                        self.landed.remove(&(rank, lid));
                        self.arrived.push_back((rank, am));
                    }
                    _ => self.parked.push((rank, am, lid, len)),
                }
            }
        }
        Ok(any)
    }

    /// One turn of a wait inside the conduit (for a send slot, bounce space, an RMA slot):
    /// the send side's events, and what arrived in ReqRB taken out and re-posted — a peer may
    /// itself be waiting in a send for room in our ReqRB. No handler runs here.
    fn wait_step(&mut self) -> Result<(), GasnetError> {
        if !self.poll_safe()? && !self.drain_am()? && !self.drain_raram()? {
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Handles the send side's events: ACKs free slots; refused AMs go again.
    fn poll_safe(&mut self) -> Result<bool, GasnetError> {
        let mut any = false;
        while let Ok((e, _)) = self.p.eq_get(self.ni, self.safe_eq) {
            any = true;
            if e.user_ptr & RMA_TAG != 0 {
                self.rma_event(e.user_ptr, e.kind, e.ni_fail);
                continue;
            }
            if e.user_ptr & LONG_TAG != 0 {
                if e.kind == EventKind::Ack {
                    // The payload is in place (its bounce copy is free) or could not be.
                    self.bounce_refs -= 1;
                    if e.ni_fail != NiFail::Ok {
                        return Err(GasnetError::Wait(format!(
                            "a Long payload was refused by its target ({:?})",
                            e.ni_fail
                        )));
                    }
                }
                continue;
            }
            if e.kind != EventKind::Ack {
                continue;
            }
            let slot = e.user_ptr as usize;
            if slot >= SLOTS || self.in_flight[slot].is_none() {
                continue;
            }
            if e.ni_fail == NiFail::Ok {
                self.in_flight[slot] = None;
                self.free_slots.push(slot);
            } else {
                // The target had no room: send it again (after the target polls, it re-posts).
                self.retries += 1;
                self.pending.push_back(slot);
            }
        }
        while let Some(slot) = self.pending.pop_front() {
            self.put_slot(slot)?;
        }
        Ok(any)
    }

    /// Starts tracking a direct operation of `pieces` pieces (`data`: a get's destination).
    fn begin_rma(&mut self, op: u64, pieces: usize, data: Option<Vec<u8>>) {
        self.rma.insert(
            op,
            Rma {
                remaining: pieces,
                ok: true,
                data,
                pieces: vec![None; pieces],
            },
        );
    }

    /// A direct piece finished (ACK of a put, REPLY of a get).
    fn rma_event(&mut self, user_ptr: u64, kind: EventKind, fail: NiFail) {
        if kind != EventKind::Ack && kind != EventKind::Reply {
            return;
        }
        let (op, piece) = ((user_ptr & !RMA_TAG) >> 16, (user_ptr & 0xffff) as usize);
        let Some(r) = self.rma.get_mut(&op) else {
            return;
        };
        self.rma_in_flight -= 1;
        r.ok &= fail == NiFail::Ok;
        if let Some(Some(b)) = r.pieces.get(piece).copied() {
            self.bounce_refs -= 1;
            if let Some(data) = r.data.as_mut() {
                let at = piece * CHUNK;
                let n = (data.len() - at).min(CHUNK);
                data[at..at + n].copy_from_slice(&self.bounce.bytes()[b as usize..b as usize + n]);
            }
        }
        r.remaining -= 1;
        if r.remaining == 0 {
            let r = self.rma.remove(&op).expect("present");
            self.finished.push(RmaDone {
                op,
                ok: r.ok,
                data: r.data.unwrap_or_default(),
            });
        }
    }

    /// `len` bytes of bounce space, waiting for earlier pieces to drain when it is short.
    fn bounce_alloc(&mut self, len: usize) -> Result<u64, GasnetError> {
        if self.bounce_used + len > BOUNCE_LEN {
            while self.bounce_refs > 0 {
                self.wait_step()?;
            }
            self.bounce_used = 0;
        }
        let at = self.bounce_used;
        self.bounce_used += len;
        self.bounce_refs += 1;
        Ok(at as u64)
    }

    /// Bounce space for piece `piece` of direct operation `op`, released when it completes.
    fn bounce_piece(&mut self, op: u64, piece: usize, len: usize) -> Result<u64, GasnetError> {
        let b = self.bounce_alloc(len)?;
        if let Some(r) = self.rma.get_mut(&op) {
            r.pieces[piece] = Some(b);
        }
        Ok(b)
    }

    /// Waits for room for one more direct piece.
    fn rma_slot(&mut self) -> Result<(), GasnetError> {
        while self.rma_in_flight >= MAX_RMA {
            self.wait_step()?;
        }
        self.rma_in_flight += 1;
        Ok(())
    }

    fn rar(&self, node: u32, offset: u64) -> Target {
        Target {
            id: ProcessId::Logical { rank: node },
            pt_index: RAR_PT,
            match_bits: 0,
            remote_offset: offset,
        }
    }

    /// AMs resent because their target had no receive buffer posted at the time.
    pub fn retries(&self) -> u64 {
        self.retries
    }
}

impl Conduit for PortalsConduit {
    fn node(&self) -> u32 {
        self.me
    }

    fn nodes(&self) -> u32 {
        self.n
    }

    fn max_am(&self) -> usize {
        MAX_AM
    }

    fn segment(&mut self) -> &mut [u8] {
        self.seg.bytes()
    }

    fn rma_put(
        &mut self,
        node: u32,
        dest_offset: u64,
        src: &[u8],
        op: u64,
    ) -> Result<bool, GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let pieces = src.len().div_ceil(CHUNK).max(1);
        // A source inside the segment goes from there; any other from the bounce region.
        let base = self.seg.as_ptr() as usize;
        let in_seg = (src.as_ptr() as usize) >= base
            && (src.as_ptr() as usize) + src.len() <= base + self.seg.len();
        self.begin_rma(op, pieces, None);
        for i in 0..pieces {
            let part = &src[(i * CHUNK).min(src.len())..((i + 1) * CHUNK).min(src.len())];
            self.rma_slot()?;
            let (md, off) = if in_seg {
                (self.seg_md, (part.as_ptr() as usize - base) as u64)
            } else {
                let b = self.bounce_piece(op, i, part.len())?;
                self.bounce.bytes()[b as usize..b as usize + part.len()].copy_from_slice(part);
                (self.bounce_md, b)
            };
            let t = self.rar(node, dest_offset + (i * CHUNK) as u64);
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
        Ok(true)
    }

    fn rma_get(
        &mut self,
        node: u32,
        src_offset: u64,
        len: usize,
        dest: GetDest,
        op: u64,
    ) -> Result<bool, GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let pieces = len.div_ceil(CHUNK).max(1);
        let data = matches!(dest, GetDest::Buffer).then(|| vec![0u8; len]);
        self.begin_rma(op, pieces, data);
        for i in 0..pieces {
            let n = (len - (i * CHUNK).min(len)).min(CHUNK);
            self.rma_slot()?;
            let (md, off) = match dest {
                GetDest::Segment(base) => (self.seg_md, base + (i * CHUNK) as u64),
                GetDest::Buffer => (self.bounce_md, self.bounce_piece(op, i, n)?),
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
        Ok(true)
    }

    fn rma_atomic(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        [a, b]: [u64; 2],
        op: u64,
    ) -> Result<bool, GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let p = atomic.portals(a, b);
        let fetch = p.call != PortalsCall::Atomic;
        self.begin_rma(op, 1, fetch.then(|| vec![0; 8]));
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
        Ok(true)
    }

    fn name(&self) -> &'static str {
        "portals"
    }

    fn wait_news(&mut self, max: std::time::Duration) -> Result<(), GasnetError> {
        if !self.pending.is_empty() || !self.finished.is_empty() || !self.arrived.is_empty() {
            return Ok(());
        }
        self.p
            .eq_sleep(self.ni, &[self.am_eq, self.safe_eq, self.raram_eq], max)
            .map_err(|e| GasnetError::Wait(e.to_string()))
    }

    fn max_long(&self) -> usize {
        MAX_LONG
    }

    fn send_long(
        &mut self,
        dest: u32,
        mut header: Vec<u8>,
        payload: &[u8],
    ) -> Result<(), GasnetError> {
        if payload.len() <= PACKED_MAX {
            header.extend_from_slice(payload);
            return self.send(dest, &header);
        }
        if dest >= self.n {
            return Err(GasnetError::BadNode(dest));
        }
        if payload.len() > MAX_LONG {
            return Err(GasnetError::TooLarge(payload.len()));
        }
        let Some((h, _)) = crate::gasnet::am::decode(&header) else {
            return Err(GasnetError::Setup(
                "send_long: not an encoded AM header".into(),
            ));
        };
        // The payload goes first, from a bounce copy (the caller may reuse its buffer at once).
        self.next_lid += 1;
        let lid = self.next_lid;
        let at = self.bounce_alloc(payload.len())?;
        self.bounce.bytes()[at as usize..at as usize + payload.len()].copy_from_slice(payload);
        let t = Target {
            id: ProcessId::Logical { rank: dest },
            pt_index: RARAM_PT,
            match_bits: 0,
            remote_offset: h.offset,
        };
        self.p
            .put(
                self.ni,
                self.bounce_md,
                at,
                payload.len() as u64,
                AckReq::Ack,
                t,
                LONG_TAG | at,
                lid,
            )
            .map_err(err)?;
        // Then the header, marked in place, naming the length and the Lid.
        let am = crate::gasnet::am::in_place(header, payload.len() as u32, lid);
        self.send(dest, &am)
    }

    fn send(&mut self, dest: u32, am: &[u8]) -> Result<(), GasnetError> {
        if dest >= self.n {
            return Err(GasnetError::BadNode(dest));
        }
        if am.len() > MAX_AM {
            return Err(GasnetError::TooLarge(am.len()));
        }
        // A free slot is a send token: wait for ACKs (no handler runs inside a send).
        let slot = loop {
            if let Some(s) = self.free_slots.pop() {
                break s;
            }
            self.wait_step()?;
        };
        self.sb.bytes()[slot * MAX_AM..slot * MAX_AM + am.len()].copy_from_slice(am);
        self.in_flight[slot] = Some((dest, am.len()));
        self.put_slot(slot)
    }

    fn poll(
        &mut self,
        deliver: &mut dyn FnMut(u32, &[u8]),
        done: &mut dyn FnMut(RmaDone),
    ) -> Result<bool, GasnetError> {
        let mut any = self.poll_safe()?;
        for d in self.finished.drain(..) {
            any = true;
            done(d);
        }
        self.p.nic().progress();
        any |= self.drain_am()?;
        any |= self.drain_raram()?;
        for (rank, data) in self.arrived.drain(..) {
            deliver(rank, &data);
        }
        Ok(any)
    }
}
