//! The portals conduit: Active Messages through the soft NIC's Portals engine, after the
//! GASNet-over-Portals design. Matching, data placement and events happen in the NIC; the
//! process only handles the events.
//!
//! - ReqRB: two locally managed receive buffers on the AM portal (`MANAGE_LOCAL`, `min_free`
//!   = one maximal AM) with their own event queue (AM_EQ). Messages pack into them; a full one
//!   unlinks itself (PTL_EVENT_AUTO_UNLINK) and is re-posted once its events are handled, so
//!   one is always linked (double buffering).
//! - ReqSB: a ring of send slots in one MD reporting to SAFE_EQ. Each AM is a put with ACK from
//!   a slot; the ACK frees the slot, so a slot is a send token (no more AMs in flight than slots).
//! - Flow control: an AM the target could not take (no receive buffer linked: DROPPED) is sent
//!   again from its slot, which still holds it.

use std::collections::VecDeque;

use super::Conduit;
use crate::gasnet::GasnetError;
use crate::nic::memory::Perms;
use crate::portals::{
    AckReq, Buffer, EventKind, List, Md, Me, NiFail, NiHandle, Portals, ProcessId, Target,
};

const AM_PT: u32 = 10;
const MAX_AM: usize = 16 * 1024;
const RB_LEN: usize = 2 << 20;
const RBS: usize = 2;
const SLOTS: usize = 256;
const BITS_AM: u64 = 0xa11;

pub struct PortalsConduit {
    p: Portals,
    ni: NiHandle,
    am_eq: u32,
    safe_eq: u32,
    rb: crate::gni::MemRegion,
    sb: crate::gni::MemRegion,
    md: u32,
    free_slots: Vec<usize>,
    /// (dest, length) of each slot in flight.
    in_flight: Vec<Option<(u32, usize)>>,
    me: u32,
    n: u32,
    retries: u64,
    /// Slots whose AM must go again.
    pending: VecDeque<usize>,
}

fn err<E: std::fmt::Display>(e: E) -> GasnetError {
    GasnetError::Setup(format!("portals conduit: {e}"))
}

impl PortalsConduit {
    pub fn new() -> Result<PortalsConduit, GasnetError> {
        let mut p = Portals::init().map_err(err)?;
        let (ni, _) = p.ni_init(true, true).map_err(err)?;
        let am_eq = p.eq_alloc(ni, 16_384).map_err(err)?;
        let safe_eq = p.eq_alloc(ni, SLOTS * 2 + 16).map_err(err)?;
        p.pt_alloc(ni, 0, Some(am_eq), Some(AM_PT)).map_err(err)?;
        let rb = p
            .nic()
            .mem_register(RB_LEN * RBS, Perms::WRITE)
            .map_err(err)?;
        let sb = p
            .nic()
            .mem_register(MAX_AM * SLOTS, Perms(0))
            .map_err(err)?;
        let md = p
            .md_bind(
                ni,
                &Md {
                    region: sb.clone(),
                    segments: vec![(0, (MAX_AM * SLOTS) as u64)],
                    options: crate::portals::md_opt::EVENT_SEND_DISABLE,
                    eq: Some(safe_eq),
                    ct: None,
                },
            )
            .map_err(err)?;
        let me = p.nic().rank();
        let n = p.nic().size();
        let mut c = PortalsConduit {
            p,
            ni,
            am_eq,
            safe_eq,
            rb,
            sb,
            md,
            free_slots: (0..SLOTS).rev().collect(),
            in_flight: vec![None; SLOTS],
            me,
            n,
            retries: 0,
            pending: VecDeque::new(),
        };
        for i in 0..RBS {
            c.post_rb(i)?;
        }
        // Everyone's receive buffers are posted before anyone sends.
        c.p.nic().barrier().map_err(err)?;
        Ok(c)
    }

    fn post_rb(&mut self, i: usize) -> Result<(), GasnetError> {
        let mut e = Me::new(
            Buffer {
                region: self.rb.clone(),
                offset: (i * RB_LEN) as u64,
                len: RB_LEN as u64,
            },
            0,
        );
        e.ignore_bits = u64::MAX;
        e.options = crate::portals::me_opt::OP_PUT
            | crate::portals::me_opt::MANAGE_LOCAL
            | crate::portals::me_opt::EVENT_LINK_DISABLE;
        e.min_free = MAX_AM as u64;
        self.p
            .me_append(self.ni, AM_PT, &e, List::Priority, i as u64)
            .map_err(err)?;
        Ok(())
    }

    fn put_slot(&mut self, slot: usize) -> Result<(), GasnetError> {
        let (dest, len) = self.in_flight[slot].expect("slot in flight");
        let t = Target {
            id: ProcessId::Logical { rank: dest },
            pt_index: AM_PT,
            match_bits: BITS_AM,
            remote_offset: 0,
        };
        self.p
            .put(
                self.ni,
                self.md,
                (slot * MAX_AM) as u64,
                len as u64,
                AckReq::Ack,
                t,
                slot as u64,
                0,
            )
            .map_err(err)
    }

    /// Handles the send side's events: ACKs free slots; refused AMs go again.
    fn poll_safe(&mut self) -> Result<bool, GasnetError> {
        let mut any = false;
        while let Ok((e, _)) = self.p.eq_get(self.ni, self.safe_eq) {
            any = true;
            if e.kind != EventKind::Ack {
                continue;
            }
            let slot = e.user_ptr as usize;
            if slot >= SLOTS || self.in_flight[slot].is_none() {
                continue;
            }
            if e.ni_fail == NiFail::Ok {
                self.in_flight[slot] = None;
                self.free_slots.push(slot);
            } else {
                // The target had no room: send it again (after the target polls, it re-posts).
                self.retries += 1;
                self.pending.push_back(slot);
            }
        }
        while let Some(slot) = self.pending.pop_front() {
            self.put_slot(slot)?;
        }
        Ok(any)
    }

    /// AMs resent because their target had no receive buffer posted at the time.
    pub fn retries(&self) -> u64 {
        self.retries
    }
}

impl Conduit for PortalsConduit {
    fn node(&self) -> u32 {
        self.me
    }

    fn nodes(&self) -> u32 {
        self.n
    }

    fn max_am(&self) -> usize {
        MAX_AM
    }

    fn name(&self) -> &'static str {
        "portals"
    }

    fn send(&mut self, dest: u32, am: &[u8]) -> Result<(), GasnetError> {
        if dest >= self.n {
            return Err(GasnetError::BadNode(dest));
        }
        if am.len() > MAX_AM {
            return Err(GasnetError::TooLarge(am.len()));
        }
        // A free slot is a send token: wait for ACKs (handling the send side only, so that no
        // handler runs inside a send).
        let slot = loop {
            if let Some(s) = self.free_slots.pop() {
                break s;
            }
            if !self.poll_safe()? {
                std::thread::yield_now();
            }
        };
        self.sb.bytes()[slot * MAX_AM..slot * MAX_AM + am.len()].copy_from_slice(am);
        self.in_flight[slot] = Some((dest, am.len()));
        self.put_slot(slot)
    }

    fn poll(&mut self, deliver: &mut dyn FnMut(u32, &[u8])) -> Result<bool, GasnetError> {
        let mut any = self.poll_safe()?;
        self.p.nic().progress();
        let mut repost = Vec::new();
        while let Ok((e, _)) = self.p.eq_get(self.ni, self.am_eq) {
            any = true;
            match e.kind {
                EventKind::Put if e.ni_fail == NiFail::Ok => {
                    let ProcessId::Logical { rank } = e.initiator else {
                        continue;
                    };
                    let at = e.start as usize;
                    if at + e.mlength as usize <= self.rb.len() {
                        let data = self.rb.bytes()[at..at + e.mlength as usize].to_vec();
                        deliver(rank, &data);
                    }
                }
                EventKind::AutoUnlink => repost.push(e.user_ptr as usize),
                _ => {}
            }
        }
        for i in repost {
            self.post_rb(i)?;
        }
        Ok(any)
    }
}
