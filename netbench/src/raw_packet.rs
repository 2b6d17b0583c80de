//! The packet floor: the kernel path the daemons take with the packet transport, without them.
//! Ranks 0 and 1 exchange raw Ethernet frames, unsealed, unreliable, busy-polling, pinned
//! apart, two ways, the faster counting: through the daemons' own driver (`AF_PACKET`, a
//! receive ring the kernel fills, `sendmmsg` batches) and through a plain packet socket read
//! with `recv`. On loopback the ring is filled in the sender's `send`, so its core makes
//! both copies; a plain socket leaves the second to the receiver's `recv`, on its own core
//! (measured here, 65,000-byte frames: 4.99–5.14 GB/s into the ring, 6.41–7.01 through `recv`).
//! Where packet frames move faster than UDP datagrams (some kernels; level on others), the
//! NIC's bulk path is judged against this floor.
//!
//! Needs CAP_NET_RAW, and a MAC per rank: on loopback one is derived from each rank's address;
//! across hosts the job's config names the hosts' interfaces and MACs (two ranks on one
//! non-loopback host have none of their own: skipped).

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use softnic::transport::packet::{
    attach_mac_filter, bind_ethertype, loopback_mac, PacketDriver, PacketLink,
};

use crate::raw_udp::{
    pieces, pingpong_over, segment_len, send_all, sock_opt, stream_row, Path, Pinned, BATCH,
};
use crate::report::Row;
use crate::Ctx;

/// The salt of this floor's reserved UDP ports (see `JobInfo::rank_addrs`), which also name
/// the ranks' loopback MACs.
const PORT_SALT: u16 = 3;

const HELLO: u8 = 0;
const DATA: u8 = 1;
const DONE: u8 = 2;
const COUNT: u8 = 3;

/// softnic's EtherType for the plain path's frames (IEEE 802 local experimental 2): the ring's
/// socket and any daemon's, bound to softnic's own, never see them.
const PLAIN_ETHERTYPE: u16 = 0x88b6;
/// Frames this long go alone in a `sendmsg` gathered from where they lie (as the daemons' do).
const GATHER_MIN: usize = 8192;

/// The daemons' way: softnic's packet driver, a receive ring the kernel fills.
struct Ring {
    drv: PacketDriver,
    peer: u16,
}

impl Path for Ring {
    fn queue(&mut self, d: &[u8]) {
        self.drv.send(self.peer, d);
    }
    fn flush(&mut self) {
        self.drv.flush();
    }
    fn recv_with(&mut self, f: &mut dyn FnMut(&[u8])) -> bool {
        self.drv.recv_with(&mut |d| f(d))
    }
    fn name(&self) -> &'static str {
        "ring"
    }
}

/// A plain packet socket read with `recv`: the kernel only queues a frame where the ring would
/// have it copied in the delivering context (on loopback the sender's `send`), so the
/// receiver's core makes the second copy (into one buffer, kept warm, as the C stream of stop
/// 57 did).
struct Plain {
    sock: socket2::Socket,
    /// Destination MAC, source MAC, EtherType.
    header: [u8; 14],
    tx: Vec<u8>,
    tx_lens: Vec<usize>,
    /// One frame, as `recv` copies it: the same buffer every time (as warm as it can be).
    rx_buf: Vec<u8>,
}

impl Plain {
    fn open(link: &PacketLink, me: usize) -> anyhow::Result<Plain> {
        let sock = socket2::Socket::new(socket2::Domain::PACKET, socket2::Type::RAW, None)?;
        sock.set_nonblocking(true)?;
        let fd = sock.as_raw_fd();
        for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
            sock_opt(fd, libc::SOL_SOCKET, opt, 16 << 20);
        }
        sock_opt(fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, 1);
        attach_mac_filter(&sock, link.macs[me])?;
        let name = std::ffi::CString::new(link.interface.clone())?;
        // SAFETY: a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        anyhow::ensure!(ifindex != 0, "no interface {:?}", link.interface);
        bind_ethertype(&sock, PLAIN_ETHERTYPE, ifindex)?;
        let mut header = [0u8; 14];
        header[..6].copy_from_slice(&link.macs[1 - me]);
        header[6..12].copy_from_slice(&link.macs[me]);
        header[12..].copy_from_slice(&PLAIN_ETHERTYPE.to_be_bytes());
        Ok(Plain {
            sock,
            header,
            tx: Vec::new(),
            tx_lens: Vec::new(),
            rx_buf: vec![0; 65_600],
        })
    }
}

impl Path for Plain {
    fn queue(&mut self, d: &[u8]) {
        if d.len() >= GATHER_MIN {
            self.flush();
            let iov = [
                libc::iovec {
                    iov_base: self.header.as_ptr() as *mut libc::c_void,
                    iov_len: self.header.len(),
                },
                libc::iovec {
                    iov_base: d.as_ptr() as *mut libc::c_void,
                    iov_len: d.len(),
                },
            ];
            // SAFETY: an all-zero msghdr is valid; it points at the two live iovecs.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = 2;
            // A full socket buffer: spin until the kernel drains it (as `send_all`).
            for _ in 0..1_000_000 {
                // SAFETY: as above; the buffers outlive the call.
                if unsafe { libc::sendmsg(self.sock.as_raw_fd(), &msg, libc::MSG_DONTWAIT) } >= 0 {
                    break;
                }
                std::hint::spin_loop();
            }
            return;
        }
        self.tx.extend_from_slice(&self.header);
        self.tx.extend_from_slice(d);
        self.tx_lens.push(self.header.len() + d.len());
        if self.tx_lens.len() == BATCH {
            self.flush();
        }
    }
    fn flush(&mut self) {
        let mut units = Vec::with_capacity(self.tx_lens.len());
        let mut at = 0;
        for &n in &self.tx_lens {
            units.push(&self.tx[at..at + n]);
            at += n;
        }
        send_all(self.sock.as_raw_fd(), &units);
        self.tx.clear();
        self.tx_lens.clear();
    }
    fn recv_with(&mut self, f: &mut dyn FnMut(&[u8])) -> bool {
        loop {
            // SAFETY: `rx_buf` is ours and as long as said.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    self.rx_buf.as_mut_ptr().cast(),
                    self.rx_buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                return false;
            }
            let frame = &self.rx_buf[..n as usize];
            if frame.len() > 14 && frame[12..14] == PLAIN_ETHERTYPE.to_be_bytes() {
                f(&frame[14..]);
                return true;
            }
        }
    }
    fn name(&self) -> &'static str {
        "recv"
    }
}

/// Ranks 0 and 1, with both paths to each other.
pub struct Pair {
    ring: Ring,
    plain: Plain,
    /// Bumped by every run, so that strays of an earlier size never count.
    epoch: u64,
}

/// This rank's link and reserved address, or why the floor cannot run in this job.
fn link(ctx: &Ctx) -> anyhow::Result<Result<(PacketLink, SocketAddr), String>> {
    if !softnic::transport::packet::permitted() {
        return Ok(Err(
            "packet sockets need CAP_NET_RAW (run as root)".to_string()
        ));
    }
    let addrs = ctx.job.rank_addrs(PORT_SALT)?;
    let me = ctx.job.rank as usize;
    let pair = [addrs[0], addrs[1]];
    if pair.iter().all(|a| a.ip().is_loopback()) {
        return Ok(Ok((
            PacketLink {
                interface: "lo".into(),
                macs: pair.iter().map(|&a| loopback_mac(a)).collect(),
            },
            pair[me],
        )));
    }
    let hosts = [ctx.job.rank_hosts[0], ctx.job.rank_hosts[1]];
    let Some(cfg) = &ctx.job.config else {
        return Ok(Err("off loopback the job's config must name MACs".into()));
    };
    if hosts[0] == hosts[1] {
        return Ok(Err(
            "ranks 0 and 1 share a non-loopback host (one MAC between them)".into(),
        ));
    }
    let cfg = softnic::config::Config::load(cfg)?;
    match cfg.packet_link(hosts[me]) {
        Ok(l) => Ok(Ok((
            PacketLink {
                interface: l.interface,
                macs: hosts.iter().map(|&h| l.macs[h as usize]).collect(),
            },
            pair[me],
        ))),
        Err(e) => Ok(Err(e.to_string())),
    }
}

impl Pair {
    /// Opens both paths and handshakes on each; `None` (rank 0 says why) where this floor
    /// cannot run. Both ranks decide alike: same user, same config.
    pub fn connect(ctx: &Ctx, mtu: usize) -> anyhow::Result<Option<Pair>> {
        let (link, addr) = match link(ctx)? {
            Ok(l) => l,
            Err(why) => {
                if ctx.job.rank == 0 {
                    eprintln!("netbench: no raw-packet floor: {why}");
                }
                return Ok(None);
            }
        };
        let me = ctx.job.rank as u16;
        let drv = PacketDriver::open(addr, me, &link, mtu.clamp(64, 65_000), None)?;
        let mut p = Pair {
            ring: Ring { drv, peer: 1 - me },
            plain: Plain::open(&link, me as usize)?,
            epoch: 0,
        };
        handshake(&mut p.ring, me)?;
        handshake(&mut p.plain, me)?;
        Ok(Some(p))
    }

    /// The largest datagram a frame carries on these paths.
    fn max_datagram(&self) -> usize {
        self.ring.drv.max_datagram()
    }
}

/// Rank 1 knocks until rank 0 answers; then strays are drained.
fn handshake(path: &mut dyn Path, me: u16) -> anyhow::Result<()> {
    let buf = &mut Vec::new();
    let t = Instant::now();
    loop {
        if me == 1 {
            path.send(&[HELLO]);
            std::thread::sleep(Duration::from_millis(2));
        }
        if path.recv_timeout(Duration::from_micros(100), buf) && buf.first() == Some(&HELLO) {
            if me == 0 {
                path.send(&[HELLO]);
            }
            break;
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(10),
            "raw-packet handshake ({}) timed out",
            path.name()
        );
    }
    std::thread::sleep(Duration::from_millis(20));
    while path.recv_with(&mut |_| {}) {}
    Ok(())
}

/// The two ways of receiving the floor compares (see the module's doc).
#[derive(Clone, Copy, Debug)]
pub enum Via {
    Ring,
    Recv,
}

/// Both, in the order they run; the job's barrier comes between (a receiver may still linger
/// after one while its sender would start the next).
pub const VIAS: [Via; 2] = [Via::Ring, Via::Recv];

impl Pair {
    fn path(&mut self, via: Via) -> &mut dyn Path {
        match via {
            Via::Ring => &mut self.ring,
            Via::Recv => &mut self.plain,
        }
    }
}

/// Of one size's rows (one per way), the fastest: the lowest latency, the highest bandwidth.
pub fn faster(rows: Vec<Row>) -> Option<Row> {
    rows.into_iter().max_by(|a, b| {
        let score = |r: &Row| r.mb_s.unwrap_or(0.0) - r.lat_us.unwrap_or(0.0);
        score(a).total_cmp(&score(b))
    })
}

/// Half round trip of a spinning ping-pong of `size`-byte datagrams, pinned apart, `via` one
/// way of receiving.
pub fn pingpong(ctx: &Ctx, p: &mut Pair, size: usize, via: Via) -> Option<Row> {
    let _pin = Pinned::apart(ctx.job.rank);
    let size = size.clamp(1, p.max_datagram());
    pingpong_over(ctx, p.path(via), "raw-packet", size)
}

/// The stream, `via` one way of receiving: rank 0 sends as many `size`-byte messages as the
/// gni stream puts, as frames of up to `mtu` bytes (small ones in `sendmmsg` batches, large
/// ones one `sendmsg` each, gathered, as the daemons do); rank 1 counts what arrives. MB/s
/// counts the bytes that arrived over the sender's time until the count came back.
pub fn bw(ctx: &Ctx, p: &mut Pair, size: usize, mtu: usize, via: Via) -> Option<Row> {
    let _pin = Pinned::apart(ctx.job.rank);
    let seg = segment_len(size, mtu.clamp(17, p.max_datagram()));
    p.epoch += 1;
    let epoch = p.epoch;
    bw_on(ctx, p.path(via), size, seg, epoch)
}

fn bw_on(ctx: &Ctx, path: &mut dyn Path, size: usize, seg: usize, epoch: u64) -> Option<Row> {
    // Control messages (the count and its request) land here.
    let buf = &mut Vec::new();
    let count = crate::gni_bench::bw_iters(ctx.iters, size);
    let epoch = epoch.to_le_bytes();
    if ctx.job.rank == 0 {
        let mut frame = vec![0u8; seg];
        frame[0] = DATA;
        frame[1..9].copy_from_slice(&epoch);
        let lens = pieces(size, seg);
        let t = Instant::now();
        for _ in 0..count {
            for &n in &lens {
                path.queue(&frame[..n]);
            }
        }
        path.flush();
        let delivered = loop {
            let mut d = [DONE; 9];
            d[1..9].copy_from_slice(&epoch);
            path.send(&d);
            if path.recv_timeout(Duration::from_millis(50), buf)
                && buf.len() >= 17
                && buf[0] == COUNT
                && buf[1..9] == epoch
            {
                break u64::from_le_bytes(buf[9..17].try_into().unwrap());
            }
            if t.elapsed() > Duration::from_secs(60) {
                break 0;
            }
        };
        Some(stream_row(ctx, "raw-packet", size, count, delivered, t))
    } else {
        let mut got = 0u64;
        let mut done = false;
        let mut last = Instant::now();
        let mut answer = [COUNT; 17];
        answer[1..9].copy_from_slice(&epoch);
        while !done && last.elapsed() < Duration::from_secs(10) {
            let mut kind = None;
            if path.recv_with(&mut |d| {
                if d.len() >= 9 && d[1..9] == epoch {
                    kind = Some((d[0], d.len()));
                }
            }) {
                last = Instant::now();
            }
            match kind {
                // Messages under 9 bytes travel as 9-byte frames.
                Some((DATA, n)) => got += n.min(size.max(1)) as u64,
                Some((DONE, _)) => {
                    answer[9..17].copy_from_slice(&got.to_le_bytes());
                    path.send(&answer);
                    done = true;
                }
                _ => std::hint::spin_loop(),
            }
        }
        // Linger to repeat the answer if it was lost (only to a request for it).
        let t = Instant::now();
        while done && t.elapsed() < Duration::from_millis(200) {
            if path.recv_timeout(Duration::from_millis(1), buf)
                && buf.len() >= 9
                && buf[0] == DONE
                && buf[1..9] == epoch
            {
                path.send(&answer);
            }
        }
        None
    }
}
