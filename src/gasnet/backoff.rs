//! How a GASNet wait backs off: spin first (a round trip is microseconds away), then yield,
//! then sleep in the conduit until news. A rank waiting long (in a barrier, for a slow peer)
//! thus leaves the cores to the NIC daemon and to ranks that compute: on a machine with fewer
//! cores than busy threads, spinning waiters slow everyone's round trips.
//!
//! Past its first spin every wait leaves a pinned NIC's core (the daemon would otherwise hand
//! its core to the waiter while other round trips need it). A wait for one operation is then
//! the exception where the conduit's operations are one-sided (`Conduit::one_sided`): nobody
//! it waits for needs its core, and a yield would hand that core to a
//! computing rank until the next scheduler tick, so it spins for `OP_SPIN` first (see
//! [`crate::shm::cores`]).

use std::time::{Duration, Instant};

use super::conduit::Conduit;
use super::GasnetError;

/// Idle polls spent spinning before yielding: few, because a waiting rank that keeps its core
/// starves the daemon when busy threads outnumber cores (measured: a blocking put to a
/// computing target 22 µs with 64, 17.5 with 16, 16.4 with 4; idle-target latency unchanged;
/// the price: an AM round trip 15.1 µs with 64, 17.7 with 4, as its target yields sooner).
const SPIN_POLLS: u32 = 4;
/// How long a wait yields before it sleeps.
const YIELD_FOR: Duration = Duration::from_micros(200);
/// A wait for one operation yields at least as long as its bytes take at this rate (bytes
/// per µs: 1 GB/s), so that a bulk transfer's waiter is awake when it completes: a blocking
/// wake-up costs ~30 µs here, and a 1 MiB put takes 300–600 µs.
const YIELD_BYTES_PER_US: u64 = 1000;
/// Longest single sleep (the conduit wakes earlier on news).
const SLEEP_MAX: Duration = Duration::from_millis(1);
/// How long a wait for one operation spins when the NIC works on another core (a blocking
/// put or get takes ~10 µs; a long one still yields and sleeps after this).
const OP_SPIN: Duration = Duration::from_micros(100);
/// While spinning for one operation, the clock is read every this many idle polls: a read
/// costs about as much as a poll, and the event is seen a poll sooner.
const CLOCK_EVERY: u32 = 16;

#[derive(Default)]
pub(crate) struct Backoff {
    idle: u32,
    since: Option<Instant>,
    /// Waiting for one operation: may spin on when the NIC is elsewhere.
    one_op: bool,
    /// Whether the NIC works on another core (asked, and made so, once per wait).
    off_core: Option<bool>,
    /// The last look at the clock found this a one-operation spin.
    op_spinning: bool,
    /// Sleeps without yielding first (see [`Backoff::for_room`]).
    no_yield: bool,
    /// Yields this long past [`YIELD_FOR`] (see [`YIELD_BYTES_PER_US`]).
    yield_more: Duration,
    /// Reached the sleeping phase at least once.
    slept: bool,
}

impl Backoff {
    /// For a wait on one operation (blocking put, get, atomic) moving `bytes`: a large one
    /// never spins so (see [`crate::client::SPIN_BELOW_BYTES`]).
    pub(crate) fn one_op(bytes: usize) -> Backoff {
        let for_bytes = Duration::from_micros(bytes as u64 / YIELD_BYTES_PER_US);
        Backoff {
            one_op: (bytes as u64) < crate::client::SPIN_BELOW_BYTES,
            yield_more: for_bytes.saturating_sub(YIELD_FOR),
            ..Backoff::default()
        }
    }

    /// For a wait on room for more bulk data (a bounce chunk, a slot for a piece): a stream
    /// outrunning the NIC waits there once per piece, and a waiter that yields stays
    /// runnable beside the daemons doing the work. After a wait that had to sleep
    /// (`last_slept`, from [`Backoff::slept`]) the next one sleeps after its spin.
    pub(crate) fn for_room(last_slept: bool) -> Backoff {
        Backoff {
            no_yield: last_slept,
            ..Backoff::default()
        }
    }

    /// Whether this wait reached its sleeping phase.
    pub(crate) fn slept(&self) -> bool {
        self.slept
    }

    /// Something happened: the next idle poll starts spinning again.
    pub(crate) fn progressed(&mut self) {
        self.idle = 0;
        self.since = None;
        self.op_spinning = false;
    }

    /// Nothing happened in the last poll.
    pub(crate) fn idle(&mut self, conduit: &mut dyn Conduit) -> Result<(), GasnetError> {
        self.idle_then(conduit, |c, max| c.wait_news(max))
    }

    /// [`Backoff::idle`] whose sleep is `sleep` (for waits that news collected for the caller
    /// does not end, which `Conduit::wait_news` would return at once for).
    pub(crate) fn idle_then<C: Conduit + ?Sized>(
        &mut self,
        conduit: &mut C,
        sleep: impl FnOnce(&mut C, Duration) -> Result<(), GasnetError>,
    ) -> Result<(), GasnetError> {
        match self.step(conduit) {
            Step::Spin => std::hint::spin_loop(),
            Step::Yield => conduit.yield_now(),
            Step::Sleep => return sleep(conduit, SLEEP_MAX),
        }
        Ok(())
    }

    /// Nothing happened in the last poll: what to do about it (a sleep lasts at most
    /// [`SLEEP_MAX`]).
    fn step<C: Conduit + ?Sized>(&mut self, conduit: &mut C) -> Step {
        self.idle = self.idle.saturating_add(1);
        if self.idle <= SPIN_POLLS
            || (self.op_spinning && !self.idle.is_multiple_of(CLOCK_EVERY))
            || conduit.keep_core()
        {
            return Step::Spin;
        }
        let waited = self.since.get_or_insert_with(Instant::now).elapsed();
        // Any wait that gets this far leaves the NIC's core first: a waiter there makes the
        // daemon hand its core over (1.3 µs a time) while a round trip of another rank is on it.
        let off_core = *self.off_core.get_or_insert_with(|| conduit.off_nic_core());
        self.past_spin(waited, off_core && conduit.one_sided())
    }

    /// A wait past its first spin, `waited` long; `nic_elsewhere`: the NIC serves it from
    /// another core, alone.
    fn past_spin(&mut self, waited: Duration, nic_elsewhere: bool) -> Step {
        self.op_spinning = self.one_op && waited < OP_SPIN && nic_elsewhere;
        if self.op_spinning {
            Step::Spin
        } else if waited < YIELD_FOR + self.yield_more && !self.no_yield {
            Step::Yield
        } else {
            self.slept = true;
            Step::Sleep
        }
    }
}

/// What an idle wait does next.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Spin,
    Yield,
    Sleep,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_for_room_sleeps_at_once_after_one_that_slept() {
        let zero = Duration::ZERO;
        let mut first = Backoff::for_room(false);
        assert_eq!(first.past_spin(zero, true), Step::Yield);
        assert!(!first.slept());
        assert_eq!(first.past_spin(YIELD_FOR, true), Step::Sleep);
        assert!(first.slept());
        let mut next = Backoff::for_room(first.slept());
        assert_eq!(next.past_spin(zero, true), Step::Sleep, "no yielding phase");
        // A wait for one small operation the NIC serves elsewhere spins first, as before.
        let mut op = Backoff::one_op(8);
        assert_eq!(op.past_spin(zero, true), Step::Spin);
        assert_eq!(op.past_spin(zero, false), Step::Yield);
        assert_eq!(op.past_spin(OP_SPIN, true), Step::Yield);
        assert_eq!(op.past_spin(YIELD_FOR, true), Step::Sleep);
        // A bulk one yields for as long as its bytes take at 1 GB/s before it sleeps.
        let mut bulk = Backoff::one_op(1 << 20);
        assert_eq!(bulk.past_spin(zero, true), Step::Yield, "never spins");
        assert_eq!(
            bulk.past_spin(Duration::from_micros(1000), true),
            Step::Yield
        );
        assert_eq!(
            bulk.past_spin(Duration::from_micros(1049), true),
            Step::Sleep
        );
    }
}
