//! Portals messages on the wire: requests and responses cut into ops that fit a datagram, and
//! put back together. The transport delivers the ops of a peer in order, exactly once, so a
//! message is whole when its last fragment arrives, and messages between a pair of NIs are
//! matched in the order they were sent whatever the network reorders, drops or duplicates.

use rustc_hash::FxHashMap as HashMap;

use super::atomic::{AtomicOp, Datatype};
use super::matching::ReqKind;
use super::ni::{Request, Response};
use super::types::{NiFail, ProcessId};
use crate::wire::{OpHeader, OpKind, OpRef, PtlHeader};

/// The wire code of a request kind and its atomic op and datatype.
pub fn encode_kind(k: ReqKind) -> (u8, u8, u8) {
    match k {
        ReqKind::Put => (0, 0, 0),
        ReqKind::Get => (1, 0, 0),
        ReqKind::Atomic(o, d) => (2, o as u8, d as u8),
        ReqKind::FetchAtomic(o, d) => (3, o as u8, d as u8),
        ReqKind::Swap(o, d) => (4, o as u8, d as u8),
    }
}

/// Whether wire code `kind` is an atomic, fetch-atomic or swap (codes 2–4 of [`encode_kind`]).
pub fn is_atomic_kind(kind: u8) -> bool {
    matches!(kind, 2..=4)
}

/// The request kind of a wire header, or `OpViolation` for an unknown op or datatype.
pub fn decode_kind(m: &PtlHeader) -> Result<ReqKind, NiFail> {
    let atomic = || {
        let o = AtomicOp::from_u8(m.atomic_op).ok_or(NiFail::OpViolation)?;
        let d = Datatype::from_u8(m.datatype).ok_or(NiFail::OpViolation)?;
        Ok((o, d))
    };
    Ok(match m.kind {
        0 => ReqKind::Put,
        1 => ReqKind::Get,
        2 => atomic().map(|(o, d)| ReqKind::Atomic(o, d))?,
        3 => atomic().map(|(o, d)| ReqKind::FetchAtomic(o, d))?,
        4 => atomic().map(|(o, d)| ReqKind::Swap(o, d))?,
        _ => return Err(NiFail::OpViolation),
    })
}

/// The ops carrying a request: every fragment repeats the header; the operand rides on each.
pub fn request_ops<'a>(
    h: OpHeader,
    m: PtlHeader,
    operand: &'a [u8],
    payload: &'a [u8],
    body: usize,
) -> impl Iterator<Item = OpRef<'a>> + 'a {
    let max = OpRef::max_data(OpKind::PtlReq, body)
        .saturating_sub(operand.len())
        .max(1);
    // An empty payload still makes one (last) fragment.
    let n = payload.len().div_ceil(max).max(1);
    (0..n).map(move |i| OpRef::PtlReq {
        h,
        m,
        last: i + 1 == n,
        operand,
        data: &payload[(i * max).min(payload.len())..((i + 1) * max).min(payload.len())],
    })
}

/// The ops carrying a response (reply data cut at `frag_off` boundaries).
pub fn response_ops(h: OpHeader, r: &Response, body: usize) -> impl Iterator<Item = OpRef<'_>> {
    let max = OpRef::max_data(OpKind::PtlResp, body).max(1);
    let n = r.data.len().div_ceil(max).max(1);
    (0..n).map(move |i| {
        let at = (i * max).min(r.data.len());
        OpRef::PtlResp {
            h,
            ni_fail: r.ni_fail as u8,
            ack: r.ack,
            mlength: r.mlength,
            offset: r.offset,
            frag_off: at as u64,
            last: i + 1 == n,
            data: &r.data[at..((i + 1) * max).min(r.data.len())],
        }
    })
}

/// A request put back together: borrowed from the datagram when it came in one piece.
pub enum Whole<'a> {
    Borrowed {
        h: OpHeader,
        m: PtlHeader,
        operand: &'a [u8],
        data: &'a [u8],
    },
    Owned {
        h: OpHeader,
        m: PtlHeader,
        operand: Vec<u8>,
        data: Vec<u8>,
    },
}

impl Whole<'_> {
    pub fn parts(&self) -> (OpHeader, PtlHeader, &[u8], &[u8]) {
        match self {
            Whole::Borrowed {
                h,
                m,
                operand,
                data,
            } => (*h, *m, operand, data),
            Whole::Owned {
                h,
                m,
                operand,
                data,
            } => (*h, *m, operand, data),
        }
    }

    /// The engine's view of the message.
    pub fn request(&self, initiator: ProcessId) -> Result<Request<'_>, NiFail> {
        let (_, m, operand, data) = self.parts();
        Ok(Request {
            kind: decode_kind(&m)?,
            initiator,
            uid: m.uid,
            pt_index: m.pt_index,
            match_bits: m.match_bits,
            remote_offset: m.remote_offset,
            rlength: m.rlength,
            hdr_data: m.hdr_data,
            data,
            operand,
        })
    }
}

/// Reassembly of requests (at targets) and responses (at initiators), bounded in bytes.
/// A request whose last fragment has not arrived yet.
struct Partial {
    h: OpHeader,
    m: PtlHeader,
    operand: Vec<u8>,
    data: Vec<u8>,
}

/// One message in reassembly: the peer host and the whole header. Operation ids are an
/// initiating process's own, so two ranks of one host may have the same id in flight at once.
pub(crate) type MsgKey = (u16, u32, u32, u32, u64);

pub(crate) fn msg_key(peer: u16, h: &OpHeader) -> MsgKey {
    (peer, h.job, h.src_rank, h.dst_rank, h.req)
}

#[derive(Default)]
pub struct Reassembly {
    requests: HashMap<MsgKey, Partial>,
    responses: HashMap<MsgKey, Placed>,
    bytes: usize,
    /// Buffers of delivered requests, reused: a fresh large buffer is a page fault per 4 KiB
    /// on first touch, and growing one copies what it held.
    spare: Vec<Vec<u8>>,
}

/// A response arriving in several fragments: what the initiator is told, and how many of its
/// bytes were placed.
struct Placed {
    resp: Response,
    got: u64,
}

/// Spare reassembly buffers kept for reuse, and the largest kept.
const SPARE_BUFFERS: usize = 4;
const SPARE_MAX_BYTES: usize = 16 << 20;

/// Most bytes held in partial messages; beyond it a message fails (DROPPED) instead of growing.
pub const MAX_PARTIAL_BYTES: usize = 256 << 20;

impl Reassembly {
    /// Feeds a request fragment from `peer`: the whole request once its last fragment is in,
    /// or `Err(Dropped)` if the partial data would pass the bound.
    pub fn request<'a>(
        &mut self,
        peer: u16,
        op: &OpRef<'a>,
    ) -> Option<Result<Whole<'a>, (OpHeader, NiFail)>> {
        let OpRef::PtlReq {
            h,
            m,
            last,
            operand,
            data,
        } = *op
        else {
            return None;
        };
        let key = msg_key(peer, &h);
        if last && !self.requests.contains_key(&key) {
            return Some(Ok(Whole::Borrowed {
                h,
                m,
                operand,
                data,
            }));
        }
        let spare = &mut self.spare;
        let e = self.requests.entry(key).or_insert_with(|| {
            // Room for the whole message at once (its length is in every fragment's header;
            // bounded, as a hostile header may claim anything).
            let mut data = spare.pop().unwrap_or_default();
            data.clear();
            data.reserve((m.rlength as usize).min(MAX_PARTIAL_BYTES));
            Partial {
                h,
                m,
                operand: operand.to_vec(),
                data,
            }
        });
        if self.bytes + data.len() > MAX_PARTIAL_BYTES {
            let p = self.requests.remove(&key).expect("present");
            self.bytes -= p.data.len();
            return Some(Err((p.h, NiFail::Dropped)));
        }
        e.data.extend_from_slice(data);
        self.bytes += data.len();
        if !last {
            return None;
        }
        let Partial {
            h,
            m,
            operand,
            data,
        } = self.requests.remove(&key).expect("present");
        self.bytes -= data.len();
        Some(Ok(Whole::Owned {
            h,
            m,
            operand,
            data,
        }))
    }

    /// Whether fragments of this request from `peer` are being put together.
    pub fn has_request(&self, peer: u16, h: &OpHeader) -> bool {
        self.requests.contains_key(&msg_key(peer, h))
    }

    /// Takes back a delivered request's buffer for the next message put back together.
    pub fn recycle(&mut self, whole: Whole<'_>) {
        if let Whole::Owned { data, .. } = whole {
            if self.spare.len() < SPARE_BUFFERS && data.capacity() <= SPARE_MAX_BYTES {
                self.spare.push(data);
            }
        }
    }

    /// Feeds a response fragment from `peer`: the whole response once its last fragment is in.
    /// A response in one piece comes back with its data; the data of one in several is handed
    /// to `place` (fragment offset, bytes) as each arrives in order, so a long reply is written
    /// where it goes without being put back together first (`false`: it could not be, and the
    /// response fails with PTL_NI_SEGV).
    pub fn response(
        &mut self,
        peer: u16,
        op: &OpRef<'_>,
        place: &mut dyn FnMut(u64, &[u8]) -> bool,
    ) -> Option<(u64, Response)> {
        let OpRef::PtlResp {
            h,
            ni_fail,
            ack,
            mlength,
            offset,
            frag_off,
            last,
            data,
        } = *op
        else {
            return None;
        };
        let key = msg_key(peer, &h);
        // The common case, a response in one piece, never touches the table.
        if last && frag_off == 0 && !self.responses.contains_key(&key) {
            return Some((
                h.req,
                Response {
                    ni_fail: ni_fail_from(ni_fail),
                    mlength,
                    offset,
                    ack,
                    data: data.to_vec(),
                },
            ));
        }
        let r = self.responses.entry(key).or_insert_with(|| Placed {
            resp: Response {
                ni_fail: ni_fail_from(ni_fail),
                mlength,
                offset,
                ack,
                data: Vec::new(),
            },
            got: 0,
        });
        // A reply whose target could not read on (its memory went away) ends with a failed
        // fragment.
        if ni_fail != NiFail::Ok as u8 {
            r.resp.ni_fail = ni_fail_from(ni_fail);
        }
        // Fragments arrive in order; a fragment that does not continue the data is ignored.
        if frag_off == r.got && r.resp.ni_fail == NiFail::Ok {
            if !place(frag_off, data) {
                r.resp.ni_fail = NiFail::Segv;
            }
            r.got += data.len() as u64;
        }
        if !last {
            return None;
        }
        let r = self.responses.remove(&key).expect("present");
        Some((h.req, r.resp))
    }
}

pub fn ni_fail_from(v: u8) -> NiFail {
    match v {
        0 => NiFail::Ok,
        1 => NiFail::Undeliverable,
        2 => NiFail::PtDisabled,
        3 => NiFail::Dropped,
        4 => NiFail::PermViolation,
        5 => NiFail::OpViolation,
        6 => NiFail::Segv,
        8 => NiFail::NoSpace,
        9 => NiFail::ArgInvalid,
        _ => NiFail::NoMatch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply in several fragments is handed to `place` piece by piece at its offsets, never
    /// put back together; a duplicate is ignored; a place that fails, or a failed last
    /// fragment, fails the response; a reply in one piece comes back whole.
    #[test]
    fn long_replies_are_placed_fragment_by_fragment() {
        let h = OpHeader {
            job: 1,
            src_rank: 3,
            dst_rank: 0,
            req: 9,
        };
        let data: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        let resp = Response {
            ni_fail: NiFail::Ok,
            mlength: 3000,
            offset: 0,
            ack: true,
            data: data.clone(),
        };
        let frags: Vec<_> = response_ops(h, &resp, 1024).collect();
        assert!(frags.len() > 2, "the test needs fragments");
        let mut asm = Reassembly::default();
        let mut placed = vec![0u8; 3000];
        let mut got = None;
        for (i, f) in frags.iter().enumerate() {
            // The second fragment comes twice.
            let again = if i == 1 { 2 } else { 1 };
            for _ in 0..again {
                let r = asm.response(0, f, &mut |off, d| {
                    placed[off as usize..off as usize + d.len()].copy_from_slice(d);
                    true
                });
                if let Some(r) = r {
                    got = Some(r);
                }
            }
        }
        let (req, r) = got.expect("complete");
        assert_eq!(
            (req, r.ni_fail, r.mlength, r.data.len()),
            (9, NiFail::Ok, 3000, 0)
        );
        assert_eq!(placed, data);
        // A place that fails fails the response.
        let mut fail = |_: u64, _: &[u8]| false;
        let mut got = None;
        for f in &frags {
            got = got.or(asm.response(1, f, &mut fail));
        }
        assert_eq!(got.expect("complete").1.ni_fail, NiFail::Segv);
        // The target could not read on: its last fragment says so.
        let mut ok = |_: u64, _: &[u8]| true;
        asm.response(2, &frags[0], &mut ok);
        let OpRef::PtlResp {
            h,
            ack,
            mlength,
            offset,
            ..
        } = frags[0]
        else {
            unreachable!()
        };
        let end = OpRef::PtlResp {
            h,
            ni_fail: NiFail::Segv as u8,
            ack,
            mlength,
            offset,
            frag_off: 1024,
            last: true,
            data: &[],
        };
        assert_eq!(
            asm.response(2, &end, &mut ok).expect("ended").1.ni_fail,
            NiFail::Segv
        );
        // One piece: the data comes back with it.
        let small = Response {
            data: vec![5; 10],
            mlength: 10,
            ..resp
        };
        let one: Vec<_> = response_ops(h, &small, 1024).collect();
        let (_, r) = asm.response(0, &one[0], &mut fail).expect("whole");
        assert_eq!(r.data, vec![5; 10]);
    }

    /// Two ranks of one host send multi-fragment messages to one target with the same
    /// operation id (each process numbers its own): their fragments interleave on the wire,
    /// and each message must come back whole and unmixed.
    #[test]
    fn same_op_id_from_two_ranks_of_one_host_reassembles_apart() {
        let header = |src_rank| OpHeader {
            job: 1,
            src_rank,
            dst_rank: 3,
            req: 7,
        };
        let m = PtlHeader {
            rlength: 3000,
            ..PtlHeader::default()
        };
        let a = vec![0xaau8; 3000];
        let b = vec![0xbbu8; 3000];
        let fa: Vec<_> = request_ops(header(0), m, &[], &a, 1024).collect();
        let fb: Vec<_> = request_ops(header(1), m, &[], &b, 1024).collect();
        assert!(fa.len() > 1, "the test needs fragments");
        let mut asm = Reassembly::default();
        let mut whole = Vec::new();
        for (x, y) in fa.iter().zip(&fb) {
            for op in [x, y] {
                if let Some(w) = asm.request(0, op) {
                    let (h, _, _, data) = w.as_ref().expect("not dropped").parts();
                    whole.push((h.src_rank, data.to_vec()));
                }
            }
        }
        assert_eq!(whole, vec![(0, a), (1, b)]);
    }
}
