//! Seeded fault injection on sent datagrams (drop, duplicate), shared by the drivers, so that
//! tests exercise the reliability layer through real sockets and repeat exactly per seed.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::udp::DriverStats;
use crate::config::Fault;

pub struct FaultInjector {
    fault: Fault,
    rng: StdRng,
}

impl FaultInjector {
    /// `None` when `fault` injects nothing. `salt` makes each host's sequence its own.
    pub fn new(fault: Option<Fault>, salt: u64) -> Option<FaultInjector> {
        let fault = fault.filter(|f| f.drop > 0.0 || f.duplicate > 0.0)?;
        let rng = StdRng::seed_from_u64(fault.seed ^ salt);
        Some(FaultInjector { fault, rng })
    }

    /// How many copies of the next datagram go out: 0 (dropped), 1, or 2 (duplicated).
    pub fn copies(&mut self, stats: &mut DriverStats) -> usize {
        if self.rng.gen_bool(self.fault.drop) {
            stats.fault_dropped += 1;
            return 0;
        }
        if self.rng.gen_bool(self.fault.duplicate) {
            stats.fault_duplicated += 1;
            return 2;
        }
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_repeatability() {
        let f = Fault {
            drop: 0.1,
            duplicate: 0.05,
            seed: 3,
        };
        let run = || {
            let mut inj = FaultInjector::new(Some(f.clone()), 9).unwrap();
            let mut st = DriverStats::default();
            let v: Vec<usize> = (0..10_000).map(|_| inj.copies(&mut st)).collect();
            (v, st.fault_dropped, st.fault_duplicated)
        };
        let (a, dropped, dup) = run();
        assert_eq!(a, run().0, "same seed, same faults");
        assert!((800..1200).contains(&dropped), "{dropped}");
        assert!((300..650).contains(&dup), "{dup}");
        assert!(FaultInjector::new(Some(Fault::default()), 1).is_none());
    }
}
