//! The registration cache (seed 001 §3.2): page-rounded registrations of a PE's own memory,
//! found again by address so that registering (or using as the local side of an operation)
//! memory already registered costs no trip to the daemon. Pure bookkeeping: the caller does
//! the registering and releasing it is told to.
//!
//! Two kinds of entries: `mem_register`ed ones, remotely accessible and counted (released
//! when the last registration of them is undone), and local-side ones (the source of a BTE
//! put, the landing place of a get, outside the symmetric segments), kept after use and
//! evicted least recently used when more than [`LOCAL_ENTRIES`] are held.

/// Registration granularity.
pub const PAGE: u64 = 4096;
/// Local-side registrations kept for reuse.
pub const LOCAL_ENTRIES: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub lo: u64,
    pub hi: u64,
    pub handle: u32,
    /// `mem_register` calls not yet undone (remote entries); 0 for local-side entries.
    pub refs: u32,
    pub remote: bool,
    used: u64,
}

/// Hit and miss counts of the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
}

#[derive(Debug, Default)]
pub struct RegCache {
    entries: Vec<Entry>,
    clock: u64,
    pub stats: CacheStats,
}

/// `[addr, addr+len)` rounded out to pages; `None` when it wraps.
pub fn pages(addr: u64, len: u64) -> Option<(u64, u64)> {
    let lo = addr / PAGE * PAGE;
    let hi = addr
        .checked_add(len.max(1))?
        .checked_next_multiple_of(PAGE)?;
    Some((lo, hi))
}

impl RegCache {
    /// An entry covering `[addr, addr+len)` (a remote one when `remote`; a local-side use may
    /// take either kind). Counts a hit and marks it used.
    pub fn lookup(&mut self, addr: u64, len: u64, remote: bool) -> Option<Entry> {
        self.clock += 1;
        let end = addr.checked_add(len)?;
        let clock = self.clock;
        let e = self
            .entries
            .iter_mut()
            .find(|e| (e.remote || !remote) && e.lo <= addr && end <= e.hi)?;
        e.used = clock;
        if remote {
            e.refs += 1;
        }
        self.stats.hits += 1;
        Some(*e)
    }

    /// Records a fresh registration (a miss); returns the handles of local-side entries to
    /// release now that the cache holds too many (never one `busy` says operations use).
    pub fn insert(
        &mut self,
        lo: u64,
        hi: u64,
        handle: u32,
        remote: bool,
        busy: impl Fn(u32) -> bool,
    ) -> Vec<u32> {
        self.clock += 1;
        self.stats.misses += 1;
        self.entries.push(Entry {
            lo,
            hi,
            handle,
            refs: remote as u32,
            remote,
            used: self.clock,
        });
        let mut out = Vec::new();
        while self.entries.iter().filter(|e| !e.remote).count() > LOCAL_ENTRIES {
            let Some(i) = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| !e.remote && !busy(e.handle))
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            out.push(self.entries.swap_remove(i).handle);
        }
        out
    }

    /// The remote entry with `handle`.
    pub fn remote_entry(&self, handle: u32) -> Option<&Entry> {
        self.entries.iter().find(|e| e.remote && e.handle == handle)
    }

    /// Undoes one registration of the remote entry `handle`; `Some(true)` when it is the
    /// last (the caller releases it), `None` when no such entry exists.
    pub fn unregister(&mut self, handle: u32) -> Option<bool> {
        let i = self
            .entries
            .iter()
            .position(|e| e.remote && e.handle == handle)?;
        self.entries[i].refs -= 1;
        if self.entries[i].refs == 0 {
            self.entries.swap_remove(i);
            return Some(true);
        }
        Some(false)
    }

    /// The address the registration `handle` starts at.
    pub fn base_of(&self, handle: u32) -> Option<u64> {
        self.entries
            .iter()
            .find(|e| e.handle == handle)
            .map(|e| e.lo)
    }

    /// Every handle held (to release at finalize).
    pub fn drain(&mut self) -> Vec<u32> {
        self.entries.drain(..).map(|e| e.handle).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_misses_refcounts_and_eviction() {
        let mut c = RegCache::default();
        assert_eq!(pages(4097, 10), Some((4096, 8192)));
        assert_eq!(pages(u64::MAX - 2, 8), None);
        assert!(c.lookup(4096, 8, true).is_none());
        assert!(c.insert(4096, 12288, 7, true, |_| false).is_empty());
        // Inside it: a hit, counted twice now.
        assert_eq!(c.lookup(8000, 100, true).unwrap().handle, 7);
        // A local-side use may take the remote entry.
        assert_eq!(c.lookup(4100, 8, false).unwrap().handle, 7);
        assert_eq!(c.stats, CacheStats { hits: 2, misses: 1 });
        assert_eq!(c.unregister(7), Some(false));
        assert_eq!(c.unregister(7), Some(true));
        assert_eq!(c.unregister(7), None);
        // Local entries beyond the budget are evicted least recently used first.
        for i in 0..LOCAL_ENTRIES as u64 {
            assert!(c
                .insert(i * PAGE * 2, i * PAGE * 2 + PAGE, i as u32, false, |_| {
                    false
                })
                .is_empty());
        }
        c.lookup(0, 8, false).unwrap(); // entry 0 used again
        assert_eq!(
            c.insert(1 << 40, (1 << 40) + PAGE, 999, false, |h| h == 1),
            vec![2],
            "1 is busy"
        );
    }
}
