//! Packet driver: the same authenticated datagrams as raw Ethernet frames of softnic's own
//! EtherType, sent on an `AF_PACKET` socket and received through a ring the kernel shares with
//! the daemon (`PACKET_RX_RING`, TPACKET_V2).
//!
//! Why: a receive is then a look at memory, not a syscall, and a send skips the UDP/IP stack
//! (and the qdisc). Measured here, one thread moving 140-byte datagrams round trip between two
//! sockets on loopback: 6.05 µs over UDP (connected `send`, `recv`), 4.07 µs this way. It needs
//! `CAP_NET_RAW`, which a NIC daemon may hold and the processes of a job do not: the udp conduit
//! cannot do the same. Frames are addressed by MAC; each host's socket keeps only frames for its
//! own MAC (a classic BPF filter in the kernel), and identifies peers by the authenticated
//! datagram header as the other drivers do. The host's UDP address stays bound (unused) so that
//! addresses, and the MACs derived from them on loopback, stay unique on a machine.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use super::fault::FaultInjector;
use super::udp::{count_send_error, send_all, DriverStats};
use crate::config::Fault;

/// softnic's EtherType (IEEE 802 local experimental 1).
pub const ETHERTYPE: u16 = 0x88b5;
/// Destination MAC, source MAC, EtherType.
pub const ETH_HEADER: usize = 14;
/// Frames queued before a flush is forced.
const BATCH: usize = 32;
/// Where the kernel puts a frame's Ethernet header in a ring slot (TPACKET_V2: the 32-byte
/// slot header and a sockaddr_ll, aligned to 16 bytes, minus the header length), with room.
const SLOT_OVERHEAD: usize = 96;
/// Kernel memory the receive ring may take. The kernel fills the slots in turn, so the whole
/// ring is the working set of its copy into it (and of the window, half the ring): 16 MiB of
/// 64 KiB loopback slots spilled out of the caches, and that copy was the kernel's largest
/// cost in a bulk stream. At 4 MiB it costs ~40% less (perf), and 1 MiB put_nbi runs 5–7%
/// faster, 4 MiB over the portals conduit 9% (docs/performance.md, stop 75).
const RING_BYTES: usize = 4 << 20;
/// Fewest and most slots of a ring.
const MIN_SLOTS: usize = 64;
const MAX_SLOTS: usize = 4096;

const TPACKET_V2: libc::c_int = 1;
const TP_STATUS_KERNEL: u32 = 0;
const TP_STATUS_USER: u32 = 1;

/// The MAC of a host with a loopback address: locally administered, made of the address's
/// last three bytes and its port, so that hosts of different clusters on one machine differ.
pub fn loopback_mac(addr: SocketAddr) -> [u8; 6] {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(v) => v.octets().to_vec(),
        std::net::IpAddr::V6(v) => v.octets().to_vec(),
    };
    let n = ip.len();
    let p = addr.port().to_be_bytes();
    [0x02, ip[n - 3], ip[n - 2], ip[n - 1], p[0], p[1]]
}

/// Whether this process may open packet sockets (CAP_NET_RAW).
pub fn permitted() -> bool {
    packet_socket().is_ok()
}

/// Where a packet-transport host lives: its interface and every host's MAC.
#[derive(Debug, Clone)]
pub struct PacketLink {
    pub interface: String,
    /// One per host of the cluster, this one included.
    pub macs: Vec<[u8; 6]>,
}

/// The receive ring, mapped from the socket.
struct Ring {
    base: NonNull<u8>,
    len: usize,
    slot: usize,
    slots: usize,
    next: usize,
}

// SAFETY: the mapping belongs to this driver alone; the kernel is the only other writer.
unsafe impl Send for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is the mapping made in `PacketDriver::open`, unmapped once.
        unsafe {
            let _ = rustix::mm::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

impl Ring {
    fn status(&self, i: usize) -> &AtomicU32 {
        // SAFETY: slot `i < slots` lies inside the mapping; its first 4 bytes are the status
        // word the kernel hands over with release ordering; an AtomicU32 may alias it.
        unsafe { &*(self.base.as_ptr().add(i * self.slot) as *const AtomicU32) }
    }

    fn header_u32(&self, i: usize, off: usize) -> u32 {
        // SAFETY: inside slot `i`'s 32-byte header, read after the status said it is ours.
        unsafe { (self.base.as_ptr().add(i * self.slot + off) as *const u32).read_unaligned() }
    }

    fn header_u16(&self, i: usize, off: usize) -> u16 {
        // SAFETY: as `header_u32`.
        unsafe { (self.base.as_ptr().add(i * self.slot + off) as *const u16).read_unaligned() }
    }

    fn bytes(&self, i: usize, off: usize, len: usize) -> &[u8] {
        debug_assert!(off + len <= self.slot);
        // SAFETY: the caller checked `off + len <= slot`; the slot is ours until released.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(i * self.slot + off), len) }
    }

    fn bytes_mut(&mut self, i: usize, off: usize, len: usize) -> &mut [u8] {
        debug_assert!(off + len <= self.slot);
        // SAFETY: as `bytes`; the kernel does not touch a slot it handed over until it is
        // released, and `&mut self` makes this the only view of it here.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(i * self.slot + off), len) }
    }
}

pub struct PacketDriver {
    fd: OwnedFd,
    ring: Ring,
    me: u16,
    macs: Vec<[u8; 6]>,
    /// Whole frames (Ethernet header included) waiting for the next flush.
    tx: Vec<u8>,
    tx_lens: Vec<usize>,
    /// The largest datagram a ring slot holds whole and the interface carries.
    max_datagram: usize,
    _reserved: std::net::UdpSocket,
    fault: Option<FaultInjector>,
    pub stats: DriverStats,
}

/// A raw packet socket that receives nothing until bound to a protocol (close-on-exec,
/// non-blocking).
fn packet_socket() -> io::Result<socket2::Socket> {
    let s = socket2::Socket::new(socket2::Domain::PACKET, socket2::Type::RAW, None)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

fn setsockopt<T>(fd: &impl AsRawFd, level: i32, name: i32, v: &T) -> io::Result<()> {
    // SAFETY: `v` is a live value of the size given, as the option expects.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            v as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as u32,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A classic BPF program that keeps frames whose destination MAC is `mac`.
fn mac_filter(mac: [u8; 6]) -> [libc::sock_filter; 6] {
    let f = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    let hi = u32::from_be_bytes([mac[0], mac[1], mac[2], mac[3]]);
    let lo = u16::from_be_bytes([mac[4], mac[5]]) as u32;
    [
        f(0x20, 0, 0, 0),        // ld  [0]        (4 bytes)
        f(0x15, 0, 3, hi),       // jeq hi, next, drop
        f(0x28, 0, 0, 4),        // ldh [4]
        f(0x15, 0, 1, lo),       // jeq lo, keep, drop
        f(0x06, 0, 0, u32::MAX), // keep the whole frame
        f(0x06, 0, 0, 0),        // drop
    ]
}

/// Makes packet socket `fd` keep only frames for `mac` (a classic BPF filter in the kernel:
/// the others are dropped before they are copied or queued).
pub fn attach_mac_filter(fd: &impl AsRawFd, mac: [u8; 6]) -> io::Result<()> {
    let mut prog = mac_filter(mac);
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &fprog)
}

/// Binds packet socket `fd` to frames of `ethertype` on interface `ifindex` (until then a
/// socket opened with protocol 0 receives nothing).
pub fn bind_ethertype(fd: &impl AsRawFd, ethertype: u16, ifindex: u32) -> io::Result<()> {
    // SAFETY: an all-zero sockaddr_ll is valid; the fields set below make it an address.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = ethertype.to_be();
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: `sll` is a valid sockaddr_ll of the size given.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl PacketDriver {
    /// Opens host `me`'s socket on `link.interface` for datagrams of up to `mtu` bytes.
    pub fn open(
        addr: SocketAddr,
        me: u16,
        link: &PacketLink,
        mtu: usize,
        fault: Option<Fault>,
    ) -> io::Result<PacketDriver> {
        let reserved = std::net::UdpSocket::bind(addr)?;
        let ifindex = rustix::net::netdevice::name_to_index(&reserved, &link.interface)?;
        let my_mac = *link
            .macs
            .get(me as usize)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no MAC for this host"))?;
        // Protocol 0: nothing is received before the ring and filter are in place and bound.
        let fd = OwnedFd::from(packet_socket()?);
        setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_VERSION, &TPACKET_V2)?;
        let slot = (mtu + ETH_HEADER + SLOT_OVERHEAD)
            .next_power_of_two()
            .max(2048);
        let slots = (RING_BYTES / slot).clamp(MIN_SLOTS, MAX_SLOTS);
        let block = slot.max(1 << 16);
        let req = libc::tpacket_req {
            tp_block_size: block as u32,
            tp_block_nr: (slots * slot / block) as u32,
            tp_frame_size: slot as u32,
            tp_frame_nr: slots as u32,
        };
        setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_RX_RING, &req)?;
        let len = slots * slot;
        // SAFETY: maps the ring the kernel just allocated for this socket; unmapped on drop.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(io::Error::from)?;
        let ring = Ring {
            base: NonNull::new(base.cast()).expect("mmap returned a mapping"),
            len,
            slot,
            slots,
            next: 0,
        };
        let one: libc::c_int = 1;
        setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, &one)?;
        setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, &one)?;
        attach_mac_filter(&fd, my_mac)?;
        bind_ethertype(&fd, ETHERTYPE, ifindex)?;
        let mut salt = [0u8; 8];
        salt[2..].copy_from_slice(&my_mac);
        let salt = u64::from_be_bytes(salt);
        // A frame longer than the interface's MTU would be refused at every send.
        let if_mtu = std::fs::read_to_string(format!("/sys/class/net/{}/mtu", link.interface))
            .ok()
            .and_then(|m| m.trim().parse::<usize>().ok())
            .unwrap_or(1500);
        Ok(PacketDriver {
            fd,
            max_datagram: (slot - SLOT_OVERHEAD - ETH_HEADER).min(if_mtu),
            ring,
            me,
            macs: link.macs.clone(),
            tx: Vec::new(),
            tx_lens: Vec::new(),
            _reserved: reserved,
            fault: FaultInjector::new(fault, salt),
            stats: DriverStats::default(),
        })
    }

    /// Ring slots: how many datagrams may wait for the daemon before the kernel drops some.
    pub fn ring_slots(&self) -> usize {
        self.ring.slots
    }

    /// The largest datagram a ring slot holds whole and the interface carries.
    pub fn max_datagram(&self) -> usize {
        self.max_datagram
    }

    /// The descriptor to register with epoll: readable while a frame waits in the ring.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }

    /// Queues one datagram for host `to`; it leaves at the next [`PacketDriver::flush`].
    pub fn send(&mut self, to: u16, bytes: &[u8]) {
        let Some(dst) = self.macs.get(to as usize).copied() else {
            return;
        };
        if to == self.me {
            return;
        }
        let copies = self.fault.as_mut().map_or(1, |f| f.copies(&mut self.stats));
        if bytes.len() >= super::udp::DIRECT_MIN {
            // As the UDP driver: queued frames first, then this one gathered from the
            // Ethernet header and where the datagram lies.
            self.flush();
            let mut eth = [0u8; ETH_HEADER];
            eth[..6].copy_from_slice(&dst);
            eth[6..12].copy_from_slice(&self.macs[self.me as usize]);
            eth[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
            for _ in 0..copies {
                if let Err(e) =
                    super::udp::send_iov(self.fd.as_raw_fd(), &[&eth, bytes], &mut self.stats)
                {
                    count_send_error(&mut self.stats, &e, 1);
                }
            }
            return;
        }
        for _ in 0..copies {
            self.tx.extend_from_slice(&dst);
            self.tx.extend_from_slice(&self.macs[self.me as usize]);
            self.tx.extend_from_slice(&ETHERTYPE.to_be_bytes());
            self.tx.extend_from_slice(bytes);
            self.tx_lens.push(ETH_HEADER + bytes.len());
        }
        if self.tx_lens.len() >= BATCH {
            self.flush();
        }
    }

    /// Sends every queued frame: one `send`, or `sendmmsg` for several. A frame the device
    /// refuses counts as loss; the transport retransmits.
    pub fn flush(&mut self) {
        if let Err((e, lost)) = send_all(
            self.fd.as_raw_fd(),
            &mut self.tx,
            &self.tx_lens,
            &mut false,
            &mut self.stats,
        ) {
            count_send_error(&mut self.stats, &e, lost);
            tracing::debug!("packet send failed: {e}");
        }
        self.tx.clear();
        self.tx_lens.clear();
    }

    /// The next received datagram, copied into `out`; `None` when the ring holds none. A frame
    /// that is truncated, malformed or too long for `out` is counted and skipped.
    pub fn recv(&mut self, out: &mut [u8]) -> Option<usize> {
        loop {
            let mut got = None;
            if !self.recv_with(&mut |d| {
                if let Some(dst) = out.get_mut(..d.len()) {
                    dst.copy_from_slice(d);
                    got = Some(d.len());
                }
            }) {
                return None;
            }
            if got.is_some() {
                return got;
            }
            self.stats.rx_bad_frames += 1;
        }
    }

    /// Hands the next received datagram to `f` where it lies in the ring (no copy; `f` may
    /// decrypt it in place), then gives the slot back; `false` when the ring holds none. A
    /// truncated or malformed frame is counted and skipped.
    pub fn recv_with(&mut self, f: &mut dyn FnMut(&mut [u8])) -> bool {
        loop {
            let i = self.ring.next;
            let status = self.ring.status(i).load(Ordering::Acquire);
            if status & TP_STATUS_USER == 0 {
                return false;
            }
            let ok = match self.frame(i) {
                Some((off, len)) => {
                    f(self.ring.bytes_mut(i, off, len));
                    true
                }
                None => false,
            };
            self.ring
                .status(i)
                .store(TP_STATUS_KERNEL, Ordering::Release);
            self.ring.next = (i + 1) % self.ring.slots;
            if ok {
                return true;
            }
            self.stats.rx_bad_frames += 1;
        }
    }

    /// Where slot `i`'s datagram lies (after the Ethernet header), after checking what the
    /// slot header claims.
    fn frame(&self, i: usize) -> Option<(usize, usize)> {
        let len = self.ring.header_u32(i, 4) as usize;
        let snap = self.ring.header_u32(i, 8) as usize;
        let mac = self.ring.header_u16(i, 12) as usize;
        if snap != len || snap < ETH_HEADER || mac + snap > self.ring.slot {
            return None;
        }
        let frame = self.ring.bytes(i, mac, snap);
        if frame[12..14] != ETHERTYPE.to_be_bytes() {
            return None;
        }
        Some((mac + ETH_HEADER, snap - ETH_HEADER))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens drivers for `n` hosts on loopback at a random port (another one if a concurrent
    /// test holds it: the port names the hosts' MACs, and sockets bound elsewhere take ports
    /// of this range too), or `None` (with the reason) without CAP_NET_RAW.
    pub(crate) fn open_all(n: u16) -> Option<Vec<PacketDriver>> {
        for _ in 0..50 {
            let port = 30_000 + rand::random::<u16>() % 20_000;
            let addrs: Vec<SocketAddr> = (0..n)
                .map(|i| SocketAddr::from(([127, 0, 0, 2 + i as u8], port)))
                .collect();
            let link = PacketLink {
                interface: "lo".into(),
                macs: addrs.iter().map(|&a| loopback_mac(a)).collect(),
            };
            let mut out = Vec::new();
            for (i, &a) in addrs.iter().enumerate() {
                match PacketDriver::open(a, i as u16, &link, 65_000, None) {
                    Ok(d) => out.push(d),
                    Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                        eprintln!("skipped: packet sockets need CAP_NET_RAW (run as root): {e}");
                        return None;
                    }
                    Err(e) if e.kind() == io::ErrorKind::AddrInUse => break,
                    Err(e) => panic!("cannot open packet driver: {e}"),
                }
            }
            if out.len() == n as usize {
                return Some(out);
            }
        }
        panic!("no free port for {n} packet drivers in 50 tries");
    }

    fn recv_soon(d: &mut PacketDriver, out: &mut [u8]) -> Option<usize> {
        for _ in 0..100_000 {
            if let Some(n) = d.recv(out) {
                return Some(n);
            }
            std::hint::spin_loop();
        }
        None
    }

    #[test]
    fn loopback_macs_are_unicast_local_and_differ_by_address() {
        let a = loopback_mac("127.0.0.2:7700".parse().unwrap());
        let b = loopback_mac("127.0.0.3:7700".parse().unwrap());
        let c = loopback_mac("127.0.0.2:7701".parse().unwrap());
        assert_eq!(a, [0x02, 0, 0, 2, 0x1e, 0x14]);
        assert_eq!(a[0] & 1, 0, "unicast");
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn frames_reach_only_the_host_they_are_for() {
        let Some(mut d) = open_all(3) else {
            return;
        };
        let mut buf = vec![0u8; 70_000];
        let big: Vec<u8> = (0..60_000).map(|i| i as u8).collect();
        d[0].send(1, b"to one");
        d[0].send(2, &big);
        d[0].send(1, b"to one again");
        d[0].flush();
        assert_eq!(
            d[0].stats.send_syscalls, 3,
            "small frames are batched; a large one leaves at once from where it lies, after \
             what was queued before it"
        );
        d[0].send(1, b"one");
        d[0].send(1, b"two");
        d[0].flush();
        assert_eq!(
            d[0].stats.send_syscalls, 4,
            "two small frames, one sendmmsg"
        );
        let n = recv_soon(&mut d[1], &mut buf).expect("host 1 gets its frame");
        assert_eq!(&buf[..n], b"to one");
        let n = recv_soon(&mut d[1], &mut buf).expect("and the next, in order");
        assert_eq!(&buf[..n], b"to one again");
        for want in [&b"one"[..], b"two"] {
            let n = recv_soon(&mut d[1], &mut buf).expect("and the later ones");
            assert_eq!(&buf[..n], want);
        }
        let n = recv_soon(&mut d[2], &mut buf).expect("host 2 gets the large one");
        assert_eq!(&buf[..n], &big[..]);
        assert_eq!(
            d[0].recv(&mut buf),
            None,
            "the sender sees none of its own frames"
        );
        assert_eq!(d[1].recv(&mut buf), None);
        assert_eq!(d[2].recv(&mut buf), None);
        d[2].send(2, b"to myself");
        d[2].flush();
        assert_eq!(d[2].stats.send_syscalls, 0, "nothing is sent to oneself");
    }

    #[test]
    fn a_datagram_longer_than_the_buffer_is_counted_and_skipped() {
        let Some(mut d) = open_all(2) else {
            return;
        };
        d[0].send(1, &[7u8; 100]);
        d[0].send(1, b"fits");
        d[0].flush();
        let mut small = [0u8; 16];
        let n = recv_soon(&mut d[1], &mut small).expect("the second frame comes");
        assert_eq!(&small[..n], b"fits");
        assert_eq!(d[1].stats.rx_bad_frames, 1);
    }

    #[test]
    fn the_ring_wraps_around() {
        let Some(mut d) = open_all(2) else {
            return;
        };
        let slots = d[1].ring_slots();
        let mut buf = vec![0u8; 2048];
        for round in 0..3 * slots as u32 {
            d[0].send(1, &round.to_le_bytes());
            d[0].flush();
            let n = recv_soon(&mut d[1], &mut buf).expect("each frame comes");
            assert_eq!(&buf[..n], &round.to_le_bytes());
        }
    }
}
