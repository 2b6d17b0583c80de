//! The packet floor: the kernel path the daemons take with the packet transport, without them.
//! Ranks 0 and 1 exchange raw Ethernet frames of softnic's EtherType through the same driver
//! the daemons use (`AF_PACKET`, a receive ring shared with the kernel, `sendmmsg` batches), no
//! sealing, no reliability, busy-polling, pinned apart. Where packet frames move faster than
//! UDP datagrams (measured: ~1.35× for 65,000-byte streams on some kernels, level on others),
//! the NIC's bulk path must be judged against this floor, not the UDP one.
//!
//! Needs CAP_NET_RAW, and a MAC per rank: on loopback one is derived from each rank's address;
//! across hosts the job's config names the hosts' interfaces and MACs (two ranks on one
//! non-loopback host have none of their own: skipped).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use softnic::transport::packet::{loopback_mac, PacketDriver, PacketLink};

use crate::raw_udp::{segment_len, Pinned};
use crate::report::Row;
use crate::Ctx;

/// The salt of this floor's reserved UDP ports (see `JobInfo::rank_addrs`), which also name
/// the ranks' loopback MACs.
const PORT_SALT: u16 = 3;

const HELLO: u8 = 0;
const DATA: u8 = 1;
const DONE: u8 = 2;
const COUNT: u8 = 3;

/// Ranks 0 and 1, each with a packet driver that knows the other's MAC.
pub struct Pair {
    drv: PacketDriver,
    /// The peer's index in the driver's MAC table (the other rank).
    peer: u16,
    buf: Vec<u8>,
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
    /// Opens and handshakes; `None` (rank 0 says why) where this floor cannot run. Both ranks
    /// decide alike: same user, same config.
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
            drv,
            peer: 1 - me,
            buf: vec![0; 65_536],
            epoch: 0,
        };
        // Rank 1 knocks until rank 0 answers.
        let t = Instant::now();
        loop {
            if me == 1 {
                p.send(&[HELLO]);
                std::thread::sleep(Duration::from_millis(2));
            }
            if let Some(n) = p.drv.recv(&mut p.buf) {
                if n >= 1 && p.buf[0] == HELLO {
                    if me == 0 {
                        p.send(&[HELLO]);
                    }
                    break;
                }
            }
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(10),
                "raw-packet handshake timed out"
            );
            std::hint::spin_loop();
        }
        std::thread::sleep(Duration::from_millis(20));
        while p.drv.recv(&mut p.buf).is_some() {}
        Ok(Some(p))
    }

    /// The largest datagram a frame carries on this path.
    pub fn max_datagram(&self) -> usize {
        self.drv.max_datagram()
    }

    fn send(&mut self, d: &[u8]) {
        self.drv.send(self.peer, d);
        self.drv.flush();
    }

    fn recv_timeout(&mut self, d: Duration) -> Option<usize> {
        let t = Instant::now();
        while t.elapsed() < d {
            if let Some(n) = self.drv.recv(&mut self.buf) {
                return Some(n);
            }
            std::hint::spin_loop();
        }
        None
    }
}

/// Half round trip of a spinning ping-pong of `size`-byte frames (payload), pinned apart.
pub fn pingpong(ctx: &Ctx, p: &mut Pair, size: usize) -> Option<Row> {
    let _pin = Pinned::apart(ctx.job.rank);
    let size = size.clamp(1, p.max_datagram());
    let msg = vec![0x5au8; size];
    let warm = ctx.lat_warmup(size);
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    for i in 0..warm + ctx.lat_iters(size) {
        if ctx.job.rank == 0 {
            let t = Instant::now();
            p.send(&msg);
            if p.recv_timeout(Duration::from_millis(200)).is_none() {
                continue; // a lost frame: no sample
            }
            if i >= warm {
                samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        } else {
            if p.recv_timeout(Duration::from_millis(500)).is_none() {
                continue;
            }
            p.send(&msg);
        }
    }
    std::thread::sleep(Duration::from_millis(10));
    while p.drv.recv(&mut p.buf).is_some() {}
    if ctx.job.rank != 0 {
        return None;
    }
    Some(
        ctx.row("pingpong", "raw-packet", "raw-packet", "pingpong", size)
            .with_latency(&mut samples),
    )
}

/// The stream: rank 0 sends as many `size`-byte messages as the gni stream puts, as frames of
/// up to `mtu` bytes (small ones batched by the driver into `sendmmsg`, large ones one `send`
/// each as the daemons do); rank 1 reads them where they lie in its ring and counts. MB/s
/// counts the bytes that arrived over the sender's time until the count came back.
pub fn bw(ctx: &Ctx, p: &mut Pair, size: usize, mtu: usize) -> Option<Row> {
    let _pin = Pinned::apart(ctx.job.rank);
    let count = crate::gni_bench::bw_iters(ctx.iters, size);
    p.epoch += 1;
    let epoch = p.epoch.to_le_bytes();
    let seg = segment_len(size, mtu.clamp(17, p.max_datagram()));
    if ctx.job.rank == 0 {
        let mut frame = vec![0u8; seg];
        frame[0] = DATA;
        frame[1..9].copy_from_slice(&epoch);
        // A message's frames: whole pieces of `seg`, the last one shorter (at least a header).
        let mut lens = Vec::new();
        let mut off = 0;
        while off < size.max(1) {
            lens.push(seg.min(size - off.min(size)).max(9));
            off += seg;
        }
        let t = Instant::now();
        for _ in 0..count {
            for &n in &lens {
                p.drv.send(p.peer, &frame[..n]);
            }
        }
        p.drv.flush();
        let delivered = loop {
            let mut d = [DONE; 9];
            d[1..9].copy_from_slice(&epoch);
            p.send(&d);
            if let Some(n) = p.recv_timeout(Duration::from_millis(50)) {
                if n >= 17 && p.buf[0] == COUNT && p.buf[1..9] == epoch {
                    break u64::from_le_bytes(p.buf[9..17].try_into().unwrap());
                }
            }
            if t.elapsed() > Duration::from_secs(60) {
                break 0;
            }
        };
        let secs = t.elapsed().as_secs_f64();
        let mut row = ctx.row("bw", "raw-packet", "raw-packet", "stream", size);
        row.iters = count;
        row.mb_s = Some(delivered as f64 / secs / 1e6);
        row.mops = Some(delivered as f64 / size.max(1) as f64 / secs / 1e6);
        Some(row)
    } else {
        let mut got = 0u64;
        let mut done = false;
        let mut last = Instant::now();
        let mut answer = [COUNT; 17];
        answer[1..9].copy_from_slice(&epoch);
        while !done && last.elapsed() < Duration::from_secs(10) {
            let mut kind = None;
            if p.drv.recv_with(&mut |d| {
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
                    p.send(&answer);
                    done = true;
                }
                _ => std::hint::spin_loop(),
            }
        }
        // Linger to repeat the answer if it was lost (only to a request for it).
        let t = Instant::now();
        while done && t.elapsed() < Duration::from_millis(200) {
            if let Some(n) = p.drv.recv(&mut p.buf) {
                if n >= 9 && p.buf[0] == DONE && p.buf[1..9] == epoch {
                    p.send(&answer);
                }
            }
        }
        None
    }
}
