//! The Portals engine's glue in the host core: the interfaces of each attached process, the
//! calls they make through the command ring, Portals messages to and from peers, triggered
//! operations, and the delivery of event queues and counting events into the processes' memory.

use rustc_hash::FxHashMap as HashMap;

use crate::nic::memory::Region;
use crate::nic::portals::initiator::{md as md_opt, PayloadSource};
use crate::nic::portals::triggered::TriggeredAction;
use crate::nic::portals::wire::{encode_kind, msg_key, request_ops, response_ops, Whole};
use crate::nic::portals::{AckReq, ReqKind};
use crate::nic::portals::{
    CtEvent, GetStream, List, MatchEntry, NiFail, OpSpec, PortalsNi, ProcessId, PtlError,
    PutStream, Response, SearchOp, StatusRegister,
};
use crate::phase_trace::{self, Phase};
use crate::shm::event_ring::{CtSlot, EventRing};
use crate::shm::ptl_call::{status_of, MeArgs, PtlCall, MAX_NIS};
use crate::shm::CqEntry;
use crate::transport::PushError;
use crate::wire::{
    ptl_acks, push_ptl_ack, OpHeader, OpKind, OpRef, PtlHeader, Status, PTL_ACK_LEN,
};

use super::gemini::OutItem;
use super::{Flow, HostCore};

/// A large put on its way out: fragments are read from the MD's memory as the transport has
/// room, and its SEND event waits for the last of them.
pub(super) struct PtlStream {
    /// The put's header: its job, initiator rank and request (interface and operation id).
    h: OpHeader,
    m: PtlHeader,
    src: PayloadSource,
    sent: u64,
}

/// How a stream ended.
pub(super) enum StreamEnd {
    /// Its last fragment went into the transport.
    Sent,
    /// Its memory could not be read: unmapped meanwhile (`Fault`), or its process exited
    /// (`NoSuchEndpoint`).
    Unreadable(Status),
    /// The peer is gone (the operation fails with the others aimed at it).
    PeerGone,
}

impl PtlStream {
    /// The process whose put this is.
    pub(super) fn owner(&self) -> (u32, u32) {
        (self.h.job, self.h.src_rank)
    }

    /// The initiator's interface and operation id.
    fn op(&self) -> (u8, u32) {
        ((self.h.req >> 32) as u8, self.h.req as u32)
    }

    /// Pushes fragments while the transport takes them; `None` when it is full (call again
    /// later), else how the stream ended.
    pub(super) fn emit(
        &mut self,
        peer: u16,
        transport: &mut crate::transport::Transport,
    ) -> Option<StreamEnd> {
        let (h, m, src, len) = (self.h, self.m, &self.src, self.src.length);
        // From the MD's memory straight into the datagram.
        emit_fragments(
            transport,
            peer,
            (OpKind::PtlReq, len, &mut self.sent),
            &|sent, n| OpRef::PtlReq {
                h,
                m,
                last: sent + n == len,
                operand: &[],
                data: &[],
            },
            &|at, n, b| src.gather(at, n, b),
            &|at, n| src.mapped(at, n),
        )
    }
}

/// Reads `n` bytes at `offset` of a stream's memory into a datagram: `read(offset, n, datagram)`.
type ReadFragment<'a> = &'a dyn Fn(u64, u64, &mut Vec<u8>) -> Result<(), Status>;
/// Where `n` bytes at `offset` of a stream's memory are mapped, if they are in one piece of
/// mapped memory that lives as long as the stream: `mapped(offset, n)`.
type MappedFragment<'a> = &'a dyn Fn(u64, u64) -> Option<*const u8>;

/// Pushes a stream's fragments (`kind`, `len` bytes, `sent` so far) while the transport takes
/// them, each op (`op(sent, n)`) filled by `read(offset, n, datagram)` straight from memory;
/// `None` when the transport is full (call again later), else how the stream ended.
fn emit_fragments(
    transport: &mut crate::transport::Transport,
    peer: u16,
    (kind, len, sent): (OpKind, u64, &mut u64),
    op: &dyn Fn(u64, u64) -> OpRef<'static>,
    read: ReadFragment<'_>,
    mapped: MappedFragment<'_>,
) -> Option<StreamEnd> {
    let mut why = Status::Fault;
    loop {
        if !super::gemini::stream_may_push(transport, peer) {
            return None;
        }
        let n = super::gemini::fragment_len(transport, peer, kind, len - *sent);
        let at = *sent;
        let mut fill = |b: &mut Vec<u8>| read(at, n, b).map_err(|s| why = s).is_ok();
        let pushed = match mapped(at, n) {
            // SAFETY: `mapped` gives memory that stays mapped while its stream lives, which
            // outlasts this call.
            Some(p) => unsafe { transport.push_op_mapped(peer, &op(at, n), p, n as usize) },
            None => transport.push_op_filled(peer, &op(at, n), n as usize, &mut fill),
        };
        match pushed {
            Ok(()) => {
                *sent += n;
                if *sent == len {
                    return Some(StreamEnd::Sent);
                }
            }
            Err(PushError::Full(_)) => return None,
            Err(PushError::Source) => return Some(StreamEnd::Unreadable(why)),
            Err(_) => return Some(StreamEnd::PeerGone),
        }
    }
}

/// A long get's reply on its way out: read from the matched entry's memory a fragment at a
/// time as the transport has room (no copy of the whole reply first); the target's GET event
/// waits for the last fragment (see [`GetStream`]).
pub(super) struct PtlReplyStream {
    /// To the initiator: the request's name and what it is told besides the data.
    h: OpHeader,
    ack: bool,
    mlength: u64,
    offset: u64,
    src: GetStream,
    sent: u64,
    /// The target process and interface whose events wait: (job, rank, interface).
    target: (u32, u32, u8),
}

impl PtlReplyStream {
    /// The fragment at `frag_off` of `n` bytes (its data is read into the datagram as it is
    /// pushed); a failed one ends the reply.
    fn op(&self, frag_off: u64, n: u64, ni_fail: NiFail) -> OpRef<'static> {
        OpRef::PtlResp {
            h: self.h,
            ni_fail: ni_fail as u8,
            ack: self.ack,
            mlength: self.mlength,
            offset: self.offset,
            frag_off,
            last: frag_off + n == self.src.len || ni_fail != NiFail::Ok,
            data: &[],
        }
    }

    /// Pushes fragments while the transport takes them; `None` when it is full (call again
    /// later), else how the stream ended.
    pub(super) fn emit(
        &mut self,
        peer: u16,
        transport: &mut crate::transport::Transport,
    ) -> Option<StreamEnd> {
        let mut sent = self.sent;
        let (region, base) = (&self.src.region, self.src.at);
        let end = emit_fragments(
            transport,
            peer,
            (OpKind::PtlResp, self.src.len, &mut sent),
            &|at, n| self.op(at, n, NiFail::Ok),
            &|at, n, b| region.append_to(base + at, n as usize, b),
            &|at, n| region.mapped_for_read(base + at, n as usize),
        );
        self.sent = sent;
        end
    }
}

/// The start scratch buffer is kept up to this capacity: operations up to it reuse it (a
/// fresh large buffer costs a page fault per 4 KiB on first touch — measured, a third of a
/// 1 MiB put stream's time went to clearing new pages).
const PAYLOAD_KEEP: usize = 16 << 20;
/// Encoded ops waiting for room are built in reused buffers, at most this many kept.
const ENCODED_SPARE: usize = 256;
/// How long a Portals acknowledgement may wait to share a datagram (ns).
const ACK_LAZY_NS: u64 = 10_000;
/// How long the acknowledgement of a silent delivery (no event at the target) may wait to
/// share a datagram (ns). Such a delivery is often answered all the same — a target polling
/// its memory, as SHMEM's `wait_until` does — and then the answer carries it: Portals put
/// ping-pong 8 B 5.1–5.3 → 2.9–3.0 µs half round trip (measured). When none comes (a
/// blocking put), the transport's lazy policy soon sends such ops at once, one in 16 still
/// waiting this long as a probe: short, so a probe costs little.
const SILENT_ACK_LAZY_NS: u64 = 2_000;

/// What a mirror pass gathers, kept between passes (a pass that moves an event would
/// otherwise allocate: one per blocking round trip).
#[derive(Default)]
pub struct MirrorScratch {
    /// (job, rank) of processes that got something.
    woken: Vec<(u32, u32)>,
    /// One interface's changed counts, with their stamps.
    cts: Vec<(u32, CtEvent, u64)>,
    /// One interface's event rings with something to move: (EQ, events the ring holds,
    /// capacity).
    rooms: Vec<(u32, u64, u64)>,
}

/// Acknowledgements in full waiting to leave for one peer as one `PtlAcks` op: sent once the
/// datagram that asked for them is served, or before anything else goes to that peer.
#[derive(Default)]
pub struct AckBatch {
    peer: u16,
    job: u32,
    /// (initiator rank, req) of the first: it rides in the op's header.
    first: Option<(u32, u64)>,
    /// The others, as the op's records.
    rest: Vec<u8>,
}

/// What serving a request at its target did.
struct Delivered {
    /// For the initiator.
    resp: Response,
    /// A long get's reply, to be read from the entry's memory as it goes out.
    stream: Option<GetStream>,
    /// A put matched on its first fragment: where the rest goes.
    put: Option<PutStream>,
    /// Triggers released operations there (to start with `ptl_run_fired`).
    fired: bool,
    /// The target process was told (a full event, a counting event moved).
    notified: bool,
}

/// A put in several fragments matched on its first (see [`PutStream`]): its later fragments
/// are written where it matched as they come, and its answer goes with the last.
pub(super) struct PtlPutIn {
    h: OpHeader,
    ni: u8,
    rlength: u64,
    remote_offset: u64,
    resp: Response,
    /// None: the match failed (the answer says why); later fragments are dropped.
    stream: Option<PutStream>,
    /// Data bytes of the message received so far.
    got: u64,
    notified: bool,
}

/// One interface of a process at its NIC, with where its events and counts go.
pub struct NiState {
    pub ni: PortalsNi,
    pub logical: bool,
    /// PtlSetMap: job rank → logical index (none: the identity).
    logical_of: Option<HashMap<u32, u32>>,
    eq_rings: HashMap<u32, EventRing>,
    ct_slots: HashMap<u32, CtSlot>,
    /// The engine's notice count when its events and counts were last mirrored, and whether
    /// events then waited for room in a ring (the next pass looks again).
    mirrored: u64,
    backlog: bool,
}

#[derive(Default)]
pub struct PortalsProc {
    nis: [Option<NiState>; MAX_NIS],
}

impl HostCore {
    fn region_of(&self, job: u32, rank: u32, id: u32) -> Result<Region, PtlError> {
        self.endpoints
            .region(job, rank, id)
            .cloned()
            .map_err(|_| PtlError::ArgInvalid)
    }

    /// (job, rank)'s interface `ni`, whose events and counts may change: the next mirroring
    /// pass looks at it.
    fn ni_state(&mut self, job: u32, rank: u32, ni: u8) -> Result<&mut NiState, PtlError> {
        self.ptl_dirty = true;
        self.ni_lookup(job, rank, ni)
    }

    /// (job, rank)'s interface `ni`, for what changes no event or count.
    fn ni_lookup(&mut self, job: u32, rank: u32, ni: u8) -> Result<&mut NiState, PtlError> {
        self.portals
            .get_mut(&(job, rank))
            .and_then(|p| p.nis.get_mut((ni & 0x7f) as usize))
            .and_then(|n| n.as_mut())
            .ok_or(PtlError::ArgInvalid)
    }

    fn match_entry(&self, job: u32, rank: u32, m: &MeArgs) -> Result<MatchEntry, PtlError> {
        // Shared memory, or the process's own memory reached by copy (puts and gets; the
        // engine refuses atomics there, which must be atomic with the owner's).
        let region = self.region_of(job, rank, m.buf.region)?;
        let match_id = match m.match_id {
            (0, r, _) => ProcessId::Logical { rank: r },
            (_, nid, pid) => ProcessId::Physical { nid, pid },
        };
        Ok(MatchEntry {
            region,
            start: m.buf.offset,
            length: m.buf.length,
            ct: m.ct,
            uid: m.uid,
            options: m.options,
            match_id,
            match_bits: m.match_bits,
            ignore_bits: m.ignore_bits,
            min_free: m.min_free,
        })
    }

    /// Serves one Portals call of process (job, rank); `client_req` 0 asks for no completion.
    pub(super) fn ptl_command(
        &mut self,
        session: u64,
        job: u32,
        rank: u32,
        client_req: u64,
        inline: &[u8],
    ) -> Flow {
        let r = match PtlCall::decode(inline) {
            Ok(call) => self.ptl_call(job, rank, call, client_req == 0),
            Err(_) => Err(PtlError::ArgInvalid),
        };
        if client_req == 0 {
            if let Err(e) = r {
                // Nobody waits for the answer: the call's own failure is all there is to say.
                tracing::debug!(job, rank, error = %e, "a one-way Portals call failed");
            }
        } else {
            self.raw_completions.push((
                session,
                CqEntry {
                    client_req,
                    status: status_of(&r),
                    value: *r.as_ref().unwrap_or(&0),
                },
            ));
        }
        Flow::Done
    }

    /// One Portals call; `oneway` when nobody waits for its answer (an append then reports a
    /// refusal as an event).
    fn ptl_call(
        &mut self,
        job: u32,
        rank: u32,
        call: PtlCall,
        oneway: bool,
    ) -> Result<u64, PtlError> {
        let r = match call {
            PtlCall::NiInit { ni, matching } => {
                let p = self.portals.entry((job, rank)).or_default();
                let slot = p
                    .nis
                    .get_mut((ni & 0x7f) as usize)
                    .ok_or(PtlError::ArgInvalid)?;
                if slot.is_none() {
                    let mut engine = PortalsNi::new(matching, Default::default());
                    // Replies longer than a fragment are read as they go out.
                    let one = OpRef::max_data(OpKind::PtlResp, self.transport.body_capacity());
                    engine.stream_gets_from = Some(one as u64 + 1);
                    *slot = Some(NiState {
                        ni: engine,
                        logical: ni & 0x80 == 0,
                        logical_of: None,
                        eq_rings: HashMap::default(),
                        ct_slots: HashMap::default(),
                        mirrored: u64::MAX,
                        backlog: false,
                    });
                }
                return Ok(0);
            }
            PtlCall::EqAlloc { ni, count, ring } => {
                let region = self.region_of(job, rank, ring.region)?;
                let er =
                    EventRing::new(region, ring.offset, ring.length).ok_or(PtlError::ArgInvalid)?;
                if er.capacity() < count as usize {
                    return Err(PtlError::ArgInvalid);
                }
                let s = self.ni_state(job, rank, ni)?;
                let eq = s.ni.eq_alloc(count as usize)?;
                if let Some(q) = s.ni.eq_mut(eq) {
                    q.set_consumer(Box::new(er.consumer()));
                }
                s.eq_rings.insert(eq, er);
                Ok(eq as u64)
            }
            PtlCall::EqFree { ni, eq } => {
                let s = self.ni_state(job, rank, ni)?;
                s.ni.eq_free(eq)?;
                s.eq_rings.remove(&eq);
                Ok(0)
            }
            PtlCall::CtAlloc { ni, slot } => {
                let region = self.region_of(job, rank, slot.region)?;
                let cs = CtSlot::new(region, slot.offset).ok_or(PtlError::ArgInvalid)?;
                let s = self.ni_state(job, rank, ni)?;
                let ct = s.ni.ct_alloc()?;
                cs.store(CtEvent::default());
                s.ct_slots.insert(ct, cs);
                Ok(ct as u64)
            }
            PtlCall::CtFree { ni, ct } => {
                let s = self.ni_state(job, rank, ni)?;
                s.ni.ct_free(ct)?;
                s.ct_slots.remove(&ct);
                Ok(0)
            }
            PtlCall::CtSet {
                ni,
                ct,
                success,
                failure,
            } => self
                .ni_state(job, rank, ni)?
                .ni
                .ct_set(ct, CtEvent { success, failure })
                .map(|_| 0),
            PtlCall::CtInc {
                ni,
                ct,
                success,
                failure,
            } => self
                .ni_state(job, rank, ni)?
                .ni
                .ct_inc(ct, CtEvent { success, failure })
                .map(|_| 0),
            PtlCall::CtCancelTriggered { ni, ct } => self
                .ni_state(job, rank, ni)?
                .ni
                .ct_cancel_triggered(ct)
                .map(|_| 0),
            PtlCall::CtTriggered {
                ni,
                ct,
                threshold,
                target,
                set,
                success,
                failure,
            } => {
                let v = CtEvent { success, failure };
                let a = if set {
                    TriggeredAction::CtSet {
                        ct: target,
                        value: v,
                    }
                } else {
                    TriggeredAction::CtInc { ct: target, by: v }
                };
                self.ni_state(job, rank, ni)?
                    .ni
                    .triggered(ct, threshold, a)
                    .map(|_| 0)
            }
            PtlCall::PtAlloc {
                ni,
                options,
                eq,
                index,
            } => self
                .ni_state(job, rank, ni)?
                .ni
                .pt_alloc(options, eq, index)
                .map(u64::from),
            PtlCall::PtFree { ni, index } => {
                self.ni_state(job, rank, ni)?.ni.pt_free(index).map(|_| 0)
            }
            PtlCall::PtEnable { ni, index, enable } => {
                let n = &mut self.ni_state(job, rank, ni)?.ni;
                if enable {
                    n.pt_enable(index)
                } else {
                    n.pt_disable(index)
                }
                .map(|_| 0)
            }
            PtlCall::Append {
                ni,
                pt,
                overflow,
                user_ptr,
                me,
            } => {
                let e = match self.match_entry(job, rank, &me) {
                    Ok(e) => e,
                    Err(err) if oneway => {
                        let n = &mut self.ni_state(job, rank, ni)?.ni;
                        return n.link_refused(pt, user_ptr, err).map(|_| 0);
                    }
                    Err(err) => return Err(err),
                };
                let list = if overflow {
                    List::Overflow
                } else {
                    List::Priority
                };
                let n = &mut self.ni_state(job, rank, ni)?.ni;
                if oneway {
                    n.append_oneway(pt, e, list, user_ptr).map(|_| 0)
                } else {
                    n.append(pt, e, list, user_ptr).map(u64::from)
                }
            }
            PtlCall::Unlink { ni, handle } => {
                self.ni_state(job, rank, ni)?.ni.unlink(handle).map(|_| 0)
            }
            PtlCall::Search {
                ni,
                pt,
                delete,
                user_ptr,
                me,
            } => {
                let e = self.match_entry(job, rank, &me)?;
                let op = if delete {
                    SearchOp::SearchDelete
                } else {
                    SearchOp::SearchOnly
                };
                self.ni_state(job, rank, ni)?
                    .ni
                    .search(pt, e, op, user_ptr)
                    .map(|_| 0)
            }
            PtlCall::MdBind {
                ni,
                region,
                segments,
                options,
                eq,
                ct,
            } => {
                let r = self.region_of(job, rank, region)?;
                self.ni_state(job, rank, ni)?
                    .ni
                    .md_bind(r, segments, options, eq, ct)
                    .map(u64::from)
            }
            PtlCall::MdRelease { ni, md } => {
                self.ni_state(job, rank, ni)?.ni.md_release(md).map(|_| 0)
            }
            PtlCall::NiFini { ni } => {
                // Everything allocated on the interface goes with it; messages still arriving
                // for it find no interface and are dropped.
                self.ni_state(job, rank, ni)?;
                if let Some(slot) = self
                    .portals
                    .get_mut(&(job, rank))
                    .and_then(|p| p.nis.get_mut((ni & 0x7f) as usize))
                {
                    *slot = None;
                }
                Ok(0)
            }
            PtlCall::NiStatus { ni, register } => {
                let r = StatusRegister::from_u32(register).ok_or(PtlError::ArgInvalid)?;
                Ok(self.ni_state(job, rank, ni)?.ni.status(r))
            }
            PtlCall::SetMap { ni, ranks } => {
                let s = self.ni_state(job, rank, ni)?;
                let mut m = HashMap::with_capacity_and_hasher(ranks.len(), Default::default());
                for (i, r) in ranks.iter().enumerate() {
                    m.entry(*r).or_insert(i as u32);
                }
                s.logical_of = Some(m);
                Ok(0)
            }
            PtlCall::Op {
                ni,
                op: spec,
                trigger,
            } => {
                match trigger {
                    Some((ct, threshold)) => {
                        let n = &mut self.ni_state(job, rank, ni)?.ni;
                        match n.triggered(ct, threshold, TriggeredAction::Op(spec)) {
                            // Nobody hears a one-way call's answer: an operation the NIC
                            // could not arm counts a failure on its trigger counter, which
                            // the process watches (so its wait ends instead of hanging).
                            Err(e) if oneway => n
                                .ct_inc(
                                    ct,
                                    CtEvent {
                                        success: 0,
                                        failure: 1,
                                    },
                                )
                                .map_or(Err(e), |_| Ok(0)),
                            r => r.map(|_| 0),
                        }
                    }
                    None => match self.ptl_start(job, rank, ni, spec) {
                        // Started: what it released is run where its counts change
                        // (`ptl_start`, `ptl_complete`), so the scan below has nothing to
                        // find. A start that failed may have counted the failure.
                        Ok(()) => return Ok(0),
                        Err(e) => Err(e),
                    },
                }
            }
        };
        // Calls can release triggered operations (counting-event changes): start them.
        let fired: Vec<u8> = self.portals.get(&(job, rank)).map_or(Vec::new(), |p| {
            (0..MAX_NIS as u8)
                .filter(|&ni| {
                    p.nis
                        .get(ni as usize)
                        .and_then(|n| n.as_ref())
                        .is_some_and(|s| s.ni.has_fired())
                })
                .collect()
        });
        for ni in fired {
            self.ptl_run_fired(job, rank, ni);
        }
        r
    }

    /// Starts an operation of (job, rank)'s interface `ni`: to a local target directly, else as
    /// Portals request ops to the target's host.
    fn ptl_start(&mut self, job: u32, rank: u32, ni: u8, spec: OpSpec) -> Result<(), PtlError> {
        let ProcessId::Physical {
            nid: host,
            pid: target_rank,
        } = spec.target
        else {
            return Err(PtlError::ArgInvalid);
        };
        if host >= self.nhosts as u32 {
            return Err(PtlError::ArgInvalid);
        }
        // Its target learns it is coming, whether a call started it or a trigger fired (a
        // collective's NIC sends on its own).
        self.ptl_address(job, rank, ni, &spec);
        let host = host as u16;
        let (kind, aop, dt) = encode_kind(spec.kind);
        // A put or atomic wanting no acknowledgement is complete once sent: its target is
        // told not to answer (a datagram's op less each way, and no completion to process).
        let unanswered = host != self.index
            && spec.ack_req == AckReq::NoAck
            && matches!(spec.kind, ReqKind::Put | ReqKind::Atomic(..));
        let (length, remote_offset) = (spec.length, spec.remote_offset);
        let m = PtlHeader {
            ni,
            kind,
            atomic_op: aop,
            datatype: dt,
            pt_index: spec.pt_index,
            match_bits: spec.match_bits,
            remote_offset: spec.remote_offset,
            rlength: spec.length,
            hdr_data: spec.hdr_data,
            uid: 0,
            flags: if unanswered { PtlHeader::NO_ANSWER } else { 0 },
        };
        let header = |id: u32| OpHeader {
            job,
            src_rank: rank,
            dst_rank: target_rank,
            req: ((ni as u64) << 32) | id as u64,
        };
        // A remote put longer than one datagram streams from its MD; a shorter one is copied
        // here, into its only fragment.
        let one_fragment = OpRef::max_data(OpKind::PtlReq, self.transport.body_capacity());
        if host != self.index && spec.kind == ReqKind::Put && spec.length > one_fragment as u64 {
            let (id, src) = self.ni_state(job, rank, ni)?.ni.start_streamed(spec)?;
            // In order behind everything already waiting for this peer, acknowledgements too.
            if self.ptl_acks.peer == host {
                self.ptl_flush_acks();
            }
            self.out[host as usize].push_back(OutItem::PtlStream(PtlStream {
                h: header(id),
                m,
                src,
                sent: 0,
            }));
            self.drain_out(host);
            return Ok(());
        }
        let operand = spec.operand.clone();
        let mut payload = std::mem::take(&mut self.ptl_payload);
        let started = self
            .ni_state(job, rank, ni)
            .and_then(|s| s.ni.start(spec, &mut payload));
        let id = match started {
            Ok(id) => id,
            Err(e) => {
                self.ptl_payload = payload;
                return Err(e);
            }
        };
        let h = header(id);
        if host == self.index {
            let whole = Whole::Borrowed {
                h,
                m,
                operand: &operand,
                data: &payload,
            };
            let Delivered {
                mut resp,
                fired,
                stream,
                ..
            } = self.ptl_deliver(host, &whole);
            if let Some(s) = stream {
                // Between processes of this host a long get's reply is read at once.
                let read = s.region.append_to(s.at, s.len as usize, &mut resp.data);
                if let Err(why) = read {
                    resp.ni_fail = crate::nic::portals::ni::copy_fail(why);
                }
                self.ptl_complete_with(job, target_rank, ni, |n| n.streamed(s.token, resp.ni_fail));
            }
            self.ptl_complete(job, rank, ni, id, &resp);
            if fired {
                self.ptl_run_fired(job, target_rank, ni);
            }
        } else {
            let body = self.transport.body_capacity();
            for op in request_ops(h, m, &operand, &payload, body) {
                self.send_owned(host, &op, None);
            }
            if unanswered {
                let resp = Response::in_full(length, remote_offset);
                self.ptl_complete(job, rank, ni, id, &resp);
            }
        }
        // Kept for the next start, unless a large transfer grew it.
        if payload.capacity() <= PAYLOAD_KEEP {
            self.ptl_payload = payload;
        }
        Ok(())
    }

    /// Serves a whole request at its target interface.
    fn ptl_deliver(&mut self, from_host: u16, whole: &Whole<'_>) -> Delivered {
        self.ptl_deliver_as(from_host, whole, false)
            .expect("a whole message is always delivered")
    }

    /// [`HostCore::ptl_deliver`]; `first_fragment`: `whole` is the first fragment of a put in
    /// several, delivered only if it can stream (`PortalsNi::deliver_first`), else `None`.
    fn ptl_deliver_as(
        &mut self,
        from_host: u16,
        whole: &Whole<'_>,
        first_fragment: bool,
    ) -> Option<Delivered> {
        let (h, m, ..) = whole.parts();
        let Ok(s) = self.ni_state(h.job, h.dst_rank, m.ni) else {
            if first_fragment {
                return None;
            }
            self.stats.served_portals += 1;
            let resp = Response {
                ni_fail: NiFail::Undeliverable,
                ack: true,
                ..Default::default()
            };
            return Some(Delivered {
                resp,
                stream: None,
                put: None,
                fired: false,
                notified: false,
            });
        };
        let before = s.ni.notices();
        let initiator = if s.logical {
            let rank = s
                .logical_of
                .as_ref()
                .map_or(Some(h.src_rank), |m| m.get(&h.src_rank).copied());
            // A process outside the map has no logical name here: it matches only RANK_ANY.
            ProcessId::Logical {
                rank: rank.unwrap_or(crate::nic::portals::types::RANK_ANY - 1),
            }
        } else {
            ProcessId::Physical {
                nid: from_host as u32,
                pid: h.src_rank,
            }
        };
        let resp = match whole.request(initiator) {
            Ok(req) if first_fragment => s.ni.deliver_first(&req)?,
            Ok(req) => s.ni.deliver(&req),
            Err(_) if first_fragment => return None,
            Err(f) => Response {
                ni_fail: f,
                ack: true,
                ..Default::default()
            },
        };
        let d = Delivered {
            resp,
            stream: s.ni.take_get_stream(),
            put: s.ni.take_put_stream(),
            fired: s.ni.has_fired(),
            notified: s.ni.notices() != before,
        };
        self.stats.served_portals += 1;
        Some(d)
    }

    /// The first fragment of a put in several: matched and streamed where it can be
    /// (`PortalsNi::deliver_first`), else `None` and it is put together as before.
    fn ptl_put_begin(&mut self, peer: u16, op: &OpRef<'_>) -> Option<PtlPutIn> {
        let OpRef::PtlReq {
            h,
            m,
            operand,
            data,
            last: false,
        } = *op
        else {
            return None;
        };
        let whole = Whole::Borrowed {
            h,
            m,
            operand,
            data,
        };
        let d = self.ptl_deliver_as(peer, &whole, true)?;
        self.stats.streamed_portals_puts += 1;
        if d.fired {
            self.ptl_run_fired(h.job, h.dst_rank, m.ni);
        }
        Some(PtlPutIn {
            h,
            ni: m.ni,
            rlength: m.rlength,
            remote_offset: m.remote_offset,
            resp: d.resp,
            stream: d.put,
            got: data.len() as u64,
            notified: d.notified,
        })
    }

    /// A later fragment of a streamed put: its bytes that fall inside the match are written.
    fn ptl_put_more(pin: &mut PtlPutIn, data: &[u8]) {
        // Once a write failed, the rest is dropped.
        if let Some(s) = pin
            .stream
            .as_ref()
            .filter(|_| pin.resp.ni_fail == NiFail::Ok)
        {
            if pin.got < s.len {
                let n = (s.len - pin.got).min(data.len() as u64) as usize;
                if let Err(why) = s.region.write(s.at + pin.got, &data[..n]) {
                    pin.resp.ni_fail = crate::nic::portals::ni::copy_fail(why);
                }
            }
        }
        pin.got = pin.got.saturating_add(data.len() as u64);
    }

    /// A streamed put's last fragment is in (or its initiator is gone): the events it held
    /// back are posted. Returns whether its target process was told.
    fn ptl_put_end(&mut self, pin: &PtlPutIn) -> bool {
        let Some(s) = pin.stream.as_ref() else {
            return pin.notified;
        };
        let (h, fail) = (pin.h, pin.resp.ni_fail);
        let mut notified = pin.notified;
        self.ptl_complete_with(h.job, h.dst_rank, pin.ni, |n| {
            let before = n.notices();
            n.streamed(s.token, fail);
            notified |= n.notices() != before;
        });
        notified
    }

    /// Answers request `h` from `peer` that was served (not streamed back): `notified`, its
    /// target process was told; `in_full`, it was taken whole.
    fn ptl_answer(
        &mut self,
        now: u64,
        peer: u16,
        h: OpHeader,
        resp: &Response,
        notified: bool,
        in_full: bool,
    ) {
        // What the initiator knows already needs only the request's name, batched with the
        // other acknowledgements this datagram asks for (the batch waits a little for
        // company: see SILENT_ACK_LAZY_NS). An answer the target process will give (a
        // notified delivery) is left to carry it lazily.
        if in_full && !notified {
            self.ptl_ack(peer, h.job, h.src_rank, h.req);
            return;
        }
        let back = OpHeader {
            job: h.job,
            src_rank: h.dst_rank,
            dst_rank: h.src_rank,
            req: h.req,
        };
        let body = self.transport.body_capacity();
        // An acknowledgement without data may wait a little for company when the target
        // process was told of the delivery (its answer, as in a ping-pong, carries it: one
        // datagram less per message each way). A silent one that was not taken in full
        // (truncated, refused) goes now.
        let lazy = (resp.data.is_empty() && notified).then_some(now + ACK_LAZY_NS);
        for o in response_ops(back, resp, body) {
            self.send_owned(peer, &o, lazy);
        }
    }

    /// A long get's reply stream left the queue: the events its target held back, failed if
    /// its memory could not be read (the initiator is told so by a last, failed fragment:
    /// undeliverable when the process owning the memory exited meanwhile, as for a process
    /// that is gone, else a bad address).
    pub(super) fn ptl_reply_ended(&mut self, peer: u16, rs: &PtlReplyStream, end: StreamEnd) {
        if let StreamEnd::Unreadable(why) = end {
            let f = crate::nic::portals::ni::copy_fail(why);
            self.push_owned(peer, &rs.op(rs.sent, 0, f), None);
        }
        let ok = matches!(end, StreamEnd::Sent);
        let (job, rank, ni) = rs.target;
        let token = rs.src.token;
        let fail = if ok { NiFail::Ok } else { NiFail::Segv };
        self.ptl_complete_with(job, rank, ni, |n| n.streamed(token, fail));
    }

    /// A stream left the queue: its SEND event, or its failure.
    pub(super) fn ptl_stream_ended(&mut self, ps: &PtlStream, end: StreamEnd) {
        let ((job, rank), (ni, id)) = (ps.owner(), ps.op());
        match end {
            StreamEnd::Sent => {
                if let Ok(s) = self.ni_state(job, rank, ni) {
                    s.ni.sent(id);
                }
                if ps.m.flags & PtlHeader::NO_ANSWER != 0 {
                    let resp = Response::in_full(ps.m.rlength, ps.m.remote_offset);
                    self.ptl_complete(job, rank, ni, id, &resp);
                }
            }
            StreamEnd::Unreadable(_) => {
                // The target holds a partial message it never completes (bounded in bytes);
                // the initiator learns of the failure as for a put from unmapped memory.
                let resp = Response {
                    ni_fail: NiFail::Segv,
                    ack: true,
                    ..Default::default()
                };
                self.ptl_complete(job, rank, ni, id, &resp);
            }
            StreamEnd::PeerGone => {}
        }
    }

    fn ptl_complete(&mut self, job: u32, rank: u32, ni: u8, id: u32, resp: &Response) {
        self.ptl_complete_with(job, rank, ni, |n| n.complete(id, resp));
    }

    /// Completes an operation of (job, rank)'s interface `ni` with `complete`, then starts
    /// what its counting events released.
    fn ptl_complete_with(
        &mut self,
        job: u32,
        rank: u32,
        ni: u8,
        complete: impl FnOnce(&mut PortalsNi),
    ) {
        let fired = self.ni_state(job, rank, ni).is_ok_and(|s| {
            complete(&mut s.ni);
            s.ni.has_fired()
        });
        if fired {
            self.ptl_run_fired(job, rank, ni);
        }
    }

    /// Notes whom a put about to start sends a message to (`HostCore::poll_addressed`),
    /// unless its MD says nobody waits for it (`md_opt::QUIET`) or it is too long to be
    /// waited for by spinning (`ANNOUNCE_MAX_BYTES`).
    fn ptl_address(&mut self, job: u32, rank: u32, ni: u8, spec: &OpSpec) {
        let (ReqKind::Put, ProcessId::Physical { nid, pid }) = (spec.kind, spec.target) else {
            return;
        };
        // A look, not a change: `ni_lookup` leaves the mirror alone.
        let quiet = self
            .ni_lookup(job, rank, ni)
            .ok()
            .and_then(|s| s.ni.md_options(spec.md))
            .is_some_and(|o| o & md_opt::QUIET != 0);
        if !quiet {
            self.address_put((nid as u16, job, pid), spec.length);
        }
    }

    /// Starts the operations triggers released on (job, rank)'s interface `ni`.
    fn ptl_run_fired(&mut self, job: u32, rank: u32, ni: u8) {
        for _ in 0..1024 {
            let Some(spec) = self
                .ni_state(job, rank, ni)
                .ok()
                .and_then(|s| s.ni.take_fired())
            else {
                return;
            };
            if let Err(e) = self.ptl_start(job, rank, ni, spec) {
                tracing::debug!(host = %self.name, "triggered operation could not start: {e}");
            }
        }
    }

    /// A Portals op from a peer.
    pub(super) fn ptl_on_op(&mut self, now: u64, peer: u16, op: &OpRef<'_>) {
        match op {
            OpRef::PtlReq {
                h, m, last, data, ..
            } => {
                // What its initiator completed when it sent it is served, never answered.
                let answer = m.flags & PtlHeader::NO_ANSWER == 0;
                let key = msg_key(peer, h);
                // Most messages are one fragment and no put streams in: no lookup then.
                let streaming = !self.ptl_put_in.is_empty();
                if let Some(mut pin) = streaming.then(|| self.ptl_put_in.remove(&key)).flatten() {
                    Self::ptl_put_more(&mut pin, data);
                    if !*last {
                        self.ptl_put_in.insert(key, pin);
                        return;
                    }
                    let notified = self.ptl_put_end(&pin);
                    let in_full = pin.resp == Response::in_full(pin.rlength, pin.remote_offset);
                    if answer {
                        self.ptl_answer(now, peer, pin.h, &pin.resp, notified, in_full);
                    }
                    return;
                }
                if !*last && !self.ptl_asm.has_request(peer, h) {
                    if let Some(pin) = self.ptl_put_begin(peer, op) {
                        self.ptl_put_in.insert(key, pin);
                        return;
                    }
                }
                let mut asm = std::mem::take(&mut self.ptl_asm);
                let got = asm.request(peer, op);
                self.ptl_asm = asm;
                let (h, resp, notified, in_full, stream) = match got {
                    None => return,
                    Some(Err((h, f))) => (
                        h,
                        Response {
                            ni_fail: f,
                            ack: true,
                            ..Default::default()
                        },
                        false,
                        false,
                        None,
                    ),
                    Some(Ok(whole)) => {
                        let (h, m, ..) = whole.parts();
                        let d = self.ptl_deliver(peer, &whole);
                        self.ptl_asm.recycle(whole);
                        if d.fired {
                            self.ptl_run_fired(h.job, h.dst_rank, m.ni);
                        }
                        let in_full = d.resp == Response::in_full(m.rlength, m.remote_offset);
                        let stream = d.stream.map(|s| (s, m.ni));
                        (h, d.resp, d.notified, in_full, stream)
                    }
                };
                let back = OpHeader {
                    job: h.job,
                    src_rank: h.dst_rank,
                    dst_rank: h.src_rank,
                    req: h.req,
                };
                if let Some((src, ni)) = stream {
                    // Behind what is queued for the peer (batched acknowledgements first).
                    if self.ptl_acks.peer == peer {
                        self.ptl_flush_acks();
                    }
                    let rs = PtlReplyStream {
                        h: back,
                        ack: resp.ack,
                        mlength: resp.mlength,
                        offset: resp.offset,
                        src,
                        sent: 0,
                        target: (h.job, h.dst_rank, ni),
                    };
                    self.out[peer as usize].push_back(OutItem::PtlReply(rs));
                    self.drain_out(peer);
                    return;
                }
                if answer {
                    self.ptl_answer(now, peer, h, &resp, notified, in_full);
                }
            }
            OpRef::PtlResp { h, .. } => {
                // A long reply goes straight into the initiator's MD, fragment by fragment.
                let (ni, id) = ((h.req >> 32) as u8, h.req as u32);
                let mut asm = std::mem::take(&mut self.ptl_asm);
                let got = asm.response(peer, op, &mut |off, data| {
                    self.ni_lookup(h.job, h.dst_rank, ni)
                        .map_or(true, |s| s.ni.reply_place(id, off, data))
                });
                self.ptl_asm = asm;
                if let Some((_, resp)) = got {
                    self.ptl_complete(h.job, h.dst_rank, ni, id, &resp);
                }
            }
            OpRef::PtlAcks { h, acks } => {
                for (rank, req) in ptl_acks(h, acks) {
                    let (ni, id) = ((req >> 32) as u8, req as u32);
                    self.ptl_complete_with(h.job, rank, ni, |n| {
                        n.complete_in_full(id, peer as u32)
                    });
                }
            }
            _ => {}
        }
    }

    /// Prefetches the word an atomic request op will update (a guess; see
    /// [`crate::nic::portals::PortalsNi::prefetch_atomic`]).
    pub(super) fn ptl_prefetch(&mut self, op: &OpRef<'_>) {
        let OpRef::PtlReq { h, m, .. } = op else {
            return;
        };
        if crate::nic::portals::wire::is_atomic_kind(m.kind) {
            if let Ok(s) = self.ni_state(h.job, h.dst_rank, m.ni) {
                s.ni.prefetch_atomic(m.pt_index, m.remote_offset);
            }
        }
    }

    /// Batches an acknowledgement in full of request `req` of (job, rank) for `peer`.
    fn ptl_ack(&mut self, peer: u16, job: u32, rank: u32, req: u64) {
        let room = OpRef::max_data(OpKind::PtlAcks, self.transport.body_capacity());
        let b = &self.ptl_acks;
        if b.first.is_some()
            && (b.peer != peer || b.job != job || b.rest.len() + PTL_ACK_LEN > room)
        {
            self.ptl_flush_acks();
        }
        let b = &mut self.ptl_acks;
        (b.peer, b.job) = (peer, job);
        match b.first {
            None => b.first = Some((rank, req)),
            Some(_) => push_ptl_ack(&mut b.rest, rank, req),
        }
    }

    /// Sends the batched acknowledgements, lazily: the next op for that peer carries them.
    pub(super) fn ptl_flush_acks(&mut self) {
        let Some((rank, req)) = self.ptl_acks.first.take() else {
            return;
        };
        let h = OpHeader {
            job: self.ptl_acks.job,
            dst_rank: rank,
            req,
            ..Default::default()
        };
        let mut rest = std::mem::take(&mut self.ptl_acks.rest);
        let lazy = Some(self.now + SILENT_ACK_LAZY_NS);
        self.push_owned(self.ptl_acks.peer, &OpRef::PtlAcks { h, acks: &rest }, lazy);
        rest.clear();
        self.ptl_acks.rest = rest;
    }

    /// Queues an op for `peer`, in order behind anything already waiting for room (batched
    /// acknowledgements included). `lazy`: the op may wait until that deadline for other
    /// traffic to share a datagram.
    fn send_owned(&mut self, peer: u16, op: &OpRef<'_>, lazy: Option<u64>) {
        if self.ptl_acks.peer == peer {
            self.ptl_flush_acks();
        }
        self.push_owned(peer, op, lazy);
    }

    pub(super) fn push_owned(&mut self, peer: u16, op: &OpRef<'_>, lazy: Option<u64>) {
        // A request passes what other processes queued for this peer (order is per process);
        // answers keep their place.
        let owner = match op {
            OpRef::PtlReq { h, .. } | OpRef::Put { h, .. } | OpRef::Get { h, .. } => {
                Some((h.job, h.src_rank))
            }
            _ => None,
        };
        let out = &self.out[peer as usize];
        let passes = match owner {
            Some(o) => !out.iter().any(|it| it.owner() == Some(o)),
            None => out.is_empty(),
        };
        if passes {
            let pushed = match lazy {
                Some(d) => self.transport.push_op_lazy_until(peer, op, d),
                None => self.transport.push_op(peer, op),
            };
            match pushed {
                Ok(()) => return,
                Err(PushError::Full(_)) => {}
                Err(_) => return, // dead peer: its operations fail through ptl_peer_dead
            }
        }
        let mut bytes = self.encoded_spare.pop().unwrap_or_default();
        bytes.clear();
        op.encode_append(&mut bytes);
        self.out[peer as usize].push_back(OutItem::Encoded { bytes, owner });
    }

    /// Takes back the buffer of an encoded op that went into the transport.
    pub(super) fn recycle_encoded(&mut self, b: Vec<u8>) {
        if self.encoded_spare.len() < ENCODED_SPARE {
            self.encoded_spare.push(b);
        }
    }

    /// Fails every Portals operation aimed at a dead (or restarted) host.
    pub(super) fn ptl_peer_dead(&mut self, host: u16) {
        self.ptl_dirty = true;
        // Puts it was streaming in will not end: their held events are posted as failed.
        let gone: Vec<_> = self
            .ptl_put_in
            .keys()
            .filter(|k| k.0 == host)
            .copied()
            .collect();
        for k in gone {
            if let Some(mut pin) = self.ptl_put_in.remove(&k) {
                pin.resp.ni_fail = NiFail::Undeliverable;
                self.ptl_put_end(&pin);
            }
        }
        for p in self.portals.values_mut() {
            for s in p.nis.iter_mut().flatten() {
                s.ni.fail_outgoing(|spec| matches!(spec.target, ProcessId::Physical { nid, .. } if nid == host as u32), NiFail::Undeliverable);
            }
        }
    }

    /// Moves events into the processes' event rings and counts into their slots; wakes
    /// sleeping processes that got something. Returns whether anything moved.
    pub(super) fn ptl_mirror(&mut self) -> bool {
        if !std::mem::take(&mut self.ptl_dirty) {
            return false;
        }
        let mut moved = false;
        let MirrorScratch {
            mut woken,
            mut cts,
            mut rooms,
        } = std::mem::take(&mut self.ptl_scratch);
        for (&(job, rank), p) in self.portals.iter_mut() {
            let mut any = false;
            for s in p.nis.iter_mut().flatten() {
                if s.ni.notices() == s.mirrored && !s.backlog {
                    continue;
                }
                s.mirrored = s.ni.notices();
                s.backlog = false;
                rooms.clear();
                for (&eq, ring) in s.eq_rings.iter_mut() {
                    let Some(q) = s.ni.eq_mut(eq) else { continue };
                    if q.is_empty() {
                        continue;
                    }
                    // An upper bound: a read of the process's index (a cache line it writes)
                    // before each push kept the event from its process for a cross-core miss.
                    rooms.push((eq, ring.held(), ring.capacity() as u64));
                }
                cts.clear();
                s.ni.take_dirty_cts(&mut cts);
                // Events and counts reach the process in the order the engine changed them
                // (by stamp): a process that sees an event also sees every count that changed
                // before it (a put's ACK counted, then a later get's REPLY), and one that sees
                // a count, every event posted before the count's first change of this pass (a
                // count changed again after an event shows its later value before it). Counts
                // behind events that wait for ring room do not wait with them.
                let mut next_ct = 0;
                loop {
                    let oldest = rooms
                        .iter()
                        .enumerate()
                        .filter(|(_, &(_, used, cap))| used < cap)
                        .filter_map(|(i, &(eq, _, _))| Some((i, s.ni.eq_mut(eq)?.head_stamp()?)))
                        .min_by_key(|&(_, stamp)| stamp);
                    let Some((i, stamp)) = oldest else { break };
                    while let Some(&(ct, v, _)) = cts.get(next_ct).filter(|c| c.2 < stamp) {
                        if let Some(slot) = s.ct_slots.get(&ct) {
                            moved = true;
                            any |= slot.store(v);
                        }
                        next_ct += 1;
                    }
                    let (eq, used, _) = &mut rooms[i];
                    let (Some(q), Some(ring)) = (s.ni.eq_mut(*eq), s.eq_rings.get_mut(eq)) else {
                        break;
                    };
                    let Some((e, dropped)) = q.take() else { break };
                    ring.push(&e, dropped);
                    *used += 1;
                    any = true;
                }
                for &(ct, v, _) in &cts[next_ct..] {
                    if let Some(slot) = s.ct_slots.get(&ct) {
                        moved = true;
                        any |= slot.store(v);
                    }
                }
                // Events wait for ring room: look again next turn (the process frees it
                // without a word).
                let mut waiting = false;
                for &(eq, _, _) in &rooms {
                    waiting |= s.ni.eq_mut(eq).is_some_and(|q| !q.is_empty());
                }
                s.backlog = waiting;
                self.ptl_dirty |= waiting;
            }
            if any {
                moved = true;
                woken.push((job, rank));
            }
        }
        for (job, rank) in woken.drain(..) {
            if let Ok(ep) = self.endpoints.get(job, rank) {
                self.wakes.push(ep.session);
            }
        }
        self.ptl_scratch = MirrorScratch { woken, cts, rooms };
        if moved {
            phase_trace::stamp(Phase::EventsMirrored);
        }
        moved
    }
}
