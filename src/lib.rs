//! softnic: HPC one-sided networking made real on commodity Ethernet.
//!
//! See DESIGN.md (shared) for the map; each module's doc says what it owns.

pub mod client;
pub mod config;
pub mod daemon;
pub mod dmapp;
pub mod extoll;
pub mod gasnet;
pub mod gni;
pub mod job;
pub mod keys;
pub mod logging;
pub mod mpi;
pub mod nic;
pub mod phase_trace;
pub mod portals;
pub mod shm;
pub mod transport;
pub mod wire;
