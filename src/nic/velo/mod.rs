//! VELO, EXTOLL's engine for small messages (seed 004 §II; after velo2): a receiver's
//! **mailbox** is one ring of fixed slots in its registered memory, written only by its NIC.
//! Each slot starts with an 8-byte status word the receiver polls; a phase bit flipped on every
//! pass over the ring tells a fresh slot from a stale one without clearing anything.
//!
//! Layout of a mailbox region: the receiver's read counter (slots consumed, a `u64` it
//! publishes) at 0, the slots from [`SLOTS_AT`]. Geometry: 64-byte slots carrying 56 bytes, a
//! message up to 64 bytes (57–64 bytes take two slots), as the seed's EXTOLL; or 128-byte slots
//! carrying a message of up to 120 bytes in one.
//!
//! Status word: `len u8 | tag u8 | source rank u32 | kind u2 | … | phase (bit 63)`; `kind` is
//! [`ONE`], [`FIRST_OF_TWO`] or [`SECOND`]. The NIC writes a message's payload, then its status
//! words (a two-slot message's second slot first), each with release ordering.

use std::sync::atomic::Ordering;

use crate::nic::memory::Region;
use crate::wire::Status;

/// Where the slots begin in a mailbox region (the read counter's cache line before).
pub const SLOTS_AT: u64 = 64;
/// Status word kinds.
pub const ONE: u64 = 1;
pub const FIRST_OF_TWO: u64 = 2;
pub const SECOND: u64 = 3;
const PHASE: u64 = 1 << 63;

/// A mailbox's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes per slot: 64 or 128.
    pub slot: u32,
    /// Slots in the ring: a power of two, at least 4.
    pub nslots: u32,
}

impl Geometry {
    pub fn new(slot: u32, nslots: u32) -> Option<Geometry> {
        (matches!(slot, 64 | 128) && nslots.is_power_of_two() && nslots >= 4)
            .then_some(Geometry { slot, nslots })
    }
    /// Payload bytes of one slot.
    pub fn payload(&self) -> usize {
        self.slot as usize - 8
    }
    /// Largest message: 64 bytes with 64-byte slots (two of them), else one slot's payload.
    pub fn max_message(&self) -> usize {
        if self.slot == 64 {
            64
        } else {
            self.payload()
        }
    }
    /// Slots a message of `len` bytes takes.
    pub fn slots_for(&self, len: usize) -> u64 {
        if len > self.payload() {
            2
        } else {
            1
        }
    }
    /// Bytes of a mailbox region of this shape.
    pub fn region_len(&self) -> u64 {
        SLOTS_AT + self.slot as u64 * self.nslots as u64
    }
    /// Byte offset of the slot with absolute index `i`.
    pub fn slot_at(&self, i: u64) -> u64 {
        SLOTS_AT + (i % self.nslots as u64) * self.slot as u64
    }
    /// The phase bit slots of pass `i / nslots` carry: set on even passes (fresh memory is
    /// zero, so nothing is valid before the first write).
    pub fn phase(&self, i: u64) -> u64 {
        if (i / self.nslots as u64).is_multiple_of(2) {
            PHASE
        } else {
            0
        }
    }
}

/// A decoded status word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotStatus {
    pub len: usize,
    pub tag: u8,
    pub src: u32,
    pub kind: u64,
}

pub fn status_word(s: &SlotStatus, phase: u64) -> u64 {
    (s.len as u64 & 0xff) | (s.tag as u64) << 8 | (s.src as u64) << 16 | (s.kind & 3) << 48 | phase
}

/// The status word `w` of the slot with absolute index `i`, if it is fresh.
pub fn read_status(g: &Geometry, i: u64, w: u64) -> Option<SlotStatus> {
    (w & PHASE == g.phase(i)).then_some(SlotStatus {
        len: (w & 0xff) as usize,
        tag: (w >> 8) as u8,
        src: (w >> 16) as u32,
        kind: (w >> 48) & 3,
    })
}

/// One process's mailbox as its NIC sees it.
pub struct Mailbox {
    pub region: Region,
    pub geometry: Geometry,
    /// Slots written so far (the NIC's own count, never read back from shared memory).
    written: u64,
    /// The receiver's consumed count as last read (never ahead of it). A delivery reads the
    /// published count only when this one leaves too little room, so the line the receiver
    /// writes on every message is not pulled across cores on every delivery.
    read_seen: u64,
}

impl Mailbox {
    /// A mailbox over `region` (mapped: status words are stored atomically), or the reason.
    pub fn new(region: Region, geometry: Geometry) -> Result<Mailbox, Status> {
        if !region.is_mapped() {
            return Err(Status::Permission);
        }
        region.check_local(0, geometry.region_len())?;
        Ok(Mailbox {
            region,
            geometry,
            written: 0,
            read_seen: 0,
        })
    }

    /// Slots free: what the receiver's published counter allows (a counter it scribbled out of
    /// range counts as nothing consumed, or everything, whichever is safe).
    pub fn free(&self) -> u64 {
        self.room(self.read_now())
    }

    /// Slots free if the receiver has consumed `read`.
    fn room(&self, read: u64) -> u64 {
        self.geometry.nslots as u64 - (self.written - read)
    }

    /// The receiver's published count, clamped to what it can be.
    fn read_now(&self) -> u64 {
        let n = self.geometry.nslots as u64;
        let read = self
            .region
            .atomic(0, crate::nic::memory::Perms(0))
            .map(|w| w.load(Ordering::Acquire))
            .unwrap_or(0);
        read.clamp(self.written.saturating_sub(n), self.written)
    }

    /// Writes a message from `src` if the ring has room; `false` (nothing written) if not.
    /// `data` must fit the geometry (checked by the caller: `max_message`).
    pub fn deliver(&mut self, src: u32, tag: u8, data: &[u8]) -> bool {
        let g = self.geometry;
        let need = g.slots_for(data.len());
        if self.room(self.read_seen) < need {
            self.read_seen = self.read_now();
            if self.room(self.read_seen) < need {
                return false;
            }
        }
        let p = g.payload();
        let (first, rest) = data.split_at(data.len().min(p));
        let i = self.written;
        let st = |kind| SlotStatus {
            len: data.len(),
            tag,
            src,
            kind,
        };
        if need == 2 {
            let at = g.slot_at(i + 1);
            let _ = self.region.write(at + 8, rest);
            self.store(at, status_word(&st(SECOND), g.phase(i + 1)));
        }
        let at = g.slot_at(i);
        let _ = self.region.write(at + 8, first);
        let kind = if need == 2 { FIRST_OF_TWO } else { ONE };
        self.store(at, status_word(&st(kind), g.phase(i)));
        self.written += need;
        true
    }

    fn store(&self, at: u64, w: u64) {
        if let Ok(word) = self.region.atomic(at, crate::nic::memory::Perms(0)) {
            word.store(w, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::memory::{HeapBacking, Perms};

    /// What a receiver does: reads messages at `read`, publishes its counter.
    fn take(m: &Mailbox, read: &mut u64) -> Option<(SlotStatus, Vec<u8>)> {
        let g = m.geometry;
        let w = m.region.atomic(g.slot_at(*read), Perms(0)).unwrap();
        let s = read_status(&g, *read, w.load(Ordering::Acquire))?;
        let mut data = m
            .region
            .to_vec(g.slot_at(*read) + 8, s.len.min(g.payload()));
        if s.kind == FIRST_OF_TWO {
            let w2 = m.region.atomic(g.slot_at(*read + 1), Perms(0)).unwrap();
            let s2 = read_status(&g, *read + 1, w2.load(Ordering::Acquire)).unwrap();
            assert_eq!(s2.kind, SECOND);
            data.extend(
                m.region
                    .to_vec(g.slot_at(*read + 1) + 8, s.len - g.payload()),
            );
            *read += 1;
        }
        *read += 1;
        m.region
            .atomic(0, Perms(0))
            .unwrap()
            .store(*read, Ordering::Release);
        Some((s, data))
    }

    #[test]
    fn ring_wraps_with_the_phase_and_two_slot_messages_and_back_pressure() {
        let g = Geometry::new(64, 4).unwrap();
        let r = Region::new(HeapBacking::new(g.region_len() as usize), Perms::READ_WRITE);
        let mut m = Mailbox::new(r, g).unwrap();
        let mut read = 0;
        assert!(take(&m, &mut read).is_none(), "fresh memory holds nothing");
        // Three passes over the 4-slot ring, messages of 1 and 2 slots mixed.
        for round in 0..12u8 {
            let len = if round % 3 == 0 {
                64
            } else {
                56 - round as usize
            };
            let data: Vec<u8> = (0..len as u8).map(|b| b ^ round).collect();
            assert!(m.deliver(7, round, &data));
            let (s, got) = take(&m, &mut read).unwrap();
            assert_eq!((s.src, s.tag, s.len), (7, round, len));
            assert_eq!(got, data);
            assert!(
                take(&m, &mut read).is_none(),
                "stale slots of the last pass are not fresh"
            );
        }
        // A receiver that does not read: the ring fills, then refuses, nothing overwritten.
        for k in 0..4u8 {
            assert!(m.deliver(1, k, &[k; 8]));
        }
        assert!(!m.deliver(1, 9, &[9; 8]), "full");
        assert_eq!(m.free(), 0);
        for k in 0..4u8 {
            assert_eq!(take(&m, &mut read).unwrap().1, [k; 8]);
        }
        // A two-slot message needs two free slots.
        for k in 0..3u8 {
            assert!(m.deliver(1, k, &[k; 8]));
        }
        assert!(!m.deliver(1, 3, &[3; 64]), "one slot left");
        assert!(m.deliver(1, 4, &[4; 8]));
        // A scribbled counter cannot make the NIC overwrite unread slots.
        m.region
            .atomic(0, Perms(0))
            .unwrap()
            .store(u64::MAX, Ordering::Release);
        assert_eq!(
            m.free(),
            4,
            "clamped: all consumed is the most it can claim"
        );
        m.region
            .atomic(0, Perms(0))
            .unwrap()
            .store(0, Ordering::Release);
        assert_eq!(m.free(), 0, "clamped from below");
    }

    #[test]
    fn geometry_rules() {
        assert!(Geometry::new(96, 8).is_none());
        assert!(Geometry::new(64, 6).is_none());
        let big = Geometry::new(128, 8).unwrap();
        assert_eq!((big.max_message(), big.slots_for(120)), (120, 1));
        let small = Geometry::new(64, 8).unwrap();
        assert_eq!((small.max_message(), small.slots_for(57)), (64, 2));
    }
}
