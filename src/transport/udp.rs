//! UDP driver: a bound socket per host that receives, a connected socket per peer that sends
//! (a connected send skips the per-datagram route lookup: ~0.6 µs of a ~3.7 µs loopback hop
//! here), sized buffers, adaptive batching, and optional seeded
//! fault injection (drop/duplicate on send) for tests of the reliability layer through real
//! sockets. Peers are identified by the authenticated datagram header, never by source address.
//!
//! Batching is adaptive because it is not free: measured here, `sendmmsg`/`recvmmsg` of a single
//! datagram cost ~1 µs more per hop than `send`/`recv`. So the datagrams a turn queues for a
//! peer leave in one `sendmmsg` only when there are several (else one `send`), and receiving
//! uses plain `recv` until two datagrams in a row show a burst, then `recvmmsg` (32 per call)
//! until the socket runs dry. Up to jumbo frames (`SEGMENTING_MAX`) runs of equal-sized
//! datagrams in a batch leave as one GSO send and arrive joined (see `transport::segment`).

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use socket2::{Domain, Protocol, Socket, Type};

use super::fault::FaultInjector;
use crate::config::Fault;
use crate::phase_trace::{self, Phase};

/// Datagrams per recvmmsg/sendmmsg call.
const BATCH: usize = 32;
/// Receive buffer per datagram: the largest UDP payload fits.
const RX_SLOT: usize = 65_536;

/// Counters of what the fault injector and the socket did.
#[derive(Debug, Default, Clone)]
pub struct DriverStats {
    pub fault_dropped: u64,
    pub fault_duplicated: u64,
    pub send_would_block: u64,
    pub send_errors: u64,
    pub send_syscalls: u64,
    pub recv_syscalls: u64,
    /// Sends that carried several datagrams for the kernel to cut (UDP GSO).
    pub gso_sends: u64,
    /// Datagrams that arrived joined to the one before them (UDP GRO).
    pub gro_joined: u64,
    /// Received frames skipped as malformed or too long (packet driver; TCP: a frame longer
    /// than any datagram, or a connection's hello that is not a peer's; either closes it).
    pub rx_bad_frames: u64,
    /// TCP connections closed as soon as accepted: more were open than peers could need.
    pub refused_connections: u64,
}

/// Datagrams waiting to be sent to one peer in one `sendmmsg`.
#[derive(Default)]
struct TxBatch {
    data: Vec<u8>,
    lens: Vec<usize>,
}

/// Socket buffers big enough for a full window: as root past `rmem_max`/`wmem_max`
/// (SO_RCVBUFFORCE), else as large as the kernel allows.
fn size_buffers(s: &Socket) {
    const WANT: libc::c_int = 8 << 20;
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        // SAFETY: setsockopt with a valid socket and an int option value.
        let forced = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                force,
                &WANT as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as u32,
            )
        } == 0;
        if !forced {
            // SAFETY: as above; the kernel caps the value at its maximum.
            unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    plain,
                    &WANT as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as u32,
                );
            }
        }
    }
}

/// Sends the datagrams `lens` cuts `data` into on `fd`: one `send`, or `sendmmsg` for several
/// (a single datagram goes ~1 µs faster alone), runs of equal sizes as one GSO message each
/// while `*gso` (see [`super::segment`]). On an error, how many were not sent.
pub(super) fn send_all(
    fd: std::os::fd::RawFd,
    data: &mut [u8],
    lens: &[usize],
    gso: &mut bool,
    stats: &mut DriverStats,
) -> Result<(), (io::Error, usize)> {
    if lens.is_empty() {
        // An idle turn's flush: nothing to set up.
        return Ok(());
    }
    phase_trace::stamp(Phase::SendStart);
    let r = send_batch(fd, data, lens, gso, stats);
    phase_trace::stamp(Phase::SendEnd);
    r
}

/// [`send_all`]'s work, between its phase stamps.
fn send_batch(
    fd: std::os::fd::RawFd,
    data: &mut [u8],
    lens: &[usize],
    gso: &mut bool,
    stats: &mut DriverStats,
) -> Result<(), (io::Error, usize)> {
    if lens.len() == 1 {
        stats.send_syscalls += 1;
        // SAFETY: `data[..lens[0]]` is a live buffer for the call.
        let r = unsafe { libc::send(fd, data.as_ptr() as *const _, lens[0], libc::MSG_DONTWAIT) };
        return if r < 0 {
            Err((io::Error::last_os_error(), 1))
        } else {
            Ok(())
        };
    }
    super::segment::send(
        fd,
        data,
        lens,
        gso,
        BATCH,
        &mut stats.send_syscalls,
        &mut stats.gso_sends,
    )
}

/// The largest datagram size at which a driver batches datagrams and has the kernel cut and
/// join runs of them (UDP GSO/GRO). Two namespaces over a veth pair, two daemons, gni put_nbi
/// 1 MiB: 1472-byte datagrams 0.38 → 2.5–2.8 GB/s, 8972-byte (jumbo) 2.0 → 5.3–5.7.
pub(super) const SEGMENTING_MAX: usize = 16_384;

/// Counts `lost` datagrams a send refused: a full buffer, or another error.
/// Datagrams at least this long leave at once from the caller's buffer instead of being copied
/// into a batch.
pub(super) const DIRECT_MIN: usize = 8192;

/// Sends one datagram gathered from `parts` (`sendmsg`, no copy in user space).
pub(super) fn send_iov(
    fd: std::os::fd::RawFd,
    parts: &[&[u8]],
    stats: &mut DriverStats,
) -> Result<(), io::Error> {
    let mut iov: [libc::iovec; 2] = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; 2];
    let n = parts.len().min(2);
    for (v, p) in iov.iter_mut().zip(parts) {
        *v = libc::iovec {
            iov_base: p.as_ptr() as *mut _,
            iov_len: p.len(),
        };
    }
    // SAFETY: an all-zero msghdr is valid; it points at `iov`, which points at live slices
    // the kernel only reads.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = n;
    phase_trace::stamp(Phase::SendStart);
    let r = loop {
        stats.send_syscalls += 1;
        // SAFETY: as above, for the duration of the call.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT) };
        if r >= 0 {
            break Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            break Err(e);
        }
    };
    phase_trace::stamp(Phase::SendEnd);
    r
}

pub(super) fn count_send_error(stats: &mut DriverStats, e: &io::Error, lost: usize) {
    if e.kind() == io::ErrorKind::WouldBlock {
        stats.send_would_block += lost as u64;
    } else {
        stats.send_errors += lost as u64;
    }
}

pub struct UdpDriver {
    sock: mio::net::UdpSocket,
    senders: Vec<Option<std::net::UdpSocket>>,
    tx: Vec<TxBatch>,
    rx: Vec<u8>,
    rx_lens: [usize; BATCH],
    /// The size the datagrams in each receive slot were joined at (UDP GRO; the slot's length
    /// when it holds one).
    rx_segs: [usize; BATCH],
    rx_count: usize,
    rx_next: usize,
    /// Where the next datagram starts in slot `rx_next`.
    rx_off: usize,
    /// Runs of equal-sized datagrams leave as one GSO send (until the kernel refuses one).
    gso: bool,
    /// The receiving socket takes datagrams joined (UDP GRO).
    gro: bool,
    /// Consecutive successful receives: a burst is under way.
    streak: u32,
    fault: Option<FaultInjector>,
    pub stats: DriverStats,
}

impl UdpDriver {
    /// Binds `addr` (pinned to interface `device`, if given) and opens a sending socket to
    /// each peer's address; `mtu` is the largest datagram the transport sends.
    pub fn bind(
        addr: SocketAddr,
        device: Option<&str>,
        peers: Vec<SocketAddr>,
        fault: Option<Fault>,
        mtu: usize,
    ) -> io::Result<UdpDriver> {
        let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        // No SO_REUSEADDR: on a UDP socket it lets a second socket bind the same address, which
        // then takes every datagram sent there. Two jobs or local clusters that chose the same
        // port would both start, and one would hear nothing; a bind must fail instead (the
        // local default then picks another port). A UDP port is free again the moment its
        // socket closes, so a restarted daemon needs no reuse either.
        super::iface::pin(&s, device)?;
        // Room for a full window of datagrams in flight; the kernel caps it at rmem_max.
        size_buffers(&s);
        s.set_nonblocking(true)?;
        s.bind(&addr.into())?;
        let senders = peers
            .iter()
            .map(|&p| {
                if p == addr {
                    return Ok(None);
                }
                let t = Socket::new(Domain::for_address(p), Type::DGRAM, Some(Protocol::UDP))?;
                for size in [8 << 20, 4 << 20, 1 << 20] {
                    if t.set_send_buffer_size(size).is_ok() {
                        break;
                    }
                }
                super::iface::pin(&t, device)?;
                t.bind(&SocketAddr::new(addr.ip(), 0).into())?;
                t.connect(&p.into())?;
                t.set_nonblocking(true)?;
                Ok(Some(t.into()))
            })
            .collect::<io::Result<Vec<_>>>()?;
        let ip = match addr.ip() {
            std::net::IpAddr::V4(v) => u32::from_be_bytes(v.octets()) as u64,
            std::net::IpAddr::V6(_) => 0,
        };
        let fault = FaultInjector::new(fault, addr.port() as u64 ^ ip);
        // Up to jumbo frames (and a little beyond: four datagrams or more per GSO send)
        // datagrams are batched and runs of them cut and joined by the kernel. Above, as on
        // loopback's 65,000 B, each leaves alone from the caller's buffer and the receive path
        // stays a plain `recv`, ~0.1 µs cheaper per datagram than `recvmsg` with a control
        // message (measured here).
        let segmenting = mtu <= SEGMENTING_MAX;
        let gro = segmenting && super::segment::enable_gro(s.as_raw_fd());
        Ok(UdpDriver {
            sock: mio::net::UdpSocket::from_std(s.into()),
            tx: senders.iter().map(|_| TxBatch::default()).collect(),
            senders,
            rx: vec![0; BATCH * RX_SLOT],
            rx_lens: [0; BATCH],
            rx_segs: [0; BATCH],
            rx_count: 0,
            rx_next: 0,
            rx_off: 0,
            gso: segmenting,
            gro,
            streak: 0,
            fault,
            stats: DriverStats::default(),
        })
    }

    /// Bytes the receive socket buffer holds (what the kernel granted).
    pub fn recv_buffer(&self) -> usize {
        socket2::SockRef::from(&self.sock)
            .recv_buffer_size()
            .unwrap_or(212_992)
    }

    pub fn socket(&mut self) -> &mut mio::net::UdpSocket {
        &mut self.sock
    }

    /// Queues one datagram for host `to`; it leaves at the next [`UdpDriver::flush`].
    pub fn send(&mut self, to: u16, bytes: &[u8]) {
        let Some(b) = self.tx.get_mut(to as usize) else {
            return;
        };
        if self.senders[to as usize].is_none() {
            return;
        }
        let copies = self.fault.as_mut().map_or(1, |f| f.copies(&mut self.stats));
        // A path MTU probe (`softnic doctor`) must cross the path as a datagram of its own:
        // a GSO send over veth carries segments past a smaller MTU that would stop them on
        // a wire.
        let probe = crate::wire::DatagramHeader::is_probe(bytes);
        if probe || (bytes.len() >= DIRECT_MIN && !self.gso) {
            // Copying a large datagram into the batch costs more than the system call it
            // would share, unless the kernel cuts the batch (GSO): send what is queued
            // (order), then this one from where it lies.
            self.flush_peer(to as usize);
            let Some(sock) = &self.senders[to as usize] else {
                return;
            };
            for _ in 0..copies {
                if let Err(e) = send_iov(sock.as_raw_fd(), &[bytes], &mut self.stats) {
                    count_send_error(&mut self.stats, &e, 1);
                }
            }
            return;
        }
        for _ in 0..copies {
            b.data.extend_from_slice(bytes);
            b.lens.push(bytes.len());
        }
        if b.lens.len() >= BATCH {
            self.flush_peer(to as usize);
        }
    }

    /// Sends every queued datagram, a `sendmmsg` per peer. A full socket buffer counts as loss:
    /// the transport retransmits, exactly as for a drop on the wire.
    pub fn flush(&mut self) {
        for i in 0..self.tx.len() {
            if !self.tx[i].lens.is_empty() {
                self.flush_peer(i);
            }
        }
    }

    fn flush_peer(&mut self, i: usize) {
        let Some(sock) = &self.senders[i] else { return };
        let b = &mut self.tx[i];
        let fd = sock.as_raw_fd();
        if let Err((e, lost)) = send_all(fd, &mut b.data, &b.lens, &mut self.gso, &mut self.stats) {
            // ICMP-induced errors (a dead peer's closed port) are not fatal.
            count_send_error(&mut self.stats, &e, lost);
            tracing::debug!("send to host {i} failed: {e}");
        }
        b.data.clear();
        b.lens.clear();
    }

    /// Whether more datagrams are likely waiting: a burst is under way or a batch is buffered.
    /// Outside a burst a caller answers the datagram it got before asking again, so that
    /// the `recv` that finds the socket empty is not on the round trip's path.
    pub fn bursting(&self) -> bool {
        self.streak >= 2 || self.buffered()
    }

    /// Whether a batch read ahead still holds datagrams.
    pub fn buffered(&self) -> bool {
        self.rx_next < self.rx_count
    }

    /// The caller knows the socket is empty (it counted what was sent to it): the next
    /// datagram starts no burst.
    pub fn settled(&mut self) {
        self.streak = 0;
    }

    /// Hands the next received datagram to `f` in the driver's own buffer (no copy; `f` may
    /// decrypt it in place); `false` when nothing is waiting. Datagrams that arrived joined
    /// (GRO) are handed over one by one, cut at the size the kernel reported.
    pub fn recv_with(&mut self, f: &mut dyn FnMut(&mut [u8])) -> bool {
        if !self.buffered() {
            let got = if self.streak < 2 {
                // One receive (no batch is buffered): a lone datagram, or one joined run.
                self.recv_one()
            } else {
                self.refill()
            };
            if !got {
                self.streak = 0;
                return false;
            }
        }
        let i = self.rx_next;
        let len = self.rx_lens[i].min(RX_SLOT);
        let at = self.rx_off;
        let n = self.rx_segs[i].min(len - at);
        if at > 0 {
            self.stats.gro_joined += 1;
        }
        self.rx_off += n;
        if self.rx_off >= len {
            self.rx_next += 1;
            self.rx_off = 0;
        }
        f(&mut self.rx[i * RX_SLOT + at..i * RX_SLOT + at + n]);
        true
    }

    /// One receive into the first slot, as a batch of one: `recvmsg` when datagrams may
    /// arrive joined (the control message says where to cut), else a plain `recv`.
    fn recv_one(&mut self) -> bool {
        for _ in 0..64 {
            self.stats.recv_syscalls += 1;
            let slot = &mut self.rx[..RX_SLOT];
            let got = match self.gro {
                true => super::segment::recv_joined(self.sock.as_raw_fd(), slot),
                false => self.sock.recv(slot).map(|n| (n, n)),
            };
            match got {
                Ok((n, seg)) => {
                    self.streak += 1;
                    (self.rx_lens[0], self.rx_segs[0]) = (n, seg);
                    (self.rx_count, self.rx_next, self.rx_off) = (1, 0, 0);
                    return true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                // Interrupted, or an ICMP error queued on the socket: try again.
                Err(e) => tracing::trace!("recv: {e}"),
            }
        }
        false
    }

    fn refill(&mut self) -> bool {
        self.rx_count = 0;
        self.rx_next = 0;
        self.rx_off = 0;
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; BATCH];
        let mut ctl = [super::segment::control(); BATCH];
        // SAFETY: an all-zero mmsghdr is a valid empty header.
        let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        for j in 0..BATCH {
            iov[j] = libc::iovec {
                iov_base: self.rx[j * RX_SLOT..].as_mut_ptr() as *mut _,
                iov_len: RX_SLOT,
            };
            msgs[j].msg_hdr.msg_iov = &mut iov[j];
            msgs[j].msg_hdr.msg_iovlen = 1;
            if self.gro {
                super::segment::receive_control(&mut msgs[j].msg_hdr, &mut ctl[j]);
            }
        }
        for _ in 0..64 {
            // SAFETY: each header points at its own RX_SLOT-sized slice of `self.rx`.
            let got = unsafe {
                libc::recvmmsg(
                    self.sock.as_raw_fd(),
                    msgs.as_mut_ptr(),
                    BATCH as u32,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            self.stats.recv_syscalls += 1;
            if got > 0 {
                for (j, m) in msgs.iter().enumerate().take(got as usize) {
                    let n = m.msg_len as usize;
                    self.rx_lens[j] = n;
                    self.rx_segs[j] = super::segment::joined_at(&m.msg_hdr, n);
                }
                self.rx_count = got as usize;
                return true;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => return false,
                // Interrupted, or an ICMP error queued on the socket: try again.
                _ => tracing::trace!("recvmmsg: {e}"),
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two drivers on loopback ports the kernel just handed out (retried if taken meanwhile).
    fn pair(mtu: usize) -> (UdpDriver, UdpDriver) {
        for _ in 0..20 {
            let free = || {
                let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
                s.local_addr().unwrap()
            };
            let peers = vec![free(), free()];
            let a = UdpDriver::bind(peers[0], None, peers.clone(), None, mtu);
            let b = UdpDriver::bind(peers[1], None, peers.clone(), None, mtu);
            if let (Ok(a), Ok(b)) = (a, b) {
                return (a, b);
            }
        }
        panic!("no two free loopback ports");
    }

    fn datagram(i: usize, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i * 7 + j) as u8).collect()
    }

    /// Everything sent arrives once, whole and in order, however it was cut and joined.
    fn sends_and_receives(mtu: usize, lens: &[usize]) -> (DriverStats, DriverStats) {
        let (mut a, mut b) = pair(mtu);
        for (i, &len) in lens.iter().enumerate() {
            a.send(1, &datagram(i, len));
        }
        a.flush();
        let mut got = Vec::new();
        let t = std::time::Instant::now();
        while got.len() < lens.len() && t.elapsed() < std::time::Duration::from_secs(5) {
            b.recv_with(&mut |d| got.push(d.to_vec()));
        }
        assert_eq!(got.len(), lens.len(), "every datagram arrives");
        for (i, (d, &len)) in got.iter().zip(lens).enumerate() {
            assert_eq!(d, &datagram(i, len), "datagram {i} whole and in order");
        }
        assert!(!b.recv_with(&mut |_| panic!("nothing more")));
        (a.stats, b.stats)
    }

    #[test]
    fn runs_of_small_datagrams_leave_cut_by_the_kernel_and_arrive_joined() {
        // 20 full ones and a short one (one run), 3 of another size, a lone longer one.
        let mut lens = vec![1472; 20];
        lens.extend([300, 200, 200, 200, 1000]);
        let (tx, rx) = sends_and_receives(1472, &lens);
        assert_eq!((tx.gso_sends, tx.send_syscalls), (2, 1), "{tx:?}");
        // Joined on receipt: all but the first of each run of the 21 and the 3.
        assert_eq!(rx.gro_joined, 20 + 2, "{rx:?}");
        // Jumbo frames: batched too (not sent alone as datagrams from 8 KiB are elsewhere),
        // seven to a GSO send.
        let (tx, rx) = sends_and_receives(8972, &[8972; 10]);
        assert_eq!((tx.gso_sends, tx.send_syscalls), (2, 1), "{tx:?}");
        assert_eq!(rx.gro_joined, 6 + 2, "{rx:?}");
    }

    #[test]
    fn an_address_in_use_is_refused_not_shared() {
        let (mut a, _b) = pair(1472);
        let addr = a.socket().local_addr().unwrap();
        let again = UdpDriver::bind(addr, None, vec![addr], None, 1472);
        assert_eq!(
            again.err().map(|e| e.kind()),
            Some(io::ErrorKind::AddrInUse),
            "a second driver on a bound address would take the first one's datagrams"
        );
    }

    #[test]
    fn large_datagrams_and_lone_ones_go_as_before() {
        let (tx, rx) = sends_and_receives(65_000, &[20_000, 20_000, 100, 100, 100]);
        assert_eq!(tx.gso_sends, 0, "{tx:?}");
        assert_eq!(rx.gro_joined, 0, "{rx:?}");
        let (tx, _) = sends_and_receives(1472, &[700]);
        assert_eq!((tx.gso_sends, tx.send_syscalls), (0, 1), "{tx:?}");
    }
}
