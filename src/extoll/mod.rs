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
