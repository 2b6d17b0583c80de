//! The reliable-delivery state machine.
//!
//! **Sessions and incarnations.** Each host has, towards each peer, a random 32-bit epoch (its
//! incarnation: new at every start, and new when it gives that peer up for dead). A datagram
//! carries the sender's epoch and the receiver's epoch as the sender knows it. A receiver
//! accepts a datagram into the session only when it names the receiver's current epoch and the
//! sender's known one. Anything else is stale: dropped, counted, and answered (rate-limited)
//! with a pure datagram that tells the sender our epoch. A new sender epoch is believed only
//! from a datagram that also names our current epoch — proof that the sender heard us in this
//! life — so random or replayed headers can never reset a session. A host that starts, or
//! comes back, greets every peer until it answers; a restarted peer is thus noticed within one
//! round trip, what was pending on its old incarnation fails, and the new one is admitted.
//!
//! **Delivery.** The unit of reliability is the datagram body (a run of coalesced ops),
//! numbered per session from 1. The receiver delivers bodies in sequence order exactly once;
//! out-of-order bodies wait in a bounded reorder buffer and are announced in the selective-ack
//! bitmap. Acknowledgements are validated: nothing can acknowledge a body never sent.
//!
//! **Loss recovery** follows QUIC's (RFC 9002) with RACK's time order: a body is lost when one
//! transmitted after it was delivered and either three transmissions separate them or 9/8 of
//! the round trip has passed since it left; a probe timeout (smoothed RTT + 4·RTTVAR + the
//! peer's ack delay, doubling while nothing is acknowledged) resends the oldest bodies when the
//! tail of a burst was lost. Timers come from the measured round trip (the greeting gives the
//! first sample), not from a fixed floor.
//!
//! **Liveness.** A peer is declared dead when data to it makes no progress (nothing newly
//! acknowledged) for `peer_timeout`; its queued and unacknowledged bodies are discarded, a
//! [`TransportEvent::PeerDead`] tells the engines to fail what was pending on it, and pushes
//! to it fail at once until it answers a greeting again.

use std::collections::{BTreeMap, VecDeque};

use super::lazy::LazyPolicy;
use crate::wire::{
    DatagramHeader, Keys, OpRef, SealKey, WireError, FLAG_CONFIRM, FLAG_IN_SESSION, FLAG_PADDED,
    HEADER_LEN, TAG_LEN,
};

/// Bodies transmitted after a lost one (and delivered) that prove its loss at once.
const PACKET_THRESHOLD: u64 = 3;
/// Bodies a probe timeout resends.
const PROBE_BODIES: usize = 2;
/// Ops with at least this many data bytes may be sealed as they are pushed
/// ([`Transport::push_op_mapped`]): below it a copy costs little and coalescing more.
const SEAL_AT_PUSH_MIN: usize = 4096;

/// Tunables; times in nanoseconds.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// Largest datagram (UDP payload) we send.
    pub mtu: usize,
    /// Most unacknowledged datagrams per peer.
    pub window: usize,
    /// Most sealed datagrams per peer waiting for the window; beyond it pushes fail with Full.
    pub max_queued: usize,
    /// Probe timeout before any round trip was measured, and the first greeting interval.
    pub rto_init: u64,
    /// Timer granularity: no loss timer is shorter.
    pub rto_min: u64,
    /// Longest probe timeout and greeting interval.
    pub rto_max: u64,
    /// No progress (while data is outstanding) for this long declares a peer dead.
    pub peer_timeout: u64,
    /// Longest a pure acknowledgement is delayed hoping to piggyback on data.
    pub ack_delay: u64,
    /// Longest a lazy op (see [`Transport::push_op_lazy`]) waits for company.
    pub lazy_delay: u64,
    /// Least time between two answers to stale datagrams from one peer.
    pub stale_answer_gap: u64,
    /// Seal every datagram (AEGIS, see `wire::datagram`); `false`: a tag in clear, as GASNet's
    /// udp-conduit (see [`crate::wire::Key::tagging`]) — for the udp conduit's baseline mode
    /// only.
    pub authenticate: bool,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            mtu: 1472,
            window: 512,
            max_queued: 512,
            rto_init: 5_000_000,
            rto_min: 100_000,
            rto_max: 1_000_000_000,
            peer_timeout: 10_000_000_000,
            ack_delay: 100_000,
            lazy_delay: 50_000,
            stale_answer_gap: 1_000_000,
            authenticate: true,
        }
    }
}

/// Counters a daemon reports in `softnic stat`.
#[derive(Debug, Clone, Default)]
pub struct TransportStats {
    pub datagrams_sent: u64,
    pub bytes_sent: u64,
    pub datagrams_received: u64,
    pub bytes_received: u64,
    pub retransmits: u64,
    /// Bodies declared lost from acknowledgements (before any timer ran out).
    pub fast_retransmits: u64,
    /// Probe timeouts that ran out.
    pub timeouts: u64,
    pub duplicates: u64,
    pub out_of_window: u64,
    pub acks_sent: u64,
    pub auth_failures: u64,
    pub malformed: u64,
    /// Authenticated datagrams outside the current session (a past incarnation, ours or the
    /// peer's, or a greeting): dropped.
    pub stale: u64,
    pub peers_declared_dead: u64,
    /// Peers seen to come back as a new incarnation.
    pub peer_restarts: u64,
    /// Datagrams sealed as their last op was pushed, its data read straight from registered
    /// memory ([`Transport::push_op_mapped`]).
    pub sealed_at_push: u64,
    /// Of those, sealed again before their first transmission (their session changed).
    pub resealed_unsent: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportEvent {
    /// The peer made no progress for `peer_timeout`; everything outstanding on it was dropped.
    PeerDead(u16),
    /// The peer came back as a new incarnation; everything outstanding on the old one was
    /// dropped.
    PeerReset(u16),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    #[error("peer {0} is dead")]
    Dead(u16),
    #[error("send queue to peer {0} is full; retry after the window opens")]
    Full(u16),
    #[error("host {0} is not a peer of this transport")]
    NoSuchPeer(u16),
    #[error("op of {0} bytes does not fit in one datagram")]
    TooLarge(usize),
    #[error("the op's data could not be read")]
    Source,
}

/// What an incoming datagram yielded.
#[derive(Debug)]
pub struct Received<'a> {
    pub peer: u16,
    /// The body, when it was the next one in sequence; call [`Transport::take_ready`] afterwards
    /// for bodies that were waiting behind it.
    pub body: Option<&'a [u8]>,
}

struct InFlight {
    seq: u64,
    /// `HEADER_LEN` bytes of header space, the body, and (once sent) the tag: each
    /// (re)transmission writes a fresh header and tag around the body in place.
    buf: Vec<u8>,
    /// Where the body ends (the tag starts) in `buf`.
    body_end: usize,
    /// The body is encrypted under the header in `buf` (it was sent): a retransmission
    /// decrypts it before sealing it again under a fresh header and nonce.
    sealed: bool,
    /// Sealed when it was pushed ([`Transport::push_op_mapped`]) under this header, and not
    /// sent yet: it leaves as it is if the header it would get now is the same.
    sealed_as: Option<DatagramHeader>,
    /// When, and as which transmission to this peer, it last left.
    sent_at: u64,
    tx: u64,
    retries: u32,
    sacked: bool,
    resend: bool,
}

/// The round-trip estimate (RFC 6298 smoothing).
#[derive(Debug, Default, Clone, Copy)]
struct Rtt {
    srtt: Option<u64>,
    rttvar: u64,
    latest: u64,
}

impl Rtt {
    fn sample(&mut self, r: u64) {
        self.latest = r;
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                self.rttvar = (3 * self.rttvar + s.abs_diff(r)) / 4;
                self.srtt = Some((7 * s + r) / 8);
            }
        }
    }
}

struct Peer {
    /// Our incarnation towards this peer.
    local_epoch: u32,
    /// The peer's, once it named ours (then the session is open).
    peer_epoch: Option<u32>,
    /// The peer is known to have our epoch as its session peer (it sent `FLAG_IN_SESSION`).
    /// Until then, pure datagrams asking it to confirm go out on the greeting schedule: the
    /// last datagram of the opening may be lost, and a peer left with our old epoch would
    /// fail the next operation it sends us.
    confirmed: bool,
    /// When to greet next while the session is not open, and the current interval.
    hello_at: u64,
    hello_interval: u64,
    hello_sent: Option<u64>,
    /// The epoch a stale datagram came with: answered by a pure datagram naming it.
    answer: Option<u32>,
    answered_at: Option<u64>,
    next_seq: u64,
    open: Option<Vec<u8>>,
    /// The open datagram holds an op that must go out at the next flush.
    open_eager: bool,
    /// When the first lazy op entered the open datagram.
    open_lazy_deadline: Option<u64>,
    /// Lazy ops waiting in the open datagram.
    open_lazy_ops: u32,
    lazy: LazyPolicy,
    queued: VecDeque<Vec<u8>>,
    /// Sealed as they were pushed, numbered, not yet sent: they leave before `queued` and
    /// hold places in the window.
    ready: VecDeque<InFlight>,
    inflight: VecDeque<InFlight>,
    /// Some body in `inflight` may be marked for resending: set wherever one is marked,
    /// cleared when a look finds none, so a stream without loss never scans its window for
    /// one (a scan of 512 bodies per datagram was a sixth of a 1472-byte stream's sender).
    maybe_resend: bool,
    /// Transmissions to this peer so far (orders them in time, ties within a turn broken).
    tx_count: u64,
    /// The latest transmission known delivered.
    rack_tx: u64,
    /// The highest sequence number the peer's acknowledgements can speak of yet (its
    /// cumulative ack + the 64 of the bitmap): a body beyond it may have arrived unreported.
    sack_horizon: u64,
    /// When a body sent before `rack_tx` becomes lost by time, if one is waiting for that.
    loss_time: Option<u64>,
    /// Probe timeouts in a row without progress.
    pto_count: u32,
    /// When a body last left.
    last_sent: u64,
    recv_next: u64,
    reorder: BTreeMap<u64, Vec<u8>>,
    ack_due: Option<u64>,
    unacked_received: u32,
    rtt: Rtt,
    /// Last time data to this peer made progress (or began to be outstanding).
    progress_at: u64,
    /// Nothing was outstanding at the last timer run (the next one that finds data starts
    /// the progress clock).
    idle: bool,
    dead: bool,
    /// When an authenticated datagram from this peer last arrived, and how many did.
    last_heard: Option<u64>,
    heard: u64,
    /// The largest authenticated datagram from this peer (bytes): below the MTU after a
    /// padded probe, larger ones do not reach us.
    largest: usize,
    /// Padded probes due to this peer (`Transport::probe`): a few, so that random loss
    /// does not look like a small path MTU.
    pad_due: u8,
    /// The wall clock (Unix ns) a padded probe from this peer carried, and when it arrived.
    peer_clock: Option<(u64, u64)>,
}

/// One peer as this host sees it (`softnic stat`, `softnic doctor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerView {
    /// A session with its current incarnation is open.
    pub open: bool,
    pub srtt_ns: Option<u64>,
    /// Since an authenticated datagram from it last arrived.
    pub heard_ago_ns: Option<u64>,
    /// Authenticated datagrams from it.
    pub heard: u64,
    /// Datagrams claiming to come from it that failed authentication.
    pub auth_failures: u64,
    /// The largest authenticated datagram from it (bytes).
    pub largest: usize,
    /// Its wall clock (Unix ns) as its last padded probe said, and how long ago that came.
    pub clock: Option<(u64, u64)>,
}

impl Peer {
    fn new(cfg: &TransportConfig, epoch: u32) -> Peer {
        Peer {
            local_epoch: epoch,
            peer_epoch: None,
            confirmed: false,
            hello_at: 0,
            hello_interval: cfg.rto_init,
            hello_sent: None,
            last_heard: None,
            heard: 0,
            largest: 0,
            pad_due: 0,
            peer_clock: None,
            answer: None,
            answered_at: None,
            next_seq: 1,
            open: None,
            open_eager: false,
            open_lazy_deadline: None,
            open_lazy_ops: 0,
            lazy: LazyPolicy::default(),
            queued: VecDeque::new(),
            ready: VecDeque::new(),
            inflight: VecDeque::new(),
            maybe_resend: false,
            tx_count: 0,
            rack_tx: 0,
            sack_horizon: 0,
            loss_time: None,
            pto_count: 0,
            last_sent: 0,
            recv_next: 1,
            reorder: BTreeMap::new(),
            ack_due: None,
            unacked_received: 0,
            rtt: Rtt::default(),
            progress_at: 0,
            idle: true,
            dead: false,
        }
    }

    fn sack_bits(&self) -> u64 {
        let mut bits = 0u64;
        for (&s, _) in self.reorder.range(self.recv_next + 1..self.recv_next + 65) {
            bits |= 1 << (s - self.recv_next - 1);
        }
        bits
    }

    fn has_outstanding(&self) -> bool {
        !self.inflight.is_empty() || !self.queued.is_empty() || !self.ready.is_empty()
    }

    /// Data of ours to this peer not yet acknowledged, sent or even closed into a datagram.
    fn holds_data(&self) -> bool {
        self.has_outstanding() || self.open.is_some()
    }

    fn is_open(&self) -> bool {
        self.peer_epoch.is_some()
    }

    /// Schedules the next greeting (or confirmation request), doubling the interval up to `max`.
    fn next_hello(&mut self, now: u64, max: u64) {
        self.hello_at = now + self.hello_interval;
        self.hello_interval = (self.hello_interval * 2).min(max);
    }

    /// The probe timeout (before backoff).
    fn pto(&self, cfg: &TransportConfig) -> u64 {
        match self.rtt.srtt {
            Some(s) => s + (4 * self.rtt.rttvar).max(cfg.rto_min) + cfg.ack_delay,
            None => cfg.rto_init,
        }
    }

    /// How long after its transmission a body sent before a delivered one counts as lost.
    fn loss_delay(&self, cfg: &TransportConfig) -> u64 {
        let base = self
            .rtt
            .srtt
            .map_or(cfg.rto_init, |s| s.max(self.rtt.latest));
        (base * 9 / 8).max(cfg.rto_min)
    }

    /// When the probe timer of this peer runs out, if it runs.
    fn pto_deadline(&self, cfg: &TransportConfig) -> Option<u64> {
        if self.loss_time.is_some() || !self.inflight.iter().any(|f| !f.sacked && !f.resend) {
            return None;
        }
        let backoff = self.pto(cfg).saturating_mul(1 << self.pto_count.min(20));
        Some(self.last_sent + backoff.min(cfg.rto_max))
    }

    /// Marks bodies lost by RACK's rules; arms `loss_time` for the ones not yet lost by time.
    fn detect_losses(&mut self, now: u64, cfg: &TransportConfig, stats: &mut TransportStats) {
        let delay = self.loss_delay(cfg);
        let rack = self.rack_tx;
        self.loss_time = None;
        for f in self.inflight.iter_mut() {
            if f.seq > self.sack_horizon {
                break; // in sequence order: the rest is beyond it too
            }
            if f.sacked || f.resend || f.tx >= rack {
                continue;
            }
            let lost_at = f.sent_at + delay;
            if rack - f.tx >= PACKET_THRESHOLD || now >= lost_at {
                f.resend = true;
                self.maybe_resend = true;
                stats.fast_retransmits += 1;
            } else {
                self.loss_time = Some(self.loss_time.map_or(lost_at, |t| t.min(lost_at)));
            }
        }
    }
}

/// Keeps a spent datagram buffer for reuse (a bounded pool: no allocation per datagram).
fn recycle_into(pool: &mut Vec<Vec<u8>>, b: Vec<u8>) {
    if pool.len() < 4096 {
        pool.push(b);
    }
}

/// Body bytes per datagram for an MTU: all of it but header and tag (AEGIS seals any length
/// at the same speed per byte, unlike the BLAKE3 tag before it, which wanted powers of two).
pub fn body_len_for(mtu: usize) -> usize {
    mtu - TAG_LEN - HEADER_LEN
}

/// Why a datagram's header is refused (for the counters).
enum Verdict {
    /// In the current session (possibly just opened by it).
    Session,
    /// Outside it: answered with our epoch, otherwise ignored.
    Stale,
    Malformed(&'static str),
}

/// Reliable delivery to every peer of one host.
pub struct Transport {
    host: u16,
    /// See [`body_len_for`].
    body_cap: usize,
    /// By host index: the key this host seals its datagrams to that host with, and the key
    /// that host seals its datagrams here with.
    tx_keys: Vec<SealKey>,
    rx_keys: Vec<SealKey>,
    /// The next datagram's nonce counter (random start: see the wire module).
    nonce: u64,
    /// Authentication failures by claimed sender.
    auth_failures_from: Vec<u64>,
    /// The wall clock (Unix ns) at the last probe and the transport's time then: what padded
    /// probes carry, advanced by the time since.
    wall_at_probe: (u64, u64),
    cfg: TransportConfig,
    peers: Vec<Peer>,
    pool: Vec<Vec<u8>>,
    scratch: Vec<u8>,
    cursor: usize,
    events: VecDeque<TransportEvent>,
    rng_state: u64,
    pub stats: TransportStats,
}

impl Transport {
    /// `nhosts` peers numbered 0.., of which `host` is this one. `seed` makes epochs distinct
    /// per start (pass randomness in production, a constant in simulations).
    pub fn new(
        host: u16,
        nhosts: u16,
        keys: impl Into<Keys>,
        mut cfg: TransportConfig,
        seed: u64,
    ) -> Transport {
        // Backoff must leave ~20 attempts before a silent peer is declared dead: at 30% loss
        // each way a datagram and its ack both get through only half the time.
        cfg.rto_max = cfg.rto_max.min(cfg.peer_timeout / 20).max(cfg.rto_min);
        let keys: Keys = keys.into();
        // A host index no key covers gets one nobody holds: its datagrams fail authentication.
        let secret = |i: u16| {
            keys.for_peer(i)
                .cloned()
                .unwrap_or(crate::wire::Key([0; 32]))
        };
        let protect = |k: &crate::wire::Key, sender: u16| match cfg.authenticate {
            true => k.sealing(sender),
            false => k.tagging(sender),
        };
        let mut t = Transport {
            host,
            body_cap: body_len_for(cfg.mtu),
            tx_keys: (0..nhosts.max(1))
                .map(|i| protect(&secret(i), host))
                .collect(),
            rx_keys: (0..nhosts.max(1)).map(|i| protect(&secret(i), i)).collect(),
            nonce: 0,
            auth_failures_from: vec![0; nhosts as usize],
            wall_at_probe: (0, 0),
            peers: Vec::new(),
            pool: Vec::new(),
            scratch: vec![0; HEADER_LEN + TAG_LEN],
            cursor: 0,
            events: VecDeque::new(),
            rng_state: seed | 1,
            stats: TransportStats::default(),
            cfg,
        };
        for _ in 0..nhosts {
            let e = t.next_epoch();
            t.peers.push(Peer::new(&t.cfg, e));
        }
        t.nonce = (t.next_epoch() as u64) << 32 | t.next_epoch() as u64;
        t
    }

    /// The nonce counter for the next sealed datagram.
    fn next_nonce(&mut self) -> u64 {
        self.nonce = self.nonce.wrapping_add(1);
        self.nonce
    }

    fn next_epoch(&mut self) -> u32 {
        // xorshift64*: epochs only need to differ, not to be secret (0 means "unknown").
        loop {
            self.rng_state ^= self.rng_state >> 12;
            self.rng_state ^= self.rng_state << 25;
            self.rng_state ^= self.rng_state >> 27;
            let e = (self.rng_state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32;
            if e != 0 {
                return e;
            }
        }
    }

    pub fn host(&self) -> u16 {
        self.host
    }

    pub fn config(&self) -> &TransportConfig {
        &self.cfg
    }

    /// Body bytes one datagram can carry.
    pub fn body_capacity(&self) -> usize {
        self.body_cap
    }

    /// Whether a session with `peer` is open (it answered a greeting in our current life).
    pub fn is_open(&self, peer: u16) -> bool {
        self.peers.get(peer as usize).is_some_and(Peer::is_open)
    }

    /// How `peer` looks from here at `now`.
    pub fn peer_view(&self, peer: u16, now: u64) -> Option<PeerView> {
        let p = self.peers.get(peer as usize)?;
        Some(PeerView {
            open: p.is_open(),
            srtt_ns: p.rtt.srtt,
            heard_ago_ns: p.last_heard.map(|t| now.saturating_sub(t)),
            heard: p.heard,
            largest: p.largest,
            clock: p.peer_clock.map(|(w, t)| (w, now.saturating_sub(t))),
            auth_failures: self
                .auth_failures_from
                .get(peer as usize)
                .copied()
                .unwrap_or(0),
        })
    }

    /// Makes every peer answer soon (`softnic doctor`): an open session asks its peer to
    /// confirm it (answered at once), a closed one greets now instead of at its backoff; and
    /// each open peer gets datagrams padded to the largest size, which tell it whether
    /// datagrams that large cross the path, and this host's wall clock `wall_ns` (Unix ns).
    pub fn probe(&mut self, now: u64, wall_ns: u64) {
        self.wall_at_probe = (wall_ns, now);
        for (i, p) in self.peers.iter_mut().enumerate() {
            if i == self.host as usize {
                continue;
            }
            if p.is_open() {
                p.confirmed = false;
                p.pad_due = 3;
            }
            p.hello_at = now;
        }
    }

    /// The smoothed round trip to `peer`, once measured (ns).
    pub fn srtt(&self, peer: u16) -> Option<u64> {
        self.peers.get(peer as usize).and_then(|p| p.rtt.srtt)
    }

    fn buf(&mut self) -> Vec<u8> {
        let mut b = self
            .pool
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.cfg.mtu));
        b.clear();
        b.resize(HEADER_LEN, 0);
        b
    }

    fn recycle(&mut self, b: Vec<u8>) {
        recycle_into(&mut self.pool, b);
    }

    /// Whether data to a live peer is not yet acknowledged (or not yet sent), or a peer still
    /// waits for our acknowledgement of what it sent (a delayed ack not yet due).
    pub fn unsettled(&self) -> bool {
        self.peers
            .iter()
            .any(|p| !p.dead && (p.holds_data() || p.ack_due.is_some()))
    }

    /// Whether no data waits to go or to be acknowledged, to any peer: an op pushed now would
    /// travel alone.
    pub fn quiet(&self) -> bool {
        self.peers.iter().all(|p| p.dead || !p.holds_data())
    }

    /// Whether `peer` accepts another op now (not dead, queue not full).
    pub fn can_push(&self, peer: u16) -> Result<(), PushError> {
        let p = self
            .peers
            .get(peer as usize)
            .filter(|_| peer != self.host)
            .ok_or(PushError::NoSuchPeer(peer))?;
        if p.dead {
            return Err(PushError::Dead(peer));
        }
        if p.queued.len() >= self.cfg.max_queued {
            return Err(PushError::Full(peer));
        }
        Ok(())
    }

    /// How many more sealed datagrams `peer`'s queue takes before pushes fail with Full.
    pub fn queued_space(&self, peer: u16) -> usize {
        self.peers
            .get(peer as usize)
            .map_or(0, |p| self.cfg.max_queued.saturating_sub(p.queued.len()))
    }

    /// Closed datagrams to `peer` not yet sent: waiting for the window, or sealed as they
    /// were pushed and waiting for their turn.
    pub fn queued_len(&self, peer: u16) -> usize {
        self.peers
            .get(peer as usize)
            .map_or(0, |p| p.queued.len() + p.ready.len())
    }

    /// Body bytes left in the datagram being filled for `peer` (a full datagram if none is open).
    pub fn open_room(&self, peer: u16) -> usize {
        let cap = self.body_capacity();
        match self.peers.get(peer as usize).and_then(|p| p.open.as_ref()) {
            Some(b) => cap - (b.len() - HEADER_LEN),
            None => cap,
        }
    }

    /// Appends an op to the datagram being filled for `peer`, sealing it first if full; it
    /// leaves at the next [`Transport::flush`].
    pub fn push_op(&mut self, peer: u16, op: &OpRef<'_>) -> Result<(), PushError> {
        self.push(peer, op, None)
    }

    /// Appends an op that is in no hurry (the acknowledgement of an implicit put): it rides
    /// along with the next eager op to `peer`, or leaves on its own after `lazy_delay`. This
    /// saves a datagram each way in request/response patterns.
    pub fn push_op_lazy(&mut self, peer: u16, op: &OpRef<'_>, now: u64) -> Result<(), PushError> {
        self.push(peer, op, Some(now + self.cfg.lazy_delay))
    }

    /// Like [`Transport::push_op_lazy`], leaving on its own at `deadline` at the latest.
    pub fn push_op_lazy_until(
        &mut self,
        peer: u16,
        op: &OpRef<'_>,
        deadline: u64,
    ) -> Result<(), PushError> {
        self.push(peer, op, Some(deadline))
    }

    /// Appends op `head` (its trailing data empty) with `data_len` data bytes that `fill`
    /// appends straight into the datagram (from registered memory: no copy in between).
    /// `Err(Source)` when `fill` fails; nothing is pushed then.
    pub fn push_op_filled(
        &mut self,
        peer: u16,
        head: &OpRef<'_>,
        data_len: usize,
        fill: &mut dyn FnMut(&mut Vec<u8>) -> bool,
    ) -> Result<(), PushError> {
        let len = head.encoded_len() + data_len;
        self.push_with(peer, len, None, &mut |b| {
            head.encode_with(b, data_len, fill)
        })
    }

    /// [`Transport::push_op_filled`] with the data at `data..data + data_len` in mapped
    /// memory. When the op ends a datagram that may leave at once (a large op, the session
    /// open, the window with room, nothing queued before it), that datagram is sealed now,
    /// right after the data is copied in (still in cache), not when it leaves. Otherwise the
    /// data is copied in as `push_op_filled` does. Either way the bytes are read before this
    /// returns.
    ///
    /// # Safety
    /// `data..data + data_len` must be readable for the duration of the call.
    pub unsafe fn push_op_mapped(
        &mut self,
        peer: u16,
        head: &OpRef<'_>,
        data: *const u8,
        data_len: usize,
    ) -> Result<(), PushError> {
        if !self.seals_at_push(peer, head.encoded_len() + data_len, data_len) {
            return self.push_op_filled(peer, head, data_len, &mut |b| {
                // SAFETY: the caller's promise for the source; `b` is the transport's own.
                unsafe { crate::wire::extend_from_raw(b, data, data_len) };
                true
            });
        }
        self.push_with(peer, head.encoded_len() + data_len, None, &mut |b| {
            head.encode_head(b, data_len);
            true
        })?;
        let Some(mut buf) = self.take_open(peer, false) else {
            unreachable!("the op was just appended to the open datagram");
        };
        let p = &mut self.peers[peer as usize];
        let Some(peer_epoch) = p.peer_epoch else {
            unreachable!("checked by seals_at_push");
        };
        let seq = p.next_seq;
        p.next_seq += 1;
        let mut h = self.header(peer, seq, peer_epoch);
        h.nonce = self.next_nonce();
        h.write(&mut buf);
        let head_end = buf.len();
        let body_end = head_end + data_len;
        // SAFETY: the caller's promise; `buf` is the transport's own.
        let len = unsafe {
            DatagramHeader::seal_with_tail(
                &self.tx_keys[peer as usize],
                &mut buf,
                head_end,
                data,
                data_len,
            )
        };
        debug_assert_eq!(len, body_end + TAG_LEN);
        self.stats.sealed_at_push += 1;
        self.peers[peer as usize].ready.push_back(InFlight {
            seq,
            body_end,
            buf,
            sealed: true,
            sealed_as: Some(h),
            sent_at: 0,
            tx: 0,
            retries: 0,
            sacked: false,
            resend: false,
        });
        Ok(())
    }

    /// Whether an op of `len` bytes (`data_len` of them data) to `peer` would end a datagram
    /// that may leave at once, so that [`Transport::push_op_mapped`] seals it as it pushes.
    fn seals_at_push(&self, peer: u16, len: usize, data_len: usize) -> bool {
        let Some(p) = self.peers.get(peer as usize).filter(|_| peer != self.host) else {
            return false;
        };
        data_len >= SEAL_AT_PUSH_MIN
            && len <= self.open_room(peer)
            && !p.dead
            && p.peer_epoch.is_some()
            && p.answer.is_none()
            && p.queued.is_empty()
            && p.inflight.len() + p.ready.len() < self.cfg.window
    }

    fn push(&mut self, peer: u16, op: &OpRef<'_>, lazy: Option<u64>) -> Result<(), PushError> {
        self.push_with(peer, op.encoded_len(), lazy, &mut |b| {
            op.encode_append(b);
            true
        })
    }

    /// Appends an op of `len` bytes that `write` appends to the open datagram.
    fn push_with(
        &mut self,
        peer: u16,
        len: usize,
        lazy: Option<u64>,
        write: &mut dyn FnMut(&mut Vec<u8>) -> bool,
    ) -> Result<(), PushError> {
        self.can_push(peer)?;
        let cap = self.body_capacity();
        if len > cap {
            return Err(PushError::TooLarge(len));
        }
        let needs_seal =
            matches!(&self.peers[peer as usize].open, Some(b) if b.len() - HEADER_LEN + len > cap);
        if needs_seal {
            self.seal(peer, false);
            self.can_push(peer)?;
        }
        if self.peers[peer as usize].open.is_none() {
            let b = self.buf();
            self.peers[peer as usize].open = Some(b);
        }
        let p = &mut self.peers[peer as usize];
        match lazy {
            Some(deadline) if p.lazy.wait() => {
                p.open_lazy_deadline =
                    Some(p.open_lazy_deadline.map_or(deadline, |d| d.min(deadline)));
                p.open_lazy_ops += 1;
            }
            _ => p.open_eager = true,
        }
        let Some(b) = p.open.as_mut() else {
            unreachable!("opened above");
        };
        if !write(b) {
            return Err(PushError::Source);
        }
        Ok(())
    }

    /// `expired`: the datagram leaves because its lazy deadline passed.
    fn seal(&mut self, peer: u16, expired: bool) {
        if let Some(b) = self.take_open(peer, expired) {
            self.peers[peer as usize].queued.push_back(b);
        }
    }

    /// Closes the open datagram to `peer` (`expired`: its lazy ops' delay ran out) and
    /// returns it.
    fn take_open(&mut self, peer: u16, expired: bool) -> Option<Vec<u8>> {
        let p = &mut self.peers[peer as usize];
        let b = p.open.take();
        if p.open_lazy_ops > 0 {
            p.lazy
                .left(expired && !p.open_eager && p.open_lazy_ops == 1);
        }
        p.open_eager = false;
        p.open_lazy_deadline = None;
        p.open_lazy_ops = 0;
        b
    }

    /// Seals partly filled datagrams that hold an eager op or a lazy op past its delay, so
    /// that they go out on the next transmit. Call once per event-loop turn: ops pushed within
    /// one turn share datagrams.
    pub fn flush(&mut self, now: u64) {
        for i in 0..self.peers.len() {
            let p = &mut self.peers[i];
            if p.open_eager || p.open_lazy_deadline.is_some_and(|d| now >= d) {
                let expired = !p.open_eager;
                self.seal(i as u16, expired);
            }
        }
    }

    /// Decides what a datagram's epochs and acknowledgement fields mean for `peer`'s session,
    /// before anything changes: a session change must come with a fresh stream's fields.
    fn verdict(&self, peer: u16, h: &DatagramHeader, body_len: usize) -> Verdict {
        let p = &self.peers[peer as usize];
        if h.flags & !(FLAG_IN_SESSION | FLAG_CONFIRM | FLAG_PADDED) != 0 {
            return Verdict::Malformed("unknown datagram flags");
        }
        let padded = h.flags & FLAG_PADDED != 0;
        if padded && h.seq != 0 {
            return Verdict::Malformed("padding in a datagram with a body");
        }
        if h.seq == 0 && body_len != 0 && !padded {
            return Verdict::Malformed("an acknowledgement with a body");
        }
        if h.dst_epoch != p.local_epoch || h.src_epoch == 0 {
            return Verdict::Stale;
        }
        // A new session starts our stream at 1: only an ack of nothing is valid for it.
        let fresh = p.peer_epoch != Some(h.src_epoch);
        let next_seq = if fresh { 1 } else { p.next_seq };
        if h.ack == 0 || h.ack > next_seq {
            return Verdict::Malformed("acknowledges a body never sent");
        }
        if h.sack != 0 {
            let highest = h.ack + 64 - h.sack.leading_zeros() as u64;
            if highest >= next_seq {
                return Verdict::Malformed("selectively acknowledges a body never sent");
            }
        }
        Verdict::Session
    }

    /// Counts a datagram whose tag failed by the host it claims to come from, and says so in
    /// the log at the first and every 1000th: a peer with the wrong key (or a config whose
    /// public key for it is out of date), or someone claiming its identity.
    fn note_auth_failure(&mut self, claimed: Option<u16>) {
        let Some(n) = claimed.and_then(|c| self.auth_failures_from.get_mut(c as usize)) else {
            return;
        };
        *n += 1;
        if *n % 1000 == 1 {
            tracing::warn!(
                "{} datagram(s) claiming to come from host {} failed authentication: that host's \
                 key, or this host's config entry for it, is wrong (or someone claims its \
                 identity)",
                n,
                claimed.unwrap_or_default()
            );
        }
    }

    /// Datagrams that failed authentication, by the host they claimed to come from.
    pub fn auth_failures_from(&self) -> &[u64] {
        &self.auth_failures_from
    }

    /// Handles one incoming datagram.
    /// Decrypts its body in place.
    pub fn on_datagram<'a>(
        &mut self,
        now: u64,
        dgram: &'a mut [u8],
    ) -> Result<Received<'a>, WireError> {
        // The key is the one the host the datagram claims to come from seals with; a host that
        // claims another's identity holds no such key, so its tag fails.
        let key = match DatagramHeader::claimed_src(dgram) {
            // Not even an envelope: `open` below says what is wrong with it.
            None => &self.rx_keys[0],
            Some(src) => match self.rx_keys.get(src as usize) {
                Some(k) => k,
                None => {
                    self.stats.malformed += 1;
                    return Err(WireError::BadField("datagram from no host of the cluster"));
                }
            },
        };
        let claimed = DatagramHeader::claimed_src(dgram);
        let dgram_len = dgram.len();
        let (h, body) = match DatagramHeader::open(key, dgram) {
            Ok(x) => x,
            Err(e) => {
                if e == WireError::BadTag {
                    self.stats.auth_failures += 1;
                    self.note_auth_failure(claimed);
                } else {
                    self.stats.malformed += 1;
                }
                return Err(e);
            }
        };
        if h.dst_host != self.host
            || h.src_host == self.host
            || h.src_host as usize >= self.peers.len()
        {
            self.stats.malformed += 1;
            return Err(WireError::BadField("datagram not addressed to this host"));
        }
        let peer = h.src_host;
        let p = &mut self.peers[peer as usize];
        p.last_heard = Some(now);
        p.heard += 1;
        p.largest = p.largest.max(dgram_len);
        match self.verdict(peer, &h, body.len()) {
            Verdict::Malformed(why) => {
                self.stats.malformed += 1;
                return Err(WireError::BadField(why));
            }
            Verdict::Stale => {
                self.stats.stale += 1;
                let p = &mut self.peers[peer as usize];
                // Tell the sender who we are now, at most once per gap: a barrage of stale
                // datagrams is not amplified.
                if h.src_epoch != 0
                    && p.answered_at
                        .is_none_or(|t| now.saturating_sub(t) >= self.cfg.stale_answer_gap)
                {
                    p.answer = Some(h.src_epoch);
                }
                return Ok(Received { peer, body: None });
            }
            Verdict::Session => {}
        }
        self.stats.datagrams_received += 1;
        self.stats.bytes_received += dgram_len as u64;
        if self.peers[peer as usize].peer_epoch != Some(h.src_epoch) {
            self.open_session(now, peer, h.src_epoch);
        }
        let p = &mut self.peers[peer as usize];
        if h.flags & FLAG_IN_SESSION != 0 {
            p.confirmed = true;
        }
        if h.flags & FLAG_CONFIRM != 0 {
            p.ack_due = Some(now);
        }
        self.process_ack(now, peer, h.ack, h.sack);
        if h.seq == 0 {
            if h.flags & FLAG_PADDED != 0 && body.len() >= 8 {
                let wall = u64::from_le_bytes(body[..8].try_into().unwrap());
                self.peers[peer as usize].peer_clock = Some((wall, now));
            }
            return Ok(Received { peer, body: None });
        }
        let cfg_window = self.cfg.window as u64;
        let ack_delay = self.cfg.ack_delay;
        let p = &mut self.peers[peer as usize];
        if h.seq < p.recv_next || p.reorder.contains_key(&h.seq) {
            self.stats.duplicates += 1;
            p.ack_due = Some(now); // our ack may have been lost: repeat it at once
            return Ok(Received { peer, body: None });
        }
        if h.seq >= p.recv_next + 2 * cfg_window {
            self.stats.out_of_window += 1;
            return Ok(Received { peer, body: None });
        }
        p.unacked_received += 1;
        // A gap (or one filled) is reported at once: the sender's loss detection runs on it.
        let due = if p.unacked_received >= 8 || h.seq != p.recv_next || !p.reorder.is_empty() {
            now
        } else {
            now + ack_delay
        };
        p.ack_due = Some(p.ack_due.map_or(due, |d| d.min(due)));
        if h.seq == p.recv_next {
            p.recv_next += 1;
            return Ok(Received {
                peer,
                body: Some(body),
            });
        }
        let mut b = self.pool.pop().unwrap_or_default();
        b.clear();
        b.extend_from_slice(body);
        self.peers[peer as usize].reorder.insert(h.seq, b);
        Ok(Received { peer, body: None })
    }

    /// `peer` named our epoch with an epoch of its own we did not know: a session opens. If
    /// another was open, the peer restarted (or gave us up): everything of the old session is
    /// dropped and the engines fail what was pending on it.
    fn open_session(&mut self, now: u64, peer: u16, epoch: u32) {
        let restarted = self.peers[peer as usize].peer_epoch.is_some();
        if restarted {
            self.stats.peer_restarts += 1;
            self.reset_streams(peer);
            self.events.push_back(TransportEvent::PeerReset(peer));
        }
        let p = &mut self.peers[peer as usize];
        p.peer_epoch = Some(epoch);
        p.confirmed = false;
        p.dead = false;
        p.hello_interval = self.cfg.rto_init;
        p.hello_at = now + p.hello_interval;
        if let Some(t) = p.hello_sent.take() {
            p.rtt.sample(now.saturating_sub(t));
        }
        // Answer at once, so that the peer learns that we know it (its session opens too).
        p.ack_due = Some(now);
        if p.has_outstanding() {
            p.progress_at = now;
        }
    }

    /// Drops both streams of `peer`'s session, with what waits to be sent: requests and
    /// replies of the old session, whose operations the engines fail.
    fn reset_streams(&mut self, peer: u16) {
        let p = &mut self.peers[peer as usize];
        let mut bufs: Vec<Vec<u8>> = p.inflight.drain(..).map(|f| f.buf).collect();
        bufs.extend(p.ready.drain(..).map(|f| f.buf));
        bufs.extend(p.queued.drain(..));
        bufs.extend(p.open.take());
        bufs.extend(std::mem::take(&mut p.reorder).into_values());
        p.open_eager = false;
        p.open_lazy_deadline = None;
        p.open_lazy_ops = 0;
        p.next_seq = 1;
        p.recv_next = 1;
        p.rack_tx = 0;
        p.sack_horizon = 0;
        p.loss_time = None;
        p.pto_count = 0;
        p.ack_due = None;
        p.unacked_received = 0;
        for b in bufs {
            self.recycle(b);
        }
    }

    /// The next body from `peer` that became deliverable in order, if any. Hand the buffer back
    /// with [`Transport::give_back`] when done.
    pub fn take_ready(&mut self, peer: u16) -> Option<Vec<u8>> {
        let p = self.peers.get_mut(peer as usize)?;
        let next = p.recv_next;
        let b = p.reorder.remove(&next)?;
        p.recv_next += 1;
        Some(b)
    }

    pub fn give_back(&mut self, b: Vec<u8>) {
        self.recycle(b);
    }

    fn process_ack(&mut self, now: u64, peer: u16, ack: u64, sack: u64) {
        let p = &mut self.peers[peer as usize];
        // The latest transmission newly known delivered: its round trip is a sample unless
        // it was a retransmission (Karn), and bodies sent before it may be lost.
        let mut newest: Option<(u64, u64, bool)> = None; // (tx, sent_at, first transmission)
        let mut note = |f: &InFlight| {
            if newest.is_none_or(|(tx, ..)| f.tx > tx) {
                newest = Some((f.tx, f.sent_at, f.retries == 0));
            }
        };
        while let Some(f) = p.inflight.front() {
            if f.seq >= ack {
                break;
            }
            let Some(f) = p.inflight.pop_front() else {
                break;
            };
            if !f.sacked {
                note(&f);
            }
            recycle_into(&mut self.pool, f.buf);
        }
        if sack != 0 {
            for f in p.inflight.iter_mut() {
                if f.seq > ack + 64 {
                    break; // in sequence order: the rest is beyond the SACK bits too
                }
                if f.seq > ack
                    && f.seq <= ack + 64
                    && sack & (1 << (f.seq - ack - 1)) != 0
                    && !f.sacked
                {
                    f.sacked = true;
                    f.resend = false;
                    note(f);
                }
            }
        }
        p.sack_horizon = p.sack_horizon.max(ack + 64);
        let Some((tx, sent_at, first)) = newest else {
            return;
        };
        p.progress_at = now;
        p.pto_count = 0;
        if first {
            p.rtt.sample(now.saturating_sub(sent_at));
        }
        p.rack_tx = p.rack_tx.max(tx);
        p.detect_losses(now, &self.cfg, &mut self.stats);
    }

    /// Runs timers: loss detection by time, probe timeouts and peer liveness (greetings and
    /// answers are sent by [`Transport::poll_transmit`] when due).
    pub fn handle_timeout(&mut self, now: u64) {
        for i in 0..self.peers.len() {
            if i == self.host as usize {
                continue;
            }
            let p = &mut self.peers[i];
            if p.dead || !p.has_outstanding() {
                p.idle = true;
                continue;
            }
            if std::mem::take(&mut p.idle) {
                p.progress_at = now;
            }
            if now.saturating_sub(p.progress_at) > self.cfg.peer_timeout {
                self.declare_dead(i as u16);
                continue;
            }
            let cfg = &self.cfg;
            if p.loss_time.is_some_and(|t| now >= t) {
                p.detect_losses(now, cfg, &mut self.stats);
            } else if p.pto_deadline(cfg).is_some_and(|t| now >= t) {
                // The tail of what was sent may be lost and nothing later will tell: probe
                // with the oldest bodies not known delivered.
                self.stats.timeouts += 1;
                p.pto_count += 1;
                for f in p
                    .inflight
                    .iter_mut()
                    .filter(|f| !f.sacked)
                    .take(PROBE_BODIES)
                {
                    f.resend = true;
                    p.maybe_resend = true;
                }
            }
        }
    }

    fn declare_dead(&mut self, peer: u16) {
        self.stats.peers_declared_dead += 1;
        self.reset_streams(peer);
        // A new incarnation towards it: if it is alive after all, its old session with us
        // is refused from now on, and the greeting opens a new one on both sides.
        let epoch = self.next_epoch();
        let p = &mut self.peers[peer as usize];
        p.local_epoch = epoch;
        p.peer_epoch = None;
        p.dead = true;
        p.hello_sent = None;
        p.hello_at = 0;
        p.hello_interval = self.cfg.rto_init;
        self.events.push_back(TransportEvent::PeerDead(peer));
    }

    /// Liveness and restart events since the last call.
    pub fn poll_event(&mut self) -> Option<TransportEvent> {
        self.events.pop_front()
    }

    /// When [`Transport::handle_timeout`] or [`Transport::poll_transmit`] next has work.
    pub fn next_timeout(&self) -> Option<u64> {
        let mut t: Option<u64> = None;
        let mut at = |x: u64| t = Some(t.map_or(x, |y| y.min(x)));
        for (i, p) in self.peers.iter().enumerate() {
            if i == self.host as usize {
                continue;
            }
            if let Some(d) = p.ack_due {
                at(d);
            }
            if let Some(d) = p.open_lazy_deadline {
                at(d);
            }
            if !p.is_open() || !p.confirmed {
                at(p.hello_at);
            }
            if p.answer.is_some() {
                at(0);
            }
            if p.dead || !p.has_outstanding() {
                continue;
            }
            if p.idle {
                at(0); // the progress clock starts at the next timer run
                continue;
            }
            if let Some(d) = p.loss_time {
                at(d);
            }
            if let Some(d) = p.pto_deadline(&self.cfg) {
                at(d);
            }
            at(p.progress_at + self.cfg.peer_timeout + 1);
        }
        t
    }

    /// The header of a datagram to `peer` naming `dst_epoch` as its epoch. Acknowledgements
    /// belong to the session: a datagram naming another epoch (a greeting, an answer to a
    /// stale datagram) acknowledges as a fresh stream would, nothing.
    fn header(&self, peer: u16, seq: u64, dst_epoch: u32) -> DatagramHeader {
        let p = &self.peers[peer as usize];
        let in_session = dst_epoch != 0 && p.peer_epoch == Some(dst_epoch);
        let flags = match (in_session, p.confirmed) {
            (false, _) => 0,
            (true, true) => FLAG_IN_SESSION,
            (true, false) => FLAG_IN_SESSION | FLAG_CONFIRM,
        };
        DatagramHeader {
            flags,
            src_host: self.host,
            dst_host: peer,
            src_epoch: p.local_epoch,
            dst_epoch,
            seq,
            ack: if in_session { p.recv_next } else { 1 },
            sack: if in_session { p.sack_bits() } else { 0 },
            nonce: 0,
        }
    }

    /// The next datagram to send and its destination host, or `None` when nothing is due.
    /// Retransmissions go first, then new data within the window, then pure acks, answers to
    /// stale datagrams and greetings.
    pub fn poll_transmit(&mut self, now: u64) -> Option<(u16, &[u8])> {
        let n = self.peers.len();
        for k in 0..n {
            let i = (self.cursor + k) % n;
            if let Some((idx, len)) = self.transmit_one(now, i as u16) {
                self.cursor = (i + 1) % n;
                self.stats.datagrams_sent += 1;
                self.stats.bytes_sent += len as u64;
                let d = match idx {
                    Some(k) => &self.peers[i].inflight[k].buf[..len],
                    None => &self.scratch[..len],
                };
                return Some((i as u16, d));
            }
        }
        None
    }

    /// Builds one datagram for `peer`: in place in its in-flight buffer (returning its index),
    /// or a pure one in `scratch`; returns where and its length.
    fn transmit_one(&mut self, now: u64, peer: u16) -> Option<(Option<usize>, usize)> {
        if peer == self.host {
            return None;
        }
        let window = self.cfg.window;
        let p = &mut self.peers[peer as usize];
        if let Some(epoch) = p.answer.take() {
            // A pure datagram naming the stale sender's epoch: if it is the peer's new
            // incarnation, it opens the session with it.
            p.answered_at = Some(now);
            let h = self.header(peer, 0, epoch);
            return Some((None, self.seal_scratch(&h)));
        }
        if let (1.., Some(epoch)) = (p.pad_due, p.peer_epoch) {
            p.pad_due -= 1;
            let mut h = self.header(peer, 0, epoch);
            h.flags |= FLAG_PADDED;
            let (wall, at) = self.wall_at_probe;
            let wall = wall + now.saturating_sub(at);
            let len = self.cfg.mtu;
            return Some((None, self.seal_scratch_padded(&h, len, wall)));
        }
        let p = &mut self.peers[peer as usize];
        let Some(peer_epoch) = p.peer_epoch else {
            if now < p.hello_at {
                return None;
            }
            // A greeting: our epoch, theirs unknown. Sent until the peer answers, backing off.
            p.hello_sent = Some(now);
            p.next_hello(now, self.cfg.rto_max);
            let h = self.header(peer, 0, 0);
            return Some((None, self.seal_scratch(&h)));
        };
        let resend = match p.maybe_resend {
            true => p.inflight.iter().position(|f| f.resend),
            false => None,
        };
        p.maybe_resend = resend.is_some();
        let (seq, idx) = if let Some(idx) = resend {
            let f = &mut p.inflight[idx];
            f.resend = false;
            f.retries += 1;
            self.stats.retransmits += 1;
            (f.seq, Some(idx))
        } else if let Some(f) = p.ready.pop_front() {
            let seq = f.seq;
            p.inflight.push_back(f);
            (seq, Some(p.inflight.len() - 1))
        } else if p.inflight.len() < window && !p.queued.is_empty() {
            let buf = p.queued.pop_front()?;
            let seq = p.next_seq;
            p.next_seq += 1;
            p.inflight.push_back(InFlight {
                seq,
                body_end: buf.len(),
                buf,
                sealed: false,
                sealed_as: None,
                sent_at: now,
                tx: 0,
                retries: 0,
                sacked: false,
                resend: false,
            });
            (seq, Some(p.inflight.len() - 1))
        } else if p.ack_due.is_some_and(|d| d <= now) {
            self.stats.acks_sent += 1;
            (0, None)
        } else if !p.confirmed && now >= p.hello_at {
            // Ask again for the confirmation, backing off as greetings do.
            p.next_hello(now, self.cfg.rto_max);
            (0, None)
        } else {
            return None;
        };
        let mut h = self.header(peer, seq, peer_epoch);
        h.nonce = self.next_nonce();
        let key = &self.tx_keys[peer as usize];
        let p = &mut self.peers[peer as usize];
        let ack_was = (p.ack_due.take(), std::mem::take(&mut p.unacked_received));
        match idx {
            Some(i) => {
                p.tx_count += 1;
                p.last_sent = now;
                let f = &mut p.inflight[i];
                f.sent_at = now;
                f.tx = p.tx_count;
                if let Some(s) = f.sealed_as.take() {
                    let same_stream = (s.flags, s.src_epoch, s.dst_epoch, s.seq)
                        == (h.flags, h.src_epoch, h.dst_epoch, h.seq);
                    if same_stream {
                        // Sealed as it was pushed. Its acknowledgement fields may be older than
                        // what arrived since: then the due acknowledgement stays due.
                        if (s.ack, s.sack) != (h.ack, h.sack) {
                            (p.ack_due, p.unacked_received) = ack_was;
                        }
                        return Some((Some(i), f.body_end + TAG_LEN));
                    }
                    self.stats.resealed_unsent += 1;
                }
                f.buf.resize(f.body_end + TAG_LEN, 0);
                if f.sealed {
                    // Sealed by us under the header still in place: it opens.
                    let opened = DatagramHeader::open(key, &mut f.buf);
                    debug_assert!(opened.is_ok(), "a body we sealed opens");
                }
                h.write(&mut f.buf);
                f.sealed = true;
                Some((Some(i), DatagramHeader::seal(key, &mut f.buf, f.body_end)))
            }
            None => Some((None, self.seal_scratch(&h))),
        }
    }

    /// Writes a body-less datagram with header `h` into `scratch`; returns its length.
    fn seal_scratch(&mut self, h: &DatagramHeader) -> usize {
        self.seal_scratch_with(h, &[], HEADER_LEN + TAG_LEN)
    }

    /// A padded probe `len` bytes long in all: the wall clock `wall` (u64, Unix ns) after the
    /// header, then zeros.
    fn seal_scratch_padded(&mut self, h: &DatagramHeader, len: usize, wall: u64) -> usize {
        self.seal_scratch_with(h, &wall.to_le_bytes(), len)
    }

    /// A pure datagram in `scratch` under a fresh nonce: header, `body`, zeros up to `len`
    /// bytes in all (at least what header, body and tag take), tag.
    fn seal_scratch_with(&mut self, h: &DatagramHeader, body: &[u8], len: usize) -> usize {
        let mut h = *h;
        h.nonce = self.next_nonce();
        let len = len.max(HEADER_LEN + body.len() + TAG_LEN);
        self.scratch.clear();
        self.scratch.resize(len, 0);
        h.write(&mut self.scratch);
        self.scratch[HEADER_LEN..HEADER_LEN + body.len()].copy_from_slice(body);
        DatagramHeader::seal(
            &self.tx_keys[h.dst_host as usize],
            &mut self.scratch,
            len - TAG_LEN,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::sim::{SimConfig, SimNet};
    use crate::wire::{Key, OpHeader, OpIter, Status};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn cfg() -> TransportConfig {
        TransportConfig {
            window: 64,
            max_queued: 64,
            rto_init: 200_000,
            rto_min: 100_000,
            peer_timeout: 500_000_000,
            ..Default::default()
        }
    }

    static DATA: [u8; 600] = [0x5a; 600];

    /// An op big enough that about two fit in a datagram, so faults hit many datagrams.
    fn op(req: u64) -> OpRef<'static> {
        OpRef::GetReply {
            h: OpHeader {
                job: 1,
                src_rank: 0,
                dst_rank: 1,
                req,
            },
            status: Status::Ok,
            frag_off: 0,
            last: true,
            data: &DATA,
        }
    }

    /// Data of the large ops [`exchange_mapped`] sends from "mapped memory" (sealed as pushed).
    static BIG: [u8; 9000] = {
        let mut a = [0u8; 9000];
        let mut i = 0;
        while i < a.len() {
            a[i] = (i * 7 + i / 251) as u8;
            i += 1;
        }
        a
    };

    /// Drives two transports through `net` until `n` ops sent each way arrive (or time runs out);
    /// returns what each side received, in delivery order.
    fn exchange(net: &mut SimNet, n: u64, max_time: u64) -> (Vec<u64>, Vec<u64>) {
        let (a, b, _) = exchange_mapped(net, n, max_time, false);
        (a, b)
    }

    /// [`exchange`]; with `mapped`, every third op carries [`BIG`] through
    /// [`Transport::push_op_mapped`], checked on arrival. Also returns how many datagrams
    /// were sealed as they were pushed.
    fn exchange_mapped(
        net: &mut SimNet,
        n: u64,
        max_time: u64,
        mapped: bool,
    ) -> (Vec<u64>, Vec<u64>, u64) {
        // Loopback's datagram size when large ops are in the mix, so that they fit.
        let c = match mapped {
            true => TransportConfig {
                mtu: 65_000,
                ..cfg()
            },
            false => cfg(),
        };
        let mut t = [
            Transport::new(0, 2, Key([1; 32]), c.clone(), 11),
            Transport::new(1, 2, Key([1; 32]), c, 22),
        ];
        let mut got = [Vec::new(), Vec::new()];
        let mut next = [1u64, 1u64];
        let mut now = 0u64;
        while now < max_time && (got[0].len() < n as usize || got[1].len() < n as usize) {
            for h in 0..2 {
                // With large ops, push as the NIC's streams do: a few datagrams ahead.
                while next[h] <= n && !(mapped && t[h].queued_len(1 - h as u16) >= 2) {
                    let (to, req) = (1 - h as u16, next[h]);
                    let pushed = if mapped && req % 3 == 0 {
                        let OpRef::GetReply { h: oh, status, .. } = op(req) else {
                            unreachable!()
                        };
                        let head = OpRef::GetReply {
                            h: oh,
                            status,
                            frag_off: 0,
                            last: true,
                            data: &[],
                        };
                        // SAFETY: a static buffer.
                        unsafe { t[h].push_op_mapped(to, &head, BIG.as_ptr(), BIG.len()) }
                    } else {
                        t[h].push_op(to, &op(req))
                    };
                    if pushed.is_err() {
                        break;
                    }
                    next[h] += 1;
                }
                t[h].flush(now);
                t[h].handle_timeout(now);
                while let Some((to, d)) = t[h].poll_transmit(now) {
                    let d = d.to_vec();
                    net.send(now, h as u16, to, &d);
                }
            }
            while let Some((to, mut d)) = net.recv_due(now) {
                let h = to as usize;
                let r = t[h].on_datagram(now, &mut d).expect("valid datagram");
                let mut bodies: Vec<Vec<u8>> = r.body.map(|b| b.to_vec()).into_iter().collect();
                while let Some(b) = t[h].take_ready(r.peer) {
                    bodies.push(b);
                }
                for b in bodies {
                    for o in OpIter::new(&b) {
                        let o = o.unwrap();
                        let data = o.split_trailing().0;
                        let want: &[u8] = if data.len() == BIG.len() { &BIG } else { &DATA };
                        assert_eq!(data, want, "op {}", o.header().req);
                        got[h].push(o.header().req);
                    }
                }
            }
            now += 20_000;
        }
        let [a, b] = got;
        let sealed = t.iter().map(|t| t.stats.sealed_at_push).sum();
        (a, b, sealed)
    }

    /// Delivers every datagram each side has to send to the other, until neither has any.
    fn shuttle(t: &mut [Transport; 2], now: u64) {
        for _ in 0..10 {
            let mut any = false;
            for h in 0..2 {
                while let Some((to, d)) = t[h].poll_transmit(now) {
                    let mut d = d.to_vec();
                    any = true;
                    let _ = t[to as usize].on_datagram(now, &mut d);
                }
            }
            if !any {
                break;
            }
        }
    }

    /// Shuttles datagrams between both, 100 µs apart, until their session is open; returns
    /// when (`now` is where to start).
    fn converge(t: &mut [Transport; 2], mut now: u64) -> u64 {
        let start = now;
        while !(t[0].is_open(1) && t[1].is_open(0)) {
            assert!(now - start < 3_000_000_000, "no session within 3 s");
            now += 100_000;
            shuttle(t, now);
        }
        now
    }

    /// Two transports whose session is open (greetings exchanged at time 0).
    fn pair() -> [Transport; 2] {
        let mut t = [
            Transport::new(0, 2, Key([1; 32]), cfg(), 11),
            Transport::new(1, 2, Key([1; 32]), cfg(), 22),
        ];
        shuttle(&mut t, 0);
        assert!(
            t[0].is_open(1) && t[1].is_open(0),
            "greetings open the session"
        );
        t
    }

    #[test]
    fn a_probe_pads_to_the_mtu_and_carries_the_wall_clock() {
        let mut t = pair();
        let mtu = t[0].config().mtu;
        assert!(t[1].peer_view(0, 0).unwrap().largest < mtu);
        t[0].probe(1_000, 5_000_000_000);
        let mut sizes = Vec::new();
        while let Some((to, d)) = t[0].poll_transmit(2_000) {
            assert_eq!(to, 1);
            sizes.push(d.len());
            let mut d = d.to_vec();
            t[1].on_datagram(3_000, &mut d).unwrap();
        }
        assert_eq!(sizes.iter().filter(|&&l| l == mtu).count(), 3, "{sizes:?}");
        let v = t[1].peer_view(0, 4_000).unwrap();
        assert_eq!(v.largest, mtu);
        // The clock as it was when the probe left (1 µs after the probe call), seen 1 µs ago.
        assert_eq!(v.clock, Some((5_000_001_000, 1_000)));
        // Padding goes only with pure datagrams: one that also has a sequence number is
        // refused, and nothing is delivered.
        t[0].probe(5_000, 0);
        let (_, d) = t[0].poll_transmit(6_000).unwrap();
        let mut d = d.to_vec();
        let len = d.len() - TAG_LEN;
        // Resealed by the sender's key with seq = 1.
        assert!(DatagramHeader::open(&Key([1; 32]).sealing(0), &mut d).is_ok());
        d[16] = 1;
        DatagramHeader::seal(&Key([1; 32]).sealing(0), &mut d, len);
        assert!(t[1].on_datagram(7_000, &mut d).is_err());
    }

    /// Pushes one lazy op at `now` (deadline `now + 10 µs`), flushes, and says whether a
    /// datagram left at once.
    fn lazy_leaves_at_once(t: &mut Transport, now: u64) -> bool {
        t.push_op_lazy_until(1, &op(now), now + 10_000).unwrap();
        t.flush(now);
        t.poll_transmit(now).is_some()
    }

    #[test]
    fn per_host_keys_a_host_cannot_speak_as_another() {
        use crate::keys::HostKey;
        let hk: Vec<HostKey> = (0..3).map(|_| HostKey::generate()).collect();
        let publics: Vec<[u8; 32]> = hk.iter().map(|k| k.public()).collect();
        let keys = |i: usize| hk[i].pair_keys(i, &publics);
        let mut t0 = Transport::new(0, 3, keys(0), cfg(), 1);
        let mut t1 = Transport::new(1, 3, keys(1), cfg(), 2);
        // Host 2 writes a datagram for host 0 and then claims to be host 1: it can tag it only
        // with its own key for host 0, which is not the pair (0, 1)'s.
        let mut t2 = Transport::new(2, 3, keys(2), cfg(), 3);
        let mut forged = t2.poll_transmit(0).unwrap().1.to_vec();
        forged[4..6].copy_from_slice(&1u16.to_le_bytes());
        assert_eq!(
            t0.on_datagram(0, &mut forged).err(),
            Some(WireError::BadTag)
        );
        assert_eq!(t0.auth_failures_from(), &[0, 1, 0]);
        // The real host 1 gets through.
        let mut hello = t1.poll_transmit(0).unwrap().1.to_vec();
        assert!(t0.on_datagram(0, &mut hello).is_ok());
        assert_eq!(t0.stats.auth_failures, 1);
    }

    #[test]
    fn lone_lazy_ops_stop_waiting_and_company_makes_them_wait_again() {
        let [mut t, _] = pair();
        let mut now = 0;
        // Two lazy ops that sit out their deadline alone (a blocking put's ACK)...
        for _ in 0..2 {
            assert!(
                !lazy_leaves_at_once(&mut t, now),
                "a lazy op waits for company"
            );
            now += 10_000;
            t.flush(now);
            assert!(t.poll_transmit(now).is_some(), "and leaves at its deadline");
            now += 1_000;
        }
        // ...and the next ones leave at the next flush, but for one probe in sixteen.
        let waited = (0..32)
            .filter(|_| {
                now += 1_000;
                let at_once = lazy_leaves_at_once(&mut t, now);
                if !at_once {
                    // Company arrives for the probe: an eager op (a ping-pong's answer).
                    t.push_op(1, &op(now)).unwrap();
                    t.flush(now);
                    assert!(t.poll_transmit(now).is_some());
                }
                !at_once
            })
            .count();
        assert_eq!(
            waited,
            32 - 15,
            "after the accompanied probe, lazy ops wait again"
        );
    }

    /// Settled: nothing unacknowledged either way. Quiet (an op pushed now would travel
    /// alone): nothing of ours waits to go or to be acknowledged, whatever we owe the peer.
    #[test]
    fn settled_once_data_is_acked_and_acks_are_sent_quiet_once_ours_is() {
        let [mut a, mut b] = pair();
        assert!(!a.unsettled() && !b.unsettled());
        assert!(a.quiet() && b.quiet());
        a.push_op(1, &op(1)).unwrap();
        assert!(a.unsettled(), "queued, not yet sent");
        assert!(!a.quiet(), "an open datagram");
        a.flush(0);
        let mut d = a.poll_transmit(0).unwrap().1.to_vec();
        assert!(a.unsettled(), "sent, not yet acknowledged");
        assert!(!a.quiet(), "in flight");
        assert!(b.on_datagram(0, &mut d).unwrap().body.is_some());
        assert!(b.unsettled(), "b owes an acknowledgement");
        assert!(b.quiet(), "an acknowledgement owed is not b's data");
        let later = cfg().ack_delay;
        b.flush(later);
        let mut ack = b.poll_transmit(later).unwrap().1.to_vec();
        assert!(!b.unsettled());
        a.on_datagram(later, &mut ack).unwrap();
        assert!(!a.unsettled());
        assert!(a.quiet(), "acknowledged");
    }

    #[test]
    fn clean_network_delivers_in_order() {
        let mut net = SimNet::new(SimConfig::default());
        let (a, b) = exchange(&mut net, 5000, 10_000_000_000);
        assert_eq!(a, (1..=5000).collect::<Vec<_>>());
        assert_eq!(b, (1..=5000).collect::<Vec<_>>());
    }

    /// A network losing 30% of datagrams, duplicating and reordering 20%.
    fn faulty_net(seed: u64) -> SimNet {
        SimNet::new(SimConfig {
            seed,
            loss: 0.3,
            duplicate: 0.2,
            reorder: 0.2,
            ..Default::default()
        })
    }

    #[test]
    fn exactly_once_in_order_under_loss_duplication_reordering() {
        for seed in 1..4 {
            let mut net = faulty_net(seed);
            let (a, b) = exchange(&mut net, 3000, 60_000_000_000);
            assert_eq!(a, (1..=3000).collect::<Vec<_>>(), "seed {seed}");
            assert_eq!(b, (1..=3000).collect::<Vec<_>>(), "seed {seed}");
            assert!(
                net.stats.lost > 100 && net.stats.duplicated > 100 && net.stats.reordered > 100
            );
        }
    }

    /// Large ops sealed as they are pushed, among ordinary ones both ways: each arrives once,
    /// in order, with its data, also when its acknowledgement fields went stale before it left
    /// or it had to be sealed again for a retransmission.
    #[test]
    fn ops_sealed_at_push_arrive_once_in_order_under_faults() {
        let mut net = SimNet::new(SimConfig::default());
        let (a, b, sealed) = exchange_mapped(&mut net, 3000, 10_000_000_000, true);
        assert!(sealed > 100, "{sealed} sealed at push");
        assert_eq!(a, (1..=3000).collect::<Vec<_>>());
        assert_eq!(b, (1..=3000).collect::<Vec<_>>());
        for seed in 1..4 {
            let mut net = faulty_net(seed);
            let (a, b, sealed) = exchange_mapped(&mut net, 2000, 60_000_000_000, true);
            assert!(sealed > 100, "seed {seed}: {sealed} sealed at push");
            assert_eq!(a, (1..=2000).collect::<Vec<_>>(), "seed {seed}");
            assert_eq!(b, (1..=2000).collect::<Vec<_>>(), "seed {seed}");
        }
    }

    /// An op is sealed as it is pushed only when its datagram may leave at once; otherwise its
    /// data is copied in and it waits in the queue like any other.
    #[test]
    fn sealing_at_push_only_when_the_datagram_leaves_next() {
        let c = TransportConfig {
            mtu: 65_000,
            ..cfg()
        };
        let mut t = [
            Transport::new(0, 2, Key([1; 32]), c.clone(), 11),
            Transport::new(1, 2, Key([1; 32]), c, 22),
        ];
        shuttle(&mut t, 0);
        let head = OpRef::GetReply {
            h: OpHeader::default(),
            status: Status::Ok,
            frag_off: 0,
            last: true,
            data: &[],
        };
        t[0].push_op(1, &op(1)).unwrap();
        // SAFETY: a static buffer.
        unsafe { t[0].push_op_mapped(1, &head, BIG.as_ptr(), BIG.len()) }.unwrap();
        assert_eq!(
            t[0].peers[1].ready.len(),
            1,
            "sealed with the small op before it"
        );
        assert!(t[0].peers[1].open.is_none() && t[0].peers[1].queued.is_empty());
        t[0].push_op(1, &op(2)).unwrap();
        t[0].flush(0);
        assert_eq!(t[0].queued_len(1), 2);
        // Something queued before it: copied, queued behind.
        unsafe { t[0].push_op_mapped(1, &head, BIG.as_ptr(), BIG.len()) }.unwrap();
        t[0].flush(0);
        assert_eq!(
            (t[0].peers[1].ready.len(), t[0].peers[1].queued.len()),
            (1, 2)
        );
        // Below the threshold: copied into the open datagram.
        unsafe { t[0].push_op_mapped(1, &head, BIG.as_ptr(), SEAL_AT_PUSH_MIN - 1) }.unwrap();
        assert!(t[0].peers[1].open.is_some());
        t[0].flush(0);
        let sent: Vec<u64> = std::iter::from_fn(|| {
            let (_, d) = t[0].poll_transmit(0)?;
            Some(get_seq(d))
        })
        .collect();
        assert_eq!(sent, [1, 2, 3, 4], "in sequence, the sealed one first");
    }

    fn get_seq(d: &[u8]) -> u64 {
        u64::from_le_bytes(d[16..24].try_into().unwrap())
    }

    /// Runs `t` alone through `net` from `*now` until `stop` or `limit`; returns the events.
    fn run_alone(
        t: &mut Transport,
        net: &mut SimNet,
        now: &mut u64,
        limit: u64,
        mut stop: impl FnMut(&TransportEvent) -> bool,
    ) -> Vec<TransportEvent> {
        let mut evs = Vec::new();
        while *now < limit {
            t.flush(*now);
            t.handle_timeout(*now);
            while let Some((to, d)) = t.poll_transmit(*now) {
                let d = d.to_vec();
                net.send(*now, 0, to, &d);
            }
            while let Some(ev) = t.poll_event() {
                let done = stop(&ev);
                evs.push(ev);
                if done {
                    return evs;
                }
            }
            *now += 1_000_000;
        }
        evs
    }

    #[test]
    fn silent_peer_is_declared_dead_after_the_timeout_and_revives_on_contact() {
        let mut net = SimNet::new(SimConfig::default());
        let [mut t, mut other] = pair();
        net.set_down(1, true);
        t.push_op(1, &op(1)).unwrap();
        let mut now = 1_000;
        let evs = run_alone(&mut t, &mut net, &mut now, 2_000_000_000, |e| {
            *e == TransportEvent::PeerDead(1)
        });
        assert_eq!(evs, vec![TransportEvent::PeerDead(1)]);
        assert!(now >= cfg().peer_timeout, "not before peer_timeout");
        assert!(now <= cfg().peer_timeout + 3_000_000, "soon after it");
        assert!(t.stats.retransmits > 0 && t.stats.timeouts > 0);
        assert_eq!(t.push_op(1, &op(2)), Err(PushError::Dead(1)));
        // The peer answers the greeting: the session opens again, on both sides, and data
        // flows (the peer's old session with us was ended by it).
        let mut both = [t, other];
        let opened = converge(&mut both, now);
        [t, other] = both;
        assert!(
            opened - now <= cfg().rto_max + 1_000_000,
            "within one greeting interval"
        );
        let now = opened;
        assert_eq!(other.poll_event(), Some(TransportEvent::PeerReset(0)));
        t.push_op(1, &op(3)).unwrap();
        t.flush(now);
        let (_, d) = t.poll_transmit(now).unwrap();
        let mut d = d.to_vec();
        assert!(other.on_datagram(now, &mut d).unwrap().body.is_some());
    }

    #[test]
    fn data_for_a_peer_that_never_answers_fails_after_the_timeout() {
        let mut net = SimNet::new(SimConfig::default());
        net.set_down(1, true);
        let mut t = Transport::new(0, 2, Key([1; 32]), cfg(), 5);
        t.push_op(1, &op(1)).unwrap();
        let mut now = 0;
        let evs = run_alone(&mut t, &mut net, &mut now, 2_000_000_000, |_| true);
        assert_eq!(evs, vec![TransportEvent::PeerDead(1)]);
        assert!(now >= cfg().peer_timeout);
        assert!(!t.is_open(1));
    }

    #[test]
    fn a_restarted_peer_is_noticed_within_a_round_trip_and_admitted() {
        let [mut a, _b] = pair();
        // Data from a is in flight when b dies.
        a.push_op(1, &op(1)).unwrap();
        a.flush(10);
        let _lost = a.poll_transmit(10).unwrap();
        // b starts again (5 ms later): a new incarnation greets a, and a notices at once.
        let b2 = Transport::new(1, 2, Key([1; 32]), cfg(), 99);
        let mut t = [a, b2];
        shuttle(&mut t, 5_000_000);
        let [a2, mut b] = t;
        a = a2;
        assert!(a.is_open(1) && b.is_open(0));
        assert_eq!(a.poll_event(), Some(TransportEvent::PeerReset(1)));
        assert_eq!(a.stats.peer_restarts, 1);
        assert!(!a.unsettled(), "the old session's data was dropped");
        // The next op goes to the new incarnation at once.
        a.push_op(1, &op(2)).unwrap();
        a.flush(5_000_010);
        let (_, d) = a.poll_transmit(5_000_010).unwrap();
        let mut d = d.to_vec();
        let r = b.on_datagram(5_000_020, &mut d).unwrap();
        let got: Vec<u64> = OpIter::new(r.body.unwrap())
            .map(|o| o.unwrap().header().req)
            .collect();
        assert_eq!(got, vec![2]);
        assert_eq!(b.poll_event(), None, "a fresh start has nothing to fail");
    }

    /// A datagram from host 1 to host 0 with this header, correctly authenticated.
    fn forged(h: DatagramHeader, body: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; HEADER_LEN + body.len() + TAG_LEN];
        h.write(&mut b);
        b[HEADER_LEN..HEADER_LEN + body.len()].copy_from_slice(body);
        let n = DatagramHeader::seal(&Key([1; 32]).sealing(1), &mut b, HEADER_LEN + body.len());
        b.truncate(n);
        b
    }

    #[test]
    fn authenticated_headers_at_extremes_change_only_counters() {
        let [mut a, mut b] = pair();
        a.push_op(1, &op(1)).unwrap();
        a.flush(10);
        let (_, d) = a.poll_transmit(10).unwrap();
        let mut first = d.to_vec();
        let (a_epoch, b_epoch) = (a.peers[1].local_epoch, b.peers[0].local_epoch);
        let base = DatagramHeader {
            flags: 0,
            src_host: 1,
            dst_host: 0,
            src_epoch: b_epoch,
            dst_epoch: a_epoch,
            seq: 0,
            ack: 1,
            sack: 0,
            nonce: 1,
        };
        let mut hostile = Vec::new();
        for (seq, ack, sack) in [
            (0, u64::MAX, 0),
            (0, 3, 0),
            (0, 0, 0),
            (0, 1, u64::MAX),
            (0, 1, 1 << 63),
            (u64::MAX, 1, 0),
            (1 << 40, 1, 0),
        ] {
            hostile.push(forged(
                DatagramHeader {
                    seq,
                    ack,
                    sack,
                    ..base
                },
                &[],
            ));
            hostile.push(forged(
                DatagramHeader {
                    seq,
                    ack,
                    sack,
                    ..base
                },
                &[1, 2, 3],
            ));
        }
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..2000 {
            let h = DatagramHeader {
                flags: rng.gen(),
                src_host: 1,
                dst_host: 0,
                src_epoch: rng.gen(),
                dst_epoch: if rng.gen_bool(0.5) {
                    a_epoch
                } else {
                    rng.gen()
                },
                seq: rng.gen(),
                ack: rng.gen(),
                sack: rng.gen(),
                nonce: rng.gen(),
            };
            hostile.push(forged(h, &[]));
        }
        for (k, d) in hostile.iter_mut().enumerate() {
            let _ = a.on_datagram(20 + k as u64, d);
        }
        assert_eq!(a.poll_event(), None, "no session was reset");
        assert!(a.is_open(1));
        assert_eq!(a.stats.peer_restarts, 0);
        assert_eq!(
            a.peers[1].inflight.len(),
            1,
            "nothing unsent was acknowledged"
        );
        assert!(a.stats.malformed > 0 && a.stats.stale > 0);
        // The real session goes on: b gets the body and a its acknowledgement.
        let r = b.on_datagram(10_000, &mut first).unwrap();
        assert!(r.body.is_some());
        b.flush(1_000_000);
        let (_, ack) = b.poll_transmit(1_000_000).unwrap();
        let mut ack = ack.to_vec();
        a.on_datagram(1_000_000, &mut ack).unwrap();
        assert!(!a.unsettled());
    }

    #[test]
    fn a_lost_tail_is_resent_after_a_round_trip_scale_probe_not_a_fixed_timer() {
        let [mut a, mut b] = pair();
        // Measure the round trip: 50 µs each way.
        let mut now = 1_000_000;
        for k in 0..8 {
            a.push_op(1, &op(k)).unwrap();
            a.flush(now);
            let (_, d) = a.poll_transmit(now).unwrap();
            let mut d = d.to_vec();
            b.on_datagram(now + 50_000, &mut d).unwrap();
            b.flush(now + 50_000 + cfg().ack_delay);
            let (_, ack) = b.poll_transmit(now + 50_000 + cfg().ack_delay).unwrap();
            let mut ack = ack.to_vec();
            a.on_datagram(now + 100_000 + cfg().ack_delay, &mut ack)
                .unwrap();
            now += 1_000_000;
        }
        let srtt = a.srtt(1).unwrap();
        assert!((100_000..=260_000).contains(&srtt), "srtt {srtt}");
        // The last body of a burst is lost: the probe resends it after about srtt + ack delay.
        a.push_op(1, &op(100)).unwrap();
        a.flush(now);
        let _lost = a.poll_transmit(now).unwrap();
        let start = now;
        loop {
            now += 10_000;
            a.handle_timeout(now);
            if a.poll_transmit(now).is_some() {
                break;
            }
            assert!(now - start < 2_000_000, "no probe within 2 ms");
        }
        assert!(now - start >= srtt, "not before a round trip");
        assert_eq!(a.stats.timeouts, 1);
    }

    #[test]
    fn a_hole_is_resent_as_soon_as_later_bodies_are_acknowledged() {
        let [mut a, mut b] = pair();
        let now = 1_000_000;
        for k in 0..5 {
            a.push_op(1, &op(k)).unwrap();
            a.flush(now);
        }
        let mut sent = Vec::new();
        while let Some((_, d)) = a.poll_transmit(now) {
            sent.push(d.to_vec());
        }
        assert!(sent.len() >= 5);
        // The first is lost, the rest arrive: b acks at once (a gap), a resends the hole.
        for d in &mut sent[1..] {
            b.on_datagram(now + 50_000, d).unwrap();
        }
        let (_, ack) = b.poll_transmit(now + 50_000).unwrap();
        let mut ack = ack.to_vec();
        a.on_datagram(now + 100_000, &mut ack).unwrap();
        assert_eq!(a.stats.fast_retransmits, 1);
        let (_, again) = a.poll_transmit(now + 100_000).unwrap();
        let mut again = again.to_vec();
        assert_eq!(again.len(), sent[0].len());
        assert_ne!(again, sent[0], "sealed again under a new nonce");
        let body = b
            .on_datagram(now + 150_000, &mut again)
            .unwrap()
            .body
            .unwrap();
        let reqs: Vec<u64> = OpIter::new(body).map(|o| o.unwrap().header().req).collect();
        assert_eq!(reqs, vec![0], "the same body");
    }

    #[test]
    fn garbage_is_counted_not_fatal() {
        let mut t = Transport::new(0, 2, Key([1; 32]), cfg(), 5);
        assert!(t.on_datagram(0, &mut [1, 2, 3]).is_err());
        let mut other = Transport::new(1, 2, Key([2; 32]), cfg(), 6);
        other.push_op(0, &op(1)).unwrap();
        other.flush(0);
        let mut d = other.poll_transmit(0).unwrap().1.to_vec();
        assert_eq!(t.on_datagram(0, &mut d).unwrap_err(), WireError::BadTag);
        assert_eq!(t.stats.auth_failures, 1);
        assert_eq!(t.stats.malformed, 1);
    }

    #[test]
    fn queue_is_bounded() {
        let mut t = Transport::new(0, 2, Key([1; 32]), cfg(), 5);
        let mut n = 0;
        while t.push_op(1, &op(n)).is_ok() {
            n += 1;
            assert!(n < 1_000_000, "queue never filled");
        }
        assert_eq!(t.push_op(1, &op(0)), Err(PushError::Full(1)));
    }
}
