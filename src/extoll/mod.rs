//! EXTOLL from Rust (seed 004: the GASNet EXTOLL conduit's two engines): [`velo`] for small
//! messages into a receiver's mailbox, [`rma`] for puts and gets with notifications.
//!
//! A process uses both through one attachment to its NIC: open the first with `open()`, the
//! second on the first's endpoint (`open_on(velo.endpoint())`).

pub mod rma;
pub mod velo;

use std::cell::RefCell;
use std::rc::Rc;

use crate::client::{Endpoint, MemRegion, NicError};
use crate::nic::memory::Perms;
use crate::shm::Command;
use crate::wire::Status;

/// An endpoint shared by the EXTOLL engines of one process.
pub type Shared = Rc<RefCell<Endpoint>>;

/// A connection to a rank of the job: where its NIC is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conn {
    pub rank: u32,
    pub(crate) host: u16,
}

impl Conn {
    /// A connection to `rank` of the job `ep` belongs to; `None` if it has no such rank.
    pub(crate) fn to(ep: &Shared, rank: u32) -> Option<Conn> {
        let host = ep.borrow().rank_host(rank).ok()?;
        Some(Conn { rank, host })
    }
}

/// A number from the environment, `default` when unset or not a number.
pub(crate) fn env_num<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// Why a port did not open.
#[derive(Debug)]
pub(crate) enum PortError {
    Nic(NicError),
    /// The NIC refused the command (a port of that kind is open already, a bad geometry).
    Refused(Status),
}

impl From<NicError> for PortError {
    fn from(e: NicError) -> PortError {
        PortError::Nic(e)
    }
}

/// Registers a port's ring of `len` bytes (no remote access: only the NIC writes it), opens
/// the port with `cmd` naming it, then waits for every rank (opening is collective).
pub(crate) fn open_port(ep: &Shared, len: usize, mut cmd: Command) -> Result<MemRegion, PortError> {
    let mut e = ep.borrow_mut();
    let ring = e.mem_register(len, Perms(0))?;
    cmd.local_region = ring.handle.0;
    let (status, _) = e.call_raw(cmd, &[])?;
    if status != Status::Ok as u32 {
        return Err(PortError::Refused(Status::from_u32(status)));
    }
    e.barrier()?;
    Ok(ring)
}
