//! softnicd: the event loop that runs one or more host NICs, their attach sockets and sessions.
//!
//! Waiting is adaptive: while work keeps arriving the loop spins; after `spin_us` of idleness it
//! yields, then announces that it sleeps (a flag in every client's control block) and blocks in
//! epoll on sockets and doorbells, so that an idle daemon burns no core and a busy one makes no
//! syscall to be woken. A daemon pinned to a core (`nic_cpu`) yields it only to clients that
//! wait on that core (see [`crate::shm::cores`]).

mod helper;
mod host;
mod rx_watch;
mod session;
pub mod signals;

pub use host::HostNic;
pub use session::{CMD_RING_BYTES, CQ_ENTRIES};

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};

use crate::config::Config;
use crate::shm::cores::Load;
use helper::Served;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot start host {host}")]
    Start { host: String, source: io::Error },
    #[error("event loop failed: {0}")]
    Io(#[from] io::Error),
}

/// Token layout: host index × STRIDE + kind; kinds 0 socket, 1 listener, 2+2s session s,
/// 3+2s its doorbell.
const STRIDE: usize = 1 << 20;

/// A yield that kept the daemon off its core this long went to a rank that computes (a rank
/// that waits gives it back within microseconds; a computing one keeps it until a tick, 4 ms).
const SLOW_YIELD_NS: u64 = 1_000_000;
/// Then idle turns keep the core this long, except for clients that announce they wait on it.
const KEEP_CORE_NS: u64 = 100_000_000;
/// An idle turn in this many gives the core away (when it may): a rank sharing it waits that
/// long for its data. Two daemons and two ranks on two cores (namespace hosts): gni put 8 B
/// ~11.3 µs at 4 against ~13.3 at 8; the local default alike at both (measured).
const YIELD_EVERY: u64 = 4;

pub struct Daemon {
    poll: Poll,
    events: Events,
    hosts: Vec<Arc<Served>>,
    /// The bulk helper's thread while it serves a host (see [`helper`]).
    helper: Option<JoinHandle<()>>,
    /// Clients may have attached or detached since they were last counted: an attach
    /// socket's event, or a host the loop turned said so.
    clients_stale: bool,
    /// The loop's busy share (per mille) of the last window, for the helper to weigh.
    loop_load: Arc<AtomicU32>,
    /// Whether every host of the config runs here (then a host counts the datagrams its
    /// neighbours send it instead of looking for them every turn).
    all_here: bool,
    clock: Instant,
    spin_ns: u64,
    /// Which allowed CPU to pin the loop's thread to (`nic_cpu`), and the CPU it got.
    pin: Option<i64>,
    cpu: Option<u32>,
    /// The CPUs the process may run on (before the loop's thread was pinned).
    cpus: Vec<u32>,
    /// Pinned: until when idle turns keep the core unless a client waits on it (a yield that
    /// lost the core for a scheduler tick showed that the other tenant computes).
    keep_core_until: u64,
    stop: Arc<AtomicBool>,
    /// Host index (of the config) → position in `hosts`, for the hosts this process serves.
    served: Vec<Option<usize>>,
    tokens: Vec<usize>,
}

impl Daemon {
    /// Starts the NICs of the hosts at `indices` of `cfg` in this process.
    pub fn new(
        cfg: &Config,
        indices: &[u16],
        stop: Arc<AtomicBool>,
    ) -> Result<Daemon, DaemonError> {
        let poll = Poll::new()?;
        let mut hosts = Vec::new();
        for (k, &i) in indices.iter().enumerate() {
            let base = k * STRIDE;
            let h = HostNic::new(cfg, i, poll.registry(), Token(base)).map_err(|source| {
                DaemonError::Start {
                    host: cfg.hosts[i as usize].name.clone(),
                    source,
                }
            })?;
            poll.registry().register(
                &mut SourceFd(&h.listener.as_raw_fd()),
                Token(base + 1),
                Interest::READABLE,
            )?;
            tracing::info!(host = %h.core.name, addr = %cfg.hosts[i as usize].addr, "NIC up");
            hosts.push(h);
        }
        let all_here = (0..cfg.hosts.len() as u16).all(|i| indices.contains(&i));
        let ears = host::Ears::default();
        for h in &mut hosts {
            h.rx_watch.every_turn = !all_here;
            h.ears = ears.clone();
        }
        Ok(Daemon {
            poll,
            events: Events::with_capacity(256),
            hosts: hosts
                .into_iter()
                .map(|h| Arc::new(Served::new(h)))
                .collect(),
            helper: None,
            clients_stale: false,
            loop_load: Arc::new(AtomicU32::new(0)),
            all_here,
            clock: Instant::now(),
            spin_ns: cfg.cluster.spin_us * 1000,
            pin: cfg.nic_cpu_for(indices),
            cpu: None,
            cpus: Vec::new(),
            keep_core_until: 0,
            tokens: Vec::with_capacity(256),
            served: (0..cfg.hosts.len() as u16)
                .map(|h| indices.iter().position(|&i| i == h))
                .collect(),
            stop,
        })
    }

    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    /// Runs until `stop` is set (on the thread it pins to `nic_cpu`, if set).
    pub fn run(&mut self) -> Result<(), DaemonError> {
        let ran = self.run_loop();
        // The helper ends with the loop, whatever ended it.
        if let Some(t) = self.helper.take() {
            self.stop.store(true, Ordering::Relaxed);
            Self::joined(t);
        }
        ran
    }

    fn run_loop(&mut self) -> Result<(), DaemonError> {
        // What the bulk helper may run on: the CPUs but the NIC's.
        self.cpus = crate::shm::cores::allowed().unwrap_or_default();
        if let Some(index) = self.pin {
            // A core of its own is an optimisation: without it the NIC still works.
            self.cpu = crate::shm::cores::pin(index).unwrap_or_else(|e| {
                tracing::warn!("not pinning the NIC thread: {e}");
                None
            });
            tracing::info!(cpu = ?self.cpu, "NIC thread placement");
            for h in &self.hosts {
                h.turn_lock().nic_cpu = self.cpu;
            }
        }
        let mut idle_since = self.now();
        let mut busy_turns = 0u64;
        let mut idle_turns = 0u64;
        let mut sent_to = Vec::new();
        // The loop's load over each window: a busy one lends a host, and while one is lent
        // the helper weighs it to decide when to give it back.
        let mut load = Load::new(idle_since, helper::WINDOW_NS);
        // Bytes every host had sent at the end of the last window (none while a host is
        // lent: the loop does not count it then).
        let mut sent_before: Option<u64> = None;
        let mut busy_since = idle_since;
        let mut busy = false;
        while !self.stop.load(Ordering::Relaxed) {
            // One clock read per turn, shared by every host (a read is a good part of an idle
            // turn, and idle turns are how fast new work is seen).
            let at = std::time::Instant::now();
            let now = at.duration_since(self.clock).as_nanos() as u64;
            if let Some(share) = load.turn(now, busy) {
                self.loop_load.store(share, Ordering::Relaxed);
                if self.helper.is_none() {
                    let sent = self.bytes_sent();
                    let bulk =
                        sent_before.is_some_and(|b| sent.saturating_sub(b) >= helper::LEND_BYTES);
                    sent_before = Some(sent);
                    if share >= helper::LEND_ABOVE && bulk {
                        self.lend();
                    }
                } else {
                    sent_before = None;
                }
            }
            busy = false;
            for k in 0..self.hosts.len() {
                if self.hosts[k].lent() {
                    continue;
                }
                {
                    let mut h = self.hosts[k].turn_lock();
                    busy |= h.turn(now, at);
                    self.clients_stale |= std::mem::take(&mut h.clients_changed);
                    sent_to.clear();
                    sent_to.extend_from_slice(&h.sent_to);
                }
                // Loopback to a host of this process: the datagram is in its socket already.
                for &to in &sent_to {
                    if let Some(j) = self.served.get(to as usize).copied().flatten() {
                        if !self.hosts[j].lent() {
                            self.hosts[j].turn_lock().rx_watch.expect();
                        }
                    }
                }
            }
            self.publish_clients();
            if busy {
                busy_turns += 1;
                idle_turns = 0;
                idle_since = now;
                // A long busy stretch still looks at new connections now and then, and may
                // hand a host to the bulk helper.
                if busy_turns.is_multiple_of(64) {
                    self.poll_events(Some(Duration::ZERO))?;
                    self.join_helper();
                    if now - busy_since >= helper::LEND_AFTER_NS {
                        self.lend();
                    }
                }
                continue;
            }
            busy_since = now;
            // Idle. A turn that finds nothing makes no syscall (rings are shared memory, and
            // datagrams between hosts of this process are counted, see `rx_watch`), so spin on
            // turns; every 16th idle turn look at the sockets and ask epoll (attach sockets,
            // doorbells), give the core away every 4th (ranks may outnumber cores) — when
            // pinned only to a client waiting on this core, as a rank that computes would keep
            // it until the next tick — and after `spin_us` sleep in epoll.
            idle_turns += 1;
            if idle_turns.is_multiple_of(16) {
                self.join_helper();
                // Datagrams not sent by this process (none are expected when it runs every
                // host): look at the sockets now and then.
                for h in self.hosts.iter().filter(|h| !h.lent()) {
                    h.turn_lock().rx_watch.mark();
                }
                if self.poll_events(Some(Duration::ZERO))? {
                    idle_since = now;
                    continue;
                }
            }
            let idle = now - idle_since;
            // A lent host comes back without a wake-up: no sleep until it has.
            if idle < self.spin_ns || self.helper.is_some() {
                if idle_turns.is_multiple_of(YIELD_EVERY) && self.may_yield(now) {
                    self.yield_core();
                } else {
                    std::hint::spin_loop();
                }
            } else {
                self.sleep()?;
                idle_since = self.now();
            }
        }
        Ok(())
    }

    /// Datagram bytes the hosts have sent so far (asked while none is lent).
    fn bytes_sent(&self) -> u64 {
        self.hosts
            .iter()
            .map(|h| h.turn_lock().core.bytes_sent())
            .sum()
    }

    /// Hands the last host to the bulk helper (the loop keeps the others), if this process
    /// serves more than one and none is lent yet.
    fn lend(&mut self) {
        // One CPU: a second thread would only take turns with the loop.
        if self.helper.is_some() || self.hosts.len() < 2 || self.cpus.len() < 2 {
            return;
        }
        // The loop no longer sees what the helper's host sends its neighbours: look every turn.
        for h in &self.hosts {
            h.turn_lock().rx_watch.every_turn = true;
        }
        let host = self.hosts[self.hosts.len() - 1].clone();
        let place = helper::Place {
            cpus: self.cpus.clone(),
            nic: self.cpu,
        };
        let loop_load = self.loop_load.clone();
        match helper::lend(host, place, self.clock, loop_load, self.stop.clone()) {
            Ok(t) => {
                tracing::debug!("bulk helper serves the last host");
                self.helper = Some(t);
            }
            Err(e) => {
                tracing::warn!("no bulk helper: {e}");
                self.restore_watch();
            }
        }
    }

    /// Takes back a host whose helper finished.
    fn join_helper(&mut self) {
        if self.helper.as_ref().is_some_and(JoinHandle::is_finished) {
            if let Some(t) = self.helper.take() {
                Self::joined(t);
            }
            self.restore_watch();
        }
    }

    /// Joins the helper; a panic in its turns is the loop's, as if the loop had made the turn
    /// (its host would otherwise stay lent, and unserved, for good).
    fn joined(t: JoinHandle<()>) {
        if let Err(panic) = t.join() {
            std::panic::resume_unwind(panic);
        }
    }

    fn restore_watch(&mut self) {
        for h in &self.hosts {
            h.turn_lock().rx_watch.every_turn = !self.all_here;
        }
    }

    /// Whether an idle turn gives the core away: unpinned, always (anyone may share it);
    /// pinned, to a client waiting on it, or to anyone unless that recently cost a tick.
    fn may_yield(&self, now: u64) -> bool {
        self.cpu.is_none() || now >= self.keep_core_until || self.waiter_here()
    }

    fn waiter_here(&self) -> bool {
        self.cpu.is_some_and(|cpu| {
            self.hosts
                .iter()
                .any(|h| !h.lent() && h.turn_lock().waiter_on(cpu))
        })
    }

    /// Yields; a pinned daemon whose yield lost the core for longer than a wait takes (a rank
    /// that computes got it until the next tick) keeps its core for a while.
    fn yield_core(&mut self) {
        let before = self.now();
        std::thread::yield_now();
        let after = self.now();
        if self.cpu.is_some() && after - before > SLOW_YIELD_NS && !self.waiter_here() {
            self.keep_core_until = after + KEEP_CORE_NS;
        }
    }

    fn sleep(&mut self) -> Result<(), DaemonError> {
        // No host is lent here (the loop does not sleep while one is).
        let mut pending = false;
        for h in &self.hosts {
            pending |= h.turn_lock().set_sleeping(true);
        }
        if !pending {
            for h in &self.hosts {
                h.turn_lock().arm(self.poll.registry())?;
            }
            let now = self.now();
            let next = self
                .hosts
                .iter()
                .filter_map(|h| h.turn_lock().core.next_deadline())
                .min();
            let wait = next
                .map_or(50_000_000, |t| t.saturating_sub(now))
                .min(50_000_000);
            self.poll_events(Some(Duration::from_nanos(wait)))?;
            for h in &self.hosts {
                let mut h = h.turn_lock();
                h.disarm(self.poll.registry())?;
                h.rx_watch.mark();
            }
        }
        for h in &self.hosts {
            h.turn_lock().set_sleeping(false);
        }
        Ok(())
    }

    /// Handles ready events; returns whether there were any.
    fn poll_events(&mut self, timeout: Option<Duration>) -> Result<bool, DaemonError> {
        match self.poll.poll(&mut self.events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        // Copied out (into a reused buffer) because handling an event needs `&mut self`.
        let mut tokens = std::mem::take(&mut self.tokens);
        tokens.clear();
        tokens.extend(self.events.iter().map(|e| e.token().0));
        let any = !tokens.is_empty();
        for &t in &tokens {
            let (k, kind) = (t / STRIDE, t % STRIDE);
            match kind {
                0 => self.hosts[k].lock().rx_watch.mark(),
                1 => {
                    let accepted = self.hosts[k].lock().accept();
                    for slot in accepted {
                        let fd = self.hosts[k].lock().sessions[slot]
                            .as_ref()
                            .map(|s| s.sock.as_raw_fd());
                        if let Some(fd) = fd {
                            self.poll.registry().register(
                                &mut SourceFd(&fd),
                                Token(k * STRIDE + 2 + 2 * slot),
                                Interest::READABLE,
                            )?;
                        }
                        self.session_readable(k, slot)?;
                    }
                }
                n if n % 2 == 0 => self.session_readable(k, (n - 2) / 2)?,
                n => {
                    // A doorbell: reset it; the next turn drains that client's ring.
                    let slot = (n - 3) / 2;
                    if let Some(Some(s)) = self.hosts[k].lock().sessions.get(slot) {
                        if let Some(a) = &s.attached {
                            let mut b = [0u8; 8];
                            let _ = rustix::io::read(&a.daemon_bell, &mut b);
                        }
                    }
                }
            }
        }
        self.tokens = tokens;
        Ok(any)
    }

    /// Serves a readable attach socket. A session that ends has its descriptors closed on
    /// detach, which also removes them from epoll.
    fn session_readable(&mut self, k: usize, slot: usize) -> Result<(), DaemonError> {
        let mut bell = None;
        self.hosts[k].lock().on_session_readable(slot, &mut bell);
        self.clients_stale = true;
        if let Some(fd) = bell {
            self.poll.registry().register(
                &mut SourceFd(&fd),
                Token(k * STRIDE + 3 + 2 * slot),
                Interest::READABLE,
            )?;
        }
        Ok(())
    }

    /// After attaches or detaches: every client learns how many share the machine with it.
    fn publish_clients(&mut self) {
        // Not from a lent host's lock every turn: the helper slept on it and the loop's unlock
        // woke it. Attaches come through the loop's events; a lent host's detaches are seen
        // when it is back.
        if std::mem::take(&mut self.clients_stale) {
            let n = self.hosts.iter().map(|h| h.lock().clients()).sum();
            self.hosts.iter().for_each(|h| h.lock().publish_clients(n));
        }
    }

    /// Statistics of every host this process runs.
    pub fn stat_text(&self) -> String {
        self.hosts
            .iter()
            .map(|h| h.lock().stat_text())
            .collect::<Vec<_>>()
            .join("\n")
    }
}
