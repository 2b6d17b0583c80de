//! The floor: two processes with plain UDP sockets, busy-polling, pinned apart, no NIC in
//! between; streams with the kernel's batching (sendmmsg/recvmmsg, UDP GSO/GRO).

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use crate::report::Row;
use crate::Ctx;

/// A connected pair of sockets between ranks 0 and 1 of the job.
pub struct Pair {
    sock: UdpSocket,
    peer: SocketAddr,
    buf: Vec<u8>,
    /// Bumped by every bandwidth run, so that round ids never repeat across sizes.
    epoch: u64,
    /// The stream receiver's `recvmmsg` buffers, made once: 4 MiB of fresh pages at the start
    /// of a stream would keep the receiver away while a stream of small messages overflows
    /// its socket.
    rx: Option<Box<RxBatch>>,
}

/// The salt of the floor's ports (see `JobInfo::rank_addrs`).
const PORT_SALT: u16 = 2;

impl Pair {
    pub fn connect(ctx: &Ctx) -> anyhow::Result<Pair> {
        let me = ctx.job.rank;
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
        // Each rank on its host's address: on one machine or across a LAN alike.
        let addrs = ctx.job.rank_addrs(PORT_SALT)?;
        sock.bind(&addrs[me as usize].into())?;
        let sock: UdpSocket = sock.into();
        sock.set_nonblocking(true)?;
        let peer = addrs[1 - me as usize];
        // Sizes for a stream: what the kernel grants up to 16 MiB (rmem_max caps it).
        let s2 = socket2::SockRef::from(&sock);
        let _ = s2.set_recv_buffer_size(16 << 20);
        let _ = s2.set_send_buffer_size(16 << 20);
        let mut p = Pair {
            sock,
            peer,
            buf: vec![0; 65_536],
            epoch: 0,
            rx: (me == 1).then(|| Box::new(RxBatch::new())),
        };
        // Handshake: rank 1 knocks until rank 0 answers.
        let t = Instant::now();
        if me == 1 {
            loop {
                p.sock.send_to(b"hello", peer).ok();
                std::thread::sleep(Duration::from_millis(2));
                if p.try_recv().is_some() {
                    break;
                }
                anyhow::ensure!(
                    t.elapsed() < Duration::from_secs(10),
                    "raw-udp handshake timed out"
                );
            }
        } else {
            while p.try_recv().is_none() {
                anyhow::ensure!(
                    t.elapsed() < Duration::from_secs(10),
                    "raw-udp handshake timed out"
                );
                std::thread::yield_now();
            }
            p.sock.send_to(b"hello", peer)?;
        }
        std::thread::sleep(Duration::from_millis(20));
        while p.try_recv().is_some() {}
        // Connected: the stream's sendmmsg names no address.
        p.sock.connect(peer)?;
        if me == 1 {
            // The stream's receiver takes joined datagrams (GRO) from the start, so that none
            // of a stream arrives before it is on; its ping-pong sees one datagram at a time.
            sock_opt(
                std::os::fd::AsRawFd::as_raw_fd(&p.sock),
                libc::SOL_UDP,
                libc::UDP_GRO,
                1,
            );
        }
        Ok(p)
    }

    fn try_recv(&mut self) -> Option<usize> {
        self.sock.recv_from(&mut self.buf).ok().map(|(n, _)| n)
    }
}

/// One way of moving datagrams between ranks 0 and 1: the floors' ping-pongs run over it.
pub(crate) trait Path {
    /// Queues a datagram for the peer; large ones may leave at once.
    fn queue(&mut self, d: &[u8]);
    /// Sends what is queued.
    fn flush(&mut self);
    /// Hands the next received datagram to `f`; `false` when none waits.
    fn recv_with(&mut self, f: &mut dyn FnMut(&[u8])) -> bool;
    /// The path's name, for errors.
    fn name(&self) -> &'static str;

    fn send(&mut self, d: &[u8]) {
        self.queue(d);
        self.flush();
    }

    /// Spins up to `t` for a datagram and hands it to `f`; `false` when none came.
    fn recv_within(&mut self, t: Duration, f: &mut dyn FnMut(&[u8])) -> bool {
        let start = Instant::now();
        while start.elapsed() < t {
            if self.recv_with(f) {
                return true;
            }
            std::hint::spin_loop();
        }
        false
    }

    /// Whether a datagram came within `t` (taken, not copied: a ping-pong only needs to know).
    fn arrived_within(&mut self, t: Duration) -> bool {
        self.recv_within(t, &mut |_| {})
    }

    /// Waits up to `t` for a datagram and copies it into `out` (control messages).
    fn recv_timeout(&mut self, t: Duration, out: &mut Vec<u8>) -> bool {
        self.recv_within(t, &mut |d| {
            out.clear();
            out.extend_from_slice(d);
        })
    }
}

impl Path for Pair {
    fn queue(&mut self, d: &[u8]) {
        self.sock.send_to(d, self.peer).ok();
    }
    fn flush(&mut self) {}
    fn recv_with(&mut self, f: &mut dyn FnMut(&[u8])) -> bool {
        match self.try_recv() {
            Some(n) => {
                f(&self.buf[..n]);
                true
            }
            None => false,
        }
    }
    fn name(&self) -> &'static str {
        "udp"
    }
}

/// Half round trip of a spinning ping-pong of `size`-byte datagrams, the two ranks pinned
/// apart.
pub fn pingpong(ctx: &Ctx, p: &mut Pair, size: usize) -> Option<Row> {
    let _pin = Pinned::apart(ctx.job.rank);
    pingpong_over(ctx, p, "raw-udp", size.clamp(1, 65_000))
}

/// A floor's ping-pong over `path` (the caller pins): rank 0's row, unless every round trip
/// was lost.
pub(crate) fn pingpong_over(ctx: &Ctx, path: &mut dyn Path, api: &str, size: usize) -> Option<Row> {
    let msg = vec![0x5au8; size];
    let warm = ctx.lat_warmup(size);
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    for i in 0..warm + ctx.lat_iters(size) {
        if ctx.job.rank == 0 {
            let t = Instant::now();
            path.send(&msg);
            if !path.arrived_within(Duration::from_millis(200)) {
                continue; // a lost datagram: no sample
            }
            if i >= warm {
                samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        } else {
            if !path.arrived_within(Duration::from_millis(500)) {
                continue;
            }
            path.send(&msg);
        }
    }
    // Drain strays before the next size.
    std::thread::sleep(Duration::from_millis(10));
    while path.recv_with(&mut |_| {}) {}
    (ctx.job.rank == 0 && !samples.is_empty()).then(|| {
        ctx.row("pingpong", api, api, "pingpong", size)
            .with_latency(&mut samples)
    })
}

const DATA: u8 = 1;
const DONE: u8 = 2;
const COUNT: u8 = 3;

/// Datagrams (or GSO buffers) per `sendmmsg`/`recvmmsg`.
pub(crate) const BATCH: usize = 64;
/// The largest UDP payload a GSO buffer may carry in all.
const GSO_MAX: usize = 65_000;

/// The datagram size of a `size`-byte message stream: the message itself (at least the
/// 9-byte header) below the MTU, else MTU-sized pieces.
pub(crate) fn segment_len(size: usize, mtu: usize) -> usize {
    if size < mtu {
        size.max(9)
    } else {
        mtu
    }
}

/// Pins this rank to a core apart from its peer's for a floor measurement (rank 0 on the first
/// allowed CPU, the others on the last); the earlier affinity comes back on drop. On separate
/// machines the pin costs nothing; on one machine it keeps sender and receiver off each other.
pub struct Pinned {
    before: Vec<u32>,
}

impl Pinned {
    pub fn apart(rank: u32) -> Option<Pinned> {
        let before = softnic::shm::cores::allowed().ok()?;
        // Among the CPUs the rank had before it left its NIC's core (the peer may not have
        // left one, and both would land on the same).
        let all = softnic::shm::cores::allowed_before_leaving().ok()?;
        if all.len() < 2 {
            return None;
        }
        let cpu = if rank == 0 {
            all[0]
        } else {
            all[all.len() - 1]
        };
        softnic::shm::cores::set_allowed(&[cpu]).ok()?;
        Some(Pinned { before })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = softnic::shm::cores::set_allowed(&self.before);
    }
}

/// Sets an int socket option at `level`; whether the kernel took it.
pub(crate) fn sock_opt(fd: i32, level: i32, opt: i32, val: i32) -> bool {
    // SAFETY: `val` outlives the call, and its size is passed.
    unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            &val as *const i32 as *const libc::c_void,
            std::mem::size_of::<i32>() as libc::socklen_t,
        ) == 0
    }
}

/// Sends `units` (slices of one buffer) with `sendmmsg` on a connected socket, spinning while
/// the socket buffer is full; returns how many left.
pub(crate) fn send_all(fd: i32, units: &[&[u8]]) -> usize {
    let mut iov: Vec<libc::iovec> = units
        .iter()
        .map(|u| libc::iovec {
            iov_base: u.as_ptr() as *mut libc::c_void,
            iov_len: u.len(),
        })
        .collect();
    // SAFETY: an all-zero mmsghdr is valid (no name, no control).
    let mut msgs: Vec<libc::mmsghdr> = (0..iov.len())
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
        m.msg_hdr.msg_iov = v;
        m.msg_hdr.msg_iovlen = 1;
    }
    let mut done = 0;
    let mut stalls = 0u32;
    while done < msgs.len() {
        // SAFETY: every header points at a live iovec over a live buffer.
        let n = unsafe {
            libc::sendmmsg(
                fd,
                msgs[done..].as_mut_ptr(),
                (msgs.len() - done) as u32,
                libc::MSG_DONTWAIT,
            )
        };
        if n > 0 {
            done += n as usize;
            stalls = 0;
        } else {
            // Full socket buffer (EAGAIN/ENOBUFS): the kernel drains it; give up on a unit
            // only if it never does (counted as not delivered).
            stalls += 1;
            if stalls > 1_000_000 {
                done += 1;
            }
            std::hint::spin_loop();
        }
    }
    done
}

/// Receive buffers for `recvmmsg`: `BATCH` slots of 64 KiB.
struct RxBatch {
    bufs: Vec<u8>,
    iov: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
}

impl RxBatch {
    fn new() -> RxBatch {
        let mut bufs = vec![0u8; BATCH * 65_536];
        let mut iov: Vec<libc::iovec> = bufs
            .chunks_mut(65_536)
            .map(|c| libc::iovec {
                iov_base: c.as_mut_ptr() as *mut libc::c_void,
                iov_len: c.len(),
            })
            .collect();
        // SAFETY: an all-zero mmsghdr is valid (no name, no control).
        let mut msgs: Vec<libc::mmsghdr> =
            (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
        for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
        }
        RxBatch { bufs, iov, msgs }
    }

    /// Receives what is waiting (none: 0); the slots then hold the datagrams.
    fn recv(&mut self, fd: i32) -> usize {
        debug_assert_eq!(self.iov.len(), BATCH);
        for m in &mut self.msgs {
            m.msg_len = 0;
        }
        // SAFETY: the headers point at `iov`, which point into `bufs`; all live in self.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                self.msgs.as_mut_ptr(),
                BATCH as u32,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        n.max(0) as usize
    }

    fn get(&self, i: usize) -> &[u8] {
        &self.bufs[i * 65_536..i * 65_536 + self.msgs[i].msg_len as usize]
    }
}

/// The datagrams of one `size`-byte message in pieces of up to `unit` bytes (the last one
/// shorter, at least the 9-byte header).
pub(crate) fn pieces(size: usize, unit: usize) -> Vec<usize> {
    let mut lens = Vec::new();
    let mut off = 0;
    while off < size.max(1) {
        lens.push(unit.min(size - off.min(size)).max(9));
        off += unit;
    }
    lens
}

/// A floor's stream row: `delivered` bytes of `count` `size`-byte messages, timed from `t`
/// until the count came back.
pub(crate) fn stream_row(
    ctx: &Ctx,
    api: &str,
    size: usize,
    count: usize,
    delivered: u64,
    t: Instant,
) -> Row {
    let secs = t.elapsed().as_secs_f64();
    let mut row = ctx.row("bw", api, api, "stream", size);
    row.iters = count;
    row.mb_s = Some(delivered as f64 / secs / 1e6);
    // Messages that arrived (whole or not: the floor counts bytes).
    row.mops = Some(delivered as f64 / size.max(1) as f64 / secs / 1e6);
    row
}

/// The stream floor: rank 0 sends `size`-byte messages back to back (datagrams of `mtu`
/// bytes, or GSO buffers of such datagrams where the kernel offers UDP GSO), `sendmmsg` in
/// batches of 64, pinned apart from rank 1, which drains with `recvmmsg` (GRO where offered).
/// No per-message handshake: the pipe stays full. MB/s counts only bytes that arrived, over
/// the sender's time until rank 1's count came back. As many messages as the gni stream.
pub fn bw(ctx: &Ctx, p: &mut Pair, size: usize, mtu: usize) -> Option<Row> {
    let _pin = Pinned::apart(ctx.job.rank);
    let count = crate::gni_bench::bw_iters(ctx.iters, size);
    p.epoch += 1;
    let epoch = p.epoch;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&p.sock);
    // No drain here: the sender may be done before the receiver gets this far (a stream of
    // small messages takes a millisecond), and stragglers of an earlier size carry another
    // epoch.
    let mtu = mtu.clamp(17, 65_000);
    if ctx.job.rank == 0 {
        // GSO pays where datagrams are small: up to 64 of them in one buffer of < 64 KiB —
        // the pieces of a large message, or whole small messages (a message-rate floor).
        let seg = segment_len(size, mtu);
        let segs = (GSO_MAX / seg).min(64);
        let gso =
            segs > 1 && size != mtu && sock_opt(fd, libc::SOL_UDP, libc::UDP_SEGMENT, seg as i32);
        let unit = if gso { segs * seg } else { seg };
        // Every datagram starts with DATA and the epoch (with GSO, at every segment boundary).
        let mut chunk = vec![0u8; unit];
        for d in chunk.chunks_mut(seg) {
            d[0] = DATA;
            d[1..9].copy_from_slice(&epoch.to_le_bytes());
        }
        // What to send: a large message's pieces, once per message; small messages `segs` to
        // a buffer.
        let mut lens = Vec::new();
        let repeat = if size < mtu {
            let per = if gso { segs } else { 1 };
            let mut left = count;
            while left > 0 {
                let k = left.min(per);
                lens.push(k * seg);
                left -= k;
            }
            1
        } else {
            lens = pieces(size, unit);
            count
        };
        let t = Instant::now();
        let mut batch: Vec<&[u8]> = Vec::with_capacity(BATCH);
        for _ in 0..repeat {
            for &n in &lens {
                batch.push(&chunk[..n]);
                if batch.len() == BATCH {
                    send_all(fd, &batch);
                    batch.clear();
                }
            }
        }
        send_all(fd, &batch);
        if gso {
            sock_opt(fd, libc::SOL_UDP, libc::UDP_SEGMENT, 0);
        }
        // Ask for the count until it comes (the request or the answer may be lost).
        let got = &mut Vec::new();
        let delivered = loop {
            let mut d = [DONE; 9];
            d[1..9].copy_from_slice(&epoch.to_le_bytes());
            p.sock.send_to(&d, p.peer).ok();
            if p.recv_timeout(Duration::from_millis(50), got)
                && got.len() >= 17
                && got[0] == COUNT
                && got[1..9] == epoch.to_le_bytes()
            {
                break u64::from_le_bytes(got[9..17].try_into().unwrap());
            }
            if t.elapsed() > Duration::from_secs(60) {
                break 0;
            }
        };
        Some(stream_row(ctx, "raw-udp", size, count, delivered, t))
    } else {
        let seg = segment_len(size, mtu);
        let mut rx = p.rx.take().unwrap_or_else(|| Box::new(RxBatch::new()));
        let mut got = 0u64;
        let mut answer = [COUNT; 17];
        answer[1..9].copy_from_slice(&epoch.to_le_bytes());
        let mut last = Instant::now();
        let mut done = false;
        while !done && last.elapsed() < Duration::from_secs(10) {
            let n = rx.recv(fd);
            if n > 0 {
                last = Instant::now();
            }
            for i in 0..n {
                // GRO joins datagrams of one size (the last may be shorter, the DONE too):
                // each segment is a datagram of its own.
                for d in rx.get(i).chunks(seg) {
                    if d.len() < 9 || d[1..9] != epoch.to_le_bytes() {
                        continue;
                    }
                    match d[0] {
                        // Messages under 9 bytes travel as 9-byte datagrams.
                        DATA => got += d.len().min(size.max(1)) as u64,
                        DONE => {
                            answer[9..17].copy_from_slice(&got.to_le_bytes());
                            p.sock.send_to(&answer, p.peer).ok();
                            done = true;
                        }
                        _ => {}
                    }
                }
            }
        }
        // Linger to repeat the answer if it was lost (only to a request for it).
        let t = Instant::now();
        while done && t.elapsed() < Duration::from_millis(200) {
            if let Some(n) = p.try_recv() {
                if n >= 9 && p.buf[0] == DONE && p.buf[1..9] == epoch.to_le_bytes() {
                    p.sock.send_to(&answer, p.peer).ok();
                }
            }
        }
        p.rx = Some(rx);
        None
    }
}
