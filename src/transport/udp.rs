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
//! until the socket runs dry.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use socket2::{Domain, Protocol, Socket, Type};

use super::fault::FaultInjector;
use crate::config::Fault;

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
    /// Received frames skipped as malformed or too long (packet driver).
    pub rx_bad_frames: u64,
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
/// (a single datagram goes ~1 µs faster alone). On an error, how many were not sent.
pub(super) fn send_all(
    fd: std::os::fd::RawFd,
    data: &mut [u8],
    lens: &[usize],
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
    // Headers and iovecs are written only as far as they are used (a whole batch's are
    // 2.5 KiB, mostly for one or two datagrams).
    let mut iov = [const { std::mem::MaybeUninit::<libc::iovec>::uninit() }; BATCH];
    let mut msgs = [const { std::mem::MaybeUninit::<libc::mmsghdr>::uninit() }; BATCH];
    let (mut at, mut k) = (0, 0);
    while k < lens.len() {
        let n = (lens.len() - k).min(BATCH);
        let mut off = at;
        for j in 0..n {
            let v = iov[j].write(libc::iovec {
                iov_base: data[off..].as_mut_ptr() as *mut _,
                iov_len: lens[k + j],
            });
            off += lens[k + j];
            // SAFETY: an all-zero mmsghdr is a valid empty header.
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_iov = v;
            h.msg_hdr.msg_iovlen = 1;
            msgs[j].write(h);
        }
        // SAFETY: msgs[..n] were written above and point at iovecs that point into `data`,
        // alive for the call.
        let sent =
            unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr().cast(), n as u32, libc::MSG_DONTWAIT) };
        stats.send_syscalls += 1;
        if sent <= 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err((e, lens.len() - k));
        }
        at += lens[k..k + sent as usize].iter().sum::<usize>();
        k += sent as usize;
    }
    Ok(())
}

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
    loop {
        stats.send_syscalls += 1;
        // SAFETY: as above, for the duration of the call.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT) };
        if r >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
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
    rx_count: usize,
    rx_next: usize,
    /// Consecutive successful receives: a burst is under way.
    streak: u32,
    fault: Option<FaultInjector>,
    pub stats: DriverStats,
}

impl UdpDriver {
    /// Binds `addr` (pinned to interface `device`, if given) and opens a sending socket to
    /// each peer's address.
    pub fn bind(
        addr: SocketAddr,
        device: Option<&str>,
        peers: Vec<SocketAddr>,
        fault: Option<Fault>,
    ) -> io::Result<UdpDriver> {
        let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        s.set_reuse_address(true)?;
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
        Ok(UdpDriver {
            sock: mio::net::UdpSocket::from_std(s.into()),
            tx: senders.iter().map(|_| TxBatch::default()).collect(),
            senders,
            rx: vec![0; BATCH * RX_SLOT],
            rx_lens: [0; BATCH],
            rx_count: 0,
            rx_next: 0,
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
        if bytes.len() >= DIRECT_MIN {
            // Copying a large datagram into the batch costs more than the system call it
            // would share: send what is queued (order), then this one from where it lies.
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
        if let Err((e, lost)) = send_all(sock.as_raw_fd(), &mut b.data, &b.lens, &mut self.stats) {
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

    /// The next received datagram, copied into `out`; `None` when nothing is waiting.
    pub fn recv(&mut self, out: &mut [u8]) -> Option<usize> {
        let mut got = None;
        self.recv_with(&mut |d| {
            let n = d.len().min(out.len());
            out[..n].copy_from_slice(&d[..n]);
            got = Some(n);
        });
        got
    }

    /// Hands the next received datagram to `f` in the driver's own buffer (no copy; `f` may
    /// decrypt it in place); `false` when nothing is waiting.
    pub fn recv_with(&mut self, f: &mut dyn FnMut(&mut [u8])) -> bool {
        if self.rx_next == self.rx_count {
            if self.streak < 2 {
                // One datagram, into the first slot (no batch is buffered).
                let mut slot = std::mem::take(&mut self.rx);
                let got = self.recv_one(&mut slot[..RX_SLOT]);
                if let Some(n) = got {
                    f(&mut slot[..n]);
                }
                self.rx = slot;
                return got.is_some();
            }
            if !self.refill() {
                self.streak = 0;
                return false;
            }
        }
        let i = self.rx_next;
        self.rx_next += 1;
        f(&mut self.rx[i * RX_SLOT..i * RX_SLOT + self.rx_lens[i].min(RX_SLOT)]);
        true
    }

    fn recv_one(&mut self, out: &mut [u8]) -> Option<usize> {
        for _ in 0..64 {
            self.stats.recv_syscalls += 1;
            match self.sock.recv(out) {
                Ok(n) => {
                    self.streak += 1;
                    return Some(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.streak = 0;
                    return None;
                }
                // Interrupted, or an ICMP error queued on the socket: try again.
                Err(e) => tracing::trace!("recv: {e}"),
            }
        }
        None
    }

    fn refill(&mut self) -> bool {
        self.rx_count = 0;
        self.rx_next = 0;
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; BATCH];
        // SAFETY: an all-zero mmsghdr is a valid empty header.
        let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        for j in 0..BATCH {
            iov[j] = libc::iovec {
                iov_base: self.rx[j * RX_SLOT..].as_mut_ptr() as *mut _,
                iov_len: RX_SLOT,
            };
            msgs[j].msg_hdr.msg_iov = &mut iov[j];
            msgs[j].msg_hdr.msg_iovlen = 1;
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
                for (len, m) in self.rx_lens.iter_mut().zip(&msgs).take(got as usize) {
                    *len = m.msg_len as usize;
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
