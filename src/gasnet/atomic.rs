//! Remote atomics on 64-bit unsigned words of a node's segment, after GASNet-EX's atomic
//! domains (`gex_AD_OpNB_U64` and friends): the operation set, and what each does to a word.
//!
//! Conduits that have network atomics run them in the NIC (the portals conduit: Portals
//! atomics on the exposed segment, executed by the target's daemon without the target process);
//! the others run them in an Active Message handler at the target (the reference approach).

use std::cell::RefCell;
use std::rc::Rc;

use super::core::Core;
use super::extended::{handler, join, split, ExtState};
use super::{Gasnet, GasnetError};
use crate::nic::portals::atomic::{AtomicOp, Datatype};

/// Extended's internal handlers for atomics run by Active Messages.
const H_AMO: u8 = 8;
const H_AMO_REPLY: u8 = 9;

/// An atomic operation (GEX_OP_*). The F-prefixed ones fetch: they return the word's prior
/// value. `Cas`/`Fcas` compare with the first operand and store the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AdOp {
    Set = 0,
    Get,
    Swap,
    Cas,
    Fcas,
    Add,
    Fadd,
    Sub,
    Fsub,
    Inc,
    Finc,
    Dec,
    Fdec,
    And,
    Fand,
    Or,
    For,
    Xor,
    Fxor,
    Min,
    Fmin,
    Max,
    Fmax,
    Mult,
    Fmult,
}

impl AdOp {
    pub const ALL: [AdOp; 25] = [
        AdOp::Set,
        AdOp::Get,
        AdOp::Swap,
        AdOp::Cas,
        AdOp::Fcas,
        AdOp::Add,
        AdOp::Fadd,
        AdOp::Sub,
        AdOp::Fsub,
        AdOp::Inc,
        AdOp::Finc,
        AdOp::Dec,
        AdOp::Fdec,
        AdOp::And,
        AdOp::Fand,
        AdOp::Or,
        AdOp::For,
        AdOp::Xor,
        AdOp::Fxor,
        AdOp::Min,
        AdOp::Fmin,
        AdOp::Max,
        AdOp::Fmax,
        AdOp::Mult,
        AdOp::Fmult,
    ];

    /// The operation with wire code `c` (hostile input: `None` when unknown).
    pub fn from_code(c: u32) -> Option<AdOp> {
        AdOp::ALL.get(c as usize).copied()
    }

    /// Whether the caller gets the prior value back.
    pub fn fetches(self) -> bool {
        use AdOp::*;
        matches!(
            self,
            Get | Swap | Fcas | Fadd | Fsub | Finc | Fdec | Fand | For | Fxor | Fmin | Fmax | Fmult
        )
    }

    /// Applies the operation to `old` with operands `a`, `b`: the new value of the word.
    pub fn apply(self, old: u64, a: u64, b: u64) -> u64 {
        use AdOp::*;
        match self {
            Get => old,
            Set | Swap => a,
            Cas | Fcas => {
                if old == a {
                    b
                } else {
                    old
                }
            }
            Add | Fadd => old.wrapping_add(a),
            Sub | Fsub => old.wrapping_sub(a),
            Inc | Finc => old.wrapping_add(1),
            Dec | Fdec => old.wrapping_sub(1),
            And | Fand => old & a,
            Or | For => old | a,
            Xor | Fxor => old ^ a,
            Min | Fmin => old.min(a),
            Max | Fmax => old.max(a),
            Mult | Fmult => old.wrapping_mul(a),
        }
    }

    /// How a Portals NIC runs it: the call, the Portals operation and the operand it sends.
    pub fn portals(self, a: u64, b: u64) -> PortalsAtomic {
        use AdOp::*;
        let (call, op, operand) = match self {
            Get => (PortalsCall::Fetch, AtomicOp::Bor, 0),
            Set | Swap => (PortalsCall::Swap { compare: 0 }, AtomicOp::Swap, a),
            Cas | Fcas => (PortalsCall::Swap { compare: a }, AtomicOp::Cswap, b),
            Add | Fadd => (PortalsCall::Atomic, AtomicOp::Sum, a),
            Sub | Fsub => (PortalsCall::Atomic, AtomicOp::Sum, a.wrapping_neg()),
            Inc | Finc => (PortalsCall::Atomic, AtomicOp::Sum, 1),
            Dec | Fdec => (PortalsCall::Atomic, AtomicOp::Sum, u64::MAX),
            And | Fand => (PortalsCall::Atomic, AtomicOp::Band, a),
            Or | For => (PortalsCall::Atomic, AtomicOp::Bor, a),
            Xor | Fxor => (PortalsCall::Atomic, AtomicOp::Bxor, a),
            Min | Fmin => (PortalsCall::Atomic, AtomicOp::Min, a),
            Max | Fmax => (PortalsCall::Atomic, AtomicOp::Max, a),
            Mult | Fmult => (PortalsCall::Atomic, AtomicOp::Prod, a),
        };
        // A fetching arithmetic operation is PtlFetchAtomic rather than PtlAtomic.
        let call = match call {
            PortalsCall::Atomic if self.fetches() => PortalsCall::Fetch,
            c => c,
        };
        PortalsAtomic {
            call,
            op,
            dt: Datatype::Uint64,
            operand,
        }
    }
}

/// Which Portals call carries an [`AdOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortalsCall {
    /// PtlAtomic (ACK completes it).
    Atomic,
    /// PtlFetchAtomic (REPLY brings the prior value).
    Fetch,
    /// PtlSwap with this comparand (REPLY brings the prior value).
    Swap { compare: u64 },
}

/// An [`AdOp`] as Portals runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortalsAtomic {
    pub call: PortalsCall,
    pub op: AtomicOp,
    pub dt: Datatype,
    pub operand: u64,
}

/// Registers the handlers of the Active Message path: the request runs the operation on the
/// target's segment word, the reply carries the prior value (or the failure) back.
pub(super) fn register_handlers(
    core: &mut Core,
    st: &Rc<RefCell<ExtState>>,
) -> Result<(), GasnetError> {
    core.register(
        H_AMO,
        handler(|t, m| {
            let a = m.args;
            let (off, code) = (join(a[2], a[3]), a[4]);
            let (x, y) = (join(a[5], a[6]), join(a[7], a[8]));
            let seg = t.segment();
            let word = usize::try_from(off).ok().filter(|o| {
                o.is_multiple_of(8) && o.checked_add(8).is_some_and(|e| e <= seg.len())
            });
            let (ok, old) = match (word, AdOp::from_code(code)) {
                (Some(o), Some(op)) => {
                    let w: &mut [u8; 8] = (&mut seg[o..o + 8]).try_into().expect("8 bytes");
                    let old = u64::from_le_bytes(*w);
                    *w = op.apply(old, x, y).to_le_bytes();
                    (true, old)
                }
                _ => (false, 0),
            };
            let [o1, o2] = split(old);
            let _ = t.reply_short(H_AMO_REPLY, &[a[0], a[1], !ok as u32, o1, o2]);
        }),
    )?;
    let s = st.clone();
    core.register(
        H_AMO_REPLY,
        handler(move |_, m| {
            let op = join(m.args[0], m.args[1]);
            let mut s = s.borrow_mut();
            if m.args[2] != 0 {
                s.failed.insert(op);
            } else if let Some(buf) = s.get_data.get_mut(&op) {
                buf.copy_from_slice(&join(m.args[3], m.args[4]).to_le_bytes());
            }
            s.part_done(op);
        }),
    )
}

impl Gasnet {
    /// An atomic's target: a node of the job, an aligned word inside the segment.
    fn ad_check(&mut self, node: u32, offset: u64) -> Result<(), GasnetError> {
        if node >= self.nodes() {
            return Err(GasnetError::BadNode(node));
        }
        if !offset.is_multiple_of(8) {
            return Err(GasnetError::Misaligned(offset));
        }
        self.check_remote(offset, 8)
    }

    /// Starts `atomic` on the word at `offset` of `node`'s segment (checked by `ad_check`);
    /// for a fetching operation the prior value will be in the op's `get_data`.
    fn ad_start(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        operands: [u64; 2],
    ) -> Result<u64, GasnetError> {
        let op = {
            let mut s = self.ext.borrow_mut();
            let op = s.new_op(1);
            if atomic.fetches() {
                s.get_data.insert(op, vec![0; 8]);
            }
            op
        };
        if !self
            .core
            .conduit
            .rma_atomic(node, offset, atomic, operands, op)?
        {
            let [lo, hi] = split(op);
            let [o1, o2] = split(offset);
            let [a1, a2] = split(operands[0]);
            let [b1, b2] = split(operands[1]);
            let code = atomic as u32;
            self.am_request_short(node, H_AMO, &[lo, hi, o1, o2, code, a1, a2, b1, b2])?;
        }
        self.track(op);
        Ok(op)
    }

    /// gex_AD_OpNB_U64 waited on at once: runs `atomic` with operands `a`, `b` on the u64 at
    /// `offset` of `node`'s segment (atomic with respect to every other remote atomic on it).
    /// Returns the prior value for fetching operations (`Get`, `Swap`, `Fcas`, `F*`), else 0.
    /// On the portals conduit the target's NIC runs it; on others, a handler at the target.
    pub fn ad_op(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        a: u64,
        b: u64,
    ) -> Result<u64, GasnetError> {
        self.ad_check(node, offset)?;
        let op = self.ad_start(node, offset, atomic, [a, b])?;
        let r = self.wait_op(op, 8);
        let data = self.ext.borrow_mut().get_data.remove(&op);
        r?;
        Ok(data.map_or(0, |d| {
            u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
        }))
    }

    /// gex_AD_OpNBI_U64 for non-fetching operations: completes with the implicit puts
    /// (`wait_syncnbi_puts`/`_all`, or an access region).
    pub fn ad_op_nbi(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        a: u64,
        b: u64,
    ) -> Result<(), GasnetError> {
        if atomic.fetches() {
            return Err(GasnetError::FetchingNbi);
        }
        self.ad_check(node, offset)?;
        // Outside an access region the conduit may count it instead of tracking an op.
        if self.ext.borrow().open_region.is_none()
            && self
                .core
                .conduit
                .atomic_implicit(node, offset, atomic, [a, b])?
        {
            return Ok(());
        }
        let op = self.ad_start(node, offset, atomic, [a, b])?;
        self.ext.borrow_mut().nbi_puts.push(op);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_refused() {
        for op in AdOp::ALL {
            assert_eq!(AdOp::from_code(op as u32), Some(op));
        }
        assert_eq!(AdOp::from_code(AdOp::ALL.len() as u32), None);
        assert_eq!(AdOp::from_code(u32::MAX), None);
    }

    #[test]
    fn apply_follows_gex_semantics() {
        assert_eq!(AdOp::Fcas.apply(5, 5, 9), 9);
        assert_eq!(
            AdOp::Cas.apply(5, 4, 9),
            5,
            "no store when the compare fails"
        );
        assert_eq!(AdOp::Sub.apply(1, 2, 0), u64::MAX, "wraps");
        assert_eq!(AdOp::Dec.apply(0, 0, 0), u64::MAX);
        assert_eq!(AdOp::Fmin.apply(3, 7, 0), 3);
        assert_eq!(AdOp::Max.apply(3, 7, 0), 7);
        assert_eq!(AdOp::Mult.apply(u64::MAX, 2, 0), u64::MAX - 1);
        assert!(AdOp::Fxor.fetches() && !AdOp::Xor.fetches() && AdOp::Swap.fetches());
    }

    #[test]
    fn the_portals_mapping_computes_what_apply_computes() {
        // Run each mapped Portals operation through the engine's own semantics.
        let (old, a, b) = (0x0123_4567_89ab_cdefu64, 0x00ff_00ff_1234_0001u64, 77u64);
        for op in AdOp::ALL {
            for (old, a) in [(old, a), (a, a), (3, 3)] {
                let p = op.portals(a, b);
                let mut word = old.to_le_bytes();
                let compare = match p.call {
                    PortalsCall::Swap { compare } => compare.to_le_bytes().to_vec(),
                    _ => Vec::new(),
                };
                // SAFETY: `word` is 8 writable bytes, one Uint64 element.
                unsafe {
                    crate::nic::portals::atomic::apply(
                        word.as_mut_ptr(),
                        p.op,
                        p.dt,
                        &p.operand.to_le_bytes(),
                        &compare,
                        None,
                    )
                }
                .unwrap();
                assert_eq!(u64::from_le_bytes(word), op.apply(old, a, b), "{op:?}");
                assert_eq!(
                    matches!(p.call, PortalsCall::Atomic),
                    !op.fetches() && !matches!(op, AdOp::Set | AdOp::Cas),
                    "{op:?}: non-fetching arithmetic needs no reply"
                );
            }
        }
    }
}
