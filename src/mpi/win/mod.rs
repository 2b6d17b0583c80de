//! MPI-3 one-sided communication on Portals (seed 003 §3.2). A window dups its communicator
//! (its context id names the window) and is match entries on the RMA portal: the window's
//! memory (match bits `2 * id`; a dynamic window has one entry per attached segment instead,
//! see `dynamic`) and its control words (`2 * id + 1`: lock word, post and complete counters,
//! the MINLOC/MAXLOC mutex, a dynamic window's segment table). Operations go from a staging
//! region through an MD that counts ACKs and REPLYs into one counting event; each operation
//! bumps a counter, so what is outstanding is the counter minus the CT, and every flush waits
//! for the CT to reach the counter. Request-based operations (`rput`, `rget`, …) go through a
//! second MD over the same staging region that counts into the same CT and also gives full
//! events, carrying the request in `user_ptr` (see `request`).
//!
//! Locks follow the seed: a 64-bit lock word, the low half counting shared holders, the high
//! half exclusive. Shared: fetch-add 1, and a result ≥ 2^32 means an exclusive holder: add −1
//! and retry. Exclusive: CSWAP 0 → 2^32, retry. Unlock: add −1, or an MSWAP clearing bit 32.

mod dynamic;
mod ops;
mod request;
mod sync;

use std::cell::RefCell;
use std::rc::Rc;

use crate::client::{MemHandle, MemRegion};
use crate::nic::memory::Perms;
use crate::portals::{md_opt, me_opt, Buffer, Datatype, List, Md, Me, ProcessId, Target};

use super::coll::{bytes_mut, Type};
use super::comm::Comm;
use super::error::{err, ErrorClass, MpiError};
use super::mem::AllocMem;
use super::state::{State, RMA_PT};

pub use self::request::RmaRequest;

/// The passive-target lock word: bits 0–31 count shared holders, bit 32 is the exclusive
/// holder, bits 33–63 count exclusive waiters (see `Win::acquire`).
const LOCK: u64 = 0;
const POST: u64 = 8;
const COMPLETE: u64 = 16;
/// The mutex MINLOC/MAXLOC accumulates hold around their get-modify-put (0 free, 1 held).
const ACC_LOCK: u64 = 24;
/// A dynamic window's table of attached segments.
const TABLE: u64 = 64;
const CTRL_LEN: usize = TABLE as usize + dynamic::TABLE_LEN;
const EXCL: u64 = 1 << 32;
/// One announced exclusive waiter in the lock word.
const WAITER: u64 = 1 << 33;
/// Staging for origin buffers and fetched results.
const STAGING: usize = 4 << 20;
/// Full events of request-based operations the window's event queue holds.
const REQ_EQ_LEN: usize = 4096;

/// Lock types (MPI_LOCK_SHARED, MPI_LOCK_EXCLUSIVE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockType {
    Shared,
    Exclusive,
}

/// Assertions (MPI_MODE_*), as bits.
pub mod mode {
    pub const NOCHECK: u32 = 1;
}

/// What access to each target is allowed now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    None,
    Lock(LockType),
    /// lock_all's shared lock (or NOCHECK).
    All,
}

/// The memory a window exposes.
enum Memory {
    /// MPI_Win_allocate: the window's own registered memory.
    Own(MemRegion),
    /// MPI_Win_create over `alloc_mem` memory (kept alive while the window lives).
    Given(AllocMem),
    /// MPI_Win_create_dynamic: the segments attached here.
    Dynamic(dynamic::Attached),
}

/// Window creation options (MPI_Info keys a window understands).
#[derive(Debug, Clone, Copy)]
pub struct WinInfo {
    /// `accumulate_ordering`: true (MPI's default, rar,raw,war,waw) splits accumulates at
    /// max_ordered_size as well as max_atomic_size, so accumulates to one place from one
    /// origin apply in order; false ("none") splits at max_atomic_size only.
    pub accumulate_ordering: bool,
}

impl Default for WinInfo {
    fn default() -> Self {
        WinInfo {
            accumulate_ordering: true,
        }
    }
}

/// An RMA window (MPI_Win).
pub struct Win {
    comm: Comm,
    memory: Memory,
    ctrl: MemRegion,
    staging: MemRegion,
    staged: usize,
    sizes: Vec<u64>,
    ct: u32,
    /// Counts what arrives at the control words, so PSCW waits can sleep on the NIC.
    ctrl_ct: u32,
    md: u32,
    /// The MD request-based operations use (full events into `rq`'s queue).
    md_req: u32,
    rq: Rc<RefCell<request::Pending>>,
    /// The memory entry (none in a dynamic window) and the control entry.
    me: Vec<u32>,
    issued: u64,
    /// Failures the CT counted that a flush already reported.
    failures: u64,
    info: WinInfo,
    fence: bool,
    access: Vec<Access>,
    lock_all: Option<bool>,
    /// PSCW: the access group (started) and exposure group (posted), with the counts seen.
    started: Option<Vec<u32>>,
    posted: Option<Vec<u32>>,
    posts_seen: u64,
    completes_seen: u64,
    /// A dynamic window: each member's attached segments as last read.
    segments: Vec<Vec<dynamic::Segment>>,
    freed: bool,
}

/// A match entry exposing `len` bytes of `region` on the RMA portal under `bits` (counting
/// what arrives on `ct`, if given).
fn expose(
    st: &mut State,
    region: MemHandle,
    len: usize,
    bits: u64,
    ct: Option<u32>,
) -> Result<u32, MpiError> {
    let mut e = Me::new(
        Buffer {
            region,
            offset: 0,
            len: len as u64,
        },
        bits,
    );
    e.options =
        me_opt::OP_PUT | me_opt::OP_GET | me_opt::EVENT_COMM_DISABLE | me_opt::EVENT_LINK_DISABLE;
    if ct.is_some() {
        e.options |= me_opt::EVENT_CT_COMM;
        e.ct = ct;
    }
    Ok(st.p.me_append(st.ni, RMA_PT, &e, List::Priority, 0)?)
}

impl Win {
    /// MPI_Win_allocate: `size` bytes at every member (sizes may differ), zeroed. Collective.
    pub fn allocate(comm: &Comm, size: usize) -> Result<Win, MpiError> {
        Self::allocate_with(comm, size, WinInfo::default())
    }

    /// MPI_Win_allocate with info keys.
    pub fn allocate_with(comm: &Comm, size: usize, info: WinInfo) -> Result<Win, MpiError> {
        let mem = comm
            .st
            .borrow_mut()
            .p
            .endpoint()
            .mem_register(size.max(8), Perms::READ_WRITE)?;
        Self::open(comm, Memory::Own(mem), size, info)
    }

    /// MPI_Win_create over memory from [`Comm::alloc_mem`] (the NIC applies atomics only to
    /// memory it maps, so user memory must come from there). Collective.
    pub fn create(comm: &Comm, mem: &AllocMem, info: WinInfo) -> Result<Win, MpiError> {
        let len = mem.len();
        Self::open(comm, Memory::Given(mem.clone()), len, info)
    }

    /// MPI_Win_create_dynamic: a window with no memory until segments are attached
    /// ([`Win::attach`]); displacements are addresses ([`AllocMem::address`]). Collective.
    pub fn create_dynamic(comm: &Comm, info: WinInfo) -> Result<Win, MpiError> {
        Self::open(comm, Memory::Dynamic(Default::default()), 0, info)
    }

    fn open(comm: &Comm, memory: Memory, size: usize, info: WinInfo) -> Result<Win, MpiError> {
        let comm = comm.dup()?;
        let id = comm.context_id() as u64;
        let exposed = match &memory {
            Memory::Own(m) => Some(m.handle),
            Memory::Given(a) => Some(a.region().handle),
            Memory::Dynamic(_) => None,
        };
        let (ctrl, staging, [ct, ctrl_ct], md, md_req, eq, me) = {
            let mut st = comm.st.borrow_mut();
            let st = &mut *st;
            let ni = st.ni;
            let ctrl = st.p.endpoint().mem_register(CTRL_LEN, Perms::READ_WRITE)?;
            let staging = st.p.endpoint().mem_register(STAGING, Perms(0))?;
            let ct = st.p.ct_alloc(ni)?;
            let eq = st.p.eq_alloc(ni, REQ_EQ_LEN)?;
            // QUIET: a window's target does not wait for the puts (it learns of them at the
            // epoch's synchronisation), so its NIC does not keep its core for them.
            let counted = md_opt::EVENT_CT_ACK
                | md_opt::EVENT_CT_REPLY
                | md_opt::EVENT_SEND_DISABLE
                | md_opt::QUIET;
            let mut bind = |options, eq| {
                st.p.md_bind(
                    ni,
                    &Md {
                        region: staging.handle,
                        segments: vec![(0, STAGING as u64)],
                        options,
                        eq,
                        ct: Some(ct),
                    },
                )
            };
            let md = bind(counted | md_opt::EVENT_SUCCESS_DISABLE, None)?;
            let md_req = bind(counted, Some(eq))?;
            let mut me = Vec::with_capacity(2);
            if let Some(region) = exposed {
                me.push(expose(st, region, size, 2 * id, None)?);
            }
            let ctrl_ct = st.p.ct_alloc(ni)?;
            me.push(expose(
                st,
                ctrl.handle,
                CTRL_LEN,
                2 * id + 1,
                Some(ctrl_ct),
            )?);
            (ctrl, staging, [ct, ctrl_ct], md, md_req, eq, me)
        };
        let n = comm.size() as usize;
        let mut sizes = vec![0u64; n];
        comm.allgather(&[size as u64], &mut sizes)?;
        // Every member's entries exist before anyone leaves (the seed's barrier).
        comm.barrier()?;
        let rq = request::Pending::new(comm.st.clone(), eq, staging.clone());
        Ok(Win {
            memory,
            ctrl,
            staging,
            staged: 0,
            sizes,
            ct,
            ctrl_ct,
            md,
            md_req,
            rq: Rc::new(RefCell::new(rq)),
            me,
            issued: 0,
            failures: 0,
            info,
            fence: false,
            access: vec![Access::None; n],
            lock_all: None,
            started: None,
            posted: None,
            posts_seen: 0,
            completes_seen: 0,
            segments: vec![Vec::new(); n],
            freed: false,
            comm,
        })
    }

    /// This rank's window memory (MPI_Win_shared_query of itself; empty for a dynamic
    /// window). Remote operations change it at any time within the epochs the program's
    /// synchronisation allows.
    #[allow(clippy::mut_from_ref)]
    pub fn local(&self) -> &mut [u8] {
        let n = self.sizes[self.comm.rank() as usize] as usize;
        match &self.memory {
            Memory::Own(m) => &mut m.bytes()[..n],
            Memory::Given(a) => a.bytes(),
            Memory::Dynamic(_) => &mut [],
        }
    }

    /// The window's communicator (a dup of the one it was created over).
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    fn id(&self) -> u64 {
        self.comm.context_id() as u64
    }

    fn target(&self, rank: u32, bits: u64, off: u64) -> Target {
        Target {
            id: ProcessId::Logical {
                rank: self.comm.group[rank as usize],
            },
            pt_index: RMA_PT,
            match_bits: bits,
            remote_offset: off,
        }
    }

    /// `rank`'s control words at `off`.
    fn ctrl_target(&self, rank: u32, off: u64) -> Target {
        self.target(rank, 2 * self.id() + 1, off)
    }

    /// Checks that `rank` may be accessed now (a member, within an epoch to it).
    fn check_access(&self, rank: u32) -> Result<(), MpiError> {
        if self.freed {
            return err(ErrorClass::Win, "the window was freed");
        }
        if rank >= self.comm.size() {
            return err(
                ErrorClass::Rank,
                format!(
                    "rank {rank} is not in this window's group of {}",
                    self.comm.size()
                ),
            );
        }
        let open = self.fence
            || self.access[rank as usize] != Access::None
            || self.started.as_ref().is_some_and(|g| g.contains(&rank));
        if !open {
            return err(
                ErrorClass::RmaSync,
                format!("no access epoch to rank {rank}: fence, lock, lock_all or start first"),
            );
        }
        Ok(())
    }

    /// Where `len` bytes at displacement `disp` of `rank`'s window are, once the access is
    /// checked: within an epoch and within the window (a dynamic window: within one attached
    /// segment).
    fn dest(&mut self, rank: u32, disp: u64, len: u64) -> Result<Target, MpiError> {
        self.check_access(rank)?;
        if matches!(self.memory, Memory::Dynamic(_)) {
            return self.resolve(rank, disp, len);
        }
        if disp
            .checked_add(len)
            .is_none_or(|e| e > self.sizes[rank as usize])
        {
            return err(
                ErrorClass::RmaRange,
                format!(
                    "[{disp}, +{len}) lies outside rank {rank}'s window of {} bytes",
                    self.sizes[rank as usize]
                ),
            );
        }
        Ok(self.target(rank, 2 * self.id(), disp))
    }

    /// Room for `len` bytes in the staging region, and for one more request piece's event in
    /// the window's queue (waiting for earlier operations to finish when either is spent).
    /// Every operation's piece stages before it is issued, so what is staged stays put
    /// until it completes.
    fn stage(&mut self, len: usize) -> Result<u64, MpiError> {
        let len8 = len.next_multiple_of(8);
        if self.staged + len8 > STAGING || self.rq.borrow().pieces >= REQ_EQ_LEN / 2 {
            self.flush_all_inner()?;
        }
        let at = self.staged;
        self.staged += len8;
        Ok(at as u64)
    }

    fn with_st<R>(&self, f: impl FnOnce(&mut State) -> Result<R, MpiError>) -> Result<R, MpiError> {
        let mut st = self.comm.st.borrow_mut();
        f(&mut st)
    }

    /// MPI_Win_free (collective): completes everything, then a barrier, then the entries go.
    pub fn free(mut self) -> Result<(), MpiError> {
        self.free_inner()
    }

    fn free_inner(&mut self) -> Result<(), MpiError> {
        if self.freed {
            return Ok(());
        }
        let r = self.flush_all_inner();
        self.comm.barrier()?;
        self.freed = true;
        let mut me = std::mem::take(&mut self.me);
        if let Memory::Dynamic(a) = &mut self.memory {
            me.extend(a.take_entries());
        }
        let (md, md_req, eq) = (self.md, self.md_req, self.rq.borrow().eq());
        let cts = [self.ct, self.ctrl_ct];
        let mut regions = vec![self.ctrl.clone(), self.staging.clone()];
        if let Memory::Own(m) = &self.memory {
            regions.push(m.clone());
        }
        self.with_st(|st| {
            let ni = st.ni;
            for h in me {
                let _ = st.p.me_unlink(ni, h);
            }
            let _ = st.p.md_release(ni, md);
            let _ = st.p.md_release(ni, md_req);
            for ct in cts {
                let _ = st.p.ct_free(ni, ct);
            }
            let _ = st.p.eq_free(ni, eq);
            for m in &regions {
                let _ = st.p.endpoint().mem_deregister(m);
            }
            Ok(())
        })?;
        r
    }
}

impl Drop for Win {
    fn drop(&mut self) {
        if !self.freed && !std::thread::panicking() {
            let _ = self.free_inner();
        }
    }
}

/// The element that leaves any value unchanged under Sum: 0, or -0.0 for floats.
fn neutral<T: Type>() -> T {
    let mut v = [T::default()];
    match T::DT {
        Datatype::Float => bytes_mut(&mut v).copy_from_slice(&(-0.0f32).to_le_bytes()),
        Datatype::Double => bytes_mut(&mut v).copy_from_slice(&(-0.0f64).to_le_bytes()),
        _ => {}
    }
    v[0]
}
