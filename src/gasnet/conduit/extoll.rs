//! The extoll conduit (seed 004): GASNet's Core over EXTOLL's two engines through the soft NIC.
//! Short and Medium Active Messages go entirely over VELO; a Long's header goes over VELO and
//! its payload as RMA puts into the destination's segment, each raising a completer
//! notification there.
//!
//! On the wire an AM is the Core's encoding (header, 0–16 arguments, payload) cut into VELO
//! messages, in order, never interleaved with another AM of the same sender (`&mut self`: the
//! seed's AMLOCK). The VELO tag marks the section a message carries: [`TAG_HEADER`] starts an
//! AM (its first two bytes are the AM's length), [`TAG_HEADER_CONT`] continues the header and
//! arguments, [`TAG_DATA`] carries a Medium's payload, one full slot each. The receiver
//! reassembles per source (`gasnetc_am_header_recv` / `gasnetc_am_data_recv` in the seed).
//!
//! A Long's AM is delivered only once its payload is in place: its header arrives as an
//! in-place Long naming how many puts carry its payload (its tag), and waits for as many
//! completer notifications from the same source (both come in order per source, so they pair
//! up first with first). A payload from outside the segment is staged in pieces (see
//! `conduit::staging`), a put each, so the NIC sends one while the next is copied.
//!
//! Flow control: VELO's credits per destination. A request needs a credit for each of its
//! messages, else `Ok(false)` and the Core polls; a reply waits for its credits, moving what
//! arrives meanwhile out of the mailbox (to be handled later), so two nodes answering each
//! other cannot wait on each other's full mailboxes.

use std::collections::VecDeque;
use std::time::Duration;

use super::staging::{self, BOUNCE_LEN, PIECE_MAX};
use super::Conduit;
use crate::client::bounce::Ring;
use crate::extoll::rma::{Class, Rma, RmaRegion, NOTIFY_COMPLETER, NOTIFY_REQUESTER};
use crate::extoll::velo::{Velo, VeloError};
use crate::extoll::{Conn, Shared};
use crate::gasnet::backoff::Backoff;
use crate::gasnet::{am, GasnetError};

/// The first VELO message of an AM (two bytes of length, then the AM's first bytes).
pub const TAG_HEADER: u8 = 1;
/// The rest of the header and arguments.
pub const TAG_HEADER_CONT: u8 = 2;
/// A Medium's payload.
pub const TAG_DATA: u8 = 3;

/// AMMaxMedium, as the seed's conduit.
pub const MAX_MEDIUM: usize = 8192;
/// AMMaxLong: one RMA operation (the seed gives none).
pub const MAX_LONG: usize = 8 << 20;
/// VELO credits per destination: a largest Medium takes 130 messages of 64 bytes.
const CREDITS: u32 = 512;
/// Where the landing area (see [`Conduit::landing`]) starts, as AMs name it: past any segment.
pub const LANDING_AT: u64 = 1 << 48;
/// The landing area's size: a get of up to this much into private memory is one Long reply.
const LANDING_LEN: usize = 4 << 20;
/// Messages handled per poll, so that one busy sender cannot keep a poll from returning.
const POLL_BUDGET: usize = 512;
/// Idle polls between looks at the completion queue (see `poll`).
const IDLE_REAP: u32 = 16;

/// An AM being reassembled from one source.
#[derive(Default)]
struct Partial {
    total: usize,
    buf: Vec<u8>,
}

pub struct ExtollConduit {
    ep: Shared,
    velo: Velo,
    rma: Rma,
    me: u32,
    n: u32,
    conns: Vec<Conn>,
    seg: RmaRegion,
    seg_len: usize,
    /// Where Long payloads from outside the segment are staged (registered), used as a ring.
    bounce: RmaRegion,
    /// The bounce area's allocator: a piece is given back once its put's requester
    /// notification says the NIC read it (in use: staged puts not read yet).
    ring: Ring,
    /// The last wait for bounce room had to sleep (`Backoff::for_room`).
    room_slept: bool,
    /// Where Long get replies for the caller's private memory land (registered after the
    /// segment and the bounce area, so at the same NLA on every node).
    landing: RmaRegion,
    /// Long payload puts from the segment whose source was not read yet.
    unread: u32,
    partial: Vec<Partial>,
    /// VELO messages taken out of the mailbox while a reply waited: (source, tag, bytes).
    stash: VecDeque<(u32, u8, Vec<u8>)>,
    /// Whole AMs to deliver (own ones, and those whose Long payload is in place).
    ready: VecDeque<(u32, Vec<u8>)>,
    /// Whole AMs per source, in arrival order, behind an in-place Long still waiting for its
    /// payload's completer notifications (each source's AMs are delivered in order): with the
    /// number each waits for (0: not an in-place Long).
    queued: Vec<VecDeque<(u32, Vec<u8>)>>,
    /// Completer notifications per source not yet paired with a Long header.
    landed: Vec<u32>,
    /// Wire form of the AM being sent.
    wire: Vec<u8>,
    pool: super::BufPool,
    /// Polls that found nothing, in a row or not (for `IDLE_REAP`).
    idle_polls: u32,
}

fn err(e: impl std::fmt::Display) -> GasnetError {
    GasnetError::Setup(e.to_string())
}

fn velo_err(e: VeloError) -> GasnetError {
    match e {
        VeloError::SendFailed { rank, .. } => GasnetError::NodeDead(rank),
        other => GasnetError::Wait(other.to_string()),
    }
}

/// The pieces of a Long payload of `len` bytes staged through the bounce ring. The target
/// counts them alike, so they do not depend on this host's datagram size.
fn staged(len: usize) -> staging::Cuts {
    staging::pieces(len, staging::FIRST, PIECE_MAX, 1)
}

/// VELO messages the wire form of `len` bytes takes: two bytes of length in the first.
fn messages(len: usize, max: usize) -> usize {
    (len + 2).div_ceil(max)
}

impl ExtollConduit {
    /// Attach: opens VELO and RMA on one endpoint, connects to every node, registers the
    /// segment (the same NLA on every node: registered alike), a bounce area and a landing
    /// area.
    pub fn new(segment_len: usize) -> Result<ExtollConduit, GasnetError> {
        let ep = crate::client::Endpoint::init().map_err(err)?;
        let ep: Shared = std::rc::Rc::new(std::cell::RefCell::new(ep));
        let velo = Velo::open_with_credits(ep.clone(), CREDITS).map_err(err)?;
        let mut rma = Rma::open_on(ep.clone()).map_err(err)?;
        let seg = rma.register(segment_len.max(8)).map_err(err)?;
        let bounce = rma.register(BOUNCE_LEN).map_err(err)?;
        let landing = rma.register(LANDING_LEN).map_err(err)?;
        let (me, n) = (velo.rank(), velo.size());
        let conns = (0..n)
            .map(|r| velo.connect(r).map_err(err))
            .collect::<Result<Vec<_>, _>>()?;
        ep.borrow_mut().barrier().map_err(err)?;
        Ok(ExtollConduit {
            ep,
            velo,
            rma,
            me,
            n,
            conns,
            seg,
            seg_len: segment_len,
            bounce,
            landing,
            ring: Ring::new(BOUNCE_LEN),
            room_slept: false,
            unread: 0,
            partial: (0..n).map(|_| Partial::default()).collect(),
            stash: VecDeque::new(),
            ready: VecDeque::new(),
            queued: (0..n).map(|_| VecDeque::new()).collect(),
            landed: vec![0; n as usize],
            wire: Vec::new(),
            pool: Default::default(),
            idle_polls: 0,
        })
    }

    /// Sends an AM (and a Long's payload first) to `dest`; `Ok(false)`, nothing sent, when
    /// `wait` is false and `dest` lacks the credits for all its messages.
    fn send(
        &mut self,
        dest: u32,
        am_bytes: &[u8],
        long: Option<&[u8]>,
        wait: bool,
    ) -> Result<bool, GasnetError> {
        if dest >= self.n {
            return Err(GasnetError::BadNode(dest));
        }
        let mut wire = std::mem::take(&mut self.wire);
        wire.clear();
        wire.extend_from_slice(am_bytes);
        if let Some(payload) = long {
            let (h, _) = am::decode(am_bytes).ok_or(GasnetError::HandlerRule("malformed AM"))?;
            if self.nla_of(h.offset, payload.len()).is_none() {
                self.wire = wire;
                return Err(GasnetError::OutOfSegment(h.offset, payload.len() as u64));
            }
            if dest == self.me {
                // Our own segment: the Core places the payload as it delivers.
                wire.extend_from_slice(payload);
                self.ready.push_back((dest, wire.clone()));
                self.wire = wire;
                return Ok(true);
            }
            wire.resize(wire.len() + am::IN_PLACE_LEN, 0);
            let puts = match self.in_segment(payload) {
                true => 1,
                false => staged(payload.len()).count() as u64,
            };
            am::mark_in_place(&mut wire, payload.len() as u32, puts);
        } else if dest == self.me {
            self.ready.push_back((dest, wire.clone()));
            self.wire = wire;
            return Ok(true);
        }
        let max = self.velo.max_message();
        let need = messages(wire.len(), max) as u32;
        while !self.velo.has_credits(dest, need) {
            if !wait {
                self.wire = wire;
                return Ok(false);
            }
            self.stash_arrivals()?;
            self.ep.borrow_mut().wait_any().map_err(err)?;
        }
        if let Some(payload) = long {
            let r = self.put_long(dest, &wire, payload);
            if let Err(e) = r {
                self.wire = wire;
                return Err(e);
            }
        }
        let head =
            am::decode(&wire).map_or(wire.len(), |(h, _)| am::encoded_len(h.nargs as usize, 0));
        let r = self.send_messages(dest, &wire, head);
        self.wire = wire;
        r.map(|()| true)
    }

    /// The NLA a Long's `len` bytes at `offset` land at on every node: in the segment, or
    /// in the landing area; `None` outside both.
    fn nla_of(&self, offset: u64, len: usize) -> Option<u64> {
        let end = offset.checked_add(len as u64)?;
        if end <= self.seg_len as u64 {
            return Some(self.seg.nla_at(offset));
        }
        let at = offset.checked_sub(LANDING_AT)?;
        (at + len as u64 <= LANDING_LEN as u64).then(|| self.landing.nla_at(at))
    }

    /// Whether `payload` lies in this node's segment (the NIC can read it in place).
    fn in_segment(&self, payload: &[u8]) -> bool {
        let base = self.seg.mem.as_ptr() as usize;
        let p = payload.as_ptr() as usize;
        p >= base && p + payload.len() <= base + self.seg.mem.len()
    }

    /// The RMA puts of a Long's payload into `dest`'s segment at the AM's offset.
    /// AMRequestLong's source may be reused as soon as the call returns: a source outside the
    /// segment is copied into the bounce ring, a piece at a time, each piece put as soon as
    /// it is copied, and the call returns at once (the NIC reads the copies meanwhile, so puts
    /// stream back to back); from the segment the NIC reads it in place, one put, and the call
    /// waits until it has (its requester notification). A put that cannot be posted fails
    /// the call; the conduit is unusable after that (the client lost its NIC).
    fn put_long(&mut self, dest: u32, wire: &[u8], payload: &[u8]) -> Result<(), GasnetError> {
        let (h, _) = am::decode(wire).ok_or(GasnetError::HandlerRule("malformed AM"))?;
        let conn = self.conns[dest as usize];
        let notify = NOTIFY_REQUESTER | NOTIFY_COMPLETER;
        let base = self
            .nla_of(h.offset, payload.len())
            .ok_or(GasnetError::OutOfSegment(h.offset, payload.len() as u64))?;
        if !self.in_segment(payload) {
            for (off, n) in staged(payload.len()) {
                let part = &payload[off..off + n];
                let at = self.bounce_room(part.len())?;
                let n = part.len() as u64;
                self.bounce.mem.bytes()[at as usize..(at + n) as usize].copy_from_slice(part);
                let dst = base + off as u64;
                if let Err(e) = self.rma.post_put(conn, &self.bounce, at, dst, n, notify) {
                    self.ring.free(at);
                    return Err(err(e));
                }
            }
            return Ok(());
        }
        let at = payload.as_ptr() as u64 - self.seg.mem.as_ptr() as u64;
        self.rma
            .post_put(conn, &self.seg, at, base, payload.len() as u64, notify)
            .map_err(err)?;
        self.unread += 1;
        while self.unread > 0 {
            self.await_notifications()?;
        }
        Ok(())
    }

    /// Waits for `len` bytes of the bounce area: a stream of Long payloads from private
    /// memory waits here once per piece, and sleeps rather than yields beside the NIC doing
    /// its work (see [`Backoff::for_room`]).
    fn bounce_room(&mut self, len: usize) -> Result<u64, GasnetError> {
        let mut b = Backoff::for_room(self.room_slept);
        loop {
            if let Some(at) = self.ring.alloc(len) {
                self.room_slept = b.slept();
                return Ok(at);
            }
            if self.take_notifications()? {
                b.progressed();
                continue;
            }
            self.stash_arrivals()?;
            // Messages stashed for the caller do not end this wait.
            b.idle_then(self, |c, max| c.sleep_on_engines(max))?;
        }
    }

    /// Blocks until a VELO message or an RMA notification is there, or `max` passes.
    fn sleep_on_engines(&self, max: Duration) -> Result<(), GasnetError> {
        let (velo, rma) = (&self.velo, &self.rma);
        let ep = self.ep.borrow();
        ep.client()
            .sleep_until_news_unless(max, &|| velo.has_message() || rma.has_notification())
            .map_err(|e| GasnetError::Wait(e.to_string()))
    }

    /// One step of waiting for our puts' notifications: takes those there, else keeps the
    /// mailbox drained (a peer waiting on us must not find it full) and yields.
    fn await_notifications(&mut self) -> Result<(), GasnetError> {
        if !self.take_notifications()? {
            self.stash_arrivals()?;
            self.ep.borrow().client().yield_now();
        }
        Ok(())
    }

    /// The VELO messages of one AM's wire form: the first carries the length; the header and
    /// arguments (`head` bytes) are tagged as such, the payload after them as data.
    fn send_messages(&mut self, dest: u32, wire: &[u8], head: usize) -> Result<(), GasnetError> {
        let conn = self.conns[dest as usize];
        let max = self.velo.max_message();
        // The first message: the AM's length, then its first bytes (no allocation per AM).
        let mut first = [0u8; 128];
        let k = wire.len().min(max - 2);
        first[..2].copy_from_slice(&(wire.len() as u16).to_le_bytes());
        first[2..2 + k].copy_from_slice(&wire[..k]);
        self.velo
            .try_send(conn, &first[..2 + k], TAG_HEADER)
            .map_err(velo_err)?;
        let mut at = k;
        while at < wire.len() {
            let end = (at + max).min(wire.len());
            let tag = if at < head { TAG_HEADER_CONT } else { TAG_DATA };
            self.velo
                .try_send(conn, &wire[at..end], tag)
                .map_err(velo_err)?;
            at = end;
        }
        Ok(())
    }

    /// Moves what the mailbox holds into the stash (a reply that waits must not run handlers,
    /// and must not leave its own mailbox full either).
    fn stash_arrivals(&mut self) -> Result<(), GasnetError> {
        let mut buf = [0u8; 128];
        while let Some((len, src, tag)) = self.velo.probe_recv(&mut buf).map_err(velo_err)? {
            self.stash.push_back((src, tag, buf[..len].to_vec()));
        }
        Ok(())
    }

    /// Takes notifications: completers of Long payloads that landed here, requesters of our
    /// staged puts; a failed put of ours is an error.
    fn take_notifications(&mut self) -> Result<bool, GasnetError> {
        let mut any = false;
        while let Some(x) = self.rma.noti_probe() {
            self.rma.noti_free();
            any = true;
            // A failed put's source is done with too: its piece and count go back first.
            let failed = x.result().err();
            match x.class {
                Class::Completer if failed.is_none() => {
                    if let Some(l) = self.landed.get_mut(x.peer as usize) {
                        *l += 1;
                    }
                }
                Class::Requester => {
                    let bounce = self.bounce.nla..self.bounce.nla + self.bounce.mem.len() as u64;
                    if bounce.contains(&x.nla) {
                        self.ring.free(x.nla - self.bounce.nla);
                    } else {
                        self.unread = self.unread.saturating_sub(1);
                    }
                }
                _ => {}
            }
            if let Some(e) = failed {
                return Err(GasnetError::Wait(format!(
                    "a Long's payload to node {} failed: {e}",
                    x.peer
                )));
            }
        }
        Ok(any)
    }

    /// One VELO message from `src` into its AM; a whole AM goes to `ready` (or, an in-place
    /// Long, behind its payload).
    fn reassemble(&mut self, src: u32, tag: u8, data: &[u8]) {
        let Some(p) = self.partial.get_mut(src as usize) else {
            return;
        };
        if tag == TAG_HEADER {
            if data.len() < 2 {
                return;
            }
            p.total = u16::from_le_bytes([data[0], data[1]]) as usize;
            p.buf = self.pool.take();
            p.buf.extend_from_slice(&data[2..]);
        } else {
            p.buf.extend_from_slice(data);
        }
        if p.buf.len() < p.total {
            return;
        }
        let whole = std::mem::take(&mut p.buf);
        p.total = 0;
        // An in-place Long waits for the completers of the puts it names; a count no sender
        // of this conduit would name (none, or more pieces than its length has) counts as one.
        let puts = match am::decode(&whole) {
            Some((h, p)) if h.category == am::Category::Long && h.in_place => {
                let (len, tag) = am::in_place_fields(p);
                match tag {
                    1.. if tag <= staged(len as usize).count() as u64 => tag as u32,
                    _ => 1,
                }
            }
            _ => 0,
        };
        let q = &mut self.queued[src as usize];
        if q.is_empty() && puts == 0 {
            self.ready.push_back((src, whole));
        } else {
            q.push_back((puts, whole));
        }
    }

    /// AMs queued behind Long headers whose payloads have now landed become ready, in order.
    fn pair_longs(&mut self) {
        for src in 0..self.n as usize {
            while let Some(&(puts, _)) = self.queued[src].front() {
                if self.landed[src] < puts {
                    break;
                }
                self.landed[src] -= puts;
                let (_, whole) = self.queued[src].pop_front().expect("checked non-empty");
                self.ready.push_back((src as u32, whole));
            }
        }
    }
}

impl Conduit for ExtollConduit {
    fn node(&self) -> u32 {
        self.me
    }

    fn nodes(&self) -> u32 {
        self.n
    }

    fn max_am(&self) -> usize {
        am::encoded_len(am::MAX_ARGS, MAX_MEDIUM)
    }

    fn max_long(&self) -> usize {
        MAX_LONG.min(self.seg_len)
    }

    fn segment(&mut self) -> &mut [u8] {
        &mut self.seg.mem.bytes()[..self.seg_len]
    }

    fn landing(&self) -> Option<(u64, usize)> {
        Some((LANDING_AT, LANDING_LEN))
    }

    fn landing_bytes(&mut self) -> &mut [u8] {
        self.landing.mem.bytes()
    }

    fn name(&self) -> &'static str {
        "extoll"
    }

    fn outgoing(&self) -> bool {
        self.velo.unacknowledged() || self.unread > 0 || self.ring.in_use()
    }

    fn request(&mut self, dest: u32, am: &[u8], long: Option<&[u8]>) -> Result<bool, GasnetError> {
        self.send(dest, am, long, false)
    }

    fn reply(
        &mut self,
        dest: u32,
        _reply_to: u64,
        reply: Option<(&[u8], Option<&[u8]>)>,
    ) -> Result<(), GasnetError> {
        // VELO's credits are not the requests': a handler that does not reply owes nothing.
        let Some((am, long)) = reply else {
            return Ok(());
        };
        self.send(dest, am, long, true).map(|_| ())
    }

    fn recycle(&mut self, b: Vec<u8>) {
        self.pool.give(b);
    }

    fn poll(
        &mut self,
        deliver: &mut dyn FnMut(u32, u64, Vec<u8>),
        _done: &mut dyn FnMut(super::RmaDone),
    ) -> Result<bool, GasnetError> {
        if self.stash.is_empty()
            && self.ready.is_empty()
            && !self.velo.has_message()
            && !self.rma.has_notification()
        {
            // Idle: two loads of memory the NIC writes. Completions (credits returned) are
            // taken every IDLE_REAP idle polls and whenever a send runs short.
            self.idle_polls = self.idle_polls.wrapping_add(1);
            if self.idle_polls.is_multiple_of(IDLE_REAP) {
                self.velo.collect();
            }
            return Ok(false);
        }
        // Notifications only when one is there; credits not here but in idle polls and when
        // a send runs short: both go through the completion queue, a line the NIC wrote when
        // it delivered our last send, so a look at it before the handlers (which run after
        // this returns) put a cross-core miss between a message's arrival and its handler.
        let mut any = self.rma.has_notification() && self.take_notifications()?;
        let mut budget = POLL_BUDGET;
        while let Some((src, tag, data)) = self.stash.pop_front() {
            self.reassemble(src, tag, &data);
            any = true;
            budget = budget.saturating_sub(1);
        }
        let mut buf = [0u8; 128];
        while budget > 0 {
            match self.velo.probe_recv(&mut buf).map_err(velo_err)? {
                Some((len, src, tag)) => {
                    self.reassemble(src, tag, &buf[..len]);
                    any = true;
                    budget -= 1;
                }
                None => break,
            }
        }
        self.pair_longs();
        while let Some((src, b)) = self.ready.pop_front() {
            deliver(src, 0, b);
            any = true;
        }
        Ok(any)
    }

    fn wait_news(&mut self, max: Duration) -> Result<(), GasnetError> {
        if !self.ready.is_empty() || !self.stash.is_empty() {
            return Ok(());
        }
        self.sleep_on_engines(max)
    }

    fn yield_now(&mut self) {
        self.ep.borrow().client().yield_now();
    }

    fn off_nic_core(&mut self) -> bool {
        self.ep.borrow().client().off_nic_core()
    }

    fn keep_core(&mut self) -> bool {
        self.ep.borrow().client().keep_core()
    }
}
