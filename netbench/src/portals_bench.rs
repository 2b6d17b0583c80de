//! Ping-pong, latency and bandwidth over the Portals 4 API (matching in the NIC).

use std::time::Instant;

use softnic::gni::{wait_until, MemRegion};
use softnic::nic::memory::Perms;
use softnic::phase_trace::{stamp, Phase};
use softnic::portals::*;

use crate::report::Row;
use crate::Ctx;

pub struct Setup {
    ni: NiHandle,
    eq: u32,
    pt: u32,
    ct: u32,
    md: u32,
    out: MemRegion,
    inn: MemRegion,
}

const BITS: u64 = 0x5eed;

pub fn setup(p: &mut Portals, max: usize) -> anyhow::Result<Setup> {
    let (ni, _) = p.ni_init(true, true)?;
    let eq = p.eq_alloc(ni, 4096)?;
    let ct = p.ct_alloc(ni)?;
    let pt = p.pt_alloc(ni, 0, Some(eq), None)?;
    let inn = p.endpoint().mem_register(max + 64, Perms::READ_WRITE)?;
    let out = p.endpoint().mem_register(max + 64, Perms::READ_WRITE)?;
    let mut e = Me::new(
        Buffer {
            region: inn.handle,
            offset: 0,
            len: (max + 64) as u64,
        },
        BITS,
    );
    // The target is not asked to report anything: data lands, the NIC acknowledges.
    e.options |= me_opt::EVENT_COMM_DISABLE | me_opt::EVENT_LINK_DISABLE;
    p.me_append(ni, pt, &e, List::Priority, 0)?;
    let md = p.md_bind(
        ni,
        &Md {
            region: out.handle,
            segments: vec![(0, (max + 64) as u64)],
            options: md_opt::EVENT_CT_ACK,
            eq: Some(eq),
            ct: Some(ct),
        },
    )?;
    p.endpoint().barrier()?;
    Ok(Setup {
        ni,
        eq,
        pt,
        ct,
        md,
        out,
        inn,
    })
}

fn target(s: &Setup, rank: u32) -> Target {
    Target {
        id: ProcessId::Logical { rank },
        pt_index: s.pt,
        match_bits: BITS,
        remote_offset: 0,
    }
}

fn drain(p: &mut Portals, s: &Setup) {
    while p.eq_get(s.ni, s.eq).is_ok() {}
}

/// Put-with-ACK ping-pong (`op: "put"`): the payload's last 8 bytes carry the iteration; the
/// peer sees it land by polling its memory and puts back. `lat_us` is half the round trip.
pub fn put_pingpong(
    ctx: &Ctx,
    p: &mut Portals,
    s: &Setup,
    size: usize,
) -> anyhow::Result<Option<Row>> {
    let size = size.max(8);
    p.endpoint().barrier()?;
    let waiter = p.endpoint().client().waiter();
    let warm = ctx.lat_warmup(size);
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    if ctx.job.rank < 2 {
        let peer = 1 - ctx.job.rank;
        let flag = size - 8;
        for i in 1..=(warm + ctx.lat_iters(size)) as u64 {
            let t = Instant::now();
            let arrived = |m: &MemRegion| {
                u64::from_le_bytes(m.bytes()[flag..flag + 8].try_into().unwrap()) == i
            };
            if ctx.job.rank == 1 {
                wait_until(&waiter, || arrived(&s.inn), || drain(p, s));
                stamp(Phase::RankArrived);
            }
            stamp(Phase::RankPost);
            s.out.bytes()[flag..flag + 8].copy_from_slice(&i.to_le_bytes());
            p.put(
                s.ni,
                s.md,
                0,
                size as u64,
                AckReq::Ack,
                target(s, peer),
                i,
                0,
            )?;
            if ctx.job.rank == 0 {
                wait_until(&waiter, || arrived(&s.inn), || drain(p, s));
                stamp(Phase::RankArrived);
                if i as usize > warm {
                    samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
        }
    }
    drain(p, s);
    s.inn.bytes()[..size].fill(0);
    p.endpoint().barrier()?;
    drain(p, s);
    Ok((ctx.job.rank == 0).then(|| {
        ctx.row("pingpong", "portals", "portals", "put", size)
            .with_latency(&mut samples)
    }))
}

/// A blocking put (`op: "put_blocking"`) on rank 0: the put, then a wait for its ACK on the
/// counting event (PtlCTWait), as MPI's one-sided put completes.
pub fn put_blocking(
    ctx: &Ctx,
    p: &mut Portals,
    s: &Setup,
    size: usize,
) -> anyhow::Result<Option<Row>> {
    p.endpoint().barrier()?;
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    if ctx.job.rank == 0 {
        let warm = ctx.lat_warmup(size);
        let mut acked = p.ct_get(s.ni, s.ct)?.success;
        for i in 0..warm + ctx.lat_iters(size) {
            let t = Instant::now();
            p.put(
                s.ni,
                s.md,
                0,
                size as u64,
                AckReq::CtAck,
                target(s, 1),
                0,
                0,
            )?;
            acked += 1;
            p.ct_wait(s.ni, s.ct, acked)?;
            if i >= warm {
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
            // SEND events: keep the queue from filling.
            if i % 256 == 0 {
                drain(p, s);
            }
        }
        drain(p, s);
    }
    p.endpoint().barrier()?;
    Ok((ctx.job.rank == 0).then(|| {
        ctx.row("pingpong", "portals", "portals", "put_blocking", size)
            .with_latency(&mut samples)
    }))
}

/// One blocking get or fetch-atomic on rank 0 (waiting for its REPLY event).
pub fn get_like(
    ctx: &Ctx,
    p: &mut Portals,
    s: &Setup,
    size: usize,
    fetch: bool,
) -> anyhow::Result<Option<Row>> {
    p.endpoint().barrier()?;
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    if ctx.job.rank == 0 {
        let warm = ctx.lat_warmup(size);
        for i in 0..warm + ctx.lat_iters(size) {
            let t = Instant::now();
            if fetch {
                p.fetch_atomic(
                    s.ni,
                    s.md,
                    64,
                    s.md,
                    0,
                    8,
                    target(s, 1),
                    0,
                    0,
                    AtomicOp::Sum,
                    Datatype::Uint64,
                )?;
            } else {
                p.get(s.ni, s.md, 0, size as u64, target(s, 1), 0)?;
            }
            loop {
                let (e, _) = p.eq_wait(s.ni, s.eq)?;
                if e.kind == EventKind::Reply {
                    break;
                }
            }
            if i >= warm {
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    p.endpoint().barrier()?;
    let (op, sz) = if fetch {
        ("fetch_atomic", 8)
    } else {
        ("get", size)
    };
    Ok((ctx.job.rank == 0).then(|| {
        ctx.row("pingpong", "portals", "portals", op, sz)
            .with_latency(&mut samples)
    }))
}

/// Put bandwidth: rank 0 streams puts acknowledged into a counting event, then waits for all.
pub fn put_bw(ctx: &Ctx, p: &mut Portals, s: &Setup, size: usize) -> anyhow::Result<Option<Row>> {
    p.endpoint().barrier()?;
    let iters = crate::gni_bench::bw_iters(ctx.iters, size);
    let mut row = None;
    if ctx.job.rank == 0 {
        let base = p.ct_get(s.ni, s.ct)?.success;
        let t = Instant::now();
        for i in 0..iters {
            p.put(
                s.ni,
                s.md,
                0,
                size as u64,
                AckReq::CtAck,
                target(s, 1),
                0,
                0,
            )?;
            // Keep the event queue from filling with SEND events.
            if i % 256 == 0 {
                drain(p, s);
            }
        }
        p.ct_wait(s.ni, s.ct, base + iters as u64)?;
        let secs = t.elapsed().as_secs_f64();
        drain(p, s);
        let mut r = ctx.row("bw", "portals", "portals", "put", size);
        r.iters = iters;
        r.mb_s = Some((size * iters) as f64 / secs / 1e6);
        // The message rate: what small sizes are about.
        r.mops = Some(iters as f64 / secs / 1e6);
        row = Some(r);
    }
    p.endpoint().barrier()?;
    Ok(row)
}
