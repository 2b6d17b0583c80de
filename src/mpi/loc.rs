//! MINLOC and MAXLOC: reductions over (value, index) pairs (MPI_2INT, MPI_FLOAT_INT,
//! MPI_DOUBLE_INT, MPI_LONG_INT, MPI_SHORT_INT). A pair travels and sits in window memory as
//! the C struct `{ value; int index; }` does: the index at the next 4-byte boundary after
//! the value, padded (with zeros) to the value's alignment.

use super::coll::Type;

/// One (value, index) pair.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Loc<V> {
    pub value: V,
    pub index: i32,
}

/// Which of MINLOC and MAXLOC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LocOp {
    Min,
    Max,
}

impl<V: Type + PartialOrd> Loc<V> {
    const INDEX_AT: usize = std::mem::size_of::<V>().next_multiple_of(4);
    /// Bytes per pair in a buffer or a window.
    pub const SIZE: usize =
        (Self::INDEX_AT + 4).next_multiple_of(if std::mem::align_of::<V>() > 4 {
            std::mem::align_of::<V>()
        } else {
            4
        });

    /// The pairs in their C layout.
    pub fn encode(pairs: &[Loc<V>]) -> Vec<u8> {
        let mut out = vec![0u8; pairs.len() * Self::SIZE];
        for (p, b) in pairs.iter().zip(out.chunks_mut(Self::SIZE)) {
            b[..std::mem::size_of::<V>()].copy_from_slice(super::coll::bytes(&[p.value]));
            b[Self::INDEX_AT..Self::INDEX_AT + 4].copy_from_slice(&p.index.to_le_bytes());
        }
        out
    }

    /// Pairs from their C layout (`b` holds `out.len()` of them).
    pub fn decode(b: &[u8], out: &mut [Loc<V>]) {
        for (p, c) in out.iter_mut().zip(b.chunks(Self::SIZE)) {
            *p = Self::one(c);
        }
    }

    fn one(c: &[u8]) -> Loc<V> {
        let mut v = [V::default()];
        super::coll::bytes_mut(&mut v).copy_from_slice(&c[..std::mem::size_of::<V>()]);
        Loc {
            value: v[0],
            index: i32::from_le_bytes(c[Self::INDEX_AT..Self::INDEX_AT + 4].try_into().unwrap()),
        }
    }

    /// `acc = acc op other` pair by pair, in C layout: the smaller (MINLOC) or larger
    /// (MAXLOC) value, and on a tie the smaller index, as MPI defines them.
    pub(super) fn combine(acc: &mut [u8], other: &[u8], op: LocOp) {
        for (a, o) in acc.chunks_mut(Self::SIZE).zip(other.chunks(Self::SIZE)) {
            let (x, y) = (Self::one(a), Self::one(o));
            let take = match op {
                LocOp::Min => y.value < x.value,
                LocOp::Max => y.value > x.value,
            } || (y.value == x.value && y.index < x.index);
            if take {
                a.copy_from_slice(o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_take_the_c_layout_and_ties_go_to_the_smaller_index() {
        assert_eq!(Loc::<f64>::SIZE, 16);
        assert_eq!(Loc::<i32>::SIZE, 8);
        assert_eq!(Loc::<i16>::SIZE, 8);
        assert_eq!(Loc::<i64>::SIZE, 16);
        let a = [
            Loc {
                value: 3.0,
                index: 7,
            },
            Loc {
                value: 1.0,
                index: 9,
            },
        ];
        let b = [
            Loc {
                value: 3.0,
                index: 2,
            },
            Loc {
                value: 5.0,
                index: 0,
            },
        ];
        let mut acc = Loc::encode(&a);
        Loc::<f64>::combine(&mut acc, &Loc::encode(&b), LocOp::Min);
        let mut out = [Loc::default(); 2];
        Loc::decode(&acc, &mut out);
        assert_eq!(
            out,
            [
                Loc {
                    value: 3.0,
                    index: 2
                },
                Loc {
                    value: 1.0,
                    index: 9
                }
            ]
        );
        let mut acc = Loc::encode(&a);
        Loc::<f64>::combine(&mut acc, &Loc::encode(&b), LocOp::Max);
        Loc::decode(&acc, &mut out);
        assert_eq!(
            out,
            [
                Loc {
                    value: 3.0,
                    index: 2
                },
                Loc {
                    value: 5.0,
                    index: 0
                }
            ]
        );
    }
}
