//! The TCP floor: one kernel TCP connection between ranks 0 and 1, no NIC in between —
//! the bulk path a stream protocol gets from the kernel (segmentation offload, its own window).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::raw_udp::Pinned;
use crate::report::Row;
use crate::Ctx;

/// The salt of this floor's ports (see `JobInfo::rank_addrs`).
const PORT_SALT: u16 = 3;
/// Besides whole messages, the stream is also run writing and reading pieces of this size (the
/// kernel's copies then run from and into memory still in cache), and the faster counts.
/// Measured in C, 1 MiB messages: between two namespaces over a veth, 256 KiB pieces 3.1–7.4
/// GB/s against 2.8–3.0 whole; over loopback, pinned apart, 3.4–7.0 against 5.0–5.6.
const PIECE: usize = 256 << 10;
/// The receive buffer: the largest piece read at once.
const READ_MAX: usize = 4 << 20;

/// Rank 0's connection to rank 1 (rank 1 listens on its host's address).
pub struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub fn connect(ctx: &Ctx) -> anyhow::Result<Conn> {
        let addrs = ctx.job.rank_addrs(PORT_SALT)?;
        let t = Instant::now();
        let s = if ctx.job.rank == 1 {
            let l = TcpListener::bind(addrs[1])?;
            l.set_nonblocking(true)?;
            loop {
                match l.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        anyhow::ensure!(
                            t.elapsed() < Duration::from_secs(10),
                            "raw-tcp: rank 0 did not connect"
                        );
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        } else {
            loop {
                match TcpStream::connect(addrs[1]) {
                    Ok(s) => break s,
                    Err(e) => {
                        anyhow::ensure!(
                            t.elapsed() < Duration::from_secs(10),
                            "raw-tcp: cannot connect to rank 1 at {}: {e}",
                            addrs[1]
                        );
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            }
        };
        s.set_nonblocking(false)?;
        s.set_nodelay(true)?;
        Ok(Conn {
            s,
            buf: vec![0; READ_MAX],
        })
    }

    /// Reads exactly `n` bytes (into the scratch buffer, at most `piece` at a time); spins on
    /// a non-blocking socket.
    fn read_n(&mut self, mut n: usize, piece: usize) -> std::io::Result<()> {
        while n > 0 {
            let k = n.min(piece).min(self.buf.len());
            match self.s.read(&mut self.buf[..k]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(got) => n -= got,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes all of `b`; spins on a non-blocking socket.
    fn write_all(&mut self, mut b: &[u8]) -> std::io::Result<()> {
        while !b.is_empty() {
            match self.s.write(b) {
                Ok(n) => b = &b[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Half round trip of a `size`-byte ping-pong over the connection (TCP_NODELAY, pinned apart,
/// spinning on a non-blocking socket).
pub fn pingpong(ctx: &Ctx, c: &mut Conn, size: usize) -> anyhow::Result<Option<Row>> {
    let _pin = Pinned::apart(ctx.job.rank);
    c.s.set_nonblocking(true)?;
    let msg = vec![0x5au8; size.max(1)];
    let warm = ctx.lat_warmup(size);
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    for i in 0..warm + ctx.lat_iters(size) {
        let t = Instant::now();
        if ctx.job.rank == 0 {
            c.write_all(&msg)?;
            c.read_n(msg.len(), READ_MAX)?;
            if i >= warm {
                samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        } else {
            c.read_n(msg.len(), READ_MAX)?;
            c.write_all(&msg)?;
        }
    }
    c.s.set_nonblocking(false)?;
    Ok((ctx.job.rank == 0).then(|| {
        ctx.row("pingpong", "raw-tcp", "raw-tcp", "pingpong", size)
            .with_latency(&mut samples)
    }))
}

/// The stream: rank 0 writes as many `size`-byte messages as the gni stream puts, back to
/// back; rank 1 reads them all and answers with one byte; MB/s over rank 0's time until then.
/// Run twice, in whole messages (up to [`READ_MAX`]) and in [`PIECE`]-byte pieces; the faster
/// is the floor.
pub fn bw(ctx: &Ctx, c: &mut Conn, size: usize) -> anyhow::Result<Option<Row>> {
    let _pin = Pinned::apart(ctx.job.rank);
    let count = crate::gni_bench::bw_iters(ctx.iters, size);
    let total = count * size;
    let mut best: Option<f64> = None;
    let mut pieces = vec![size.min(READ_MAX)];
    if PIECE < size {
        pieces.push(PIECE);
    }
    let msg = vec![0xa5u8; if ctx.job.rank == 0 { size } else { 0 }];
    for piece in pieces {
        if ctx.job.rank == 0 {
            let t = Instant::now();
            for _ in 0..count {
                for p in msg.chunks(piece) {
                    c.s.write_all(p)?;
                }
            }
            c.read_n(1, 1)?;
            let secs = t.elapsed().as_secs_f64();
            best = Some(best.unwrap_or(0.0).max(secs.recip()));
        } else {
            c.read_n(total, piece)?;
            c.s.write_all(&[1])?;
        }
    }
    Ok(best.map(|per_sec| {
        let mut row = ctx.row("bw", "raw-tcp", "raw-tcp", "stream", size);
        row.iters = count;
        row.mb_s = Some(total as f64 * per_sec / 1e6);
        row.mops = Some(count as f64 * per_sec / 1e6);
        row
    }))
}
