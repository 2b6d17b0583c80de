//! Ops: the units of work a datagram body carries, several per datagram (coalescing).
//!
//! Every op starts with a 24-byte [`OpHeader`]: `kind u8 | flags u8 | len u16 | job u32 |
//! src_rank u32 | dst_rank u32 | req u64`, where `len` is the whole op's length and `req` the
//! initiator daemon's request id that replies echo. Kind-specific fields follow, then data.

use super::{get_u32, get_u64, WireError};

pub const OP_HEADER_LEN: usize = 24;
/// Flag: the last fragment of a segmented put or get reply.
pub const FLAG_LAST: u8 = 1;
/// Flag on a put: its initiator is in no hurry for the ack (an implicit put), so the target
/// may send it lazily, piggybacked on other traffic.
pub const FLAG_LAZY_ACK: u8 = 2;
/// Flag on an RMA put's fragments or an RMA get: the target writes an EXTOLL notification
/// into its process's notification queue (completer: data in place; responder: get served).
pub const FLAG_NOTIFY: u8 = 4;
/// With [`FLAG_NOTIFY`] on a put: it is an RMA immediate put (the notification says so).
pub const FLAG_IMMEDIATE: u8 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OpKind {
    Put = 1,
    PutAck = 2,
    Get = 3,
    GetReply = 4,
    Amo = 5,
    AmoReply = 6,
    AmoScatter = 7,
    PtlReq = 8,
    PtlResp = 9,
    /// An Active Message of the GASNet layer (opaque here: it encodes its own header).
    Am = 10,
    PtlAcks = 11,
    /// A strided or indexed put (DMAPP iput/ixput): one op per fragment of elements.
    PutV = 12,
    /// A strided or indexed get (DMAPP iget/ixget), answered by `GetReply` fragments of the
    /// elements packed in order.
    GetV = 13,
    /// A VELO message for the target process's mailbox; acknowledged by a `PutAck` once it is
    /// in the mailbox (the sender's credit comes back with it).
    VeloMsg = 14,
}

impl OpKind {
    fn from_u8(v: u8) -> Result<Self, WireError> {
        Ok(match v {
            1 => Self::Put,
            2 => Self::PutAck,
            3 => Self::Get,
            4 => Self::GetReply,
            5 => Self::Amo,
            6 => Self::AmoReply,
            7 => Self::AmoScatter,
            8 => Self::PtlReq,
            9 => Self::PtlResp,
            10 => Self::Am,
            11 => Self::PtlAcks,
            12 => Self::PutV,
            13 => Self::GetV,
            14 => Self::VeloMsg,
            _ => return Err(WireError::UnknownOp(v)),
        })
    }
    /// Bytes of kind-specific fields after the common header.
    fn fixed_len(self) -> usize {
        match self {
            Self::Put => 32,
            Self::PutAck => 8,
            Self::Get => 24,
            Self::GetReply => 16,
            Self::Amo => 32,
            Self::AmoReply => 16,
            Self::AmoScatter => 8,
            Self::PtlReq => 48,
            Self::PtlResp => 32,
            Self::Am => 0,
            Self::PtlAcks => 0,
            Self::PutV | Self::GetV => VShape::LEN,
            Self::VeloMsg => 8,
        }
    }
}

/// Completion status carried by replies and, through the client, by completion-queue entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    Ok = 0,
    /// The access falls outside the target region.
    OutOfBounds = 1,
    /// The target region does not allow this kind of access.
    Permission = 2,
    /// No region with that handle is registered at the target.
    NoSuchRegion = 3,
    /// No process of this job has that rank at the target host (exited, killed, never attached).
    NoSuchEndpoint = 4,
    /// The target host's daemon stopped answering; the op may or may not have been applied.
    PeerDead = 5,
    /// The request itself was malformed (bad size, misaligned atomic, bad host index…).
    BadRequest = 6,
    /// Memory the NIC reaches by copy (a process's private pages) could not be read or
    /// written: unmapped, or its process is gone.
    Fault = 7,
}

impl Status {
    pub fn from_u32(v: u32) -> Status {
        match v {
            0 => Status::Ok,
            1 => Status::OutOfBounds,
            2 => Status::Permission,
            3 => Status::NoSuchRegion,
            4 => Status::NoSuchEndpoint,
            5 => Status::PeerDead,
            7 => Status::Fault,
            _ => Status::BadRequest,
        }
    }
    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }
}

/// The Gemini 64-bit atomic memory operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum AmoOp {
    Aadd = 1,
    Aand = 2,
    Aor = 3,
    Axor = 4,
    Afadd = 5,
    Afand = 6,
    Afor = 7,
    Afxor = 8,
    /// Fetch, then store `(old & operand) ^ operand2` (and-mask, then xor-mask).
    Afax = 9,
    /// If the word equals operand2 (the comperand), store operand (the swaperand); fetches.
    Acswap = 10,
}

impl AmoOp {
    pub const ALL: [AmoOp; 10] = [
        AmoOp::Aadd,
        AmoOp::Aand,
        AmoOp::Aor,
        AmoOp::Axor,
        AmoOp::Afadd,
        AmoOp::Afand,
        AmoOp::Afor,
        AmoOp::Afxor,
        AmoOp::Afax,
        AmoOp::Acswap,
    ];
    pub fn from_u8(v: u8) -> Option<AmoOp> {
        AmoOp::ALL.iter().copied().find(|o| *o as u8 == v)
    }
    /// Whether the initiator gets the old value back.
    pub fn is_fetching(self) -> bool {
        !matches!(self, AmoOp::Aadd | AmoOp::Aand | AmoOp::Aor | AmoOp::Axor)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpHeader {
    pub job: u32,
    pub src_rank: u32,
    pub dst_rank: u32,
    pub req: u64,
}

/// Where the elements of a strided or indexed op lie in the target region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VShape {
    /// Element size in bytes: 1, 4, 8 or 16 (DMAPP's Byte, DW, QW, DQW).
    pub elem: u8,
    /// Offsets come from a list of `u64` byte offsets carried in the op (ixput, ixget), not
    /// from `base + i·stride`.
    pub indexed: bool,
    /// Index in the whole operation of this op's first element, and how many this op carries.
    pub first: u32,
    pub n: u32,
    /// Byte offset of element 0 and the stride in bytes (strided shapes).
    pub base: u64,
    pub stride: i64,
    /// The whole operation's extent `[lo, hi)`, checked on every op of it so that an
    /// operation partly outside the region changes nothing; every element must lie inside.
    pub lo: u64,
    pub hi: u64,
}

impl VShape {
    /// Bytes of the encoded shape (with the region handle in front).
    const LEN: usize = 48;

    /// Byte offset of this op's element `i`, from the shape or the op's offset list; `None` when
    /// it overflows or lies outside `[lo, hi)` (a malformed op).
    pub fn offset(&self, i: u32, idx: &[u8]) -> Option<u64> {
        let off = if self.indexed {
            let at = i as usize * 8;
            get_u64(idx.get(at..at + 8)?, 0)
        } else {
            let o = self.base as i128 + (self.first as i128 + i as i128) * self.stride as i128;
            u64::try_from(o).ok()?
        };
        let end = off.checked_add(self.elem as u64)?;
        (off >= self.lo && end <= self.hi).then_some(off)
    }

    /// Bytes of the offset list an op of this shape carries.
    pub fn idx_len(&self) -> usize {
        if self.indexed {
            self.n as usize * 8
        } else {
            0
        }
    }

    /// Bytes of this op's elements.
    pub fn data_len(&self) -> usize {
        self.n as usize * self.elem as usize
    }

    pub fn valid_elem(elem: u8) -> bool {
        matches!(elem, 1 | 4 | 8 | 16)
    }

    fn encode(&self, region: u32, f: &mut [u8]) {
        f[0..4].copy_from_slice(&region.to_le_bytes());
        f[4..8].copy_from_slice(&[self.elem, self.indexed as u8, 0, 0]);
        f[8..12].copy_from_slice(&self.first.to_le_bytes());
        f[12..16].copy_from_slice(&self.n.to_le_bytes());
        f[16..24].copy_from_slice(&self.base.to_le_bytes());
        f[24..32].copy_from_slice(&self.stride.to_le_bytes());
        f[32..40].copy_from_slice(&self.lo.to_le_bytes());
        f[40..48].copy_from_slice(&self.hi.to_le_bytes());
    }

    fn decode(f: &[u8]) -> Result<(u32, VShape), WireError> {
        let s = VShape {
            elem: f[4],
            indexed: f[5] == 1,
            first: get_u32(f, 8),
            n: get_u32(f, 12),
            base: get_u64(f, 16),
            stride: get_u64(f, 24) as i64,
            lo: get_u64(f, 32),
            hi: get_u64(f, 40),
        };
        if !Self::valid_elem(s.elem) || f[5] > 1 || s.n == 0 {
            return Err(WireError::BadField(
                "vector op: bad element size, mode or count",
            ));
        }
        Ok((get_u32(f, 0), s))
    }
}

/// A decoded op borrowing its data from the datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpRef<'a> {
    /// One fragment of a put: `data` goes at `offset`; the whole put covers
    /// `[total_off, total_off + total_len)`, checked on every fragment so a partly
    /// out-of-bounds put changes nothing.
    Put {
        h: OpHeader,
        region: u32,
        offset: u64,
        total_off: u64,
        total_len: u64,
        last: bool,
        lazy_ack: bool,
        /// An RMA put: 0, or the RMA command (1 put, 3 immediate put) whose completer
        /// notification the target raises on the last fragment.
        notify: u8,
        data: &'a [u8],
    },
    PutAck {
        h: OpHeader,
        status: Status,
    },
    Get {
        h: OpHeader,
        region: u32,
        offset: u64,
        len: u64,
        /// An RMA get: notify the target process (responder) once it is served.
        notify: bool,
    },
    /// One fragment of a get reply: `data` belongs at `frag_off` within the requested range.
    GetReply {
        h: OpHeader,
        status: Status,
        frag_off: u64,
        last: bool,
        data: &'a [u8],
    },
    Amo {
        h: OpHeader,
        region: u32,
        op: AmoOp,
        offset: u64,
        operand: u64,
        operand2: u64,
    },
    AmoReply {
        h: OpHeader,
        status: Status,
        value: u64,
    },
    /// A vector of non-fetching AMOs on one region: `pairs` is a run of 16-byte
    /// `(offset u64, operand u64)`. Answered by one `AmoReply` (value: updates applied) after
    /// the last fragment, or at once on the first failure.
    AmoScatter {
        h: OpHeader,
        region: u32,
        op: AmoOp,
        last: bool,
        pairs: &'a [u8],
    },
    /// One fragment of a Portals message (put, get, atomic, fetch-atomic, swap). The header
    /// fields repeat on every fragment; the target reassembles by request id and matches once,
    /// on the last fragment. `data` follows `operand` in the op.
    PtlReq {
        h: OpHeader,
        m: PtlHeader,
        last: bool,
        operand: &'a [u8],
        data: &'a [u8],
    },
    /// One fragment of the target's answer: failure type, acknowledgement permission, matched
    /// length, offset used, and reply data at `frag_off`.
    PtlResp {
        h: OpHeader,
        ni_fail: u8,
        ack: bool,
        mlength: u64,
        offset: u64,
        frag_off: u64,
        last: bool,
        data: &'a [u8],
    },
    /// An Active Message: `data` is the GASNet layer's own encoding.
    Am {
        h: OpHeader,
        data: &'a [u8],
    },
    /// Portals requests of job `h.job` acknowledged in full: the one the header names
    /// (`h.dst_rank` the initiator's rank, `h.req`), then one per [`PTL_ACK_LEN`]-byte record
    /// `initiator rank u32 | req u64`. In full: no failure, the whole requested length
    /// matched at the requested offset, no data — what the initiator already knows, so only
    /// the request's name travels (a lone acknowledgement is a bare 24-byte op header).
    PtlAcks {
        h: OpHeader,
        acks: &'a [u8],
    },
    /// One fragment of a strided or indexed put: `data` is the offset list (indexed shapes),
    /// then the elements. Acknowledged by a `PutAck` after the last fragment.
    PutV {
        h: OpHeader,
        region: u32,
        s: VShape,
        last: bool,
        lazy_ack: bool,
        data: &'a [u8],
    },
    /// A VELO message: `tag` and the payload, for the mailbox of `h.dst_rank`.
    VeloMsg {
        h: OpHeader,
        tag: u8,
        lazy_ack: bool,
        data: &'a [u8],
    },
    /// A strided or indexed get of `s.n` elements from `s.first` on; `idx` is the offset list
    /// of an indexed shape. Answered by `GetReply` fragments at packed byte offsets from
    /// `first · elem`, the last one flagged.
    GetV {
        h: OpHeader,
        region: u32,
        s: VShape,
        idx: &'a [u8],
    },
}

/// Bytes of one record of [`OpRef::PtlAcks`].
pub const PTL_ACK_LEN: usize = 12;

/// Appends the record of request `req` of initiator `rank` to the records of an [`OpRef::PtlAcks`].
pub fn push_ptl_ack(records: &mut Vec<u8>, rank: u32, req: u64) {
    records.extend_from_slice(&rank.to_le_bytes());
    records.extend_from_slice(&req.to_le_bytes());
}

/// The requests an [`OpRef::PtlAcks`] acknowledges: (initiator rank, req), the header's first.
pub fn ptl_acks<'a>(h: &OpHeader, acks: &'a [u8]) -> impl Iterator<Item = (u32, u64)> + 'a {
    std::iter::once((h.dst_rank, h.req)).chain(
        acks.chunks_exact(PTL_ACK_LEN)
            .map(|r| (get_u32(r, 0), get_u64(r, 4))),
    )
}

/// The Portals message header carried by every [`OpRef::PtlReq`] fragment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PtlHeader {
    /// Which of the target process's interfaces.
    pub ni: u8,
    /// 0 put, 1 get, 2 atomic, 3 fetch-atomic, 4 swap.
    pub kind: u8,
    pub atomic_op: u8,
    pub datatype: u8,
    pub pt_index: u32,
    pub match_bits: u64,
    pub remote_offset: u64,
    pub rlength: u64,
    pub hdr_data: u64,
    pub uid: u32,
    /// [`PtlHeader::NO_ANSWER`] or nothing.
    pub flags: u8,
}

impl PtlHeader {
    /// The initiator asked for no acknowledgement of this put or atomic (PTL_NO_ACK_REQ) and
    /// completed it once sent: its target answers nothing, not even a failure.
    pub const NO_ANSWER: u8 = 1;
}

impl<'a> OpRef<'a> {
    pub fn header(&self) -> &OpHeader {
        match self {
            OpRef::Put { h, .. }
            | OpRef::PutAck { h, .. }
            | OpRef::Get { h, .. }
            | OpRef::GetReply { h, .. }
            | OpRef::Amo { h, .. }
            | OpRef::AmoReply { h, .. }
            | OpRef::AmoScatter { h, .. }
            | OpRef::PtlReq { h, .. }
            | OpRef::PtlResp { h, .. }
            | OpRef::PtlAcks { h, .. }
            | OpRef::PutV { h, .. }
            | OpRef::GetV { h, .. }
            | OpRef::VeloMsg { h, .. }
            | OpRef::Am { h, .. } => h,
        }
    }

    fn kind(&self) -> OpKind {
        match self {
            OpRef::Put { .. } => OpKind::Put,
            OpRef::PutAck { .. } => OpKind::PutAck,
            OpRef::Get { .. } => OpKind::Get,
            OpRef::GetReply { .. } => OpKind::GetReply,
            OpRef::Amo { .. } => OpKind::Amo,
            OpRef::AmoReply { .. } => OpKind::AmoReply,
            OpRef::AmoScatter { .. } => OpKind::AmoScatter,
            OpRef::PtlReq { .. } => OpKind::PtlReq,
            OpRef::PtlResp { .. } => OpKind::PtlResp,
            OpRef::Am { .. } => OpKind::Am,
            OpRef::PtlAcks { .. } => OpKind::PtlAcks,
            OpRef::PutV { .. } => OpKind::PutV,
            OpRef::GetV { .. } => OpKind::GetV,
            OpRef::VeloMsg { .. } => OpKind::VeloMsg,
        }
    }

    /// Bytes after the fixed fields (for PtlReq: operand then data).
    fn tail_len(&self) -> usize {
        match self {
            OpRef::PtlReq { operand, data, .. } => operand.len() + data.len(),
            other => other.data().len(),
        }
    }

    fn data(&self) -> &'a [u8] {
        match self {
            OpRef::PtlResp { data, .. } | OpRef::Am { data, .. } => data,
            OpRef::PtlAcks { acks, .. } => acks,
            OpRef::Put { data, .. } | OpRef::GetReply { data, .. } => data,
            OpRef::AmoScatter { pairs, .. } => pairs,
            OpRef::PutV { data, .. } => data,
            OpRef::GetV { idx, .. } => idx,
            OpRef::VeloMsg { data, .. } => data,
            _ => &[],
        }
    }

    /// Bytes this op takes on the wire.
    pub fn encoded_len(&self) -> usize {
        Self::len_for(self.kind(), self.tail_len())
    }

    /// Bytes an op of `kind` with `data_len` data bytes takes on the wire.
    pub fn len_for(kind: OpKind, data_len: usize) -> usize {
        OP_HEADER_LEN + kind.fixed_len() + data_len
    }

    /// Largest data payload of a put/get-reply fragment that fits in `room` body bytes.
    pub fn max_data(kind: OpKind, room: usize) -> usize {
        room.saturating_sub(OP_HEADER_LEN + kind.fixed_len())
            .min(u16::MAX as usize - 64)
    }

    /// The data at the end of the op's encoding, and the op without it.
    pub fn split_trailing(&self) -> (&'a [u8], OpRef<'a>) {
        let mut head = *self;
        let data = match &mut head {
            OpRef::PtlReq { data, .. }
            | OpRef::PtlResp { data, .. }
            | OpRef::Am { data, .. }
            | OpRef::Put { data, .. }
            | OpRef::GetReply { data, .. } => std::mem::take(data),
            OpRef::PtlAcks { acks, .. } => std::mem::take(acks),
            OpRef::AmoScatter { pairs, .. } => std::mem::take(pairs),
            OpRef::PutV { data, .. } => std::mem::take(data),
            OpRef::GetV { idx, .. } => std::mem::take(idx),
            OpRef::VeloMsg { data, .. } => std::mem::take(data),
            _ => &[],
        };
        (data, head)
    }

    /// Appends the encoding to `out` (no pass over the data but the copy itself).
    pub fn encode_append(&self, out: &mut Vec<u8>) {
        let (data, head) = self.split_trailing();
        let ok = head.encode_with(out, data.len(), &mut |o| {
            o.extend_from_slice(data);
            true
        });
        debug_assert!(ok);
    }

    /// Appends this op (its trailing data empty) carrying `data_len` data bytes that `fill`
    /// appends to `out` after the fixed part. `false` (and `out` as before) when `fill`
    /// fails or appends another length.
    pub fn encode_with(
        &self,
        out: &mut Vec<u8>,
        data_len: usize,
        fill: &mut dyn FnMut(&mut Vec<u8>) -> bool,
    ) -> bool {
        let at = out.len();
        let len = self.encoded_len() + data_len;
        self.encode_head(out, data_len);
        if !fill(out) || out.len() != at + len {
            out.truncate(at);
            return false;
        }
        true
    }

    /// Appends this op's encoding (its trailing data empty) to `out`, its length field
    /// counting `data_len` data bytes that the caller appends (or seals in) right after.
    pub fn encode_head(&self, out: &mut Vec<u8>, data_len: usize) {
        debug_assert!(self.split_trailing().0.is_empty());
        let head_len = self.encoded_len();
        let at = out.len();
        out.resize(at + head_len, 0);
        self.encode(&mut out[at..]);
        out[at + 2..at + 4].copy_from_slice(&((head_len + data_len) as u16).to_le_bytes());
    }

    /// Encodes into the front of `buf` (which must hold [`Self::encoded_len`] bytes).
    pub fn encode(&self, buf: &mut [u8]) -> usize {
        let len = self.encoded_len();
        let h = self.header();
        let last = matches!(
            self,
            OpRef::Put { last: true, .. }
                | OpRef::PutV { last: true, .. }
                | OpRef::GetReply { last: true, .. }
                | OpRef::AmoScatter { last: true, .. }
                | OpRef::PtlReq { last: true, .. }
                | OpRef::PtlResp { last: true, .. }
        );
        buf[0] = self.kind() as u8;
        let lazy = matches!(
            self,
            OpRef::Put { lazy_ack: true, .. }
                | OpRef::PutV { lazy_ack: true, .. }
                | OpRef::VeloMsg { lazy_ack: true, .. }
        );
        let (notify, immediate) = match self {
            OpRef::Put { notify, .. } => (*notify != 0, *notify == 3),
            OpRef::Get { notify, .. } => (*notify, false),
            _ => (false, false),
        };
        buf[1] = if last { FLAG_LAST } else { 0 }
            | if lazy { FLAG_LAZY_ACK } else { 0 }
            | if notify { FLAG_NOTIFY } else { 0 }
            | if immediate { FLAG_IMMEDIATE } else { 0 };
        buf[2..4].copy_from_slice(&(len as u16).to_le_bytes());
        buf[4..8].copy_from_slice(&h.job.to_le_bytes());
        buf[8..12].copy_from_slice(&h.src_rank.to_le_bytes());
        buf[12..16].copy_from_slice(&h.dst_rank.to_le_bytes());
        buf[16..24].copy_from_slice(&h.req.to_le_bytes());
        let f = &mut buf[OP_HEADER_LEN..len];
        let put64 =
            |f: &mut [u8], at: usize, v: u64| f[at..at + 8].copy_from_slice(&v.to_le_bytes());
        let put32 =
            |f: &mut [u8], at: usize, v: u32| f[at..at + 4].copy_from_slice(&v.to_le_bytes());
        match *self {
            OpRef::Put {
                region,
                offset,
                total_off,
                total_len,
                data,
                ..
            } => {
                put32(f, 0, region);
                put32(f, 4, 0);
                put64(f, 8, offset);
                put64(f, 16, total_off);
                put64(f, 24, total_len);
                f[32..].copy_from_slice(data);
            }
            OpRef::PutAck { status, .. } => {
                put32(f, 0, status as u32);
                put32(f, 4, 0);
            }
            OpRef::Get {
                region,
                offset,
                len,
                notify: _,
                ..
            } => {
                put32(f, 0, region);
                put32(f, 4, 0);
                put64(f, 8, offset);
                put64(f, 16, len);
            }
            OpRef::GetReply {
                status,
                frag_off,
                data,
                ..
            } => {
                put32(f, 0, status as u32);
                put32(f, 4, 0);
                put64(f, 8, frag_off);
                f[16..].copy_from_slice(data);
            }
            OpRef::Amo {
                region,
                op,
                offset,
                operand,
                operand2,
                ..
            } => {
                put32(f, 0, region);
                f[4..8].copy_from_slice(&[op as u8, 0, 0, 0]);
                put64(f, 8, offset);
                put64(f, 16, operand);
                put64(f, 24, operand2);
            }
            OpRef::AmoReply { status, value, .. } => {
                put32(f, 0, status as u32);
                put32(f, 4, 0);
                put64(f, 8, value);
            }
            OpRef::AmoScatter {
                region, op, pairs, ..
            } => {
                put32(f, 0, region);
                f[4..8].copy_from_slice(&[op as u8, 0, 0, 0]);
                f[8..].copy_from_slice(pairs);
            }
            OpRef::PtlReq {
                m, operand, data, ..
            } => {
                f[0..4].copy_from_slice(&[m.ni, m.kind, m.atomic_op, m.datatype]);
                put32(f, 4, m.pt_index);
                put64(f, 8, m.match_bits);
                put64(f, 16, m.remote_offset);
                put64(f, 24, m.rlength);
                put64(f, 32, m.hdr_data);
                put32(f, 40, m.uid);
                f[44..46].copy_from_slice(&(operand.len() as u16).to_le_bytes());
                f[46..48].copy_from_slice(&[m.flags, 0]);
                f[48..48 + operand.len()].copy_from_slice(operand);
                f[48 + operand.len()..].copy_from_slice(data);
            }
            OpRef::Am { data, .. } => f.copy_from_slice(data),
            OpRef::VeloMsg { tag, data, .. } => {
                f[0..8].copy_from_slice(&[tag, 0, 0, 0, 0, 0, 0, 0]);
                f[8..].copy_from_slice(data);
            }
            OpRef::PutV {
                region, s, data, ..
            }
            | OpRef::GetV {
                region,
                s,
                idx: data,
                ..
            } => {
                s.encode(region, f);
                f[VShape::LEN..].copy_from_slice(data);
            }
            OpRef::PtlAcks { acks, .. } => f.copy_from_slice(acks),
            OpRef::PtlResp {
                ni_fail,
                ack,
                mlength,
                offset,
                frag_off,
                data,
                ..
            } => {
                f[0..8].copy_from_slice(&[ni_fail, ack as u8, 0, 0, 0, 0, 0, 0]);
                put64(f, 8, mlength);
                put64(f, 16, offset);
                put64(f, 24, frag_off);
                f[32..].copy_from_slice(data);
            }
        }
        len
    }

    /// Decodes one op from the front of `b`; returns it and its length.
    pub fn decode(b: &'a [u8]) -> Result<(OpRef<'a>, usize), WireError> {
        if b.len() < OP_HEADER_LEN {
            return Err(WireError::OpTruncated(0));
        }
        let kind = OpKind::from_u8(b[0])?;
        let last = b[1] & FLAG_LAST != 0;
        let lazy_ack = b[1] & FLAG_LAZY_ACK != 0;
        let notify = b[1] & FLAG_NOTIFY != 0;
        let put_notify = match (notify, b[1] & FLAG_IMMEDIATE != 0) {
            (false, _) => 0,
            (true, false) => 1,
            (true, true) => 3,
        };
        let len = u16::from_le_bytes([b[2], b[3]]) as usize;
        let fixed_end = OP_HEADER_LEN + kind.fixed_len();
        if len < fixed_end || len > b.len() {
            return Err(WireError::OpTruncated(len));
        }
        let h = OpHeader {
            job: get_u32(b, 4),
            src_rank: get_u32(b, 8),
            dst_rank: get_u32(b, 12),
            req: get_u64(b, 16),
        };
        let f = &b[OP_HEADER_LEN..len];
        let data = &b[fixed_end..len];
        let has_data = matches!(
            kind,
            OpKind::Put
                | OpKind::GetReply
                | OpKind::AmoScatter
                | OpKind::PtlReq
                | OpKind::PtlResp
                | OpKind::PtlAcks
                | OpKind::Am
                | OpKind::PutV
                | OpKind::GetV
                | OpKind::VeloMsg
        );
        if !has_data && !data.is_empty() {
            return Err(WireError::BadField("trailing bytes after a fixed-size op"));
        }
        let op = match kind {
            OpKind::Put => OpRef::Put {
                h,
                region: get_u32(f, 0),
                offset: get_u64(f, 8),
                total_off: get_u64(f, 16),
                total_len: get_u64(f, 24),
                last,
                lazy_ack,
                notify: put_notify,
                data,
            },
            OpKind::PutAck => OpRef::PutAck {
                h,
                status: Status::from_u32(get_u32(f, 0)),
            },
            OpKind::Get => OpRef::Get {
                h,
                region: get_u32(f, 0),
                offset: get_u64(f, 8),
                len: get_u64(f, 16),
                notify,
            },
            OpKind::GetReply => OpRef::GetReply {
                h,
                status: Status::from_u32(get_u32(f, 0)),
                frag_off: get_u64(f, 8),
                last,
                data,
            },
            OpKind::Amo => OpRef::Amo {
                h,
                region: get_u32(f, 0),
                op: AmoOp::from_u8(f[4]).ok_or(WireError::BadField("unknown AMO"))?,
                offset: get_u64(f, 8),
                operand: get_u64(f, 16),
                operand2: get_u64(f, 24),
            },
            OpKind::AmoReply => OpRef::AmoReply {
                h,
                status: Status::from_u32(get_u32(f, 0)),
                value: get_u64(f, 8),
            },
            OpKind::AmoScatter => {
                let op = AmoOp::from_u8(f[4]).ok_or(WireError::BadField("unknown AMO"))?;
                if op.is_fetching() || !data.len().is_multiple_of(16) {
                    return Err(WireError::BadField(
                        "AMO scatter: fetching AMO or partial pair",
                    ));
                }
                OpRef::AmoScatter {
                    h,
                    region: get_u32(f, 0),
                    op,
                    last,
                    pairs: data,
                }
            }
            OpKind::PtlReq => {
                let olen = u16::from_le_bytes([f[44], f[45]]) as usize;
                if olen > data.len() || olen > 32 || f[1] > 4 || f[46] & !PtlHeader::NO_ANSWER != 0
                {
                    return Err(WireError::BadField(
                        "Portals request: bad kind, flags or operand length",
                    ));
                }
                let m = PtlHeader {
                    ni: f[0],
                    kind: f[1],
                    atomic_op: f[2],
                    datatype: f[3],
                    pt_index: get_u32(f, 4),
                    match_bits: get_u64(f, 8),
                    remote_offset: get_u64(f, 16),
                    rlength: get_u64(f, 24),
                    hdr_data: get_u64(f, 32),
                    uid: get_u32(f, 40),
                    flags: f[46],
                };
                OpRef::PtlReq {
                    h,
                    m,
                    last,
                    operand: &data[..olen],
                    data: &data[olen..],
                }
            }
            OpKind::Am => OpRef::Am { h, data },
            OpKind::VeloMsg => OpRef::VeloMsg {
                h,
                tag: f[0],
                lazy_ack,
                data,
            },
            OpKind::PutV => {
                let (region, s) = VShape::decode(f)?;
                if data.len() != s.idx_len() + s.data_len() {
                    return Err(WireError::BadField(
                        "vector put: length disagrees with its shape",
                    ));
                }
                OpRef::PutV {
                    h,
                    region,
                    s,
                    last,
                    lazy_ack,
                    data,
                }
            }
            OpKind::GetV => {
                let (region, s) = VShape::decode(f)?;
                if data.len() != s.idx_len() {
                    return Err(WireError::BadField(
                        "vector get: offset list disagrees with its shape",
                    ));
                }
                OpRef::GetV {
                    h,
                    region,
                    s,
                    idx: data,
                }
            }
            OpKind::PtlAcks => {
                if !data.len().is_multiple_of(PTL_ACK_LEN) {
                    return Err(WireError::BadField("Portals acks: partial record"));
                }
                OpRef::PtlAcks { h, acks: data }
            }
            OpKind::PtlResp => OpRef::PtlResp {
                h,
                ni_fail: f[0],
                ack: f[1] != 0,
                mlength: get_u64(f, 8),
                offset: get_u64(f, 16),
                frag_off: get_u64(f, 24),
                last,
                data,
            },
        };
        Ok((op, len))
    }
}

/// Iterates the ops of a datagram body; stops at the first malformed op (yielding its error).
pub struct OpIter<'a> {
    body: &'a [u8],
    failed: bool,
}

impl<'a> OpIter<'a> {
    pub fn new(body: &'a [u8]) -> Self {
        OpIter {
            body,
            failed: false,
        }
    }
}

impl<'a> Iterator for OpIter<'a> {
    type Item = Result<OpRef<'a>, WireError>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.body.is_empty() || self.failed {
            return None;
        }
        match OpRef::decode(self.body) {
            Ok((op, n)) => {
                self.body = &self.body[n..];
                Some(Ok(op))
            }
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples(data: &[u8]) -> Vec<OpRef<'_>> {
        let h = OpHeader {
            job: 1,
            src_rank: 2,
            dst_rank: 3,
            req: 4,
        };
        vec![
            OpRef::Put {
                h,
                region: 5,
                offset: 6,
                total_off: 6,
                total_len: 100,
                last: true,
                lazy_ack: true,
                notify: 3,
                data,
            },
            OpRef::PutAck {
                h,
                status: Status::OutOfBounds,
            },
            OpRef::Get {
                h,
                region: 1,
                offset: 2,
                len: 3,
                notify: true,
            },
            OpRef::GetReply {
                h,
                status: Status::Ok,
                frag_off: 9,
                last: false,
                data,
            },
            OpRef::Amo {
                h,
                region: 1,
                op: AmoOp::Acswap,
                offset: 8,
                operand: 1,
                operand2: 2,
            },
            OpRef::AmoReply {
                h,
                status: Status::Ok,
                value: u64::MAX,
            },
            OpRef::AmoScatter {
                h,
                region: 2,
                op: AmoOp::Axor,
                last: true,
                pairs: &[7; 32],
            },
            OpRef::PtlReq {
                h,
                m: PtlHeader {
                    ni: 1,
                    kind: 4,
                    atomic_op: 11,
                    datatype: 7,
                    pt_index: 3,
                    match_bits: 9,
                    remote_offset: 8,
                    rlength: 8,
                    hdr_data: 6,
                    uid: 5,
                    flags: PtlHeader::NO_ANSWER,
                },
                last: true,
                operand: &[1; 8],
                data,
            },
            OpRef::PtlResp {
                h,
                ni_fail: 2,
                ack: true,
                mlength: 11,
                offset: 4,
                frag_off: 0,
                last: false,
                data,
            },
            OpRef::Am { h, data },
            OpRef::PtlAcks {
                h,
                acks: &[3; 2 * PTL_ACK_LEN],
            },
            OpRef::PutV {
                h,
                region: 3,
                s: VShape {
                    elem: 8,
                    indexed: true,
                    first: 4,
                    n: 2,
                    lo: 8,
                    hi: 64,
                    ..Default::default()
                },
                last: true,
                lazy_ack: true,
                data: &[5; 32],
            },
            OpRef::VeloMsg {
                h,
                tag: 9,
                lazy_ack: true,
                data,
            },
            OpRef::GetV {
                h,
                region: 1,
                s: VShape {
                    elem: 16,
                    indexed: false,
                    first: 0,
                    n: 3,
                    base: 32,
                    stride: -16,
                    lo: 0,
                    hi: 48,
                },
                idx: &[],
            },
        ]
    }

    #[test]
    fn vector_shapes_place_elements_inside_their_extent_only() {
        let s = VShape {
            elem: 8,
            first: 2,
            n: 3,
            base: 100,
            stride: -24,
            lo: 4,
            hi: 108,
            ..Default::default()
        };
        // Elements 2, 3, 4 of the whole: 100 - 48, -72, -96.
        assert_eq!(s.offset(0, &[]), Some(52));
        assert_eq!(s.offset(2, &[]), Some(4));
        assert_eq!(s.offset(3, &[]), None, "below lo");
        let s = VShape { first: 5, ..s };
        assert_eq!(s.offset(0, &[]), None, "negative offset");
        let mut idx = Vec::new();
        for o in [8u64, 100, 101] {
            idx.extend_from_slice(&o.to_le_bytes());
        }
        let s = VShape { indexed: true, ..s };
        assert_eq!(s.offset(0, &idx), Some(8));
        assert_eq!(s.offset(1, &idx), Some(100));
        assert_eq!(s.offset(2, &idx), None, "ends past hi");
        assert_eq!(s.offset(3, &idx), None, "past the list");
        // A shape whose lengths disagree with its data is refused.
        let op = OpRef::PutV {
            h: OpHeader::default(),
            region: 0,
            s: VShape { n: 2, ..s },
            last: true,
            lazy_ack: false,
            data: &[0; 16],
        };
        let mut buf = vec![0u8; op.encoded_len()];
        op.encode(&mut buf);
        assert!(matches!(OpRef::decode(&buf), Err(WireError::BadField(_))));
    }

    #[test]
    fn portals_acks_are_whole_records() {
        let h = OpHeader {
            job: 1,
            dst_rank: 4,
            req: 3,
            ..Default::default()
        };
        let lone = OpRef::PtlAcks { h, acks: &[] };
        assert_eq!(lone.encoded_len(), OP_HEADER_LEN);
        let mut acks = Vec::new();
        for (rank, req) in [(2u32, 7u64 | 1 << 32), (5, 9)] {
            push_ptl_ack(&mut acks, rank, req);
        }
        let op = OpRef::PtlAcks { h, acks: &acks };
        let mut buf = vec![0u8; op.encoded_len()];
        op.encode(&mut buf);
        let (back, _) = OpRef::decode(&buf).unwrap();
        let OpRef::PtlAcks { h: gh, acks: got } = back else {
            panic!("{back:?}");
        };
        assert_eq!(
            ptl_acks(&gh, got).collect::<Vec<_>>(),
            [(4, 3), (2, 7 | 1 << 32), (5, 9)]
        );
        // A record cut short is refused, not read past or rounded down.
        let short = OpRef::PtlAcks {
            h,
            acks: &acks[..PTL_ACK_LEN + 5],
        };
        let mut buf = vec![0u8; short.encoded_len()];
        short.encode(&mut buf);
        assert!(matches!(OpRef::decode(&buf), Err(WireError::BadField(_))));
    }

    #[test]
    fn a_portals_request_with_an_unknown_flag_is_refused() {
        let data = [3u8; 8];
        let op = samples(&data)
            .into_iter()
            .find(|o| matches!(o, OpRef::PtlReq { .. }))
            .unwrap();
        let OpRef::PtlReq { h, m, operand, .. } = op else {
            unreachable!()
        };
        for (flags, ok) in [
            (0, true),
            (PtlHeader::NO_ANSWER, true),
            (2, false),
            (0x80, false),
        ] {
            let op = OpRef::PtlReq {
                h,
                m: PtlHeader { flags, ..m },
                last: true,
                operand,
                data: &data,
            };
            let mut buf = vec![0u8; op.encoded_len()];
            op.encode(&mut buf);
            match OpRef::decode(&buf) {
                Ok((back, _)) => assert!(ok && back == op, "flags {flags}: {back:?}"),
                Err(e) => assert!(!ok && matches!(e, WireError::BadField(_)), "{flags}: {e:?}"),
            }
        }
    }

    #[test]
    fn every_kind_round_trips_in_one_body() {
        let data = b"hello world";
        let ops = samples(data);
        let mut buf = vec![0u8; 1024];
        let mut at = 0;
        for op in &ops {
            at += op.encode(&mut buf[at..]);
        }
        let got: Vec<_> = OpIter::new(&buf[..at]).map(|r| r.unwrap()).collect();
        assert_eq!(got, ops);
    }

    #[test]
    fn appended_encodings_equal_encode_and_a_failed_fill_leaves_nothing() {
        let data = [9u8; 33];
        for op in samples(&data) {
            let mut want = vec![0u8; op.encoded_len()];
            op.encode(&mut want);
            let mut got = vec![7u8; 3];
            op.encode_append(&mut got);
            assert_eq!(&got[3..], &want[..], "{op:?}");
            let (trailing, head) = op.split_trailing();
            let mut filled = Vec::new();
            assert!(head.encode_with(&mut filled, trailing.len(), &mut |o| {
                o.extend_from_slice(trailing);
                true
            }));
            assert_eq!(filled, want, "{op:?}");
            let mut none = vec![1u8];
            assert!(!head.encode_with(&mut none, trailing.len() + 1, &mut |o| {
                o.extend_from_slice(trailing);
                true
            }));
            assert!(!head.encode_with(&mut none, 0, &mut |_| false));
            assert_eq!(none, [1], "nothing is left of a failed fill");
        }
    }

    proptest! {
        #[test]
        fn mutated_bodies_never_panic(flip in 0usize..2048, val in any::<u8>(), cut in 0usize..2048) {
            let data = [1u8; 17];
            let mut buf = vec![0u8; 2048];
            let mut at = 0;
            for op in samples(&data) { at += op.encode(&mut buf[at..]); }
            buf[flip % at] = val;
            for r in OpIter::new(&buf[..cut.min(at)]) { let _ = r; }
        }

        #[test]
        fn random_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            for r in OpIter::new(&bytes) { let _ = r; }
        }
    }
}
