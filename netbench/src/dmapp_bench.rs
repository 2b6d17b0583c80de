//! DMAPP's figures (seed 001 §4): Fig. 2 latencies, Fig. 3 put_nb bandwidth per processes per
//! node, Fig. 4 the rate of non-blocking puts vs how many are outstanding, Fig. 5 strided put
//! rate vs stride, Fig. 6 AMO rate at PE 0 vs job size; and RandomAccess with AXOR nbi.

use std::time::Instant;

use softnic::client::{wait_until, MemRegion};
use softnic::dmapp::{Dmapp, SegDesc, SyncId, Type};

use crate::report::Row;
use crate::Ctx;

/// Symmetric buffers every benchmark uses (same addresses' offsets on every PE).
pub struct Bufs {
    heap: SegDesc,
    mem: MemRegion,
    /// Source and landing areas, `max` bytes each.
    out: u64,
    inn: u64,
    /// 8192 AMO words, then one word per PE for reductions.
    words: u64,
    slots: u64,
    max: usize,
}

pub const AMO_WORDS: usize = 8192;

impl Bufs {
    pub fn new(d: &mut Dmapp, max: usize) -> anyhow::Result<Bufs> {
        let heap = d.get_jobinfo().sheap_seg;
        let np = d.get_jobinfo().npes as usize;
        let out = d.sheap_malloc(max + 64)?;
        let inn = d.sheap_malloc(max + 64)?;
        let words = d.sheap_malloc(AMO_WORDS * 8)?;
        let slots = d.sheap_malloc(np * 8)?;
        d.barrier()?;
        Ok(Bufs {
            heap,
            mem: d.sheap_region(),
            out,
            inn,
            words,
            slots,
            max,
        })
    }

    fn bytes(&self, addr: u64, len: usize) -> &mut [u8] {
        let at = (addr - self.mem.as_ptr() as u64) as usize;
        &mut self.mem.bytes()[at..at + len]
    }

    fn word(&self, addr: u64) -> u64 {
        self.mem
            .read_u64((addr - self.mem.as_ptr() as u64) as usize)
    }
}

fn row(ctx: &Ctx, bench: &str, op: &str, size: usize) -> Row {
    ctx.row(bench, "dmapp", "dmapp", op, size)
}

/// Fig. 2, `op: "put"`: rank 0 puts `size` bytes into rank 1's heap, rank 1 polls its own
/// memory for the last 8 bytes and puts back; half the round trip.
pub fn put_pingpong(
    ctx: &Ctx,
    d: &mut Dmapp,
    b: &Bufs,
    size: usize,
) -> anyhow::Result<Option<Row>> {
    let size = size.clamp(8, b.max);
    d.barrier()?;
    let waiter = d.nic().client().waiter();
    let warm = ctx.lat_warmup(size);
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    let flag = b.inn + size as u64 - 8;
    if ctx.job.rank < 2 {
        let peer = 1 - ctx.job.rank;
        for i in 1..=(warm + ctx.lat_iters(size)) as u64 {
            let t = Instant::now();
            let arrived = |b: &Bufs| b.word(flag) == i;
            if ctx.job.rank == 1 {
                wait_until(&waiter, || arrived(b), || d.nic().progress());
            }
            b.bytes(b.out + size as u64 - 8, 8)
                .copy_from_slice(&i.to_le_bytes());
            d.put_nbi(
                b.inn,
                &b.heap,
                peer,
                b.bytes(b.out, size),
                size as u64,
                Type::Byte,
            )?;
            if ctx.job.rank == 0 {
                wait_until(&waiter, || arrived(b), || d.nic().progress());
                if i as usize > warm {
                    samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
        }
    }
    d.gsync_wait()?;
    b.bytes(b.inn, size).fill(0);
    d.barrier()?;
    Ok((ctx.job.rank == 0).then(|| row(ctx, "pingpong", "put", size).with_latency(&mut samples)))
}

/// Times one blocking call on rank 0 against rank 1 (`op` names it).
fn blocking(
    ctx: &Ctx,
    d: &mut Dmapp,
    op: &str,
    size: usize,
    mut f: impl FnMut(&mut Dmapp) -> anyhow::Result<()>,
) -> anyhow::Result<Option<Row>> {
    d.barrier()?;
    let mut samples = Vec::new();
    if ctx.job.rank == 0 {
        samples = crate::time_calls(ctx.lat_warmup(size), ctx.lat_iters(size), || f(d))?;
    }
    d.barrier()?;
    Ok((ctx.job.rank == 0).then(|| row(ctx, "pingpong", op, size).with_latency(&mut samples)))
}

/// Fig. 2: `put_blocking`, `get` and `afadd`, each a blocking call's time.
pub fn latencies(ctx: &Ctx, d: &mut Dmapp, b: &Bufs, sizes: &[usize]) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &s in sizes.iter().filter(|&&s| s <= b.max) {
        rows.extend(blocking(ctx, d, "put_blocking", s, |d| {
            Ok(d.put(b.inn, &b.heap, 1, b.bytes(b.out, s), s as u64, Type::Byte)?)
        })?);
    }
    for &s in sizes.iter().filter(|&&s| s <= b.max) {
        rows.extend(blocking(ctx, d, "get", s, |d| {
            Ok(d.get(b.bytes(b.inn, s), b.out, &b.heap, 1, s as u64, Type::Byte)?)
        })?);
    }
    rows.extend(blocking(ctx, d, "afadd", 8, |d| {
        d.afadd_qw(b.words, &b.heap, 1, 1)?;
        Ok(())
    })?);
    Ok(rows)
}

/// The senders of a bandwidth run and their partners: the k-th rank of rank 0's host sends
/// to the k-th rank of the next host.
fn pairs(ctx: &Ctx) -> Vec<(u32, u32)> {
    let hosts = &ctx.job.rank_hosts;
    let h0 = hosts[0];
    let h1 = hosts.iter().copied().find(|h| *h != h0).unwrap_or(h0);
    let on = |h| (0..hosts.len() as u32).filter(move |r| hosts[*r as usize] == h);
    on(h0).zip(on(h1).filter(|r| *r != 0)).collect()
}

/// Collects every sender's elapsed seconds at rank 0 (a put into its slot) and returns the
/// longest, on rank 0.
fn slowest(d: &mut Dmapp, b: &Bufs, me: u32, mine: Option<f64>) -> anyhow::Result<f64> {
    b.bytes(b.slots + me as u64 * 8, 8).fill(0);
    d.barrier()?;
    if let Some(s) = mine {
        let ns = ((s * 1e9) as u64).max(1);
        d.put(
            b.slots + me as u64 * 8,
            &b.heap,
            0,
            &ns.to_le_bytes(),
            1,
            Type::Qw,
        )?;
    }
    d.barrier()?;
    let np = d.get_jobinfo().npes as u64;
    Ok((0..np).map(|r| b.word(b.slots + r * 8)).max().unwrap_or(0) as f64 / 1e9)
}

/// Fig. 3: `put_nb` bandwidth, every sending rank of one host streaming to its partner with
/// up to 64 sync ids in flight; aggregate MB/s over the slowest sender. `ppn` senders.
pub fn put_nb_bw(ctx: &Ctx, d: &mut Dmapp, b: &Bufs, size: usize) -> anyhow::Result<Option<Row>> {
    let size = size.min(b.max);
    let pairs = pairs(ctx);
    let me = ctx.job.rank;
    let iters = crate::gni_bench::bw_iters(ctx.iters, size);
    d.barrier()?;
    let mut mine = None;
    if let Some(&(_, to)) = pairs.iter().find(|(s, _)| *s == me) {
        let mut window: std::collections::VecDeque<SyncId> = Default::default();
        let t = Instant::now();
        for _ in 0..iters {
            if window.len() == 64 {
                d.syncid_wait(window.pop_front().expect("full window"))?;
            }
            window.push_back(d.put_nb(
                b.inn,
                &b.heap,
                to,
                b.bytes(b.out, size),
                size as u64,
                Type::Byte,
            )?);
        }
        for id in window {
            d.syncid_wait(id)?;
        }
        mine = Some(t.elapsed().as_secs_f64());
    }
    let secs = slowest(d, b, me, mine)?;
    Ok((me == 0).then(|| {
        let mut r = row(ctx, "bw", "put_nb", size);
        r.iters = iters;
        r.ppn = Some(pairs.len() as u32);
        let bytes = (size * iters * pairs.len()) as f64;
        r.mb_s = Some(bytes / secs / 1e6);
        r.mops = Some((iters * pairs.len()) as f64 / secs / 1e6);
        r
    }))
}

/// Fig. 4: the rate of `put_nbi` and `put_nb` with `outstanding` in flight before each sync
/// (gsync, or waiting every sync id), and of `put_blocking`; rank 0 to rank 1.
pub fn nbrate(
    ctx: &Ctx,
    d: &mut Dmapp,
    b: &Bufs,
    size: usize,
    outstanding: &[u32],
) -> anyhow::Result<Vec<Row>> {
    let size = size.min(b.max);
    let mut rows = Vec::new();
    let batches = |o: u32| (ctx.iters * 8 / o as usize).max(20);
    for op in ["put_nbi", "put_nb", "put_blocking"] {
        let list: Vec<u32> = if op == "put_blocking" {
            vec![1]
        } else {
            outstanding.to_vec()
        };
        for &o in &list {
            d.barrier()?;
            if ctx.job.rank == 0 {
                let n = batches(o);
                let src = b.bytes(b.out, size);
                let mut ids = Vec::with_capacity(o as usize);
                let t = Instant::now();
                for _ in 0..n {
                    for _ in 0..o {
                        match op {
                            "put_nbi" => {
                                d.put_nbi(b.inn, &b.heap, 1, src, size as u64, Type::Byte)?
                            }
                            "put_nb" => ids.push(d.put_nb(
                                b.inn,
                                &b.heap,
                                1,
                                src,
                                size as u64,
                                Type::Byte,
                            )?),
                            _ => d.put(b.inn, &b.heap, 1, src, size as u64, Type::Byte)?,
                        }
                    }
                    match op {
                        "put_nbi" => d.gsync_wait()?,
                        "put_nb" => {
                            for id in ids.drain(..) {
                                d.syncid_wait(id)?;
                            }
                        }
                        _ => {}
                    }
                }
                let secs = t.elapsed().as_secs_f64();
                let ops = (n * o as usize) as f64;
                let mut r = row(ctx, "nbrate", op, size);
                r.iters = n * o as usize;
                r.outstanding = Some(o);
                r.mops = Some(ops / secs / 1e6);
                r.mb_s = Some(ops * size as f64 / secs / 1e6);
                rows.push(r);
            }
            d.barrier()?;
        }
    }
    Ok(rows)
}

/// Fig. 5: 64-bit strided puts, `nelems` elements at target stride `stride` per `iput_nbi`,
/// against a `put_nbi` per element (`put_nbi_loop`); Mops are elements per µs.
pub fn strided(
    ctx: &Ctx,
    d: &mut Dmapp,
    b: &Bufs,
    stride: u64,
    nelems: u64,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let span = ((nelems - 1) * stride + 1) as usize * 8;
    if span > b.max || nelems * 8 > b.max as u64 {
        return Ok(rows);
    }
    let calls = (ctx.iters * 64 / nelems as usize).clamp(4, 20_000);
    for op in ["iput", "put_nbi_loop"] {
        d.barrier()?;
        if ctx.job.rank == 0 {
            let src = b.bytes(b.out, nelems as usize * 8);
            let t = Instant::now();
            for _ in 0..calls {
                if op == "iput" {
                    d.iput_nbi(b.inn, &b.heap, 1, src, stride as i64, 1, nelems, Type::Qw)?;
                } else {
                    for k in 0..nelems {
                        let at = b.inn + k * stride * 8;
                        d.put_nbi(
                            at,
                            &b.heap,
                            1,
                            &src[k as usize * 8..k as usize * 8 + 8],
                            1,
                            Type::Qw,
                        )?;
                    }
                }
            }
            d.gsync_wait()?;
            let secs = t.elapsed().as_secs_f64();
            let elems = (calls as u64 * nelems) as f64;
            let mut r = row(ctx, "strided", op, 8);
            r.iters = calls;
            r.stride = Some(stride);
            r.nelems = Some(nelems);
            r.mops = Some(elems / secs / 1e6);
            r.mb_s = Some(elems * 8.0 / secs / 1e6);
            rows.push(r);
        }
        d.barrier()?;
    }
    Ok(rows)
}

/// Fig. 6: every rank but 0 aims AMOs at rank 0's words — one word (`single`) or one of 8192
/// at random (`random8k`); `aadd_nbi` and blocking `afadd`; aggregate Mops over the slowest.
pub fn amo(ctx: &Ctx, d: &mut Dmapp, b: &Bufs) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let me = ctx.job.rank;
    let issuers = ctx.job.size.saturating_sub(1).max(1);
    for op in ["aadd_nbi", "afadd"] {
        for variant in ["single", "random8k"] {
            let n = if op == "afadd" {
                ctx.iters
            } else {
                ctx.iters * 20
            };
            // xorshift64: a different word sequence per rank, no dependency.
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (me as u64 + 1);
            let offs: Vec<u64> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    match variant {
                        "single" => 0,
                        _ => (x % AMO_WORDS as u64) * 8,
                    }
                })
                .collect();
            d.barrier()?;
            let mut mine = None;
            if me != 0 || ctx.job.size == 1 {
                let t = Instant::now();
                for &o in &offs {
                    if op == "aadd_nbi" {
                        d.aadd_qw_nbi(b.words + o, &b.heap, 0, 1)?;
                    } else {
                        d.afadd_qw(b.words + o, &b.heap, 0, 1)?;
                    }
                }
                d.gsync_wait()?;
                mine = Some(t.elapsed().as_secs_f64());
            }
            let secs = slowest(d, b, me, mine)?;
            if me == 0 {
                let mut r = row(ctx, "amo", op, 8);
                r.iters = n * issuers as usize;
                r.variant = Some(variant.into());
                r.mops = Some((n * issuers as usize) as f64 / secs / 1e6);
                rows.push(r);
            }
        }
    }
    d.barrier()?;
    Ok(rows)
}
