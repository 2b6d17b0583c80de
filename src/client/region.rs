//! Registered memory as a process holds it: a shared mapping the daemon also maps, named by a
//! handle that is the same on every rank that registered in the same order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::nic::memory::Perms;
use crate::shm::Mapping;

/// A region's handle; the same on every rank that registered in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemHandle(pub u32);

/// Registered memory, shared with the daemon (and through it with the job).
#[derive(Clone)]
pub struct MemRegion {
    pub handle: MemHandle,
    map: Arc<Mapping>,
    len: usize,
}

impl MemRegion {
    pub(super) fn new(handle: MemHandle, map: Arc<Mapping>, len: usize) -> MemRegion {
        MemRegion { handle, map, len }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }
    /// The region's bytes. Remote puts and AMOs may change them at any time (that is the
    /// point); synchronise through flags or atomics as with any NIC memory.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes(&self) -> &mut [u8] {
        // SAFETY: the mapping lives as long as self; concurrent remote writes are the contract.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr(), self.len) }
    }
    /// The 8-byte word at `off` (8-aligned), for atomics coherent with the NIC's AMOs.
    pub fn word(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "word offset {off} unaligned or out of range"
        );
        // SAFETY: aligned, in bounds, mapped while self lives.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) }
    }
    /// Reads the u64 at `off` (volatile: it may be changed by remote puts).
    pub fn read_u64(&self, off: usize) -> u64 {
        self.word(off).load(Ordering::Acquire)
    }
    /// This region as the NIC's memory model sees it (for rings shared with the NIC).
    pub fn nic_region(&self) -> crate::nic::memory::Region {
        crate::nic::memory::Region::new(self.map.clone(), Perms::READ_WRITE)
    }

    /// The offset of `[p, p+len)` in this region, if it lies inside.
    pub fn contains(&self, p: *const u8, len: usize) -> Option<u64> {
        let base = self.map.as_ptr() as usize;
        let a = p as usize;
        (a >= base && a + len <= base + self.len).then(|| (a - base) as u64)
    }
}
