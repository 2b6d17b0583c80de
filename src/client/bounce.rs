//! A bounce region's allocator (the portals conduit's staged sources, the extoll conduit's
//! Long payloads, MPI's staged long receives): a ring. Space is taken at the head and given back in any order; the tail
//! moves past what was given back in allocation order. Pieces mostly finish in the order they
//! started, so the ring keeps the pipeline full without waiting for all of it to drain.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct Ring {
    len: u64,
    head: u64,
    /// Allocations from the oldest: (offset, length, given back).
    live: VecDeque<(u64, u64, bool)>,
}

impl Ring {
    pub fn new(len: usize) -> Ring {
        Ring {
            len: len as u64,
            head: 0,
            live: VecDeque::new(),
        }
    }

    /// `n` contiguous bytes, or `None` until more is given back (or ever, if `n` exceeds the
    /// ring).
    pub fn alloc(&mut self, n: usize) -> Option<u64> {
        // Zero bytes take one, so that no two live allocations share an offset.
        let n = n.max(1) as u64;
        let at = match self.live.front() {
            None => Some(0).filter(|_| n <= self.len),
            Some(&(tail, _, _)) if self.head > tail => {
                // Free: [head, len) and [0, tail).
                match self.head + n <= self.len {
                    true => Some(self.head),
                    false => Some(0).filter(|_| n <= tail),
                }
            }
            // Wrapped (or full): free is [head, tail).
            Some(&(tail, _, _)) => Some(self.head).filter(|_| self.head + n <= tail),
        }?;
        self.live.push_back((at, n, false));
        self.head = at + n;
        Some(at)
    }

    /// Whether some allocation is not given back yet.
    pub fn in_use(&self) -> bool {
        !self.live.is_empty()
    }

    /// Gives back the allocation at `at`.
    pub fn free(&mut self, at: u64) {
        if let Some(e) = self.live.iter_mut().find(|e| e.0 == at && !e.2) {
            e.2 = true;
        }
        while self.live.front().is_some_and(|e| e.2) {
            self.live.pop_front();
        }
        if self.live.is_empty() {
            self.head = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wraps_and_waits_for_the_oldest() {
        let mut r = Ring::new(100);
        assert_eq!((r.alloc(40), r.alloc(40)), (Some(0), Some(40)));
        assert_eq!(
            r.alloc(30),
            None,
            "20 left at the end, nothing at the start"
        );
        r.free(40);
        assert_eq!(r.alloc(30), None, "the oldest still holds the start");
        r.free(0);
        assert_eq!(r.alloc(30), Some(0), "all free again: from the start");
        assert_eq!(r.alloc(70), Some(30));
        assert_eq!(r.alloc(1), None);
        r.free(0);
        assert_eq!(r.alloc(20), Some(0), "wrapped into the freed start");
        assert_eq!(r.alloc(11), None);
        assert_eq!(r.alloc(101), None);
    }

    proptest! {
        /// Live allocations never overlap and stay inside the ring; a ring given everything
        /// back takes its whole length again.
        #[test]
        fn allocations_never_overlap(ops in proptest::collection::vec((0usize..40, any::<bool>(), 0usize..8), 1..300)) {
            let mut r = Ring::new(100);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (n, give, pick) in ops {
                if give && !live.is_empty() {
                    let (at, _) = live.remove(pick % live.len());
                    r.free(at);
                } else if let Some(at) = r.alloc(n) {
                    let n = n.max(1) as u64;
                    let end = at + n;
                    prop_assert!(end <= 100);
                    for &(a, l) in &live {
                        prop_assert!(end <= a || a + l <= at);
                    }
                    live.push((at, n));
                }
            }
            for (at, _) in live.drain(..) {
                r.free(at);
            }
            prop_assert_eq!(r.alloc(100), Some(0));
        }
    }
}
