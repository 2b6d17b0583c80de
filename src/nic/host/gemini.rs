//! The Gemini engine's glue in the host core: commands of attached processes become FMA/BTE
//! wire ops, ops from peers are served against registered memory, replies and bulk streams
//! wait in per-peer queues for room in the transport.

use crate::nic::gemini::{
    place_packed, serve, Completion, Pending, PendingKind, Reply, TargetAction,
};
use crate::nic::memory::{Endpoints, Region};
use crate::shm::{Command, CommandKind, PeerFailure, CMD_IMPLICIT, CMD_LAND};
use crate::transport::PushError;
use crate::wire::{get_u64, OpHeader, OpIter, OpKind, OpRef, Status, VShape};

use super::{Flow, HostCore};

/// The completion value of an operation refused because `host` cannot be reached.
pub(super) fn lost(host: u16) -> u64 {
    PeerFailure {
        host,
        op: None,
        waited_ms: 0,
    }
    .pack()
}

/// The fragments of a put of `data` at `offset` of `region`, `max` data bytes each (one
/// empty fragment for no data); every fragment names the whole put.
pub(super) fn put_fragments<'a>(
    h: OpHeader,
    region: u32,
    offset: u64,
    data: &'a [u8],
    lazy_ack: bool,
    max: usize,
) -> impl Iterator<Item = OpRef<'a>> + 'a {
    let max = max.max(1);
    let frags = data.len().div_ceil(max).max(1);
    (0..frags).map(move |i| {
        let at = i * max;
        let end = (at + max).min(data.len());
        OpRef::Put {
            h,
            region,
            offset: offset + at as u64,
            total_off: offset,
            total_len: data.len() as u64,
            last: i + 1 == frags,
            lazy_ack,
            notify: 0,
            data: &data[at..end],
        }
    })
}

/// The target-side shape of a whole vector command (first element 0, all of them): its
/// extent from the stride or the listed offsets; `None` when an offset overflows.
fn vector_shape(c: &Command, inline: &[u8]) -> Option<VShape> {
    let (e, n) = (c.elem as u64, c.nelems);
    let mut s = VShape {
        elem: c.elem,
        indexed: c.indexed,
        first: 0,
        n,
        base: c.remote_off,
        stride: c.operand as i64,
        lo: 0,
        hi: 0,
    };
    let (lo, hi) = if c.indexed {
        let idx = inline.get(..n as usize * 8)?;
        let offs = idx.chunks_exact(8).map(|b| get_u64(b, 0));
        (offs.clone().min()?, offs.max()?)
    } else {
        let last = c.remote_off as i128 + (n as i128 - 1) * s.stride as i128;
        let last = u64::try_from(last).ok()?;
        (c.remote_off.min(last), c.remote_off.max(last))
    };
    s.lo = lo;
    s.hi = hi.checked_add(e)?;
    Some(s)
}

/// Whether the elements `local_off + k·stride` (k < n) of `elem` bytes lie in `r`.
fn local_strided_fits(r: &Region, local_off: u64, stride: i64, elem: u8, n: u32) -> bool {
    let last = local_off as i128 + (n as i128 - 1) * stride as i128;
    let (a, b) = (local_off as i128, last);
    let (lo, hi) = (a.min(b), a.max(b) + elem as i128);
    lo >= 0 && hi <= r.len() as i128
}

/// How many ops ahead of the one being served an atomic's target is prefetched.
const PREFETCH_AHEAD: usize = 8;

/// An outbound item waiting for room in the transport (kept in order per peer).
pub(super) enum OutItem {
    Reply(Reply),
    Stream(Stream),
    /// An op owned in encoded form (Portals requests and responses that found no room), and
    /// the process whose request it is (none for a response).
    Encoded {
        bytes: Vec<u8>,
        owner: Option<(u32, u32)>,
    },
    /// A large Portals put, read from its MD a fragment at a time as room appears.
    PtlStream(super::portals::PtlStream),
    /// A long Portals get's reply, read from the target entry a fragment at a time.
    PtlReply(super::portals::PtlReplyStream),
}

impl OutItem {
    /// The process (job, rank) whose request this is; `None` for answers to a peer's requests.
    /// A process's later ops wait behind its own queued items (order per process); other
    /// processes' ops pass them.
    pub(super) fn owner(&self) -> Option<(u32, u32)> {
        match self {
            OutItem::Stream(st) => {
                matches!(st.kind, StreamKind::Put { .. }).then_some((st.h.job, st.h.src_rank))
            }
            OutItem::PtlStream(ps) => Some(ps.owner()),
            OutItem::Encoded { owner, .. } => *owner,
            OutItem::Reply(_) | OutItem::PtlReply(_) => None,
        }
    }
}

/// Stream data kept waiting in the transport ahead of other traffic, in bytes: enough to keep
/// the window full between turns, little enough that a small op of another process queued
/// behind it waits for a few datagrams at most, not for the whole transfer.
const STREAM_AHEAD_BYTES: usize = 256 << 10;

/// Whether a stream may push another fragment to `peer` now.
pub(super) fn stream_may_push(t: &crate::transport::Transport, peer: u16) -> bool {
    let ahead = (STREAM_AHEAD_BYTES / t.body_capacity().max(1)).max(2);
    t.queued_len(peer) < ahead
}

/// Data bytes of a stream's next fragment of `kind` to `peer`, `remaining` left: what the open
/// datagram holds, unless only a sliver is left in it (then a datagram of its own).
pub(super) fn fragment_len(
    t: &crate::transport::Transport,
    peer: u16,
    kind: OpKind,
    remaining: u64,
) -> u64 {
    let room = OpRef::max_data(kind, t.open_room(peer));
    let max = if room as u64 >= remaining || room >= 1024 {
        room
    } else {
        OpRef::max_data(kind, t.body_capacity())
    };
    remaining.min(max.max(1) as u64)
}

/// Bulk data streamed from a region as fragments: a BTE put or a get reply.
pub(super) struct Stream {
    kind: StreamKind,
    h: OpHeader,
    src: Region,
    src_off: u64,
    len: u64,
    sent: u64,
    started: bool,
    /// Get replies: the packed byte offset this stream's data starts at (vector gets).
    frag_base: u64,
    /// An EXTOLL notification for process (job, rank) once the last fragment has left (an RMA
    /// put's requester: its source was read; an RMA get's responder: it was served).
    pub(super) on_end: Option<(u32, u32, crate::nic::rma::Notification)>,
}

pub(super) enum StreamKind {
    Put {
        region: u32,
        dst_off: u64,
        lazy_ack: bool,
        /// An RMA put: the target notifies its process when the data is in place.
        notify: bool,
    },
    GetReply,
}

impl Stream {
    /// A BTE put of `len` bytes of `src` from `src_off` to `region` at `dst_off`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn put(
        h: OpHeader,
        src: Region,
        src_off: u64,
        len: u64,
        region: u32,
        dst_off: u64,
        lazy_ack: bool,
        notify: bool,
    ) -> Stream {
        Stream {
            kind: StreamKind::Put {
                region,
                dst_off,
                lazy_ack,
                notify,
            },
            h,
            src,
            src_off,
            len,
            sent: 0,
            started: false,
            frag_base: 0,
            on_end: None,
        }
    }
}

impl HostCore {
    pub(super) fn complete(&mut self, session: u64, client_req: u64, status: Status, value: u64) {
        self.completions.push(Completion {
            session,
            client_req,
            status,
            value,
        });
    }

    pub(super) fn command(
        &mut self,
        now: u64,
        session: u64,
        job: u32,
        rank: u32,
        c: &Command,
        inline: &[u8],
    ) -> Flow {
        match c.kind {
            CommandKind::PutInline | CommandKind::PutFrom | CommandKind::PutV => {
                self.stats.cmd_put += 1
            }
            CommandKind::Get | CommandKind::GetV => self.stats.cmd_get += 1,
            CommandKind::Amo | CommandKind::AmoScatter => self.stats.cmd_amo += 1,
            CommandKind::Portals => {
                self.stats.cmd_portals += 1;
                return self.ptl_command(session, job, rank, c.client_req, inline);
            }
            CommandKind::VeloOpen => return self.velo_open(session, job, rank, c),
            CommandKind::RmaOpen => return self.rma_open(session, job, rank, c),
            CommandKind::RmaPut | CommandKind::RmaGet | CommandKind::RmaImmediate => {
                return self.rma_command(now, session, job, rank, c, inline)
            }
            CommandKind::VeloSend => return self.velo_send(now, session, job, rank, c, inline),
            CommandKind::Ixpe => {
                if c.operand == super::ixpe::IxpeMode::Gather as u64 {
                    self.stats.cmd_get += 1;
                } else {
                    self.stats.cmd_put += 1;
                }
                return self.ixpe_command(now, session, job, rank, c, inline);
            }
        }
        if c.host >= self.nhosts {
            self.complete(session, c.client_req, Status::BadRequest, 0);
            return Flow::Done;
        }
        let h = OpHeader {
            job,
            src_rank: rank,
            dst_rank: c.rank,
            req: 0,
        };
        if c.host == self.index {
            self.stats.local_ops += 1;
            let land = (c.kind == CommandKind::Amo && c.flags & CMD_LAND != 0)
                .then(|| self.own_local(job, rank, c.local_region, c.local_off, 8));
            if let Some(Err(s)) = land {
                self.complete(session, c.client_req, s, 0);
                return Flow::Done;
            }
            let (mut status, value) = self.local(h, c, inline);
            if let (Some(Ok(r)), true) = (land, status.is_ok()) {
                if let Err(s) = r.write(c.local_off, &value.to_le_bytes()) {
                    status = s;
                }
            }
            self.complete(session, c.client_req, status, value);
            return Flow::Done;
        }
        let host = c.host;
        if let Err(flow) = self.may_send(host, (h.job, h.src_rank), session, c.client_req) {
            return flow;
        }
        let pending = |kind| Pending {
            started: now,
            session,
            client_req: c.client_req,
            host,
            kind,
        };
        match c.kind {
            // Served before any host routing (see the top of `command`).
            CommandKind::Portals
            | CommandKind::Ixpe
            | CommandKind::VeloOpen
            | CommandKind::VeloSend
            | CommandKind::RmaOpen
            | CommandKind::RmaPut
            | CommandKind::RmaGet
            | CommandKind::RmaImmediate => {}
            CommandKind::PutInline => {
                let max = OpRef::max_data(OpKind::Put, self.transport.body_capacity());
                let frags = inline.len().div_ceil(max).max(1);
                if self.transport.queued_space(host) < frags + 1 {
                    return Flow::Backpressure;
                }
                let req = self.initiator.start(pending(PendingKind::Put));
                let h = OpHeader { req, ..h };
                let lazy = c.flags & CMD_IMPLICIT != 0;
                for op in put_fragments(h, c.remote_region, c.remote_off, inline, lazy, max) {
                    if let Err(e) = self.transport.push_op(host, &op) {
                        tracing::error!("push after reserving room failed: {e}");
                        if let Some(done) =
                            self.initiator.complete(req, Status::PeerDead, lost(host))
                        {
                            self.completions.push(done);
                        }
                        break;
                    }
                }
            }
            CommandKind::PutFrom => {
                let Some(src) = self.own_side(session, job, rank, c) else {
                    return Flow::Done;
                };
                let req = self.initiator.start(pending(PendingKind::Put));
                self.out[host as usize].push_back(OutItem::Stream(Stream::put(
                    OpHeader { req, ..h },
                    src,
                    c.local_off,
                    c.len,
                    c.remote_region,
                    c.remote_off,
                    c.flags & CMD_IMPLICIT != 0,
                    false,
                )));
                // Into the transport now as far as it has room: the process's next command
                // waits only for what is left behind.
                self.drain_out(host);
            }
            CommandKind::Get => {
                let Some(region) = self.own_side(session, job, rank, c) else {
                    return Flow::Done;
                };
                let req = self.initiator.start(pending(PendingKind::Get {
                    region,
                    offset: c.local_off,
                    len: c.len,
                }));
                let op = OpRef::Get {
                    h: OpHeader { req, ..h },
                    region: c.remote_region,
                    offset: c.remote_off,
                    len: c.len,
                    notify: false,
                };
                self.push_or_fail(host, req, &op);
            }
            CommandKind::PutV => {
                let Some(shape) = vector_shape(c, inline) else {
                    self.complete(session, c.client_req, Status::BadRequest, 0);
                    return Flow::Done;
                };
                let per = shape.elem as usize + if shape.indexed { 8 } else { 0 };
                let m = (OpRef::max_data(OpKind::PutV, self.transport.body_capacity()) / per).max(1)
                    as u32;
                let frags = shape.n.div_ceil(m) as usize;
                if self.transport.queued_space(host) < frags + 1 {
                    return Flow::Backpressure;
                }
                let req = self.initiator.start(pending(PendingKind::Put));
                let h = OpHeader { req, ..h };
                let (idx, elems) = inline.split_at(shape.idx_len());
                let e = shape.elem as usize;
                let mut first = 0u32;
                while first < shape.n {
                    let n = m.min(shape.n - first);
                    let s = VShape { first, n, ..shape };
                    let op = OpRef::PutV {
                        h,
                        region: c.remote_region,
                        s,
                        last: first + n == shape.n,
                        lazy_ack: c.flags & CMD_IMPLICIT != 0,
                        data: &[],
                    };
                    let (f, t) = (first as usize, (first + n) as usize);
                    let idx_part = if shape.indexed {
                        &idx[f * 8..t * 8]
                    } else {
                        &[][..]
                    };
                    let el_part = &elems[f * e..t * e];
                    let pushed = self.transport.push_op_filled(
                        host,
                        &op,
                        idx_part.len() + el_part.len(),
                        &mut |b| {
                            b.extend_from_slice(idx_part);
                            b.extend_from_slice(el_part);
                            true
                        },
                    );
                    if let Err(e) = pushed {
                        tracing::error!("push after reserving room failed: {e}");
                        if let Some(done) =
                            self.initiator.complete(req, Status::PeerDead, lost(host))
                        {
                            self.completions.push(done);
                        }
                        break;
                    }
                    first += n;
                }
            }
            CommandKind::GetV => {
                let Some(shape) = vector_shape(c, inline) else {
                    self.complete(session, c.client_req, Status::BadRequest, 0);
                    return Flow::Done;
                };
                let Some(region) = self.own_vector_dst(session, job, rank, c) else {
                    return Flow::Done;
                };
                // Strided: one request, the target streams every element back. Indexed: the
                // offset list split into requests of a datagram each.
                let m = if shape.indexed {
                    (OpRef::max_data(OpKind::GetV, self.transport.body_capacity()) / 8).max(1)
                        as u32
                } else {
                    shape.n
                };
                let parts = shape.n.div_ceil(m);
                if self.transport.queued_space(host) < parts as usize + 1 {
                    return Flow::Backpressure;
                }
                let req = self.initiator.start(pending(PendingKind::GetV {
                    region,
                    offset: c.local_off,
                    stride: c.operand2 as i64,
                    elem: c.elem,
                    nelems: c.nelems,
                    parts,
                }));
                let mut first = 0u32;
                while first < shape.n {
                    let n = m.min(shape.n - first);
                    let (f, t) = (first as usize * 8, (first + n) as usize * 8);
                    let op = OpRef::GetV {
                        h: OpHeader { req, ..h },
                        region: c.remote_region,
                        s: VShape { first, n, ..shape },
                        idx: if shape.indexed { &inline[f..t] } else { &[] },
                    };
                    if self.transport.push_op(host, &op).is_err() {
                        if let Some(done) =
                            self.initiator.complete(req, Status::PeerDead, lost(host))
                        {
                            self.completions.push(done);
                        }
                        break;
                    }
                    first += n;
                }
            }
            CommandKind::AmoScatter => {
                let Some(amo) = c.amo else {
                    self.complete(session, c.client_req, Status::BadRequest, 0);
                    return Flow::Done;
                };
                let max =
                    OpRef::max_data(OpKind::AmoScatter, self.transport.body_capacity()) / 16 * 16;
                let frags = inline.len().div_ceil(max).max(1);
                if self.transport.queued_space(host) < frags + 1 {
                    return Flow::Backpressure;
                }
                let req = self.initiator.start(pending(PendingKind::Amo));
                let h = OpHeader { req, ..h };
                let mut chunks = inline.chunks(max).peekable();
                loop {
                    let pairs = chunks.next().unwrap_or(&[]);
                    let last = chunks.peek().is_none();
                    let op = OpRef::AmoScatter {
                        h,
                        region: c.remote_region,
                        op: amo,
                        last,
                        pairs,
                    };
                    if self.transport.push_op(host, &op).is_err() {
                        if let Some(done) =
                            self.initiator.complete(req, Status::PeerDead, lost(host))
                        {
                            self.completions.push(done);
                        }
                        break;
                    }
                    if last {
                        break;
                    }
                }
            }
            CommandKind::Amo => {
                let Some(amo) = c.amo else {
                    self.complete(session, c.client_req, Status::BadRequest, 0);
                    return Flow::Done;
                };
                let kind = if c.flags & CMD_LAND != 0 {
                    match self.own_local(job, rank, c.local_region, c.local_off, 8) {
                        Ok(region) => PendingKind::AmoLand {
                            region,
                            offset: c.local_off,
                        },
                        Err(s) => {
                            self.complete(session, c.client_req, s, 0);
                            return Flow::Done;
                        }
                    }
                } else {
                    PendingKind::Amo
                };
                let req = self.initiator.start(pending(kind));
                let op = OpRef::Amo {
                    h: OpHeader { req, ..h },
                    region: c.remote_region,
                    op: amo,
                    offset: c.remote_off,
                    operand: c.operand,
                    operand2: c.operand2,
                };
                self.push_or_fail(host, req, &op);
            }
        }
        Flow::Done
    }

    /// `[off, off+len)` of this client's own region `handle` (mapped, or reached by copy).
    fn own_local(
        &self,
        job: u32,
        rank: u32,
        handle: u32,
        off: u64,
        len: u64,
    ) -> Result<Region, Status> {
        self.endpoints
            .region(job, rank, handle)
            .and_then(|r| r.check_local(off, len).map(|_| r.clone()))
    }

    /// The local side of a BTE put or get: this client's own registered memory, mapped or
    /// reached by copy (a process region: streams read and replies write it through the
    /// kernel). On anything else the command completes with the reason and `None` comes back.
    fn own_side(&mut self, session: u64, job: u32, rank: u32, c: &Command) -> Option<Region> {
        let r = self.own_local(job, rank, c.local_region, c.local_off, c.len);
        match r {
            Ok(r) => Some(r),
            Err(s) => {
                self.complete(session, c.client_req, s, 0);
                None
            }
        }
    }

    /// Whether process (job, rank)'s next operation to `host` may go now. `Err(Backpressure)`
    /// while the transport is full or the process's own earlier items still wait for that
    /// host (order is per process); `Err(Done)` once the operation has been failed because
    /// `host` is dead.
    pub(super) fn may_send(
        &mut self,
        host: u16,
        owner: (u32, u32),
        session: u64,
        client_req: u64,
    ) -> Result<(), Flow> {
        match self.transport.can_push(host) {
            Err(PushError::Full(_)) => return Err(Flow::Backpressure),
            Err(_) => {
                self.complete(session, client_req, Status::PeerDead, lost(host));
                return Err(Flow::Done);
            }
            Ok(()) => {}
        }
        if self.out[host as usize]
            .iter()
            .any(|it| it.owner() == Some(owner))
        {
            return Err(Flow::Backpressure);
        }
        Ok(())
    }

    /// The landing place of a vector get: this client's own region (mapped or reached by
    /// copy) holding every strided element; else the command completes with the reason.
    fn own_vector_dst(&mut self, session: u64, job: u32, rank: u32, c: &Command) -> Option<Region> {
        let r = self
            .endpoints
            .region(job, rank, c.local_region)
            .and_then(|r| {
                local_strided_fits(r, c.local_off, c.operand2 as i64, c.elem, c.nelems)
                    .then(|| r.clone())
                    .ok_or(Status::OutOfBounds)
            });
        match r {
            Ok(r) => Some(r),
            Err(s) => {
                self.complete(session, c.client_req, s, 0);
                None
            }
        }
    }

    /// Copies `[off, off+len)` of `src` into the scratch buffer and hands the bytes to `f`.
    fn with_copy<T>(
        &mut self,
        src: &Region,
        off: u64,
        len: usize,
        f: impl FnOnce(&Self, &[u8]) -> T,
    ) -> Result<T, Status> {
        let mut data = std::mem::take(&mut self.copy_buf);
        data.clear();
        let r = src.append_to(off, len, &mut data).map(|()| f(self, &data));
        self.copy_buf = data;
        r
    }

    fn push_or_fail(&mut self, host: u16, req: u64, op: &OpRef<'_>) {
        if self.transport.push_op(host, op).is_err() {
            if let Some(done) = self.initiator.complete(req, Status::PeerDead, lost(host)) {
                self.completions.push(done);
            }
        }
    }

    /// Executes a command whose target is on this host, without the network.
    pub(super) fn local(&mut self, h: OpHeader, c: &Command, inline: &[u8]) -> (Status, u64) {
        let own = |eps: &Endpoints| {
            eps.region(h.job, h.src_rank, c.local_region)
                .and_then(|r| r.check_local(c.local_off, c.len).map(|_| r.clone()))
        };
        fn put<'a>(h: OpHeader, c: &Command, data: &'a [u8]) -> OpRef<'a> {
            OpRef::Put {
                h,
                region: c.remote_region,
                offset: c.remote_off,
                total_off: c.remote_off,
                total_len: data.len() as u64,
                last: true,
                lazy_ack: false,
                notify: 0,
                data,
            }
        }
        let action = match c.kind {
            CommandKind::Portals
            | CommandKind::Ixpe
            | CommandKind::VeloOpen
            | CommandKind::VeloSend
            | CommandKind::RmaOpen
            | CommandKind::RmaPut
            | CommandKind::RmaGet
            | CommandKind::RmaImmediate => return (Status::BadRequest, 0),
            CommandKind::PutInline => serve(&self.endpoints, &put(h, c, inline)),
            CommandKind::PutFrom => {
                let src = match own(&self.endpoints) {
                    Ok(r) => r,
                    Err(s) => return (s, 0),
                };
                let served = self.with_copy(&src, c.local_off, c.len as usize, |me, data| {
                    serve(&me.endpoints, &put(h, c, data))
                });
                match served {
                    Ok(a) => a,
                    Err(s) => return (s, 0),
                }
            }
            CommandKind::Get => {
                let dst = match own(&self.endpoints) {
                    Ok(r) => r,
                    Err(s) => return (s, 0),
                };
                match serve(
                    &self.endpoints,
                    &OpRef::Get {
                        h,
                        region: c.remote_region,
                        offset: c.remote_off,
                        len: c.len,
                        notify: false,
                    },
                ) {
                    TargetAction::StreamGet {
                        region,
                        offset,
                        len,
                        ..
                    } => {
                        let moved = self
                            .with_copy(&region, offset, len as usize, |_, data| {
                                dst.write(c.local_off, data)
                            })
                            .and_then(|r| r);
                        return (moved.err().unwrap_or(Status::Ok), 0);
                    }
                    other => other,
                }
            }
            CommandKind::PutV => match vector_shape(c, inline) {
                Some(s) => serve(
                    &self.endpoints,
                    &OpRef::PutV {
                        h,
                        region: c.remote_region,
                        s,
                        last: true,
                        lazy_ack: false,
                        data: inline,
                    },
                ),
                None => return (Status::BadRequest, 0),
            },
            CommandKind::GetV => {
                let Some(s) = vector_shape(c, inline) else {
                    return (Status::BadRequest, 0);
                };
                let dst = match self.endpoints.region(h.job, h.src_rank, c.local_region) {
                    Ok(r)
                        if local_strided_fits(
                            r,
                            c.local_off,
                            c.operand2 as i64,
                            c.elem,
                            c.nelems,
                        ) =>
                    {
                        r.clone()
                    }
                    Ok(_) => return (Status::OutOfBounds, 0),
                    Err(s) => return (s, 0),
                };
                let op = OpRef::GetV {
                    h,
                    region: c.remote_region,
                    s,
                    idx: &inline[..s.idx_len()],
                };
                match serve(&self.endpoints, &op) {
                    TargetAction::StreamGet { region, len, .. } => {
                        let moved = self
                            .with_copy(&region, 0, len as usize, |_, data| {
                                place_packed(
                                    &dst,
                                    c.local_off,
                                    c.operand2 as i64,
                                    c.elem,
                                    c.nelems,
                                    0,
                                    data,
                                )
                            })
                            .and_then(|r| r);
                        return (moved.err().unwrap_or(Status::Ok), 0);
                    }
                    other => other,
                }
            }
            CommandKind::AmoScatter => {
                let Some(op) = c.amo else {
                    return (Status::BadRequest, 0);
                };
                serve(
                    &self.endpoints,
                    &OpRef::AmoScatter {
                        h,
                        region: c.remote_region,
                        op,
                        last: true,
                        pairs: inline,
                    },
                )
            }
            CommandKind::Amo => {
                let Some(op) = c.amo else {
                    return (Status::BadRequest, 0);
                };
                serve(
                    &self.endpoints,
                    &OpRef::Amo {
                        h,
                        region: c.remote_region,
                        op,
                        offset: c.remote_off,
                        operand: c.operand,
                        operand2: c.operand2,
                    },
                )
            }
        };
        match action {
            TargetAction::Reply(Reply::PutAck { status, .. })
            | TargetAction::Reply(Reply::GetError { status, .. }) => (status, 0),
            TargetAction::Reply(Reply::AmoReply { status, value, .. }) => (status, value),
            _ => (Status::BadRequest, 0),
        }
    }

    pub(super) fn on_body(&mut self, now: u64, peer: u16, body: &[u8]) {
        // Atomics a few ops ahead have their target words loaded while this one is served.
        let mut ahead = OpIter::new(body).skip(PREFETCH_AHEAD);
        // Portals answers (acknowledgements, replies) wait for the rest: a message that rode
        // with them reaches its process first, as in a ping-pong whose answer carries the
        // acknowledgement of the message before (the answers complete this host's own
        // requests; nothing orders those completions against events of arrivals).
        let (mut answers, mut arrivals) = (false, false);
        for op in OpIter::new(body) {
            if let Some(Ok(next)) = ahead.next() {
                self.ptl_prefetch(&next);
            }
            match op {
                Ok(OpRef::PtlAcks { .. } | OpRef::PtlResp { .. }) => answers = true,
                Ok(op) => {
                    arrivals |= matches!(op, OpRef::PtlReq { .. });
                    self.on_op(now, peer, &op)
                }
                Err(e) => {
                    self.stats.malformed_ops += 1;
                    tracing::warn!(host = %self.name, peer, "malformed op from an authenticated peer: {e}");
                }
            }
        }
        if answers {
            if arrivals {
                self.ptl_mirror();
            }
            for op in OpIter::new(body).flatten() {
                if matches!(op, OpRef::PtlAcks { .. } | OpRef::PtlResp { .. }) {
                    self.on_op(now, peer, &op);
                }
            }
        }
        self.ptl_flush_acks();
    }

    fn on_op(&mut self, now: u64, peer: u16, op: &OpRef<'_>) {
        match op {
            OpRef::PtlReq { .. } | OpRef::PtlResp { .. } | OpRef::PtlAcks { .. } => {
                self.ptl_on_op(now, peer, op)
            }
            // Active Messages travel between udp-conduit processes, never to a daemon.
            OpRef::Am { .. } => self.stats.malformed_ops += 1,
            OpRef::VeloMsg {
                h,
                tag,
                lazy_ack,
                data,
            } => self.velo_on_msg(now, peer, h, *tag, *lazy_ack, data),
            OpRef::Put { .. }
            | OpRef::Get { .. }
            | OpRef::PutV { .. }
            | OpRef::GetV { .. }
            | OpRef::Amo { .. }
            | OpRef::AmoScatter { .. } => {
                match op {
                    OpRef::Put { .. } | OpRef::PutV { .. } => self.stats.served_put += 1,
                    OpRef::Get { .. } | OpRef::GetV { .. } => self.stats.served_get += 1,
                    _ => self.stats.served_amo += 1,
                }
                match serve(&self.endpoints, op) {
                    TargetAction::None => {}
                    TargetAction::Reply(
                        r @ Reply::PutAck {
                            status: Status::Ok, ..
                        },
                    ) if matches!(op, OpRef::Put { notify: 1..=3, .. }) => {
                        // An RMA put in place: its completer notification first, the
                        // acknowledgement once that is written (a full queue holds it back).
                        self.rma_completer(op, peer, r)
                    }
                    TargetAction::Reply(r) => self.send_reply(now, peer, r),
                    TargetAction::StreamGet {
                        h,
                        region,
                        offset,
                        len,
                        frag_base,
                    } => {
                        // An RMA get's responder notification, once it has been served.
                        let on_end = match op {
                            OpRef::Get {
                                h: g,
                                region,
                                offset,
                                len,
                                notify: true,
                            } => Some(self.rma_responder(g, *region, *offset, *len)),
                            _ => None,
                        };
                        self.out[peer as usize].push_back(OutItem::Stream(Stream {
                            kind: StreamKind::GetReply,
                            h,
                            src: region,
                            src_off: offset,
                            len,
                            sent: 0,
                            started: false,
                            frag_base,
                            on_end,
                        }));
                        self.drain_out(peer);
                    }
                }
            }
            OpRef::PutAck { h, .. } | OpRef::GetReply { h, .. } | OpRef::AmoReply { h, .. } => {
                // Only the host we sent the request to may answer it.
                if self.initiator.get(h.req).is_some_and(|p| p.host == peer) {
                    if let Some(c) = self.initiator.on_reply(op) {
                        self.completions.push(c);
                    }
                }
            }
        }
    }

    pub(super) fn send_reply(&mut self, now: u64, peer: u16, r: Reply) {
        if self.out[peer as usize].is_empty() {
            let pushed = match r {
                Reply::PutAck { lazy: true, .. } => {
                    self.transport.push_op_lazy(peer, &r.as_op(), now)
                }
                _ => self.transport.push_op(peer, &r.as_op()),
            };
            match pushed {
                Ok(()) => return,
                Err(PushError::Full(_)) => {}
                Err(_) => return, // a dead peer is not waiting for answers
            }
        }
        self.out[peer as usize].push_back(OutItem::Reply(r));
    }

    /// Moves queued replies and stream fragments into the transport while it has room.
    pub(super) fn drain_out(&mut self, peer: u16) {
        let p = peer as usize;
        while let Some(item) = self.out[p].front_mut() {
            match item {
                OutItem::Encoded { bytes, .. } => {
                    let pushed = match OpRef::decode(bytes) {
                        Ok((op, _)) => self.transport.push_op(peer, &op),
                        Err(_) => Ok(()), // our own encoding: cannot happen; drop it
                    };
                    match pushed {
                        Err(PushError::Full(_)) => return,
                        _ => {
                            if let Some(OutItem::Encoded { bytes, .. }) = self.out[p].pop_front() {
                                self.recycle_encoded(bytes);
                            }
                        }
                    }
                }
                OutItem::PtlStream(_) | OutItem::PtlReply(_) => {
                    let end = match item {
                        OutItem::PtlStream(ps) => ps.emit(peer, &mut self.transport),
                        OutItem::PtlReply(rs) => rs.emit(peer, &mut self.transport),
                        _ => unreachable!("matched above"),
                    };
                    let Some(end) = end else { return };
                    match self.out[p].pop_front() {
                        Some(OutItem::PtlStream(ps)) => self.ptl_stream_ended(&ps, end),
                        Some(OutItem::PtlReply(rs)) => self.ptl_reply_ended(peer, &rs, end),
                        _ => unreachable!("the front item was this stream"),
                    }
                }
                OutItem::Reply(r) => match self.transport.push_op(peer, &r.as_op()) {
                    Err(PushError::Full(_)) => return,
                    _ => {
                        self.out[p].pop_front();
                    }
                },
                OutItem::Stream(st) => {
                    let mut ended = None;
                    if matches!(st.kind, StreamKind::Put { .. })
                        && self.initiator.get(st.h.req).is_none()
                    {
                        self.out[p].pop_front(); // its operation was failed meanwhile
                        continue;
                    }
                    loop {
                        if !stream_may_push(&self.transport, peer) {
                            return;
                        }
                        let kind = match st.kind {
                            StreamKind::Put { .. } => OpKind::Put,
                            StreamKind::GetReply => OpKind::GetReply,
                        };
                        let n =
                            fragment_len(&self.transport, peer, kind, st.len - st.sent) as usize;
                        let last = st.sent + n as u64 == st.len;
                        let data: &[u8] = &[];
                        let op = match st.kind {
                            StreamKind::Put {
                                region,
                                dst_off,
                                lazy_ack,
                                notify,
                            } => OpRef::Put {
                                h: st.h,
                                region,
                                offset: dst_off + st.sent,
                                total_off: dst_off,
                                total_len: st.len,
                                last,
                                lazy_ack,
                                notify: notify as u8,
                                data,
                            },
                            StreamKind::GetReply => OpRef::GetReply {
                                h: st.h,
                                status: Status::Ok,
                                frag_off: st.frag_base + st.sent,
                                last,
                                data,
                            },
                        };
                        // The data goes from the region straight into the datagram.
                        let (src, at) = (&st.src, st.src_off + st.sent);
                        let mut unreadable = None;
                        let pushed = match src.mapped_for_read(at, n) {
                            // SAFETY: the stream's region keeps its mapping while it lives.
                            Some(p) => unsafe { self.transport.push_op_mapped(peer, &op, p, n) },
                            None => self.transport.push_op_filled(peer, &op, n, &mut |b| {
                                src.append_to(at, n, b)
                                    .map_err(|s| unreadable = Some(s))
                                    .is_ok()
                            }),
                        };
                        if let (Err(PushError::Source), Some(s)) = (&pushed, unreadable) {
                            // Memory reached by copy that is gone (its process unmapped it or
                            // exited): the operation fails with the reason.
                            match st.kind {
                                StreamKind::Put { .. } => {
                                    if let Some(c) = self.initiator.complete(st.h.req, s, 0) {
                                        self.completions.push(c);
                                    }
                                }
                                StreamKind::GetReply => {
                                    let r = Reply::GetError { h: st.h, status: s };
                                    if let Err(PushError::Full(_)) =
                                        self.transport.push_op(peer, &r.as_op())
                                    {
                                        // Retried from the queue like any reply.
                                        self.out[p].pop_front();
                                        self.out[p].push_front(OutItem::Reply(r));
                                        return;
                                    }
                                }
                            }
                            break;
                        }
                        match pushed {
                            Ok(()) => {
                                st.sent += n as u64;
                                st.started = true;
                                if last {
                                    ended = st.on_end.take();
                                    break;
                                }
                            }
                            Err(PushError::Full(_)) => return,
                            Err(_) => {
                                if matches!(st.kind, StreamKind::Put { .. }) {
                                    let req = st.h.req;
                                    if let Some(c) =
                                        self.initiator.complete(req, Status::PeerDead, lost(peer))
                                    {
                                        self.completions.push(c);
                                    }
                                }
                                break;
                            }
                        }
                    }
                    self.out[p].pop_front();
                    if let Some((job, rank, note)) = ended {
                        self.rma_notify(job, rank, note, None);
                    }
                }
            }
        }
    }
}
