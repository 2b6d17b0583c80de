//! Flow control by recovery (seed 003 §3.1.3, after Barrett et al.): when unexpected messages
//! exhaust a receiver's overflow buffers or headers, its NIC disables the `recv` portal and
//! refuses what arrives (ACK with PTL_NI_PT_DISABLED). Then:
//! 1. the receiver tells every rank (STOP: one counter increment fires the triggered puts armed
//!    for this epoch, one per rank, so the NIC fans the notice out) and drains: its receives
//!    consume unexpected messages, freed overflow buffers go back, one more is linked if none
//!    is;
//! 2. each rank queues its sends to that receiver, in order, and once none is in flight to it
//!    any more answers READY (refused messages rejoin the queue in their original order);
//! 3. with every READY in, no message to the receiver is in flight anywhere: it re-enables the
//!    portal and says RESUME; the senders send their queues again, in order.
//!
//! Non-overtaking order survives: nothing to the receiver overtakes a refused message.

use std::collections::VecDeque;

use rustc_hash::FxHashMap as HashMap;

use crate::portals::{
    me_opt, AckReq, Buffer, CtEvent, Event, List, Me, ProcessId, Target, RANK_ANY,
};

use super::error::MpiError;
use super::stage::Staging;
use super::state::{State, OVF_MAX, RECV_PT};

pub const FC_PT: u32 = 23;
pub const T_FC: u64 = 9 << 60;

const STOP: u64 = 1;
const READY: u64 = 2;
const RESUME: u64 = 3;

/// One point-to-point put, kept until its ACK so a refused one can go again.
#[derive(Debug, Clone, Copy)]
pub struct Msg {
    pub req: u32,
    pub dest: u32,
    pub md: u32,
    pub offset: u64,
    pub len: u64,
    pub bits: u64,
    pub hdr: u64,
    /// A long body still to be copied into the send ring (`md`/`offset` not set yet).
    pub unstaged: bool,
}

#[derive(Default)]
struct Peer {
    /// Sends wait here while the peer recovers (or behind ones that do).
    queue: VecDeque<(u64, Msg)>,
    stalled: bool,
    inflight: u32,
    /// The peer asked STOP (epoch): READY is owed once nothing is in flight to it.
    ready_owed: Option<u64>,
    next_seq: u64,
}

#[derive(Default)]
pub struct Flow {
    pub eq: u32,
    /// Static credits, when that scheme is on (`credit`).
    pub credit: Option<super::credit::Credits>,
    /// Messages waiting in any peer's queue.
    queued: usize,
    peers: HashMap<u32, Peer>,
    /// Puts awaiting their ACK: request → (sequence, message).
    inflight: HashMap<u32, (u64, Msg)>,
    /// The counter whose increments fire the STOP notices armed for the next epoch.
    stop_ct: u32,
    /// This rank's own recovery: its epoch and the READYs collected.
    recovering: bool,
    epoch: u64,
    readies: u32,
}

impl Flow {
    pub fn busy(&self) -> bool {
        self.recovering || self.queued > 0
    }
}

/// The flow-control portal: one persistent entry taking empty notices from anyone.
pub fn open(st: &mut State) -> Result<(), MpiError> {
    let eq = st.p.eq_alloc(st.ni, 4 * st.size as usize + 64)?;
    st.flow.eq = eq;
    st.p.pt_alloc(st.ni, 0, Some(eq), Some(FC_PT))?;
    // An empty entry: any registered region serves (the endpoint's bounce region).
    let region = st.p.endpoint().bounce().handle;
    let mut me = Me::new(
        Buffer {
            region,
            offset: 0,
            len: 0,
        },
        0,
    );
    me.options = me_opt::OP_PUT | me_opt::ACK_DISABLE | me_opt::EVENT_LINK_DISABLE;
    me.ignore_bits = !0;
    me.match_id = ProcessId::Logical { rank: RANK_ANY };
    st.p.me_append(st.ni, FC_PT, &me, List::Priority, T_FC)?;
    st.flow.stop_ct = st.p.ct_alloc(st.ni)?;
    arm_stops(st, 1)
}

fn notice_target(to: u32) -> Target {
    Target {
        id: ProcessId::Logical { rank: to },
        pt_index: FC_PT,
        match_bits: 0,
        remote_offset: 0,
    }
}

fn notice_hdr(kind: u64, epoch: u64) -> u64 {
    kind << 56 | (epoch & ((1 << 56) - 1))
}

/// Arms the STOP notices of recovery `epoch`: one triggered put per rank (this one too),
/// fired when the stop counter reaches the epoch.
fn arm_stops(st: &mut State, epoch: u64) -> Result<(), MpiError> {
    let (md, ct) = (st.bounce_md(), st.flow.stop_ct);
    for r in 0..st.size {
        st.p.triggered_put(
            st.ni,
            md,
            0,
            0,
            AckReq::NoAck,
            notice_target(r),
            0,
            notice_hdr(STOP, epoch),
            ct,
            epoch,
        )?;
    }
    Ok(())
}

fn tell(st: &mut State, to: u32, kind: u64, epoch: u64) -> Result<(), MpiError> {
    let md = st.bounce_md();
    st.p.put(
        st.ni,
        md,
        0,
        0,
        AckReq::NoAck,
        notice_target(to),
        0,
        notice_hdr(kind, epoch),
    )?;
    Ok(())
}

/// Sends `m` now, or queues it behind its destination's recovery, the messages queued
/// before it, (static credits) until a credit for it comes back, or until the send ring has
/// room for its body (see `stage::Out`).
pub fn send(st: &mut State, mut m: Msg) -> Result<(), MpiError> {
    let credit = st
        .flow
        .credit
        .as_ref()
        .is_none_or(|c| c.available(m.dest) > 0);
    let p = st.flow.peers.entry(m.dest).or_default();
    let seq = p.next_seq;
    p.next_seq += 1;
    let held = p.stalled || !p.queue.is_empty() || !credit;
    if held {
        if !credit && !p.stalled && p.queue.is_empty() {
            st.stats.credit_waits += 1;
        }
        return enqueue(st, seq, m);
    }
    if m.unstaged {
        match st.stage_body(&mut m) {
            Staging::Ready => {}
            Staging::Dropped => return Ok(()),
            Staging::NoRoom => {
                st.stats.stage_waits += 1;
                return enqueue(st, seq, m);
            }
        }
    }
    go(st, seq, m)
}

fn enqueue(st: &mut State, seq: u64, m: Msg) -> Result<(), MpiError> {
    st.flow
        .peers
        .entry(m.dest)
        .or_default()
        .queue
        .push_back((seq, m));
    st.flow.queued += 1;
    Ok(())
}

fn go(st: &mut State, seq: u64, m: Msg) -> Result<(), MpiError> {
    if let Some(c) = st.flow.credit.as_mut() {
        c.take(m.dest);
    }
    st.flow.peers.entry(m.dest).or_default().inflight += 1;
    st.flow.inflight.insert(m.req, (seq, m));
    st.put_msg(&m)
}

/// Sends what waits in the queues of peers that are not recovering, in order, as far as
/// credits allow.
fn pump(st: &mut State) -> Result<(), MpiError> {
    if st.flow.queued == 0 {
        return Ok(());
    }
    let dests: Vec<u32> = st
        .flow
        .peers
        .iter()
        .filter(|(_, p)| !p.stalled && !p.queue.is_empty())
        .map(|(d, _)| *d)
        .collect();
    for d in dests {
        loop {
            if st.flow.credit.as_ref().is_some_and(|c| c.available(d) == 0) {
                break;
            }
            let Some((seq, mut m)) = st.flow.peers.get_mut(&d).and_then(|p| p.queue.pop_front())
            else {
                break;
            };
            if m.unstaged {
                match st.stage_body(&mut m) {
                    Staging::Ready => {}
                    Staging::Dropped => {
                        st.flow.queued -= 1;
                        continue;
                    }
                    Staging::NoRoom => {
                        if let Some(p) = st.flow.peers.get_mut(&d) {
                            p.queue.push_front((seq, m));
                        }
                        break;
                    }
                }
            }
            st.flow.queued -= 1;
            go(st, seq, m)?;
        }
    }
    Ok(())
}

/// A send's ACK came back (any outcome but a refusal). It may be the last one in flight to
/// a peer that asked STOP meanwhile: ACKs and notices arrive in different event queues, so a
/// STOP can be handled before the ACK of a message its sender's portal still accepted, and
/// the READY it is owed goes now (without it the peer's recovery never ends).
pub fn acked(st: &mut State, req: u32) -> Result<(), MpiError> {
    match st.flow.inflight.remove(&req) {
        Some((_, m)) => landed(st, m.dest),
        None => Ok(()),
    }
}

/// The target's portal was disabled: the message goes again after its recovery, in order.
pub fn refused(st: &mut State, req: u32) -> Result<(), MpiError> {
    st.stats.pt_disabled += 1;
    let Some((seq, m)) = st.flow.inflight.remove(&req) else {
        return Ok(());
    };
    if let Some(c) = st.flow.credit.as_mut() {
        c.give_back(m.dest);
    }
    let p = st.flow.peers.entry(m.dest).or_default();
    p.stalled = true;
    let at = p.queue.partition_point(|(s, _)| *s < seq);
    p.queue.insert(at, (seq, m));
    st.flow.queued += 1;
    landed(st, m.dest)
}

/// One message to `dest` is in flight no more (acknowledged or refused).
fn landed(st: &mut State, dest: u32) -> Result<(), MpiError> {
    if let Some(p) = st.flow.peers.get_mut(&dest) {
        p.inflight -= 1;
    }
    owe_ready(st, dest)
}

/// Sends the READY `dest` asked for once nothing of ours is in flight to it.
fn owe_ready(st: &mut State, dest: u32) -> Result<(), MpiError> {
    let Some(p) = st.flow.peers.get_mut(&dest) else {
        return Ok(());
    };
    if p.inflight == 0 {
        if let Some(epoch) = p.ready_owed.take() {
            return tell(st, dest, READY, epoch);
        }
    }
    Ok(())
}

/// Our own `recv` portal was disabled: start a recovery (once).
pub fn pt_disabled(st: &mut State) -> Result<(), MpiError> {
    if st.flow.recovering {
        return Ok(());
    }
    st.flow.recovering = true;
    st.flow.epoch += 1;
    st.flow.readies = 0;
    tracing::debug!(rank = st.rank, epoch = st.flow.epoch, "flow control: STOP");
    st.p.ct_inc(
        st.ni,
        st.flow.stop_ct,
        CtEvent {
            success: 1,
            failure: 0,
        },
    )?;
    arm_stops(st, st.flow.epoch + 1)
}

/// Tells every rank (this one too: its own sends to itself take part) that our recovery ended.
fn tell_all(st: &mut State, kind: u64) -> Result<(), MpiError> {
    tracing::debug!(rank = st.rank, epoch = st.flow.epoch, kind, "flow control");
    for r in 0..st.size {
        tell(st, r, kind, st.flow.epoch)?;
    }
    Ok(())
}

/// A notice on the flow-control portal.
pub fn notice(st: &mut State, e: &Event) -> Result<(), MpiError> {
    let ProcessId::Logical { rank: from } = e.initiator else {
        return Ok(());
    };
    let (kind, epoch) = (e.hdr_data >> 56, e.hdr_data & ((1 << 56) - 1));
    match kind {
        STOP => {
            let p = st.flow.peers.entry(from).or_default();
            p.stalled = true;
            p.ready_owed = Some(epoch);
            owe_ready(st, from)
        }
        READY if st.flow.recovering && epoch == st.flow.epoch => {
            st.flow.readies += 1;
            tick(st)
        }
        RESUME => {
            let p = st.flow.peers.entry(from).or_default();
            p.stalled = false;
            st.stats.resent += p.queue.len() as u64;
            pump(st)
        }
        _ => Ok(()),
    }
}

/// Sends what credits now allow; ends our recovery once every rank is READY and an overflow
/// buffer has room.
pub fn tick(st: &mut State) -> Result<(), MpiError> {
    pump(st)?;
    if !st.flow.recovering || st.flow.readies < st.size {
        return Ok(());
    }
    if !st.ovf_linked.iter().any(|l| *l) {
        if st.ovf_n >= OVF_MAX {
            // Every buffer is full of messages nobody received yet: wait for receives.
            return Ok(());
        }
        let i = st.ovf_n;
        st.ovf_n += 1;
        st.link_overflow(i)?;
    }
    st.p.pt_enable(st.ni, RECV_PT)?;
    st.flow.recovering = false;
    tell_all(st, RESUME)
}
