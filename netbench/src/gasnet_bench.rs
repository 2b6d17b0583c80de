//! GASNet over a conduit (`--conduit udp|portals`): Active Message round trips, blocking put and
//! get, non-blocking put bandwidth.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Instant;

use softnic::gasnet::{Category, Gasnet, Handler, Msg, Token};
use softnic::phase_trace::{stamp, Phase};

use crate::report::Row;
use crate::Ctx;

const H_PING: u8 = 200;
const H_PONG: u8 = 201;

/// Attaches with the handlers the AM and RandomAccess benchmarks use.
pub fn init(ra_acks: &Rc<Cell<u64>>) -> anyhow::Result<(Gasnet, Rc<Cell<u64>>)> {
    let pongs = Rc::new(Cell::new(0u64));
    let p = pongs.clone();
    // A failed reply is fatal, as in GASNet: the launcher sees the rank die instead of a hang.
    let ping: Handler = Box::new(|t: &mut Token<'_>, m: Msg<'_>| {
        stamp(Phase::RankArrived);
        stamp(Phase::RankPost);
        let r = match m.category {
            Category::Short => t.reply_short(H_PONG, m.args),
            Category::Medium => t.reply_medium(H_PONG, m.payload, m.args),
            Category::Long => t.reply_long(H_PONG, m.payload, m.offset, m.args),
        };
        if let Err(e) = r {
            eprintln!("netbench: AM reply failed: {e}");
            std::process::exit(1);
        }
    });
    let pong: Handler = Box::new(move |_: &mut Token<'_>, _: Msg<'_>| {
        stamp(Phase::RankArrived);
        p.set(p.get() + 1)
    });
    let mut hs = vec![(H_PING, ping), (H_PONG, pong)];
    hs.extend(crate::gasnet_ra::handlers(ra_acks));
    let g = Gasnet::init(hs)?;
    Ok((g, pongs))
}

fn row(ctx: &Ctx, g: &Gasnet, bench: &str, op: &str, size: usize) -> Row {
    ctx.row(bench, "gasnet", g.conduit_name(), op, size)
}

/// AM request/reply round trip (`op: am_short | am_medium | am_long`), rank 0 → rank 1.
pub fn am(
    ctx: &Ctx,
    g: &mut Gasnet,
    pongs: &Rc<Cell<u64>>,
    op: &str,
    size: usize,
) -> anyhow::Result<Option<Row>> {
    g.barrier()?;
    let size = match op {
        "am_short" => 0,
        "am_medium" => size.min(g.am_max_medium()),
        _ => size.min(g.am_max_long_request()),
    };
    let payload = vec![7u8; size];
    let mut samples = Vec::new();
    if ctx.job.rank == 0 {
        samples = crate::time_calls(ctx.lat_warmup(size), ctx.lat_iters(size), || {
            let before = pongs.get();
            stamp(Phase::RankPost);
            match op {
                "am_short" => g.am_request_short(1, H_PING, &[1, 2])?,
                "am_medium" => g.am_request_medium(1, H_PING, &payload, &[1, 2])?,
                _ => g.am_request_long(1, H_PING, &payload, 4096, &[1, 2])?,
            }
            g.block_until(|| pongs.get() > before)?;
            Ok(())
        })?;
    }
    g.barrier()?;
    Ok((ctx.job.rank == 0).then(|| row(ctx, g, "am", op, size).with_latency(&mut samples)))
}

/// AM Short flood (`op: am_short_flood`): rank 0 sends requests back to back, each answered
/// by a reply, and waits for all the replies; `Mops` is requests per second (millions), the
/// message rate a runtime's small AMs get.
pub fn am_flood(ctx: &Ctx, g: &mut Gasnet, pongs: &Rc<Cell<u64>>) -> anyhow::Result<Option<Row>> {
    g.barrier()?;
    let n = (ctx.iters * 20).clamp(1_000, 100_000) as u64;
    let mut out = None;
    if ctx.job.rank == 0 {
        let before = pongs.get();
        let t = Instant::now();
        for _ in 0..n {
            g.am_request_short(1, H_PING, &[1, 2])?;
        }
        g.block_until(|| pongs.get() >= before + n)?;
        let secs = t.elapsed().as_secs_f64();
        let mut r = row(ctx, g, "am", "am_short_flood", 0);
        r.iters = n as usize;
        r.mops = Some(n as f64 / secs / 1e6);
        out = Some(r);
    }
    g.barrier()?;
    Ok(out)
}

/// One blocking put or get of `size` bytes on rank 0 (`op: put_blocking | get`).
pub fn blocking(ctx: &Ctx, g: &mut Gasnet, get: bool, size: usize) -> anyhow::Result<Option<Row>> {
    g.barrier()?;
    let mut buf = vec![1u8; size];
    let mut samples = Vec::new();
    if ctx.job.rank == 0 {
        samples = crate::time_calls(ctx.lat_warmup(size), ctx.lat_iters(size), || {
            if get {
                g.get(&mut buf, 1, 0)?;
            } else {
                g.put(1, 0, &buf)?;
            }
            Ok(())
        })?;
    }
    g.barrier()?;
    let op = if get { "get" } else { "put_blocking" };
    Ok((ctx.job.rank == 0).then(|| row(ctx, g, "pingpong", op, size).with_latency(&mut samples)))
}

/// Non-blocking put bandwidth: rank 0 streams puts (implicit handles) then syncs them all.
pub fn bw(ctx: &Ctx, g: &mut Gasnet, size: usize) -> anyhow::Result<Option<Row>> {
    g.barrier()?;
    let iters = crate::gni_bench::bw_iters(ctx.iters, size).min(4096);
    let src = vec![3u8; size];
    let mut out = None;
    if ctx.job.rank == 0 {
        let t = Instant::now();
        for _ in 0..iters {
            g.put_nbi(1, 0, &src)?;
        }
        g.wait_syncnbi_all()?;
        let secs = t.elapsed().as_secs_f64();
        let mut r = row(ctx, g, "bw", "put_nbi", size);
        r.iters = iters;
        r.mb_s = Some((size * iters) as f64 / secs / 1e6);
        // The message rate: what small sizes are about.
        r.mops = Some(iters as f64 / secs / 1e6);
        out = Some(r);
    }
    g.barrier()?;
    Ok(out)
}

/// Where rank 0 tells the busy rank 1 to stop computing (past the buffers the others use).
const STOP_AT: u64 = 8 << 20;
/// How long the target computes between two looks at the network.
const COMPUTE: std::time::Duration = std::time::Duration::from_millis(10);

/// One-sided progress: blocking puts from rank 0 to rank 1 while rank 1 waits in a barrier
/// (`variant: target_idle`) and while it computes for 10 ms at a time without calling GASNet
/// (`target_busy_10ms`). Over the NIC the second costs nothing more; a conduit that needs the
/// target's help waits for its next poll.
pub fn progress(ctx: &Ctx, g: &mut Gasnet, size: usize) -> anyhow::Result<Vec<Row>> {
    let iters = ctx.iters.min(200);
    let buf = vec![5u8; size];
    let mut rows = Vec::new();
    for busy in [false, true] {
        if ctx.job.rank == 1 {
            g.segment()[STOP_AT as usize..STOP_AT as usize + 8].fill(0);
        }
        g.barrier()?;
        let mut samples = Vec::new();
        if ctx.job.rank == 0 {
            samples = crate::time_calls(10, iters, || Ok(g.put(1, 0, &buf)?))?;
            if busy {
                g.put(1, STOP_AT, &1u64.to_le_bytes())?;
            }
        } else if ctx.job.rank == 1 && busy {
            while g.segment()[STOP_AT as usize] == 0 {
                let t = Instant::now();
                while t.elapsed() < COMPUTE {
                    std::hint::black_box(t.elapsed());
                }
                g.am_poll()?;
            }
        }
        g.barrier()?;
        if ctx.job.rank == 0 {
            let mut r = row(ctx, g, "progress", "put_blocking", size).with_latency(&mut samples);
            r.iters = iters;
            r.variant = Some(
                if busy {
                    "target_busy_10ms"
                } else {
                    "target_idle"
                }
                .into(),
            );
            rows.push(r);
        }
    }
    Ok(rows)
}
