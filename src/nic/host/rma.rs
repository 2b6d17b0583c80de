//! RMA in the host core: notification queues of attached processes, RMA puts, gets and
//! immediate puts (Gemini streams and gets underneath, with the notify flag on the wire), and
//! notifications that wait for room. A completer notification at a put's target is written
//! before the put is acknowledged, so a process that does not free its queue holds back the
//! origins (through their outstanding operations) and loses nothing.

use std::collections::VecDeque;

use crate::nic::gemini::{Completion, Pending, PendingKind, Reply};
use crate::nic::rma::{
    nla, Class, Cmd, NotiQueue, Notification, MAX_OP, NOTIFY_COMPLETER, NOTIFY_REQUESTER,
    NOTIFY_RESPONDER,
};
use crate::shm::{Command, CommandKind};
use crate::wire::{OpHeader, OpRef, Status};

use super::gemini::{put_fragments, OutItem, Stream};
use super::{Flow, HostCore};

/// Notifications one queue may hold back (beyond, its writers misbehave).
const WAITING_MAX: usize = 1 << 16;

/// One process's RMA port: its notification queue and what waits for room in it.
pub(super) struct RmaPort {
    queue: NotiQueue,
    waiting: VecDeque<(Notification, Option<(u16, Reply)>)>,
}

impl RmaPort {
    pub(super) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }
}

/// What the origin's NIC remembers of an RMA operation until it completes.
pub(super) struct RmaOp {
    job: u32,
    rank: u32,
    cmd: Cmd,
    notify: u8,
    peer: u32,
    local_nla: u64,
    len: u32,
}

impl HostCore {
    /// `RmaOpen`: the notification queue is `local_region` with `operand` entries.
    pub(super) fn rma_open(&mut self, session: u64, job: u32, rank: u32, c: &Command) -> Flow {
        let q = self
            .endpoints
            .region(job, rank, c.local_region)
            .and_then(|r| NotiQueue::new(r.clone(), c.operand));
        let port = q.map(|queue| RmaPort {
            queue,
            waiting: VecDeque::new(),
        });
        let status = super::open_port(&mut self.rma, (job, rank), port);
        self.complete(session, c.client_req, status, 0);
        Flow::Done
    }

    /// `RmaPut`, `RmaGet`, `RmaImmediate`: `operand` the notify flags.
    pub(super) fn rma_command(
        &mut self,
        now: u64,
        session: u64,
        job: u32,
        rank: u32,
        c: &Command,
        inline: &[u8],
    ) -> Flow {
        self.stats.rma_ops += 1;
        let notify = c.operand as u8;
        let cmd = match c.kind {
            CommandKind::RmaGet => Cmd::Get,
            CommandKind::RmaImmediate => Cmd::ImmediatePut,
            _ => Cmd::Put,
        };
        let immediate = cmd == Cmd::ImmediatePut;
        let bad = c.len > MAX_OP
            || (immediate && !(1..=8).contains(&c.len))
            || c.host >= self.nhosts
            || !self.rma.contains_key(&(job, rank))
            || notify & !(NOTIFY_REQUESTER | NOTIFY_COMPLETER | NOTIFY_RESPONDER) != 0;
        // The local side: this process's registered region (an immediate put has none).
        let local = if immediate || bad {
            None
        } else {
            match self
                .endpoints
                .region(job, rank, c.local_region)
                .and_then(|r| r.check_local(c.local_off, c.len).map(|_| r.clone()))
            {
                Ok(r) => Some(r),
                Err(s) => {
                    self.complete(session, c.client_req, s, 0);
                    return Flow::Done;
                }
            }
        };
        if bad {
            self.complete(session, c.client_req, Status::BadRequest, 0);
            return Flow::Done;
        }
        let host = c.host;
        let op = RmaOp {
            job,
            rank,
            cmd,
            notify,
            peer: c.rank,
            local_nla: if immediate {
                0
            } else {
                nla(c.local_region, c.local_off)
            },
            len: c.len as u32,
        };
        let requester = Notification {
            class: Class::Requester,
            cmd,
            error: 0,
            len: op.len,
            peer: op.peer,
            nla: op.local_nla,
        };
        let h = OpHeader {
            job,
            src_rank: rank,
            dst_rank: c.rank,
            req: 0,
        };
        if host == self.index {
            return self.rma_local(session, c, inline, h, op, requester);
        }
        // Known before the check, so that failing it (a dead host) raises its notification.
        let key = (session, c.client_req);
        self.rma_ops.insert(key, op);
        if let Err(flow) = self.may_send(host, (job, rank), session, c.client_req) {
            if flow == Flow::Backpressure {
                self.rma_ops.remove(&key);
            }
            return flow;
        }
        let kind = match (&local, cmd) {
            (Some(r), Cmd::Get) => PendingKind::Get {
                region: r.clone(),
                offset: c.local_off,
                len: c.len,
            },
            _ => PendingKind::Put,
        };
        let req = self.initiator.start(Pending {
            session,
            client_req: c.client_req,
            host,
            kind,
            started: now,
        });
        let h = OpHeader { req, ..h };
        let wants = |f: u8| notify & f != 0;
        // Nobody waits for a put's acknowledgement (the requester is notified when the
        // source was read, the completer at the target; only a failure comes back with it):
        // it waits for company, as an implicit Gemini put's does. RMA put ping-pong 8 B
        // 5.1–5.4 → 2.6–3.1 µs half round trip, the extoll conduit's blocking put 8 B 7.9–9.6
        // → 5.6–7.0 (measured).
        match (cmd, local) {
            (Cmd::Get, _) => {
                let op = OpRef::Get {
                    h,
                    region: c.remote_region,
                    offset: c.remote_off,
                    len: c.len,
                    notify: wants(NOTIFY_RESPONDER),
                };
                self.push_owned(host, &op, None);
                if wants(NOTIFY_REQUESTER) {
                    self.rma_notify(job, rank, requester, None);
                }
            }
            (_, Some(src)) => {
                let mut st = Stream::put(
                    h,
                    src,
                    c.local_off,
                    c.len,
                    c.remote_region,
                    c.remote_off,
                    true,
                    wants(NOTIFY_COMPLETER),
                );
                if wants(NOTIFY_REQUESTER) {
                    st.on_end = Some((job, rank, requester));
                }
                self.out[host as usize].push_back(OutItem::Stream(st));
                self.drain_out(host);
            }
            (_, None) => {
                let max = OpRef::max_data(crate::wire::OpKind::Put, self.transport.body_capacity());
                for mut op in put_fragments(h, c.remote_region, c.remote_off, inline, true, max) {
                    if let (OpRef::Put { notify, .. }, true) = (&mut op, wants(NOTIFY_COMPLETER)) {
                        *notify = Cmd::ImmediatePut as u8;
                    }
                    self.push_owned(host, &op, None);
                }
                if wants(NOTIFY_REQUESTER) {
                    self.rma_notify(job, rank, requester, None);
                }
            }
        }
        Flow::Done
    }

    /// An RMA operation between two processes of this host, done at once.
    fn rma_local(
        &mut self,
        session: u64,
        c: &Command,
        inline: &[u8],
        h: OpHeader,
        op: RmaOp,
        requester: Notification,
    ) -> Flow {
        let sub = Command {
            kind: match op.cmd {
                Cmd::Get => CommandKind::Get,
                Cmd::Put => CommandKind::PutFrom,
                Cmd::ImmediatePut => CommandKind::PutInline,
            },
            ..*c
        };
        self.stats.local_ops += 1;
        let (status, _) = self.local(h, &sub, inline);
        let wants = |f: u8| op.notify & f != 0;
        if wants(NOTIFY_REQUESTER) {
            self.rma_notify(op.job, op.rank, requester, None);
        }
        if status.is_ok() {
            let target_nla = nla(c.remote_region, c.remote_off);
            let at_target = |class| Notification {
                class,
                cmd: op.cmd,
                error: 0,
                len: op.len,
                peer: op.rank,
                nla: target_nla,
            };
            if op.cmd == Cmd::Get && wants(NOTIFY_RESPONDER) {
                self.rma_notify(op.job, op.peer, at_target(Class::Responder), None);
            }
            if op.cmd != Cmd::Get && wants(NOTIFY_COMPLETER) {
                self.rma_notify(op.job, op.peer, at_target(Class::Completer), None);
            }
        }
        self.rma_ops.insert((session, c.client_req), op);
        self.complete(session, c.client_req, status, 0);
        Flow::Done
    }

    /// The responder notification of an RMA get served here.
    pub(super) fn rma_responder(
        &self,
        g: &OpHeader,
        region: u32,
        offset: u64,
        len: u64,
    ) -> (u32, u32, Notification) {
        (
            g.job,
            g.dst_rank,
            Notification {
                class: Class::Responder,
                cmd: Cmd::Get,
                error: 0,
                len: len as u32,
                peer: g.src_rank,
                nla: nla(region, offset),
            },
        )
    }

    /// The last fragment of an RMA put is in place here: its completer notification, then the
    /// acknowledgement `ack` to `peer`.
    pub(super) fn rma_completer(&mut self, op: &OpRef<'_>, peer: u16, ack: Reply) {
        let OpRef::Put {
            h,
            region,
            total_off,
            total_len,
            notify,
            ..
        } = *op
        else {
            return;
        };
        let note = Notification {
            class: Class::Completer,
            cmd: if notify == Cmd::ImmediatePut as u8 {
                Cmd::ImmediatePut
            } else {
                Cmd::Put
            },
            error: 0,
            len: total_len as u32,
            peer: h.src_rank,
            nla: nla(region, total_off),
        };
        self.rma_notify(h.job, h.dst_rank, note, Some((peer, ack)));
    }

    /// Writes `note` into (job, rank)'s queue, or queues it behind the waiting ones; then
    /// sends `ack`. A process without an RMA port gets no notification (the ack goes).
    pub(super) fn rma_notify(
        &mut self,
        job: u32,
        rank: u32,
        note: Notification,
        ack: Option<(u16, Reply)>,
    ) {
        self.stats.rma_notifications += 1;
        let Some(port) = self.rma.get_mut(&(job, rank)) else {
            if let Some((peer, r)) = ack {
                let now = self.now;
                self.send_reply(now, peer, r);
            }
            return;
        };
        if port.waiting.is_empty() && port.queue.write(&note) {
            self.wake_process(job, rank);
            if let Some((peer, r)) = ack {
                let now = self.now;
                self.send_reply(now, peer, r);
            }
            return;
        }
        if port.waiting.len() >= WAITING_MAX {
            self.stats.malformed_ops += 1;
            if let Some((peer, Reply::PutAck { h, lazy, .. })) = ack {
                let now = self.now;
                let r = Reply::PutAck {
                    h,
                    status: Status::BadRequest,
                    lazy,
                };
                self.send_reply(now, peer, r);
            }
            return;
        }
        port.waiting.push_back((note, ack));
    }

    /// Writes waiting notifications into queues that have room again; whether any moved.
    pub(super) fn rma_flush(&mut self) -> bool {
        if !self.rma.values().any(RmaPort::has_waiting) {
            return false;
        }
        let mut acks = Vec::new();
        let mut woken = Vec::new();
        for (&(job, rank), port) in self.rma.iter_mut().filter(|(_, p)| p.has_waiting()) {
            let mut wrote = false;
            while let Some((note, _)) = port.waiting.front() {
                if !port.queue.write(note) {
                    break;
                }
                wrote = true;
                acks.extend(port.waiting.pop_front().and_then(|(_, a)| a));
            }
            if wrote {
                woken.push((job, rank));
            }
        }
        let moved = !woken.is_empty();
        for (job, rank) in woken {
            self.wake_process(job, rank);
        }
        let now = self.now;
        for (peer, r) in acks {
            self.send_reply(now, peer, r);
        }
        moved
    }

    /// An RMA operation of this host's process completed (or failed): the origin's
    /// notifications — a get's completer; for any failure, a completer carrying the error.
    pub(super) fn rma_completed(&mut self, c: &Completion) {
        let Some(op) = self.rma_ops.remove(&(c.session, c.client_req)) else {
            return;
        };
        let failed = !c.status.is_ok();
        if failed || (op.cmd == Cmd::Get && op.notify & NOTIFY_COMPLETER != 0) {
            let note = Notification {
                class: Class::Completer,
                cmd: op.cmd,
                error: if failed { (c.status as u8).max(1) } else { 0 },
                len: op.len,
                peer: op.peer,
                nla: op.local_nla,
            };
            self.rma_notify(op.job, op.rank, note, None);
        }
    }

    /// A process leaves: its queue goes; acknowledgements held for it are sent.
    pub(super) fn rma_close(&mut self, job: u32, rank: u32) {
        if let Some(port) = self.rma.remove(&(job, rank)) {
            let now = self.now;
            for (_, ack) in port.waiting {
                if let Some((peer, r)) = ack {
                    self.send_reply(now, peer, r);
                }
            }
        }
        self.rma_ops
            .retain(|_, op| (op.job, op.rank) != (job, rank));
    }
}
