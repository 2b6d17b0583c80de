//! EXTOLL's engines raw (seed 004's VELO/RMA reference lines): VELO and RMA ping-pongs, RMA
//! gets and immediate puts, VELO and RMA bandwidth, and RandomAccess with one VELO message per
//! update (`velo`) or updates bucketed into full messages (`velo-bucketed`), applied by the
//! owner as it polls.

use std::time::Instant;

use softnic::extoll::rma::{Class, Rma, RmaRegion, NOTIFY_COMPLETER, NOTIFY_REQUESTER};
use softnic::extoll::velo::Velo;
use softnic::extoll::{Conn, Shared};
use softnic::phase_trace::{stamp, Phase};

use crate::report::Row;
use crate::Ctx;

/// VELO and RMA on one endpoint, with a registered buffer (same NLA on every rank).
pub struct Ex {
    pub velo: Velo,
    pub rma: Rma,
    buf: RmaRegion,
    max: usize,
    conns: Vec<Conn>,
}

/// The VELO tag of RandomAccess updates and of its end marks.
const TAG_UPDATE: u8 = 1;
const TAG_DONE: u8 = 2;
/// A bandwidth run's closing message.
const TAG_ACK: u8 = 3;

fn row(ctx: &Ctx, bench: &str, op: &str, size: usize) -> Row {
    ctx.row(bench, "extoll", "extoll", op, size)
}

impl Ex {
    pub fn open(ep: Shared, max: usize) -> anyhow::Result<Ex> {
        let velo = Velo::open_on(ep.clone())?;
        let mut rma = Rma::open_on(ep.clone())?;
        let buf = rma.register(2 * max.max(64) + 64)?;
        let conns = (0..velo.size())
            .map(|r| velo.connect(r))
            .collect::<Result<Vec<_>, _>>()?;
        ep.borrow_mut().barrier()?;
        Ok(Ex {
            velo,
            rma,
            buf,
            max: max.max(64),
            conns,
        })
    }

    fn barrier(&self) -> anyhow::Result<()> {
        Ok(self.velo.endpoint().borrow_mut().barrier()?)
    }

    /// Sends `size` bytes as back-to-back VELO messages.
    fn velo_send(&mut self, to: u32, size: usize, tag: u8) -> anyhow::Result<()> {
        let m = self.velo.max_message();
        let chunk = [0x5au8; 128];
        let mut left = size;
        loop {
            let n = left.min(m);
            self.velo.send(self.conns[to as usize], &chunk[..n], tag)?;
            left -= n;
            if left == 0 {
                return Ok(());
            }
        }
    }

    /// Receives `size` bytes of back-to-back VELO messages.
    fn velo_recv(&mut self, size: usize) -> anyhow::Result<()> {
        let mut b = [0u8; 128];
        let mut got = 0;
        loop {
            let (n, _, _) = self.velo.recv(&mut b)?;
            got += n;
            if got >= size {
                return Ok(());
            }
        }
    }

    /// Waits for the next notification of `class`, freeing those before it.
    fn wait_note(&mut self, class: Class) -> anyhow::Result<()> {
        loop {
            let n = self.rma.noti_get_block();
            self.rma.noti_free();
            n.result()?;
            if n.class == class {
                return Ok(());
            }
        }
    }
}

/// `op: "velo"`: half the round trip of `size` bytes in VELO messages (up to 8 KiB).
pub fn velo_pingpong(ctx: &Ctx, ex: &mut Ex, size: usize) -> anyhow::Result<Option<Row>> {
    ex.barrier()?;
    let warm = ctx.lat_warmup(size);
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    if ctx.job.rank < 2 {
        let peer = 1 - ctx.job.rank;
        for i in 0..warm + ctx.lat_iters(size) {
            let t = Instant::now();
            if ctx.job.rank == 0 {
                stamp(Phase::RankPost);
                ex.velo_send(peer, size, 1)?;
                ex.velo_recv(size)?;
                stamp(Phase::RankArrived);
                if i >= warm {
                    samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            } else {
                ex.velo_recv(size)?;
                stamp(Phase::RankArrived);
                stamp(Phase::RankPost);
                ex.velo_send(peer, size, 1)?;
            }
        }
    }
    ex.velo.flush()?;
    ex.barrier()?;
    Ok((ctx.job.rank == 0).then(|| row(ctx, "pingpong", "velo", size).with_latency(&mut samples)))
}

/// `op: "put"` (RMA) or `"immediate_put"`: half the round trip of puts whose arrival each side
/// sees through its completer notification.
pub fn rma_pingpong(
    ctx: &Ctx,
    ex: &mut Ex,
    size: usize,
    immediate: bool,
) -> anyhow::Result<Option<Row>> {
    let size = if immediate {
        size.clamp(1, 8)
    } else {
        size.min(ex.max)
    };
    ex.barrier()?;
    let warm = ctx.lat_warmup(size);
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    if ctx.job.rank < 2 {
        let peer = 1 - ctx.job.rank;
        let conn = ex.conns[peer as usize];
        let dst = ex.buf.nla_at(ex.max as u64);
        let buf = ex.buf.clone();
        for i in 0..warm + ctx.lat_iters(size) {
            let t = Instant::now();
            let put = |ex: &mut Ex| -> anyhow::Result<()> {
                if immediate {
                    ex.rma
                        .immediate_put(conn, dst, &[7u8; 8][..size], NOTIFY_COMPLETER)?;
                } else {
                    ex.rma
                        .post_put(conn, &buf, 0, dst, size as u64, NOTIFY_COMPLETER)?;
                }
                Ok(())
            };
            if ctx.job.rank == 0 {
                put(ex)?;
                ex.wait_note(Class::Completer)?;
                if i >= warm {
                    samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            } else {
                ex.wait_note(Class::Completer)?;
                put(ex)?;
            }
        }
    }
    ex.barrier()?;
    let op = if immediate { "immediate_put" } else { "put" };
    Ok((ctx.job.rank == 0).then(|| row(ctx, "pingpong", op, size).with_latency(&mut samples)))
}

/// `op: "get"`: one RMA get of `size` bytes from rank 1, until its completer notification.
pub fn rma_get(ctx: &Ctx, ex: &mut Ex, size: usize) -> anyhow::Result<Option<Row>> {
    let size = size.min(ex.max);
    ex.barrier()?;
    let mut samples = Vec::new();
    if ctx.job.rank == 0 {
        let conn = ex.conns[1];
        let src = ex.buf.nla_at(0);
        let buf = ex.buf.clone();
        samples = crate::time_calls(ctx.lat_warmup(size), ctx.lat_iters(size), || {
            ex.rma.post_get(
                conn,
                &buf,
                ex.max as u64,
                src,
                size as u64,
                NOTIFY_COMPLETER,
            )?;
            ex.wait_note(Class::Completer)
        })?;
    }
    ex.barrier()?;
    Ok((ctx.job.rank == 0).then(|| row(ctx, "pingpong", "get", size).with_latency(&mut samples)))
}

/// `bw`, `op: "put"`: rank 0 streams RMA puts of `size` bytes to rank 1 (at most 64 whose
/// source is not read yet); the last raises a completer there, answered by a VELO message.
pub fn rma_bw(ctx: &Ctx, ex: &mut Ex, size: usize) -> anyhow::Result<Option<Row>> {
    let size = size.min(ex.max);
    let iters = crate::gni_bench::bw_iters(ctx.iters, size);
    ex.barrier()?;
    let mut out = None;
    if ctx.job.rank < 2 {
        let conn = ex.conns[1 - ctx.job.rank as usize];
        let buf = ex.buf.clone();
        let dst = ex.buf.nla_at(ex.max as u64);
        if ctx.job.rank == 0 {
            let t = Instant::now();
            let mut unread = 0;
            for k in 0..iters {
                let last = k + 1 == iters;
                let notify = NOTIFY_REQUESTER | if last { NOTIFY_COMPLETER } else { 0 };
                ex.rma.post_put(conn, &buf, 0, dst, size as u64, notify)?;
                unread += 1;
                while unread >= 64 || (last && unread > 0) {
                    ex.wait_note(Class::Requester)?;
                    unread -= 1;
                }
            }
            ex.velo_recv(1)?;
            let secs = t.elapsed().as_secs_f64();
            let mut r = row(ctx, "bw", "put", size);
            r.iters = iters;
            r.mb_s = Some((size * iters) as f64 / secs / 1e6);
            r.mops = Some(iters as f64 / secs / 1e6);
            out = Some(r);
        } else {
            ex.wait_note(Class::Completer)?;
            ex.velo_send(0, 1, TAG_ACK)?;
        }
    }
    ex.velo.flush()?;
    ex.barrier()?;
    Ok(out)
}

/// `bw`, `op: "velo"`: rank 0 streams VELO messages of `size` bytes (at most one message) to
/// rank 1, which answers the last.
pub fn velo_bw(ctx: &Ctx, ex: &mut Ex, size: usize) -> anyhow::Result<Option<Row>> {
    let size = size.min(ex.velo.max_message());
    let iters = (ctx.iters * 100).max(10_000);
    ex.barrier()?;
    let mut out = None;
    if ctx.job.rank == 0 {
        let t = Instant::now();
        let msg = vec![0x33u8; size];
        for _ in 0..iters {
            ex.velo.send(ex.conns[1], &msg, 1)?;
        }
        ex.velo_recv(1)?;
        let secs = t.elapsed().as_secs_f64();
        let mut r = row(ctx, "bw", "velo", size);
        r.iters = iters;
        r.mb_s = Some((size * iters) as f64 / secs / 1e6);
        r.mops = Some(iters as f64 / secs / 1e6);
        out = Some(r);
    } else if ctx.job.rank == 1 {
        let mut b = [0u8; 128];
        for _ in 0..iters {
            ex.velo.recv(&mut b)?;
        }
        ex.velo_send(0, 1, TAG_ACK)?;
    }
    ex.velo.flush()?;
    ex.barrier()?;
    Ok(out)
}

/// RandomAccess over VELO: each update (byte offset, value) goes to its owner as a message
/// (`bucketed`: as many as a message holds), the owner XORs it in as it polls; a rank ends with
/// a done mark to every other and stops when it has everyone's.
pub fn randomaccess(
    ctx: &Ctx,
    ex: &mut Ex,
    log_local: u32,
    verify: bool,
    bucketed: bool,
) -> anyhow::Result<Option<Row>> {
    crate::randomaccess::check_ranks(ctx)?;
    let local = 1usize << log_local;
    let (me, n) = (ctx.job.rank, ctx.job.size);
    let base = local as u64 * me as u64;
    let mut table: Vec<u64> = (0..local as u64).map(|i| base + i).collect();
    let per = if bucketed {
        ex.velo.max_message() / 16
    } else {
        1
    };
    let pass = |ex: &mut Ex, table: &mut Vec<u64>| -> anyhow::Result<()> {
        let mut buckets: Vec<Vec<u8>> = (0..n).map(|_| Vec::with_capacity(per * 16)).collect();
        let mut done = 0u32;
        let mut b = [0u8; 128];
        let apply = |table: &mut Vec<u64>, m: &[u8]| {
            for u in m.chunks_exact(16) {
                let off = u64::from_le_bytes(u[..8].try_into().unwrap()) as usize / 8;
                let v = u64::from_le_bytes(u[8..].try_into().unwrap());
                if let Some(w) = table.get_mut(off) {
                    *w ^= v;
                }
            }
        };
        let drain = |ex: &mut Ex, table: &mut Vec<u64>, done: &mut u32| -> anyhow::Result<()> {
            let mut b = [0u8; 128];
            while let Some((len, _, tag)) = ex.velo.probe_recv(&mut b)? {
                match tag {
                    TAG_DONE => *done += 1,
                    _ => apply(table, &b[..len]),
                }
            }
            Ok(())
        };
        for (owner, off, ran) in crate::randomaccess::stream(me, n, log_local) {
            if owner == me {
                table[off as usize / 8] ^= ran;
                continue;
            }
            let bk = &mut buckets[owner as usize];
            bk.extend_from_slice(&off.to_le_bytes());
            bk.extend_from_slice(&ran.to_le_bytes());
            if bk.len() == per * 16 {
                let msg = std::mem::take(bk);
                loop {
                    match ex.velo.try_send(ex.conns[owner as usize], &msg, TAG_UPDATE) {
                        Ok(()) => break,
                        Err(softnic::extoll::velo::VeloError::WouldBlock(_)) => {
                            drain(ex, table, &mut done)?;
                            ex.velo.endpoint().borrow_mut().progress();
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                *bk = msg;
                bk.clear();
            }
        }
        for owner in (0..n).filter(|&o| o != me) {
            let msg = std::mem::take(&mut buckets[owner as usize]);
            if !msg.is_empty() {
                ex.velo.send(ex.conns[owner as usize], &msg, TAG_UPDATE)?;
            }
            ex.velo.send(ex.conns[owner as usize], &[], TAG_DONE)?;
        }
        while done < n - 1 {
            drain(ex, table, &mut done)?;
            if done < n - 1 {
                let (len, _, tag) = ex.velo.recv(&mut b)?;
                match tag {
                    TAG_DONE => done += 1,
                    _ => apply(table, &b[..len]),
                }
            }
        }
        ex.velo.flush()?;
        Ok(())
    };
    ex.barrier()?;
    let t = Instant::now();
    pass(ex, &mut table)?;
    ex.barrier()?;
    let secs = t.elapsed().as_secs_f64();
    let mut errors = None;
    if verify {
        pass(ex, &mut table)?;
        ex.barrier()?;
        let bad = (0..local).filter(|&i| table[i] != base + i as u64).count() as u64;
        // Sum the errors at rank 0 with immediate puts into its buffer's slots.
        let slot = ex.buf.nla_at(8 * me as u64);
        ex.rma
            .immediate_put(ex.conns[0], slot, &bad.to_le_bytes(), NOTIFY_REQUESTER)?;
        ex.wait_note(Class::Requester)?;
        ex.barrier()?;
        ex.barrier()?;
        errors = Some((0..n as usize).map(|r| ex.buf.mem.read_u64(8 * r)).sum());
    }
    let total = 4 * local as u64 * n as u64;
    Ok((me == 0).then(|| {
        let mut r = ctx.row("randomaccess", "extoll", "extoll", "xor", local * 8);
        r.iters = total as usize;
        r.gups = Some(total as f64 / secs / 1e9);
        r.mops = Some(total as f64 / secs / 1e6);
        r.errors = errors;
        r.variant = Some(if bucketed { "velo-bucketed" } else { "velo" }.into());
        r
    }))
}
