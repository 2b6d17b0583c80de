//! AM flow control of the portals conduit, after GASNet-over-Portals: credits. A requester may
//! have at most its credit's worth of request bytes at a target that the target has not yet
//! answered; each reply gives back what its request cost. Every peer starts with a base share
//! of the target's receive-buffer capacity; the rest is the target's pool. A request sent with
//! too little credit left for the next one asks for a loan, which the target grants in its
//! reply while its pool lasts; the borrower repays (in a later request) once it holds a loan
//! more than it needs.
//!
//! A target's bases and loans never exceed what its receive buffers hold while it drains
//! nothing, so a credited request always finds room: the catch-basin stays empty unless a peer
//! ignores its credit. Pure state, no I/O.

/// Every request costs at least this much: undrained requests, and so their events, are few
/// enough for the AM event queue.
pub const MIN_COST: u64 = 64;

/// What a request of `len` bytes costs.
pub fn cost(len: usize) -> u64 {
    (len as u64).max(MIN_COST)
}

/// What a request carries for flow control.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Carry {
    /// The sender runs short: lend it credit in the reply.
    pub ask: bool,
    /// Credit the sender gives back to the target's pool.
    pub repay: u64,
}

/// Flow-control counters, as sender and as target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CreditStats {
    /// Requests that had to wait for credit (counted once per wait).
    pub stalls: u64,
    /// Requests that asked for a loan.
    pub asks: u64,
    /// Loans this node lent.
    pub loans: u64,
    /// Loans this node repaid.
    pub repaid: u64,
    /// Grants or repayments that broke the protocol (a hostile or confused peer), ignored.
    pub bad: u64,
}

#[derive(Debug)]
pub struct Credits {
    base: u64,
    loan: u64,
    max_am: u64,
    /// As a requester, per target: credit in hand, and how much of the holding was lent.
    avail: Vec<u64>,
    borrowed: Vec<u64>,
    stalled: Vec<bool>,
    /// As a target, per requester: credit lent out; and what is left to lend.
    lent: Vec<u64>,
    pool: u64,
    pub stats: CreditStats,
}

impl Credits {
    /// Receive-buffer capacity that `nodes` peers need: bases of two maximal AMs each, and as
    /// much again to lend.
    pub fn capacity_for(nodes: u32, max_am: usize) -> u64 {
        4 * nodes.max(1) as u64 * max_am as u64
    }

    /// Credits of a node among `nodes` whose receive buffers hold `capacity` bytes undrained
    /// (at least [`Credits::capacity_for`]).
    pub fn new(nodes: u32, capacity: u64, max_am: usize) -> Credits {
        let n = nodes.max(1) as usize;
        let base = capacity / (2 * n as u64);
        debug_assert!(base >= 2 * max_am as u64, "capacity below capacity_for");
        Credits {
            base,
            loan: base,
            max_am: max_am as u64,
            avail: vec![base; n],
            borrowed: vec![0; n],
            stalled: vec![false; n],
            lent: vec![0; n],
            pool: capacity - base * n as u64,
            stats: CreditStats::default(),
        }
    }

    /// A request of `len` bytes to `dest`: takes its cost if the credit is there, saying what
    /// the request must carry; `None` means wait (for replies giving credit back).
    pub fn take(&mut self, dest: u32, len: usize) -> Option<Carry> {
        let (d, c) = (dest as usize, cost(len));
        if self.avail[d] < c {
            if !std::mem::replace(&mut self.stalled[d], true) {
                self.stats.stalls += 1;
            }
            return None;
        }
        self.stalled[d] = false;
        self.avail[d] -= c;
        let ask = self.avail[d] < self.max_am;
        let mut repay = 0;
        if ask {
            self.stats.asks += 1;
        } else if self.borrowed[d] >= self.loan && self.base + self.borrowed[d] - self.avail[d] == c
        {
            // Quiet towards `dest` (this is the only request out there): the loan goes back.
            repay = self.loan;
            self.avail[d] -= repay;
            self.borrowed[d] -= repay;
            self.stats.repaid += 1;
        }
        Some(Carry { ask, repay })
    }

    /// The reply to our request of `len` bytes to `dest` granted `grant`: the cost back, and
    /// perhaps a loan. A grant below the cost or above cost and one loan is not believed.
    pub fn granted(&mut self, dest: u32, len: usize, grant: u64) {
        let (d, c) = (dest as usize, cost(len));
        if grant < c || grant - c > self.loan {
            self.stats.bad += 1;
            self.avail[d] += c;
            return;
        }
        self.avail[d] += grant;
        self.borrowed[d] += grant - c;
    }

    /// A request from `src` gave back `repay` of what it was lent.
    pub fn repaid(&mut self, src: u32, repay: u64) {
        let s = src as usize;
        let r = repay.min(self.lent[s]);
        if r != repay {
            self.stats.bad += 1;
        }
        self.lent[s] -= r;
        self.pool += r;
    }

    /// What the reply to `src`'s request of `len` bytes grants: its cost, and a loan if the
    /// request asked and the pool has one.
    pub fn grant(&mut self, src: u32, len: usize, ask: bool) -> u64 {
        let s = src as usize;
        let mut g = cost(len);
        if ask && self.pool >= self.loan {
            self.pool -= self.loan;
            self.lent[s] += self.loan;
            self.stats.loans += 1;
            g += self.loan;
        }
        g
    }

    /// Credit in hand for requests to `dest`.
    #[cfg(test)]
    pub fn available(&self, dest: u32) -> u64 {
        self.avail[dest as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MAX_AM: usize = 16 * 1024;

    #[test]
    fn a_short_sender_asks_and_borrows_then_repays() {
        let cap = Credits::capacity_for(2, MAX_AM);
        let (mut s, mut t) = (Credits::new(2, cap, MAX_AM), Credits::new(2, cap, MAX_AM));
        let base = s.available(1);
        assert_eq!(base, cap / 4);
        // Spend down to the last maximal AM: that request asks.
        let mut sent = Vec::new();
        loop {
            let c = s.take(1, MAX_AM).expect("credit");
            sent.push(c);
            if c.ask {
                break;
            }
        }
        assert!(s.available(1) < MAX_AM as u64);
        assert_eq!(s.take(1, MAX_AM), None, "out of credit: wait");
        assert_eq!(s.stats.stalls, 1);
        // The target answers everything; the asking request's reply carries a loan.
        for c in &sent {
            t.repaid(0, c.repay);
            let g = t.grant(0, MAX_AM, c.ask);
            s.granted(1, MAX_AM, g);
        }
        assert_eq!((t.stats.loans, s.available(1)), (1, 2 * base));
        // Quiet again: the next request repays the loan, and the target's pool has it back.
        let c = s.take(1, 100).unwrap();
        assert_eq!(
            c,
            Carry {
                ask: false,
                repay: base
            }
        );
        t.repaid(0, c.repay);
        s.granted(1, 100, t.grant(0, 100, false));
        assert_eq!(s.available(1), base);
        assert_eq!(t.pool, cap - 2 * base);
    }

    #[test]
    fn lies_from_peers_are_counted_and_ignored() {
        let cap = Credits::capacity_for(2, MAX_AM);
        let mut c = Credits::new(2, cap, MAX_AM);
        let before = c.available(1);
        c.take(1, 1000).unwrap();
        c.granted(1, 1000, u64::MAX);
        assert_eq!(c.available(1), before, "only the cost comes back");
        c.repaid(1, 12345);
        assert_eq!(c.stats.bad, 2);
        assert_eq!(c.pool, cap - 2 * before, "nothing was lent to 1");
    }

    proptest! {
        /// Any interleaving of sends, arrivals and replies among 3 nodes: what a target's
        /// senders hold plus what they have outstanding there never exceeds its capacity, and
        /// when everything is answered every sender can send a maximal AM again.
        #[test]
        fn credit_never_exceeds_capacity(steps in proptest::collection::vec((0u8..3, 0u8..3, 0usize..MAX_AM + 1, 0u8..3), 1..400)) {
            let n = 3u32;
            let cap = Credits::capacity_for(n, MAX_AM);
            let mut nodes: Vec<Credits> = (0..n).map(|_| Credits::new(n, cap, MAX_AM)).collect();
            // Requests sent and not yet answered: (from, to, len, carry, arrived).
            let mut flight: Vec<(u32, u32, usize, Carry, bool)> = Vec::new();
            for (from, to, len, what) in steps {
                let (from, to) = (from as u32, to as u32);
                match what {
                    0 => if let Some(c) = nodes[from as usize].take(to, len) {
                        flight.push((from, to, len, c, false));
                    },
                    1 => if let Some(f) = flight.iter_mut().find(|f| !f.4) {
                        f.4 = true;
                        nodes[f.1 as usize].repaid(f.0, f.3.repay);
                    },
                    _ => if let Some(i) = flight.iter().position(|f| f.4) {
                        let (s, t, len, c, _) = flight.remove(i);
                        let g = nodes[t as usize].grant(s, len, c.ask);
                        nodes[s as usize].granted(t, len, g);
                    },
                }
                for t in 0..n {
                    let outstanding: u64 = flight.iter().filter(|f| f.1 == t).map(|f| cost(f.2)).sum();
                    let held: u64 = nodes.iter().map(|s| s.available(t)).sum();
                    prop_assert!(held + outstanding <= cap);
                }
            }
            for (s, t, len, c, arrived) in std::mem::take(&mut flight) {
                if !arrived {
                    nodes[t as usize].repaid(s, c.repay);
                }
                let g = nodes[t as usize].grant(s, len, c.ask);
                nodes[s as usize].granted(t, len, g);
            }
            for s in 0..n {
                for t in 0..n {
                    prop_assert!(nodes[s as usize].available(t) >= MAX_AM as u64);
                }
                prop_assert_eq!(nodes[s as usize].stats.bad, 0);
            }
        }
    }
}
