//! Portals atomic operations over every datatype, executed element by element on target memory.
//!
//! Each naturally aligned element of 1, 2, 4 or 8 bytes (integers, FLOAT, DOUBLE, FLOAT_COMPLEX)
//! is updated with a compare-and-swap loop on the CPU atomic of its width, so NIC atomics are
//! coherent with the owner process's own atomics on the same words. DOUBLE_COMPLEX (16 bytes)
//! and unaligned elements are updated without a CPU atomic: no portable 16-byte atomic exists,
//! and the daemon's single event loop already serialises NIC-side atomics.
//!
//! Conditional swaps compare the operand with the target: `CSWAP_LT` swaps when
//! `operand < target`, and so on. `MSWAP` stores `(data & mask) | (target & !mask)` with the
//! operand as mask.

use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum AtomicOp {
    Min = 0,
    Max,
    Sum,
    Prod,
    Lor,
    Land,
    Bor,
    Band,
    Lxor,
    Bxor,
    Swap,
    Cswap,
    CswapNe,
    CswapLe,
    CswapLt,
    CswapGe,
    CswapGt,
    Mswap,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Datatype {
    Int8 = 0,
    Uint8,
    Int16,
    Uint16,
    Int32,
    Uint32,
    Int64,
    Uint64,
    Float,
    Double,
    FloatComplex,
    DoubleComplex,
}

impl AtomicOp {
    pub const ALL: [AtomicOp; 18] = [
        AtomicOp::Min,
        AtomicOp::Max,
        AtomicOp::Sum,
        AtomicOp::Prod,
        AtomicOp::Lor,
        AtomicOp::Land,
        AtomicOp::Bor,
        AtomicOp::Band,
        AtomicOp::Lxor,
        AtomicOp::Bxor,
        AtomicOp::Swap,
        AtomicOp::Cswap,
        AtomicOp::CswapNe,
        AtomicOp::CswapLe,
        AtomicOp::CswapLt,
        AtomicOp::CswapGe,
        AtomicOp::CswapGt,
        AtomicOp::Mswap,
    ];

    pub fn from_u8(v: u8) -> Option<AtomicOp> {
        AtomicOp::ALL.get(v as usize).copied()
    }

    /// Swap-family ops take an operand (comparand or mask) and belong to PtlSwap.
    pub fn is_swap(self) -> bool {
        matches!(
            self,
            AtomicOp::Swap
                | AtomicOp::Cswap
                | AtomicOp::CswapNe
                | AtomicOp::CswapLe
                | AtomicOp::CswapLt
                | AtomicOp::CswapGe
                | AtomicOp::CswapGt
                | AtomicOp::Mswap
        )
    }

    /// Whether this op is defined on this datatype.
    pub fn supports(self, dt: Datatype) -> bool {
        use AtomicOp::*;
        let int = dt.is_integer();
        let complex = matches!(dt, Datatype::FloatComplex | Datatype::DoubleComplex);
        match self {
            Sum | Prod | Swap | Cswap | CswapNe => true,
            Min | Max | CswapLe | CswapLt | CswapGe | CswapGt => !complex,
            Lor | Land | Bor | Band | Lxor | Bxor | Mswap => int,
        }
    }
}

impl Datatype {
    pub const ALL: [Datatype; 12] = [
        Datatype::Int8,
        Datatype::Uint8,
        Datatype::Int16,
        Datatype::Uint16,
        Datatype::Int32,
        Datatype::Uint32,
        Datatype::Int64,
        Datatype::Uint64,
        Datatype::Float,
        Datatype::Double,
        Datatype::FloatComplex,
        Datatype::DoubleComplex,
    ];

    pub fn from_u8(v: u8) -> Option<Datatype> {
        Datatype::ALL.get(v as usize).copied()
    }

    pub fn size(self) -> usize {
        match self {
            Datatype::Int8 | Datatype::Uint8 => 1,
            Datatype::Int16 | Datatype::Uint16 => 2,
            Datatype::Int32 | Datatype::Uint32 | Datatype::Float => 4,
            Datatype::Int64 | Datatype::Uint64 | Datatype::Double | Datatype::FloatComplex => 8,
            Datatype::DoubleComplex => 16,
        }
    }

    pub fn is_integer(self) -> bool {
        (self as u8) <= Datatype::Uint64 as u8
    }
}

/// Why an atomic could not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicError {
    /// The op is not defined on the datatype.
    Unsupported,
    /// Lengths are not whole elements, or the operand is missing.
    BadLength,
}

/// The new value of one element, or `None` to leave it unchanged (a failed conditional swap).
/// Values travel as little-endian bit patterns of the element's width.
fn combine(op: AtomicOp, dt: Datatype, t: u64, d: u64, o: u64) -> Option<u64> {
    use AtomicOp::*;
    macro_rules! int {
        ($ty:ty, $w:expr) => {{
            let (tv, dv, ov) = (t as $ty, d as $ty, o as $ty);
            let r: $ty = match op {
                Min => tv.min(dv),
                Max => tv.max(dv),
                Sum => tv.wrapping_add(dv),
                Prod => tv.wrapping_mul(dv),
                Lor => ((tv != 0) || (dv != 0)) as $ty,
                Land => ((tv != 0) && (dv != 0)) as $ty,
                Lxor => ((tv != 0) ^ (dv != 0)) as $ty,
                Bor => tv | dv,
                Band => tv & dv,
                Bxor => tv ^ dv,
                Swap => dv,
                Mswap => (dv & ov) | (tv & !ov),
                Cswap => return (ov == tv).then_some(d & $w),
                CswapNe => return (ov != tv).then_some(d & $w),
                CswapLe => return (ov <= tv).then_some(d & $w),
                CswapLt => return (ov < tv).then_some(d & $w),
                CswapGe => return (ov >= tv).then_some(d & $w),
                CswapGt => return (ov > tv).then_some(d & $w),
            };
            Some((r as u64) & $w)
        }};
    }
    macro_rules! float {
        ($ty:ty, $bits:ty, $w:expr) => {{
            let tv = <$ty>::from_bits(t as $bits);
            let dv = <$ty>::from_bits(d as $bits);
            let ov = <$ty>::from_bits(o as $bits);
            let r: $ty = match op {
                Min => tv.min(dv),
                Max => tv.max(dv),
                Sum => tv + dv,
                Prod => tv * dv,
                Swap => dv,
                Cswap => return (ov == tv).then_some(d & $w),
                CswapNe => return (ov != tv).then_some(d & $w),
                CswapLe => return (ov <= tv).then_some(d & $w),
                CswapLt => return (ov < tv).then_some(d & $w),
                CswapGe => return (ov >= tv).then_some(d & $w),
                CswapGt => return (ov > tv).then_some(d & $w),
                _ => unreachable!("checked by supports()"),
            };
            Some(r.to_bits() as u64 & $w)
        }};
    }
    match dt {
        Datatype::Int8 => int!(i8, 0xff),
        Datatype::Uint8 => int!(u8, 0xff),
        Datatype::Int16 => int!(i16, 0xffff),
        Datatype::Uint16 => int!(u16, 0xffff),
        Datatype::Int32 => int!(i32, 0xffff_ffff),
        Datatype::Uint32 => int!(u32, 0xffff_ffff),
        Datatype::Int64 => int!(i64, u64::MAX),
        Datatype::Uint64 => int!(u64, u64::MAX),
        Datatype::Float => float!(f32, u32, 0xffff_ffff),
        Datatype::Double => float!(f64, u64, u64::MAX),
        Datatype::FloatComplex => {
            let split = |v: u64| (f32::from_bits(v as u32), f32::from_bits((v >> 32) as u32));
            let join = |(re, im): (f32, f32)| re.to_bits() as u64 | ((im.to_bits() as u64) << 32);
            let (tv, dv, ov) = (split(t), split(d), split(o));
            Some(join(match op {
                Sum => (tv.0 + dv.0, tv.1 + dv.1),
                Prod => (tv.0 * dv.0 - tv.1 * dv.1, tv.0 * dv.1 + tv.1 * dv.0),
                Swap => dv,
                Cswap => return (ov == tv).then_some(d),
                CswapNe => return (ov != tv).then_some(d),
                _ => unreachable!("checked by supports()"),
            }))
        }
        Datatype::DoubleComplex => {
            unreachable!("16-byte elements go through combine_complex_double")
        }
    }
}

fn combine_complex_double(op: AtomicOp, t: [f64; 2], d: [f64; 2], o: [f64; 2]) -> Option<[f64; 2]> {
    match op {
        AtomicOp::Sum => Some([t[0] + d[0], t[1] + d[1]]),
        AtomicOp::Prod => Some([t[0] * d[0] - t[1] * d[1], t[0] * d[1] + t[1] * d[0]]),
        AtomicOp::Swap => Some(d),
        AtomicOp::Cswap => (o == t).then_some(d),
        AtomicOp::CswapNe => (o != t).then_some(d),
        _ => unreachable!("checked by supports()"),
    }
}

fn load_le(b: &[u8]) -> u64 {
    let mut v = [0u8; 8];
    v[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(v)
}

/// Applies `op` element-wise to `len = data.len()` bytes of target memory at `target`.
/// `operand` is the comparand or mask of swap-family ops (one element). The previous values are
/// written to `fetched` when given (fetching atomics and swaps).
///
/// # Safety
/// `target..target+data.len()` must be valid, mapped memory for the duration of the call (it
/// may be concurrently accessed through atomics by its owner).
pub unsafe fn apply(
    target: *mut u8,
    op: AtomicOp,
    dt: Datatype,
    data: &[u8],
    operand: &[u8],
    mut fetched: Option<&mut [u8]>,
) -> Result<(), AtomicError> {
    if !op.supports(dt) {
        return Err(AtomicError::Unsupported);
    }
    let w = dt.size();
    if !data.len().is_multiple_of(w) || (op.is_swap() && op != AtomicOp::Swap && operand.len() < w)
    {
        return Err(AtomicError::BadLength);
    }
    if fetched.as_ref().is_some_and(|f| f.len() < data.len()) {
        return Err(AtomicError::BadLength);
    }
    let o = if operand.len() >= w {
        &operand[..w]
    } else {
        &[][..]
    };
    for (i, d) in data.chunks_exact(w).enumerate() {
        let p = target.add(i * w);
        let old = if w == 16 {
            // SAFETY (caller): 16 valid bytes at p.
            let mut cur = [0u8; 16];
            std::ptr::copy_nonoverlapping(p, cur.as_mut_ptr(), 16);
            let f = |b: &[u8]| {
                [
                    f64::from_le_bytes(b[..8].try_into().expect("8")),
                    f64::from_le_bytes(b[8..16].try_into().expect("8")),
                ]
            };
            let ov = if o.is_empty() { [0.0; 2] } else { f(o) };
            if let Some(n) = combine_complex_double(op, f(&cur), f(d), ov) {
                let mut nb = [0u8; 16];
                nb[..8].copy_from_slice(&n[0].to_le_bytes());
                nb[8..].copy_from_slice(&n[1].to_le_bytes());
                std::ptr::copy_nonoverlapping(nb.as_ptr(), p, 16);
            }
            cur
        } else {
            let dv = load_le(d);
            let ov = if o.is_empty() { 0 } else { load_le(o) };
            let old = if (p as usize).is_multiple_of(w) {
                native(p, w, op, dt, dv)
                    .unwrap_or_else(|| cas_loop(p, w, |t| combine(op, dt, t, dv, ov)))
            } else {
                let mut cur = [0u8; 8];
                std::ptr::copy_nonoverlapping(p, cur.as_mut_ptr(), w);
                let t = u64::from_le_bytes(cur);
                if let Some(n) = combine(op, dt, t, dv, ov) {
                    std::ptr::copy_nonoverlapping(n.to_le_bytes().as_ptr(), p, w);
                }
                t
            };
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&old.to_le_bytes());
            b
        };
        if let Some(f) = fetched.as_deref_mut() {
            f[i * w..(i + 1) * w].copy_from_slice(&old[..w]);
        }
    }
    Ok(())
}

/// The operations the CPU has one read-modify-write instruction for, on integers: one
/// exclusive access to the line instead of a load and a compare-and-swap (a random-update
/// stream pays a cache miss per word). Returns the old value, or `None` for the others.
unsafe fn native(p: *mut u8, w: usize, op: AtomicOp, dt: Datatype, d: u64) -> Option<u64> {
    if matches!(
        dt,
        Datatype::Float | Datatype::Double | Datatype::FloatComplex | Datatype::DoubleComplex
    ) {
        return None;
    }
    macro_rules! run {
        ($a:ty, $t:ty) => {{
            // SAFETY (caller): p is aligned for $a and valid.
            let a = &*(p as *const $a);
            let d = d as $t;
            let old = match op {
                AtomicOp::Sum => a.fetch_add(d, Ordering::SeqCst),
                AtomicOp::Bor => a.fetch_or(d, Ordering::SeqCst),
                AtomicOp::Band => a.fetch_and(d, Ordering::SeqCst),
                AtomicOp::Bxor => a.fetch_xor(d, Ordering::SeqCst),
                AtomicOp::Swap => a.swap(d, Ordering::SeqCst),
                _ => return None,
            };
            Some(old as u64)
        }};
    }
    match w {
        1 => run!(AtomicU8, u8),
        2 => run!(AtomicU16, u16),
        4 => run!(AtomicU32, u32),
        8 => run!(AtomicU64, u64),
        _ => None,
    }
}

/// Compare-and-swap loop on the naturally aligned `w`-byte atomic at `p`; returns the old value.
unsafe fn cas_loop(p: *mut u8, w: usize, f: impl Fn(u64) -> Option<u64>) -> u64 {
    macro_rules! run {
        ($a:ty, $t:ty) => {{
            // SAFETY (caller): p is aligned for $a and valid.
            let a = &*(p as *const $a);
            let mut cur = a.load(Ordering::SeqCst);
            loop {
                let Some(n) = f(cur as u64) else {
                    return cur as u64;
                };
                match a.compare_exchange_weak(cur, n as $t, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(_) => return cur as u64,
                    Err(x) => cur = x,
                }
            }
        }};
    }
    match w {
        1 => run!(AtomicU8, u8),
        2 => run!(AtomicU16, u16),
        4 => run!(AtomicU32, u32),
        _ => run!(AtomicU64, u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The reference model: the same definitions, element by element on plain values.
    fn model(op: AtomicOp, dt: Datatype, t: &[u8], d: &[u8], o: &[u8]) -> Vec<u8> {
        let w = dt.size();
        let mut out = t.to_vec();
        for i in 0..d.len() / w {
            let r = i * w..(i + 1) * w;
            let new: Option<Vec<u8>> = match dt {
                Datatype::Float => model_f32(op, &t[r.clone()], &d[r.clone()], o),
                Datatype::Double => model_f64(op, &t[r.clone()], &d[r.clone()], o),
                Datatype::FloatComplex | Datatype::DoubleComplex => None, // checked separately
                _ => model_int(op, dt, &t[r.clone()], &d[r.clone()], o),
            };
            if let Some(n) = new {
                out[r].copy_from_slice(&n);
            }
        }
        out
    }

    /// Integers modelled exactly in i128 (signed or unsigned as the datatype says), then
    /// wrapped to the element width: independent of the implementation's per-type code.
    fn model_int(op: AtomicOp, dt: Datatype, t: &[u8], d: &[u8], o: &[u8]) -> Option<Vec<u8>> {
        let w = t.len();
        let bits = (w * 8) as u32;
        let signed = matches!(
            dt,
            Datatype::Int8 | Datatype::Int16 | Datatype::Int32 | Datatype::Int64
        );
        let val = |b: &[u8]| -> i128 {
            let mut v = [0u8; 16];
            v[..w].copy_from_slice(&b[..w]);
            let u = u128::from_le_bytes(v);
            if signed && (u >> (bits - 1)) & 1 == 1 {
                u as i128 - (1i128 << bits)
            } else {
                u as i128
            }
        };
        let mask = if bits == 128 {
            u128::MAX
        } else {
            (1u128 << bits) - 1
        };
        let wrap = |v: i128| -> Vec<u8> { ((v as u128) & mask).to_le_bytes()[..w].to_vec() };
        let (tv, dv) = (val(t), val(d));
        let ov = if o.len() >= w { val(o) } else { 0 };
        let truth = |b: bool| b as i128;
        let r = match op {
            AtomicOp::Min => tv.min(dv),
            AtomicOp::Max => tv.max(dv),
            AtomicOp::Sum => tv + dv,
            AtomicOp::Prod => tv.wrapping_mul(dv),
            AtomicOp::Lor => truth(tv != 0 || dv != 0),
            AtomicOp::Land => truth(tv != 0 && dv != 0),
            AtomicOp::Lxor => truth((tv != 0) != (dv != 0)),
            AtomicOp::Bor => tv | dv,
            AtomicOp::Band => tv & dv,
            AtomicOp::Bxor => tv ^ dv,
            AtomicOp::Swap => dv,
            AtomicOp::Mswap => (dv & ov) | (tv & !ov),
            AtomicOp::Cswap => return (ov == tv).then(|| wrap(dv)),
            AtomicOp::CswapNe => return (ov != tv).then(|| wrap(dv)),
            AtomicOp::CswapLe => return (ov <= tv).then(|| wrap(dv)),
            AtomicOp::CswapLt => return (ov < tv).then(|| wrap(dv)),
            AtomicOp::CswapGe => return (ov >= tv).then(|| wrap(dv)),
            AtomicOp::CswapGt => return (ov > tv).then(|| wrap(dv)),
        };
        Some(wrap(r))
    }

    /// The floating-point ops on values widened to f64 (for f32 the same as computing in f32:
    /// one sum or product of two f32 rounds alike either way); `None`: nothing stored.
    fn model_float(op: AtomicOp, tv: f64, dv: f64, ov: f64) -> Option<f64> {
        match op {
            AtomicOp::Min => Some(tv.min(dv)),
            AtomicOp::Max => Some(tv.max(dv)),
            AtomicOp::Sum => Some(tv + dv),
            AtomicOp::Prod => Some(tv * dv),
            AtomicOp::Swap => Some(dv),
            AtomicOp::Cswap => (ov == tv).then_some(dv),
            AtomicOp::CswapNe => (ov != tv).then_some(dv),
            AtomicOp::CswapLe => (ov <= tv).then_some(dv),
            AtomicOp::CswapLt => (ov < tv).then_some(dv),
            AtomicOp::CswapGe => (ov >= tv).then_some(dv),
            AtomicOp::CswapGt => (ov > tv).then_some(dv),
            _ => unreachable!(),
        }
    }

    fn model_f64(op: AtomicOp, t: &[u8], d: &[u8], o: &[u8]) -> Option<Vec<u8>> {
        let f = |b: &[u8]| f64::from_le_bytes(b[..8].try_into().unwrap());
        let ov = if o.len() >= 8 { f(o) } else { 0.0 };
        model_float(op, f(t), f(d), ov).map(|r| r.to_le_bytes().to_vec())
    }

    fn model_f32(op: AtomicOp, t: &[u8], d: &[u8], o: &[u8]) -> Option<Vec<u8>> {
        let f = |b: &[u8]| f32::from_le_bytes(b[..4].try_into().unwrap()) as f64;
        let ov = if o.len() >= 4 { f(o) } else { 0.0 };
        model_float(op, f(t), f(d), ov).map(|r| (r as f32).to_le_bytes().to_vec())
    }

    /// Small values (so that sums, products and comparisons exercise interesting cases) as the
    /// raw little-endian bytes of `dt`.
    fn sample(rng: &mut impl Rng, dt: Datatype, n: usize) -> Vec<u8> {
        let mut v = Vec::new();
        for _ in 0..n {
            let x: i8 = rng.gen_range(-4..=4);
            match dt {
                Datatype::Float => v.extend_from_slice(&(x as f32 * 0.5).to_le_bytes()),
                Datatype::Double => v.extend_from_slice(&(x as f64 * 0.5).to_le_bytes()),
                Datatype::FloatComplex => {
                    v.extend_from_slice(&(x as f32).to_le_bytes());
                    v.extend_from_slice(&((x / 2) as f32).to_le_bytes());
                }
                Datatype::DoubleComplex => {
                    v.extend_from_slice(&(x as f64).to_le_bytes());
                    v.extend_from_slice(&((x / 2) as f64).to_le_bytes());
                }
                _ => v.extend_from_slice(&(x as i64).to_le_bytes()[..dt.size()]),
            }
        }
        v
    }

    #[test]
    fn every_op_and_datatype_matches_the_reference_model() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(42);
        let mut checked = 0;
        for dt in Datatype::ALL {
            for op in AtomicOp::ALL {
                if !op.supports(dt) {
                    let mut t = vec![0u8; 16];
                    let r = unsafe {
                        apply(
                            t.as_mut_ptr(),
                            op,
                            dt,
                            &vec![0; dt.size()],
                            &vec![0; dt.size()],
                            None,
                        )
                    };
                    assert_eq!(r, Err(AtomicError::Unsupported), "{op:?} on {dt:?}");
                    continue;
                }
                for round in 0..50 {
                    let n = if op.is_swap() && op != AtomicOp::Swap {
                        1
                    } else {
                        1 + round % 4
                    };
                    let target0 = sample(&mut rng, dt, n);
                    // Comparands often equal the target so that conditional swaps do swap.
                    let operand = if round % 2 == 0 {
                        target0[..dt.size()].to_vec()
                    } else {
                        sample(&mut rng, dt, 1)
                    };
                    let data = sample(&mut rng, dt, n);
                    // An aligned buffer: u64 backing.
                    let mut backing = vec![0u64; target0.len().div_ceil(8) + 1];
                    let p = backing.as_mut_ptr() as *mut u8;
                    unsafe { std::ptr::copy_nonoverlapping(target0.as_ptr(), p, target0.len()) };
                    let mut fetched = vec![0u8; data.len()];
                    unsafe { apply(p, op, dt, &data, &operand, Some(&mut fetched)).unwrap() };
                    let got = unsafe { std::slice::from_raw_parts(p, target0.len()) }.to_vec();
                    assert_eq!(fetched, target0, "{op:?} {dt:?} fetches the old values");
                    let want = match dt {
                        Datatype::FloatComplex | Datatype::DoubleComplex => {
                            complex_model(op, dt, &target0, &data, &operand)
                        }
                        _ => model(op, dt, &target0, &data, &operand),
                    };
                    assert_eq!(
                        got, want,
                        "{op:?} {dt:?} t={target0:?} d={data:?} o={operand:?}"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked > 5000);
    }

    fn complex_model(op: AtomicOp, dt: Datatype, t: &[u8], d: &[u8], o: &[u8]) -> Vec<u8> {
        let w = dt.size();
        let h = w / 2;
        let get = |b: &[u8]| -> (f64, f64) {
            if h == 4 {
                (
                    f32::from_le_bytes(b[..4].try_into().unwrap()) as f64,
                    f32::from_le_bytes(b[4..8].try_into().unwrap()) as f64,
                )
            } else {
                (
                    f64::from_le_bytes(b[..8].try_into().unwrap()),
                    f64::from_le_bytes(b[8..16].try_into().unwrap()),
                )
            }
        };
        let put = |v: (f64, f64)| -> Vec<u8> {
            if h == 4 {
                [(v.0 as f32).to_le_bytes(), (v.1 as f32).to_le_bytes()].concat()
            } else {
                [v.0.to_le_bytes(), v.1.to_le_bytes()].concat()
            }
        };
        let mut out = t.to_vec();
        for i in 0..d.len() / w {
            let (tv, dv, ov) = (get(&t[i * w..]), get(&d[i * w..]), get(o));
            let n = match op {
                AtomicOp::Sum => Some((tv.0 + dv.0, tv.1 + dv.1)),
                AtomicOp::Prod => Some((tv.0 * dv.0 - tv.1 * dv.1, tv.0 * dv.1 + tv.1 * dv.0)),
                AtomicOp::Swap => Some(dv),
                AtomicOp::Cswap => (ov == tv).then_some(dv),
                AtomicOp::CswapNe => (ov != tv).then_some(dv),
                _ => unreachable!(),
            };
            if let Some(n) = n {
                out[i * w..(i + 1) * w].copy_from_slice(&put(n));
            }
        }
        out
    }

    #[test]
    fn concurrent_sums_are_atomic_with_the_owner() {
        let word = std::sync::Arc::new(AtomicU64::new(0));
        let w2 = word.clone();
        let owner = std::thread::spawn(move || {
            for _ in 0..100_000 {
                w2.fetch_add(1, Ordering::SeqCst);
            }
        });
        let p = word.as_ptr() as *mut u8;
        for _ in 0..100_000 {
            unsafe {
                apply(
                    p,
                    AtomicOp::Sum,
                    Datatype::Uint64,
                    &1u64.to_le_bytes(),
                    &[],
                    None,
                )
                .unwrap()
            };
        }
        owner.join().unwrap();
        assert_eq!(word.load(Ordering::SeqCst), 200_000);
    }

    #[test]
    fn bad_lengths_are_refused() {
        let mut t = [0u64; 2];
        let p = t.as_mut_ptr() as *mut u8;
        assert_eq!(
            unsafe { apply(p, AtomicOp::Sum, Datatype::Int32, &[1, 2, 3], &[], None) },
            Err(AtomicError::BadLength)
        );
        assert_eq!(
            unsafe {
                apply(
                    p,
                    AtomicOp::Cswap,
                    Datatype::Int32,
                    &[1, 2, 3, 4],
                    &[],
                    None,
                )
            },
            Err(AtomicError::BadLength)
        );
    }
}
