//! A client's private pages, reached by the daemon by copy (`process_vm_readv`/`writev`)
//! instead of through a shared mapping: what lets the registration cache hand the NIC any
//! buffer of the process without copying it into shared memory first.
//!
//! The daemon addresses the pages by virtual address at the moment of each access, so a
//! buffer freed and reallocated at the same address is simply the new buffer: a cached
//! registration can never go stale the way pinned pages under a hardware NIC can. Linux checks
//! ptrace access (same user, and Yama's rules where enabled: the client names the daemon as
//! its tracer). A pidfd taken when the client attached is checked before every access, so a
//! process that exited (its pid possibly reused by another) is never read or written.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use crate::nic::memory::Backing;
use crate::wire::Status;

/// `[addr, addr+len)` of process `pid`.
pub struct ProcessMemory {
    pid: libc::pid_t,
    /// The process as it was when it attached (readable once it exited).
    pidfd: Arc<OwnedFd>,
    addr: usize,
    len: usize,
}

/// A pidfd for `pid`, to tell later whether that very process still runs.
pub fn pidfd(pid: libc::pid_t) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid).ok_or(io::ErrorKind::InvalidInput)?;
    Ok(rustix::process::pidfd_open(
        pid,
        rustix::process::PidfdFlags::empty(),
    )?)
}

impl ProcessMemory {
    /// Checks the daemon may reach the first and last byte (access rights, mapped range).
    pub fn new(
        pid: libc::pid_t,
        pidfd: Arc<OwnedFd>,
        addr: u64,
        len: u64,
    ) -> io::Result<ProcessMemory> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_string());
        if len == 0 {
            return Err(bad("an empty range"));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| bad("the range wraps around"))?;
        let (addr, len) = (
            usize::try_from(addr).map_err(|_| bad("address out of range"))?,
            usize::try_from(len).map_err(|_| bad("length out of range"))?,
        );
        let m = ProcessMemory {
            pid,
            pidfd,
            addr,
            len,
        };
        let mut b = [0u8; 1];
        for off in [0, (end - 1) as usize - addr] {
            m.transfer(off, b.as_mut_ptr(), 1, false)?;
        }
        Ok(m)
    }

    /// Whether the process exited (its pidfd is readable then).
    fn exited(&self) -> io::Result<bool> {
        let fd = self.pidfd.as_fd();
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        Ok(rustix::event::poll(&mut fds, 0)? != 0)
    }

    /// Whether the process is on its way out: its address space is torn down (copies fail
    /// as from a bad address) before its pidfd says it exited. Asked only after a copy
    /// failed; the pidfd was checked first, so the pid still names this process.
    fn exiting(&self) -> bool {
        const PF_EXITING: u64 = 0x4;
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) else {
            return true;
        };
        // After the command name (which may hold anything): state, then flags 6 fields on.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let mut f = rest.split_whitespace();
        let state = f.next().unwrap_or("");
        let flags = f.nth(5).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
    }

    /// Moves `n` bytes between `local` and offset `off` of the remote range, resuming after
    /// partial transfers.
    fn transfer(&self, off: usize, local: *mut u8, n: usize, write: bool) -> io::Result<()> {
        if self.exited()? {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        let mut done = 0;
        while done < n {
            let l = libc::iovec {
                iov_base: unsafe { local.add(done) } as *mut libc::c_void,
                iov_len: n - done,
            };
            let r = libc::iovec {
                iov_base: (self.addr + off + done) as *mut libc::c_void,
                iov_len: n - done,
            };
            // SAFETY: `l` covers memory the caller owns for `n` bytes; the remote side is
            // checked by the kernel, which fails the call rather than touching anything else.
            let got = unsafe {
                if write {
                    libc::process_vm_writev(self.pid, &l, 1, &r, 1, 0)
                } else {
                    libc::process_vm_readv(self.pid, &l, 1, &r, 1, 0)
                }
            };
            match got {
                g if g > 0 => done += g as usize,
                0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                _ => return Err(io::Error::last_os_error()),
            }
        }
        Ok(())
    }
}

impl Backing for ProcessMemory {
    fn ptr(&self) -> Option<*mut u8> {
        None
    }
    fn len(&self) -> usize {
        self.len
    }
    fn read_at(&self, off: usize, out: &mut [MaybeUninit<u8>]) -> Result<(), Status> {
        // process_vm_readv writes every byte it reports; transfer resumes until all are.
        self.transfer(off, out.as_mut_ptr().cast(), out.len(), false)
            .map_err(|_| Status::Fault)
    }
    fn owner_gone(&self) -> bool {
        self.exited().unwrap_or(false) || self.exiting()
    }
    fn write_at(&self, off: usize, data: &[u8]) -> Result<(), Status> {
        // process_vm_writev only reads the local side.
        self.transfer(off, data.as_ptr() as *mut u8, data.len(), true)
            .map_err(|_| Status::Fault)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> (libc::pid_t, Arc<OwnedFd>) {
        let pid = std::process::id() as libc::pid_t;
        (pid, Arc::new(pidfd(pid).unwrap()))
    }

    #[test]
    fn reads_and_writes_this_process_by_copy() {
        let mut buf = vec![7u8; 10_000];
        let (me, fd) = me();
        let m = ProcessMemory::new(me, fd, buf.as_ptr() as u64, buf.len() as u64).unwrap();
        let mut out = [MaybeUninit::uninit(); 4];
        m.read_at(9_996, &mut out).unwrap();
        // SAFETY: read_at succeeded: every byte is initialised.
        assert_eq!(out.map(|b| unsafe { b.assume_init() }), [7; 4]);
        m.write_at(100, b"abc").unwrap();
        // The kernel wrote behind the compiler's back: read through a volatile view.
        let got: Vec<u8> = (100..103)
            .map(|i| unsafe { std::ptr::read_volatile(buf.as_mut_ptr().add(i)) })
            .collect();
        assert_eq!(got, b"abc");
    }

    #[test]
    fn unmapped_or_wrapping_ranges_are_refused() {
        let (me, fd) = me();
        let new = |a, l| ProcessMemory::new(me, fd.clone(), a, l);
        assert!(new(8, 4096).is_err(), "page 0 is never mapped");
        assert!(new(u64::MAX - 1, 4).is_err());
        assert!(new(4096, 0).is_err());
    }

    #[test]
    fn a_process_that_exited_is_never_touched_even_if_its_pid_is_reused() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let fd = Arc::new(pidfd(child.id() as libc::pid_t).unwrap());
        child.wait().unwrap();
        let buf = [0u8; 64];
        // The pid now names a live process (this one, as if reused); the pidfd knows better.
        let m = ProcessMemory {
            pid: std::process::id() as libc::pid_t,
            pidfd: fd,
            addr: buf.as_ptr() as usize,
            len: 64,
        };
        let mut out = [MaybeUninit::uninit(); 8];
        assert_eq!(m.read_at(0, &mut out), Err(Status::Fault));
        assert!(m.owner_gone(), "a copy that failed on it says why");
        // Through a region (every engine's way in), the failure names the process as gone.
        let r = crate::nic::memory::Region::new(Arc::new(m), crate::nic::memory::Perms::READ_WRITE);
        let mut v = Vec::new();
        assert_eq!(r.append_to(0, 8, &mut v), Err(Status::NoSuchEndpoint));
        assert!(v.is_empty());
        assert_eq!(r.write(0, b"x"), Err(Status::NoSuchEndpoint));
    }
}
