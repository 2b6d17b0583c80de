//! MPI over Portals (seed 003's figures): send/recv ping-pong and streaming, one-sided
//! operation latency by the seed's method (a lock epoch with one operation minus an empty
//! one), synchronisation overhead vs processes, latency vs operations per epoch, collectives.

use std::time::Instant;

use softnic::mpi::{Comm, LockType, LongProtocol, Op, Win};
use softnic::phase_trace::{stamp, Phase};

use crate::report::Row;
use crate::Ctx;

fn eager_limit() -> usize {
    std::env::var("SOFTNIC_MPI_EAGER_LIMIT")
        .ok()
        .and_then(|v| softnic::config::parse_size(&v))
        .map_or(softnic::mpi::EAGER_LIMIT, |n| n as usize)
}

/// The protocols a send of `size` bytes is measured under: SHORT, or both long ones.
fn protocols(size: usize) -> Vec<Option<LongProtocol>> {
    if size <= eager_limit() {
        vec![None]
    } else {
        vec![Some(LongProtocol::Eager), Some(LongProtocol::Rendezvous)]
    }
}

/// Runs `f` under each protocol `size` takes (set on every rank alike), naming its rows'
/// variant; the protocol goes back to what it was after.
fn under_protocols(
    w: &Comm,
    size: usize,
    mut f: impl FnMut() -> anyhow::Result<Option<Row>>,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let was = w.long_protocol();
    for p in protocols(size) {
        if let Some(p) = p {
            w.set_long_protocol(p);
        }
        let name = match p {
            None => "short",
            Some(LongProtocol::Eager) => "eager",
            Some(LongProtocol::Rendezvous) => "rendezvous",
        };
        if let Some(mut r) = f()? {
            r.variant = Some(match r.variant.take() {
                Some(suffix) => format!("{name}{suffix}"),
                None => name.into(),
            });
            rows.push(r);
        }
    }
    w.set_long_protocol(was);
    Ok(rows)
}

fn row(ctx: &Ctx, bench: &str, op: &str, size: usize) -> Row {
    ctx.row(bench, "mpi", "portals", op, size)
}

/// `send_recv`: rank 0 sends, rank 1 receives and sends back; `lat_us` is half the round trip.
pub fn pingpong(ctx: &Ctx, w: &Comm, size: usize) -> anyhow::Result<Option<Row>> {
    w.barrier()?;
    let mut out = vec![7u8; size];
    let mut inn = vec![0u8; size];
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    let warm = ctx.lat_warmup(size);
    if w.rank() < 2 {
        let peer = 1 - w.rank() as i32;
        for i in 0..warm + ctx.lat_iters(size) {
            if size >= 8 {
                out[..8].copy_from_slice(&(i as u64).to_le_bytes());
            }
            let t = Instant::now();
            if w.rank() == 0 {
                stamp(Phase::RankPost);
                w.send(&out, peer, 1)?;
                w.recv(&mut inn, peer, 1)?;
                stamp(Phase::RankArrived);
                if i >= warm {
                    samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            } else {
                w.recv(&mut inn, peer, 1)?;
                stamp(Phase::RankArrived);
                stamp(Phase::RankPost);
                w.send(&out, peer, 1)?;
            }
            if size >= 8 {
                anyhow::ensure!(inn[..8] == (i as u64).to_le_bytes(), "message {i} garbled");
            }
        }
    }
    w.barrier()?;
    Ok((w.rank() == 0).then(|| row(ctx, "pingpong", "send_recv", size).with_latency(&mut samples)))
}

/// How many windows of 64 messages a bandwidth row times: a quarter of `--iters`, at most
/// 16 GiB in all (4 MiB messages would take half a minute a row), at least 4.
fn windows(ctx: &Ctx, size: usize) -> usize {
    (ctx.iters / 4)
        .min((16usize << 30) / (64 * size.max(1)))
        .max(4)
}

/// Streaming: rank 0 keeps 64 sends in flight to rank 1, which has receives posted; the
/// buffers are ordinary memory, or (`alloc_mem`, variant suffix `+alloc_mem`) memory from
/// MPI_Alloc_mem, which the NIC maps.
pub fn bw(ctx: &Ctx, w: &Comm, size: usize, alloc_mem: bool) -> anyhow::Result<Option<Row>> {
    const WINDOW: usize = 64;
    let reps = windows(ctx, size);
    let mut plain_out = Vec::new();
    let mut plain_in = Vec::new();
    let mem = if alloc_mem {
        let m = w.alloc_mem((WINDOW + 1) * size)?;
        m.bytes()[..size].fill(3);
        Some(m)
    } else {
        plain_out = vec![3u8; size];
        plain_in = vec![0u8; WINDOW * size];
        None
    };
    let (out, inn_all): (&[u8], &mut [u8]) = match &mem {
        Some(m) => {
            let (o, i) = m.bytes().split_at_mut(size);
            (o, i)
        }
        None => (&plain_out, &mut plain_in),
    };
    let mut inn: Vec<&mut [u8]> = inn_all.chunks_mut(size.max(1)).take(WINDOW).collect();
    w.barrier()?;
    let t = Instant::now();
    if w.rank() == 0 {
        for _ in 0..reps {
            let reqs = (0..WINDOW)
                .map(|_| w.isend(out, 1, 2))
                .collect::<Result<Vec<_>, _>>()?;
            softnic::mpi::wait_all(reqs)?;
            w.recv(&mut [], 1, 3)?;
        }
    } else if w.rank() == 1 {
        for _ in 0..reps {
            let reqs = inn
                .iter_mut()
                .map(|b| w.irecv(b, 0, 2))
                .collect::<Result<Vec<_>, _>>()?;
            softnic::mpi::wait_all(reqs)?;
            w.send(&[], 0, 3)?;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    w.barrier()?;
    Ok((w.rank() == 0).then(|| {
        let mut r = row(ctx, "bw", "send_recv", size);
        if alloc_mem {
            r.variant = Some("+alloc_mem".into());
        }
        let msgs = (reps * WINDOW) as f64;
        r.mb_s = Some(msgs * size as f64 / secs / 1e6);
        r.mops = Some(msgs / secs / 1e6);
        r
    }))
}

/// One-sided latency by the seed's method: a shared-lock epoch to rank 1 holding one
/// operation, minus an empty epoch, on rank 0 (rank 1 idle in a barrier).
pub fn rma(
    ctx: &Ctx,
    w: &Comm,
    win: &mut Win,
    op: &str,
    size: usize,
) -> anyhow::Result<Option<Row>> {
    w.barrier()?;
    let mut samples = Vec::new();
    if w.rank() == 0 {
        let warm = ctx.lat_warmup(size);
        let origin = vec![1u8; size];
        let mut back = vec![0u8; size];
        let words = vec![1u64; (size / 8).max(1)];
        let mut empty = Vec::with_capacity(ctx.lat_iters(size));
        for i in 0..warm + ctx.lat_iters(size) {
            let t = Instant::now();
            win.lock(LockType::Shared, 1, 0)?;
            win.unlock(1)?;
            let e = t.elapsed().as_secs_f64() * 1e6;
            let t = Instant::now();
            win.lock(LockType::Shared, 1, 0)?;
            match op {
                "put" => win.put(&origin, 1, 0)?,
                "get" => win.get(&mut back, 1, 0)?,
                "accumulate" => win.accumulate(&words, 1, 0, Op::Sum)?,
                "fetch_and_op" => {
                    win.fetch_and_op(1u64, 1, 0, Op::Sum)?;
                }
                "compare_and_swap" => {
                    win.compare_and_swap(1u64, 0u64, 1, 0)?;
                }
                _ => anyhow::bail!("unknown one-sided op {op}"),
            }
            win.unlock(1)?;
            let full = t.elapsed().as_secs_f64() * 1e6;
            if i >= warm {
                samples.push(full);
                empty.push(e);
            }
        }
        let (e, _) = crate::report::median_p99(&mut empty);
        for s in samples.iter_mut() {
            *s = (*s - e).max(0.0);
        }
    }
    w.barrier()?;
    Ok((w.rank() == 0).then(|| {
        let mut r = ctx.row("pingpong", "mpi", "portals", op, size);
        r.variant = Some("lock_shared".into());
        r.with_latency(&mut samples)
    }))
}

/// Collective latency on every rank of the job (`bench: "coll"`): barrier and an 8-byte
/// allreduce, offloaded (`triggered`) and point-to-point (`p2p`); rank 0's median.
pub fn coll(ctx: &Ctx, w: &Comm) -> anyhow::Result<Vec<Row>> {
    use softnic::mpi::CollMode;
    let mut rows = Vec::new();
    let was = w.coll_mode();
    for (mode, name) in [(CollMode::Triggered, "triggered"), (CollMode::P2p, "p2p")] {
        w.set_coll_mode(mode);
        for (op, size) in [("barrier", 0usize), ("allreduce", 8)] {
            w.barrier()?;
            let mut samples = Vec::with_capacity(ctx.iters);
            let mut out = [0u64];
            for i in 0..ctx.warmup() + ctx.iters {
                let t = Instant::now();
                if size == 0 {
                    w.barrier()?;
                } else {
                    w.allreduce(&[i as u64], &mut out, Op::Sum)?;
                }
                if i >= ctx.warmup() {
                    samples.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            if w.rank() == 0 {
                let mut r = ctx.row("coll", "mpi", "portals", op, size);
                r.variant = Some(name.into());
                rows.push(r.with_latency(&mut samples));
            }
        }
    }
    w.set_coll_mode(was);
    Ok(rows)
}

/// One-sided bandwidth: puts of `size` in one lock_all epoch, flushed every 64.
pub fn rma_bw(ctx: &Ctx, w: &Comm, win: &mut Win, size: usize) -> anyhow::Result<Option<Row>> {
    let reps = windows(ctx, size) * 64;
    let origin = vec![5u8; size];
    w.barrier()?;
    let t = Instant::now();
    if w.rank() == 0 {
        win.lock_all(softnic::mpi::mode::NOCHECK)?;
        for k in 0..reps {
            win.put(&origin, 1, 0)?;
            if k % 64 == 63 {
                win.flush(1)?;
            }
        }
        win.unlock_all()?;
    }
    let secs = t.elapsed().as_secs_f64();
    w.barrier()?;
    Ok((w.rank() == 0).then(|| {
        let mut r = ctx.row("bw", "mpi", "portals", "put", size);
        r.mb_s = Some(reps as f64 * size as f64 / secs / 1e6);
        r.mops = Some(reps as f64 / secs / 1e6);
        r
    }))
}

/// The mean epoch over every rank's epochs (each rank runs as many). Not a median: under a
/// contended lock a rank's long waits can be a minority of its epochs that a median drops,
/// while the mean is the time a process spends synchronising.
fn across_ranks(w: &Comm, samples: &[f64]) -> anyhow::Result<f64> {
    let mean = samples.iter().sum::<f64>() / samples.len().max(1) as f64;
    let mut all = vec![0u64; w.size() as usize];
    w.allgather(&[mean.to_bits()], &mut all)?;
    Ok(all.into_iter().map(f64::from_bits).sum::<f64>() / w.size() as f64)
}

/// Synchronisation overhead (`bench: "sync"`, seed 003's figure): the time of an empty
/// epoch with every rank targeting rank 0 — fence, PSCW (rank 0 exposes to all), shared and
/// exclusive lock, lock_all, and an empty flush inside lock_all; `lat_us` is the mean over
/// every rank's epochs. Then the collectives (`bench: "coll"`).
pub fn sync(ctx: &Ctx, w: &Comm, win: &mut Win) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let (me, n) = (w.rank(), w.size());
    let others: Vec<u32> = (1..n).collect();
    for op in [
        "fence",
        "pscw",
        "lock_shared",
        "lock_exclusive",
        "lock_all",
        "flush",
    ] {
        w.barrier()?;
        if op == "flush" {
            win.lock_all(0)?;
        }
        let mut samples = Vec::with_capacity(ctx.iters);
        for i in 0..ctx.warmup() + ctx.iters {
            let t = Instant::now();
            match op {
                "fence" => win.fence()?,
                "pscw" if me == 0 => {
                    win.post(&others)?;
                    win.wait()?;
                }
                "pscw" => {
                    win.start(&[0])?;
                    win.complete()?;
                }
                "lock_shared" | "lock_exclusive" => {
                    let k = if op == "lock_shared" {
                        LockType::Shared
                    } else {
                        LockType::Exclusive
                    };
                    win.lock(k, 0, 0)?;
                    win.unlock(0)?;
                }
                "lock_all" => {
                    win.lock_all(0)?;
                    win.unlock_all()?;
                }
                _ => win.flush(0)?,
            }
            if i >= ctx.warmup() {
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        if op == "flush" {
            win.unlock_all()?;
        }
        if op == "fence" {
            // Leave the fence epoch before the next kind of synchronisation.
            w.barrier()?;
        }
        let m = across_ranks(w, &samples)?;
        if me == 0 {
            let mut r = ctx.row("sync", "mpi", "portals", op, 0);
            r.lat_us = Some(m);
            rows.push(r);
        }
    }
    rows.extend(coll(ctx, w)?);
    Ok(rows)
}

/// Per-operation latency vs operations per lock epoch (`bench: "epoch"`, field `per_epoch`):
/// rank 0 puts `k` × 8 bytes to rank 1 inside one shared-lock epoch; `lat_us` is the epoch's
/// time over `k`.
pub fn epoch(ctx: &Ctx, w: &Comm, win: &mut Win, per_epoch: &[u32]) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &k in per_epoch {
        w.barrier()?;
        let mut samples = Vec::new();
        if w.rank() == 0 {
            let origin = [1u8; 8];
            let reps = (ctx.iters / k.max(1) as usize).max(20);
            for i in 0..reps + reps / 10 + 2 {
                let t = Instant::now();
                win.lock(LockType::Shared, 1, 0)?;
                for j in 0..k {
                    win.put(&origin, 1, 8 * (j as u64 % 64))?;
                }
                win.unlock(1)?;
                if i >= reps / 10 + 2 {
                    samples.push(t.elapsed().as_secs_f64() * 1e6 / k as f64);
                }
            }
        }
        w.barrier()?;
        if w.rank() == 0 {
            let mut r = ctx.row("epoch", "mpi", "portals", "put", 8);
            r.per_epoch = Some(k);
            r.variant = Some("lock_shared".into());
            rows.push(r.with_latency(&mut samples));
        }
    }
    Ok(rows)
}

/// What `--api mpi` runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Parts {
    pub lat: bool,
    pub bw: bool,
    pub sync: bool,
    pub epoch: bool,
}

/// Every row `--api mpi` makes for this bench.
pub fn run(
    ctx: &Ctx,
    parts: Parts,
    lat_sizes: &[usize],
    bw_sizes: &[usize],
    per_epoch: &[u32],
) -> anyhow::Result<Vec<Row>> {
    let (lat, bw_on) = (parts.lat, parts.bw);
    let w = softnic::mpi::Mpi::init()?;
    anyhow::ensure!(w.size() >= 2, "MPI benchmarks need at least 2 ranks");
    let max = lat_sizes
        .iter()
        .chain(bw_sizes)
        .copied()
        .max()
        .unwrap_or(8)
        .max(8);
    let mut win = Win::allocate(&w, max.max(512))?;
    let mut rows = Vec::new();
    if lat {
        for &s in lat_sizes {
            rows.extend(under_protocols(&w, s, || pingpong(ctx, &w, s))?);
        }
        for op in ["put", "get", "accumulate"] {
            for &s in lat_sizes {
                rows.extend(rma(ctx, &w, &mut win, op, s.max(8))?);
            }
        }
        for op in ["fetch_and_op", "compare_and_swap"] {
            rows.extend(rma(ctx, &w, &mut win, op, 8)?);
        }
        if !parts.sync {
            rows.extend(coll(ctx, &w)?);
        }
    }
    if parts.sync {
        rows.extend(sync(ctx, &w, &mut win)?);
    }
    if parts.epoch {
        rows.extend(epoch(ctx, &w, &mut win, per_epoch)?);
    }
    if bw_on {
        for alloc_mem in [false, true] {
            for &s in bw_sizes {
                rows.extend(under_protocols(&w, s, || bw(ctx, &w, s, alloc_mem))?);
            }
        }
        for &s in bw_sizes {
            rows.extend(rma_bw(ctx, &w, &mut win, s)?);
        }
    }
    win.free()?;
    Ok(rows)
}
