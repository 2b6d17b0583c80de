//! Portals event queues and counting events in the process's memory.
//!
//! An event ring lives in a region the process registered: the consumer index (written by the
//! process) on its own cache line, then records of two cache lines each. A record's first word
//! is its mark: the event's number plus one, stored last (release). The process polls the mark
//! of the record it expects next, so an event reaches it as two line transfers and nothing
//! else (a producer index beside the records would be a third line each side touches per
//! event, and 96-byte records shared lines with their neighbours). The ring's memory starts
//! zeroed (a fresh registration is): a zero mark is no event. The daemon reads the consumer
//! index only when the events it handed out since its last look would fill the queue (the
//! engine's EQ counts them against its capacity, see `nic::portals::events`), and validates
//! it.
//! A counting event is a 16-byte slot (success, failure) the daemon stores after each change.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::nic::memory::Region;
use crate::nic::portals::atomic::{AtomicOp, Datatype};
use crate::nic::portals::wire::ni_fail_from;
use crate::nic::portals::{Consumed, CtEvent, Event, EventKind, ProcessId};
use crate::wire::{get_u32, get_u64};

const HEAD: u64 = 0; // consumer (process)
const FIRST: u64 = 128;
/// A record: the mark word, then the encoded event ([`BODY_LEN`] bytes).
pub const EVENT_LEN: u64 = 128;
/// An event's encoding, after the record's mark.
const BODY_LEN: usize = 80;

/// Bytes an event ring of `count` events takes.
pub fn ring_bytes(count: usize) -> usize {
    (FIRST + EVENT_LEN * count as u64) as usize
}

const KINDS: [EventKind; 16] = [
    EventKind::Get,
    EventKind::GetOverflow,
    EventKind::Put,
    EventKind::PutOverflow,
    EventKind::Atomic,
    EventKind::AtomicOverflow,
    EventKind::FetchAtomic,
    EventKind::FetchAtomicOverflow,
    EventKind::Reply,
    EventKind::Send,
    EventKind::Ack,
    EventKind::PtDisabled,
    EventKind::Link,
    EventKind::AutoUnlink,
    EventKind::AutoFree,
    EventKind::Search,
];

fn encode(e: &Event, dropped: bool, b: &mut [u8; BODY_LEN]) {
    b[0] = KINDS.iter().position(|k| *k == e.kind).unwrap_or(0) as u8;
    b[1] = e.ni_fail as u8;
    if let Some((o, d)) = e.atomic {
        b[2] = 1;
        b[3] = o as u8;
        b[4] = d as u8;
    }
    b[5] = dropped as u8;
    let (t, x, y) = match e.initiator {
        ProcessId::Logical { rank } => (0u8, rank, 0),
        ProcessId::Physical { nid, pid } => (1, nid, pid),
    };
    b[6] = t;
    b[8..12].copy_from_slice(&x.to_le_bytes());
    b[12..16].copy_from_slice(&y.to_le_bytes());
    b[16..20].copy_from_slice(&e.pt_index.to_le_bytes());
    b[20..24].copy_from_slice(&e.uid.to_le_bytes());
    for (i, v) in [
        e.match_bits,
        e.rlength,
        e.mlength,
        e.remote_offset,
        e.start,
        e.user_ptr,
        e.hdr_data,
    ]
    .iter()
    .enumerate()
    {
        b[24 + i * 8..32 + i * 8].copy_from_slice(&v.to_le_bytes());
    }
}

fn decode(b: &[u8]) -> (Event, bool) {
    let atomic = (b[2] == 1)
        .then(|| AtomicOp::from_u8(b[3]).zip(Datatype::from_u8(b[4])))
        .flatten();
    let initiator = if b[6] == 0 {
        ProcessId::Logical {
            rank: get_u32(b, 8),
        }
    } else {
        ProcessId::Physical {
            nid: get_u32(b, 8),
            pid: get_u32(b, 12),
        }
    };
    let e = Event {
        kind: KINDS[(b[0] as usize).min(15)],
        initiator,
        pt_index: get_u32(b, 16),
        uid: get_u32(b, 20),
        match_bits: get_u64(b, 24),
        rlength: get_u64(b, 32),
        mlength: get_u64(b, 40),
        remote_offset: get_u64(b, 48),
        start: get_u64(b, 56),
        user_ptr: get_u64(b, 64),
        hdr_data: get_u64(b, 72),
        ni_fail: ni_fail_from(b[1]),
        atomic,
    };
    (e, b[5] != 0)
}

/// One side's view of an event ring at `base` (of `cap` events) in `region`.
pub struct EventRing {
    /// Keeps the mapping that `ring` points into alive.
    _region: Region,
    /// The ring's first byte, checked once at [`EventRing::new`]: the indices and records are
    /// then reached without a bounds check and a call through the region's backing per look
    /// (an idle poll looks at three rings).
    ring: std::ptr::NonNull<u8>,
    cap: u64,
    /// This side's own index (the producer's tail or the consumer's head).
    mine: u64,
    /// Producer: unconsumed events as last read from the consumer's index, plus those pushed
    /// since. An upper bound (the consumer only frees), so pushes need not read the index —
    /// a cache line the process writes — while it shows room.
    seen: u64,
}

// SAFETY: `ring` points into the mapping that `_region` (Send, as every backing is) keeps
// alive; the ring is reached through `&self`/`&mut self` only, as the region would be.
unsafe impl Send for EventRing {}

impl EventRing {
    /// Checks that `len` bytes at `base` hold a ring of at least one event, 8-aligned.
    /// The memory must start zeroed (see the module's doc).
    pub fn new(region: Region, base: u64, len: u64) -> Option<EventRing> {
        if !base.is_multiple_of(64) || len < FIRST + EVENT_LEN {
            return None;
        }
        let ring = std::ptr::NonNull::new(region.mapped_at(base, len).ok()?)?;
        if !(ring.as_ptr() as usize).is_multiple_of(8) {
            return None;
        }
        Some(EventRing {
            _region: region,
            ring,
            cap: (len - FIRST) / EVENT_LEN,
            mine: 0,
            seen: 0,
        })
    }

    pub fn capacity(&self) -> usize {
        self.cap as usize
    }

    fn word(&self, at: u64) -> &AtomicU64 {
        // SAFETY: `at` is HEAD or a record's mark, inside the ring checked at `new`; `self`
        // keeps the mapping alive.
        unsafe { word_at(self.ring, at) }
    }

    /// The offset of event number `n`'s record (modulo the capacity).
    fn at(&self, n: u64) -> u64 {
        FIRST + (n % self.cap) * EVENT_LEN
    }

    /// The body of event number `n`'s record (modulo the capacity), after its mark.
    fn body(&self, n: u64) -> *mut u8 {
        // SAFETY: inside the ring checked at `new` (`cap` records fit after FIRST).
        unsafe { self.ring.as_ptr().add(self.at(n) as usize + 8) }
    }

    // ---- producer (daemon) ----

    /// The consumer's index, for the engine's queue to read when it looks full (see
    /// [`Consumed`]).
    pub fn consumer(&self) -> ConsumerIndex {
        ConsumerIndex {
            _region: self._region.clone(),
            ring: self.ring,
        }
    }

    /// Events written and not yet consumed, or `None` if the consumer's index is nonsense
    /// (the ring then counts as full).
    pub fn backlog(&mut self) -> Option<u64> {
        let head = self.word(HEAD).load(Ordering::Acquire);
        let used = self.mine.wrapping_sub(head);
        let ok = used <= self.cap;
        self.seen = if ok { used } else { self.cap };
        ok.then_some(used)
    }

    /// The events the process may still hold: an upper bound, exact (from the consumer's
    /// index, a line the process writes) only once the bound fills the ring; the whole ring
    /// if that index is nonsense.
    pub fn held(&mut self) -> u64 {
        if self.seen < self.cap {
            return self.seen;
        }
        self.backlog().unwrap_or(self.cap)
    }

    /// The unconsumed events as last seen by [`EventRing::backlog`] and counted since: never
    /// fewer than there are.
    pub fn seen_backlog(&self) -> u64 {
        self.seen
    }

    /// Appends an event; `false` when the ring is full (or its consumer index is corrupt).
    /// The consumer's index is read only when the last look showed the ring full.
    pub fn push(&mut self, e: &Event, dropped: bool) -> bool {
        if self.held() >= self.cap {
            return false;
        }
        let mut b = [0u8; BODY_LEN];
        encode(e, dropped, &mut b);
        // SAFETY: the body is inside the ring (see `body`); the process reads it only after
        // the release store of its mark below.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.body(self.mine), b.len()) };
        let mark = self.at(self.mine);
        self.mine += 1;
        self.seen += 1;
        self.word(mark).store(self.mine, Ordering::Release);
        true
    }

    // ---- consumer (process) ----

    /// The next event and whether events were dropped before it (PTL_EQ_DROPPED).
    pub fn pop(&mut self) -> Option<(Event, bool)> {
        if !self.pending() {
            return None;
        }
        // SAFETY: the body is inside the ring (see `body`) and was written before the mark
        // that the acquire load in `pending` saw.
        let r = decode(unsafe { std::slice::from_raw_parts(self.body(self.mine), BODY_LEN) });
        self.mine += 1;
        self.word(HEAD).store(self.mine, Ordering::Release);
        Some(r)
    }

    /// Is the next event there: its record marked with its number (plus one)?
    pub fn pending(&self) -> bool {
        self.word(self.at(self.mine)).load(Ordering::Acquire) == self.mine + 1
    }
}

/// A ring's consumer index as the daemon reads it: how many events the process consumed.
pub struct ConsumerIndex {
    /// Keeps the mapping that `ring` points into alive.
    _region: Region,
    ring: std::ptr::NonNull<u8>,
}

// SAFETY: as for `EventRing`: `ring` points into the mapping `_region` keeps alive.
unsafe impl Send for ConsumerIndex {}

impl std::fmt::Debug for ConsumerIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConsumerIndex({:p})", self.ring)
    }
}

impl Consumed for ConsumerIndex {
    fn consumed(&self) -> u64 {
        // SAFETY: HEAD is inside the ring checked at `EventRing::new`; `_region` keeps the
        // mapping alive.
        unsafe { word_at(self.ring, HEAD) }.load(Ordering::Acquire)
    }
}

/// The word at offset `at` of the ring starting at `ring`.
///
/// # Safety
/// `at` is 8-aligned and inside a ring checked by [`EventRing::new`] (whose first byte is
/// 8-aligned), and the mapping outlives `'a`.
unsafe fn word_at<'a>(ring: std::ptr::NonNull<u8>, at: u64) -> &'a AtomicU64 {
    // SAFETY: the caller's contract.
    unsafe { &*(ring.as_ptr().add(at as usize) as *const AtomicU64) }
}

/// A counting event's slot: `success u64 | failure u64 | wake_at u64 | reserved u64`.
///
/// `wake_at` is the sleeping process's PtlCTWait test: while it is non-zero the NIC rings the
/// doorbell for this count only once `success >= wake_at` or a failure is counted, instead of
/// on every change (a process waiting for 1024 acknowledgements is woken once, not per batch).
/// Zero means "wake me on any change".
pub struct CtSlot {
    region: Region,
    at: u64,
}

/// Bytes per counting-event slot.
pub const CT_SLOT_LEN: u64 = 32;

impl CtSlot {
    pub fn new(region: Region, at: u64) -> Option<CtSlot> {
        (at.is_multiple_of(8) && region.is_mapped() && region.check_local(at, CT_SLOT_LEN).is_ok())
            .then_some(CtSlot { region, at })
    }

    fn word(&self, i: u64) -> &AtomicU64 {
        self.region
            .atomic(self.at + i * 8, crate::nic::memory::Perms(0))
            .expect("checked")
    }

    /// The NIC side: publishes `v`; says whether it wakes the sleeper (see [`CtSlot::wakes`]).
    /// The count is out before the threshold is read: a process that sets its threshold after
    /// this read sees the new count and does not sleep.
    pub fn store(&self, v: CtEvent) -> bool {
        self.word(1).store(v.failure, Ordering::Release);
        self.word(0).store(v.success, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        self.wakes(v)
    }

    pub fn load(&self) -> CtEvent {
        CtEvent {
            success: self.word(0).load(Ordering::Acquire),
            failure: self.word(1).load(Ordering::Acquire),
        }
    }

    /// The process side: wake me only when the count reaches `test` (0: on any change).
    pub fn set_wake_at(&self, test: u64) {
        self.word(2).store(test, Ordering::SeqCst);
    }

    /// Does count `v` (stored) wake a sleeper: no threshold set, or the threshold reached?
    pub fn wakes(&self, v: CtEvent) -> bool {
        let t = self.word(2).load(Ordering::SeqCst);
        t == 0 || v.reached(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::memory::{GoneBacking, HeapBacking, Perms};
    use crate::nic::portals::NiFail;

    #[test]
    fn a_count_wakes_its_sleeper_only_at_the_threshold() {
        let r = Region::new(HeapBacking::new(4096), Perms(0));
        let s = CtSlot::new(r.clone(), 64).unwrap();
        assert!(CtSlot::new(r, 4096 - 16).is_none(), "a slot needs 32 bytes");
        let v = |success, failure| CtEvent { success, failure };
        // No threshold: every change is news.
        assert!(s.wakes(v(1, 0)));
        s.set_wake_at(1024);
        assert!(!s.wakes(v(1023, 0)));
        assert!(s.wakes(v(1024, 0)));
        assert!(
            s.wakes(v(3, 1)),
            "a failure always wakes (PtlCTWait returns on it)"
        );
        s.store(v(5, 0));
        assert_eq!(
            s.load(),
            v(5, 0),
            "the threshold word is apart from the count"
        );
        s.set_wake_at(0);
        assert!(s.wakes(v(6, 0)));
    }

    #[test]
    fn events_flow_and_fill() {
        let r = Region::new(HeapBacking::new(4096), Perms(0));
        let mut p = EventRing::new(r.clone(), 64, ring_bytes(3) as u64).unwrap();
        let mut c = EventRing::new(r, 64, ring_bytes(3) as u64).unwrap();
        let mut e = Event::bare(EventKind::Put, 4, 77, NiFail::PtDisabled);
        e.initiator = ProcessId::Physical { nid: 2, pid: 9 };
        e.atomic = Some((AtomicOp::Sum, Datatype::Double));
        e.mlength = 12;
        for i in 0..3 {
            assert!(p.push(&Event { user_ptr: i, ..e }, i == 1));
        }
        assert!(!p.push(&e, false), "full");
        assert_eq!(c.pop(), Some((Event { user_ptr: 0, ..e }, false)));
        assert_eq!(p.seen_backlog(), 3, "not looked at since");
        assert_eq!(c.pop(), Some((Event { user_ptr: 1, ..e }, true)));
        assert!(p.push(&e, false), "a full ring looks again");
        assert_eq!(p.seen_backlog(), 2);
        assert_eq!(p.backlog(), Some(2));
    }

    #[test]
    fn a_record_of_an_earlier_lap_is_not_an_event() {
        let r = Region::new(HeapBacking::new(4096), Perms(0));
        let mut p = EventRing::new(r.clone(), 0, ring_bytes(2) as u64).unwrap();
        let mut c = EventRing::new(r, 0, ring_bytes(2) as u64).unwrap();
        let e = Event::bare(EventKind::Put, 1, 2, NiFail::Ok);
        assert!(!c.pending(), "zeroed memory holds no event");
        for i in 0..7 {
            assert!(p.push(&Event { user_ptr: i, ..e }, false));
            assert!(c.pending());
            assert_eq!(c.pop(), Some((Event { user_ptr: i, ..e }, false)));
            // The slot the consumer looks at next holds an event of the lap before (once
            // the ring has wrapped).
            assert!(!c.pending(), "lap {i}: an old record must not count");
            assert_eq!(c.pop(), None);
        }
    }

    #[test]
    fn corrupt_consumer_index_is_refused() {
        let r = Region::new(HeapBacking::new(4096), Perms(0));
        let mut p = EventRing::new(r.clone(), 0, 1024).unwrap();
        r.atomic(0, Perms(0))
            .unwrap()
            .store(1 << 40, Ordering::SeqCst);
        assert_eq!(p.backlog(), None);
        assert_eq!(p.seen_backlog(), p.capacity() as u64, "counts as full");
        assert!(!p.push(&Event::bare(EventKind::Link, 0, 0, NiFail::Ok), false));
        assert!(EventRing::new(r.clone(), 3, 1024).is_none());
        assert!(EventRing::new(r, 0, 8192).is_none());
    }

    #[test]
    fn a_ring_needs_mapped_memory() {
        // A process's private memory, reached by copy: nothing there can be pointed at.
        let r = Region::new(std::sync::Arc::new(GoneBacking(4096)), Perms(0));
        assert!(EventRing::new(r, 0, 1024).is_none());
    }
}
