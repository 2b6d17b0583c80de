//! The simulation harness: N host cores (the same [`HostCore`] the daemon drives) over the
//! seeded [`SimNet`], on a virtual clock, with sessions whose memory is plain heap buffers.
//!
//! Tests hand commands to sessions, let virtual time run until a condition holds, crash and
//! restart hosts, cut them off (`net.set_down`) and inject hostile datagrams; everything is a
//! function of the seed. Time jumps from one event to the next (a datagram due, a host's
//! deadline), so a run that waits out a multi-second peer timeout costs microseconds.

use std::collections::VecDeque;

use rustc_hash::FxHashMap as HashMap;

use crate::nic::host::{AttachError, Flow, HostCore};
use crate::nic::memory::Region;
use crate::shm::{Command, CqEntry};
use crate::transport::sim::{SimConfig, SimNet};
use crate::transport::TransportConfig;
use crate::wire::{Key, Status};

/// The condition did not hold within the virtual time allowed: a hang, as a test sees it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("no progress to the condition within {waited_ns} ns of virtual time (now {now_ns} ns)")]
pub struct SimTimeout {
    pub waited_ns: u64,
    pub now_ns: u64,
}

/// Why a session could not attach in the simulation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimAttachError {
    #[error("host {0} is crashed")]
    HostDown(u16),
    #[error(transparent)]
    Refused(#[from] AttachError),
}

/// A command waiting for room in its host's transport.
struct Queued {
    session: u64,
    cmd: Command,
    inline: Vec<u8>,
}

/// N hosts on one simulated network; see the module doc.
pub struct SimCluster {
    pub net: SimNet,
    hosts: Vec<Option<HostCore>>,
    key: Key,
    cfg: TransportConfig,
    /// Virtual time, ns.
    pub now: u64,
    /// Starts so far, for distinct incarnations.
    starts: u64,
    queued: Vec<VecDeque<Queued>>,
    completions: HashMap<u64, Vec<CqEntry>>,
}

impl SimCluster {
    /// `nhosts` hosts sharing one cluster key (as the local default does).
    pub fn new(nhosts: u16, cfg: TransportConfig, net: SimConfig) -> SimCluster {
        let key = Key([0x5a; 32]);
        let mut c = SimCluster {
            net: SimNet::new(net),
            hosts: (0..nhosts).map(|_| None).collect(),
            key,
            cfg,
            now: 0,
            starts: 0,
            queued: (0..nhosts).map(|_| VecDeque::new()).collect(),
            completions: HashMap::default(),
        };
        for h in 0..nhosts {
            c.start(h);
        }
        c
    }

    fn start(&mut self, h: u16) {
        self.starts += 1;
        let n = self.hosts.len() as u16;
        let seed = self.starts * 7919 + h as u64;
        self.hosts[h as usize] = Some(HostCore::new(
            h,
            n,
            format!("sim{h}"),
            self.key.clone(),
            self.cfg.clone(),
            seed,
        ));
    }

    /// The cluster key (to forge authenticated datagrams in tests).
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// Host `h`'s core; `None` while it is crashed.
    pub fn host(&self, h: u16) -> Option<&HostCore> {
        self.hosts.get(h as usize)?.as_ref()
    }

    pub fn host_mut(&mut self, h: u16) -> Option<&mut HostCore> {
        self.hosts.get_mut(h as usize)?.as_mut()
    }

    fn live(&mut self, h: u16) -> Result<&mut HostCore, Status> {
        self.host_mut(h).ok_or(Status::PeerDead)
    }

    /// Attaches `session` (ids are the caller's, unique across the cluster) on host `h`.
    pub fn attach(
        &mut self,
        h: u16,
        session: u64,
        job: u32,
        job_key: u64,
        rank: u32,
        size: u32,
    ) -> Result<(), SimAttachError> {
        let core = self.host_mut(h).ok_or(SimAttachError::HostDown(h))?;
        Ok(core.attach(session, job, job_key, rank, size)?)
    }

    /// Registers memory of `session` on host `h`; its handle.
    pub fn register(&mut self, h: u16, session: u64, region: Region) -> Result<u32, Status> {
        self.live(h)?.register(session, region)
    }

    /// Hands a command of `session` to host `h`, in order after any still waiting for room.
    pub fn submit(&mut self, h: u16, session: u64, cmd: Command, inline: &[u8]) {
        self.queued[h as usize].push_back(Queued {
            session,
            cmd,
            inline: inline.to_vec(),
        });
        self.feed(h);
    }

    /// Drains the completions `session` has received so far.
    pub fn take_completions(&mut self, session: u64) -> Vec<CqEntry> {
        self.completions.remove(&session).unwrap_or_default()
    }

    /// Completions of `session` received and not yet taken.
    pub fn completions(&self, session: u64) -> &[CqEntry] {
        self.completions.get(&session).map_or(&[], |v| v)
    }

    /// Host `h` dies: its state is gone, nothing reaches it, its queued commands are lost.
    pub fn crash(&mut self, h: u16) {
        self.hosts[h as usize] = None;
        self.queued[h as usize].clear();
        self.net.set_down(h, true);
    }

    /// Host `h` starts again with a new incarnation and no sessions.
    pub fn restart(&mut self, h: u16) {
        self.start(h);
        self.net.set_down(h, false);
    }

    /// A datagram arrives at host `h` now, from nobody in particular (hostile input).
    pub fn inject(&mut self, h: u16, bytes: &[u8]) {
        let now = self.now;
        if let Some(core) = self.host_mut(h) {
            core.handle_datagram(now, &mut bytes.to_vec());
        }
    }

    fn feed(&mut self, h: u16) {
        let now = self.now;
        let Some(core) = self.hosts[h as usize].as_mut() else {
            return;
        };
        // Each session's commands in order, as from its own ring: one that must wait holds
        // back only its own session's later commands.
        let q = &mut self.queued[h as usize];
        let mut waiting: Vec<u64> = Vec::new();
        let mut i = 0;
        while i < q.len() {
            let c = &q[i];
            if waiting.contains(&c.session) {
                i += 1;
                continue;
            }
            match core.handle_command(now, c.session, &c.cmd, &c.inline) {
                Flow::Done => {
                    q.remove(i);
                }
                Flow::Backpressure => {
                    waiting.push(c.session);
                    i += 1;
                }
            }
        }
    }

    /// One round at the current time: commands in, due datagrams in, timers, outputs out.
    fn round(&mut self) {
        let now = self.now;
        for h in 0..self.hosts.len() as u16 {
            self.feed(h);
        }
        while let Some((to, mut d)) = self.net.recv_due(now) {
            if let Some(core) = self.hosts[to as usize].as_mut() {
                core.handle_datagram(now, &mut d);
            }
        }
        for h in 0..self.hosts.len() as u16 {
            self.feed(h);
            let Some(core) = self.hosts[h as usize].as_mut() else {
                continue;
            };
            core.deliver_events();
            core.handle_timeout(now);
            while let Some((to, d)) = core.poll_transmit(now) {
                self.net.send(now, h, to, d);
            }
            core.deliver_events();
            while let Some((s, e)) = core.poll_completion() {
                self.completions.entry(s).or_default().push(e);
            }
            // Sessions read their event rings themselves: wake-ups are the daemon's business.
            while core.poll_wake().is_some() {}
        }
    }

    /// When something next happens: a datagram due, a host deadline, or (with work waiting
    /// for room) a microsecond on.
    fn next_time(&self) -> u64 {
        let busy = self.queued.iter().any(|q| !q.is_empty())
            || self
                .hosts
                .iter()
                .flatten()
                .any(|c| c.has_backlog() || c.has_completions());
        let mut t = if busy { self.now + 1_000 } else { u64::MAX };
        if let Some(at) = self.net.next_due() {
            t = t.min(at);
        }
        for c in self.hosts.iter().flatten() {
            if let Some(at) = c.next_deadline() {
                t = t.min(at);
            }
        }
        t.max(self.now + 1)
    }

    /// Runs until `cond` holds, or fails after `limit_ns` of virtual time.
    pub fn run_until(
        &mut self,
        limit_ns: u64,
        mut cond: impl FnMut(&mut SimCluster) -> bool,
    ) -> Result<(), SimTimeout> {
        let start = self.now;
        let end = start.saturating_add(limit_ns);
        loop {
            self.round();
            if cond(self) {
                return Ok(());
            }
            let next = self.next_time();
            if next > end {
                self.now = end;
                self.round();
                return if cond(self) {
                    Ok(())
                } else {
                    Err(SimTimeout {
                        waited_ns: limit_ns,
                        now_ns: self.now,
                    })
                };
            }
            self.now = next;
        }
    }

    /// Lets `ns` of virtual time pass.
    pub fn run_for(&mut self, ns: u64) {
        let end = self.now.saturating_add(ns);
        let _ = self.run_until(ns, |c| c.now >= end);
    }
}
