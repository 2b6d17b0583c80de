//! EXTOLL from Rust (seed 004: the GASNet EXTOLL conduit's two engines): [`velo`] for small
//! messages into a receiver's mailbox, [`rma`] for puts and gets with notifications.
//!
//! A process uses both through one attachment to its NIC: open the first with `open()`, the
//! second on the first's endpoint (`open_on(velo.endpoint())`).

pub mod rma;
pub mod velo;

use std::cell::RefCell;
use std::rc::Rc;

use crate::client::Endpoint;

/// An endpoint shared by the EXTOLL engines of one process.
pub type Shared = Rc<RefCell<Endpoint>>;

/// A connection to a rank of the job: where its NIC is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conn {
    pub rank: u32,
    pub(crate) host: u16,
}
