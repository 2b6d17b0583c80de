//! The bulk helper: a second NIC thread that serves one of this process's hosts while traffic
//! keeps the loop busy, and ends once one thread is enough again.
//!
//! The local default runs every host in one loop: on two cores that keeps a second spinning
//! thread away from the ranks, and a live second thread would cost every socket call a file
//! reference (measured: +0.23 µs a round trip). But a stream then has one core seal, send,
//! open and copy both sides' datagrams. So when the loop has been busy without a break for
//! [`LEND_AFTER_NS`], or for [`LEND_ABOVE`] of a [`WINDOW_NS`] while sending at least
//! [`LEND_BYTES`], one host's turns move to a helper thread. It hands the host back (and
//! exits) once one thread could do the work of both again: when the two threads' busy shares
//! of a [`WINDOW_NS`] add up to less than [`RECALL_BELOW`] — a stream ended, or a ping-pong
//! followed it (whose latency a second spinning thread on two cores costs ~60%: AM Medium
//! 8 B 11.3 → 18.6 µs measured while a flood's helper stayed). The host core is untouched:
//! the same turns run, on another thread.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use super::HostNic;
use crate::shm::cores::{self, Load};

/// Busy this long without an idle turn: lend a host (streams and RandomAccess floods get
/// there; small ping-pongs idle between round trips).
pub(super) const LEND_AFTER_NS: u64 = 2_000_000;
/// The window over which each thread measures its busy share.
pub(super) const WINDOW_NS: u64 = 1_000_000;
/// The loop busy for this share of a window (per mille) while its hosts sent at least
/// [`LEND_BYTES`] in it: lend a host. A loop of blocking MiB puts gets there, though it idles
/// a few µs between puts, which breaks the stretch [`LEND_AFTER_NS`] asks for (1 MiB puts
/// 196–200 → 153–168 µs). Without the bytes, an 8-byte Portals put ping-pong got there too,
/// and a second spinning thread cost it 5.0–5.2 → 5.8–6.2 µs.
pub(super) const LEND_ABOVE: u32 = 900;
/// See [`LEND_ABOVE`]: bulk traffic, 1 GB/s.
pub(super) const LEND_BYTES: u64 = 1 << 20;
/// Both threads' busy shares of a window together below this (per mille): one thread is
/// enough, the host goes back.
const RECALL_BELOW: u32 = 750;

/// A host NIC and who turns it: the loop, or (lent) the helper.
pub(super) struct Served {
    nic: Mutex<HostNic>,
    /// The helper serves it: the loop skips its turns.
    lent: AtomicBool,
    /// The loop waits for the lock (an attach event): the helper stands back between turns
    /// until it has been served.
    wanted: AtomicBool,
}

impl Served {
    pub fn new(h: HostNic) -> Served {
        Served {
            nic: Mutex::new(h),
            lent: AtomicBool::new(false),
            wanted: AtomicBool::new(false),
        }
    }

    pub fn lent(&self) -> bool {
        self.lent.load(Ordering::Acquire)
    }

    /// The NIC for whoever turns it (the loop for hosts not lent: never contended).
    pub fn turn_lock(&self) -> MutexGuard<'_, HostNic> {
        // A turn that panicked took the process down with it; nothing half-done to guard.
        self.nic.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The NIC for the loop, whoever turns it: a lent host's helper lets go after its turn.
    pub fn lock(&self) -> Wanted<'_> {
        let flag = self.lent().then(|| {
            self.wanted.store(true, Ordering::Release);
            &self.wanted
        });
        Wanted {
            guard: self.turn_lock(),
            flag,
        }
    }
}

/// The loop's hold on a host; the helper may go on once it is dropped (the flag is cleared
/// first, then the guard, a field, unlocks).
pub(super) struct Wanted<'a> {
    guard: MutexGuard<'a, HostNic>,
    flag: Option<&'a AtomicBool>,
}

impl std::ops::Deref for Wanted<'_> {
    type Target = HostNic;
    fn deref(&self) -> &HostNic {
        &self.guard
    }
}

impl std::ops::DerefMut for Wanted<'_> {
    fn deref_mut(&mut self) -> &mut HostNic {
        &mut self.guard
    }
}

impl Drop for Wanted<'_> {
    fn drop(&mut self) {
        if let Some(f) = self.flag {
            f.store(false, Ordering::Release);
        }
    }
}

/// Where the helper runs: the process's CPUs but the loop's (`nic`, if it is pinned) — a
/// thread starts with its parent's affinity, which would put both NIC threads on one core.
pub(super) struct Place {
    pub cpus: Vec<u32>,
    pub nic: Option<u32>,
}

/// Hands `host` to a new helper thread, which turns it on the loop's clock until the two
/// threads' load (the loop's published in `loop_load`, per mille) says one is enough, or
/// `stop` is set, then gives it back.
pub(super) fn lend(
    host: Arc<Served>,
    place: Place,
    clock: Instant,
    loop_load: Arc<AtomicU32>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    loop_load.store(1000, Ordering::Relaxed);
    host.lent.store(true, Ordering::Release);
    let h = host.clone();
    let spawned = std::thread::Builder::new()
        .name("softnicd-bulk".into())
        .spawn(move || {
            let placed = match place.nic {
                Some(nic) => cores::leave(&place.cpus, nic),
                None => cores::set_allowed(&place.cpus).is_ok(),
            };
            if !placed {
                tracing::debug!("bulk helper stays on the loop's CPUs");
            }
            serve(&h, clock, &loop_load, &stop)
        });
    if spawned.is_err() {
        host.lent.store(false, Ordering::Release);
    }
    spawned
}

fn serve(host: &Served, clock: Instant, loop_load: &AtomicU32, stop: &AtomicBool) {
    {
        let mut h = host.turn_lock();
        h.counters.bulk_lends += 1;
        h.counters.bulk_serving = true;
    }
    let mut load = Load::new(clock.elapsed().as_nanos() as u64, WINDOW_NS);
    let mut busy = true;
    while !stop.load(Ordering::Relaxed) {
        let at = Instant::now();
        let now = at.duration_since(clock).as_nanos() as u64;
        if let Some(share) = load.turn(now, busy) {
            if share + loop_load.load(Ordering::Relaxed) < RECALL_BELOW {
                break;
            }
        }
        busy = host.turn_lock().turn(now, at);
        while host.wanted.load(Ordering::Acquire) {
            // Rare (attach events), and the loop may share this CPU (placement refused).
            std::thread::yield_now();
        }
        // Ranks share this CPU: an idle turn gives it to one that waits (a blocking put's
        // rank saw its completion ~2 µs sooner than when the helper yielded every fourth idle
        // turn: 256 KiB 34.1 -> 31.9 µs, docs/performance.md stop 76).
        if !busy {
            std::thread::yield_now();
        }
    }
    tracing::debug!("bulk helper hands its host back");
    host.turn_lock().counters.bulk_serving = false;
    host.lent.store(false, Ordering::Release);
}
