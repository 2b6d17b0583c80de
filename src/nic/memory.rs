//! Registered memory: regions with bounds and permissions, and the endpoint table that maps a
//! job's rank to the regions its process registered.
//!
//! A region is memory shared with a client process (a memfd mapping in the daemon, a heap
//! buffer in tests). The owning process may read and write it concurrently, as with a hardware
//! NIC; atomics go through real CPU atomic instructions so they are coherent with the owner's.
//!
//! A region may also be memory the NIC reaches only by copying (a client's private pages, the
//! registration cache's regions): such a region serves as the local side of operations (the
//! source of a put, the landing place of a reply) but can hold no atomics, event rings or
//! list entries, because those need the bytes mapped here.

use rustc_hash::FxHashMap as HashMap;
use std::mem::MaybeUninit;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::wire::Status;

/// Memory a region lives in: mapped into this process (`ptr` is `Some`), or reached by copy
/// through `read_at`/`write_at`. Implementors of a mapped backing guarantee
/// `ptr()..ptr()+len()` stays mapped and 8-byte aligned at `ptr()` for their whole lifetime.
pub trait Backing: Send + Sync {
    fn ptr(&self) -> Option<*mut u8>;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `out.len()` bytes at `off` out of a backing that is not mapped (bounds checked by
    /// the caller), initialising all of `out` when it succeeds (so a datagram is filled
    /// without zeroing it first). `Status::Fault` when the memory is gone.
    fn read_at(&self, _off: usize, _out: &mut [MaybeUninit<u8>]) -> Result<(), Status> {
        Err(Status::Fault)
    }
    /// Copies `data` in at `off` of a backing that is not mapped.
    fn write_at(&self, _off: usize, _data: &[u8]) -> Result<(), Status> {
        Err(Status::Fault)
    }
    /// Whether the process this memory belongs to has exited (a copy that failed then tells
    /// of a dead process, not of a bad address).
    fn owner_gone(&self) -> bool {
        false
    }
}

/// Tests: `len` bytes of memory reached by copy that is gone (a process's unmapped pages):
/// nothing to point at, every copy faults.
#[cfg(test)]
pub struct GoneBacking(pub usize);

#[cfg(test)]
impl Backing for GoneBacking {
    fn ptr(&self) -> Option<*mut u8> {
        None
    }
    fn len(&self) -> usize {
        self.0
    }
}

/// Plain heap memory, for tests and simulations.
pub struct HeapBacking(Box<[AtomicU64]>);

impl HeapBacking {
    pub fn new(len: usize) -> Arc<HeapBacking> {
        Arc::new(HeapBacking(
            (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect(),
        ))
    }
}

impl Backing for HeapBacking {
    fn ptr(&self) -> Option<*mut u8> {
        Some(self.0.as_ptr() as *mut u8)
    }
    fn len(&self) -> usize {
        self.0.len() * 8
    }
}

/// Remote access rights of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Perms(pub u8);

impl Perms {
    pub const READ: Perms = Perms(1);
    pub const WRITE: Perms = Perms(2);
    pub const READ_WRITE: Perms = Perms(3);
    pub fn contains(self, other: Perms) -> bool {
        self.0 & other.0 == other.0
    }
}

/// A registered region: a window `[0, len)` of a backing with remote permissions.
#[derive(Clone)]
pub struct Region {
    backing: Arc<dyn Backing>,
    perms: Perms,
}

impl Region {
    pub fn new(backing: Arc<dyn Backing>, perms: Perms) -> Region {
        Region { backing, perms }
    }

    pub fn len(&self) -> usize {
        self.backing.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks `[off, off+len)` lies inside and `need` is granted.
    pub fn check(&self, off: u64, len: u64, need: Perms) -> Result<(), Status> {
        if !self.perms.contains(need) {
            return Err(Status::Permission);
        }
        match off.checked_add(len) {
            Some(end) if end <= self.len() as u64 => Ok(()),
            _ => Err(Status::OutOfBounds),
        }
    }

    /// Checks bounds only (the local side of an operation, owned by the caller).
    pub fn check_local(&self, off: u64, len: u64) -> Result<(), Status> {
        self.check(off, len, Perms(0))
    }

    /// Whether the bytes are mapped here (needed for atomics, event rings, list entries).
    pub fn is_mapped(&self) -> bool {
        self.backing.ptr().is_some()
    }

    /// A failed copy's status: `NoSuchEndpoint` when the process owning memory reached by copy
    /// has exited (its copies fail while it exits, before its pidfd says so), else `e`.
    fn why(&self, e: Status) -> Status {
        match e {
            Status::Fault if self.backing.owner_gone() => Status::NoSuchEndpoint,
            e => e,
        }
    }

    /// Copies `data` in at `off`. Bounds must have been checked (asserted); `Status::Fault` when
    /// memory reached by copy is unmapped, `NoSuchEndpoint` when its process exited.
    pub fn write(&self, off: u64, data: &[u8]) -> Result<(), Status> {
        assert!(
            off as usize + data.len() <= self.len(),
            "write past a checked region"
        );
        let Some(base) = self.backing.ptr() else {
            return self
                .backing
                .write_at(off as usize, data)
                .map_err(|e| self.why(e));
        };
        // SAFETY: in bounds (asserted); the backing stays mapped while `self` holds it. The owner
        // process may touch these bytes concurrently, which is the contract of NIC memory.
        // `copy` (memmove): a put from a rank to itself may overlap.
        unsafe { std::ptr::copy(data.as_ptr(), base.add(off as usize), data.len()) }
        Ok(())
    }

    /// Appends the bytes at `[off, off+len)` to `out`, copied once whatever the backing. Bounds
    /// must have been checked (asserted); on a failure (`Status::Fault`: memory reached by copy
    /// unmapped; `NoSuchEndpoint`: its process exited), `out` is left as it was.
    ///
    /// Never a borrowed slice: the owner may write these bytes while the NIC reads them, as
    /// under a hardware NIC's DMA, and a `&[u8]` over them would promise Rust they cannot
    /// change. The copy goes through raw pointers, so what is read is whatever bytes were there.
    pub fn append_to(&self, off: u64, len: usize, out: &mut Vec<u8>) -> Result<(), Status> {
        assert!(
            off as usize + len <= self.len(),
            "read past a checked region"
        );
        let at = out.len();
        match self.backing.ptr() {
            Some(base) => {
                out.reserve(len);
                // SAFETY: the source is in bounds (asserted) and mapped for the lifetime of
                // `self`; the destination is `out`'s spare capacity (reserved above), which
                // cannot overlap NIC memory; the copy initialises the `len` bytes `set_len`
                // then exposes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        base.add(off as usize),
                        out.as_mut_ptr().add(at),
                        len,
                    );
                    out.set_len(at + len);
                }
                Ok(())
            }
            None => {
                out.reserve(len);
                self.backing
                    .read_at(off as usize, &mut out.spare_capacity_mut()[..len])
                    .map_err(|e| self.why(e))?;
                // SAFETY: read_at initialised these `len` bytes of spare capacity.
                unsafe { out.set_len(at + len) };
                Ok(())
            }
        }
    }

    /// Where `[off, off+len)` is mapped, for a reader that takes raw pointers (a datagram
    /// sealed straight from it, see `Transport::push_op_mapped`); `None` for memory reached
    /// by copy. Bounds must have been checked (asserted). The pointer is valid while `self`
    /// lives; the owner may write the bytes meanwhile, as with [`Region::append_to`].
    pub fn mapped_for_read(&self, off: u64, len: usize) -> Option<*const u8> {
        assert!(
            off as usize + len <= self.len(),
            "read past a checked region"
        );
        // SAFETY: in bounds (asserted) of a mapping that lives as long as `self`.
        self.backing
            .ptr()
            .map(|base| unsafe { base.add(off as usize) } as *const u8)
    }

    /// A copy of the bytes at `[off, off+len)` (tests and diagnostics).
    ///
    /// # Panics
    /// Out of bounds, or memory reached by copy that is gone.
    pub fn to_vec(&self, off: u64, len: usize) -> Vec<u8> {
        let mut v = Vec::new();
        self.append_to(off, len, &mut v)
            .expect("to_vec() of memory that is gone");
        v
    }

    /// Where `[off, off+len)` is mapped, for atomics applied in place: bounds checked, and
    /// `Status::Permission` on a region reached by copy.
    pub fn mapped_at(&self, off: u64, len: u64) -> Result<*mut u8, Status> {
        self.check_local(off, len)?;
        let base = self.backing.ptr().ok_or(Status::Permission)?;
        // SAFETY: in bounds (checked).
        Ok(unsafe { base.add(off as usize) })
    }

    /// The 64-bit word at `off` for an atomic operation: 8-byte aligned and in bounds, or an error.
    pub fn atomic(&self, off: u64, need: Perms) -> Result<&AtomicU64, Status> {
        self.check(off, 8, need)?;
        if !off.is_multiple_of(8) {
            return Err(Status::BadRequest);
        }
        let p = self.mapped_at(off, 8)?;
        // SAFETY: in bounds, 8-aligned (the backing base is 8-aligned), mapped while `self` lives.
        Ok(unsafe { &*(p as *const AtomicU64) })
    }
}

/// What one process (rank of a job) has registered at this host.
pub struct Endpoint {
    /// Opaque id of the daemon session this endpoint belongs to.
    pub session: u64,
    /// Region handles index this; a deregistered handle stays `None` and is never reused.
    pub regions: Vec<Option<Region>>,
}

impl Endpoint {
    pub fn region(&self, id: u32) -> Result<&Region, Status> {
        self.regions
            .get(id as usize)
            .and_then(|r| r.as_ref())
            .ok_or(Status::NoSuchRegion)
    }
}

/// (job, rank) → endpoint, for the processes attached to this host.
#[derive(Default)]
pub struct Endpoints {
    map: HashMap<(u32, u32), Endpoint>,
}

impl Endpoints {
    pub fn insert(&mut self, job: u32, rank: u32, session: u64) -> bool {
        if self.map.contains_key(&(job, rank)) {
            return false;
        }
        self.map.insert(
            (job, rank),
            Endpoint {
                session,
                regions: Vec::new(),
            },
        );
        true
    }

    pub fn remove(&mut self, job: u32, rank: u32) -> Option<Endpoint> {
        self.map.remove(&(job, rank))
    }

    pub fn get(&self, job: u32, rank: u32) -> Result<&Endpoint, Status> {
        self.map.get(&(job, rank)).ok_or(Status::NoSuchEndpoint)
    }

    pub fn get_mut(&mut self, job: u32, rank: u32) -> Option<&mut Endpoint> {
        self.map.get_mut(&(job, rank))
    }

    pub fn region(&self, job: u32, rank: u32, id: u32) -> Result<&Region, Status> {
        self.get(job, rank)?.region(id)
    }

    /// Registers a region for an endpoint; returns its handle.
    pub fn register(&mut self, job: u32, rank: u32, region: Region) -> Result<u32, Status> {
        let ep = self
            .map
            .get_mut(&(job, rank))
            .ok_or(Status::NoSuchEndpoint)?;
        ep.regions.push(Some(region));
        Ok((ep.regions.len() - 1) as u32)
    }

    pub fn deregister(&mut self, job: u32, rank: u32, id: u32) -> Result<(), Status> {
        let ep = self
            .map
            .get_mut(&(job, rank))
            .ok_or(Status::NoSuchEndpoint)?;
        match ep.regions.get_mut(id as usize) {
            Some(r @ Some(_)) => {
                *r = None;
                Ok(())
            }
            _ => Err(Status::NoSuchRegion),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_permissions() {
        let r = Region::new(HeapBacking::new(64), Perms::READ);
        assert_eq!(r.check(0, 64, Perms::READ), Ok(()));
        assert_eq!(r.check(1, 64, Perms::READ), Err(Status::OutOfBounds));
        assert_eq!(r.check(u64::MAX, 2, Perms::READ), Err(Status::OutOfBounds));
        assert_eq!(r.check(0, 1, Perms::WRITE), Err(Status::Permission));
        assert_eq!(r.atomic(4, Perms::READ).err(), Some(Status::BadRequest));
        assert_eq!(r.atomic(64, Perms::READ).err(), Some(Status::OutOfBounds));
    }

    #[test]
    fn handles_are_never_reused() {
        let mut e = Endpoints::default();
        assert!(e.insert(1, 0, 7));
        let a = e
            .register(1, 0, Region::new(HeapBacking::new(8), Perms::READ))
            .unwrap();
        e.deregister(1, 0, a).unwrap();
        let b = e
            .register(1, 0, Region::new(HeapBacking::new(8), Perms::READ))
            .unwrap();
        assert_ne!(a, b);
        assert_eq!(e.region(1, 0, a).err(), Some(Status::NoSuchRegion));
        assert_eq!(e.region(2, 0, b).err(), Some(Status::NoSuchEndpoint));
    }
}
