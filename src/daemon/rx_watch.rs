//! When a host's turn looks at its UDP socket, and when it stops: a pure state machine, so
//! that the rules that keep empty `recv`s (0.3 µs each here) off a round trip's path are
//! testable without sockets.
//!
//! Three sources of knowledge: datagrams this process's own hosts sent (over loopback they
//! are in the socket when `send` returns, so they are counted, not looked for); readiness
//! (epoll, a wake-up, the periodic look for other processes' datagrams); and what the last
//! look found. After a lone datagram the socket is usually empty, so the look that would
//! prove it waits while the turn has commands to send (one turn at most).

/// What a host knows of its socket's receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// A recv found it empty, or everything counted in was received.
    Empty,
    /// A lone datagram was taken; more may have come behind it.
    Unproven,
    /// Datagrams are, or may well be, waiting.
    Ready,
}

/// How a look goes on after a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Recv,
    Stop,
}

#[derive(Debug)]
pub struct RxWatch {
    known: Known,
    /// A look was put off last turn.
    deferred: bool,
    /// Datagrams this process's hosts sent here and not yet received.
    expect: usize,
    /// The current look only takes what was counted in.
    counted: bool,
    /// Some peer lives in another process: look every turn.
    pub every_turn: bool,
}

impl Default for RxWatch {
    fn default() -> RxWatch {
        RxWatch {
            known: Known::Ready,
            deferred: false,
            expect: 0,
            counted: false,
            every_turn: true,
        }
    }
}

impl RxWatch {
    /// Datagrams may be waiting (epoll, a wake-up, or time to look for other processes').
    pub fn mark(&mut self) {
        self.known = Known::Ready;
    }

    /// A host of this process sent a datagram here.
    pub fn expect(&mut self) {
        self.expect += 1;
    }

    /// Whether this turn looks; `commands` says the turn has something to send. `counting`
    /// says the driver delivers datagrams one by one as sent (UDP), so counting them works.
    pub fn start(&mut self, commands: bool, counting: bool) -> bool {
        if self.every_turn && self.known == Known::Empty {
            self.known = Known::Unproven;
        }
        let look = self.expect > 0
            || match self.known {
                Known::Ready => true,
                Known::Unproven => !commands || self.deferred,
                Known::Empty => false,
            };
        self.deferred = !look && self.known == Known::Unproven;
        if look {
            self.counted = counting && self.known == Known::Empty;
            self.known = Known::Unproven;
        }
        look
    }

    /// A recv found the socket empty: the look ends.
    pub fn found_empty(&mut self) {
        self.known = Known::Empty;
        self.expect = 0;
    }

    /// A datagram came; `bursting` and `buffered` are the driver's view (more likely waiting,
    /// or read ahead). On `Stop` with `settled()` true the socket is known empty without a
    /// recv having said so.
    pub fn got(&mut self, bursting: bool, buffered: bool) -> Next {
        self.expect = self.expect.saturating_sub(1);
        if self.counted {
            if self.expect == 0 && !buffered {
                self.known = Known::Empty;
                return Next::Stop;
            }
            return Next::Recv;
        }
        // A lone datagram (a round trip, not a stream) is answered before looking again.
        if bursting {
            Next::Recv
        } else {
            Next::Stop
        }
    }

    /// The look ran out of budget or stopped: whether more is known to wait.
    pub fn end(&mut self, bursting: bool) {
        if self.known == Known::Unproven && bursting {
            self.known = Known::Ready;
        }
    }

    /// The last look ended by counting, not by a recv that found nothing.
    pub fn settled(&self) -> bool {
        self.counted && self.known == Known::Empty
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet() -> RxWatch {
        let mut w = RxWatch {
            every_turn: false,
            ..RxWatch::default()
        };
        assert!(w.start(false, true), "a new host looks");
        w.found_empty();
        w
    }

    #[test]
    fn counted_datagrams_need_no_empty_recv() {
        let mut w = quiet();
        assert!(!w.start(false, true), "nothing sent here: no look");
        w.expect();
        assert!(
            w.start(true, true),
            "a datagram from a host of this process"
        );
        assert_eq!(w.got(false, false), Next::Stop, "that was all of them");
        assert!(w.settled());
        assert!(!w.start(false, true), "and no look to prove it");
        w.expect();
        w.expect();
        assert!(w.start(false, true));
        assert_eq!(w.got(true, false), Next::Recv, "one of two");
        assert_eq!(w.got(true, false), Next::Stop);
    }

    #[test]
    fn a_batch_read_ahead_is_taken_before_stopping() {
        let mut w = quiet();
        w.expect();
        assert!(w.start(false, true));
        assert_eq!(w.got(true, true), Next::Recv);
    }

    #[test]
    fn a_lone_datagram_is_answered_and_the_proof_waits_one_turn_for_commands() {
        let mut w = quiet();
        w.mark();
        assert!(w.start(false, true));
        assert!(!w.settled());
        assert_eq!(w.got(false, false), Next::Stop, "answer first");
        w.end(false);
        assert!(!w.start(true, true), "commands go out first");
        assert!(w.start(true, true), "but only for one turn");
        w.found_empty();
        assert!(!w.start(false, true));
    }

    #[test]
    fn an_idle_turn_proves_a_lone_datagram_alone() {
        let mut w = quiet();
        w.mark();
        assert!(w.start(false, true));
        assert_eq!(w.got(false, false), Next::Stop);
        assert!(w.start(false, true), "no commands: look now");
    }

    #[test]
    fn a_burst_is_drained_and_a_cut_one_resumed() {
        let mut w = quiet();
        w.mark();
        assert!(w.start(false, true));
        assert_eq!(w.got(true, false), Next::Recv);
        w.end(true);
        assert!(
            w.start(true, true),
            "the budget ran out mid-burst: commands do not delay it"
        );
    }

    #[test]
    fn hosts_with_peers_elsewhere_look_every_turn() {
        let mut w = RxWatch::default();
        assert!(w.start(false, true));
        w.found_empty();
        assert!(
            w.start(false, true),
            "another process may have sent something"
        );
        w.found_empty();
        assert!(!w.start(true, true), "a turn with commands sends first");
        assert!(w.start(true, true), "and looks the next");
    }

    #[test]
    fn tcp_is_never_counted() {
        let mut w = quiet();
        w.expect();
        assert!(w.start(false, false));
        assert_eq!(w.got(false, false), Next::Stop);
        assert!(!w.settled());
    }
}
