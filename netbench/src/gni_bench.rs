//! Ping-pong, latency and bandwidth over the Gemini-level API.

use std::time::Instant;

use softnic::gni::{wait_until, MemRegion, Nic, Remote};
use softnic::nic::memory::Perms;
use softnic::phase_trace::{stamp, Phase};

use crate::report::Row;
use crate::Ctx;

pub struct Bufs {
    mem: MemRegion,
    max: usize,
}

const AMO_WORD: usize = 0;
const HEAD: usize = 64;

impl Bufs {
    pub fn new(nic: &mut Nic, max: usize) -> anyhow::Result<Bufs> {
        let mem = nic.mem_register(HEAD + 2 * max + 64, Perms::READ_WRITE)?;
        nic.barrier()?;
        Ok(Bufs { mem, max })
    }
    fn out_off(&self) -> usize {
        HEAD
    }
    fn in_off(&self) -> usize {
        HEAD + self.max + 32
    }
    fn remote(&self, rank: u32, off: usize) -> Remote {
        Remote {
            rank,
            handle: self.mem.handle,
            offset: off as u64,
        }
    }
}

/// Put ping-pong (`op: "put"`): rank 0 puts `size` bytes into rank 1's memory; rank 1 sees them
/// arrive by polling its own memory (the last 8 bytes carry the iteration) and puts back.
/// `lat_us` is half the round trip.
pub fn put_pingpong(
    ctx: &Ctx,
    nic: &mut Nic,
    b: &Bufs,
    size: usize,
) -> anyhow::Result<Option<Row>> {
    let size = size.max(8);
    nic.barrier()?;
    let waiter = nic.client().waiter();
    let warm = ctx.lat_warmup(size);
    let mut samples = Vec::with_capacity(ctx.lat_iters(size));
    let (out, inn) = (b.out_off(), b.in_off());
    let flag = inn + size - 8;
    if ctx.job.rank < 2 {
        let peer = 1 - ctx.job.rank;
        for i in 1..=(warm + ctx.lat_iters(size)) as u64 {
            let t = Instant::now();
            if ctx.job.rank == 1 {
                let mem = &b.mem;
                wait_until(
                    &waiter,
                    || u64::from_le_bytes(mem.bytes()[flag..flag + 8].try_into().unwrap()) == i,
                    || nic.progress(),
                );
                stamp(Phase::RankArrived);
            }
            stamp(Phase::RankPost);
            b.mem.bytes()[out + size - 8..out + size].copy_from_slice(&i.to_le_bytes());
            nic.put_nbi(b.remote(peer, inn), &b.mem.bytes()[out..out + size])?;
            if ctx.job.rank == 0 {
                let mem = &b.mem;
                wait_until(
                    &waiter,
                    || u64::from_le_bytes(mem.bytes()[flag..flag + 8].try_into().unwrap()) == i,
                    || nic.progress(),
                );
                stamp(Phase::RankArrived);
                if i as usize > warm {
                    samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
        }
    }
    nic.gsync_wait()?;
    // Reset the flags for the next size.
    b.mem.bytes()[inn..inn + size].fill(0);
    nic.barrier()?;
    Ok((ctx.job.rank == 0).then(|| {
        ctx.row("pingpong", "gni", "gni", "put", size)
            .with_latency(&mut samples)
    }))
}

/// Times one blocking call on rank 0 (`op` names it), rank 1 idle in a barrier.
fn blocking(
    ctx: &Ctx,
    nic: &mut Nic,
    op: &str,
    size: usize,
    mut f: impl FnMut(&mut Nic) -> anyhow::Result<()>,
) -> anyhow::Result<Option<Row>> {
    nic.barrier()?;
    let mut samples = Vec::new();
    if ctx.job.rank == 0 {
        samples = crate::time_calls(ctx.lat_warmup(size), ctx.lat_iters(size), || f(nic))?;
    }
    nic.barrier()?;
    Ok((ctx.job.rank == 0).then(|| {
        ctx.row("pingpong", "gni", "gni", op, size)
            .with_latency(&mut samples)
    }))
}

pub fn put_blocking(
    ctx: &Ctx,
    nic: &mut Nic,
    b: &Bufs,
    size: usize,
) -> anyhow::Result<Option<Row>> {
    let (out, dst) = (b.out_off(), b.remote(1, b.in_off()));
    let mem = b.mem.clone();
    blocking(ctx, nic, "put_blocking", size, |nic| {
        Ok(nic.put(dst, &mem.bytes()[out..out + size])?)
    })
}

pub fn get(ctx: &Ctx, nic: &mut Nic, b: &Bufs, size: usize) -> anyhow::Result<Option<Row>> {
    let (inn, src) = (b.in_off(), b.remote(1, b.out_off()));
    let mem = b.mem.clone();
    blocking(ctx, nic, "get", size, |nic| {
        Ok(nic.get(&mut mem.bytes()[inn..inn + size], src)?)
    })
}

pub fn afadd(ctx: &Ctx, nic: &mut Nic, b: &Bufs) -> anyhow::Result<Option<Row>> {
    let dst = b.remote(1, AMO_WORD);
    blocking(ctx, nic, "afadd", 8, |nic| {
        nic.afadd(dst, 1)?;
        Ok(())
    })
}

/// Put bandwidth: rank 0 streams `iters` non-blocking puts of `size` bytes from registered
/// memory into rank 1, then waits for remote completion of all.
pub fn put_bw(ctx: &Ctx, nic: &mut Nic, b: &Bufs, size: usize) -> anyhow::Result<Option<Row>> {
    nic.barrier()?;
    let iters = bw_iters(ctx.iters, size);
    let mut row = None;
    if ctx.job.rank == 0 {
        let (out, dst) = (b.out_off(), b.remote(1, b.in_off()));
        let t = Instant::now();
        for _ in 0..iters {
            nic.put_nbi(dst, &b.mem.bytes()[out..out + size])?;
        }
        nic.gsync_wait()?;
        let secs = t.elapsed().as_secs_f64();
        let mut r = ctx.row("bw", "gni", "gni", "put", size);
        r.iters = iters;
        r.mb_s = Some((size * iters) as f64 / secs / 1e6);
        // The message rate: what small sizes are about.
        r.mops = Some(iters as f64 / secs / 1e6);
        row = Some(r);
    }
    nic.barrier()?;
    Ok(row)
}

/// Enough iterations to move at least 64 MiB (bounded), so that large sizes are measured too.
pub fn bw_iters(iters: usize, size: usize) -> usize {
    iters.max((64 << 20) / size.max(1)).min(100_000)
}
