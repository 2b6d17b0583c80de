//! The NIC engines: pure logic, no sockets, no threads, no clock.
//!
//! [`memory`] resolves (job, rank, region) to registered memory and checks every remote access;
//! [`gemini`] executes one-sided put/get and the 64-bit AMOs at the target and tracks the
//! initiator's outstanding operations; [`portals`] is the Portals 4 engine; [`host`] joins them
//! with the transport into one host's whole NIC, driven by the daemon or the simulation.

pub mod gemini;
pub mod host;
pub mod memory;
pub mod portals;
pub mod rma;
pub mod sim;
pub mod velo;
