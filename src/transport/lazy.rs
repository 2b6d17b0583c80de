//! When a lazy op may wait for company: the delayed-acknowledgement trade of TCP, with its
//! quick-ack mode.
//!
//! Waiting pays off when the peer's application answers soon (a ping-pong's reply carries the
//! acknowledgement) or when many lazy ops leave together (a stream of acknowledgements). It
//! costs the whole delay when nothing comes: a blocking put waits for an acknowledgement that
//! sits out its deadline alone. After a few such datagrams in a row, lazy ops to that peer go
//! at the next flush instead, and one in [`PROBE_EVERY`] waits again to see whether company
//! has come back.

/// Lazy datagrams that left alone, in a row, before lazy ops stop waiting.
const QUICK_AFTER: u8 = 2;
/// In quick mode, one lazy op in this many still waits, as a probe.
const PROBE_EVERY: u32 = 16;

#[derive(Debug, Default)]
pub(crate) struct LazyPolicy {
    alone_streak: u8,
    quick_pushes: u32,
}

impl LazyPolicy {
    /// Whether a lazy op pushed now should wait for company (or go at the next flush).
    pub(crate) fn wait(&mut self) -> bool {
        if self.alone_streak < QUICK_AFTER {
            return true;
        }
        self.quick_pushes = self.quick_pushes.wrapping_add(1);
        self.quick_pushes.is_multiple_of(PROBE_EVERY)
    }

    /// A datagram holding waiting lazy ops left: `alone` when it held a single lazy op and
    /// left by its deadline, with nothing else to share it.
    pub(crate) fn left(&mut self, alone: bool) {
        if alone {
            self.alone_streak = self.alone_streak.saturating_add(1);
        } else {
            self.alone_streak = 0;
            self.quick_pushes = 0;
        }
    }

    #[cfg(test)]
    pub(crate) fn quick(&self) -> bool {
        self.alone_streak >= QUICK_AFTER
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lone_lazy_datagrams_switch_to_quick_mode_and_probes_switch_back() {
        let mut p = LazyPolicy::default();
        assert!(p.wait());
        p.left(true);
        assert!(p.wait(), "one lone datagram is not a pattern");
        p.left(true);
        assert!(p.quick());
        let waits = (0..PROBE_EVERY * 2).filter(|_| p.wait()).count();
        assert_eq!(waits, 2, "only probes wait in quick mode");
        p.left(false);
        assert!(!p.quick());
        assert!(p.wait());
    }
}
