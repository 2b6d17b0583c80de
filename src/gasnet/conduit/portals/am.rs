//! Active Messages of the portals conduit: requests from ReqSB slots into the target's ReqRB
//! under credit, replies into the request's own slot, the events of both, and the matching of
//! Long headers with payloads put in place.

use std::time::{Duration, Instant};

use super::credit::{self, Carry};
use super::{
    err, Parked, PortalsConduit, ReqSlot, AM_PT, BITS_AM, CATCH_ME, LONG_TAG, MAX_AM, MAX_LONG,
    PACKED_MAX, RARAM_PT, REPLY_ME, REPLY_PT, REP_SLOTS, REP_TAG, REQ_SLOTS, RMA_TAG,
};
use crate::gasnet::am::{self, IN_PLACE_LEN};
use crate::gasnet::GasnetError;
use crate::portals::{
    me_opt, AckReq, Buffer, Event, EventKind, List, Me, NiFail, ProcessId, Target,
};

/// `reply_to` of a request that is owed an answer: OWED | slot | ask << 16 | length << 32.
/// Anything without the bit (replies) is owed nothing.
const OWED: u64 = 1 << 31;
/// A refused request goes again after this, doubling per refusal up to `RESEND_MAX`.
const RESEND_FIRST: Duration = Duration::from_micros(20);
const RESEND_MAX: Duration = Duration::from_millis(5);

/// How a Long travels: packed behind the header, or put in place (the AM then carries
/// `IN_PLACE_LEN` bytes naming it).
fn wire_len(am: &[u8], long: Option<&[u8]>) -> Result<(usize, bool), GasnetError> {
    let (extra, in_place) = match long {
        None => (0, false),
        Some(p) if p.len() <= PACKED_MAX => (p.len(), false),
        Some(p) if p.len() <= MAX_LONG => (IN_PLACE_LEN, true),
        Some(p) => return Err(GasnetError::TooLarge(p.len())),
    };
    let len = am.len() + extra;
    if len > MAX_AM {
        return Err(GasnetError::TooLarge(len));
    }
    Ok((len, in_place))
}

impl PortalsConduit {
    pub(super) fn post_rb(&mut self, i: usize) -> Result<(), GasnetError> {
        let mut e = Me::new(
            Buffer {
                region: self.rb.handle,
                offset: (i * self.rb_len) as u64,
                len: self.rb_len as u64,
            },
            0,
        );
        e.ignore_bits = u64::MAX;
        e.options = me_opt::OP_PUT | me_opt::MANAGE_LOCAL | me_opt::EVENT_LINK_DISABLE;
        e.min_free = MAX_AM as u64;
        self.p
            .me_append(self.ni, AM_PT, &e, List::Priority, i as u64)
            .map_err(err)?;
        Ok(())
    }

    /// A request, if a slot and credit are there (else `Ok(false)`, nothing sent).
    pub(super) fn try_request(
        &mut self,
        dest: u32,
        am: &[u8],
        long: Option<&[u8]>,
    ) -> Result<bool, GasnetError> {
        if dest >= self.n {
            return Err(GasnetError::BadNode(dest));
        }
        let (len, in_place) = wire_len(am, long)?;
        let mut carry = None;
        for first in [true, false] {
            if !self.free_req.is_empty() {
                carry = match self.credits_on {
                    true => self.credits.take(dest, len),
                    false => Some(Carry::default()),
                };
            }
            if carry.is_some() || !first {
                break;
            }
            // Replies that came meanwhile free slots and give credit back.
            self.poll_safe()?;
        }
        let Some(carry) = carry else {
            return Ok(false);
        };
        let slot = self.free_req.pop().expect("a free slot was checked");
        let lid = match (long, in_place) {
            (Some(p), true) => Some(self.put_long(dest, am, p)?),
            _ => None,
        };
        self.write_am(slot * MAX_AM, am, long, lid, len);
        let hdr = slot as u64 | (carry.ask as u64) << 16 | carry.repay << 32;
        self.req[slot] = Some(ReqSlot {
            dest,
            len,
            hdr,
            // Credited, it always finds room: its reply says all (see `put_request`).
            acked: self.credits_on,
            answered: false,
            refused: 0,
        });
        self.put_request(slot)?;
        Ok(true)
    }

    /// Answers a request delivered with `reply_to`: the reply into its slot at the requester,
    /// granting back its cost (and a loan if it asked); an empty put when the handler sent none.
    pub(super) fn send_reply(
        &mut self,
        dest: u32,
        reply_to: u64,
        reply: Option<(&[u8], Option<&[u8]>)>,
    ) -> Result<(), GasnetError> {
        if reply_to & OWED == 0 || dest >= self.n {
            // Not a request we took (a reply, or a request header that came as a reply).
            self.protocol_errors += reply.is_some() as u64;
            return Ok(());
        }
        let slot = reply_to & 0xffff;
        let (ask, req_len) = (reply_to & 1 << 16 != 0, (reply_to >> 32) as usize);
        let grant = match self.credits_on {
            true => self.credits.grant(dest, req_len, ask),
            false => credit::cost(req_len),
        };
        let t = Target {
            id: ProcessId::Logical { rank: dest },
            pt_index: REPLY_PT,
            match_bits: 0,
            remote_offset: slot * MAX_AM as u64,
        };
        let Some((am, long)) = reply else {
            // The implicit reply: nothing to deliver, only the slot and credit to give back.
            return self
                .p
                .put(self.ni, self.sb_md, 0, 0, AckReq::NoAck, t, 0, grant)
                .map_err(err);
        };
        let (len, in_place) = wire_len(am, long)?;
        // A reply slot frees on its SEND event: the reply is the answer, so nothing answers it
        // (and its requester's NIC sends nothing back for it).
        let r = loop {
            if let Some(r) = self.free_rep.pop() {
                break r;
            }
            self.wait_step()?;
        };
        let lid = match (long, in_place) {
            (Some(p), true) => Some(self.put_long(dest, am, p)?),
            _ => None,
        };
        let at = (REQ_SLOTS + r) * MAX_AM;
        self.write_am(at, am, long, lid, len);
        self.p
            .put(
                self.ni,
                self.rep_md,
                at as u64,
                len as u64,
                AckReq::NoAck,
                t,
                REP_TAG | r as u64,
                grant,
            )
            .map_err(err)
    }

    /// Writes an AM into ReqSB at `at`: the encoded header, then a packed Long's payload or
    /// the fields naming one put in place.
    fn write_am(
        &mut self,
        at: usize,
        am: &[u8],
        long: Option<&[u8]>,
        lid: Option<u64>,
        len: usize,
    ) {
        let buf = &mut self.sb.bytes()[at..at + len];
        buf[..am.len()].copy_from_slice(am);
        match (long, lid) {
            (Some(p), Some(lid)) => am::mark_in_place(buf, p.len() as u32, lid),
            (Some(p), None) => buf[am.len()..].copy_from_slice(p),
            (None, _) => {}
        }
    }

    /// Puts a Long's payload straight into `dest`'s segment (RARAM), from a bounce copy so the
    /// caller may reuse its buffer at once; returns its Lid.
    fn put_long(&mut self, dest: u32, header: &[u8], payload: &[u8]) -> Result<u64, GasnetError> {
        let Some((h, _)) = am::decode(header) else {
            return Err(GasnetError::Setup(
                "a Long without an encoded header".into(),
            ));
        };
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
        Ok(lid)
    }

    fn put_request(&mut self, slot: usize) -> Result<(), GasnetError> {
        let s = self.req[slot].expect("slot in use");
        let t = Target {
            id: ProcessId::Logical { rank: s.dest },
            pt_index: AM_PT,
            match_bits: BITS_AM,
            remote_offset: 0,
        };
        let at = (slot * MAX_AM) as u64;
        // A credited request always finds room in a ReqRB (see `credit`), so no ACK is asked:
        // its reply frees the slot. Without credits the ACK says whether it must go again.
        let ack = match self.credits_on {
            true => AckReq::NoAck,
            false => AckReq::Ack,
        };
        self.p
            .put(
                self.ni,
                self.sb_md,
                at,
                s.len as u64,
                ack,
                t,
                slot as u64,
                s.hdr,
            )
            .map_err(err)
    }

    /// The next event of `eq`; its overflow (PTL_EQ_DROPPED: events lost) is an error, since
    /// every queue here is sized or flow-controlled never to overflow.
    fn next_event(&mut self, eq: u32, name: &str) -> Result<Option<Event>, GasnetError> {
        match self.p.eq_get(self.ni, eq) {
            Ok((_, true)) => Err(GasnetError::Wait(format!(
                "{name} overflowed: events were lost"
            ))),
            Ok((e, false)) => Ok(Some(e)),
            Err(_) => Ok(None),
        }
    }

    /// Handles the send side's events (ACKs, replies, direct operations) and sends again the
    /// refused requests that are due. Returns whether anything happened.
    pub(super) fn poll_safe(&mut self) -> Result<bool, GasnetError> {
        let mut any = false;
        while let Some(e) = self.next_event(self.safe_eq, "SAFE_EQ (sized for all in flight)")? {
            let up = e.user_ptr;
            if up & RMA_TAG != 0 {
                self.rma_event(up, e.kind, e.ni_fail);
            } else if up & LONG_TAG != 0 {
                if e.kind == EventKind::Ack {
                    // The payload is in place (its bounce copy is free) or could not be.
                    self.ring.free(up & !LONG_TAG);
                    if e.ni_fail != NiFail::Ok {
                        return Err(GasnetError::Wait(format!(
                            "a Long payload was refused by its target ({:?})",
                            e.ni_fail
                        )));
                    }
                }
            } else if up == REPLY_ME {
                if e.kind == EventKind::Put {
                    self.answered(&e);
                }
            } else if up & REP_TAG != 0 {
                let r = (up & !REP_TAG) as usize;
                if e.kind == EventKind::Send && r < REP_SLOTS {
                    self.free_rep.push(r);
                }
                // A reply slot coming free is bookkeeping, not news a wait is waiting for:
                // counted as progress, it kept a rank that had just replied spinning on the
                // core its requester shared with it, whose answer had already arrived.
                continue;
            } else if e.kind == EventKind::Ack {
                self.request_acked(&e);
            }
            any = true;
        }
        if !self.resend.is_empty() {
            let now = Instant::now();
            let mut due = Vec::new();
            self.resend.retain(|&(t, slot)| {
                let ready = t <= now;
                if ready {
                    due.push(slot);
                }
                !ready
            });
            for slot in due {
                self.put_request(slot)?;
            }
        }
        Ok(any)
    }

    /// The ACK of a request: its target took it, or — no ReqRB linked (the catch-basin took
    /// nothing of it) or its AM portal disabled by flow control — it goes again later.
    fn request_acked(&mut self, e: &Event) {
        let slot = e.user_ptr as usize;
        let Some(s) = self.req.get_mut(slot).and_then(|s| s.as_mut()) else {
            return;
        };
        if e.ni_fail != NiFail::Ok || e.mlength < s.len as u64 {
            let wait = (RESEND_FIRST * (1 << s.refused.min(8))).min(RESEND_MAX);
            s.refused += 1;
            self.resent += 1;
            self.resend.push((Instant::now() + wait, slot));
            return;
        }
        s.acked = true;
        if s.answered {
            self.free_slot(slot);
        }
    }

    /// A reply landed in one of our request slots: the credit it grants, its AM for delivery
    /// (none for an implicit reply), and the slot free once the request's ACK came too.
    fn answered(&mut self, e: &Event) {
        let ProcessId::Logical { rank } = e.initiator else {
            self.protocol_errors += 1;
            return;
        };
        let slot = (e.start / MAX_AM as u64) as usize;
        let ok = e.ni_fail == NiFail::Ok
            && e.start.is_multiple_of(MAX_AM as u64)
            && e.mlength == e.rlength
            && e.mlength <= MAX_AM as u64;
        let s = match self.req.get(slot).copied().flatten() {
            Some(s) if ok && s.dest == rank && !s.answered => s,
            _ => {
                self.protocol_errors += 1;
                return;
            }
        };
        if self.credits_on {
            self.credits.granted(rank, s.len, e.hdr_data);
        }
        if e.mlength > 0 {
            let at = e.start as usize;
            let mut data = self.pool.take();
            data.extend_from_slice(&self.sb.bytes()[at..at + e.mlength as usize]);
            self.arrive(rank, 0, data);
        }
        let s = self.req[slot].as_mut().expect("checked");
        s.answered = true;
        if s.acked {
            self.free_slot(slot);
        }
    }

    fn free_slot(&mut self, slot: usize) {
        self.req[slot] = None;
        self.free_req.push(slot);
    }

    /// Takes the requests that landed in ReqRB out (for delivery, owed an answer), re-posts the
    /// buffers that filled up, and re-enables the AM portal if flow control disabled it.
    pub(super) fn drain_am(&mut self) -> Result<bool, GasnetError> {
        let mut any = false;
        let mut repost = Vec::new();
        let mut enable = false;
        while let Some(e) = self.next_event(self.am_eq, "AM_EQ (despite flow control)")? {
            any = true;
            match e.kind {
                EventKind::Put if e.user_ptr != CATCH_ME => self.request_arrived(&e),
                EventKind::AutoUnlink => repost.push(e.user_ptr as usize),
                EventKind::PtDisabled => enable = true,
                _ => {}
            }
        }
        // Re-posting goes to the NIC before any reply that gives this space's credit back.
        for i in repost {
            self.post_rb(i)?;
        }
        if enable {
            self.p.pt_enable(self.ni, AM_PT).map_err(err)?;
        }
        Ok(any)
    }

    fn request_arrived(&mut self, e: &Event) {
        let (ProcessId::Logical { rank }, NiFail::Ok) = (e.initiator, e.ni_fail) else {
            return;
        };
        let slot = e.hdr_data & 0xffff;
        let (at, len) = (e.start as usize, e.mlength as usize);
        let fits = at.checked_add(len).is_some_and(|end| end <= self.rb.len());
        if rank >= self.n || slot >= REQ_SLOTS as u64 || e.mlength != e.rlength || !fits {
            self.protocol_errors += 1;
            return;
        }
        if self.credits_on {
            self.credits.repaid(rank, e.hdr_data >> 32);
        }
        let mut data = self.pool.take();
        data.extend_from_slice(&self.rb.bytes()[at..at + len]);
        let reply_to = OWED | slot | (e.hdr_data & 1 << 16) | (len as u64) << 32;
        self.arrive(rank, reply_to, data);
    }

    /// An AM ready for delivery, or — a Long header whose payload is still on its way — parked
    /// until RARAM reports it.
    fn arrive(&mut self, src: u32, reply_to: u64, am: Vec<u8>) {
        match am::decode(&am) {
            Some((h, p)) if h.in_place => {
                let (len, lid) = am::in_place_fields(p);
                self.parked.push(Parked {
                    src,
                    reply_to,
                    am,
                    lid,
                    len: len as u64,
                });
            }
            _ => self.arrived.push_back((src, reply_to, am)),
        }
    }

    /// Takes RARAM's PUT events and releases the Long headers whose payload is complete.
    pub(super) fn drain_raram(&mut self) -> Result<bool, GasnetError> {
        let mut any = false;
        while let Some(e) = self.next_event(self.raram_eq, "RARAM's EQ (Long payloads)")? {
            any = true;
            if let (EventKind::Put, NiFail::Ok, ProcessId::Logical { rank }) =
                (e.kind, e.ni_fail, e.initiator)
            {
                self.payload_landed(rank, e.hdr_data, e.mlength);
            }
        }
        if !self.parked.is_empty() {
            for p in std::mem::take(&mut self.parked) {
                match self.landed.get(&(p.src, p.lid)) {
                    Some(&got) if got >= p.len => {
                        self.landed.remove(&(p.src, p.lid));
                        self.landed_from[p.src as usize] -= 1;
                        self.arrived.push_back((p.src, p.reply_to, p.am));
                    }
                    _ => self.parked.push(p),
                }
            }
        }
        Ok(any)
    }

    /// Records Long payload bytes from `src` under `lid`. A sender has at most one Long per
    /// request or reply slot in flight, so more Lids than that waiting for their headers is a
    /// peer breaking the protocol: counted, and not kept (memory stays bounded).
    fn payload_landed(&mut self, src: u32, lid: u64, bytes: u64) {
        if let Some(got) = self.landed.get_mut(&(src, lid)) {
            *got += bytes;
            return;
        }
        match self.landed_from.get_mut(src as usize) {
            Some(k) if (*k as usize) < REQ_SLOTS + REP_SLOTS => {
                *k += 1;
                self.landed.insert((src, lid), bytes);
            }
            _ => self.protocol_errors += 1,
        }
    }
}
