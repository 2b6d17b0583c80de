//! How a conduit cuts a payload it copies into bounce memory for the NIC: a first piece small
//! enough that the NIC starts sending after a short copy, then pieces doubling up to a
//! largest, so that a stream takes few operations. Each piece is put as soon as it is copied:
//! the copy of the next overlaps the sending of this one (measured, docs/performance.md,
//! stop 52: a blocking 1 MiB put over the portals conduit 158 µs in whole-MiB pieces, 130–137
//! in 128 KiB ones; doubling pieces against equal ones, 4 MiB put_nbi over the extoll conduit,
//! medians of four rounds, 5804 → 6499 and 6200 → 6845 MB/s).

/// The first piece of a copied payload.
pub const FIRST: usize = 128 * 1024;

/// The largest piece the conduits cut a copied payload into.
pub const PIECE_MAX: usize = 1 << 20;

/// A conduit's bounce area: two largest pieces in flight (one sent while the next is copied),
/// no more, presumably so that what the rank copies in is still cached when the NIC seals it.
/// Measured (docs/performance.md stop 62), portals conduit put_nbi 1 MiB / 4 MiB, six rounds:
/// 8 MiB 2429 / 2493 MB/s, 4 MiB 2641 / 2732, 2 MiB 2864 / 3004 (every round faster than
/// 8 MiB), one piece 2960 / 2163.
pub const BOUNCE_LEN: usize = 2 * PIECE_MAX;

/// The pieces `(offset, length)` of a payload of `len` bytes: two of `first`, then each twice
/// the one before, up to `max` (`first` = `max`: equal pieces; no piece is empty but for an
/// empty payload's one, which its target still hears of). A piece ends at the payload's end,
/// on a multiple of `max` (the growing piece whose successor would cross one runs up to it),
/// or on a whole number of `quantum`s.
///
/// `quantum`: the data one datagram carries (1: any length). `first` is rounded down to whole
/// datagrams, so the growing pieces leave no partly filled datagram behind: at 128 KiB over
/// loopback (64,864 bytes a datagram) each took a third datagram of 1,344 bytes, sent on its
/// own before the next piece came (docs/performance.md, stop 76). The full pieces stay `max`,
/// so that they tile a staging area of whole `max`es: 1 MiB pieces rounded down to datagrams
/// left gaps in the bounce ring that shallowed the pipeline (4 MiB put_nbi 5% slower). A
/// quantum above `max` is ignored.
pub fn pieces(len: usize, first: usize, max: usize, quantum: usize) -> Cuts {
    let max = max.max(1);
    let q = if quantum == 0 || quantum > max {
        1
    } else {
        quantum
    };
    Cuts {
        len,
        at: 0,
        next: (first / q * q).max(q).min(max),
        max,
        taken: 0,
    }
}

/// The iterator of [`pieces`] (not the portals conduit's `Pieces`, which keeps where each
/// piece of an operation lies in bounce memory).
#[derive(Debug, Clone)]
pub struct Cuts {
    len: usize,
    at: usize,
    next: usize,
    max: usize,
    taken: usize,
}

impl Iterator for Cuts {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        if self.at >= self.len && (self.taken > 0 || self.len > 0) {
            return None;
        }
        let to_bound = self.max - self.at % self.max;
        let mut n = self.next.min(to_bound);
        // The piece after this one is twice it from the third on (the first two are equal);
        // if that one would cross the boundary, this one runs up to it.
        let doubles = self.taken >= 1;
        let after = if doubles { 2 * n } else { n };
        if n + after > to_bound {
            n = to_bound;
        }
        let n = n.min(self.len - self.at);
        let piece = (self.at, n);
        self.at += n;
        self.taken += 1;
        if doubles {
            self.next = (n * 2).min(self.max).max(1);
        }
        Some(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_first_then_doubling() {
        let k = FIRST;
        let sizes: Vec<usize> = pieces(4 << 20, FIRST, 1 << 20, 1).map(|p| p.1).collect();
        assert_eq!(sizes, [k, k, 2 * k, 4 * k, 8 * k, 8 * k, 8 * k]);
        assert_eq!(pieces(0, FIRST, 1 << 20, 1).collect::<Vec<_>>(), [(0, 0)]);
        assert_eq!(pieces(10, FIRST, 1 << 20, 1).collect::<Vec<_>>(), [(0, 10)]);
        let equal: Vec<usize> = pieces(3 << 20, 1 << 20, 1 << 20, 1).map(|p| p.1).collect();
        assert_eq!(equal, [1 << 20; 3]);
    }

    #[test]
    fn whole_datagrams_but_the_last() {
        // Loopback: 64,864 bytes of put data a datagram.
        let (q, m) = (64_864, 1 << 20);
        let sizes: Vec<usize> = pieces(256 << 10, FIRST, m, q).map(|p| p.1).collect();
        assert_eq!(sizes, [2 * q, 2 * q, (256 << 10) - 4 * q]);
        // The last growing piece runs to the MiB; full pieces follow.
        let sizes: Vec<usize> = pieces(3 << 20, FIRST, m, q).map(|p| p.1).collect();
        assert_eq!(sizes, [2 * q, 2 * q, 4 * q, m - 8 * q, m, m]);
        // A quantum above the first piece makes the first piece one quantum.
        assert_eq!(pieces(m, 1000, m, 1400).next(), Some((0, 1400)));
        // One that fits nowhere is ignored.
        assert_eq!(
            pieces(10, 4, 8, 9).map(|p| p.1).collect::<Vec<_>>(),
            [4, 4, 2]
        );
        assert_eq!(
            pieces(20, 4, 8, 9).map(|p| p.1).collect::<Vec<_>>(),
            [4, 4, 8, 4]
        );
    }

    proptest! {
        /// The pieces tile the payload in order, none empty unless the payload is, none above
        /// the largest.
        #[test]
        fn pieces_tile_the_payload(
            len in 0usize..(20 << 20),
            first_k in 1usize..4,
            max_k in 4usize..16,
            quantum in prop_oneof![Just(1usize), 1usize..70_000, Just(64_864usize)],
        ) {
            let max = FIRST * max_k;
            let mut at = 0;
            let mut count = 0;
            for (off, n) in pieces(len, FIRST * first_k, max, quantum) {
                prop_assert_eq!(off, at);
                prop_assert!(n <= max && (n > 0 || len == 0));
                // No piece crosses a multiple of `max` (full pieces tile the staging area)…
                prop_assert!(n == 0 || off / max == (off + n - 1) / max);
                // …and one that ends elsewhere than there or at the end fills whole datagrams.
                let end = off + n;
                if end < len && end % max != 0 {
                    prop_assert_eq!(n % quantum, 0);
                }
                at += n;
                count += 1;
            }
            prop_assert_eq!(at, len);
            prop_assert!(count >= 1);
        }
    }
}
