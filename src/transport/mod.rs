//! Per-peer reliable delivery over datagrams (pure state machine) and its drivers.
//!
//! [`reliable::Transport`] owns sequence numbers, acknowledgements, retransmission, the window,
//! duplicate suppression and peer liveness for every peer of one host. It does no I/O and reads
//! no clock: datagrams and the current time are fed in, datagrams to send are polled out. The
//! drivers ([`udp`], [`tcp`]) move those datagrams over sockets; [`sim`] moves them through a
//! seeded lossy network for tests.

pub mod reliable;
pub mod sim;
pub mod tcp;
pub mod udp;

pub use reliable::{
    PushError, Received, Transport, TransportConfig, TransportEvent, TransportStats,
};
