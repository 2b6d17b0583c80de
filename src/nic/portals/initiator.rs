//! Initiator side of a Portals interface: memory descriptors (MDs), operations in flight, and
//! the events that complete them (SEND, ACK, REPLY) with their counting events.
//!
//! SEND means the payload has left the MD (the NIC copied it), so the buffer may be reused. A
//! put's ACK follows `ack_req`: ACK posts a full event, CT_ACK and OC_ACK only count, NO_ACK
//! neither — and none comes when the target entry has PTL_ME_ACK_DISABLE. A NO_ACK put or
//! atomic to another host is complete once sent: its target is told to answer nothing. Gets, fetching
//! atomics and swaps complete with REPLY once the data is in the MD. Failures arrive in the
//! ACK/REPLY event's `ni_fail` and as failure counts.

use super::atomic::{AtomicOp, Datatype};
use super::events::CtEvent;
use super::matching::ReqKind;
use super::ni::{PortalsNi, Response};
use super::types::{Event, EventKind, NiFail, ProcessId, PtlError};
use crate::nic::memory::Region;
use crate::wire::Status;

/// Memory descriptor options (`ptl_md_t.options`).
pub mod md {
    pub const EVENT_SUCCESS_DISABLE: u32 = 1 << 5;
    pub const EVENT_SEND_DISABLE: u32 = 1 << 6;
    pub const EVENT_CT_SEND: u32 = 1 << 7;
    pub const EVENT_CT_REPLY: u32 = 1 << 8;
    pub const EVENT_CT_ACK: u32 = 1 << 9;
    pub const EVENT_CT_BYTES: u32 = 1 << 10;
    pub const UNORDERED: u32 = 1 << 11;
    pub const VOLATILE: u32 = 1 << 12;
    pub const IOVEC: u32 = 1;
    /// softnic's own: the targets of this MD's puts do not wait for them (one-sided data, as
    /// MPI's windows take it), so their NIC does not tell them a message is on its way
    /// (`shm::control::Waiter::keep_core`), which would have them spin for it.
    pub const QUIET: u32 = 1 << 16;
    pub const ALL: u32 = QUIET
        | EVENT_SUCCESS_DISABLE
        | EVENT_SEND_DISABLE
        | EVENT_CT_SEND
        | EVENT_CT_REPLY
        | EVENT_CT_ACK
        | EVENT_CT_BYTES
        | UNORDERED
        | VOLATILE
        | IOVEC;
}

/// Acknowledgement requests of a put (`ptl_ack_req_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckReq {
    Ack,
    CtAck,
    OcAck,
    NoAck,
}

impl AckReq {
    /// The code a Portals call carries (0 ACK, 1 CT_ACK, 2 OC_ACK, 3 NO_ACK).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The inverse of [`AckReq::code`]; `None` for an unknown code.
    pub fn from_code(c: u8) -> Option<AckReq> {
        Some(match c {
            0 => AckReq::Ack,
            1 => AckReq::CtAck,
            2 => AckReq::OcAck,
            3 => AckReq::NoAck,
            _ => return None,
        })
    }
}

/// A memory descriptor: segments of a registered region seen as one contiguous buffer.
pub struct Md {
    pub region: Region,
    pub segments: Vec<(u64, u64)>,
    pub length: u64,
    pub options: u32,
    pub eq: Option<u32>,
    pub ct: Option<u32>,
    pub pending: usize,
}

/// Where a streamed put's payload lies: its MD's memory, read a fragment at a time as the
/// network has room (as a NIC's DMA engine reads the buffer while the message leaves), so the
/// daemon holds no copy of a large message waiting for the window.
pub struct PayloadSource {
    region: Region,
    segments: Vec<(u64, u64)>,
    /// Where the payload starts in the MD, and its length.
    offset: u64,
    pub length: u64,
    /// The call's own bytes (a volatile MD's, see [`OpSpec::inline`]): read instead of the MD.
    inline: Option<Vec<u8>>,
}

impl PayloadSource {
    /// Appends payload bytes `[off, off + len)` to `out`.
    pub fn gather(&self, off: u64, len: u64, out: &mut Vec<u8>) -> Result<(), Status> {
        match &self.inline {
            Some(b) => {
                let part = off
                    .checked_add(len)
                    .and_then(|end| b.get(usize::try_from(off).ok()?..usize::try_from(end).ok()?))
                    .ok_or(Status::OutOfBounds)?;
                out.extend_from_slice(part);
                Ok(())
            }
            None => gather(&self.region, &self.segments, self.offset + off, len, out),
        }
    }

    /// Where payload bytes `[off, off + len)` are mapped, if in one segment of mapped memory
    /// (never for the call's own bytes: they are gathered).
    pub fn mapped(&self, off: u64, len: u64) -> Option<*const u8> {
        if self.inline.is_some() {
            return None;
        }
        let mut off = self.offset + off;
        for &(start, slen) in &self.segments {
            if off < slen {
                return (off + len <= slen)
                    .then(|| self.region.mapped_for_read(start + off, len as usize))
                    .flatten();
            }
            off -= slen;
        }
        None
    }
}

/// Copies `len` bytes at offset `off` of the buffer `segments` of `region` make out (gather;
/// the Portals library copies a volatile MD's bytes into its call with it too).
pub(crate) fn gather(
    region: &Region,
    segments: &[(u64, u64)],
    mut off: u64,
    len: u64,
    out: &mut Vec<u8>,
) -> Result<(), Status> {
    let mut left = len;
    for &(start, slen) in segments {
        if left == 0 {
            break;
        }
        if off >= slen {
            off -= slen;
            continue;
        }
        let n = (slen - off).min(left);
        region.append_to(start + off, n as usize, out)?;
        left -= n;
        off = 0;
    }
    Ok(())
}

impl Md {
    /// Copies `len` bytes at MD offset `off` out (gather).
    fn gather(&self, off: u64, len: u64, out: &mut Vec<u8>) -> Result<(), Status> {
        gather(&self.region, &self.segments, off, len, out)
    }

    /// Copies `data` in at MD offset `off` (scatter).
    fn scatter(&self, mut off: u64, mut data: &[u8]) -> Result<(), Status> {
        for &(start, slen) in &self.segments {
            if data.is_empty() {
                break;
            }
            if off >= slen {
                off -= slen;
                continue;
            }
            let n = ((slen - off) as usize).min(data.len());
            self.region.write(start + off, &data[..n])?;
            data = &data[n..];
            off = 0;
        }
        Ok(())
    }
}

/// An operation to start (PtlPut, PtlGet, PtlAtomic, PtlFetchAtomic, PtlSwap). For gets,
/// fetching atomics and swaps, `get_md`/`get_offset` say where the reply lands; `md`/`offset`
/// name the payload (puts, atomics, swaps).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpSpec {
    pub kind: ReqKind,
    pub md: u32,
    pub offset: u64,
    pub length: u64,
    pub get_md: Option<u32>,
    pub get_offset: u64,
    pub ack_req: AckReq,
    pub target: ProcessId,
    pub pt_index: u32,
    pub match_bits: u64,
    pub remote_offset: u64,
    pub user_ptr: u64,
    pub hdr_data: u64,
    pub operand: Vec<u8>,
    /// The bytes a put or atomic sends, carried in the call itself: a `PTL_MD_VOLATILE` MD's,
    /// which the library copied before PtlPut returned (the process may reuse the buffer at
    /// once, and the NIC reads no memory the process just wrote on another core). Empty: the
    /// NIC reads them from the MD as the operation starts.
    pub inline: Vec<u8>,
}

/// An operation in flight.
pub struct Outgoing {
    pub spec: OpSpec,
}

impl PortalsNi {
    /// The options of MD `h`, if it is bound.
    pub fn md_options(&self, h: u32) -> Option<u32> {
        self.mds.get(h).map(|m| m.options)
    }

    /// PtlMDBind: `segments` are (offset, length) pieces of `region` (one piece unless IOVEC).
    pub fn md_bind(
        &mut self,
        region: Region,
        segments: Vec<(u64, u64)>,
        options: u32,
        eq: Option<u32>,
        ct: Option<u32>,
    ) -> Result<u32, PtlError> {
        if options & !md::ALL != 0
            || segments.is_empty()
            || (options & md::IOVEC == 0 && segments.len() != 1)
        {
            return Err(PtlError::ArgInvalid);
        }
        if segments.len() > self.limits.max_iovecs {
            return Err(PtlError::ArgInvalid);
        }
        for &(s, l) in &segments {
            if s.checked_add(l).is_none_or(|e| e > region.len() as u64) {
                return Err(PtlError::ArgInvalid);
            }
        }
        if eq.is_some_and(|q| self.eq_ref(q).is_none())
            || ct.is_some_and(|c| self.ct_get(c).is_err())
        {
            return Err(PtlError::ArgInvalid);
        }
        if self.mds.live >= self.limits.max_mds {
            return Err(PtlError::NoSpace);
        }
        let length = segments.iter().map(|s| s.1).sum();
        Ok(self.mds.insert(Md {
            region,
            segments,
            length,
            options,
            eq,
            ct,
            pending: 0,
        }))
    }

    /// PtlMDRelease: refused while operations on the MD are in flight.
    pub fn md_release(&mut self, h: u32) -> Result<(), PtlError> {
        let m = self.mds.get(h).ok_or(PtlError::ArgInvalid)?;
        if m.pending > 0 {
            return Err(PtlError::InUse);
        }
        self.mds.remove(h);
        Ok(())
    }

    /// Starts an operation: checks it, copies the payload out of the MD into `payload` (for
    /// the wire; the caller's buffer, reused so that starting allocates nothing), posts SEND.
    /// Returns the operation's id for [`PortalsNi::complete`].
    pub fn start(&mut self, spec: OpSpec, payload: &mut Vec<u8>) -> Result<u32, PtlError> {
        self.begin(spec, Some(payload))
    }

    /// Starts a put whose payload the caller reads from its MD as the message leaves
    /// ([`PayloadSource`]); its SEND event (and CT_SEND) come with [`PortalsNi::sent`], once
    /// the last byte is out of the buffer. Checks as [`PortalsNi::start`].
    pub fn start_streamed(&mut self, spec: OpSpec) -> Result<(u32, PayloadSource), PtlError> {
        if spec.kind != ReqKind::Put {
            return Err(PtlError::ArgInvalid);
        }
        let (md, offset, length) = (spec.md, spec.offset, spec.length);
        // Checked by `begin`, which keeps no copy of them.
        let inline = (!spec.inline.is_empty()).then(|| spec.inline.clone());
        let id = self.begin(spec, None)?;
        let m = self.mds.get(md).expect("begin checked the MD");
        Ok((
            id,
            PayloadSource {
                region: m.region.clone(),
                segments: m.segments.clone(),
                offset,
                length,
                inline,
            },
        ))
    }

    /// The payload of streamed operation `id` has left its buffer: its SEND event and
    /// CT_SEND count. An operation completed meanwhile (failed) is ignored.
    pub fn sent(&mut self, id: u32) {
        let Some(spec) = self.outgoing.get(id).map(|o| o.spec.clone()) else {
            return;
        };
        self.post_send(&spec);
    }

    fn post_send(&mut self, spec: &OpSpec) {
        let Some(m) = self.mds.get(spec.md) else {
            return;
        };
        let (eq, ct, opts) = (m.eq, m.ct, m.options);
        if opts & (md::EVENT_SEND_DISABLE | md::EVENT_SUCCESS_DISABLE) == 0 {
            let e = self.initiator_event(EventKind::Send, spec, spec.length, NiFail::Ok);
            self.post(eq, e);
        }
        if opts & md::EVENT_CT_SEND != 0 {
            if let Some(c) = ct {
                self.bump_ct(c, success(opts, spec.length));
            }
        }
    }

    /// Checks and registers an operation; with `payload`, copies what it sends there and
    /// posts its SEND event now, else leaves both to the streaming caller.
    fn begin(&mut self, spec: OpSpec, mut payload: Option<&mut Vec<u8>>) -> Result<u32, PtlError> {
        if let Some(p) = payload.as_deref_mut() {
            p.clear();
        }
        let needs_reply = !matches!(spec.kind, ReqKind::Put | ReqKind::Atomic(..));
        let sends = !matches!(spec.kind, ReqKind::Get);
        if spec.length > self.limits.max_msg_size {
            return Err(PtlError::ArgInvalid);
        }
        if let ReqKind::Atomic(op, dt) | ReqKind::FetchAtomic(op, dt) | ReqKind::Swap(op, dt) =
            spec.kind
        {
            check_atomic(&self.limits, spec.kind, op, dt, spec.length, &spec.operand)?;
        }
        let pay = self.mds.get(spec.md).ok_or(PtlError::ArgInvalid)?;
        if spec
            .offset
            .checked_add(if sends { spec.length } else { 0 })
            .is_none_or(|e| e > pay.length)
        {
            return Err(PtlError::ArgInvalid);
        }
        if needs_reply {
            let g = spec
                .get_md
                .and_then(|g| self.mds.get(g))
                .ok_or(PtlError::ArgInvalid)?;
            if spec
                .get_offset
                .checked_add(spec.length)
                .is_none_or(|e| e > g.length)
            {
                return Err(PtlError::ArgInvalid);
            }
        }
        if !spec.inline.is_empty()
            && (!sends
                || spec.inline.len() as u64 != spec.length
                || spec.length > self.limits.max_volatile_size)
        {
            return Err(PtlError::ArgInvalid);
        }
        let streamed = payload.is_none();
        let gathered = match payload {
            Some(p) if sends && !spec.inline.is_empty() => {
                p.extend_from_slice(&spec.inline);
                Ok(())
            }
            Some(p) if sends => pay.gather(spec.offset, spec.length, p),
            _ => Ok(()),
        };
        if gathered.is_err() {
            // Memory reached by copy is gone (a process region unmapped): the operation fails
            // as a segmentation violation where its completion would be reported, since a
            // one-way call has no other way back.
            let (kind, md) = match needs_reply {
                true => (EventKind::Reply, spec.get_md.expect("checked")),
                false => (EventKind::Ack, spec.md),
            };
            let (eq, ct) = self.mds.get(md).map_or((None, None), |m| (m.eq, m.ct));
            let e = self.initiator_event(kind, &spec, 0, NiFail::Segv);
            self.post(eq, e);
            if let Some(c) = ct {
                self.bump_ct(
                    c,
                    CtEvent {
                        success: 0,
                        failure: 1,
                    },
                );
            }
            return Err(PtlError::ArgInvalid);
        }
        self.mds.get_mut(spec.md).expect("checked").pending += 1;
        if needs_reply {
            self.mds
                .get_mut(spec.get_md.expect("checked"))
                .expect("checked")
                .pending += 1;
        }
        if sends && !streamed {
            self.post_send(&spec);
        }
        // Sent: the copy need not wait for the answer.
        let spec = OpSpec {
            inline: Vec::new(),
            ..spec
        };
        Ok(self.outgoing.insert(Outgoing { spec }))
    }

    /// Writes a fragment of get `id`'s reply into its MD as it arrives (`frag_off` bytes into
    /// the reply; what lies past the operation's length is dropped). `false` when the memory
    /// is gone; an unknown operation (late, duplicate) takes nothing.
    pub fn reply_place(&mut self, id: u32, frag_off: u64, data: &[u8]) -> bool {
        let Some(o) = self.outgoing.get(id) else {
            return true;
        };
        let s = &o.spec;
        let Some(m) = s.get_md.and_then(|h| self.mds.get(h)) else {
            return true;
        };
        let n = data.len().min(s.length.saturating_sub(frag_off) as usize);
        m.scatter(s.get_offset + frag_off, &data[..n]).is_ok()
    }

    /// Completes operation `id` with the target's response: ACK or REPLY, counting events,
    /// reply data into the MD. A late or unknown id is ignored.
    pub fn complete(&mut self, id: u32, resp: &Response) {
        let Some(o) = self.outgoing.remove(id) else {
            return;
        };
        let s = o.spec;
        let reply = !matches!(s.kind, ReqKind::Put | ReqKind::Atomic(..));
        if let Some(m) = self.mds.get_mut(s.md) {
            m.pending = m.pending.saturating_sub(1);
        }
        let (kind, mdh, ctopt) = if reply {
            (
                EventKind::Reply,
                s.get_md.expect("start checked"),
                md::EVENT_CT_REPLY,
            )
        } else {
            (EventKind::Ack, s.md, md::EVENT_CT_ACK)
        };
        let Some(m) = self.mds.get_mut(mdh) else {
            return;
        };
        let mut segv = false;
        if reply {
            m.pending = m.pending.saturating_sub(1);
            if resp.ni_fail == NiFail::Ok {
                let n = resp.data.len().min(s.length as usize);
                if m.scatter(s.get_offset, &resp.data[..n]).is_err() {
                    segv = true;
                }
            }
        }
        let (eq, ct, opts) = (m.eq, m.ct, m.options);
        // Puts: what the ack request and the target entry allow.
        let (full, counted) = if reply {
            (true, true)
        } else if !resp.ack && resp.ni_fail == NiFail::Ok {
            (false, false)
        } else {
            match s.ack_req {
                AckReq::Ack => (true, true),
                AckReq::CtAck | AckReq::OcAck => (false, true),
                AckReq::NoAck => (false, false),
            }
        };
        // A reply that could not land (its memory is gone) fails as a segmentation violation.
        let ni_fail = if segv { NiFail::Segv } else { resp.ni_fail };
        let failed = ni_fail != NiFail::Ok;
        if full && (failed || opts & md::EVENT_SUCCESS_DISABLE == 0) {
            let e = self.initiator_event(kind, &s, resp.mlength, ni_fail);
            self.post(
                eq,
                Event {
                    remote_offset: resp.offset,
                    ..e
                },
            );
        }
        if counted && opts & ctopt != 0 {
            if let Some(c) = ct {
                let by = if failed {
                    CtEvent {
                        success: 0,
                        failure: 1,
                    }
                } else {
                    success(opts, resp.mlength)
                };
                self.bump_ct(c, by);
            }
        }
    }

    /// Completes operation `id` as acknowledged in full by host `from` (a record of a
    /// `PtlAcks` op): with [`Response::in_full`] of what was asked. An id that is unknown or
    /// aimed at another host is ignored.
    pub fn complete_in_full(&mut self, id: u32, from: u32) {
        let Some(o) = self.outgoing.get(id) else {
            return;
        };
        if !matches!(o.spec.target, ProcessId::Physical { nid, .. } if nid == from) {
            return;
        }
        let resp = Response::in_full(o.spec.length, o.spec.remote_offset);
        self.complete(id, &resp);
    }

    /// Operations in flight.
    pub fn outgoing_len(&self) -> usize {
        self.outgoing.live
    }

    /// Fails every operation in flight whose spec `pred` selects (its target died), as if the
    /// target had answered `ni_fail`.
    pub fn fail_outgoing(&mut self, pred: impl Fn(&OpSpec) -> bool, ni_fail: NiFail) {
        let ids: Vec<u32> = self
            .outgoing
            .handles()
            .filter(|&h| self.outgoing.get(h).is_some_and(|o| pred(&o.spec)))
            .collect();
        for id in ids {
            self.complete(
                id,
                &Response {
                    ni_fail,
                    ack: true,
                    ..Default::default()
                },
            );
        }
    }

    fn initiator_event(&self, kind: EventKind, s: &OpSpec, mlength: u64, ni_fail: NiFail) -> Event {
        let atomic = match s.kind {
            ReqKind::Atomic(o, d) | ReqKind::FetchAtomic(o, d) | ReqKind::Swap(o, d) => {
                Some((o, d))
            }
            _ => None,
        };
        Event {
            kind,
            initiator: s.target,
            pt_index: s.pt_index,
            uid: 0,
            match_bits: s.match_bits,
            rlength: s.length,
            mlength,
            remote_offset: s.remote_offset,
            start: s.offset,
            user_ptr: s.user_ptr,
            hdr_data: s.hdr_data,
            ni_fail,
            atomic,
        }
    }
}

fn success(opts: u32, bytes: u64) -> CtEvent {
    CtEvent {
        success: if opts & md::EVENT_CT_BYTES != 0 {
            bytes
        } else {
            1
        },
        failure: 0,
    }
}

/// The initiator-side checks of an atomic: defined op, whole elements, within the size limits,
/// an operand for conditional and masked swaps, one element for those.
fn check_atomic(
    l: &super::events::Limits,
    kind: ReqKind,
    op: AtomicOp,
    dt: Datatype,
    length: u64,
    operand: &[u8],
) -> Result<(), PtlError> {
    let w = dt.size() as u64;
    let fetch = !matches!(kind, ReqKind::Atomic(..));
    let max = if fetch {
        l.max_fetch_atomic_size
    } else {
        l.max_atomic_size
    };
    let swap_family = matches!(kind, ReqKind::Swap(..));
    if !op.supports(dt) || op.is_swap() != swap_family || !length.is_multiple_of(w) || length > max
    {
        return Err(PtlError::ArgInvalid);
    }
    if swap_family && op != AtomicOp::Swap && (length != w || (operand.len() as u64) < w) {
        return Err(PtlError::ArgInvalid);
    }
    Ok(())
}
