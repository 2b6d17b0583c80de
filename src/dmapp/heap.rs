//! The symmetric heap's region allocator (seed 001 §2.2.6, §3.2): deterministic first-fit
//! over offsets, so every PE that makes the same calls in the same order gets the same
//! offsets, which is what makes the heap symmetric. Pure bookkeeping; the bytes live in a
//! region registered at init.

use std::collections::BTreeMap;

/// Blocks start on this boundary (room for any DMAPP type, and a cache line apart).
pub const ALIGN: u64 = 64;

#[derive(Debug)]
pub struct Heap {
    /// Free runs: offset → length, coalesced.
    free: BTreeMap<u64, u64>,
    /// Allocated blocks: offset → length (rounded).
    used: BTreeMap<u64, u64>,
}

impl Heap {
    pub fn new(len: u64) -> Heap {
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, len);
        }
        Heap {
            free,
            used: BTreeMap::new(),
        }
    }

    fn round(size: u64) -> Option<u64> {
        size.max(1).checked_next_multiple_of(ALIGN)
    }

    /// First fit; `None` when no free run holds `size` bytes.
    pub fn malloc(&mut self, size: u64) -> Option<u64> {
        let need = Self::round(size)?;
        let (&off, &len) = self.free.iter().find(|(_, &l)| l >= need)?;
        self.free.remove(&off);
        if len > need {
            self.free.insert(off + need, len - need);
        }
        self.used.insert(off, need);
        Some(off)
    }

    /// The length of the block at `off`, if one starts there.
    pub fn block(&self, off: u64) -> Option<u64> {
        self.used.get(&off).copied()
    }

    /// Frees the block at `off`; `false` when no block starts there.
    pub fn free(&mut self, off: u64) -> bool {
        let Some(len) = self.used.remove(&off) else {
            return false;
        };
        self.give_back(off, len);
        true
    }

    fn give_back(&mut self, mut off: u64, mut len: u64) {
        if let Some((&next, &nlen)) = self.free.range(off + len..).next() {
            if next == off + len {
                self.free.remove(&next);
                len += nlen;
            }
        }
        if let Some((&prev, &plen)) = self.free.range(..off).next_back() {
            if prev + plen == off {
                self.free.remove(&prev);
                off = prev;
                len += plen;
            }
        }
        self.free.insert(off, len);
    }

    /// Resizes the block at `off`: in place when it shrinks or the run after it is free,
    /// else a new block (the caller moves the contents and the old block is freed). Returns
    /// the block's offset; `None` (nothing changed) when it starts no block or no room.
    pub fn realloc(&mut self, off: u64, size: u64) -> Option<u64> {
        let cur = *self.used.get(&off)?;
        let need = Self::round(size)?;
        if need <= cur {
            if need < cur {
                self.used.insert(off, need);
                self.give_back(off + need, cur - need);
            }
            return Some(off);
        }
        if let Some(&next) = self.free.get(&(off + cur)) {
            if cur + next >= need {
                self.free.remove(&(off + cur));
                if cur + next > need {
                    self.free.insert(off + need, cur + next - need);
                }
                self.used.insert(off, need);
                return Some(off);
            }
        }
        let new = self.malloc(size)?;
        self.free(off);
        Some(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_calls_same_offsets_and_runs_coalesce() {
        let run = || {
            let mut h = Heap::new(1 << 20);
            let a = h.malloc(100).unwrap();
            let b = h.malloc(8).unwrap();
            let c = h.malloc(4096).unwrap();
            assert!(h.free(b));
            let d = h.malloc(8).unwrap();
            (a, b, c, d, h)
        };
        let (a, b, c, d, mut h) = run();
        assert_eq!((a, b, c, d), (0, 128, 192, 128));
        let again = run();
        assert_eq!(
            (again.0, again.1, again.2, again.3),
            (a, b, c, d),
            "deterministic"
        );
        assert!(!h.free(5), "not a block");
        for x in [a, c, d] {
            assert!(h.free(x));
        }
        assert_eq!(h.malloc(1 << 20), Some(0), "everything coalesced back");
        assert_eq!(h.malloc(1), None, "exhausted");
    }

    #[test]
    fn realloc_grows_in_place_or_moves() {
        let mut h = Heap::new(4096);
        let a = h.malloc(64).unwrap();
        assert_eq!(h.realloc(a, 256), Some(a), "the run after it was free");
        let b = h.malloc(64).unwrap();
        let moved = h.realloc(a, 512).unwrap();
        assert!(moved != a && moved > b, "moved past b");
        assert_eq!(h.block(a), None);
        assert_eq!(h.realloc(moved, 64), Some(moved), "shrinks in place");
        assert_eq!(h.realloc(moved, 1 << 20), None, "no room: unchanged");
        assert_eq!(h.block(moved), Some(64));
    }
}
