//! A seeded, deterministic simulated datagram network for tests.
//!
//! Time is passed in; loss, duplication, reordering (extra delay), base delay, jitter and MTU
//! are knobs; a host can be black-holed to simulate a crash or partition. Same seed, same run.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub seed: u64,
    /// Probability a datagram is lost.
    pub loss: f64,
    /// Probability a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability a datagram is held back long enough to be overtaken.
    pub reorder: f64,
    pub delay_ns: u64,
    pub jitter_ns: u64,
    /// Datagrams larger than this are dropped (as an IP network without fragmentation would).
    pub mtu: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 1,
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            delay_ns: 10_000,
            jitter_ns: 2_000,
            mtu: 65_507,
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct SimStats {
    pub sent: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub too_big: u64,
    pub blackholed: u64,
}

/// A datagram in flight: (due time, tie-breaking counter, destination host, bytes).
type InFlight = Reverse<(u64, u64, u16, Vec<u8>)>;

pub struct SimNet {
    cfg: SimConfig,
    rng: StdRng,
    queue: BinaryHeap<InFlight>,
    counter: u64,
    down: HashSet<u16>,
    pub stats: SimStats,
}

impl SimNet {
    pub fn new(cfg: SimConfig) -> SimNet {
        SimNet {
            rng: StdRng::seed_from_u64(cfg.seed),
            cfg,
            queue: BinaryHeap::new(),
            counter: 0,
            down: HashSet::new(),
            stats: SimStats::default(),
        }
    }

    /// Makes `host` silent: nothing it sends or is sent arrives.
    pub fn set_down(&mut self, host: u16, down: bool) {
        if down {
            self.down.insert(host);
        } else {
            self.down.remove(&host);
        }
    }

    pub fn send(&mut self, now: u64, from: u16, to: u16, bytes: &[u8]) {
        self.stats.sent += 1;
        if bytes.len() > self.cfg.mtu {
            self.stats.too_big += 1;
            return;
        }
        if self.down.contains(&from) || self.down.contains(&to) {
            self.stats.blackholed += 1;
            return;
        }
        if self.rng.gen_bool(self.cfg.loss) {
            self.stats.lost += 1;
            return;
        }
        let copies = if self.rng.gen_bool(self.cfg.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut at = now + self.cfg.delay_ns + self.rng.gen_range(0..=self.cfg.jitter_ns);
            if self.rng.gen_bool(self.cfg.reorder) {
                self.stats.reordered += 1;
                at += self.cfg.delay_ns * 4 + self.rng.gen_range(0..=self.cfg.delay_ns * 4);
            }
            self.counter += 1;
            self.queue
                .push(Reverse((at, self.counter, to, bytes.to_vec())));
        }
    }

    /// The next datagram due by `now`: (destination host, bytes).
    pub fn recv_due(&mut self, now: u64) -> Option<(u16, Vec<u8>)> {
        match self.queue.peek() {
            Some(Reverse((at, ..))) if *at <= now => {
                let Reverse((_, _, to, b)) = self.queue.pop().expect("peeked");
                Some((to, b))
            }
            _ => None,
        }
    }

    /// When the next datagram is due, if any is in flight.
    pub fn next_due(&self) -> Option<u64> {
        self.queue.peek().map(|Reverse((at, ..))| *at)
    }
}
