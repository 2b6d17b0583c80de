//! VELO in the host core: the mailboxes of attached processes, sends into them, and messages
//! that arrived before their mailbox had room. Those wait here in arrival order and are
//! acknowledged only once written, so a receiver that does not poll holds back its senders
//! (through the credits their acknowledgements return), never loses or overwrites a message,
//! and leaves every other port alone.

use std::collections::VecDeque;

use crate::nic::gemini::{reply_header, Pending, PendingKind, Reply};
use crate::nic::velo::{Geometry, Mailbox};
use crate::phase_trace::{self, Phase};
use crate::shm::{Command, CMD_LAZY};
use crate::wire::{OpHeader, OpRef, Status};

use super::{Flow, HostCore};

/// Messages one mailbox may hold back before its senders are treated as misbehaving (their
/// credits keep well-behaved ones far below: senders × credits).
const WAITING_MAX: usize = 1 << 16;

/// One process's VELO port.
pub(super) struct VeloPort {
    mailbox: Mailbox,
    waiting: VecDeque<Waiting>,
}

impl VeloPort {
    pub(super) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }
}

/// A message waiting for room, and whom to tell once it is in.
struct Waiting {
    src: u32,
    tag: u8,
    data: Vec<u8>,
    done: Done,
}

enum Done {
    /// Acknowledge to the sender's host (the reply header names the sender's request).
    Remote { peer: u16, h: OpHeader },
    /// Complete the sender's command on this host.
    Local { session: u64, client_req: u64 },
}

impl HostCore {
    /// `VeloOpen`: the mailbox is `local_region` with `operand`-byte slots, `operand2` of them.
    pub(super) fn velo_open(&mut self, session: u64, job: u32, rank: u32, c: &Command) -> Flow {
        let port = Geometry::new(c.operand as u32, c.operand2 as u32)
            .ok_or(Status::BadRequest)
            .and_then(|g| {
                let r = self.endpoints.region(job, rank, c.local_region)?.clone();
                Mailbox::new(r, g)
            });
        let port = port.map(|mailbox| VeloPort {
            mailbox,
            waiting: VecDeque::new(),
        });
        let status = super::open_port(&mut self.velo, (job, rank), port);
        self.complete(session, c.client_req, status, 0);
        Flow::Done
    }

    /// `VeloSend`: `inline` to the mailbox of `c.rank`, tag `c.operand`.
    pub(super) fn velo_send(
        &mut self,
        now: u64,
        session: u64,
        job: u32,
        rank: u32,
        c: &Command,
        inline: &[u8],
    ) -> Flow {
        self.stats.velo_sent += 1;
        let tag = c.operand as u8;
        if c.host == self.index {
            let done = Done::Local {
                session,
                client_req: c.client_req,
            };
            if let Err((s, done)) = self.velo_arrive(job, rank, c.rank, tag, inline, done) {
                self.velo_done(done, s);
            }
            return Flow::Done;
        }
        if c.host >= self.nhosts {
            self.complete(session, c.client_req, Status::BadRequest, 0);
            return Flow::Done;
        }
        let host = c.host;
        if let Err(flow) = self.may_send(host, (job, rank), session, c.client_req) {
            return flow;
        }
        let req = self.initiator.start(Pending {
            session,
            client_req: c.client_req,
            host,
            kind: PendingKind::Put,
            started: now,
        });
        let op = OpRef::VeloMsg {
            h: OpHeader {
                job,
                src_rank: rank,
                dst_rank: c.rank,
                req,
            },
            tag,
            lazy_ack: c.flags & CMD_LAZY != 0,
            data: inline,
        };
        if self.transport.push_op(host, &op).is_err() {
            if let Some(done) =
                self.initiator
                    .complete(req, Status::PeerDead, super::gemini::lost(host))
            {
                self.completions.push(done);
            }
        }
        Flow::Done
    }

    /// A VELO message from `peer`'s process `h.src_rank` for this host's `h.dst_rank`.
    pub(super) fn velo_on_msg(
        &mut self,
        now: u64,
        peer: u16,
        h: &OpHeader,
        tag: u8,
        lazy: bool,
        data: &[u8],
    ) {
        self.stats.velo_received += 1;
        let rh = reply_header(h);
        let done = Done::Remote { peer, h: rh };
        match self.velo_arrive(h.job, h.src_rank, h.dst_rank, tag, data, done) {
            Ok(true) => self.send_reply(
                now,
                peer,
                Reply::PutAck {
                    h: rh,
                    status: Status::Ok,
                    lazy,
                },
            ),
            Ok(false) => {}
            Err((s, done)) => self.velo_done(done, s),
        }
    }

    /// Puts a message into `dst`'s mailbox, or behind the ones waiting there. `Ok(true)`:
    /// written now (the caller acknowledges); `Ok(false)`: waiting (acknowledged when
    /// written); `Err`: refused, with why.
    fn velo_arrive(
        &mut self,
        job: u32,
        src: u32,
        dst: u32,
        tag: u8,
        data: &[u8],
        done: Done,
    ) -> Result<bool, (Status, Done)> {
        let Some(port) = self.velo.get_mut(&(job, dst)) else {
            return Err((Status::NoSuchEndpoint, done));
        };
        if data.len() > port.mailbox.geometry.max_message() {
            return Err((Status::BadRequest, done));
        }
        if port.waiting.is_empty() && port.mailbox.deliver(src, tag, data) {
            phase_trace::stamp(Phase::VeloWritten);
            self.wake_process(job, dst);
            if let Done::Local { .. } = done {
                self.velo_done(done, Status::Ok);
            }
            return Ok(true);
        }
        if port.waiting.len() >= WAITING_MAX {
            self.stats.malformed_ops += 1;
            return Err((Status::BadRequest, done));
        }
        port.waiting.push_back(Waiting {
            src,
            tag,
            data: data.to_vec(),
            done,
        });
        Ok(false)
    }

    fn velo_done(&mut self, done: Done, status: Status) {
        match done {
            Done::Local {
                session,
                client_req,
            } => self.complete(session, client_req, status, 0),
            Done::Remote { peer, h } => {
                let now = self.now;
                self.send_reply(
                    now,
                    peer,
                    Reply::PutAck {
                        h,
                        status,
                        lazy: false,
                    },
                )
            }
        }
    }

    /// Writes waiting messages into the mailboxes that have room again; whether any moved.
    pub(super) fn velo_flush(&mut self) -> bool {
        if !self.velo.values().any(VeloPort::has_waiting) {
            return false;
        }
        let mut written = Vec::new();
        let mut woken = Vec::new();
        for (&(job, rank), port) in self.velo.iter_mut().filter(|(_, p)| p.has_waiting()) {
            let before = written.len();
            while let Some(w) = port.waiting.front() {
                if !port.mailbox.deliver(w.src, w.tag, &w.data) {
                    break;
                }
                written.extend(port.waiting.pop_front().map(|w| w.done));
            }
            if written.len() > before {
                woken.push((job, rank));
            }
        }
        for (job, rank) in woken {
            self.wake_process(job, rank);
        }
        let moved = !written.is_empty();
        for done in written {
            self.velo_done(done, Status::Ok);
        }
        moved
    }

    /// Tells the driver that (job, rank)'s memory changed (so a sleeping process is woken).
    pub(super) fn wake_process(&mut self, job: u32, rank: u32) {
        if let Ok(ep) = self.endpoints.get(job, rank) {
            let s = ep.session;
            if self.wakes.last() != Some(&s) {
                self.wakes.push(s);
            }
        }
    }

    /// A process leaves: its port goes, and whoever waits on a message for it learns so.
    pub(super) fn velo_close(&mut self, job: u32, rank: u32) {
        if let Some(port) = self.velo.remove(&(job, rank)) {
            for w in port.waiting {
                self.velo_done(w.done, Status::NoSuchEndpoint);
            }
        }
    }
}
