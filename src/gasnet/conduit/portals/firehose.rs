//! The registration cache for local buffers outside the segment, in the manner of Firehose:
//! page-granular registrations, kept after use and found again by address (LRU), neighbours
//! coalesced into one, idle ones evicted when the budget of registered bytes or regions is
//! spent. The cache itself is bookkeeping; a [`Registrar`] does what it says with the NIC
//! (the GASNet portals conduit and MPI each have one).
//!
//! A registration here is a process region (the daemon reaches the pages by copy, by virtual
//! address, at the time of each access), so a buffer freed and reallocated at the same
//! address needs no invalidation: the cache can never hand out stale pages.

/// Registration granularity.
pub const PAGE: u64 = 4096;

/// What the conduit holds for one registered range: the daemon's region and the MD over it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    pub region: u32,
    pub md: u32,
}

/// A buffer found in (or just added to) the cache: release `id` when the operation is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Use {
    pub id: u64,
    pub reg: Registration,
    /// The buffer's offset in the registration.
    pub offset: u64,
}

/// A miss: register `[start, end)`, after releasing `release` (coalesced and evicted entries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Miss {
    pub start: u64,
    pub end: u64,
    pub release: Vec<Registration>,
}

use crate::client::{MemHandle, NicError};
use crate::gasnet::conduit::FirehoseStats;
use crate::nic::memory::Perms;
use crate::portals::{Md, NiHandle, Portals, PortalsError};

struct Entry {
    id: u64,
    start: u64,
    end: u64,
    reg: Registration,
    /// Operations using it; a busy entry is never released.
    busy: u32,
    used: u64,
}

pub struct Firehose {
    entries: Vec<Entry>,
    clock: u64,
    next_id: u64,
    max_bytes: u64,
    max_entries: usize,
    pub stats: FirehoseStats,
}

impl Firehose {
    /// A cache of at most `max_bytes` registered bytes in `max_entries` regions, not counting
    /// busy ones (which may exceed both until released).
    pub fn new(max_bytes: u64, max_entries: usize) -> Firehose {
        Firehose {
            entries: Vec::new(),
            clock: 0,
            next_id: 0,
            max_bytes,
            max_entries: max_entries.max(1),
            stats: FirehoseStats::default(),
        }
    }

    fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.end - e.start).sum()
    }

    /// A registration covering `[addr, addr+len)`, if there is one (marked busy).
    pub fn lookup(&mut self, addr: u64, len: u64) -> Option<Use> {
        let end = addr.checked_add(len)?;
        self.clock += 1;
        let e = self
            .entries
            .iter_mut()
            .find(|e| e.start <= addr && end <= e.end)?;
        e.busy += 1;
        e.used = self.clock;
        self.stats.hits += 1;
        Some(Use {
            id: e.id,
            reg: e.reg,
            offset: addr - e.start,
        })
    }

    /// What to register for `[addr, addr+len)` after a failed lookup: the pages it touches,
    /// grown over idle registrations it overlaps or abuts (which are released), then least
    /// recently used idle ones released while the budget is exceeded. `None` when the range
    /// wraps the address space.
    pub fn plan(&mut self, addr: u64, len: u64) -> Option<Miss> {
        let mut start = addr / PAGE * PAGE;
        let mut end = addr.checked_add(len)?.checked_next_multiple_of(PAGE)?;
        self.stats.misses += 1;
        let mut release = Vec::new();
        // Coalesce to a fixed point: a merge may reach further neighbours.
        while let Some(i) = self
            .entries
            .iter()
            .position(|e| e.busy == 0 && e.start <= end && start <= e.end)
        {
            let e = self.entries.swap_remove(i);
            start = start.min(e.start);
            end = end.max(e.end);
            release.push(e.reg);
            self.stats.coalesced += 1;
        }
        let need = end - start;
        while self.bytes() + need > self.max_bytes || self.entries.len() >= self.max_entries {
            let Some(i) = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.busy == 0)
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break; // everything left is busy
            };
            release.push(self.entries.swap_remove(i).reg);
            self.stats.evicted += 1;
        }
        Some(Miss {
            start,
            end,
            release,
        })
    }

    /// Records the registration of `[start, end)` (a planned miss, or part of one), busy for
    /// the buffer at `addr`.
    pub fn insert(&mut self, start: u64, end: u64, reg: Registration, addr: u64) -> Use {
        self.clock += 1;
        self.next_id += 1;
        self.entries.push(Entry {
            id: self.next_id,
            start,
            end,
            reg,
            busy: 1,
            used: self.clock,
        });
        Use {
            id: self.next_id,
            reg,
            offset: addr - start,
        }
    }

    /// An operation using `id` finished.
    pub fn release(&mut self, id: u64) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.id == id) {
            e.busy = e.busy.saturating_sub(1);
        }
    }
}

/// How one user of the cache registers a range with the NIC: a process region with `perms`
/// and an MD over it with `md_options`, events to `eq`.
#[derive(Debug, Clone, Copy)]
pub struct Registrar {
    pub perms: Perms,
    pub md_options: u32,
    pub eq: Option<u32>,
}

impl Registrar {
    fn register(
        &self,
        p: &mut Portals,
        ni: NiHandle,
        start: u64,
        end: u64,
    ) -> Result<Registration, PortalsError> {
        let region = p
            .endpoint()
            .client()
            .register_process(start, end - start, self.perms)
            .map_err(NicError::from)?;
        let md = Md {
            region: MemHandle(region),
            segments: vec![(0, end - start)],
            options: self.md_options,
            eq: self.eq,
            ct: None,
        };
        match p.md_bind(ni, &md) {
            Ok(md) => Ok(Registration { region, md }),
            Err(e) => {
                let _ = p.endpoint().client().deregister(region);
                Err(e)
            }
        }
    }

    /// Gives up a registration the cache released.
    pub fn unregister(&self, p: &mut Portals, ni: NiHandle, r: Registration) {
        let _ = p.md_release(ni, r.md);
        let _ = p.endpoint().client().deregister(r.region);
    }

    /// Carries out `miss` (planned for the buffer `[addr, addr+len)`): releases what it
    /// gave up, registers its range — or, when that fails, the buffer's own pages (a range
    /// coalesced with idle neighbours may reach memory freed since they were registered) —
    /// and records it in `fh`. The error is the own pages' registration's.
    pub fn register_miss(
        &self,
        fh: &mut Firehose,
        p: &mut Portals,
        ni: NiHandle,
        miss: Miss,
        (addr, len): (u64, u64),
    ) -> Result<Use, PortalsError> {
        for r in &miss.release {
            self.unregister(p, ni, *r);
        }
        let own = (addr / PAGE * PAGE, (addr + len).next_multiple_of(PAGE));
        let planned = (miss.start, miss.end);
        let (start, end, reg) = match self.register(p, ni, planned.0, planned.1) {
            Ok(reg) => (planned.0, planned.1, reg),
            Err(_) if planned != own => (own.0, own.1, self.register(p, ni, own.0, own.1)?),
            Err(e) => return Err(e),
        };
        Ok(fh.insert(start, end, reg, addr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reg(n: u32) -> Registration {
        Registration { region: n, md: n }
    }

    /// Looks `[a, a+len)` up, registering on a miss as the conduit does.
    fn acquire(f: &mut Firehose, n: &mut u32, a: u64, len: u64) -> (Use, Vec<Registration>) {
        if let Some(u) = f.lookup(a, len) {
            return (u, Vec::new());
        }
        let m = f.plan(a, len).unwrap();
        *n += 1;
        (f.insert(m.start, m.end, reg(*n), a), m.release)
    }

    #[test]
    fn a_buffer_is_found_again_and_pages_are_the_unit() {
        let mut f = Firehose::new(1 << 30, 16);
        let mut n = 0;
        let (u, _) = acquire(&mut f, &mut n, 0x10_010, 100);
        assert_eq!(u.offset, 0x10);
        f.release(u.id);
        // Another buffer on the same page: a hit, at its own offset.
        let (v, _) = acquire(&mut f, &mut n, 0x10_800, 0x700);
        assert_eq!((v.reg, v.offset), (u.reg, 0x800));
        assert_eq!((f.stats.hits, f.stats.misses), (1, 1));
    }

    #[test]
    fn neighbours_coalesce_into_one_registration() {
        let mut f = Firehose::new(1 << 30, 16);
        let mut n = 0;
        let (a, _) = acquire(&mut f, &mut n, 0, PAGE);
        let (b, _) = acquire(&mut f, &mut n, 2 * PAGE, PAGE);
        f.release(a.id);
        f.release(b.id);
        // The page between them joins both: one registration of three pages remains.
        let (c, released) = acquire(&mut f, &mut n, PAGE, PAGE);
        assert_eq!(released.len(), 2);
        assert_eq!(c.offset, PAGE);
        assert!(f.lookup(0, 3 * PAGE).is_some());
        assert_eq!(f.entries.len(), 1);
    }

    #[test]
    fn the_least_recently_used_idle_registration_goes_first_and_busy_ones_stay() {
        let mut f = Firehose::new(3 * PAGE, 16);
        let mut n = 0;
        let (a, _) = acquire(&mut f, &mut n, 0, PAGE);
        let _busy = acquire(&mut f, &mut n, 10 * PAGE, PAGE);
        let (c, _) = acquire(&mut f, &mut n, 20 * PAGE, PAGE);
        f.release(a.id);
        f.release(c.id);
        let (d, _) = acquire(&mut f, &mut n, 20 * PAGE, 1); // c is now recent
        f.release(d.id);
        let (_, released) = acquire(&mut f, &mut n, 30 * PAGE, PAGE);
        assert_eq!(released, vec![a.reg], "a was idle longest; b is busy");
    }

    proptest! {
        /// Whatever the sequence: a registration covers the buffer it is used for, a busy one
        /// is never released, and after a miss the cache is within its budget unless only
        /// busy registrations are left to blame.
        #[test]
        fn covered_never_released_while_busy_and_within_budget(
            ops in proptest::collection::vec((0u64..64, 1u64..3 * PAGE, any::<bool>()), 1..200)
        ) {
            let (budget, max_entries) = (16 * PAGE, 6);
            let mut f = Firehose::new(budget, max_entries);
            let mut n = 0;
            let mut busy: Vec<Use> = Vec::new();
            for (page, len, keep) in ops {
                let a = page * PAGE + len % 97;
                let misses = f.stats.misses;
                let (u, released) = acquire(&mut f, &mut n, a, len);
                let e = f.entries.iter().find(|e| e.id == u.id).unwrap();
                prop_assert!(e.start <= a && a + len <= e.end && a - e.start == u.offset);
                for r in &released {
                    prop_assert!(busy.iter().all(|b| b.reg != *r), "released a busy registration");
                }
                if f.stats.misses > misses {
                    let all_busy = f.entries.iter().all(|e| e.busy > 0);
                    prop_assert!(f.bytes() <= budget || all_busy);
                    prop_assert!(f.entries.len() <= max_entries || all_busy);
                }
                busy.push(u);
                if !keep {
                    f.release(busy.remove(0).id);
                }
            }
        }
    }
}
