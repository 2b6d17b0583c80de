//! Event queues and counting events as the NIC keeps them.
//!
//! A full EQ drops the event and remembers it: the next event read reports PTL_EQ_DROPPED
//! (PtlEQGet's semantics). Counting events count successes and failures separately.

use std::cell::Cell;
use std::collections::VecDeque;

use super::types::{Event, PtlError};

/// How many events the process has consumed of those handed to it, as it publishes the count
/// (its event ring's consumer index, in memory it writes: hostile, validated by the reader).
pub trait Consumed: Send + std::fmt::Debug {
    fn consumed(&self) -> u64;
}

#[derive(Debug)]
pub struct EventQueue {
    cap: usize,
    /// With the interface's notice count when each was posted (see `PortalsNi::notices`):
    /// the daemon publishes counts and events to the process in the order they changed.
    events: VecDeque<(Event, u64)>,
    dropped: bool,
    /// Events handed to the process (taken by the daemon for its ring) since the queue began.
    handed: u64,
    /// How many of those the process had consumed when `consumer` was last read. The ones it
    /// may still hold (`handed - consumed`, an upper bound) take room too; the index is read
    /// only when that bound says the queue is full, so that the daemon reads the cache line
    /// the process writes once in a ring's lap, not per event.
    consumed: Cell<u64>,
    consumer: Option<Box<dyn Consumed>>,
}

impl EventQueue {
    pub fn new(cap: usize) -> EventQueue {
        EventQueue {
            cap,
            events: VecDeque::with_capacity(cap.min(4096)),
            dropped: false,
            handed: 0,
            consumed: Cell::new(0),
            consumer: None,
        }
    }

    /// Where the process publishes what it consumed of the events handed to it.
    pub fn set_consumer(&mut self, c: Box<dyn Consumed>) {
        self.consumer = Some(c);
    }

    /// Room for `n` more events.
    pub fn has_room(&self, n: usize) -> bool {
        let fits = || {
            let held = self.handed.wrapping_sub(self.consumed.get());
            self.events.len() as u64 + held + n as u64 <= self.cap as u64
        };
        fits() || (self.refresh() && fits())
    }

    /// Re-reads what the process consumed; a count it could not have (more than it was
    /// handed, or further back than the queue holds) leaves no room. Says whether it read.
    fn refresh(&self) -> bool {
        let Some(c) = &self.consumer else {
            return false;
        };
        let done = c.consumed();
        let held = self.handed.wrapping_sub(done);
        self.consumed.set(if held <= self.cap as u64 {
            done
        } else {
            self.handed.wrapping_sub(self.cap as u64)
        });
        true
    }

    /// Takes the next event for the process, with the dropped flag.
    pub fn take(&mut self) -> Option<(Event, bool)> {
        let r = self.get().ok()?;
        self.handed += 1;
        Some(r)
    }

    /// Posts an event, stamped `stamp`; a full queue drops it (and says so on the next read).
    pub fn push(&mut self, e: Event, stamp: u64) -> bool {
        if !self.has_room(1) {
            self.dropped = true;
            return false;
        }
        self.events.push_back((e, stamp));
        true
    }

    /// The stamp of the next event.
    pub fn head_stamp(&self) -> Option<u64> {
        self.events.front().map(|&(_, s)| s)
    }

    /// PtlEQGet: the next event, and whether events were dropped since the previous read
    /// (PTL_EQ_DROPPED); `Err(EqEmpty)` when there is none.
    pub fn get(&mut self) -> Result<(Event, bool), PtlError> {
        let (e, _) = self.events.pop_front().ok_or(PtlError::EqEmpty)?;
        Ok((e, std::mem::take(&mut self.dropped)))
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

/// A counting event (`ptl_ct_event_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CtEvent {
    pub success: u64,
    pub failure: u64,
}

impl CtEvent {
    pub fn inc(&mut self, by: CtEvent) {
        self.success += by.success;
        self.failure += by.failure;
    }

    /// Whether a test value (PtlCTWait / triggered threshold) is reached: the success count
    /// reaches it, or any failure happened.
    pub fn reached(&self, test: u64) -> bool {
        self.success >= test || self.failure > 0
    }
}

/// The limits of an interface (`ptl_ni_limits_t`), as reported by PtlNIInit and enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_entries: usize,
    pub max_unexpected_headers: usize,
    pub max_mds: usize,
    pub max_cts: usize,
    pub max_eqs: usize,
    /// Largest portal table index (at least 63).
    pub max_pt_index: u32,
    pub max_iovecs: usize,
    pub max_list_size: usize,
    pub max_triggered_ops: usize,
    pub max_msg_size: u64,
    pub max_atomic_size: u64,
    pub max_fetch_atomic_size: u64,
    pub max_ordered_size: u64,
    /// Most bytes a put or atomic from a `PTL_MD_VOLATILE` MD may send: the library copies
    /// them into the call (see `OpSpec::inline`).
    pub max_volatile_size: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_entries: 65_536,
            max_unexpected_headers: 65_536,
            max_mds: 65_536,
            max_cts: 4096,
            max_eqs: 256,
            max_pt_index: 255,
            max_iovecs: 1024,
            max_list_size: 65_536,
            max_triggered_ops: 65_536,
            max_msg_size: 1 << 30,
            max_atomic_size: 512,
            max_fetch_atomic_size: 512,
            max_ordered_size: 1 << 30,
            max_volatile_size: 512,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::portals::types::{EventKind, NiFail};

    #[test]
    fn full_queue_reports_dropped_once() {
        let mut q = EventQueue::new(2);
        let e = |p| Event::bare(EventKind::Link, 0, p, NiFail::Ok);
        assert!(q.push(e(1), 0) && q.push(e(2), 1));
        assert!(!q.push(e(3), 2));
        assert_eq!(q.get().unwrap(), (e(1), true));
        assert_eq!(q.get().unwrap(), (e(2), false));
        assert_eq!(q.get(), Err(PtlError::EqEmpty));
    }

    /// The process's consumption is read only when the queue looks full, and a nonsense
    /// count leaves no room.
    #[test]
    fn handed_events_are_counted_until_the_process_says_it_consumed_them() {
        #[derive(Debug)]
        struct Index(
            std::sync::Arc<std::sync::atomic::AtomicU64>,
            std::sync::Arc<std::sync::atomic::AtomicU64>,
        );
        impl Consumed for Index {
            fn consumed(&self) -> u64 {
                self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.0.load(std::sync::atomic::Ordering::Relaxed)
            }
        }
        let (done, reads) = (std::sync::Arc::default(), std::sync::Arc::default());
        let mut q = EventQueue::new(2);
        q.set_consumer(Box::new(Index(
            std::sync::Arc::clone(&done),
            std::sync::Arc::clone(&reads),
        )));
        let e = |p| Event::bare(EventKind::Link, 0, p, NiFail::Ok);
        let reads_now = || reads.load(std::sync::atomic::Ordering::Relaxed);
        assert!(q.push(e(1), 0) && q.push(e(2), 1));
        assert_eq!(reads_now(), 0, "room known without a look");
        assert!(q.take().is_some() && q.take().is_some());
        assert!(!q.push(e(3), 2), "both still held by the process");
        assert_eq!(reads_now(), 1);
        done.store(1, std::sync::atomic::Ordering::Relaxed);
        assert!(q.push(e(4), 3), "one consumed: room for one");
        assert!(!q.has_room(1));
        done.store(7, std::sync::atomic::Ordering::Relaxed);
        assert!(!q.has_room(1), "more consumed than handed: no room");
        done.store(2, std::sync::atomic::Ordering::Relaxed);
        assert!(q.has_room(1));
        assert_eq!(q.get().unwrap(), (e(4), true), "e(3) was dropped");
    }

    #[test]
    fn thresholds() {
        let mut c = CtEvent::default();
        assert!(!c.reached(1));
        c.inc(CtEvent {
            success: 2,
            failure: 0,
        });
        assert!(c.reached(2) && !c.reached(3));
        c.inc(CtEvent {
            success: 0,
            failure: 1,
        });
        assert!(c.reached(100), "a failure releases every waiter");
    }
}
