//! GASNet over the soft NIC: the Core API (Active Messages) and the Extended API (put/get,
//! non-blocking with explicit and implicit handles, memset, split-phase barrier), over a conduit
//! chosen at run time (`SOFTNIC_CONDUIT`, or `GASNET_CONDUIT`).
//!
//! Addresses are offsets into each node's segment (`GASNET_SEGMENT_SIZE` / `SOFTNIC_SEGMENT`
//! bytes, default 64 MiB); local buffers may be anywhere. Conduits available: `udp` (no daemon:
//! each process runs its own reliable delivery, as GASNet's udp-conduit does).

pub mod am;
pub mod atomic;
mod backoff;
pub mod conduit;
mod core;
mod extended;

pub use self::am::Category;
pub use self::atomic::AdOp;
pub use self::conduit::{FirehoseStats, FlowStats};
pub use self::core::{Handler, Msg, Token, HANDLER_USER_MIN};
pub use self::extended::{BarrierFlags, Handle};

use std::cell::RefCell;
use std::rc::Rc;

use self::conduit::Conduit;
use self::core::Core;
use self::extended::ExtState;
use crate::job::{JobError, JobInfo};

#[derive(Debug, thiserror::Error)]
pub enum GasnetError {
    #[error(transparent)]
    Job(#[from] JobError),
    #[error("GASNet setup failed: {0}")]
    Setup(String),
    #[error("unknown conduit {0:?}: available: portals, extoll, udp")]
    UnknownConduit(String),
    #[error("node {0} is not in this job")]
    BadNode(u32),
    #[error("node {0} stopped answering")]
    NodeDead(u32),
    #[error("handler index {0} is not registered (clients use 128..=255)")]
    BadHandler(u8),
    #[error("{0} arguments: at most 16")]
    TooManyArgs(usize),
    #[error("payload of {0} bytes exceeds the AM maximum for this conduit")]
    TooLarge(usize),
    #[error("a transfer of {0} bytes is more than this conduit moves in one operation")]
    TransferTooLarge(usize),
    #[error("handler rule broken: {0}")]
    HandlerRule(&'static str),
    #[error("segment range [{0}, +{1}) lies outside the segment")]
    OutOfSegment(u64, u64),
    #[error("barrier mismatch: nodes notified with different ids (GASNET_ERR_BARRIER_MISMATCH)")]
    BarrierMismatch,
    #[error("barrier_wait/try without a matching barrier_notify (or with another id)")]
    BarrierState,
    #[error("atomic on offset {0}: remote atomics need an 8-byte aligned word")]
    Misaligned(u64),
    #[error("a fetching atomic needs somewhere to put its result: use ad_op, not ad_op_nbi")]
    FetchingNbi,
    #[error("unknown or already synchronised handle")]
    BadHandle,
    #[error("the conduit failed while waiting: {0}")]
    Wait(String),
}

/// A node's GASNet: attach once per process.
pub struct Gasnet {
    pub(crate) core: Core,
    pub(crate) ext: Rc<RefCell<ExtState>>,
}

/// Longest a leaving process keeps delivering what it sent (a target may be gone).
const EXIT_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

impl Drop for Gasnet {
    /// Like gasnet_exit, a leaving node first gets its Active Messages delivered, running
    /// handlers meanwhile: node 0 leaves a barrier as soon as it sent the release to the
    /// others, and a release that was refused and waits to be sent again would die with it.
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let start = std::time::Instant::now();
        let waited = self.wait_with(backoff::Backoff::default(), |g| {
            !g.core.conduit.outgoing() || start.elapsed() > EXIT_DRAIN
        });
        if waited.is_err() || self.core.conduit.outgoing() {
            tracing::warn!("leaving with Active Messages undelivered");
        }
    }
}

/// A size from the first of `names` that is set (a count; k/m/g suffixes as GASNet reads
/// them). A value that does not parse counts as unset.
pub(crate) fn env_size(names: &[&str]) -> Option<usize> {
    let v = names.iter().find_map(|n| std::env::var(n).ok())?;
    usize::try_from(crate::config::parse_size(&v)?).ok()
}

/// The segment size from `SOFTNIC_SEGMENT` or `GASNET_SEGMENT_SIZE` (bytes; k/m/g suffixes).
fn segment_from_env() -> usize {
    env_size(&["SOFTNIC_SEGMENT", "GASNET_SEGMENT_SIZE"]).unwrap_or(64 << 20)
}

impl Gasnet {
    /// gasnet_init + gasnet_attach: joins the job, opens the conduit, registers `handlers`
    /// (indices 128..=255), allocates the segment, and synchronises all nodes.
    pub fn init(handlers: Vec<(u8, Handler)>) -> Result<Gasnet, GasnetError> {
        let job = JobInfo::from_env()?;
        let name = std::env::var("SOFTNIC_CONDUIT")
            .or_else(|_| std::env::var("GASNET_CONDUIT"))
            .unwrap_or_else(|_| "udp".into());
        let conduit: Box<dyn Conduit> = match name.as_str() {
            "udp" => Box::new(conduit::udp::UdpConduit::new(&job, segment_from_env())?),
            "portals" => Box::new(conduit::portals::PortalsConduit::new(segment_from_env())?),
            "extoll" => Box::new(conduit::extoll::ExtollConduit::new(segment_from_env())?),
            other => return Err(GasnetError::UnknownConduit(other.into())),
        };
        Self::attach(conduit, handlers)
    }

    /// Attaches over a given conduit.
    pub fn attach(
        conduit: Box<dyn Conduit>,
        handlers: Vec<(u8, Handler)>,
    ) -> Result<Gasnet, GasnetError> {
        let mut core = Core::new(conduit);
        for (i, h) in handlers {
            if i < HANDLER_USER_MIN {
                return Err(GasnetError::BadHandler(i));
            }
            core.register(i, h)?;
        }
        let ext = Rc::new(RefCell::new(ExtState::default()));
        extended::register_handlers(&mut core, &ext)?;
        let mut g = Gasnet { core, ext };
        g.barrier()?;
        Ok(g)
    }

    pub fn mynode(&self) -> u32 {
        self.core.conduit.node()
    }

    pub fn nodes(&self) -> u32 {
        self.core.conduit.nodes()
    }

    pub fn conduit_name(&self) -> &'static str {
        self.core.conduit.name()
    }

    /// This node's segment.
    pub fn segment(&mut self) -> &mut [u8] {
        self.core.conduit.segment()
    }

    pub fn am_max_args(&self) -> usize {
        am::MAX_ARGS
    }

    pub fn am_max_medium(&self) -> usize {
        self.core.max_payload(am::MAX_ARGS)
    }

    pub fn am_max_long_request(&self) -> usize {
        self.core.conduit.max_long()
    }

    pub fn am_max_long_reply(&self) -> usize {
        self.core.conduit.max_long()
    }

    /// gasnet_AMRequestShortM.
    pub fn am_request_short(
        &mut self,
        dest: u32,
        handler: u8,
        args: &[u32],
    ) -> Result<(), GasnetError> {
        self.core
            .request(dest, handler, Category::Short, args, &[], 0)
    }

    /// gasnet_AMRequestMediumM: `payload` is copied; the handler gets it as a buffer.
    pub fn am_request_medium(
        &mut self,
        dest: u32,
        handler: u8,
        payload: &[u8],
        args: &[u32],
    ) -> Result<(), GasnetError> {
        self.core
            .request(dest, handler, Category::Medium, args, payload, 0)
    }

    /// gasnet_AMRequestLongM: `payload` lands in `dest`'s segment at `dest_offset` before the
    /// handler runs there.
    pub fn am_request_long(
        &mut self,
        dest: u32,
        handler: u8,
        payload: &[u8],
        dest_offset: u64,
        args: &[u32],
    ) -> Result<(), GasnetError> {
        self.core
            .request(dest, handler, Category::Long, args, payload, dest_offset)
    }

    /// gasnet_AMRequestLongAsyncM: as Long; the payload is copied at once, so the source may be
    /// reused immediately (stronger than GASNet requires).
    pub fn am_request_long_async(
        &mut self,
        dest: u32,
        handler: u8,
        payload: &[u8],
        dest_offset: u64,
        args: &[u32],
    ) -> Result<(), GasnetError> {
        self.am_request_long(dest, handler, payload, dest_offset, args)
    }

    /// gasnet_AMPoll.
    pub fn am_poll(&mut self) -> Result<(), GasnetError> {
        self.poll_once().map(|_| ())
    }

    /// One round of progress: handlers run, finished direct operations are accounted.
    pub(crate) fn poll_once(&mut self) -> Result<bool, GasnetError> {
        let any = self.core.poll()?;
        self.account_rma();
        Ok(any)
    }

    /// GASNET_BLOCKUNTIL: polls (running handlers) until `cond` holds.
    pub fn block_until(&mut self, mut cond: impl FnMut() -> bool) -> Result<(), GasnetError> {
        self.wait_with(backoff::Backoff::default(), |_| cond())
    }

    /// Like [`Gasnet::block_until`], for a condition that one operation through the network
    /// moving `bytes` makes true (it may spin longer: see `backoff`).
    pub(crate) fn block_until_op(
        &mut self,
        bytes: usize,
        mut cond: impl FnMut() -> bool,
    ) -> Result<(), GasnetError> {
        self.wait_with(backoff::Backoff::one_op(bytes), |_| cond())
    }

    /// Polls (running handlers), backing off as `b` says, until `cond` holds.
    fn wait_with(
        &mut self,
        mut b: backoff::Backoff,
        mut cond: impl FnMut(&Self) -> bool,
    ) -> Result<(), GasnetError> {
        while !cond(self) {
            if self.poll_once()? {
                b.progressed();
            } else {
                b.idle(self.core.conduit.as_mut())?;
            }
        }
        Ok(())
    }

    /// How Active Message flow control went on this node (credits, loans, the catch-basin).
    pub fn flow_stats(&self) -> FlowStats {
        self.core.conduit.flow_stats()
    }

    /// How the registration cache for large local buffers outside the segment went.
    pub fn firehose_stats(&self) -> FirehoseStats {
        self.core.conduit.firehose_stats()
    }

    /// Active Messages this node sent (requests and replies).
    pub fn am_sent(&self) -> u64 {
        self.core.sent
    }

    /// Messages dropped as malformed, out of segment, or to unregistered handlers.
    pub fn dropped(&self) -> u64 {
        self.core.dropped
    }
}
