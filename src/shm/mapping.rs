//! memfd-backed shared mappings.
//!
//! The creator seals the memfd against shrinking before handing it over, and the receiver
//! insists on that seal: otherwise a hostile process could truncate the file under the daemon
//! and turn the daemon's next access into SIGBUS.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{
    fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, memfd_create, MemfdFlags, SealFlags,
};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

use crate::nic::memory::Backing;

/// A shared read-write mapping of a whole memfd.
pub struct Mapping {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; concurrent access is the NIC memory contract and
// all synchronisation goes through atomics placed in it.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Creates, sizes, seals and maps a new memfd of `len` bytes (rounded up to a page).
    pub fn create(name: &str, len: usize) -> io::Result<Mapping> {
        let len = len.max(1).next_multiple_of(4096);
        let fd = memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        ftruncate(&fd, len as u64)?;
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        Self::map(fd, len)
    }

    /// Maps a memfd received from another process, after checking its seals and size.
    pub fn from_fd(fd: OwnedFd, min_len: usize, max_len: usize) -> io::Result<Mapping> {
        let seals = fcntl_get_seals(&fd)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "memfd is not sealed against shrinking",
            ));
        }
        let len = fstat(&fd)?.st_size as usize;
        if len < min_len || len > max_len || !len.is_multiple_of(4096) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("memfd size {len} outside {min_len}..={max_len}"),
            ));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of a sealed file; we own it until Drop.
        let p = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        let ptr =
            NonNull::new(p as *mut u8).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { fd, ptr, len })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole mapping as a byte slice. The other process may change it at any time.
    ///
    /// # Safety
    /// The caller must not create overlapping `&mut` views and must tolerate concurrent change.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.as_ptr(), self.len)
    }
}

impl Backing for Mapping {
    fn ptr(&self) -> Option<*mut u8> {
        Some(self.as_ptr())
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped.
        unsafe {
            let _ = munmap(self.ptr.as_ptr() as *mut _, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsealed_memfd_is_refused() {
        let fd = memfd_create("t", MemfdFlags::CLOEXEC).unwrap();
        ftruncate(&fd, 4096).unwrap();
        assert!(Mapping::from_fd(fd, 0, 1 << 20).is_err());
    }

    #[test]
    fn shared_between_two_mappings() {
        let a = Mapping::create("t", 100).unwrap();
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = Mapping::from_fd(fd, 4096, 4096).unwrap();
        unsafe { a.slice_mut()[7] = 42 };
        assert_eq!(unsafe { b.slice_mut()[7] }, 42);
    }
}
