//! The floor: two processes with plain UDP sockets, busy-polling, no NIC in between.

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
}

/// The salt of the floor's ports (see `JobInfo::rank_addrs`).
const PORT_SALT: u16 = 2;

impl Pair {
    pub fn connect(ctx: &Ctx) -> anyhow::Result<Pair> {
        let me = ctx.job.rank;
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None)?;
        let _ = sock.set_recv_buffer_size(8 << 20);
        let _ = sock.set_send_buffer_size(8 << 20);
        // Each rank on its host's address: on one machine or across a LAN alike.
        let addrs = ctx.job.rank_addrs(PORT_SALT)?;
        sock.bind(&addrs[me as usize].into())?;
        let sock: UdpSocket = sock.into();
        sock.set_nonblocking(true)?;
        let peer = addrs[1 - me as usize];
        let mut p = Pair {
            sock,
            peer,
            buf: vec![0; 65_536],
            epoch: 0,
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
        Ok(p)
    }

    fn try_recv(&mut self) -> Option<usize> {
        self.sock.recv_from(&mut self.buf).ok().map(|(n, _)| n)
    }

    fn recv_timeout(&mut self, d: Duration) -> Option<usize> {
        let t = Instant::now();
        while t.elapsed() < d {
            if let Some(n) = self.try_recv() {
                return Some(n);
            }
            std::hint::spin_loop();
        }
        None
    }
}

/// Half round trip of a spinning ping-pong of `size`-byte datagrams.
pub fn pingpong(ctx: &Ctx, p: &mut Pair, size: usize) -> Option<Row> {
    let size = size.clamp(1, 65_000);
    let msg = vec![0x5au8; size];
    let warm = ctx.iters / 10 + 10;
    let mut samples = Vec::with_capacity(ctx.iters);
    for i in 0..warm + ctx.iters {
        if ctx.job.rank == 0 {
            let t = Instant::now();
            p.sock.send_to(&msg, p.peer).ok();
            if p.recv_timeout(Duration::from_millis(200)).is_none() {
                continue; // a lost datagram: no sample
            }
            if i >= warm {
                samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        } else {
            if p.recv_timeout(Duration::from_millis(500)).is_none() {
                continue;
            }
            p.sock.send_to(&msg, p.peer).ok();
        }
    }
    // Drain strays before the next size.
    std::thread::sleep(Duration::from_millis(10));
    while p.try_recv().is_some() {}
    if ctx.job.rank != 0 {
        return None;
    }
    Some(
        ctx.row("pingpong", "raw-udp", "raw-udp", "pingpong", size)
            .with_latency(&mut samples),
    )
}

const DATA: u8 = 1;
const DONE: u8 = 2;
const COUNT: u8 = 3;

/// Streams `size` bytes in datagrams of `mtu` bytes per round; rank 1 reports how many bytes
/// arrived when asked. MB/s counts only bytes that arrived. Round ids carry an epoch per call,
/// and the caller separates calls with a barrier, so stragglers of one size are never counted
/// (or lost) in the next.
pub fn bw(ctx: &Ctx, p: &mut Pair, size: usize, mtu: usize) -> Option<Row> {
    let per = size.div_ceil(mtu).max(1);
    let rounds = (crate::gni_bench::bw_iters(ctx.iters, size) / 4).max(5);
    p.epoch += 1;
    let base = p.epoch << 32;
    while p.try_recv().is_some() {}
    if ctx.job.rank == 0 {
        let mut chunk = vec![0u8; mtu.max(17)];
        let mut delivered = 0u64;
        let t = Instant::now();
        for r in base..base + rounds as u64 {
            for k in 0..per {
                let n = if k + 1 == per { size - k * mtu } else { mtu }.max(9);
                chunk[0] = DATA;
                chunk[1..9].copy_from_slice(&r.to_le_bytes());
                while p.sock.send_to(&chunk[..n], p.peer).is_err() {
                    std::hint::spin_loop();
                }
            }
            // Ask for the count until it comes (the request or the answer may be lost).
            loop {
                let mut d = [DONE; 9];
                d[1..9].copy_from_slice(&r.to_le_bytes());
                p.sock.send_to(&d, p.peer).ok();
                if let Some(n) = p.recv_timeout(Duration::from_millis(50)) {
                    if n >= 17 && p.buf[0] == COUNT && p.buf[1..9] == r.to_le_bytes() {
                        delivered += u64::from_le_bytes(p.buf[9..17].try_into().unwrap());
                        break;
                    }
                }
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let mut row = ctx.row("bw", "raw-udp", "raw-udp", "stream", size);
        row.iters = rounds;
        row.mb_s = Some(delivered as f64 / secs / 1e6);
        Some(row)
    } else {
        let mut got = 0u64;
        let mut round = base;
        let mut answer = [COUNT; 17];
        while round < base + rounds as u64 {
            let Some(n) = p.recv_timeout(Duration::from_secs(10)) else {
                break;
            };
            if n < 9 {
                continue;
            }
            let r = u64::from_le_bytes(p.buf[1..9].try_into().unwrap());
            match p.buf[0] {
                DATA if r == round => got += n as u64,
                DONE if r == round => {
                    answer[1..9].copy_from_slice(&r.to_le_bytes());
                    answer[9..17].copy_from_slice(&got.to_le_bytes());
                    p.sock.send_to(&answer, p.peer).ok();
                    got = 0;
                    round += 1;
                }
                DONE if r + 1 == round => {
                    p.sock.send_to(&answer, p.peer).ok();
                }
                _ => {}
            }
        }
        // Linger to repeat the final answer if it was lost (only to a request for it).
        let last = base + rounds as u64 - 1;
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(200) {
            if let Some(n) = p.try_recv() {
                if n >= 9 && p.buf[0] == DONE && p.buf[1..9] == last.to_le_bytes() {
                    p.sock.send_to(&answer, p.peer).ok();
                }
            }
        }
        None
    }
}
