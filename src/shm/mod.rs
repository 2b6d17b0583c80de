//! Everything between a client process and its daemon after attach: sealed memfd mappings,
//! the control block (SPSC command ring client→NIC, completion queue NIC→client, sleep flags),
//! eventfd doorbells, the attach messages carried over the UNIX socket, and who runs on which
//! core.

pub mod attach;
pub mod control;
pub mod cores;
pub mod event_ring;
pub mod mapping;
pub mod process_memory;
pub mod ptl_call;

pub use control::{
    Command, CommandKind, Control, ControlError, CqEntry, FailedOp, PeerFailure, CMD_IMPLICIT,
    CMD_LAND, CMD_LAZY,
};
pub use mapping::Mapping;
