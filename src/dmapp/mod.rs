//! DMAPP on the Gemini engine, after seed 001 (ten Bruggencate and Roweth, "DMAPP — An API
//! for One-sided Program Models on Baker Systems") and Cray's dmapp man pages.
//!
//! A [`Dmapp`] wraps a [`gni::Nic`](crate::gni::Nic): every transfer becomes Gemini-level
//! commands to the soft NIC. What DMAPP adds is the program model of §2: PEs, symmetric memory
//! (a data segment stand-in and a symmetric heap registered at init, same offsets on every PE),
//! addresses given as (virtual address, segment descriptor, PE), element types, strided,
//! indexed and PE-strided transfers, the AMO set in three completion styles, sync ids with
//! DMAPP's rules, dynamic registration behind a registration cache, and `DMAPP_RC_*` codes.
//!
//! Paths (§3.2): a contiguous put or get of fewer bytes than `offload_threshold` goes FMA (the
//! data inline in the command), larger ones BTE (the daemon streams from or into registered
//! memory); strided, indexed, PE-strided transfers and AMOs always go FMA, each as one command
//! and one wire op per datagram of elements, every element checked by the target NIC.
//!
//! Ordering: one PE's puts and AMOs reach a target PE in issue order under every routing mode
//! (the daemon keeps a process's operations to a host in order, an FMA put behind a BTE one
//! too), so `Routing::InOrder` holds and the others promise no less.

/// The three completion forms of a transfer call, from its `Mode`-taking implementation:
/// blocking (globally visible on return), `_nb` (complete when the sync id retires) and
/// `_nbi` (complete at the next gsync).
macro_rules! forms {
    ($(#[$doc:meta])* $any:ident => $b:ident, $nb:ident, $nbi:ident
        ($($arg:ident: $t:ty),*)) => {
        impl Dmapp {
            $(#[$doc])*
            /// Blocking: globally visible on return.
            #[allow(clippy::too_many_arguments)]
            pub fn $b(&mut self, $($arg: $t),*) -> Result<(), DmappError> {
                self.$any(Mode::Blocking, $($arg),*).map(|_| ())
            }
            $(#[$doc])*
            /// Non-blocking explicit: issued on return, complete when the sync id retires.
            #[allow(clippy::too_many_arguments)]
            pub fn $nb(&mut self, $($arg: $t),*) -> Result<SyncId, DmappError> {
                self.$any(Mode::Nb, $($arg),*).map(|id| id.expect("nb gives a sync id"))
            }
            $(#[$doc])*
            /// Non-blocking implicit: issued on return, complete at the next gsync.
            #[allow(clippy::too_many_arguments)]
            pub fn $nbi(&mut self, $($arg: $t),*) -> Result<(), DmappError> {
                self.$any(Mode::Nbi, $($arg),*).map(|_| ())
            }
        }
    };
}

mod amo;
mod error;
pub mod heap;
mod pe_strided;
pub mod regcache;
mod rma;

use rustc_hash::FxHashMap as HashMap;

use crate::client::{MemHandle, MemRegion};
use crate::gni::{Nic, Remote};
use crate::nic::memory::Perms;

pub use error::{DmappError, Rc};
pub use regcache::CacheStats;

use error::err;

/// `DMAPP_MIN_OUTSTANDING_NB`, `DMAPP_DEF_OUTSTANDING_NB`, `DMAPP_MAX_OUTSTANDING_NB`.
pub const MIN_OUTSTANDING_NB: u32 = 5;
pub const DEF_OUTSTANDING_NB: u32 = 512;
pub const MAX_OUTSTANDING_NB: u32 = 2048;
/// `DMAPP_OFFLOAD_THRESHOLD`: transfers of this many bytes or more are offloaded (BTE).
pub const OFFLOAD_THRESHOLD: u32 = 4096;
/// The symmetric heap grows in granules of this size (the seed's large pages).
pub const HEAP_GRANULE: u64 = 2 << 20;
/// Symmetric heap size when `XT_SYMMETRIC_HEAP_SIZE` is not set.
pub const DEFAULT_HEAP: u64 = 64 << 20;
/// Size of the data segment stand-in when `SOFTNIC_DMAPP_DATA_SIZE` is not set.
pub const DEFAULT_DATA: u64 = 1 << 20;

/// `dmapp_type_t`: the element types, in Cray's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Type {
    /// Double quad word, 16 bytes.
    Dqw,
    /// Quad word, 8 bytes.
    Qw,
    /// Double word, 4 bytes.
    Dw,
    Byte,
}

impl Type {
    pub fn size(self) -> usize {
        match self {
            Type::Dqw => 16,
            Type::Qw => 8,
            Type::Dw => 4,
            Type::Byte => 1,
        }
    }
}

/// `dmapp_routing_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    InOrder = 0,
    Deterministic = 1,
    Adaptive = 2,
}

/// `dmapp_rma_attrs_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RmaAttrs {
    /// Non-blocking explicit requests (sync ids) a PE may hold unretired; init only.
    pub max_outstanding_nb: u32,
    /// Bytes from which a contiguous put or get is offloaded (BTE); any time.
    pub offload_threshold: u32,
    pub put_relaxed_ordering: Routing,
    pub get_relaxed_ordering: Routing,
    /// Threads using DMAPP at once; init only, at least 1 (a `Dmapp` is used through
    /// `&mut`, so one at a time).
    pub max_concurrency: u32,
}

impl Default for RmaAttrs {
    fn default() -> RmaAttrs {
        RmaAttrs {
            max_outstanding_nb: DEF_OUTSTANDING_NB,
            offload_threshold: OFFLOAD_THRESHOLD,
            put_relaxed_ordering: Routing::Deterministic,
            get_relaxed_ordering: Routing::Adaptive,
            max_concurrency: 1,
        }
    }
}

/// `dmapp_seg_desc_t`: a remotely accessible segment of one PE — its base address there, its
/// length and the NIC's handle for it. Plain bytes ([`SegDesc::to_bytes`]) to send out of band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegDesc {
    pub addr: u64,
    pub len: u64,
    pub handle: u32,
}

const SEG_MAGIC: u32 = 0x4453_4d44; // "DMSD"
/// Bytes of an encoded [`SegDesc`].
pub const SEG_DESC_LEN: usize = 24;

impl SegDesc {
    pub fn to_bytes(&self) -> [u8; SEG_DESC_LEN] {
        let mut b = [0u8; SEG_DESC_LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.handle.to_le_bytes());
        b[20..24].copy_from_slice(&SEG_MAGIC.to_le_bytes());
        b
    }

    /// Decodes a descriptor received from another PE; garbage is `INVALID_PARAM`.
    pub fn from_bytes(b: &[u8]) -> Result<SegDesc, DmappError> {
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        if b.len() != SEG_DESC_LEN || u32_at(20) != SEG_MAGIC {
            return err(
                Rc::InvalidParam,
                format!("not a segment descriptor ({} bytes)", b.len()),
            );
        }
        let d = SegDesc {
            addr: u64_at(0),
            len: u64_at(8),
            handle: u32_at(16),
        };
        if d.addr.checked_add(d.len).is_none() {
            return err(
                Rc::InvalidParam,
                "segment descriptor wraps the address space",
            );
        }
        Ok(d)
    }

    /// The address `off` bytes into the segment.
    pub fn at(&self, off: u64) -> u64 {
        self.addr + off
    }
}

/// `dmapp_jobinfo_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobInfo {
    pub npes: u32,
    pub pe: u32,
    pub data_seg: SegDesc,
    pub sheap_seg: SegDesc,
}

/// A non-blocking explicit operation's sync id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SyncId(u64);

/// Path and registration-cache counters of this PE.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub fma_ops: u64,
    pub bte_ops: u64,
    pub reg_cache: CacheStats,
}

/// How an operation completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Blocking,
    Nb,
    Nbi,
}

/// An operation whose local memory the NIC still reads or writes after the call returned:
/// registration `handle`, local range `[lo, hi)`, and its sync id (`None`: implicit).
struct Inflight {
    req: Option<u64>,
    handle: u32,
    lo: u64,
    hi: u64,
}

/// Where local bytes are for the NIC: a region of this PE and the offset in it.
#[derive(Debug, Clone, Copy)]
struct Local {
    handle: MemHandle,
    off: u64,
}

/// One PE's DMAPP.
pub struct Dmapp {
    nic: Nic,
    attrs: RmaAttrs,
    data: MemRegion,
    heap_mem: MemRegion,
    heap: heap::Heap,
    regs: regcache::RegCache,
    /// Sync ids handed out and not retired; a group id stands for several requests.
    nb: HashMap<u64, Reqs>,
    next_group: u64,
    inflight: Vec<Inflight>,
    counters: Counters,
}

/// The requests one call posted: almost always one (no allocation on the hot path).
enum Reqs {
    One(u64),
    Many(Vec<u64>),
}

impl Reqs {
    fn as_slice(&self) -> &[u64] {
        match self {
            Reqs::One(r) => std::slice::from_ref(r),
            Reqs::Many(v) => v,
        }
    }
}

/// Bit of a [`SyncId`] that marks a group (one id for the requests of a PE-strided call).
const GROUP: u64 = 1 << 62;

/// A size from the environment (`64M`, `512K`, `1G`), `default` when unset.
fn size_env(name: &str, default: u64) -> Result<u64, DmappError> {
    let Ok(v) = std::env::var(name) else {
        return Ok(default);
    };
    crate::config::parse_size(&v).ok_or_else(|| {
        DmappError::new(
            Rc::InvalidParam,
            format!("{name}={v}: expected a size such as 64M, 512K or 1G"),
        )
    })
}

impl Dmapp {
    /// `dmapp_init`: attaches to this PE's daemon, registers the data segment stand-in and the
    /// symmetric heap (`XT_SYMMETRIC_HEAP_SIZE`, rounded up to 2 MiB granules), and returns
    /// the attributes in force. Collective: every PE calls it.
    pub fn init(requested: Option<RmaAttrs>) -> Result<(Dmapp, RmaAttrs), DmappError> {
        Self::check_attrs(&requested.unwrap_or_default())?;
        let nic = Nic::init()
            .map_err(|e| DmappError::new(Rc::ResourceError, format!("no soft NIC: {e}")))?;
        Self::with_nic(nic, requested)
    }

    /// [`Dmapp::init`] on an attached NIC (whose owner registered nothing yet, or registered
    /// alike on every PE).
    pub fn with_nic(
        mut nic: Nic,
        requested: Option<RmaAttrs>,
    ) -> Result<(Dmapp, RmaAttrs), DmappError> {
        let req = requested.unwrap_or_default();
        Self::check_attrs(&req)?;
        let attrs = RmaAttrs {
            max_concurrency: 1,
            ..req
        };
        let heap_len = size_env("XT_SYMMETRIC_HEAP_SIZE", DEFAULT_HEAP)?
            .max(1)
            .checked_next_multiple_of(HEAP_GRANULE)
            .ok_or_else(|| DmappError::new(Rc::InvalidParam, "symmetric heap size overflows"))?;
        let data_len = size_env("SOFTNIC_DMAPP_DATA_SIZE", DEFAULT_DATA)?.max(8);
        let resource = |e| DmappError::new(Rc::ResourceError, format!("cannot register: {e}"));
        let data = nic
            .mem_register(data_len as usize, Perms::READ_WRITE)
            .map_err(resource)?;
        let heap_mem = nic
            .mem_register(heap_len as usize, Perms::READ_WRITE)
            .map_err(resource)?;
        // Every PE's segments are registered before anyone addresses them.
        nic.barrier().map_err(DmappError::from)?;
        let mut d = Dmapp {
            nic,
            attrs,
            data,
            heap: heap::Heap::new(heap_len),
            heap_mem,
            regs: regcache::RegCache::default(),
            nb: HashMap::default(),
            next_group: 0,
            inflight: Vec::new(),
            counters: Counters::default(),
        };
        d.apply_threshold();
        Ok((d, attrs))
    }

    fn check_attrs(a: &RmaAttrs) -> Result<(), DmappError> {
        if !(MIN_OUTSTANDING_NB..=MAX_OUTSTANDING_NB).contains(&a.max_outstanding_nb) {
            return err(
                Rc::InvalidParam,
                format!(
                    "max_outstanding_nb {} outside {MIN_OUTSTANDING_NB}..={MAX_OUTSTANDING_NB}",
                    a.max_outstanding_nb
                ),
            );
        }
        if a.max_concurrency < 1 {
            return err(Rc::InvalidParam, "max_concurrency must be at least 1");
        }
        Ok(())
    }

    /// The gni layer inlines up to its threshold: one byte below ours.
    fn apply_threshold(&mut self) {
        self.nic
            .set_fma_threshold((self.attrs.offload_threshold as usize).saturating_sub(1));
    }

    /// `dmapp_finalize`: completes this PE's implicit operations, retires nothing it was not
    /// asked to, releases dynamic registrations and leaves through a barrier of all PEs.
    pub fn finalize(mut self) -> Result<(), DmappError> {
        let first = self.gsync_wait().err();
        self.nic.barrier().map_err(DmappError::from)?;
        for h in self.regs.drain() {
            let _ = self.nic.endpoint().client().deregister(h);
        }
        first.map_or(Ok(()), Err)
    }

    /// Hands the NIC back (after completing this PE's implicit operations) to a layer that
    /// goes on without DMAPP; the segments stay registered. Sync ids not retired are lost.
    pub fn into_nic(mut self) -> Result<Nic, DmappError> {
        self.gsync_wait()?;
        Ok(self.nic)
    }

    /// `dmapp_get_jobinfo`.
    pub fn get_jobinfo(&self) -> JobInfo {
        JobInfo {
            npes: self.nic.size(),
            pe: self.nic.rank(),
            data_seg: Self::seg_of(&self.data),
            sheap_seg: Self::seg_of(&self.heap_mem),
        }
    }

    fn seg_of(r: &MemRegion) -> SegDesc {
        SegDesc {
            addr: r.as_ptr() as u64,
            len: r.len() as u64,
            handle: r.handle.0,
        }
    }

    /// `dmapp_get_rma_attrs`.
    pub fn get_rma_attrs(&self) -> RmaAttrs {
        self.attrs
    }

    /// `dmapp_set_rma_attrs`: the dynamic attributes (offload threshold, routing) change for
    /// later requests; the static ones (max_outstanding_nb, max_concurrency) are init only and
    /// must be passed unchanged.
    pub fn set_rma_attrs(&mut self, requested: RmaAttrs) -> Result<RmaAttrs, DmappError> {
        Self::check_attrs(&requested)?;
        if requested.max_outstanding_nb != self.attrs.max_outstanding_nb
            || requested.max_concurrency != self.attrs.max_concurrency
        {
            return err(
                Rc::InvalidParam,
                "max_outstanding_nb and max_concurrency can be set at init only",
            );
        }
        self.attrs = requested;
        self.apply_threshold();
        Ok(self.attrs)
    }

    /// Path and registration-cache counters.
    pub fn counters(&self) -> Counters {
        Counters {
            reg_cache: self.regs.stats,
            ..self.counters
        }
    }

    /// The gni NIC underneath (for layers that mix both, and benchmarks).
    pub fn nic(&mut self) -> &mut Nic {
        &mut self.nic
    }

    /// This PE's symmetric heap as registered memory (its bytes outlive borrows of `self`, so
    /// they can be the source of this PE's own puts).
    pub fn sheap_region(&self) -> MemRegion {
        self.heap_mem.clone()
    }

    /// This PE's data segment stand-in as registered memory.
    pub fn data_region(&self) -> MemRegion {
        self.data.clone()
    }

    /// The local bytes of this PE's symmetric memory (data segment or heap) at `addr`.
    pub fn local_slice(&self, addr: u64, len: usize) -> Result<&mut [u8], DmappError> {
        for r in [&self.data, &self.heap_mem] {
            if let Some(off) = r.contains(addr as *const u8, len) {
                return Ok(&mut r.bytes()[off as usize..off as usize + len]);
            }
        }
        err(
            Rc::InvalidParam,
            format!("[{addr:#x}, +{len}) is not in this PE's symmetric memory"),
        )
    }

    /// A barrier of all PEs over the NIC (completes this PE's implicit operations first).
    pub fn barrier(&mut self) -> Result<(), DmappError> {
        self.nic.barrier().map_err(DmappError::from)
    }

    // ------------------------------------------------------------ symmetric heap

    /// `dmapp_heap_malloc` (sheap_malloc): `size` bytes of the symmetric heap; the same calls
    /// in the same order on every PE give the same offsets. RESOURCE_ERROR when exhausted.
    pub fn sheap_malloc(&mut self, size: usize) -> Result<u64, DmappError> {
        match self.heap.malloc(size as u64) {
            Some(off) => Ok(self.heap_mem.as_ptr() as u64 + off),
            None => err(
                Rc::ResourceError,
                format!(
                    "symmetric heap exhausted: no {size} bytes free of {} (set \
                     XT_SYMMETRIC_HEAP_SIZE)",
                    self.heap_mem.len()
                ),
            ),
        }
    }

    fn heap_block(&self, addr: u64) -> Result<(u64, u64), DmappError> {
        let off = addr.wrapping_sub(self.heap_mem.as_ptr() as u64);
        match self.heap.block(off) {
            Some(len) if off < self.heap_mem.len() as u64 => Ok((off, len)),
            _ => err(
                Rc::InvalidParam,
                format!("{addr:#x} is not a block of the symmetric heap"),
            ),
        }
    }

    /// `dmapp_heap_realloc`: resizes a block, keeping its contents (moved when it cannot grow
    /// in place). BUSY while this PE's own operations use it.
    pub fn sheap_realloc(&mut self, addr: u64, size: usize) -> Result<u64, DmappError> {
        let (off, len) = self.heap_block(addr)?;
        self.not_busy(addr, addr + len)?;
        let Some(new) = self.heap.realloc(off, size as u64) else {
            return err(
                Rc::ResourceError,
                format!("symmetric heap exhausted: cannot grow a block to {size} bytes"),
            );
        };
        if new != off {
            let keep = (len as usize).min(size);
            self.heap_mem
                .bytes()
                .copy_within(off as usize..off as usize + keep, new as usize);
        }
        Ok(self.heap_mem.as_ptr() as u64 + new)
    }

    /// `dmapp_heap_free`. BUSY while this PE's own operations use the block.
    pub fn sheap_free(&mut self, addr: u64) -> Result<(), DmappError> {
        let (off, len) = self.heap_block(addr)?;
        self.not_busy(addr, addr + len)?;
        self.heap.free(off);
        Ok(())
    }

    // ------------------------------------------------------------ registration

    /// `dmapp_mem_register`: makes `[addr, addr+len)` of this process (a `Vec`, an mmap)
    /// remotely accessible, page-rounded, non-symmetric: remote PEs reach it only through the
    /// returned descriptor, sent to them out of band. A range already registered is a cache
    /// hit, counted, and must be unregistered as often as registered.
    pub fn mem_register(&mut self, addr: u64, len: u64) -> Result<SegDesc, DmappError> {
        let Some((lo, hi)) = regcache::pages(addr, len) else {
            return err(Rc::InvalidParam, "range wraps the address space");
        };
        if let Some(e) = self.regs.lookup(addr, len, true) {
            return Ok(SegDesc {
                addr: e.lo,
                len: e.hi - e.lo,
                handle: e.handle,
            });
        }
        let handle = self
            .nic
            .endpoint()
            .client()
            .register_process(lo, hi - lo, Perms::READ_WRITE)
            .map_err(|e| DmappError::new(Rc::ResourceError, format!("cannot register: {e}")))?;
        self.regs.insert(lo, hi, handle, true, |_| false);
        Ok(SegDesc {
            addr: lo,
            len: hi - lo,
            handle,
        })
    }

    /// `dmapp_mem_unregister`: undoes one registration. NOT_FOUND for memory this PE did not
    /// register; BUSY while its own operations use the region.
    pub fn mem_unregister(&mut self, seg: &SegDesc) -> Result<(), DmappError> {
        let Some(e) = self.regs.remote_entry(seg.handle).copied() else {
            return err(
                Rc::NotFound,
                format!("no registration with handle {} on this PE", seg.handle),
            );
        };
        if e.lo != seg.addr {
            return err(Rc::NotFound, "descriptor does not match its registration");
        }
        self.not_busy(e.lo, e.hi)?;
        if self.regs.unregister(e.handle) == Some(true) {
            self.nic
                .endpoint()
                .client()
                .deregister(e.handle)
                .map_err(|x| DmappError::new(Rc::ResourceError, x.to_string()))?;
        }
        Ok(())
    }

    /// BUSY when an operation of this PE still uses memory in `[lo, hi)` (through whichever
    /// registration).
    fn not_busy(&mut self, lo: u64, hi: u64) -> Result<(), DmappError> {
        self.nic.progress();
        if self.inflight.iter().any(|f| f.lo < hi && lo < f.hi) {
            return err(
                Rc::Busy,
                "operations of this PE still use this memory: sync them first",
            );
        }
        Ok(())
    }

    /// Where the NIC finds `[p, p+len)` of this process: the symmetric segments, a
    /// `mem_register`ed range, or a local-side registration from the cache (made on a miss).
    fn local(&mut self, p: *const u8, len: usize) -> Result<Local, DmappError> {
        for r in [&self.heap_mem, &self.data] {
            if let Some(off) = r.contains(p, len) {
                return Ok(Local {
                    handle: r.handle,
                    off,
                });
            }
        }
        let addr = p as u64;
        if let Some(e) = self.regs.lookup(addr, len as u64, false) {
            return Ok(Local {
                handle: MemHandle(e.handle),
                off: addr - e.lo,
            });
        }
        let Some((lo, hi)) = regcache::pages(addr, len as u64) else {
            return err(Rc::InvalidParam, "local buffer wraps the address space");
        };
        let handle = self
            .nic
            .endpoint()
            .client()
            .register_process(lo, hi - lo, Perms(0))
            .map_err(|e| {
                DmappError::new(
                    Rc::ResourceError,
                    format!("cannot register a local buffer: {e}"),
                )
            })?;
        let inflight = &self.inflight;
        let evicted = self.regs.insert(lo, hi, handle, false, |h| {
            inflight.iter().any(|f| f.handle == h)
        });
        for h in evicted {
            let _ = self.nic.endpoint().client().deregister(h);
        }
        Ok(Local {
            handle: MemHandle(handle),
            off: addr - lo,
        })
    }

    // ------------------------------------------------------------ addressing

    fn check_pe(&self, pe: u32) -> Result<(), DmappError> {
        if pe >= self.nic.size() {
            return err(
                Rc::InvalidParam,
                format!("PE {pe} is not in this job of {} PEs", self.nic.size()),
            );
        }
        Ok(())
    }

    /// The remote address `addr` of `pe` in segment `seg`, `bytes` long: TRANSACTION_ERROR
    /// when it leaves the segment.
    fn remote(&self, addr: u64, seg: &SegDesc, pe: u32, bytes: u64) -> Result<Remote, DmappError> {
        self.check_pe(pe)?;
        let inside = addr >= seg.addr
            && addr
                .checked_add(bytes)
                .is_some_and(|e| e <= seg.addr.saturating_add(seg.len));
        if !inside {
            return err(
                Rc::TransactionError,
                format!(
                    "remote range [{addr:#x}, +{bytes}) lies outside the segment [{:#x}, +{})",
                    seg.addr, seg.len
                ),
            );
        }
        Ok(Remote {
            rank: pe,
            handle: MemHandle(seg.handle),
            offset: addr - seg.addr,
        })
    }

    /// Whether `seg` is one of the symmetric segments (the same object on every PE).
    fn is_symmetric(&self, seg: &SegDesc) -> bool {
        *seg == Self::seg_of(&self.heap_mem) || *seg == Self::seg_of(&self.data)
    }

    fn check_align(ty: Type, what: &str, addr: u64) -> Result<(), DmappError> {
        if ty != Type::Byte && !addr.is_multiple_of(4) {
            return err(
                Rc::AlignmentError,
                format!("{what} {addr:#x} of a {ty:?} transfer is not dword-aligned"),
            );
        }
        Ok(())
    }

    /// `nelems` elements of `ty` in bytes, and that they fit in a slice of `have` bytes.
    fn bytes_of(nelems: u64, ty: Type, have: usize, what: &str) -> Result<usize, DmappError> {
        match nelems.checked_mul(ty.size() as u64) {
            Some(b) if b <= have as u64 => Ok(b as usize),
            _ => err(
                Rc::InvalidParam,
                format!("{nelems} {ty:?} elements do not fit in the {have}-byte {what}"),
            ),
        }
    }

    // ------------------------------------------------------------ completion

    /// Room for one more sync id, or NO_SPACE.
    fn nb_room(&self) -> Result<(), DmappError> {
        if self.nb.len() >= self.attrs.max_outstanding_nb as usize {
            return err(
                Rc::NoSpace,
                format!(
                    "{} sync ids unretired (max_outstanding_nb): wait on some first",
                    self.nb.len()
                ),
            );
        }
        Ok(())
    }

    /// Finishes a posted request the way `mode` asks: waits (blocking), hands out a sync id
    /// (nb), or leaves it to gsync (nbi, already posted implicit).
    fn finish(&mut self, mode: Mode, reqs: Reqs) -> Result<Option<SyncId>, DmappError> {
        match mode {
            Mode::Blocking => {
                let mut first = None;
                for &r in reqs.as_slice() {
                    if let Err(e) = self.nic.wait_req(r) {
                        first.get_or_insert(DmappError::from(e));
                    }
                }
                first.map_or(Ok(None), Err)
            }
            Mode::Nb => {
                let id = match &reqs {
                    Reqs::One(r) => *r,
                    Reqs::Many(_) => {
                        self.next_group += 1;
                        self.next_group | GROUP
                    }
                };
                self.nb.insert(id, reqs);
                Ok(Some(SyncId(id)))
            }
            Mode::Nbi => Ok(None),
        }
    }

    /// Notes that the local `[lo, hi)` of `handle` is in use until `req` (or, implicit, the
    /// next gsync) retires.
    fn track(&mut self, mode: Mode, req: u64, l: Local, len: usize) {
        if mode == Mode::Blocking {
            return;
        }
        let base = self.local_base(l.handle);
        self.inflight.push(Inflight {
            req: (mode == Mode::Nb).then_some(req),
            handle: l.handle.0,
            lo: base + l.off,
            hi: base + l.off + len as u64,
        });
    }

    /// The address a registration of this PE starts at.
    fn local_base(&self, h: MemHandle) -> u64 {
        if h == self.heap_mem.handle {
            self.heap_mem.as_ptr() as u64
        } else if h == self.data.handle {
            self.data.as_ptr() as u64
        } else {
            self.regs.base_of(h.0).unwrap_or(0)
        }
    }

    /// `dmapp_syncid_wait`: waits until the operation is globally visible and retires the
    /// id; returns the fetched value of a fetching AMO (0 otherwise).
    pub fn syncid_wait(&mut self, id: SyncId) -> Result<u64, DmappError> {
        let Some(reqs) = self.nb.remove(&id.0) else {
            return err(Rc::InvalidParam, "unknown or already retired sync id");
        };
        let reqs = reqs.as_slice();
        if !self.inflight.is_empty() {
            self.inflight
                .retain(|f| f.req.is_none_or(|r| !reqs.contains(&r)));
        }
        let mut value = 0;
        let mut first = None;
        for &r in reqs {
            match self.nic.wait_req(r) {
                Ok(v) => value = v,
                Err(e) => {
                    first.get_or_insert(DmappError::from(e));
                }
            }
        }
        first.map_or(Ok(value), Err)
    }

    /// `dmapp_syncid_test`: the value once done (and the id retired), NOT_DONE while pending.
    pub fn syncid_test(&mut self, id: SyncId) -> Result<u64, DmappError> {
        let Some(reqs) = self.nb.get(&id.0) else {
            return err(Rc::InvalidParam, "unknown or already retired sync id");
        };
        let reqs = reqs.as_slice().to_vec();
        self.nic.progress();
        for r in &reqs {
            if !self.nic.endpoint().is_done(*r) {
                return err(Rc::NotDone, "operation still in flight");
            }
        }
        self.syncid_wait(id)
    }

    /// `dmapp_gsync_wait`: waits until every implicit operation of this PE is globally
    /// visible; reports the first failure among them, once. Retires no sync id.
    pub fn gsync_wait(&mut self) -> Result<(), DmappError> {
        let r = self.nic.gsync_wait().map_err(DmappError::from);
        self.inflight.retain(|f| f.req.is_some());
        r
    }

    /// `dmapp_gsync_test`: Ok once every implicit operation is done, NOT_DONE before.
    pub fn gsync_test(&mut self) -> Result<(), DmappError> {
        match self.nic.gsync_test() {
            Ok(false) => err(Rc::NotDone, "implicit operations still in flight"),
            done => {
                self.inflight.retain(|f| f.req.is_some());
                done.map(|_| ()).map_err(DmappError::from)
            }
        }
    }
}
