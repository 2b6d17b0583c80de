//! GASNet over a conduit (`--conduit udp|portals`): Active Message round trips, blocking put and
//! get, non-blocking put bandwidth.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Instant;

use softnic::gasnet::{Category, Gasnet, Handler, Msg, Token};

use crate::report::{median_p99, Row};
use crate::Ctx;

const H_PING: u8 = 200;
const H_PONG: u8 = 201;

/// Attaches with the handlers the AM and RandomAccess benchmarks use.
pub fn init(ra_acks: &Rc<Cell<u64>>) -> anyhow::Result<(Gasnet, Rc<Cell<u64>>)> {
    let pongs = Rc::new(Cell::new(0u64));
    let p = pongs.clone();
    // A failed reply is fatal, as in GASNet: the launcher sees the rank die instead of a hang.
    let ping: Handler = Box::new(|t: &mut Token<'_>, m: Msg<'_>| {
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
    let pong: Handler = Box::new(move |_: &mut Token<'_>, _: Msg<'_>| p.set(p.get() + 1));
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
    let size = if op == "am_short" {
        0
    } else {
        size.min(g.am_max_medium())
    };
    let payload = vec![7u8; size];
    let mut samples = Vec::with_capacity(ctx.iters);
    if ctx.rank == 0 {
        for i in 0..ctx.iters + ctx.iters / 10 + 10 {
            let before = pongs.get();
            let t = Instant::now();
            match op {
                "am_short" => g.am_request_short(1, H_PING, &[1, 2])?,
                "am_medium" => g.am_request_medium(1, H_PING, &payload, &[1, 2])?,
                _ => g.am_request_long(1, H_PING, &payload, 4096, &[1, 2])?,
            }
            let p = pongs.clone();
            g.block_until(|| p.get() > before)?;
            if i >= ctx.iters / 10 + 10 {
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    g.barrier()?;
    Ok((ctx.rank == 0).then(|| {
        let (m, q) = median_p99(&mut samples);
        Row {
            lat_us: Some(m),
            lat_us_p99: Some(q),
            ..row(ctx, g, "am", op, size)
        }
    }))
}

/// One blocking put or get of `size` bytes on rank 0 (`op: put_blocking | get`).
pub fn blocking(ctx: &Ctx, g: &mut Gasnet, get: bool, size: usize) -> anyhow::Result<Option<Row>> {
    g.barrier()?;
    let mut buf = vec![1u8; size];
    let mut samples = Vec::with_capacity(ctx.iters);
    if ctx.rank == 0 {
        for i in 0..ctx.iters + ctx.iters / 10 + 10 {
            let t = Instant::now();
            if get {
                g.get(&mut buf, 1, 0)?;
            } else {
                g.put(1, 0, &buf)?;
            }
            if i >= ctx.iters / 10 + 10 {
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    g.barrier()?;
    let op = if get { "get" } else { "put_blocking" };
    Ok((ctx.rank == 0).then(|| {
        let (m, q) = median_p99(&mut samples);
        Row {
            lat_us: Some(m),
            lat_us_p99: Some(q),
            ..row(ctx, g, "pingpong", op, size)
        }
    }))
}

/// Non-blocking put bandwidth: rank 0 streams puts (implicit handles) then syncs them all.
pub fn bw(ctx: &Ctx, g: &mut Gasnet, size: usize) -> anyhow::Result<Option<Row>> {
    g.barrier()?;
    let iters = crate::gni_bench::bw_iters(ctx.iters, size).min(4096);
    let src = vec![3u8; size];
    let mut out = None;
    if ctx.rank == 0 {
        let t = Instant::now();
        for _ in 0..iters {
            g.put_nbi(1, 0, &src)?;
        }
        g.wait_syncnbi_all()?;
        let secs = t.elapsed().as_secs_f64();
        let mut r = row(ctx, g, "bw", "put_nbi", size);
        r.iters = iters;
        r.mb_s = Some((size * iters) as f64 / secs / 1e6);
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
        if ctx.rank == 1 {
            g.segment()[STOP_AT as usize..STOP_AT as usize + 8].fill(0);
        }
        g.barrier()?;
        let mut samples = Vec::with_capacity(iters);
        if ctx.rank == 0 {
            for i in 0..iters + 10 {
                let t = Instant::now();
                g.put(1, 0, &buf)?;
                if i >= 10 {
                    samples.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            if busy {
                g.put(1, STOP_AT, &1u64.to_le_bytes())?;
            }
        } else if ctx.rank == 1 && busy {
            while g.segment()[STOP_AT as usize] == 0 {
                let t = Instant::now();
                while t.elapsed() < COMPUTE {
                    std::hint::black_box(t.elapsed());
                }
                g.am_poll()?;
            }
        }
        g.barrier()?;
        if ctx.rank == 0 {
            let (m, q) = median_p99(&mut samples);
            let mut r = row(ctx, g, "progress", "put_blocking", size);
            r.iters = iters;
            r.lat_us = Some(m);
            r.lat_us_p99 = Some(q);
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
