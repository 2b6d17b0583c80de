//! The host core: the whole soft NIC of one host as a pure state machine.
//!
//! It owns the reliable transport to every peer, the Gemini and Portals engines, the sessions
//! of attached processes and their registered memory, and does no I/O and reads no clock. The
//! shape is quinn-proto's: inputs go in through `handle_*` (a datagram, a command of a session,
//! the passing of time, attach and detach), outputs come out of `poll_*` (datagrams to send,
//! completions for sessions, sessions to wake) and [`HostCore::next_deadline`]. The daemon
//! drives it over sockets and shared memory; the simulation harness (`nic::sim`) drives the same
//! type over a seeded lossy network and plain buffers.
//!
//! Memory is reached only through [`crate::nic::memory::Region`]s the driver registers, so the
//! core works the same over shared mappings and over heap buffers.

mod gemini;
pub mod ixpe;
mod portals;
mod rma;
mod sessions;
mod velo;

use std::collections::VecDeque;

// Fx: the core looks these up per operation; keys are small ids from its own sessions and
// authenticated peers.
use rustc_hash::FxHashMap as HashMap;

use crate::nic::gemini::{Completion, Initiator};
use crate::nic::memory::Endpoints;
use crate::phase_trace::{self, Phase};
use crate::shm::{Command, CqEntry};
use crate::transport::{Transport, TransportConfig, TransportEvent};

pub use sessions::AttachError;

use gemini::OutItem;
use sessions::SessionInfo;

/// Counters of this host beyond the transport's.
#[derive(Debug, Default, Clone)]
pub struct HostStats {
    pub cmd_put: u64,
    pub cmd_get: u64,
    pub cmd_amo: u64,
    pub served_put: u64,
    pub served_get: u64,
    pub served_amo: u64,
    pub local_ops: u64,
    pub cmd_portals: u64,
    pub served_portals: u64,
    /// Portals puts in several fragments written as they came (matched on the first).
    pub streamed_portals_puts: u64,
    pub velo_sent: u64,
    pub velo_received: u64,
    pub rma_ops: u64,
    pub rma_notifications: u64,
    pub malformed_ops: u64,
    pub clients_attached: u64,
    pub clients_detached: u64,
    pub attach_refused: u64,
    /// Operations failed because their peer died or restarted.
    pub failed_peer_ops: u64,
}

/// Installs (job, rank)'s port of one kind (a VELO mailbox, an RMA notification queue) in
/// `ports`, or says why not: a second port of a kind is refused.
fn open_port<P>(
    ports: &mut HashMap<(u32, u32), P>,
    key: (u32, u32),
    port: Result<P, crate::wire::Status>,
) -> crate::wire::Status {
    use crate::wire::Status;
    match port {
        Ok(_) if ports.contains_key(&key) => Status::BadRequest,
        Ok(p) => {
            ports.insert(key, p);
            Status::Ok
        }
        Err(s) => s,
    }
}

/// How soon a mailbox that had no room is looked at again.
const VELO_RECHECK_NS: u64 = 20_000;

/// Did a command go through, or must it wait for room (and be handed in again)?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Done,
    Backpressure,
}

/// Messages noted for [`HostCore::poll_addressed`] between two polls, at most.
const ADDRESSED_MAX: usize = 1024;

/// A put longer than this is not announced to its target ([`HostCore::poll_addressed`]): at
/// the few GB/s a NIC thread moves, it lands later than a waiter keeps its core for a message
/// on its way (`shm::control::KEEP_CORE_FOR`, 20 µs), so the news would only have the target
/// spin beside the transfer. The extoll conduit's Long payloads (128 KiB–1 MiB RMA puts) had
/// its target spin ~15% of a core that the stream's other threads needed.
pub const ANNOUNCE_MAX_BYTES: u64 = 64 * 1024;

/// One host's soft NIC; see the module doc.
pub struct HostCore {
    pub index: u16,
    pub name: String,
    pub(crate) nhosts: u16,
    pub transport: Transport,
    pub(crate) endpoints: Endpoints,
    initiator: Initiator,
    sessions: HashMap<u64, SessionInfo>,
    jobs: HashMap<u32, (u64, usize)>,
    out: Vec<VecDeque<OutItem>>,
    completions: Vec<Completion>,
    /// Completions with a raw status (Portals return codes).
    raw_completions: Vec<(u64, CqEntry)>,
    /// What `poll_completion` hands out, in the order the operations completed.
    ready: VecDeque<(u64, CqEntry)>,
    /// Sessions whose event queues or counts changed (for `poll_wake`).
    wakes: Vec<u64>,
    /// See [`HostCore::poll_addressed`].
    addressed: Vec<(u16, u32, u32)>,
    /// Portals interfaces of the attached processes, by (job, rank).
    portals: HashMap<(u32, u32), portals::PortalsProc>,
    ptl_asm: crate::nic::portals::wire::Reassembly,
    /// Puts in several fragments streaming into the entry they matched on their first, by
    /// message.
    ptl_put_in: HashMap<crate::nic::portals::wire::MsgKey, portals::PtlPutIn>,
    /// Scratch for the payload of the Portals operation being started.
    ptl_payload: Vec<u8>,
    /// Buffers of encoded ops (waiting for room) for reuse.
    encoded_spare: Vec<Vec<u8>>,
    /// Scratch for bytes copied out of registered memory (puts from it, streamed data).
    copy_buf: Vec<u8>,
    ptl_acks: portals::AckBatch,
    ptl_scratch: portals::MirrorScratch,
    /// An interface was reached (so its events or counts may have changed) or a ring still
    /// held unconsumed events at the last delivery: the next one looks.
    ptl_dirty: bool,
    /// PE-strided commands fanned out, by group id, until their last member completes.
    groups: HashMap<u64, ixpe::Group>,
    next_group: u64,
    /// VELO ports (mailboxes) of the attached processes, by (job, rank).
    velo: HashMap<(u32, u32), velo::VeloPort>,
    /// RMA ports (notification queues) of the attached processes, by (job, rank).
    rma: HashMap<(u32, u32), rma::RmaPort>,
    /// RMA operations this host started, by (session, client request), until they complete.
    rma_ops: HashMap<(u64, u64), rma::RmaOp>,
    /// The time of the latest input (for work the core does on its own, such as writing
    /// VELO messages that waited for room).
    now: u64,
    pub stats: HostStats,
}

impl HostCore {
    /// Host `index` of `nhosts`, authenticating with `keys`; `seed` makes its incarnation
    /// distinct (randomness in the daemon, a constant in simulations).
    pub fn new(
        index: u16,
        nhosts: u16,
        name: impl Into<String>,
        keys: impl Into<crate::wire::Keys>,
        cfg: TransportConfig,
        seed: u64,
    ) -> HostCore {
        HostCore {
            index,
            name: name.into(),
            nhosts,
            transport: Transport::new(index, nhosts, keys, cfg, seed),
            endpoints: Endpoints::default(),
            initiator: Initiator::default(),
            sessions: HashMap::default(),
            jobs: HashMap::default(),
            out: (0..nhosts).map(|_| VecDeque::new()).collect(),
            completions: Vec::new(),
            raw_completions: Vec::new(),
            ready: VecDeque::new(),
            wakes: Vec::new(),
            addressed: Vec::new(),
            portals: HashMap::default(),
            ptl_asm: Default::default(),
            ptl_put_in: HashMap::default(),
            ptl_payload: Vec::new(),
            encoded_spare: Vec::new(),
            copy_buf: Vec::new(),
            ptl_acks: Default::default(),
            ptl_scratch: Default::default(),
            ptl_dirty: false,
            groups: HashMap::default(),
            next_group: 0,
            velo: HashMap::default(),
            rma: HashMap::default(),
            rma_ops: HashMap::default(),
            now: 0,
            stats: HostStats::default(),
        }
    }

    // ------------------------------------------------------------------ inputs

    /// A command of an attached session. `Flow::Backpressure`: nothing was done; hand the same
    /// command in again later (the transport has no room now).
    pub fn handle_command(&mut self, now: u64, session: u64, cmd: &Command, inline: &[u8]) -> Flow {
        let Some(s) = self.sessions.get(&session) else {
            // Not attached (or detached meanwhile): nobody to answer.
            return Flow::Done;
        };
        let (job, rank) = (s.job, s.rank);
        self.now = now;
        use crate::shm::CommandKind::*;
        match cmd.kind {
            // Their data is in the command: small.
            PutInline | PutV | VeloSend | RmaImmediate => self.address((cmd.host, job, cmd.rank)),
            PutFrom | RmaPut => self.address_put((cmd.host, job, cmd.rank), cmd.len),
            _ => {}
        }
        self.command(now, session, job, rank, cmd, inline)
    }

    /// A process (host, job, rank) a message was sent to since the last call: puts and VELO
    /// or RMA messages a command sent, and the puts of triggered operations as they fire;
    /// not gets or atomics, which the target does not wait for. The daemon tells that
    /// process if it serves it (`shm::control::Waiter::keep_core`).
    pub fn poll_addressed(&mut self) -> Option<(u16, u32, u32)> {
        self.addressed.pop()
    }

    /// Notes a message to `to` for [`HostCore::poll_addressed`]; a driver that never asks
    /// (the simulated network) keeps at most `ADDRESSED_MAX`: the news is a hint.
    pub(super) fn address(&mut self, to: (u16, u32, u32)) {
        if self.addressed.len() < ADDRESSED_MAX {
            self.addressed.push(to);
        }
    }

    /// [`HostCore::address`] for a put of `len` bytes read from memory: only one short
    /// enough to land while its target spins for it (`ANNOUNCE_MAX_BYTES`).
    pub(super) fn address_put(&mut self, to: (u16, u32, u32), len: u64) {
        if len <= ANNOUNCE_MAX_BYTES {
            self.address(to);
        }
    }

    /// A datagram from the network (from whom is proven by its authentication tag, not by
    /// where it came from), decrypted in place. Anything invalid is counted and dropped.
    pub fn handle_datagram(&mut self, now: u64, d: &mut [u8]) {
        phase_trace::stamp(Phase::DatagramIn);
        self.now = now;
        let r = match self.transport.on_datagram(now, d) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(host = %self.name, "dropped datagram: {e}");
                return;
            }
        };
        phase_trace::stamp(Phase::DatagramOpened);
        let peer = r.peer;
        if let Some(body) = r.body {
            self.on_body(now, peer, body);
        }
        while let Some(b) = self.transport.take_ready(peer) {
            self.on_body(now, peer, &b);
            self.transport.give_back(b);
        }
        phase_trace::stamp(Phase::DatagramDone);
    }

    /// Runs timers (retransmission, liveness, delayed acks), fails what was pending on dead or
    /// restarted peers, and moves queued replies and streams into the transport.
    pub fn handle_timeout(&mut self, now: u64) {
        self.now = now;
        self.transport.handle_timeout(now);
        while let Some(ev) = self.transport.poll_event() {
            match ev {
                TransportEvent::PeerDead(h) | TransportEvent::PeerReset(h) => {
                    tracing::warn!(host = %self.name, peer = h, "peer {ev:?}: failing its pending operations");
                    let before = self.completions.len();
                    self.initiator.fail_host(h, now, &mut self.completions);
                    self.stats.failed_peer_ops += (self.completions.len() - before) as u64;
                    // Gets being answered to it end, failed, with the events they held back.
                    for item in std::mem::take(&mut self.out[h as usize]) {
                        if let gemini::OutItem::PtlReply(rs) = item {
                            self.ptl_reply_ended(h, &rs, portals::StreamEnd::PeerGone);
                        }
                    }
                    self.ptl_peer_dead(h);
                }
            }
        }
        self.flush_eager(now);
    }

    /// Closes the datagrams that hold ops in a hurry so that [`HostCore::poll_transmit`]
    /// sends them now, without running the timers (those wait for `handle_timeout`).
    pub fn flush_eager(&mut self, now: u64) {
        self.now = now;
        for peer in 0..self.nhosts {
            self.drain_out(peer);
        }
        self.transport.flush(now);
    }

    // ------------------------------------------------------------------ outputs

    /// The next datagram to send and its destination host.
    pub fn poll_transmit(&mut self, now: u64) -> Option<(u16, &[u8])> {
        self.transport.poll_transmit(now)
    }

    /// Moves Portals events and counts into the sessions' memory (their event rings and
    /// counting-event slots); returns whether anything moved. Sessions that got something
    /// come out of [`HostCore::poll_wake`].
    pub fn deliver_events(&mut self) -> bool {
        let velo = self.velo_flush();
        let rma = self.rma_flush();
        self.ptl_mirror() | velo | rma
    }

    /// The next completion for a session: (session, entry).
    pub fn poll_completion(&mut self) -> Option<(u64, CqEntry)> {
        if !self.completions.is_empty() || !self.raw_completions.is_empty() {
            let mut done = std::mem::take(&mut self.completions);
            for c in done.drain(..) {
                // Request id 0 asks for no completion (a one-way command); group members
                // complete their group.
                let Some(c) = self.through_group(c).filter(|c| c.client_req != 0) else {
                    continue;
                };
                if !self.rma_ops.is_empty() {
                    self.rma_completed(&c);
                }
                let e = CqEntry {
                    client_req: c.client_req,
                    status: c.status as u32,
                    value: c.value,
                };
                self.ready.push_back((c.session, e));
            }
            self.completions = done;
            self.ready.extend(self.raw_completions.drain(..));
        }
        self.ready.pop_front()
    }

    /// Whether completions wait to be polled.
    pub fn has_completions(&self) -> bool {
        !self.ready.is_empty() || !self.completions.is_empty() || !self.raw_completions.is_empty()
    }

    /// A session whose event queues or counting events changed since the last call.
    pub fn poll_wake(&mut self) -> Option<u64> {
        self.wakes.pop()
    }

    /// When [`HostCore::handle_timeout`] next has work (ns on the caller's clock).
    pub fn next_deadline(&self) -> Option<u64> {
        let t = self.transport.next_timeout();
        // Messages wait for a mailbox to have room: look again soon (the receiver publishes
        // its read counter in memory, no doorbell).
        if self.velo.values().any(|p| p.has_waiting()) || self.rma.values().any(|p| p.has_waiting())
        {
            let again = self.now + VELO_RECHECK_NS;
            return Some(t.map_or(again, |t| t.min(again)));
        }
        t
    }

    /// Whether replies or streams wait for room in the transport (the driver must not sleep
    /// on them).
    pub fn has_backlog(&self) -> bool {
        self.out.iter().any(|q| !q.is_empty())
    }

    /// Whether messages wait for a mailbox to have room (the simulation keeps time moving).
    pub fn has_waiting_messages(&self) -> bool {
        self.velo.values().any(|p| p.has_waiting()) || self.rma.values().any(|p| p.has_waiting())
    }

    /// Datagram bytes this host sent so far (retransmissions included).
    pub fn bytes_sent(&self) -> u64 {
        self.transport.stats.bytes_sent
    }

    /// Datagrams this host sent that carried ops (pure acknowledgements not counted).
    pub fn op_datagrams_sent(&self) -> u64 {
        let t = &self.transport.stats;
        t.datagrams_sent.saturating_sub(t.acks_sent)
    }

    /// Operations this host started and that have not completed.
    pub fn outstanding(&self) -> usize {
        self.initiator.outstanding()
    }

    /// Counter lines for `softnic stat` (name, value).
    pub fn stat_lines(&self) -> Vec<(&'static str, String)> {
        let t = &self.transport.stats;
        let s = &self.stats;
        let out_depth: usize = self.out.iter().map(|q| q.len()).sum();
        vec![
            ("packets_sent", t.datagrams_sent.to_string()),
            ("packets_received", t.datagrams_received.to_string()),
            ("bytes_sent", t.bytes_sent.to_string()),
            ("bytes_received", t.bytes_received.to_string()),
            ("retransmits", t.retransmits.to_string()),
            ("fast_retransmits", t.fast_retransmits.to_string()),
            ("sealed_at_push", t.sealed_at_push.to_string()),
            ("resealed_unsent", t.resealed_unsent.to_string()),
            ("timeouts", t.timeouts.to_string()),
            ("duplicates_suppressed", t.duplicates.to_string()),
            ("out_of_window", t.out_of_window.to_string()),
            ("acks_sent", t.acks_sent.to_string()),
            ("auth_failures", t.auth_failures.to_string()),
            ("auth_failures_by_claimed_host", {
                let by: Vec<String> = (self.transport.auth_failures_from().iter().enumerate())
                    .filter(|(_, n)| **n > 0)
                    .map(|(h, n)| format!("host{h}={n}"))
                    .collect();
                if by.is_empty() {
                    "-".into()
                } else {
                    by.join(" ")
                }
            }),
            ("malformed_datagrams", t.malformed.to_string()),
            ("stale_datagrams", t.stale.to_string()),
            ("malformed_ops", s.malformed_ops.to_string()),
            ("peers_declared_dead", t.peers_declared_dead.to_string()),
            ("peer_restarts", t.peer_restarts.to_string()),
            ("failed_peer_ops", s.failed_peer_ops.to_string()),
            ("gemini_put_issued", s.cmd_put.to_string()),
            ("gemini_get_issued", s.cmd_get.to_string()),
            ("gemini_amo_issued", s.cmd_amo.to_string()),
            ("gemini_put_served", s.served_put.to_string()),
            ("gemini_get_served", s.served_get.to_string()),
            ("gemini_amo_served", s.served_amo.to_string()),
            ("portals_calls", s.cmd_portals.to_string()),
            ("portals_served", s.served_portals.to_string()),
            ("portals_puts_streamed", s.streamed_portals_puts.to_string()),
            ("velo_sent", s.velo_sent.to_string()),
            ("velo_received", s.velo_received.to_string()),
            ("rma_ops", s.rma_ops.to_string()),
            ("rma_notifications", s.rma_notifications.to_string()),
            ("local_ops", s.local_ops.to_string()),
            ("clients_attached_total", s.clients_attached.to_string()),
            ("clients_detached_total", s.clients_detached.to_string()),
            ("attach_refused", s.attach_refused.to_string()),
            ("ops_outstanding", self.initiator.outstanding().to_string()),
            ("out_queue_depth", out_depth.to_string()),
        ]
    }
}
