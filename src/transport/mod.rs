//! Per-peer reliable delivery over datagrams (pure state machine) and its drivers.
//!
//! [`reliable::Transport`] owns sequence numbers, acknowledgements, retransmission, the window,
//! duplicate suppression and peer liveness for every peer of one host. It does no I/O and reads
//! no clock: datagrams and the current time are fed in, datagrams to send are polled out. The
//! drivers ([`udp`], [`tcp`], [`packet`]) move those datagrams over sockets; [`sim`] moves them through a
//! seeded lossy network for tests.

pub mod fault;
pub mod iface;
mod lazy;
pub mod packet;
pub mod reliable;
mod segment;
pub mod sim;
pub mod tcp;
pub mod udp;

pub use reliable::{
    PushError, Received, Transport, TransportConfig, TransportEvent, TransportStats,
};

/// The socket layer under a host's transport: UDP (default), TCP, or raw Ethernet frames.
#[allow(clippy::large_enum_variant)] // one per host, built once, never moved on a hot path
pub enum Driver {
    Udp(udp::UdpDriver),
    Tcp(tcp::TcpDriver),
    Packet(packet::PacketDriver),
}

impl Driver {
    /// Which transport this driver is.
    pub fn kind(&self) -> crate::config::TransportKind {
        match self {
            Driver::Udp(_) => crate::config::TransportKind::Udp,
            Driver::Tcp(_) => crate::config::TransportKind::Tcp,
            Driver::Packet(_) => crate::config::TransportKind::Packet,
        }
    }

    pub fn send(&mut self, to: u16, bytes: &[u8]) {
        match self {
            Driver::Udp(d) => d.send(to, bytes),
            Driver::Tcp(d) => d.send(to, bytes),
            Driver::Packet(d) => d.send(to, bytes),
        }
    }

    /// Hands the next received datagram to `f` where the driver holds it (UDP batch, packet
    /// ring): `f` decrypts it in place, no copy on the way; `false` when none is waiting.
    pub fn recv_with(&mut self, f: &mut dyn FnMut(&mut [u8])) -> bool {
        match self {
            Driver::Udp(d) => d.recv_with(f),
            Driver::Tcp(d) => d.recv_with(f),
            Driver::Packet(d) => d.recv_with(f),
        }
    }

    /// Whether more received data is likely waiting (TCP: always ask, reads are buffered;
    /// packet: always ask, asking is a look at memory).
    pub fn bursting(&self) -> bool {
        match self {
            Driver::Udp(d) => d.bursting(),
            Driver::Tcp(_) | Driver::Packet(_) => true,
        }
    }

    /// Whether received datagrams are buffered in the driver (a batch read ahead).
    pub fn buffered(&self) -> bool {
        match self {
            Driver::Udp(d) => d.buffered(),
            Driver::Tcp(_) | Driver::Packet(_) => true,
        }
    }

    /// The caller knows the socket is empty without having asked: the next receive is not
    /// part of a burst.
    pub fn settled(&mut self) {
        if let Driver::Udp(d) = self {
            d.settled();
        }
    }

    /// Sends what [`Driver::send`] queued (UDP: one sendmmsg per peer; TCP: what the streams take).
    pub fn flush(&mut self) {
        match self {
            Driver::Udp(d) => d.flush(),
            Driver::Tcp(d) => d.flush(),
            Driver::Packet(d) => d.flush(),
        }
    }

    pub fn stats(&self) -> &udp::DriverStats {
        match self {
            Driver::Udp(d) => &d.stats,
            Driver::Tcp(d) => &d.stats,
            Driver::Packet(d) => &d.stats,
        }
    }
}
