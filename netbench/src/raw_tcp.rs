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
            buf: vec![0; 4 << 20],
        })
    }

    /// Reads exactly `n` bytes (into the scratch buffer, in pieces); spins on a non-blocking
    /// socket.
    fn read_n(&mut self, mut n: usize) -> std::io::Result<()> {
        while n > 0 {
            let k = n.min(self.buf.len());
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
            c.read_n(msg.len())?;
            if i >= warm {
                samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        } else {
            c.read_n(msg.len())?;
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
pub fn bw(ctx: &Ctx, c: &mut Conn, size: usize) -> anyhow::Result<Option<Row>> {
    let _pin = Pinned::apart(ctx.job.rank);
    let count = crate::gni_bench::bw_iters(ctx.iters, size);
    let total = count * size;
    if ctx.job.rank == 0 {
        let msg = vec![0xa5u8; size];
        let t = Instant::now();
        for _ in 0..count {
            c.s.write_all(&msg)?;
        }
        c.read_n(1)?;
        let secs = t.elapsed().as_secs_f64();
        let mut row = ctx.row("bw", "raw-tcp", "raw-tcp", "stream", size);
        row.iters = count;
        row.mb_s = Some(total as f64 / secs / 1e6);
        row.mops = Some(count as f64 / secs / 1e6);
        Ok(Some(row))
    } else {
        c.read_n(total)?;
        c.s.write_all(&[1])?;
        Ok(None)
    }
}
