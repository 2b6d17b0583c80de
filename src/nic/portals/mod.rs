//! The Portals 4 engine of the soft NIC (pure): the portal table, priority and overflow match
//! lists, the unexpected header list, locally and remotely managed offsets, full and counting
//! events, atomics over every datatype, and flow control by disabling a portal table entry.
//!
//! Matching happens here, in the NIC, as on an offloading NIC: the target process takes no
//! part in matching, data placement or events. Names and semantics follow the Portals 4.x
//! specification; see [`ni::PortalsNi`] for delivery and [`atomic`] for the atomic operations.

pub mod atomic;
pub mod events;
pub mod initiator;
pub mod matching;
pub mod ni;
pub mod triggered;
pub mod types;
pub mod wire;

pub use events::{Consumed, CtEvent, EventQueue, Limits};
pub use initiator::{AckReq, OpSpec};
pub use matching::{MatchEntry, ReqKind};
pub use ni::{GetStream, PortalsNi, PutStream, Request, Response};
pub use triggered::TriggeredAction;
pub use types::{Event, EventKind, List, NiFail, ProcessId, PtlError, SearchOp, StatusRegister};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod tests_initiator;
