//! Conduits: how Active Messages (and, where the network can, puts and gets) move between
//! nodes. The GASNet layer above is the same for all of them.

pub mod extoll;
pub mod portals;
mod staging;
pub mod udp;

use super::{AdOp, GasnetError};

/// Buffers of delivered AMs, back from the Core ([`Conduit::recycle`]) for the next arrivals,
/// so a conduit allocates no buffer per AM.
#[derive(Default)]
pub(crate) struct BufPool(Vec<Vec<u8>>);

impl BufPool {
    /// An empty buffer: one given back, if any.
    pub fn take(&mut self) -> Vec<u8> {
        let mut b = self.0.pop().unwrap_or_default();
        b.clear();
        b
    }

    /// Keeps `b` for reuse (at most 256 buffers, none over 64 KiB).
    pub fn give(&mut self, b: Vec<u8>) {
        if self.0.len() < 256 && b.capacity() <= 1 << 16 {
            self.0.push(b);
        }
    }
}

/// Where the data of a direct get goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetDest {
    /// This node's segment, at an offset.
    Segment(u64),
    /// The caller's buffer at this address, of the get's length: the conduit fills it. The
    /// caller keeps it valid and does not touch it until the operation completes, or until it
    /// gives the operation up with [`Conduit::abandon`].
    Local(u64),
}

/// A direct put or get that finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RmaDone {
    pub op: u64,
    pub ok: bool,
    pub data: Vec<u8>,
}

/// How the registration cache for local memory outside the segment went on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FirehoseStats {
    pub hits: u64,
    pub misses: u64,
    /// Idle registrations released for the budget.
    pub evicted: u64,
    /// Idle registrations merged into a new, larger one.
    pub coalesced: u64,
}

/// How Active Message flow control went on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlowStats {
    /// Requests that waited for credit (once per wait).
    pub credit_stalls: u64,
    /// Requests that asked their target for a credit loan.
    pub loans_asked: u64,
    /// Loans this node granted as a target.
    pub loans_granted: u64,
    /// Loans this node gave back.
    pub loans_repaid: u64,
    /// Requests that found no receive buffer at this node (caught by the catch-basin).
    pub caught: u64,
    /// Requests this node sent again because their target caught them.
    pub resent: u64,
    /// Flow-control fields from peers that broke the protocol (ignored).
    pub protocol_errors: u64,
}

pub trait Conduit {
    fn node(&self) -> u32;
    fn nodes(&self) -> u32;
    /// Largest encoded AM one send takes.
    fn max_am(&self) -> usize;
    /// This node's segment (memory the network can reach, where the conduit needs that).
    fn segment(&mut self) -> &mut [u8];
    /// A registered area beside the segment that the Extended API's Long get replies may
    /// land in when the caller's buffer is not in the segment (one copy out, instead of
    /// Medium replies): the offset from which AMs name it, on every node alike, and its
    /// length. Only the Extended API addresses it; `None`: no such area.
    fn landing(&self) -> Option<(u64, usize)> {
        None
    }
    /// The landing area's bytes (empty without one).
    fn landing_bytes(&mut self) -> &mut [u8] {
        &mut []
    }
    /// Sends a request to `dest` (itself included): the encoded AM and, for a Long, its
    /// payload for `dest`'s segment (packed behind the header, or put in place first where the
    /// network can). `Ok(false)`: no room for it now (credit, send buffers) and nothing was
    /// sent — the Core runs handlers and tries again, as GASNet lets AMRequest poll.
    fn request(&mut self, dest: u32, am: &[u8], long: Option<&[u8]>) -> Result<bool, GasnetError>;
    /// Answers the request from `dest` that [`Conduit::poll`] delivered with `reply_to`: the
    /// handler's reply (encoded, and a Long's payload), or `None` when the handler sent none —
    /// a conduit that must answer every request then sends its implicit reply. Waits for room
    /// making progress, and runs no handler.
    fn reply(
        &mut self,
        dest: u32,
        reply_to: u64,
        reply: Option<(&[u8], Option<&[u8]>)>,
    ) -> Result<(), GasnetError>;
    /// Largest Long payload (AMMaxLongRequest/Reply): by default what one AM carries.
    fn max_long(&self) -> usize {
        self.max_am()
            .saturating_sub(super::am::encoded_len(super::am::MAX_ARGS, 0))
    }
    /// Makes progress; hands each arrived AM (owned) to `deliver` (source, what [`Conduit::reply`]
    /// needs to answer it, the AM) in arrival order, and each finished direct operation to
    /// `done`. Returns whether anything happened.
    fn poll(
        &mut self,
        deliver: &mut dyn FnMut(u32, u64, Vec<u8>),
        done: &mut dyn FnMut(RmaDone),
    ) -> Result<bool, GasnetError>;
    /// Takes back a buffer [`Conduit::poll`] delivered, once handled, for reuse (a conduit
    /// without a pool drops it).
    fn recycle(&mut self, _b: Vec<u8>) {}
    /// The conduit's name (`udp`, `portals`, …).
    fn name(&self) -> &'static str;
    /// AM flow-control counters (conduits without credits of their own report zeros).
    fn flow_stats(&self) -> FlowStats {
        FlowStats::default()
    }
    /// Registration-cache counters (conduits without one report zeros).
    fn firehose_stats(&self) -> FirehoseStats {
        FirehoseStats::default()
    }
    /// Blocks until something may have arrived for [`Conduit::poll`], or `max` passed, or the
    /// conduit has timers due. Returns at once when news is already there.
    fn wait_news(&mut self, max: std::time::Duration) -> Result<(), GasnetError>;
    /// Whether Active Messages this node sent are not yet in their targets' hands (not
    /// acknowledged, or waiting to be sent again): a process that leaves waits for them, or a
    /// node still waiting for one (a barrier's release) would wait for ever.
    fn outgoing(&self) -> bool {
        false
    }
    /// Gives the core away for a moment in a wait (a NIC daemon learns that we wait on it).
    fn yield_now(&mut self) {
        std::thread::yield_now();
    }
    /// For a wait past its first polls: whether to keep spinning rather than yield, because
    /// the message due next is ours (see `shm::control::Waiter::keep_core`).
    fn keep_core(&mut self) -> bool {
        false
    }
    /// For a wait that outlasts its first spin: whether we run on another core than a pinned
    /// NIC's (moving off it if we are on it), so that waiting costs the NIC nothing.
    fn off_nic_core(&mut self) -> bool {
        false
    }
    /// Whether a blocking put, get or atomic completes in the NICs alone, without the target
    /// process: only then may a wait for one of them spin on (nobody it waits for needs the
    /// core). Conduits that carry them as Active Messages say no.
    fn one_sided(&self) -> bool {
        false
    }
    /// A put straight through the network (completion later as `RmaDone { op }`); `Ok(false)`
    /// when the conduit has none, and the Extended layer uses Active Messages instead.
    /// `bulk`: the caller leaves `src` unchanged until completion; otherwise it may reuse `src`
    /// as soon as this returns (GASNet's bulk and non-bulk rules).
    fn rma_put(
        &mut self,
        _node: u32,
        _dest_offset: u64,
        _src: &[u8],
        _op: u64,
        _bulk: bool,
    ) -> Result<bool, GasnetError> {
        Ok(false)
    }
    /// The caller stops waiting for direct operation `op` (an error ended its wait): nothing
    /// may be written into its local buffer any more.
    fn abandon(&mut self, _op: u64) {}
    /// A get straight through the network; `Ok(false)` as for [`Conduit::rma_put`].
    fn rma_get(
        &mut self,
        _node: u32,
        _src_offset: u64,
        _len: usize,
        _dest: GetDest,
        _op: u64,
    ) -> Result<bool, GasnetError> {
        Ok(false)
    }
    /// A 64-bit atomic on the word at `offset` of `node`'s segment, run by the network without
    /// the target process (completion as `RmaDone { op }`, whose `data` holds the prior value
    /// for fetching operations); `Ok(false)` when the conduit has none, and the Extended layer
    /// runs it in an Active Message handler at the target instead.
    fn rma_atomic(
        &mut self,
        _node: u32,
        _offset: u64,
        _atomic: AdOp,
        _operands: [u64; 2],
        _op: u64,
    ) -> Result<bool, GasnetError> {
        Ok(false)
    }
    /// A non-fetching 64-bit atomic that belongs to the implicit puts and has no operation of
    /// its own: the network counts its completion (no per-operation state or event), and
    /// [`Conduit::implicit_done`] reports when all such have completed. `Ok(false)` when the
    /// conduit has no such path, and the Extended layer tracks it as an operation.
    fn atomic_implicit(
        &mut self,
        _node: u32,
        _offset: u64,
        _atomic: AdOp,
        _operands: [u64; 2],
    ) -> Result<bool, GasnetError> {
        Ok(false)
    }
    /// Whether every [`Conduit::atomic_implicit`] so far has completed. Failures among them
    /// are reported once, as an error, by the call that first sees them.
    fn implicit_done(&mut self) -> Result<bool, GasnetError> {
        Ok(true)
    }
}
