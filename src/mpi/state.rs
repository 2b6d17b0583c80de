//! The library's state in a rank: the Portals interface, its portals and event queues, the
//! bounce slots and registration cache for user buffers, the request table, and the progress
//! engine that turns Portals events into completed MPI requests (seed 003 §3.1).
//!
//! - `recv` portal (PTL_PT_FLOWCTRL, events on RECV_EQ): receives are USE_ONCE priority
//!   entries over the user's buffer (or a bounce slot when small); 16 locally managed 1 MiB
//!   overflow entries take any SHORT or RNDV message nobody waits for, and a truncating overflow
//!   entry keeps only the header of an unexpected LONG one. Posting a receive searches the
//!   unexpected headers in the NIC, atomically (PTL_EVENT_PUT_OVERFLOW).
//! - `read` portal (events on MD_EQ): a LONG or RNDV send exposes its buffer there under its
//!   send id until the receiver has fetched what it needed.
//! - MD_EQ: ACKs of sends, REPLYs of the receiver's gets, GETs of `read` entries.

use std::time::{Duration, Instant};

use rustc_hash::FxHashMap as HashMap;

use crate::client::{MemHandle, MemRegion};
use crate::gasnet::conduit::portals::firehose::{Firehose, Registrar, Registration};
use crate::nic::memory::Perms;
use crate::portals::{
    md_opt, me_opt, pt_opt, AckReq, Buffer, Event, EventKind, Limits, List, Md, Me, NiFail,
    NiHandle, Portals, ProcessId, PtlError, SearchOp, Target, RANK_ANY,
};

use super::bits;
use super::credit::{Credits, FlowScheme};
use super::error::{err, ErrorClass, MpiError};
use super::stage::{body_target, Stage, StagedGet, T_STAGE};

pub const RECV_PT: u32 = 20;
pub const READ_PT: u32 = 21;
pub const RMA_PT: u32 = 22;

/// Unexpected short messages: 16 overflow entries of 1 MiB (the seed's numbers), grown by one
/// at a time in flow-control recovery up to OVF_MAX (the region is reserved whole; its pages
/// are only touched as messages land).
const OVF_N: usize = 16;
pub(super) const OVF_MAX: usize = 64;
const OVF_LEN: usize = 1 << 20;
/// Bounce slots (for small sends and small, non-empty receive buffers).
const SLOTS: usize = 512;
/// Slots receives leave to sends: a send waits for a slot, and slots held by posted receives
/// come back only when those receives are matched — perhaps by the answer to that very send.
/// Receives beyond the others land in their registered buffers instead.
const SEND_RESERVE: usize = 64;
const EQ_LEN: usize = 1 << 16;
/// The "cache use" of a buffer in `alloc_mem` memory (nothing to release).
const NOT_CACHED: u64 = u64::MAX;

/// Memory from `alloc_mem`: user buffers inside it need no registration of their own.
pub(super) struct AllocRange {
    pub start: u64,
    pub end: u64,
    pub region: MemHandle,
    pub md: Option<u32>,
}

impl AllocRange {
    /// Whether `[addr, addr+len)` lies inside it.
    fn holds(&self, addr: u64, len: u64) -> bool {
        addr >= self.start && addr.saturating_add(len) <= self.end
    }
}

/// Static credits: unexpected messages each rank may have at each receiver
/// (`SOFTNIC_MPI_CREDITS`).
const CREDITS: u64 = 64;
/// Registration cache budget (`SOFTNIC_MPI_REGCACHE`, bytes).
const REGCACHE: usize = 256 << 20;

// user_ptr tags (bits 63..60), the rest an index.
const T_RECV: u64 = 1 << 60;
const T_OVF: u64 = 2 << 60;
const T_LONGOVF: u64 = 3 << 60;
const T_PROBE: u64 = 4 << 60;
const T_ACK: u64 = 5 << 60;
const T_READ: u64 = 6 << 60;
const T_GET: u64 = 7 << 60;
const T_PING: u64 = 8 << 60;
const TAG_MASK: u64 = 0xf << 60;

/// What a completed receive (or a probe) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Status {
    /// The sender's rank in the communicator.
    pub source: u32,
    pub tag: u32,
    /// Bytes received (for a probe: bytes the message holds).
    pub count: usize,
}

impl Status {
    /// MPI_Get_count: whole elements of `T`, or `None` when the bytes are not whole elements.
    pub fn get_count<T>(&self) -> Option<usize> {
        let w = std::mem::size_of::<T>().max(1);
        self.count.is_multiple_of(w).then_some(self.count / w)
    }
}

/// Where a receive's data lands in this process: a bounce slot or the user's registered buffer.
#[derive(Debug, Clone, Copy)]
enum Landing {
    Slot(u32),
    Cached { md: u32, offset: u64, id: u64 },
}

/// A request: user-visible completion (`done`) and the NIC resources it still holds.
pub(super) struct Req {
    pub(super) done: bool,
    status: Status,
    err: Option<MpiError>,
    /// The user's buffer.
    addr: u64,
    len: usize,
    landing: Option<Landing>,
    slot: Option<u32>,
    cached: Option<u64>,
    read_me: Option<u32>,
    /// A long send's body copied into the send ring at this offset (see `stage::Out`).
    staged: Option<u64>,
    /// A LONG/RNDV send: its whole length (an ACK of all of it ends it).
    total: u64,
    /// Internal events still to come (a short send's ACK after the user saw it done, a
    /// staged get's reply).
    pub(super) busy: u32,
    /// The user no longer holds it: freed once done and not busy.
    orphan: bool,
    /// A probe found a message.
    probe_found: bool,
    /// The world rank whose death would leave it waiting for ever (a receive's named
    /// source, a long send's receiver): waits ask after it.
    peer: Option<u32>,
}

impl Req {
    fn new() -> Req {
        Req {
            done: false,
            status: Status::default(),
            err: None,
            addr: 0,
            len: 0,
            landing: None,
            slot: None,
            cached: None,
            read_me: None,
            staged: None,
            total: 0,
            busy: 0,
            orphan: false,
            probe_found: false,
            peer: None,
        }
    }
}

/// How collectives run (`SOFTNIC_MPI_COLL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollMode {
    /// Trees of triggered operations in the NIC (barrier, small bcast and allreduce).
    Triggered,
    /// Point-to-point messages between the processes.
    P2p,
    /// Point-to-point on two ranks (one exchange beats a tree's two hops), offloaded beyond.
    Auto,
}

/// Which long protocol sends beyond the eager limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LongProtocol {
    Eager,
    Rendezvous,
}

/// Counters for tests and netbench.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    pub unexpected: u64,
    pub expected: u64,
    pub long_gets: u64,
    /// Long bodies fetched through the staging ring (into private memory; see `stage`).
    pub staged_gets: u64,
    /// Long sends whose bodies were copied into the send ring (from private memory).
    pub staged_sends: u64,
    /// Long sends that found the send ring full and waited for room.
    pub stage_waits: u64,
    pub pt_disabled: u64,
    pub resent: u64,
    /// Static credits: sends that waited for one; batches this rank gave back.
    pub credit_waits: u64,
    pub credit_returns: u64,
}

pub struct State {
    pub p: Portals,
    pub ni: NiHandle,
    pub limits: Limits,
    pub rank: u32,
    pub size: u32,
    eq_recv: u32,
    eq_md: u32,
    bounce: MemRegion,
    bounce_md: u32,
    slot_len: usize,
    free_slots: Vec<u32>,
    ovf: MemRegion,
    pub(super) ovf_linked: [bool; OVF_MAX],
    /// Overflow buffers in use (linked, or full and waiting for their headers' receives).
    pub(super) ovf_n: usize,
    fh: Firehose,
    reqs: Vec<Option<Req>>,
    free_reqs: Vec<u32>,
    next_send_id: u32,
    pub eager_limit: usize,
    pub long: LongProtocol,
    /// Free context ids (bit set = free); the world owns 0.
    pub ctx_free: [u64; (bits::MAX_CONTEXTS / 2 / 64) as usize],
    pub finalized: bool,
    pub stats: Stats,
    /// Flow control: senders whose messages the target's disabled portal refused, waiting to
    /// go again in order (see `flow`).
    pub(super) flow: super::flow::Flow,
    pub coll: CollMode,
    /// Offloaded collectives' state per collective context (see `triggered`).
    pub(super) trees: HashMap<u32, super::triggered::Tree>,
    /// Whether the collective portal is allocated.
    pub(super) coll_pt: bool,
    /// Ranks known dead (a ping of theirs failed), and when each rank was last pinged.
    dead: Vec<bool>,
    pinged: HashMap<u32, Instant>,
    /// Live `alloc_mem` allocations.
    pub(super) alloc: Vec<AllocRange>,
    /// The ring long receives into private memory are fetched through.
    pub(super) stage: Stage,
}

/// A request waiting this long on one peer asks whether it is alive (and again as often).
pub(super) const PING_AFTER: Duration = Duration::from_secs(1);

pub(crate) fn env_size(name: &str) -> Result<Option<usize>, MpiError> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => crate::config::parse_size(&v)
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                MpiError::new(
                    ErrorClass::Arg,
                    format!("{name}={v:?} is not a size (bytes, k/m/g suffixes)"),
                )
            }),
    }
}

/// The value of `name` among `choices` (the first when unset), or an ERR_ARG naming them.
fn env_choice<T: Copy>(name: &str, choices: &[(&str, T)]) -> Result<T, MpiError> {
    match std::env::var(name) {
        Err(_) => Ok(choices[0].1),
        Ok(v) => choices
            .iter()
            .find(|(n, _)| *n == v)
            .map(|(_, c)| *c)
            .ok_or_else(|| {
                let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
                MpiError::new(
                    ErrorClass::Arg,
                    format!("{name}={v:?}: {}", names.join(" or ")),
                )
            }),
    }
}

impl State {
    /// Opens the interface, portals, event queues and buffers (MPI_Init's Portals part).
    pub fn open(mut p: Portals) -> Result<State, MpiError> {
        let (rank, size) = (p.endpoint().rank(), p.endpoint().size());
        if size > bits::MAX_RANKS {
            return err(
                ErrorClass::Other,
                format!("{size} ranks: match bits hold at most {}", bits::MAX_RANKS),
            );
        }
        let eager_limit = env_size("SOFTNIC_MPI_EAGER_LIMIT")?.unwrap_or(super::EAGER_LIMIT);
        if eager_limit > OVF_LEN / 4 {
            return err(
                ErrorClass::Arg,
                format!(
                    "SOFTNIC_MPI_EAGER_LIMIT={eager_limit}: at most {} (a quarter of an overflow buffer)",
                    OVF_LEN / 4
                ),
            );
        }
        use LongProtocol::{Eager, Rendezvous};
        // Rendezvous by default: with long bodies staged for private buffers it is the faster
        // of the two from 128 KiB to 1 MiB (docs/performance.md, 2026-11-26).
        let long = env_choice(
            "SOFTNIC_MPI_LONG",
            &[("rendezvous", Rendezvous), ("eager", Eager)],
        )?;
        let coll = env_choice(
            "SOFTNIC_MPI_COLL",
            &[
                ("auto", CollMode::Auto),
                ("triggered", CollMode::Triggered),
                ("p2p", CollMode::P2p),
            ],
        )?;
        let scheme = env_choice(
            "SOFTNIC_MPI_FLOW",
            &[
                ("recovery", FlowScheme::Recovery),
                ("credit", FlowScheme::Credit),
            ],
        )?;
        let asked = env_size("SOFTNIC_MPI_CREDITS")?.map(|c| c as u64);
        if asked == Some(0) {
            return err(ErrorClass::Arg, "SOFTNIC_MPI_CREDITS=0: at least 1");
        }
        let slot = eager_limit.max(64).next_multiple_of(64);
        // Credits: room for every rank's allowance of unexpected messages of the eager limit
        // (a locally managed buffer retires once less than that is left), up to the reserve;
        // the default allowance shrinks to fit it (never below 2), an asked one is refused.
        let per_buf = ((OVF_LEN - eager_limit) / slot).max(1) as u64;
        let fits = ((OVF_MAX as u64 - 1) * per_buf / size as u64).max(2);
        let per_peer = asked.unwrap_or(CREDITS.min(fits));
        let ovf_initial = match scheme {
            FlowScheme::Recovery => OVF_N,
            FlowScheme::Credit => {
                let need = (per_peer * size as u64).div_ceil(per_buf) as usize + 1;
                if need > OVF_MAX {
                    return err(
                        ErrorClass::Arg,
                        format!(
                            "SOFTNIC_MPI_CREDITS={per_peer} for {size} ranks needs {need} MiB of unexpected-message buffers, more than the {OVF_MAX} MiB reserved: fewer credits or a smaller SOFTNIC_MPI_EAGER_LIMIT"
                        ),
                    );
                }
                need.max(OVF_N)
            }
        };
        let regcache = env_size("SOFTNIC_MPI_REGCACHE")?.unwrap_or(REGCACHE);
        let (ni, limits) = p.ni_init(true, true)?;
        let eq_recv = p.eq_alloc(ni, EQ_LEN)?;
        let eq_md = p.eq_alloc(ni, EQ_LEN)?;
        p.pt_alloc(ni, pt_opt::FLOWCTRL, Some(eq_recv), Some(RECV_PT))?;
        p.pt_alloc(ni, 0, Some(eq_md), Some(READ_PT))?;
        p.pt_alloc(ni, 0, None, Some(RMA_PT))?;
        let slot_len = eager_limit.max(64).next_multiple_of(64);
        let bounce = p.endpoint().mem_register(slot_len * SLOTS, Perms(0))?;
        let bounce_md = p.md_bind(
            ni,
            &Md {
                region: bounce.handle,
                segments: vec![(0, bounce.len() as u64)],
                options: md_opt::EVENT_SEND_DISABLE,
                eq: Some(eq_md),
                ct: None,
            },
        )?;
        let ovf = p
            .endpoint()
            .mem_register(OVF_MAX * OVF_LEN, Perms::READ_WRITE)?;
        let stage = Stage::open(&mut p, ni, eq_md)?;
        let mut st = State {
            p,
            ni,
            limits,
            rank,
            size,
            eq_recv,
            eq_md,
            bounce,
            bounce_md,
            slot_len,
            free_slots: (0..SLOTS as u32).rev().collect(),
            ovf,
            ovf_linked: [false; OVF_MAX],
            ovf_n: ovf_initial,
            fh: Firehose::new(regcache as u64, 64),
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            next_send_id: 1,
            eager_limit,
            long,
            ctx_free: [!0; (bits::MAX_CONTEXTS / 2 / 64) as usize],
            finalized: false,
            stats: Stats::default(),
            flow: super::flow::Flow::default(),
            coll,
            trees: HashMap::default(),
            coll_pt: false,
            dead: vec![false; size as usize],
            pinged: HashMap::default(),
            alloc: Vec::new(),
            stage,
        };
        st.ctx_free[0] &= !1;
        for i in 0..ovf_initial {
            st.link_overflow(i)?;
        }
        // Unexpected LONG messages: only the header is kept (the entry truncates to nothing).
        let mut long = Me::new(
            Buffer {
                region: st.ovf.handle,
                offset: 0,
                len: 0,
            },
            bits::LONG << bits::PROTO_SHIFT,
        );
        long.options = me_opt::OP_PUT | me_opt::EVENT_LINK_DISABLE;
        long.ignore_bits = !bits::PROTO_MASK;
        st.p.me_append(st.ni, RECV_PT, &long, List::Overflow, T_LONGOVF)?;
        super::flow::open(&mut st)?;
        if scheme == FlowScheme::Credit {
            st.flow.credit = Some(Credits::open(&mut st, per_peer)?);
        }
        Ok(st)
    }

    pub(super) fn link_overflow(&mut self, i: usize) -> Result<(), MpiError> {
        let mut e = Me::new(
            Buffer {
                region: self.ovf.handle,
                offset: (i * OVF_LEN) as u64,
                len: OVF_LEN as u64,
            },
            bits::SHORT << bits::PROTO_SHIFT,
        );
        e.options =
            me_opt::OP_PUT | me_opt::MANAGE_LOCAL | me_opt::MAY_ALIGN | me_opt::EVENT_LINK_DISABLE;
        // SHORT and RNDV (bit 61 ignored), any context, source and tag.
        e.ignore_bits = !bits::PROTO_MASK | (0b0010 << bits::PROTO_SHIFT);
        e.min_free = self.eager_limit as u64;
        self.p
            .me_append(self.ni, RECV_PT, &e, List::Overflow, T_OVF | i as u64)?;
        self.ovf_linked[i] = true;
        Ok(())
    }

    // ------------------------------------------------------------ requests

    /// A request on the user's `[addr, addr+len)`, unless MPI was finalized.
    fn req_on(&self, addr: u64, len: usize) -> Result<Req, MpiError> {
        if self.finalized {
            return err(ErrorClass::Other, "MPI is finalized");
        }
        let mut r = Req::new();
        r.addr = addr;
        r.len = len;
        Ok(r)
    }

    fn new_req(&mut self, r: Req) -> u32 {
        match self.free_reqs.pop() {
            Some(i) => {
                self.reqs[i as usize] = Some(r);
                i
            }
            None => {
                self.reqs.push(Some(r));
                (self.reqs.len() - 1) as u32
            }
        }
    }

    pub(super) fn req(&mut self, i: u32) -> Option<&mut Req> {
        self.reqs.get_mut(i as usize).and_then(|r| r.as_mut())
    }

    pub(super) fn req_ref(&self, i: u32) -> Option<&Req> {
        self.reqs.get(i as usize).and_then(|r| r.as_ref())
    }

    /// One internal event of request `i` came (or will not): freed if nothing else holds it.
    pub(super) fn unbusy(&mut self, i: u32) {
        if let Some(r) = self.req(i) {
            r.busy = r.busy.saturating_sub(1);
        }
        self.maybe_free(i);
    }

    pub fn is_done(&self, i: u32) -> bool {
        self.reqs
            .get(i as usize)
            .and_then(|r| r.as_ref())
            .is_none_or(|r| r.done)
    }

    /// Takes a finished request's outcome; the entry is freed once nothing refers to it.
    pub fn take(&mut self, i: u32) -> Result<Status, MpiError> {
        let Some(r) = self.req(i) else {
            return err(ErrorClass::Intern, "request already completed");
        };
        debug_assert!(r.done);
        let out = match r.err.take() {
            Some(e) => Err(e),
            None => Ok(r.status),
        };
        r.orphan = true;
        self.maybe_free(i);
        out
    }

    pub(super) fn maybe_free(&mut self, i: u32) {
        let free = self
            .reqs
            .get(i as usize)
            .and_then(|r| r.as_ref())
            .is_some_and(|r| r.orphan && r.done && r.busy == 0);
        if free {
            let r = self.reqs[i as usize].take().expect("checked");
            if let Some(s) = r.slot {
                self.free_slots.push(s);
            }
            if let Some(Landing::Slot(s)) = r.landing {
                self.free_slots.push(s);
            }
            // A send that failed before its receiver fetched it: the buffer is the user's
            // again, nobody may read it any more.
            if let Some(h) = r.read_me {
                let _ = self.p.me_unlink(self.ni, h);
            }
            if let Some(c) = r.cached.filter(|&c| c != NOT_CACHED) {
                self.fh.release(c);
            }
            if let Some(Landing::Cached { id, .. }) = r.landing {
                if id != NOT_CACHED {
                    self.fh.release(id);
                }
            }
            self.free_reqs.push(i);
        }
    }

    pub(super) fn finish(&mut self, i: u32, e: Option<MpiError>) {
        if let Some(r) = self.req(i) {
            if !r.done {
                r.done = true;
                if r.err.is_none() {
                    r.err = e;
                }
            }
            // A long send is done once its receiver has fetched the body (or it failed):
            // the NIC reads its staged copy no more.
            if let Some(at) = r.staged.take() {
                self.stage.out.free(at);
            }
        }
        self.maybe_free(i);
    }

    /// Whether the library still has operations in the NIC (finalize drains them).
    pub fn outstanding(&self) -> bool {
        self.reqs.iter().flatten().any(|r| !r.done || r.busy > 0) || self.flow.busy()
    }

    // ------------------------------------------------------------ memory

    /// A bounce slot, waiting for one to come back if all are in use.
    fn slot(&mut self) -> Result<u32, MpiError> {
        loop {
            if let Some(s) = self.free_slots.pop() {
                return Ok(s);
            }
            self.wait_event(Duration::from_millis(10))?;
        }
    }

    fn slot_ptr(&self, s: u32) -> *mut u8 {
        // SAFETY: s < SLOTS, the region holds SLOTS slots.
        unsafe { self.bounce.as_ptr().add(s as usize * self.slot_len) }
    }

    fn slot_off(&self, s: u32) -> u64 {
        s as u64 * self.slot_len as u64
    }

    /// `[addr, addr+len)` inside memory from `alloc_mem` (mapped by the NIC: no copy through
    /// the kernel): its registration (an MD bound at first use) and offset.
    fn in_alloc_mem(
        &mut self,
        addr: u64,
        len: u64,
    ) -> Result<Option<(Registration, u64, u64)>, MpiError> {
        let Some(a) = self.alloc.iter_mut().find(|a| a.holds(addr, len)) else {
            return Ok(None);
        };
        let md = match a.md {
            Some(md) => md,
            None => {
                let md = self.p.md_bind(
                    self.ni,
                    &Md {
                        region: a.region,
                        segments: vec![(0, a.end - a.start)],
                        options: md_opt::EVENT_SEND_DISABLE,
                        eq: Some(self.eq_md),
                        ct: None,
                    },
                )?;
                a.md = Some(md);
                md
            }
        };
        let reg = Registration {
            region: a.region.0,
            md,
        };
        Ok(Some((reg, addr - a.start, NOT_CACHED)))
    }

    /// A registration covering the user's `[addr, addr+len)` (process memory the NIC reaches by
    /// copy): (registration, offset of addr in it, cache use id).
    pub(crate) fn cached(
        &mut self,
        addr: u64,
        len: u64,
    ) -> Result<(Registration, u64, u64), MpiError> {
        if len == 0 {
            // No byte moves: any memory of ours will do. An empty buffer's address may be
            // dangling (an empty Vec's), and the daemon would refuse to reach it.
            let reg = Registration {
                region: self.bounce.handle.0,
                md: self.bounce_md,
            };
            return Ok((reg, 0, NOT_CACHED));
        }
        if let Some(hit) = self.in_alloc_mem(addr, len)? {
            return Ok(hit);
        }
        if let Some(u) = self.fh.lookup(addr, len) {
            return Ok((u.reg, u.offset, u.id));
        }
        let miss = self
            .fh
            .plan(addr, len)
            .ok_or_else(|| MpiError::new(ErrorClass::Buffer, "buffer wraps the address space"))?;
        let registrar = Registrar {
            perms: Perms::READ_WRITE,
            md_options: md_opt::EVENT_SEND_DISABLE,
            eq: Some(self.eq_md),
        };
        let u = registrar
            .register_miss(&mut self.fh, &mut self.p, self.ni, miss, (addr, len))
            .map_err(|e| MpiError::new(ErrorClass::Buffer, format!("registering a buffer: {e}")))?;
        Ok((u.reg, u.offset, u.id))
    }

    // ------------------------------------------------------------ point-to-point

    /// Starts a send of `[addr, addr+len)` to world rank `dest` with these match bits' context,
    /// source and tag. Returns the request (done at once for short messages: the bytes were
    /// copied).
    pub fn isend(
        &mut self,
        addr: u64,
        len: usize,
        dest: u32,
        ctx: u32,
        src: u32,
        tag: u32,
    ) -> Result<u32, MpiError> {
        let mut r = self.req_on(addr, len)?;
        self.check_alive(dest)?;
        if len <= self.eager_limit {
            let s = self.slot()?;
            // SAFETY: the caller's buffer is valid for len bytes; the slot holds slot_len >= len.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, self.slot_ptr(s), len) };
            r.slot = Some(s);
            r.done = true;
            r.busy = 1;
            let i = self.new_req(r);
            let m = super::flow::Msg {
                req: i,
                dest,
                md: self.bounce_md,
                offset: self.slot_off(s),
                len: len as u64,
                bits: bits::encode(bits::SHORT, ctx, src, tag),
                hdr: 0,
                unstaged: false,
            };
            super::flow::send(self, m)?;
            return Ok(i);
        }
        let proto = match self.long {
            LongProtocol::Eager => bits::LONG,
            LongProtocol::Rendezvous => bits::RNDV,
        };
        // Rendezvous bodies in private memory up to the staging limit are copied into the
        // send ring as they go (see `stage::Out`); others are exposed where they are (an eager
        // long message's put carries its whole body at once: a copy first only delays it).
        let stageable = proto == bits::RNDV
            && len as u64 <= super::stage::STAGE_MAX
            && !self.alloc.iter().any(|a| a.holds(addr, len as u64));
        let direct = if stageable {
            None
        } else {
            let (reg, off, id) = self.cached(addr, len as u64)?;
            r.cached = Some(id);
            Some((reg, off))
        };
        r.total = len as u64;
        // It may wait for the receiver's get.
        r.peer = Some(dest);
        let send_id = self.next_send_id;
        self.next_send_id = (self.next_send_id + 1) & 0xff_ffff;
        let i = self.new_req(r);
        let first = if proto == bits::RNDV {
            self.eager_limit as u64
        } else {
            len as u64
        };
        let mut m = super::flow::Msg {
            req: i,
            dest,
            md: 0,
            offset: 0,
            len: first,
            bits: bits::encode(proto, ctx, src, tag),
            hdr: bits::hdr(send_id, len as u64),
            unstaged: stageable,
        };
        if let Some((reg, off)) = direct {
            self.expose_body(&mut m, MemHandle(reg.region), reg.md, off)?;
        }
        super::flow::send(self, m)?;
        Ok(i)
    }

    /// Exposes a long send's body — `region` at `offset`, the put's MD `md` — on `read` for
    /// its receiver under the send id, before the put goes.
    pub(super) fn expose_body(
        &mut self,
        m: &mut super::flow::Msg,
        region: MemHandle,
        md: u32,
        offset: u64,
    ) -> Result<(), MpiError> {
        let len = self.req_ref(m.req).map_or(0, |r| r.total);
        let mut me = Me::new(
            Buffer {
                region,
                offset,
                len,
            },
            bits::hdr_send_id(m.hdr) as u64,
        );
        me.options = me_opt::OP_GET
            | me_opt::USE_ONCE
            | me_opt::EVENT_LINK_DISABLE
            | me_opt::EVENT_UNLINK_DISABLE;
        me.match_id = ProcessId::Logical { rank: m.dest };
        let h = self
            .p
            .me_append(self.ni, READ_PT, &me, List::Priority, T_READ | m.req as u64)?;
        if let Some(r) = self.req(m.req) {
            r.read_me = Some(h);
        }
        m.md = md;
        m.offset = offset;
        m.unstaged = false;
        Ok(())
    }

    /// A long send's body in private memory, for `stage::Out`: its address and length.
    pub(super) fn send_body(&self, i: u32) -> Option<(u64, usize)> {
        self.req_ref(i).filter(|r| !r.done).map(|r| (r.addr, r.len))
    }

    /// Records that request `i`'s body sits in the send ring at `at`.
    pub(super) fn set_staged(&mut self, i: u32, at: u64) {
        if let Some(r) = self.req(i) {
            r.staged = Some(at);
        }
        self.stats.staged_sends += 1;
    }

    /// Exposes request `i`'s body where it is (the registration cache).
    pub(super) fn set_cached(&mut self, i: u32) -> Result<(MemHandle, u32, u64), MpiError> {
        let (addr, len) = self.send_body(i).unwrap_or((0, 0));
        let (reg, off, id) = self.cached(addr, len as u64)?;
        if let Some(r) = self.req(i) {
            r.cached = Some(id);
        }
        Ok((MemHandle(reg.region), reg.md, off))
    }

    /// The Portals put of one point-to-point message (first sending or a resend).
    pub(super) fn bounce_md(&self) -> u32 {
        self.bounce_md
    }

    pub(super) fn put_msg(&mut self, m: &super::flow::Msg) -> Result<(), MpiError> {
        self.p.put(
            self.ni,
            m.md,
            m.offset,
            m.len,
            AckReq::Ack,
            Target {
                id: ProcessId::Logical { rank: m.dest },
                pt_index: RECV_PT,
                match_bits: m.bits,
                remote_offset: 0,
            },
            T_ACK | m.req as u64,
            m.hdr,
        )?;
        Ok(())
    }

    /// Posts a receive into `[addr, addr+len)` on context `ctx` from `src` (comm rank;
    /// `peer` its world rank) with `tag` (`None`: any).
    pub fn irecv(
        &mut self,
        addr: u64,
        len: usize,
        ctx: u32,
        (src, peer): (Option<u32>, Option<u32>),
        tag: Option<u32>,
    ) -> Result<u32, MpiError> {
        let mut r = self.req_on(addr, len)?;
        if let Some(p) = peer {
            self.check_alive(p)?;
        }
        r.peer = peer;
        let (region, offset, landing) =
            if len > 0 && len <= self.slot_len && self.free_slots.len() > SEND_RESERVE {
                let s = self.free_slots.pop().expect("checked");
                (self.bounce.handle, self.slot_off(s), Landing::Slot(s))
            } else {
                let (reg, off, id) = self.cached(addr, len as u64)?;
                (
                    MemHandle(reg.region),
                    off,
                    Landing::Cached {
                        md: reg.md,
                        offset: off,
                        id,
                    },
                )
            };
        r.landing = Some(landing);
        let i = self.new_req(r);
        let (match_bits, ignore_bits) = bits::receive(ctx, src, tag);
        let mut me = Me::new(
            Buffer {
                region,
                offset,
                len: len as u64,
            },
            match_bits,
        );
        me.ignore_bits = ignore_bits;
        me.options = me_opt::OP_PUT
            | me_opt::USE_ONCE
            | me_opt::EVENT_LINK_DISABLE
            | me_opt::EVENT_UNLINK_DISABLE;
        // One-way: a refusal comes back as a failed link event (see `handle`).
        if let Err(e) =
            self.p
                .me_append_oneway(self.ni, RECV_PT, &me, List::Priority, T_RECV | i as u64)
        {
            // Nothing was posted: the request and its landing area go at once.
            self.finish(i, None);
            self.req(i).expect("kept").orphan = true;
            self.maybe_free(i);
            return Err(MpiError::new(
                ErrorClass::Other,
                format!("posting a receive: {e}"),
            ));
        }
        Ok(i)
    }

    /// MPI_Iprobe's search of the unexpected headers: Some(status) if a message matches.
    pub fn iprobe(
        &mut self,
        ctx: u32,
        src: Option<u32>,
        tag: Option<u32>,
    ) -> Result<Option<Status>, MpiError> {
        self.progress()?;
        let i = self.new_req(Req::new());
        let (match_bits, ignore_bits) = bits::receive(ctx, src, tag);
        let mut me = Me::new(
            Buffer {
                region: self.ovf.handle,
                offset: 0,
                len: 0,
            },
            match_bits,
        );
        me.ignore_bits = ignore_bits;
        me.match_id = ProcessId::Logical { rank: RANK_ANY };
        self.p.me_search(
            self.ni,
            RECV_PT,
            &me,
            SearchOp::SearchOnly,
            T_PROBE | i as u64,
        )?;
        while !self.is_done(i) {
            self.wait_event_for(Some(i), Duration::from_millis(10))?;
        }
        let found = self.req(i).expect("kept").probe_found;
        let st = self.take(i)?;
        Ok(found.then_some(st))
    }

    // ------------------------------------------------------------ progress

    /// Handles every event waiting; returns whether there was any.
    pub fn progress(&mut self) -> Result<bool, MpiError> {
        let mut any = false;
        for eq in self.eqs() {
            loop {
                match self.p.eq_get(self.ni, eq) {
                    Ok((e, _)) => {
                        any = true;
                        self.handle(e)?;
                    }
                    Err(PtlError::EqEmpty) => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        if self.stage.has_waiting() {
            self.issue_staged()?;
        }
        super::flow::tick(self)?;
        Ok(any)
    }

    /// The event queues progress watches.
    pub(super) fn eqs(&self) -> [u32; 4] {
        let credit = self.flow.credit.as_ref().map_or(self.flow.eq, |c| c.eq);
        // Without credits the last is the flow-control queue again (looking twice is free).
        [self.eq_recv, self.eq_md, self.flow.eq, credit]
    }

    /// Waits (adaptively) for the next event or `max`, and handles what came.
    pub fn wait_event(&mut self, max: Duration) -> Result<(), MpiError> {
        self.wait_event_for(None, max)
    }

    /// [`State::wait_event`]; with `waited`, returns as soon as an event completes that
    /// request: what else came (a ping-pong's ACK rides with its answer) is handled at the
    /// next call, after the caller's next message has left.
    fn wait_event_for(&mut self, waited: Option<u32>, max: Duration) -> Result<(), MpiError> {
        if self.progress()? {
            return Ok(());
        }
        let eqs = self.eqs();
        // Queued sends may be waiting for the send ring's patience to run out.
        let max = if self.flow.busy() {
            max.min(super::stage::PATIENCE)
        } else {
            max
        };
        match self.p.eq_poll(self.ni, &eqs, Some(max)) {
            Ok((e, _, _)) => self.handle(e)?,
            Err(crate::portals::PortalsError::Ptl(PtlError::EqEmpty)) => {}
            Err(e) => return Err(e.into()),
        }
        if waited.is_some_and(|i| self.is_done(i)) {
            return Ok(());
        }
        self.progress()?;
        Ok(())
    }

    /// Waits for request `i` to complete. One waiting long on a single peer asks after it
    /// now and then, so that a dead peer fails it (MPI_ERR_PROC_FAILED) instead of a hang.
    pub fn wait(&mut self, i: u32) -> Result<Status, MpiError> {
        let start = Instant::now();
        while !self.is_done(i) {
            self.wait_event_for(Some(i), Duration::from_millis(10))?;
            if start.elapsed() >= PING_AFTER {
                if let Some(p) = self.reqs.get(i as usize).and_then(|r| r.as_ref()?.peer) {
                    self.ping(p)?;
                }
            }
        }
        self.take(i)
    }

    /// For a wait that began at `since` and depends on `ranks`: once it has lasted
    /// PING_AFTER, asks after each of them, and fails if one is known dead.
    pub(super) fn ask_after(&mut self, ranks: &[u32], since: Instant) -> Result<(), MpiError> {
        if ranks.is_empty() || since.elapsed() < PING_AFTER {
            return Ok(());
        }
        for &r in ranks {
            self.check_alive(r)?;
            if r != self.rank {
                self.ping(r)?;
            }
        }
        Ok(())
    }

    fn check_alive(&self, rank: u32) -> Result<(), MpiError> {
        if self.dead.get(rank as usize).copied().unwrap_or(false) {
            return err(ErrorClass::ProcFailed, format!("world rank {rank} is dead"));
        }
        Ok(())
    }

    /// Asks whether `rank` is alive (at most once per PING_AFTER): an empty put to its
    /// flow-control entry, which acknowledges nothing unless the put failed.
    fn ping(&mut self, rank: u32) -> Result<(), MpiError> {
        if self
            .pinged
            .get(&rank)
            .is_some_and(|t| t.elapsed() < PING_AFTER)
        {
            return Ok(());
        }
        self.pinged.insert(rank, Instant::now());
        self.p.put(
            self.ni,
            self.bounce_md,
            0,
            0,
            AckReq::Ack,
            Target {
                id: ProcessId::Logical { rank },
                pt_index: super::flow::FC_PT,
                match_bits: 0,
                remote_offset: 0,
            },
            T_PING | rank as u64,
            0,
        )?;
        Ok(())
    }

    /// `rank` is dead: every request waiting on it fails.
    fn peer_failed(&mut self, rank: u32, why: NiFail) {
        tracing::warn!(rank = self.rank, peer = rank, ?why, "MPI: a peer is dead");
        if let Some(d) = self.dead.get_mut(rank as usize) {
            *d = true;
        }
        let waiting: Vec<u32> = (0..self.reqs.len() as u32)
            .filter(|&i| {
                self.reqs[i as usize]
                    .as_ref()
                    .is_some_and(|r| !r.done && r.peer == Some(rank))
            })
            .collect();
        for i in waiting {
            if let Some(r) = self.req(i) {
                // A receive's entry stays linked over its bounce slot: the slot is not
                // given back.
                if matches!(r.landing, Some(Landing::Slot(_))) {
                    r.landing = None;
                }
            }
            self.finish(
                i,
                Some(MpiError::new(
                    ErrorClass::ProcFailed,
                    format!("world rank {rank} died"),
                )),
            );
        }
    }

    fn handle(&mut self, e: Event) -> Result<(), MpiError> {
        let idx = (e.user_ptr & !TAG_MASK) as u32;
        match (e.user_ptr & TAG_MASK, e.kind) {
            (_, EventKind::PtDisabled) => super::flow::pt_disabled(self),
            (T_RECV, EventKind::Put) => {
                self.stats.expected += 1;
                self.arrived(idx, &e, false)
            }
            (T_RECV, EventKind::Link) if e.ni_fail != NiFail::Ok => {
                let what = match e.ni_fail {
                    NiFail::NoSpace => "the NIC has no room for another receive",
                    _ => "the NIC refused the receive's list entry",
                };
                self.finish(idx, Some(MpiError::new(ErrorClass::Other, what)));
                Ok(())
            }
            (T_RECV, EventKind::PutOverflow) => {
                self.stats.unexpected += 1;
                self.arrived(idx, &e, true)
            }
            (T_OVF, EventKind::AutoUnlink) => {
                if let Some(l) = self.ovf_linked.get_mut(idx as usize) {
                    *l = false;
                }
                Ok(())
            }
            (T_OVF, EventKind::AutoFree) => self.link_overflow(idx as usize),
            (T_OVF | T_LONGOVF, _) => Ok(()),
            (T_PROBE, EventKind::Search) => {
                let found = e.ni_fail == NiFail::Ok;
                if let Some(r) = self.req(idx) {
                    r.probe_found = found;
                    if found {
                        r.status = Status {
                            source: bits::src(e.match_bits),
                            tag: bits::tag(e.match_bits),
                            count: message_len(&e) as usize,
                        };
                    }
                }
                self.finish(idx, None);
                Ok(())
            }
            (T_ACK, EventKind::Ack) => self.acked(idx, &e),
            (T_PING, EventKind::Ack) if e.ni_fail != NiFail::Ok => {
                self.peer_failed(idx, e.ni_fail);
                Ok(())
            }
            (T_READ, EventKind::Get) => {
                if let Some(r) = self.req(idx) {
                    r.read_me = None;
                }
                self.finish(idx, None);
                Ok(())
            }
            (T_GET, EventKind::Reply) => {
                let fail = (e.ni_fail != NiFail::Ok)
                    .then(|| MpiError::from_fail(e.ni_fail, "fetching a long message"));
                self.landed(idx, fail);
                Ok(())
            }
            (T_STAGE, kind) => {
                self.staged_reply(idx as u64, kind, e.ni_fail, e.mlength);
                Ok(())
            }
            (super::flow::T_FC, EventKind::Put) => super::flow::notice(self, &e),
            _ => Ok(()),
        }
    }

    /// A send's ACK: a short one frees its slot; a long one delivered whole is done.
    fn acked(&mut self, i: u32, e: &Event) -> Result<(), MpiError> {
        if e.ni_fail == NiFail::PtDisabled {
            return super::flow::refused(self, i);
        }
        super::flow::acked(self, i)?;
        let Some(r) = self.req(i) else { return Ok(()) };
        if e.ni_fail != NiFail::Ok {
            let fail = MpiError::from_fail(e.ni_fail, "a send");
            if r.slot.is_some() {
                r.busy = 0;
            }
            let me = r.read_me.take();
            if let Some(h) = me {
                let _ = self.p.me_unlink(self.ni, h);
            }
            self.finish(i, Some(fail));
            return Ok(());
        }
        if r.slot.is_some() {
            r.busy = 0;
            self.maybe_free(i);
        } else if e.mlength == r.total && e.rlength == r.total {
            // Expected and whole (eager LONG): nobody will fetch it.
            if let Some(h) = r.read_me.take() {
                let _ = self.p.me_unlink(self.ni, h);
            }
            self.finish(i, None);
        }
        Ok(())
    }

    /// A receive matched a message: in place (`overflow` false) or an unexpected one whose
    /// first bytes wait in an overflow buffer.
    fn arrived(&mut self, i: u32, e: &Event, overflow: bool) -> Result<(), MpiError> {
        if let ProcessId::Logical { rank } = e.initiator {
            super::credit::consumed(self, rank)?;
        }
        let eager = self.eager_limit;
        let Some(r) = self.req(i) else { return Ok(()) };
        let Some(landing) = r.landing else {
            // A receive that failed (its peer was declared dead) and gave up its slot.
            return Ok(());
        };
        let len = r.len as u64;
        let r_addr = r.addr;
        let proto = bits::proto(e.match_bits);
        let total = message_len(e);
        r.status = Status {
            source: bits::src(e.match_bits),
            tag: bits::tag(e.match_bits),
            count: total.min(len) as usize,
        };
        if total > len {
            r.err = Some(MpiError::new(
                ErrorClass::Truncate,
                format!("a message of {total} bytes for a receive buffer of {len}"),
            ));
        }
        // The first bytes: in place already, or copied out of the overflow buffer.
        let first = match proto {
            bits::LONG if overflow => 0,
            _ => e.mlength.min(len),
        };
        if overflow && first > 0 {
            let dst = match landing {
                Landing::Slot(s) => self.slot_ptr(s),
                Landing::Cached { .. } => r_addr as *mut u8,
            };
            // SAFETY: the event's bytes lie in the overflow region (the NIC placed them there);
            // the landing area holds len >= first bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ovf.as_ptr().add(e.start as usize),
                    dst,
                    first as usize,
                )
            };
        }
        let need_get = match proto {
            bits::SHORT => false,
            bits::LONG => overflow || e.mlength < total,
            bits::RNDV => total > eager as u64 || e.mlength < total,
            _ => false,
        };
        if !need_get {
            self.landed(i, None);
            return Ok(());
        }
        // Fetch the rest from the sender's `read` entry (zero bytes when truncated: that still
        // tells the sender it may complete).
        let want = total.min(len).saturating_sub(first);
        let initiator = match e.initiator {
            ProcessId::Logical { rank } => rank,
            _ => {
                return err(
                    ErrorClass::Intern,
                    "a physical initiator on a logical interface",
                )
            }
        };
        let target = body_target(initiator, bits::hdr_send_id(e.hdr_data) as u64, first);
        self.stats.long_gets += 1;
        let (md, base) = match landing {
            Landing::Slot(s) => (self.bounce_md, self.slot_off(s)),
            // Private memory: through the ring (see `stage`).
            Landing::Cached { id, .. }
                if id != NOT_CACHED && want > 0 && want <= super::stage::STAGE_MAX =>
            {
                self.stats.staged_gets += 1;
                return self.stage_get(StagedGet {
                    req: i,
                    dst: r_addr + first,
                    len: want,
                    target,
                });
            }
            Landing::Cached { md, offset, .. } => (md, offset),
        };
        self.p
            .get(self.ni, md, base + first, want, target, T_GET | i as u64)?;
        Ok(())
    }

    /// All of a receive's bytes are in its landing area: copy out of a bounce slot, done.
    fn landed(&mut self, i: u32, fail: Option<MpiError>) {
        let Some(r) = self.reqs.get(i as usize).and_then(|r| r.as_ref()) else {
            return;
        };
        if let Some(Landing::Slot(s)) = r.landing {
            let n = r.status.count.min(r.len);
            // SAFETY: the slot holds at least len bytes; the user's buffer len bytes.
            unsafe { std::ptr::copy_nonoverlapping(self.slot_ptr(s), r.addr as *mut u8, n) };
        }
        self.finish(i, fail);
    }
}

/// A message's whole length as its event tells it (RNDV carries it in hdr_data).
fn message_len(e: &Event) -> u64 {
    match bits::proto(e.match_bits) {
        bits::RNDV | bits::LONG => bits::hdr_total(e.hdr_data),
        _ => e.rlength,
    }
}
