//! Portals calls as the client hands them to its NIC through the command ring.
//!
//! A call rides in a `CommandKind::Portals` command's inline bytes: a code, then fixed
//! little-endian fields. The daemon decodes from its private copy and refuses anything short,
//! long or unknown with a typed error (the client is then disconnected, as for any garbage).

use crate::nic::portals::wire::{decode_kind, encode_kind};
use crate::nic::portals::{AckReq, OpSpec, ProcessId};
use crate::wire::{get_u32, get_u64, PtlHeader};

/// Interfaces per process (PtlNIInit's `iface` × matching/non-matching: 4 is plenty); the
/// `ni` of every call is below this.
pub const MAX_NIS: usize = 4;

/// Memory as the client names it: a registered region, an offset, a length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Buf {
    pub region: u32,
    pub offset: u64,
    pub length: u64,
}

/// A match list entry or list entry as sent to the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MeArgs {
    pub buf: Buf,
    pub ct: Option<u32>,
    pub uid: u32,
    pub options: u32,
    /// (0 logical rank | 1 physical nid/pid, a, b)
    pub match_id: (u8, u32, u32),
    pub match_bits: u64,
    pub ignore_bits: u64,
    pub min_free: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PtlCall {
    NiInit {
        ni: u8,
        matching: bool,
    },
    EqAlloc {
        ni: u8,
        count: u32,
        ring: Buf,
    },
    EqFree {
        ni: u8,
        eq: u32,
    },
    CtAlloc {
        ni: u8,
        slot: Buf,
    },
    CtFree {
        ni: u8,
        ct: u32,
    },
    CtSet {
        ni: u8,
        ct: u32,
        success: u64,
        failure: u64,
    },
    CtInc {
        ni: u8,
        ct: u32,
        success: u64,
        failure: u64,
    },
    CtCancelTriggered {
        ni: u8,
        ct: u32,
    },
    /// A triggered CTInc/CTSet: when `ct` reaches `threshold`, do it to `target`.
    CtTriggered {
        ni: u8,
        ct: u32,
        threshold: u64,
        target: u32,
        set: bool,
        success: u64,
        failure: u64,
    },
    PtAlloc {
        ni: u8,
        options: u32,
        eq: Option<u32>,
        index: Option<u32>,
    },
    PtFree {
        ni: u8,
        index: u32,
    },
    PtEnable {
        ni: u8,
        index: u32,
        enable: bool,
    },
    Append {
        ni: u8,
        pt: u32,
        overflow: bool,
        user_ptr: u64,
        me: MeArgs,
    },
    Unlink {
        ni: u8,
        handle: u32,
    },
    Search {
        ni: u8,
        pt: u32,
        delete: bool,
        user_ptr: u64,
        me: MeArgs,
    },
    MdBind {
        ni: u8,
        region: u32,
        segments: Vec<(u64, u64)>,
        options: u32,
        eq: Option<u32>,
        ct: Option<u32>,
    },
    MdRelease {
        ni: u8,
        md: u32,
    },
    /// A data movement (PtlPut, PtlGet, PtlAtomic, PtlFetchAtomic, PtlSwap) as the engine
    /// takes it, target already resolved to a physical id; a triggered one carries
    /// `trigger = Some((ct, threshold))`.
    Op {
        ni: u8,
        op: OpSpec,
        trigger: Option<(u32, u64)>,
    },
    /// PtlSetMap: logical index i names the job's rank `ranks[i]`.
    SetMap {
        ni: u8,
        ranks: Vec<u32>,
    },
    /// PtlNIFini: the interface and everything allocated on it go.
    NiFini {
        ni: u8,
    },
    /// PtlNIStatus: one status register's value.
    NiStatus {
        ni: u8,
        register: u32,
    },
}

/// Whether a call with this code only changes its interface's state and sends nothing:
/// everything but data movements, counting-event changes (which may fire triggered
/// operations) and PtlNIFini.
pub fn stays_local(code: u8) -> bool {
    matches!(code, 1..=5 | 8 | 10..=17 | 19 | 21)
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed Portals call")]
pub struct BadCall;

/// The completion status of a Portals call: 0 for PTL_OK, else 1000 + the error's code.
pub fn status_of(r: &Result<u64, crate::nic::portals::PtlError>) -> u32 {
    use crate::nic::portals::PtlError::*;
    match r {
        Ok(_) => 0,
        Err(e) => {
            1000 + match e {
                ArgInvalid => 1,
                NoSpace => 2,
                PtInUse => 3,
                PtFull => 4,
                PtEqNeeded => 5,
                ListTooLong => 6,
                InUse => 7,
                EqEmpty => 8,
                EqDropped => 9,
                CtNoneReached => 10,
            }
        }
    }
}

/// The inverse of [`status_of`].
pub fn result_of(status: u32, value: u64) -> Result<u64, crate::nic::portals::PtlError> {
    use crate::nic::portals::PtlError::*;
    Err(match status {
        0 => return Ok(value),
        1002 => NoSpace,
        1003 => PtInUse,
        1004 => PtFull,
        1005 => PtEqNeeded,
        1006 => ListTooLong,
        1007 => InUse,
        1008 => EqEmpty,
        1009 => EqDropped,
        1010 => CtNoneReached,
        _ => ArgInvalid,
    })
}

/// `u32::MAX` stands for "none" in optional handles.
const NONE: u32 = u32::MAX;

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn opt(&mut self, v: Option<u32>) -> &mut Self {
        self.u32(v.unwrap_or(NONE))
    }
    fn buf(&mut self, b: &Buf) -> &mut Self {
        self.u32(b.region).u64(b.offset).u64(b.length)
    }
    /// A process id: 0 logical (rank, 0), 1 physical (nid, pid).
    fn process(&mut self, p: &ProcessId) -> &mut Self {
        match *p {
            ProcessId::Logical { rank } => self.u8(0).u32(rank).u32(0),
            ProcessId::Physical { nid, pid } => self.u8(1).u32(nid).u32(pid),
        }
    }
    fn me(&mut self, m: &MeArgs) -> &mut Self {
        self.buf(&m.buf).opt(m.ct).u32(m.uid).u32(m.options);
        self.u8(m.match_id.0).u32(m.match_id.1).u32(m.match_id.2);
        self.u64(m.match_bits).u64(m.ignore_bits).u64(m.min_free)
    }
}

struct R<'a>(&'a [u8]);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BadCall> {
        if self.0.len() < n {
            return Err(BadCall);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, BadCall> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, BadCall> {
        Ok(get_u32(self.take(4)?, 0))
    }
    fn u64(&mut self) -> Result<u64, BadCall> {
        Ok(get_u64(self.take(8)?, 0))
    }
    fn opt(&mut self) -> Result<Option<u32>, BadCall> {
        Ok(Some(self.u32()?).filter(|&v| v != NONE))
    }
    fn buf(&mut self) -> Result<Buf, BadCall> {
        Ok(Buf {
            region: self.u32()?,
            offset: self.u64()?,
            length: self.u64()?,
        })
    }
    fn process(&mut self) -> Result<ProcessId, BadCall> {
        Ok(match (self.u8()?, self.u32()?, self.u32()?) {
            (0, rank, 0) => ProcessId::Logical { rank },
            (1, nid, pid) => ProcessId::Physical { nid, pid },
            _ => return Err(BadCall),
        })
    }
    fn me(&mut self) -> Result<MeArgs, BadCall> {
        Ok(MeArgs {
            buf: self.buf()?,
            ct: self.opt()?,
            uid: self.u32()?,
            options: self.u32()?,
            match_id: (self.u8()?, self.u32()?, self.u32()?),
            match_bits: self.u64()?,
            ignore_bits: self.u64()?,
            min_free: self.u64()?,
        })
    }
}

impl PtlCall {
    /// Encodes into `out`, replacing what it held (a caller's buffer, reused call after call).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.clear();
        let mut w = W(std::mem::take(out));
        match self {
            PtlCall::NiInit { ni, matching } => w.u8(1).u8(*ni).u8(*matching as u8),
            PtlCall::EqAlloc { ni, count, ring } => w.u8(2).u8(*ni).u32(*count).buf(ring),
            PtlCall::EqFree { ni, eq } => w.u8(3).u8(*ni).u32(*eq),
            PtlCall::CtAlloc { ni, slot } => w.u8(4).u8(*ni).buf(slot),
            PtlCall::CtFree { ni, ct } => w.u8(5).u8(*ni).u32(*ct),
            PtlCall::CtSet {
                ni,
                ct,
                success,
                failure,
            } => w.u8(6).u8(*ni).u32(*ct).u64(*success).u64(*failure),
            PtlCall::CtInc {
                ni,
                ct,
                success,
                failure,
            } => w.u8(7).u8(*ni).u32(*ct).u64(*success).u64(*failure),
            PtlCall::CtCancelTriggered { ni, ct } => w.u8(8).u8(*ni).u32(*ct),
            PtlCall::CtTriggered {
                ni,
                ct,
                threshold,
                target,
                set,
                success,
                failure,
            } => w
                .u8(9)
                .u8(*ni)
                .u32(*ct)
                .u64(*threshold)
                .u32(*target)
                .u8(*set as u8)
                .u64(*success)
                .u64(*failure),
            PtlCall::PtAlloc {
                ni,
                options,
                eq,
                index,
            } => w.u8(10).u8(*ni).u32(*options).opt(*eq).opt(*index),
            PtlCall::PtFree { ni, index } => w.u8(11).u8(*ni).u32(*index),
            PtlCall::PtEnable { ni, index, enable } => {
                w.u8(12).u8(*ni).u32(*index).u8(*enable as u8)
            }
            PtlCall::Append {
                ni,
                pt,
                overflow,
                user_ptr,
                me,
            } => w
                .u8(13)
                .u8(*ni)
                .u32(*pt)
                .u8(*overflow as u8)
                .u64(*user_ptr)
                .me(me),
            PtlCall::Unlink { ni, handle } => w.u8(14).u8(*ni).u32(*handle),
            PtlCall::Search {
                ni,
                pt,
                delete,
                user_ptr,
                me,
            } => w
                .u8(15)
                .u8(*ni)
                .u32(*pt)
                .u8(*delete as u8)
                .u64(*user_ptr)
                .me(me),
            PtlCall::MdBind {
                ni,
                region,
                segments,
                options,
                eq,
                ct,
            } => {
                w.u8(16)
                    .u8(*ni)
                    .u32(*region)
                    .u32(*options)
                    .opt(*eq)
                    .opt(*ct)
                    .u32(segments.len() as u32);
                for (s, l) in segments {
                    w.u64(*s).u64(*l);
                }
                &mut w
            }
            PtlCall::MdRelease { ni, md } => w.u8(17).u8(*ni).u32(*md),
            PtlCall::NiFini { ni } => w.u8(20).u8(*ni),
            PtlCall::NiStatus { ni, register } => w.u8(21).u8(*ni).u32(*register),
            PtlCall::SetMap { ni, ranks } => {
                w.u8(19).u8(*ni).u32(ranks.len() as u32);
                for r in ranks {
                    w.u32(*r);
                }
                &mut w
            }
            PtlCall::Op { ni, op, trigger } => {
                let (kind, aop, dt) = encode_kind(op.kind);
                w.u8(18)
                    .u8(*ni)
                    .u8(kind)
                    .u8(aop)
                    .u8(dt)
                    .u8(op.ack_req.code());
                w.u32(op.md)
                    .u64(op.offset)
                    .u64(op.length)
                    .opt(op.get_md)
                    .u64(op.get_offset);
                w.process(&op.target).u32(op.pt_index).u64(op.match_bits);
                w.u64(op.remote_offset).u64(op.user_ptr).u64(op.hdr_data);
                let (ct, th) = trigger.unwrap_or((NONE, 0));
                w.u32(ct).u64(th).u8(op.operand.len() as u8);
                w.0.extend_from_slice(&op.operand);
                // Volatile bytes last, their length in a u32 (the call's own length bounds it).
                w.u32(op.inline.len() as u32);
                w.0.extend_from_slice(&op.inline);
                &mut w
            }
        };
        *out = w.0;
    }

    pub fn decode(b: &[u8]) -> Result<PtlCall, BadCall> {
        let mut r = R(b);
        let code = r.u8()?;
        let ni = r.u8()?;
        let call = match code {
            1 => PtlCall::NiInit {
                ni,
                matching: r.u8()? != 0,
            },
            2 => PtlCall::EqAlloc {
                ni,
                count: r.u32()?,
                ring: r.buf()?,
            },
            3 => PtlCall::EqFree { ni, eq: r.u32()? },
            4 => PtlCall::CtAlloc { ni, slot: r.buf()? },
            5 => PtlCall::CtFree { ni, ct: r.u32()? },
            6 => PtlCall::CtSet {
                ni,
                ct: r.u32()?,
                success: r.u64()?,
                failure: r.u64()?,
            },
            7 => PtlCall::CtInc {
                ni,
                ct: r.u32()?,
                success: r.u64()?,
                failure: r.u64()?,
            },
            8 => PtlCall::CtCancelTriggered { ni, ct: r.u32()? },
            9 => PtlCall::CtTriggered {
                ni,
                ct: r.u32()?,
                threshold: r.u64()?,
                target: r.u32()?,
                set: r.u8()? != 0,
                success: r.u64()?,
                failure: r.u64()?,
            },
            10 => PtlCall::PtAlloc {
                ni,
                options: r.u32()?,
                eq: r.opt()?,
                index: r.opt()?,
            },
            11 => PtlCall::PtFree {
                ni,
                index: r.u32()?,
            },
            12 => PtlCall::PtEnable {
                ni,
                index: r.u32()?,
                enable: r.u8()? != 0,
            },
            13 => PtlCall::Append {
                ni,
                pt: r.u32()?,
                overflow: r.u8()? != 0,
                user_ptr: r.u64()?,
                me: r.me()?,
            },
            14 => PtlCall::Unlink {
                ni,
                handle: r.u32()?,
            },
            15 => PtlCall::Search {
                ni,
                pt: r.u32()?,
                delete: r.u8()? != 0,
                user_ptr: r.u64()?,
                me: r.me()?,
            },
            16 => {
                let (region, options, eq, ct, n) =
                    (r.u32()?, r.u32()?, r.opt()?, r.opt()?, r.u32()?);
                if n as usize > r.0.len() / 16 {
                    return Err(BadCall);
                }
                let segments = (0..n)
                    .map(|_| Ok((r.u64()?, r.u64()?)))
                    .collect::<Result<Vec<_>, _>>()?;
                PtlCall::MdBind {
                    ni,
                    region,
                    segments,
                    options,
                    eq,
                    ct,
                }
            }
            17 => PtlCall::MdRelease { ni, md: r.u32()? },
            20 => PtlCall::NiFini { ni },
            21 => PtlCall::NiStatus {
                ni,
                register: r.u32()?,
            },
            19 => {
                let n = r.u32()? as usize;
                if n > r.0.len() / 4 {
                    return Err(BadCall);
                }
                PtlCall::SetMap {
                    ni,
                    ranks: (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?,
                }
            }
            18 => {
                let h = PtlHeader {
                    kind: r.u8()?,
                    atomic_op: r.u8()?,
                    datatype: r.u8()?,
                    ..Default::default()
                };
                let kind = decode_kind(&h).map_err(|_| BadCall)?;
                let ack_req = AckReq::from_code(r.u8()?).ok_or(BadCall)?;
                let op = OpSpec {
                    kind,
                    ack_req,
                    md: r.u32()?,
                    offset: r.u64()?,
                    length: r.u64()?,
                    get_md: r.opt()?,
                    get_offset: r.u64()?,
                    target: r.process()?,
                    pt_index: r.u32()?,
                    match_bits: r.u64()?,
                    remote_offset: r.u64()?,
                    user_ptr: r.u64()?,
                    hdr_data: r.u64()?,
                    operand: Vec::new(),
                    inline: Vec::new(),
                };
                let (ct, th) = (r.u32()?, r.u64()?);
                let n = r.u8()? as usize;
                let operand = r.take(n)?.to_vec();
                let k = r.u32()? as usize;
                let inline = r.take(k)?.to_vec();
                PtlCall::Op {
                    ni,
                    op: OpSpec {
                        operand,
                        inline,
                        ..op
                    },
                    trigger: (ct != NONE).then_some((ct, th)),
                }
            }
            _ => return Err(BadCall),
        };
        if !r.0.is_empty() {
            return Err(BadCall);
        }
        Ok(call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::portals::atomic::{AtomicOp, Datatype};
    use crate::nic::portals::ReqKind;
    use proptest::prelude::*;

    #[test]
    fn calls_round_trip() {
        let me = MeArgs {
            buf: Buf {
                region: 3,
                offset: 8,
                length: 64,
            },
            ct: Some(2),
            uid: 7,
            options: 9,
            match_id: (1, 4, 5),
            match_bits: 6,
            ignore_bits: 7,
            min_free: 8,
        };
        let op = OpSpec {
            kind: ReqKind::Swap(AtomicOp::Cswap, Datatype::Uint64),
            ack_req: AckReq::CtAck,
            md: 1,
            offset: 2,
            length: 8,
            get_md: Some(3),
            get_offset: 4,
            target: ProcessId::Physical { nid: 1, pid: 5 },
            pt_index: 6,
            match_bits: 7,
            remote_offset: 8,
            user_ptr: 9,
            hdr_data: 10,
            operand: vec![1; 8],
            inline: Vec::new(),
        };
        for c in [
            PtlCall::NiInit {
                ni: 1,
                matching: true,
            },
            PtlCall::NiFini { ni: 2 },
            PtlCall::NiStatus { ni: 0, register: 1 },
            PtlCall::EqAlloc {
                ni: 0,
                count: 64,
                ring: Buf {
                    region: 2,
                    offset: 0,
                    length: 4096,
                },
            },
            PtlCall::CtTriggered {
                ni: 0,
                ct: 1,
                threshold: 5,
                target: 2,
                set: true,
                success: 3,
                failure: 0,
            },
            PtlCall::PtAlloc {
                ni: 0,
                options: 1,
                eq: None,
                index: Some(4),
            },
            PtlCall::Append {
                ni: 0,
                pt: 4,
                overflow: true,
                user_ptr: 99,
                me,
            },
            PtlCall::Search {
                ni: 0,
                pt: 4,
                delete: false,
                user_ptr: 9,
                me,
            },
            PtlCall::MdBind {
                ni: 0,
                region: 1,
                segments: vec![(0, 8), (16, 8)],
                options: 1,
                eq: Some(1),
                ct: None,
            },
            PtlCall::Op {
                ni: 0,
                op: op.clone(),
                trigger: Some((4, 100)),
            },
            PtlCall::Op {
                ni: 1,
                op: OpSpec {
                    kind: ReqKind::Put,
                    target: ProcessId::Logical { rank: 3 },
                    operand: Vec::new(),
                    inline: vec![1, 2, 3, 4, 5, 6, 7, 8],
                    ..op
                },
                trigger: None,
            },
        ] {
            let mut b = Vec::new();
            c.encode_into(&mut b);
            assert_eq!(PtlCall::decode(&b), Ok(c));
        }
    }

    proptest! {
        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = PtlCall::decode(&b);
        }
    }
}
