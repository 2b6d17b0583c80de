//! The portals conduit: Active Messages through the soft NIC's Portals engine, after the
//! GASNet-over-Portals design. Matching, data placement and events happen in the NIC; the
//! process only handles the events.
//!
//! - ReqRB: two locally managed receive buffers on the AM portal (`MANAGE_LOCAL`, `min_free`
//!   = one maximal AM) reporting to AM_EQ. Requests pack into them; a full one unlinks itself
//!   and is re-posted once its events are handled, so one is always linked (double buffering).
//! - ReqSB: request slots and reply slots in one region. A request is a put from its slot,
//!   without ACK while credits are on (a credited request always finds room); the slot is also
//!   exposed on the reply portal, where the target puts its reply (or an empty implicit one),
//!   so a reply always has room and lands on SAFE_EQ — never among requests, so waiting for a
//!   reply never runs request handlers. A request slot is a send token until its reply; a
//!   reply slot until its SEND event (replies ask no ACK).
//! - Flow control (see `credit`): credits bound each sender's unanswered request bytes at a
//!   target by a share of its ReqRB; a sender running short asks for a loan, lent in the reply.
//!   Behind it, a catch-basin (an overflow entry that truncates to nothing and keeps no header)
//!   takes what finds no ReqRB linked, and PTL_PT_FLOWCTRL disables the AM portal before
//!   AM_EQ could overflow; with credits off (`SOFTNIC_PORTALS_CREDITS=off`) requests ask for
//!   an ACK, which tells the sender of either, and it sends again after a back-off.
//! - Request fields in `hdr_data`: slot | ask << 16 | repaid credit << 32; a reply's
//!   `hdr_data` is the credit it grants.
//! - RAR: the segment, exposed on its own portal (ignore-all match bits, puts and gets, no
//!   target events). Extended puts and gets go straight to Portals put and get — from or into
//!   the segment directly, else through a bounce region — and complete from their ACK and
//!   REPLY events on SAFE_EQ, never through Active Messages. Remote atomics are Portals
//!   atomics on the same portal, run by the target's NIC.
//! - Long: payloads up to `PACKED_MAX` ride in the AM (packed Long). Larger ones are put
//!   straight into the target's segment through RARAM (the segment again, on its own portal,
//!   with PUT events on its own EQ) with a Long id (Lid) in `hdr_data`, and the header follows
//!   naming the Lid and length; the target runs the handler once both have arrived, in
//!   whichever order they came. An unanswered header holds its sender's credit, so headers
//!   waiting for payloads are bounded like any request.

mod am;
mod credit;
pub(crate) mod firehose;
mod rma;

use std::collections::VecDeque;
use std::time::Instant;

use rustc_hash::FxHashMap as HashMap;

use self::credit::Credits;
use super::{staging, Conduit, FirehoseStats, FlowStats, GetDest, RmaDone};
use crate::client::MemRegion;
use crate::gasnet::{env_size, AdOp, GasnetError};
use crate::nic::memory::Perms;
use crate::portals::{
    md_opt, me_opt, pt_opt, Buffer, List, Md, Me, NiHandle, Portals, ProcessId, Target,
};

const AM_PT: u32 = 10;
const RAR_PT: u32 = 11;
/// The portal of Long payloads (RARAM).
const RARAM_PT: u32 = 12;
/// The portal of replies: the request slots of ReqSB.
const REPLY_PT: u32 = 13;
const MAX_AM: usize = 16 * 1024;
/// ReqRB: at least this large, more for many nodes (see `credit::Credits::capacity_for`).
const RB_MIN: usize = 2 << 20;
const RBS: usize = 2;
/// Requests awaiting their reply, and replies awaiting their ACK.
const REQ_SLOTS: usize = 256;
const REP_SLOTS: usize = 64;
const BITS_AM: u64 = 0xa11;
/// Largest piece of one direct transfer.
const CHUNK: usize = staging::PIECE_MAX;
/// The bounce region (see [`staging::BOUNCE_LEN`]).
const BOUNCE_LEN: usize = staging::BOUNCE_LEN;
/// Most direct pieces in flight (SAFE_EQ holds their completions).
const MAX_RMA: usize = 256;
/// Segment sources of non-bulk puts up to this size are copied through the bounce region (the
/// call returns at once); larger ones are sent from in place, the call returning at local
/// completion.
const COPY_MAX: usize = 32 * 1024;
/// Default budget of the registration cache: bytes (`GASNET_FIREHOSE_M`) and regions
/// (`GASNET_FIREHOSE_R`), as GASNet's firehose names them.
const FIREHOSE_M: usize = 256 << 20;
const FIREHOSE_R: usize = 64;
/// Non-fetching atomics of the implicit puts in flight at most, and their operand slots.
const IMPLICIT_SLOTS: usize = 4096;
/// Failure events of implicit atomics kept for the error that reports them (the rest are
/// only counted).
const IMPLICIT_FAILURES: usize = 64;
/// Long payloads up to this ride inside the AM.
const PACKED_MAX: usize = 8 * 1024;
/// Largest Long payload (AMMaxLongRequest/Reply): one piece of the bounce region.
const MAX_LONG: usize = CHUNK;
/// RARAM's event queue: one event per Long payload not yet matched with its header.
const RARAM_EQ_LEN: usize = 16_384;

// `user_ptr`s. SAFE_EQ: request ACKs carry the slot; the others a tag.
/// Direct pieces: tag | op << 16 | piece.
const RMA_TAG: u64 = 1 << 63;
/// Long payload puts: tag | bounce offset.
const LONG_TAG: u64 = 1 << 62;
/// Replies sent: tag | reply slot.
const REP_TAG: u64 = 1 << 61;
/// The reply entry over our request slots (PUT events of replies arriving).
const REPLY_ME: u64 = 1 << 60;
/// The catch-basin on the AM portal (counted, not reported: it has no full events).
const CATCH_ME: u64 = 1 << 59;

/// A request slot in use.
#[derive(Debug, Clone, Copy)]
struct ReqSlot {
    dest: u32,
    len: usize,
    hdr: u64,
    /// The target's NIC took it (ACK), and the target answered (reply): free when both.
    acked: bool,
    answered: bool,
    /// Times the target could not take it.
    refused: u32,
}

/// A direct operation in flight.
struct Rma {
    remaining: usize,
    ok: bool,
    /// SEND events still to come before a non-bulk put may return.
    unsent: usize,
    /// A get into the caller's memory through bounce pieces: (address, length).
    dest: Option<(u64, usize)>,
    /// A fetching atomic's prior value.
    data: Option<Vec<u8>>,
    /// Per piece, its bounce offset.
    pieces: Pieces,
    /// Its use of the registration cache, released at completion.
    cached: Option<u64>,
}

/// The bounce offsets of an operation's pieces; the first is kept inline (most operations
/// are one piece: no allocation for them).
struct Pieces {
    first: Option<u64>,
    rest: Vec<Option<u64>>,
}

impl Pieces {
    fn new(n: usize) -> Pieces {
        Pieces {
            first: None,
            rest: vec![None; n.saturating_sub(1)],
        }
    }

    fn get(&self, i: usize) -> Option<u64> {
        match i {
            0 => self.first,
            _ => self.rest.get(i - 1).copied().flatten(),
        }
    }

    fn set(&mut self, i: usize, at: u64) {
        match i {
            0 => self.first = Some(at),
            _ => {
                if let Some(p) = self.rest.get_mut(i - 1) {
                    *p = Some(at);
                }
            }
        }
    }
}

/// A Long header whose payload has not fully landed yet.
struct Parked {
    src: u32,
    reply_to: u64,
    am: Vec<u8>,
    lid: u64,
    len: u64,
}

pub struct PortalsConduit {
    p: Portals,
    ni: NiHandle,
    me: u32,
    n: u32,
    am_eq: u32,
    safe_eq: u32,
    raram_eq: u32,
    rb: MemRegion,
    rb_len: usize,
    catch_ct: u32,
    sb: MemRegion,
    sb_md: u32,
    /// ReqSB again, with SEND events: a reply slot is free once its reply has left it.
    rep_md: u32,
    req: Vec<Option<ReqSlot>>,
    free_req: Vec<usize>,
    free_rep: Vec<usize>,
    /// Requests their target could not take: when to send each again.
    resend: Vec<(Instant, usize)>,
    credits: Credits,
    /// Off only to test the catch-basin (`SOFTNIC_PORTALS_CREDITS=off`).
    credits_on: bool,
    resent: u64,
    protocol_errors: u64,
    /// AMs ready for delivery: (source, reply_to, AM).
    arrived: VecDeque<(u32, u64, Vec<u8>)>,
    /// Buffers of delivered AMs, back from the Core for the next arrivals.
    pool: super::BufPool,
    next_lid: u64,
    /// Long payload bytes landed per (source, Lid) whose header has not come yet.
    landed: HashMap<(u32, u64), u64>,
    /// Entries of `landed` per source.
    landed_from: Vec<u32>,
    parked: Vec<Parked>,
    seg: MemRegion,
    seg_md: u32,
    /// The segment with SEND events, for non-bulk puts that await local completion.
    seg_send_md: u32,
    bounce: MemRegion,
    bounce_md: u32,
    ring: crate::client::bounce::Ring,
    rma: HashMap<u64, Rma>,
    rma_in_flight: usize,
    /// The last wait for bulk room had to sleep (`Backoff::for_room`).
    room_slept: bool,
    finished: Vec<RmaDone>,
    firehose: firehose::Firehose,
    /// Off once the daemon could not reach this process's memory.
    firehose_on: bool,
    /// Local buffers outside the segment up to this size are copied through the bounce region
    /// by this process; larger ones go from and to their place through the registration
    /// cache (`SOFTNIC_PORTALS_COPY_MAX`; default: every size). The daemon reaches private
    /// memory only by `process_vm_readv`/`writev` on its own thread, which a stream is bound
    /// by, while bounce memory it reads mapped (and seals as it reads): copying here is the
    /// cheaper side (measured: docs/performance.md, stop 47).
    copy_max: usize,
    /// The put data one datagram carries ([`Portals::put_fragment_len`]): copied pieces are
    /// whole numbers of it.
    put_quantum: usize,
    /// Implicit atomics (see `rma::implicit_atomic`): operand slots, their MD counting ACKs
    /// on a CT (and telling failures only, as full events, on `imp_eq`: what the error names),
    /// how many were issued, and how many failures were reported already.
    imp: MemRegion,
    imp_md: u32,
    imp_ct: u32,
    imp_eq: u32,
    imp_issued: u64,
    imp_failed: u64,
}

fn err<E: std::fmt::Display>(e: E) -> GasnetError {
    GasnetError::Setup(format!("portals conduit: {e}"))
}

/// An entry over all of `region`'s first `len` bytes, any match bits, no link events.
fn whole(region: &MemRegion, len: usize, options: u32) -> Me {
    let mut e = Me::new(
        Buffer {
            region: region.handle,
            offset: 0,
            len: len as u64,
        },
        0,
    );
    e.ignore_bits = u64::MAX;
    e.options = options | me_opt::EVENT_LINK_DISABLE;
    e
}

impl PortalsConduit {
    pub fn new(segment_len: usize) -> Result<PortalsConduit, GasnetError> {
        let mut p = Portals::init().map_err(err)?;
        let (ni, _) = p.ni_init(true, true).map_err(err)?;
        let (me, n) = (p.endpoint().rank(), p.endpoint().size());
        let rb_len = RB_MIN.max(Credits::capacity_for(n, MAX_AM) as usize + MAX_AM);
        let capacity = (rb_len - MAX_AM) as u64;
        // Credited requests cost at least MIN_COST each: this many can wait undrained.
        let am_eq_len = (capacity / credit::MIN_COST) as usize + 64;
        let am_eq = p.eq_alloc(ni, am_eq_len).map_err(err)?;
        // Per request slot its ACK and reply, per reply slot its ACK, per direct piece its
        // SEND and completion, per packed Long its ACK.
        let safe_eq_len = 2 * REQ_SLOTS + REP_SLOTS + 2 * MAX_RMA + BOUNCE_LEN / PACKED_MAX + 64;
        let safe_eq = p.eq_alloc(ni, safe_eq_len).map_err(err)?;
        let raram_eq = p.eq_alloc(ni, RARAM_EQ_LEN).map_err(err)?;
        p.pt_alloc(ni, pt_opt::FLOWCTRL, Some(am_eq), Some(AM_PT))
            .map_err(err)?;
        p.pt_alloc(ni, 0, Some(safe_eq), Some(RAR_PT))
            .map_err(err)?;
        p.pt_alloc(ni, 0, Some(raram_eq), Some(RARAM_PT))
            .map_err(err)?;
        p.pt_alloc(ni, 0, Some(safe_eq), Some(REPLY_PT))
            .map_err(err)?;
        let reg = |p: &mut Portals, len: usize, perms| p.endpoint().mem_register(len, perms);
        let rb = reg(&mut p, rb_len * RBS, Perms::WRITE).map_err(err)?;
        let sb_len = (REQ_SLOTS + REP_SLOTS) * MAX_AM;
        let sb = reg(&mut p, sb_len, Perms::WRITE).map_err(err)?;
        let seg = reg(&mut p, segment_len.max(8), Perms::READ_WRITE).map_err(err)?;
        let bounce = reg(&mut p, BOUNCE_LEN, Perms(0)).map_err(err)?;
        let md = |p: &mut Portals, region: &MemRegion, options| {
            p.md_bind(
                ni,
                &Md {
                    region: region.handle,
                    segments: vec![(0, region.len() as u64)],
                    options,
                    eq: Some(safe_eq),
                    ct: None,
                },
            )
        };
        let quiet = md_opt::EVENT_SEND_DISABLE;
        let sb_md = md(&mut p, &sb, quiet).map_err(err)?;
        let rep_md = md(&mut p, &sb, 0).map_err(err)?;
        let seg_md = md(&mut p, &seg, quiet).map_err(err)?;
        let seg_send_md = md(&mut p, &seg, 0).map_err(err)?;
        let bounce_md = md(&mut p, &bounce, quiet).map_err(err)?;
        let imp = reg(&mut p, IMPLICIT_SLOTS * 8, Perms(0)).map_err(err)?;
        let imp_ct = p.ct_alloc(ni).map_err(err)?;
        let imp_eq = p.eq_alloc(ni, IMPLICIT_FAILURES).map_err(err)?;
        let imp_md = p
            .md_bind(
                ni,
                &Md {
                    region: imp.handle,
                    segments: vec![(0, imp.len() as u64)],
                    options: md_opt::EVENT_SEND_DISABLE
                        | md_opt::EVENT_SUCCESS_DISABLE
                        | md_opt::EVENT_CT_ACK,
                    eq: Some(imp_eq),
                    ct: Some(imp_ct),
                },
            )
            .map_err(err)?;
        // Replies land in the request slots.
        let reply = whole(&sb, REQ_SLOTS * MAX_AM, me_opt::OP_PUT);
        p.me_append(ni, REPLY_PT, &reply, List::Priority, REPLY_ME)
            .map_err(err)?;
        // RAR: puts, gets and atomics on the segment, silently; RARAM: the same with events.
        let quiet = me_opt::OP_PUT | me_opt::OP_GET | me_opt::EVENT_COMM_DISABLE;
        let rar = whole(&seg, seg.len(), quiet);
        p.me_append(ni, RAR_PT, &rar, List::Priority, 0)
            .map_err(err)?;
        let raram = whole(&seg, seg.len(), me_opt::OP_PUT);
        p.me_append(ni, RARAM_PT, &raram, List::Priority, 0)
            .map_err(err)?;
        // The catch-basin: takes (as nothing) what finds no ReqRB, counting it.
        let catch_ct = p.ct_alloc(ni).map_err(err)?;
        let mut basin = whole(
            &rb,
            0,
            me_opt::OP_PUT
                | me_opt::UNEXPECTED_HDR_DISABLE
                | me_opt::EVENT_COMM_DISABLE
                | me_opt::EVENT_CT_COMM,
        );
        basin.ct = Some(catch_ct);
        p.me_append(ni, AM_PT, &basin, List::Overflow, CATCH_ME)
            .map_err(err)?;
        let credits_on = std::env::var("SOFTNIC_PORTALS_CREDITS").map_or(true, |v| v != "off");
        let put_quantum = p.put_fragment_len();
        let mut c = PortalsConduit {
            p,
            ni,
            me,
            n,
            am_eq,
            safe_eq,
            raram_eq,
            rb,
            rb_len,
            catch_ct,
            sb,
            sb_md,
            rep_md,
            req: vec![None; REQ_SLOTS],
            free_req: (0..REQ_SLOTS).rev().collect(),
            free_rep: (0..REP_SLOTS).rev().collect(),
            resend: Vec::new(),
            credits: Credits::new(n, capacity, MAX_AM),
            credits_on,
            resent: 0,
            protocol_errors: 0,
            arrived: VecDeque::new(),
            pool: Default::default(),
            next_lid: 0,
            landed: HashMap::default(),
            landed_from: vec![0; n as usize],
            parked: Vec::new(),
            seg,
            seg_md,
            seg_send_md,
            bounce,
            bounce_md,
            ring: crate::client::bounce::Ring::new(BOUNCE_LEN),
            rma: HashMap::default(),
            rma_in_flight: 0,
            room_slept: false,
            finished: Vec::new(),
            firehose: firehose::Firehose::new(
                env_size(&["GASNET_FIREHOSE_M"]).unwrap_or(FIREHOSE_M) as u64,
                env_size(&["GASNET_FIREHOSE_R"]).unwrap_or(FIREHOSE_R),
            ),
            firehose_on: true,
            copy_max: env_size(&["SOFTNIC_PORTALS_COPY_MAX"]).unwrap_or(usize::MAX),
            put_quantum,
            imp,
            imp_md,
            imp_ct,
            imp_eq,
            imp_issued: 0,
            imp_failed: 0,
        };
        for i in 0..RBS {
            c.post_rb(i)?;
        }
        // Everyone's receive buffers are posted before anyone sends.
        c.p.endpoint().barrier().map_err(err)?;
        Ok(c)
    }

    fn rar(&self, node: u32, offset: u64) -> Target {
        Target {
            id: ProcessId::Logical { rank: node },
            pt_index: RAR_PT,
            match_bits: 0,
            remote_offset: offset,
        }
    }

    /// Blocks until an event queue this conduit reads has news, an implicit atomic count is
    /// complete, a resend is due, or `max` passes (what is already collected aside).
    pub(super) fn sleep_on_events(&mut self, max: std::time::Duration) -> Result<(), GasnetError> {
        // A request to send again wakes us when it is due.
        let now = Instant::now();
        let max = self
            .resend
            .iter()
            .map(|&(due, _)| due.saturating_duration_since(now))
            .fold(max, |m, d| m.min(d));
        // Implicit atomics have no events: their count wakes us when all are done.
        let outstanding = self.imp_issued > self.imp_completions()?.0;
        let n = outstanding as usize;
        self.p
            .sleep(
                self.ni,
                &[self.am_eq, self.safe_eq, self.raram_eq],
                &[self.imp_ct][..n],
                &[self.imp_issued][..n],
                max,
            )
            .map_err(|e| GasnetError::Wait(e.to_string()))
    }

    /// One turn of a wait inside the conduit (for a reply slot, an implicit atomic's slot, a
    /// put's local completion; room for bulk data waits in `wait_room`):
    /// the send side's events, and what arrived taken out of the receive buffers (a peer may
    /// be waiting for our replies, or for room in our ReqRB). No handler runs here.
    fn wait_step(&mut self) -> Result<(), GasnetError> {
        if !self.poll_safe()? && !self.drain_am()? && !self.drain_raram()? {
            Conduit::yield_now(self);
        }
        Ok(())
    }
}

impl Conduit for PortalsConduit {
    fn node(&self) -> u32 {
        self.me
    }

    fn recycle(&mut self, b: Vec<u8>) {
        self.pool.give(b);
    }

    fn outgoing(&self) -> bool {
        // A request's slot is freed once its target's NIC took it and the target answered.
        !self.resend.is_empty() || self.req.iter().any(Option::is_some)
    }

    fn nodes(&self) -> u32 {
        self.n
    }

    fn max_am(&self) -> usize {
        MAX_AM
    }

    fn max_long(&self) -> usize {
        MAX_LONG
    }

    fn segment(&mut self) -> &mut [u8] {
        self.seg.bytes()
    }

    fn name(&self) -> &'static str {
        "portals"
    }

    fn request(&mut self, dest: u32, am: &[u8], long: Option<&[u8]>) -> Result<bool, GasnetError> {
        self.try_request(dest, am, long)
    }

    fn reply(
        &mut self,
        dest: u32,
        reply_to: u64,
        reply: Option<(&[u8], Option<&[u8]>)>,
    ) -> Result<(), GasnetError> {
        self.send_reply(dest, reply_to, reply)
    }

    fn poll(
        &mut self,
        deliver: &mut dyn FnMut(u32, u64, Vec<u8>),
        done: &mut dyn FnMut(RmaDone),
    ) -> Result<bool, GasnetError> {
        let mut any = self.poll_safe()?;
        for d in self.finished.drain(..) {
            any = true;
            done(d);
        }
        self.p.endpoint().progress();
        any |= self.drain_am()?;
        any |= self.drain_raram()?;
        for (src, reply_to, am) in self.arrived.drain(..) {
            deliver(src, reply_to, am);
        }
        Ok(any)
    }

    fn yield_now(&mut self) {
        self.p.endpoint().client().yield_now();
    }

    fn off_nic_core(&mut self) -> bool {
        self.p.endpoint().client().off_nic_core()
    }

    fn keep_core(&mut self) -> bool {
        self.p.endpoint().client().keep_core()
    }

    fn one_sided(&self) -> bool {
        // Put, get and atomics are Portals operations the target's NIC serves alone.
        true
    }

    fn wait_news(&mut self, max: std::time::Duration) -> Result<(), GasnetError> {
        if !self.finished.is_empty() || !self.arrived.is_empty() {
            return Ok(());
        }
        self.sleep_on_events(max)
    }

    fn flow_stats(&self) -> FlowStats {
        let c = self.credits.stats;
        let caught = self
            .p
            .ct_get(self.ni, self.catch_ct)
            .map_or(0, |ct| ct.success);
        FlowStats {
            credit_stalls: c.stalls,
            loans_asked: c.asks,
            loans_granted: c.loans,
            loans_repaid: c.repaid,
            caught,
            resent: self.resent,
            protocol_errors: self.protocol_errors + c.bad,
        }
    }

    fn firehose_stats(&self) -> FirehoseStats {
        self.firehose.stats
    }

    fn rma_put(
        &mut self,
        node: u32,
        dest_offset: u64,
        src: &[u8],
        op: u64,
        bulk: bool,
    ) -> Result<bool, GasnetError> {
        self.direct_put(node, dest_offset, src, op, bulk)
            .map(|()| true)
    }

    fn abandon(&mut self, op: u64) {
        self.abandon_rma(op);
    }

    fn rma_get(
        &mut self,
        node: u32,
        src_offset: u64,
        len: usize,
        dest: GetDest,
        op: u64,
    ) -> Result<bool, GasnetError> {
        self.direct_get(node, src_offset, len, dest, op)
            .map(|()| true)
    }

    fn rma_atomic(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        operands: [u64; 2],
        op: u64,
    ) -> Result<bool, GasnetError> {
        self.direct_atomic(node, offset, atomic, operands, op)
            .map(|()| true)
    }

    fn atomic_implicit(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        operands: [u64; 2],
    ) -> Result<bool, GasnetError> {
        self.implicit_atomic(node, offset, atomic, operands)
    }

    fn implicit_done(&mut self) -> Result<bool, GasnetError> {
        self.implicit_check()
    }
}
