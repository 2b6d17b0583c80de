//! RMA, EXTOLL's engine for bulk data (seed 004 §II; after librma2): puts and gets between a
//! local region and a remote **NLA** (network logical address), and **notifications** —
//! 16-byte entries in a queue in the process's registered memory, written by its NIC — that
//! tell each side when its part of an operation is done.
//!
//! An NLA names a byte of a registered region: the region's handle in the high 24 bits, the
//! offset in the low 40 ([`nla`], [`split_nla`]).
//!
//! Notification queue layout: the process's read counter at 0 (entries consumed, a `u64` it
//! publishes), the entries from [`ENTRIES_AT`]. Entry: word 0 `class u2 | command u2 | error
//! u4 | length u24 | peer rank u31 | phase (bit 63)`, word 1 the NLA. The NIC writes word 1,
//! then word 0 with release ordering; the phase bit flips every pass, as in a VELO mailbox.

use std::sync::atomic::Ordering;

use crate::nic::memory::{Perms, Region};
use crate::wire::Status;

pub const ENTRIES_AT: u64 = 64;
pub const ENTRY: u64 = 16;
/// Largest RMA operation (bytes).
pub const MAX_OP: u64 = 8 << 20;
const PHASE: u64 = 1 << 63;
const OFFSET_BITS: u32 = 40;

/// The NLA of byte `offset` of region `handle`.
pub fn nla(handle: u32, offset: u64) -> u64 {
    (handle as u64) << OFFSET_BITS | (offset & ((1 << OFFSET_BITS) - 1))
}

/// (handle, offset) of an NLA.
pub fn split_nla(nla: u64) -> (u32, u64) {
    ((nla >> OFFSET_BITS) as u32, nla & ((1 << OFFSET_BITS) - 1))
}

/// Which side's part a notification reports (RMA2's classes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Origin: the source was read (put), the request went out (get).
    Requester = 1,
    /// Put: the data is in place at the target. Get: the data landed at the origin.
    Completer = 2,
    /// Get, at the target: it was served.
    Responder = 3,
}

/// The operation a notification belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    Put = 1,
    Get = 2,
    ImmediatePut = 3,
}

/// Notification flags of an operation (`notify`): which classes to raise.
pub const NOTIFY_REQUESTER: u8 = 1;
pub const NOTIFY_COMPLETER: u8 = 2;
pub const NOTIFY_RESPONDER: u8 = 4;

/// One notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notification {
    pub class: Class,
    pub cmd: Cmd,
    /// `Status` of a failed operation (0: success).
    pub error: u8,
    pub len: u32,
    /// The other side's rank.
    pub peer: u32,
    /// This side's NLA of the operation.
    pub nla: u64,
}

impl Notification {
    pub fn encode(&self, phase: u64) -> [u64; 2] {
        let w0 = self.class as u64
            | (self.cmd as u64) << 2
            | (self.error as u64 & 0xf) << 4
            | (self.len as u64 & 0xff_ffff) << 8
            | (self.peer as u64 & 0x7fff_ffff) << 32
            | phase;
        [w0, self.nla]
    }

    /// Decodes an entry whose word 0 carries `phase`; `None` if stale or nonsensical.
    pub fn decode(w: [u64; 2], phase: u64) -> Option<Notification> {
        let w0 = w[0];
        if w0 & PHASE != phase {
            return None;
        }
        let class = match w0 & 3 {
            1 => Class::Requester,
            2 => Class::Completer,
            3 => Class::Responder,
            _ => return None,
        };
        let cmd = match (w0 >> 2) & 3 {
            1 => Cmd::Put,
            2 => Cmd::Get,
            3 => Cmd::ImmediatePut,
            _ => return None,
        };
        Some(Notification {
            class,
            cmd,
            error: ((w0 >> 4) & 0xf) as u8,
            len: ((w0 >> 8) & 0xff_ffff) as u32,
            peer: ((w0 >> 32) & 0x7fff_ffff) as u32,
            nla: w[1],
        })
    }

    pub fn status(&self) -> Status {
        Status::from_u32(self.error as u32)
    }
}

/// The phase bit of entry `i` of a queue of `n` entries.
pub fn phase(i: u64, n: u64) -> u64 {
    if (i / n).is_multiple_of(2) {
        PHASE
    } else {
        0
    }
}

/// Byte offset of entry `i`.
pub fn entry_at(i: u64, n: u64) -> u64 {
    ENTRIES_AT + (i % n) * ENTRY
}

/// Bytes of a queue of `n` entries.
pub fn queue_len(n: u64) -> u64 {
    ENTRIES_AT + n * ENTRY
}

/// A process's notification queue as its NIC sees it.
pub struct NotiQueue {
    region: Region,
    n: u64,
    written: u64,
}

impl NotiQueue {
    pub fn new(region: Region, n: u64) -> Result<NotiQueue, Status> {
        if !n.is_power_of_two() || n < 4 {
            return Err(Status::BadRequest);
        }
        if !region.is_mapped() {
            return Err(Status::Permission);
        }
        region.check_local(0, queue_len(n))?;
        Ok(NotiQueue {
            region,
            n,
            written: 0,
        })
    }

    fn word(&self, at: u64) -> Option<&std::sync::atomic::AtomicU64> {
        self.region.atomic(at, Perms(0)).ok()
    }

    /// Entries free (the process's published counter, clamped to what is possible).
    pub fn free(&self) -> u64 {
        let read = self
            .word(0)
            .map_or(0, |w| w.load(Ordering::Acquire))
            .clamp(self.written.saturating_sub(self.n), self.written);
        self.n - (self.written - read)
    }

    /// Writes `note` if the queue has room; `false` if it is full.
    pub fn write(&mut self, note: &Notification) -> bool {
        if self.free() == 0 {
            return false;
        }
        let i = self.written;
        let at = entry_at(i, self.n);
        let [w0, w1] = note.encode(phase(i, self.n));
        if let (Some(a), Some(b)) = (self.word(at), self.word(at + 8)) {
            b.store(w1, Ordering::Relaxed);
            a.store(w0, Ordering::Release);
        }
        self.written += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::memory::HeapBacking;

    #[test]
    fn notifications_round_trip_wrap_and_fill() {
        let n = 4;
        let r = Region::new(HeapBacking::new(queue_len(n) as usize), Perms::READ_WRITE);
        let mut q = NotiQueue::new(r.clone(), n).unwrap();
        let note = |k: u32| Notification {
            class: Class::Completer,
            cmd: Cmd::Put,
            error: 0,
            len: (8 << 20) - 1,
            peer: k,
            nla: nla(3, 1 << 39),
        };
        let mut read = 0u64;
        for k in 0..10u32 {
            assert!(q.write(&note(k)));
            let at = entry_at(read, n);
            let w = [
                r.atomic(at, Perms(0)).unwrap().load(Ordering::Acquire),
                r.atomic(at + 8, Perms(0)).unwrap().load(Ordering::Acquire),
            ];
            assert_eq!(Notification::decode(w, phase(read, n)), Some(note(k)));
            read += 1;
            // The next entry is stale until written.
            let at2 = entry_at(read, n);
            let w2 = [r.atomic(at2, Perms(0)).unwrap().load(Ordering::Acquire), 0];
            assert_eq!(Notification::decode(w2, phase(read, n)), None);
            r.atomic(0, Perms(0))
                .unwrap()
                .store(read, Ordering::Release);
        }
        for k in 0..4 {
            assert!(q.write(&note(k)));
        }
        assert!(!q.write(&note(9)), "full until the process frees entries");
        assert_eq!(split_nla(nla(7, 12345)), (7, 12345));
        assert!(NotiQueue::new(r, 6).is_err());
    }
}
