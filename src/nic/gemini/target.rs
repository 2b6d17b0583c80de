//! Target side: what the NIC does with a put, get or AMO addressed to one of its endpoints.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::nic::memory::{Endpoints, HeapBacking, Perms, Region};
use crate::wire::{AmoOp, OpHeader, OpRef, Status, VShape};

/// A small reply op owned by the engine (no borrowed data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// `lazy`: the initiator asked for no hurry (an implicit put).
    PutAck {
        h: OpHeader,
        status: Status,
        lazy: bool,
    },
    AmoReply {
        h: OpHeader,
        status: Status,
        value: u64,
    },
    /// A get that failed its checks: a single last reply fragment with no data.
    GetError { h: OpHeader, status: Status },
}

impl Reply {
    pub fn as_op(&self) -> OpRef<'static> {
        match *self {
            Reply::PutAck { h, status, .. } => OpRef::PutAck { h, status },
            Reply::AmoReply { h, status, value } => OpRef::AmoReply { h, status, value },
            Reply::GetError { h, status } => OpRef::GetReply {
                h,
                status,
                frag_off: 0,
                last: true,
                data: &[],
            },
        }
    }
}

/// What serving an op asks of the daemon.
pub enum TargetAction {
    /// Nothing to send (a non-final put fragment, or a reply op, which is the initiator's).
    None,
    Reply(Reply),
    /// Stream `len` bytes of `region` from `offset` back as get-reply fragments, numbered
    /// from `frag_base` (non-zero for the later parts of a vector get).
    StreamGet {
        h: OpHeader,
        region: Region,
        offset: u64,
        len: u64,
        frag_base: u64,
    },
}

/// The header of a reply to `h`: same job and request, ranks swapped.
pub fn reply_header(h: &OpHeader) -> OpHeader {
    OpHeader {
        job: h.job,
        src_rank: h.dst_rank,
        dst_rank: h.src_rank,
        req: h.req,
    }
}

/// Applies one AMO to `word` with a CPU atomic instruction; returns the previous value.
pub fn apply_amo(word: &AtomicU64, op: AmoOp, operand: u64, operand2: u64) -> u64 {
    let o = Ordering::SeqCst;
    match op {
        AmoOp::Aadd | AmoOp::Afadd => word.fetch_add(operand, o),
        AmoOp::Aand | AmoOp::Afand => word.fetch_and(operand, o),
        AmoOp::Aor | AmoOp::Afor => word.fetch_or(operand, o),
        AmoOp::Axor | AmoOp::Afxor => word.fetch_xor(operand, o),
        AmoOp::Afax => match word.fetch_update(o, o, |v| Some((v & operand) ^ operand2)) {
            Ok(v) | Err(v) => v,
        },
        AmoOp::Acswap => match word.compare_exchange(operand2, operand, o, o) {
            Ok(v) | Err(v) => v,
        },
    }
}

/// The value an AMO leaves in a word that held `old`.
fn amo_new(op: AmoOp, old: u64, operand: u64, operand2: u64) -> u64 {
    match op {
        AmoOp::Aadd | AmoOp::Afadd => old.wrapping_add(operand),
        AmoOp::Aand | AmoOp::Afand => old & operand,
        AmoOp::Aor | AmoOp::Afor => old | operand,
        AmoOp::Axor | AmoOp::Afxor => old ^ operand,
        AmoOp::Afax => (old & operand) ^ operand2,
        AmoOp::Acswap if old == operand2 => operand,
        AmoOp::Acswap => old,
    }
}

/// Applies an AMO to the word at `off` of `r`; returns the previous value. In mapped memory
/// with a CPU atomic (coherent with the owner's atomics); in memory reached by copy (a
/// process's registered private pages) by read, compute, write, which is atomic among NIC
/// AMOs because one engine thread serves every op of a host.
pub fn amo_at(
    r: &Region,
    off: u64,
    need: Perms,
    op: AmoOp,
    operand: u64,
    operand2: u64,
) -> Result<u64, Status> {
    if r.is_mapped() {
        return r
            .atomic(off, need)
            .map(|w| apply_amo(w, op, operand, operand2));
    }
    r.check(off, 8, need)?;
    if !off.is_multiple_of(8) {
        return Err(Status::BadRequest);
    }
    let mut b = Vec::with_capacity(8);
    r.append_to(off, 8, &mut b)?;
    let old = u64::from_le_bytes(b[..8].try_into().expect("8 bytes read"));
    r.write(off, &amo_new(op, old, operand, operand2).to_le_bytes())?;
    Ok(old)
}

/// A strided or indexed put fragment: the whole operation's extent is checked, then every
/// element of the fragment, before anything is written.
fn put_vector(
    eps: &Endpoints,
    h: &OpHeader,
    region: u32,
    s: &VShape,
    data: &[u8],
) -> Result<(), Status> {
    let r = eps.region(h.job, h.dst_rank, region)?;
    r.check(s.lo, s.hi.saturating_sub(s.lo), Perms::WRITE)?;
    let (idx, elems) = data.split_at(s.idx_len());
    for i in 0..s.n {
        s.offset(i, idx).ok_or(Status::BadRequest)?;
    }
    let e = s.elem as usize;
    for (i, el) in elems.chunks_exact(e).enumerate() {
        let off = s.offset(i as u32, idx).ok_or(Status::BadRequest)?;
        r.write(off, el)?;
    }
    Ok(())
}

/// A strided or indexed get: the elements gathered, packed in order, into a buffer the reply
/// streams from.
fn get_vector(
    eps: &Endpoints,
    h: &OpHeader,
    region: u32,
    s: &VShape,
    idx: &[u8],
) -> Result<(Region, u64), Status> {
    let r = eps.region(h.job, h.dst_rank, region)?;
    r.check(s.lo, s.hi.saturating_sub(s.lo), Perms::READ)?;
    let mut packed = Vec::with_capacity(s.data_len());
    for i in 0..s.n {
        let off = s.offset(i, idx).ok_or(Status::BadRequest)?;
        r.append_to(off, s.elem as usize, &mut packed)?;
    }
    let out = Region::new(HeapBacking::new(packed.len()), Perms::READ);
    out.write(0, &packed)?;
    Ok((out, packed.len() as u64))
}

/// Serves one op addressed to this host. Checks every access against the target region's
/// bounds and permissions; a failing access changes nothing and is answered with its status.
pub fn serve(eps: &Endpoints, op: &OpRef<'_>) -> TargetAction {
    match *op {
        OpRef::Put {
            h,
            region,
            offset,
            total_off,
            total_len,
            last,
            lazy_ack,
            notify: _,
            data,
        } => {
            let status = match put_fragment(eps, &h, region, offset, total_off, total_len, data) {
                Ok(()) => Status::Ok,
                Err(s) => s,
            };
            if last {
                TargetAction::Reply(Reply::PutAck {
                    h: reply_header(&h),
                    status,
                    lazy: lazy_ack,
                })
            } else {
                TargetAction::None
            }
        }
        OpRef::Get {
            h,
            region,
            offset,
            len,
            notify: _,
        } => {
            let rh = reply_header(&h);
            match eps
                .region(h.job, h.dst_rank, region)
                .and_then(|r| r.check(offset, len, Perms::READ).map(|_| r))
            {
                Ok(r) => TargetAction::StreamGet {
                    h: rh,
                    region: r.clone(),
                    offset,
                    len,
                    frag_base: 0,
                },
                Err(status) => TargetAction::Reply(Reply::GetError { h: rh, status }),
            }
        }
        OpRef::Amo {
            h,
            region,
            op,
            offset,
            operand,
            operand2,
        } => {
            let need = if op.is_fetching() {
                Perms::READ_WRITE
            } else {
                Perms::WRITE
            };
            let (status, value) = match eps
                .region(h.job, h.dst_rank, region)
                .and_then(|r| amo_at(r, offset, need, op, operand, operand2))
            {
                Ok(old) => (Status::Ok, old),
                Err(s) => (s, 0),
            };
            TargetAction::Reply(Reply::AmoReply {
                h: reply_header(&h),
                status,
                value,
            })
        }
        OpRef::AmoScatter {
            h,
            region,
            op,
            last,
            pairs,
        } => {
            let mut applied = 0u64;
            let mut status = Status::Ok;
            match eps.region(h.job, h.dst_rank, region) {
                Ok(r) => {
                    for p in pairs.chunks_exact(16) {
                        let off = u64::from_le_bytes(p[..8].try_into().expect("16-byte chunk"));
                        let v = u64::from_le_bytes(p[8..].try_into().expect("16-byte chunk"));
                        match amo_at(r, off, Perms::WRITE, op, v, 0) {
                            Ok(_) => applied += 1,
                            Err(s) => status = s,
                        }
                    }
                }
                Err(s) => status = s,
            }
            if last || !status.is_ok() {
                TargetAction::Reply(Reply::AmoReply {
                    h: reply_header(&h),
                    status,
                    value: applied,
                })
            } else {
                TargetAction::None
            }
        }
        OpRef::PutV {
            h,
            region,
            s,
            last,
            lazy_ack,
            data,
        } => {
            let status = put_vector(eps, &h, region, &s, data)
                .err()
                .unwrap_or(Status::Ok);
            if last {
                TargetAction::Reply(Reply::PutAck {
                    h: reply_header(&h),
                    status,
                    lazy: lazy_ack,
                })
            } else {
                TargetAction::None
            }
        }
        OpRef::GetV { h, region, s, idx } => {
            let rh = reply_header(&h);
            match get_vector(eps, &h, region, &s, idx) {
                Ok((packed, len)) => TargetAction::StreamGet {
                    h: rh,
                    len,
                    region: packed,
                    offset: 0,
                    frag_base: s.first as u64 * s.elem as u64,
                },
                Err(status) => TargetAction::Reply(Reply::GetError { h: rh, status }),
            }
        }
        // Replies belong to the initiator; Portals ops to the Portals engine.
        OpRef::PutAck { .. }
        | OpRef::GetReply { .. }
        | OpRef::AmoReply { .. }
        | OpRef::PtlReq { .. }
        | OpRef::PtlResp { .. }
        | OpRef::PtlAcks { .. }
        | OpRef::VeloMsg { .. }
        | OpRef::Am { .. } => TargetAction::None,
    }
}

fn put_fragment(
    eps: &Endpoints,
    h: &OpHeader,
    region: u32,
    offset: u64,
    total_off: u64,
    total_len: u64,
    data: &[u8],
) -> Result<(), Status> {
    let r = eps.region(h.job, h.dst_rank, region)?;
    // The whole put is checked on every fragment, so a put that is partly out of bounds writes
    // nothing at all; the fragment must lie inside the whole.
    r.check(total_off, total_len, Perms::WRITE)?;
    let frag_end = offset
        .checked_add(data.len() as u64)
        .ok_or(Status::BadRequest)?;
    if offset < total_off || frag_end > total_off + total_len {
        return Err(Status::BadRequest);
    }
    r.write(offset, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::memory::HeapBacking;

    fn eps() -> (Endpoints, Region) {
        let mut e = Endpoints::default();
        e.insert(1, 5, 0);
        let r = Region::new(HeapBacking::new(64), Perms::READ_WRITE);
        e.register(1, 5, r.clone()).unwrap();
        e.register(1, 5, Region::new(HeapBacking::new(64), Perms::READ))
            .unwrap();
        (e, r)
    }

    fn h() -> OpHeader {
        OpHeader {
            job: 1,
            src_rank: 0,
            dst_rank: 5,
            req: 42,
        }
    }

    #[test]
    fn put_writes_and_acks_on_last_fragment() {
        let (e, r) = eps();
        let a = serve(
            &e,
            &OpRef::Put {
                h: h(),
                region: 0,
                offset: 3,
                total_off: 3,
                total_len: 4,
                last: false,
                lazy_ack: false,
                notify: 0,
                data: b"ab",
            },
        );
        assert!(matches!(a, TargetAction::None));
        let a = serve(
            &e,
            &OpRef::Put {
                h: h(),
                region: 0,
                offset: 5,
                total_off: 3,
                total_len: 4,
                last: true,
                lazy_ack: false,
                notify: 0,
                data: b"cd",
            },
        );
        match a {
            TargetAction::Reply(Reply::PutAck { h: rh, status, .. }) => {
                assert_eq!(status, Status::Ok);
                assert_eq!((rh.src_rank, rh.dst_rank, rh.req), (5, 0, 42));
            }
            _ => panic!("expected an ack"),
        }
        assert_eq!(r.to_vec(3, 4), b"abcd");
    }

    #[test]
    fn partly_out_of_bounds_put_writes_nothing() {
        let (e, r) = eps();
        let a = serve(
            &e,
            &OpRef::Put {
                h: h(),
                region: 0,
                offset: 60,
                total_off: 60,
                total_len: 8,
                last: true,
                lazy_ack: false,
                notify: 0,
                data: b"abcd",
            },
        );
        assert!(matches!(
            a,
            TargetAction::Reply(Reply::PutAck {
                status: Status::OutOfBounds,
                ..
            })
        ));
        assert_eq!(r.to_vec(60, 4), &[0; 4]);
        let a = serve(
            &e,
            &OpRef::Put {
                h: h(),
                region: 1,
                offset: 0,
                total_off: 0,
                total_len: 1,
                last: true,
                lazy_ack: false,
                notify: 0,
                data: b"x",
            },
        );
        assert!(matches!(
            a,
            TargetAction::Reply(Reply::PutAck {
                status: Status::Permission,
                ..
            })
        ));
    }

    #[test]
    fn amos_match_their_definitions() {
        let w = AtomicU64::new(0b1100);
        let cases = [
            (AmoOp::Aadd, 1, 0, 0b1101),
            (AmoOp::Aand, 0b0101, 0, 0b0101),
            (AmoOp::Aor, 0b1010, 0, 0b1111),
            (AmoOp::Axor, 0b0001, 0, 0b1110),
            (AmoOp::Afadd, 2, 0, 0b10000),
            (AmoOp::Afand, 0b10000, 0, 0b10000),
            (AmoOp::Afor, 1, 0, 0b10001),
            (AmoOp::Afxor, 0b10001, 0, 0),
            (AmoOp::Afax, 0, 0xff, 0xff),
            (AmoOp::Acswap, 7, 0xff, 7),
            (AmoOp::Acswap, 9, 0xff, 7),
        ];
        for (op, a, b, want) in cases {
            let before = w.load(Ordering::SeqCst);
            let old = apply_amo(&w, op, a, b);
            assert_eq!(old, before, "{op:?} fetches the old value");
            assert_eq!(w.load(Ordering::SeqCst), want, "{op:?}");
        }
    }

    #[test]
    fn amo_checks() {
        let (e, _) = eps();
        let amo = |region, op, offset| match serve(
            &e,
            &OpRef::Amo {
                h: h(),
                region,
                op,
                offset,
                operand: 1,
                operand2: 0,
            },
        ) {
            TargetAction::Reply(Reply::AmoReply { status, .. }) => status,
            _ => panic!("expected an AMO reply"),
        };
        assert_eq!(amo(0, AmoOp::Afadd, 8), Status::Ok);
        assert_eq!(amo(0, AmoOp::Afadd, 4), Status::BadRequest);
        assert_eq!(amo(0, AmoOp::Afadd, 64), Status::OutOfBounds);
        assert_eq!(amo(1, AmoOp::Aadd, 0), Status::Permission);
        assert_eq!(amo(9, AmoOp::Aadd, 0), Status::NoSuchRegion);
    }
}
