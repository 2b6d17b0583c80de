//! MPI over Portals 4 (seed 003): point-to-point with short, eager-long and rendezvous
//! protocols and flow-control recovery, communicators, collectives, and MPI-3 one-sided
//! windows — a library in the rank making only `softnic::portals` calls; matching, placement,
//! atomics and acknowledgements happen in the soft NIC.
//!
//! ```no_run
//! use softnic::mpi::Mpi;
//! let world = Mpi::init().unwrap();
//! if world.rank() == 0 {
//!     world.send(b"hello", 1, 7).unwrap();
//! } else if world.rank() == 1 {
//!     let mut buf = [0u8; 5];
//!     world.recv(&mut buf, 0, 7).unwrap();
//! }
//! // Dropping `world` finalizes.
//! ```
//!
//! Environment: `SOFTNIC_MPI_EAGER_LIMIT` (bytes sent eagerly as SHORT, default 64 KiB),
//! `SOFTNIC_MPI_LONG=rendezvous|eager` (the protocol beyond it; rendezvous by default), `SOFTNIC_MPI_REGCACHE` (bytes
//! of user buffers kept registered), `SOFTNIC_MPI_SEND_STAGE` (bytes of the ring rendezvous
//! bodies in private memory are copied into for the NIC, default 4 MiB).

mod bits;
mod coll;
mod comm;
mod credit;
mod error;
mod flow;
mod loc;
mod mem;
mod stage;
mod state;
mod triggered;
mod win;

pub use self::coll::{Op, Type};
pub use self::comm::{wait_all, Comm, Request, ANY_SOURCE, ANY_TAG, TAG_UB, UNDEFINED};
pub use self::credit::FlowScheme;
pub use self::error::{ErrorClass, MpiError};
pub use self::loc::Loc;
pub use self::mem::AllocMem;
pub use self::state::{CollMode, LongProtocol, Stats, Status};
pub use self::win::{mode, LockType, RmaRequest, Win, WinInfo};

use crate::portals::Portals;

/// Messages up to this many bytes go eagerly as SHORT (copied through a bounce slot). From
/// the measured crossover: SHORT's copies beat the LONG protocols' registered user buffers at
/// every size up to the largest limit allowed (send/recv half round trip, 2 ranks, local
/// default: 64 KiB 47–58 µs SHORT vs 82 LONG, 256 KiB 165–172 vs 274–297), so the limit is
/// set by memory instead: 512 bounce slots of 64 KiB (32 MiB, touched as used) and 15
/// messages per 1 MiB overflow buffer.
pub const EAGER_LIMIT: usize = 64 * 1024;

/// The library's entry point.
pub struct Mpi;

impl Mpi {
    /// MPI_Init: attaches to this rank's NIC (rank and size from the job's bootstrap), opens
    /// the Portals interface and returns the world communicator. Collective.
    pub fn init() -> Result<Comm, MpiError> {
        let p = Portals::init()?;
        Self::init_on(p)
    }

    /// MPI_Init on a Portals library another API already attached.
    pub fn init_on(p: Portals) -> Result<Comm, MpiError> {
        let st = state::State::open(p)?;
        let world = Comm::world(st);
        // Every rank's portals exist before anyone sends (a message to a rank still opening
        // would find no entry).
        world
            .st
            .borrow_mut()
            .p
            .endpoint()
            .barrier()
            .map_err(|e| MpiError::new(ErrorClass::Other, format!("MPI_Init's barrier: {e}")))?;
        Ok(world)
    }
}
