//! HPCC RandomAccess over the NIC: the standard update stream (x ← x·2 ⊕ POLY over GF(2)),
//! a table of 2^n 64-bit words per rank, 4× as many updates as table words, applied as XOR
//! updates at the owner by the NIC (AXOR), then verified by replaying the stream (XOR undoes
//! itself) and counting words that do not hold their initial value.

use std::time::Instant;

use softnic::gni::{Amo, MemRegion, Nic, Remote};
use softnic::nic::memory::Perms;

use crate::report::Row;
use crate::Ctx;

const POLY: u64 = 0x7;
const PERIOD: i64 = 1_317_624_576_693_539_401;

fn step(x: u64) -> u64 {
    (x << 1) ^ if (x as i64) < 0 { POLY } else { 0 }
}

/// The n-th element of the update stream, by repeated squaring in GF(2)\[x\] (HPCC's starts).
pub fn starts(mut n: i64) -> u64 {
    while n < 0 {
        n += PERIOD;
    }
    while n > PERIOD {
        n -= PERIOD;
    }
    if n == 0 {
        return 1;
    }
    // m2[i] = x^(2i) mod POLY.
    let mut m2 = [0u64; 64];
    let mut t = 1u64;
    for m in m2.iter_mut() {
        *m = t;
        t = step(step(t));
    }
    let mut i = 62;
    while i >= 0 && (n >> i) & 1 == 0 {
        i -= 1;
    }
    let mut ran = 2u64;
    while i > 0 {
        let mut sq = 0u64;
        for (j, m) in m2.iter().enumerate() {
            if (ran >> j) & 1 == 1 {
                sq ^= m;
            }
        }
        ran = sq;
        i -= 1;
        if (n >> i) & 1 == 1 {
            ran = step(ran);
        }
    }
    ran
}

/// One rank's share of the update stream: (owner, byte offset in the owner's table, value).
pub fn stream(rank: u32, ranks: u32, log_local: u32) -> impl Iterator<Item = (u32, u64, u64)> {
    let local = 1u64 << log_local;
    let global_mask = local * ranks as u64 - 1;
    let mut ran = starts((4 * local * rank as u64) as i64);
    (0..4 * local).map(move |_| {
        ran = step(ran);
        let idx = ran & global_mask;
        ((idx >> log_local) as u32, (idx & (local - 1)) * 8, ran)
    })
}

/// How updates reach a remote owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// One NIC AXOR per update.
    NicAmo,
    /// Updates bucketed per owner (as HPCC's MPI version buckets them) and sent as vector
    /// AXORs of `BUCKET` updates, applied by the owner's NIC.
    NicAmoBucketed,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::NicAmo => "nic-amo",
            Variant::NicAmoBucketed => "nic-amo-bucketed",
        }
    }
}

const BUCKET: usize = 256;

/// Applies this rank's share of the update stream once.
fn updates(
    ctx: &Ctx,
    nic: &mut Nic,
    table: &MemRegion,
    log_local: u32,
    v: Variant,
) -> anyhow::Result<()> {
    let mut buckets: Vec<Vec<(u64, u64)>> = (0..ctx.job.size)
        .map(|_| Vec::with_capacity(BUCKET))
        .collect();
    for (owner, off, ran) in stream(ctx.job.rank, ctx.job.size, log_local) {
        if owner == ctx.job.rank {
            table
                .word(off as usize)
                .fetch_xor(ran, std::sync::atomic::Ordering::Relaxed);
            continue;
        }
        match v {
            Variant::NicAmo => nic.amo_nbi(
                Amo::Axor,
                Remote {
                    rank: owner,
                    handle: table.handle,
                    offset: off,
                },
                ran,
                0,
            )?,
            Variant::NicAmoBucketed => {
                let b = &mut buckets[owner as usize];
                b.push((off, ran));
                if b.len() == BUCKET {
                    nic.amo_scatter_nbi(Amo::Axor, owner, table.handle, b)?;
                    b.clear();
                }
            }
        }
    }
    for (owner, b) in buckets.iter().enumerate() {
        if !b.is_empty() {
            nic.amo_scatter_nbi(Amo::Axor, owner as u32, table.handle, b)?;
        }
    }
    nic.gsync_wait()?;
    Ok(())
}

/// HPCC's update stream splits the table by the high bits of the index: ranks must be 2^k.
pub fn check_ranks(ctx: &Ctx) -> anyhow::Result<()> {
    anyhow::ensure!(
        ctx.job.size.is_power_of_two(),
        "RandomAccess needs a power-of-two number of ranks"
    );
    Ok(())
}

pub fn run(
    ctx: &Ctx,
    nic: &mut Nic,
    log_local: u32,
    verify: bool,
    v: Variant,
) -> anyhow::Result<Option<Row>> {
    check_ranks(ctx)?;
    let local = 1usize << log_local;
    let table = nic.mem_register(local * 8, Perms::READ_WRITE)?;
    let errs = nic.mem_register(8, Perms::READ_WRITE)?;
    nic.barrier()?;
    let base = local as u64 * ctx.job.rank as u64;
    for i in 0..local {
        table
            .word(i * 8)
            .store(base + i as u64, std::sync::atomic::Ordering::Relaxed);
    }
    nic.barrier()?;
    let t = Instant::now();
    updates(ctx, nic, &table, log_local, v)?;
    nic.barrier()?;
    let secs = t.elapsed().as_secs_f64();
    let mut errors = None;
    if verify {
        updates(ctx, nic, &table, log_local, v)?;
        nic.barrier()?;
        let bad = (0..local)
            .filter(|&i| table.read_u64(i * 8) != base + i as u64)
            .count() as u64;
        nic.amo(
            Amo::Aadd,
            Remote {
                rank: 0,
                handle: errs.handle,
                offset: 0,
            },
            bad,
            0,
        )?;
        nic.barrier()?;
        errors = Some(errs.read_u64(0));
    }
    let total = 4 * local as u64 * ctx.job.size as u64;
    Ok((ctx.job.rank == 0).then(|| {
        let mut r = ctx.row("randomaccess", "gni", "gni", "axor", local * 8);
        r.iters = total as usize;
        r.gups = Some(total as f64 / secs / 1e9);
        r.mops = Some(total as f64 / secs / 1e6);
        r.errors = errors;
        r.variant = Some(v.name().into());
        r
    }))
}

/// RandomAccess over DMAPP: the table in the symmetric heap, each remote update one
/// `axor_qw_nbi` (HPCC rules: the same stream, verification by replaying it).
pub fn run_dmapp(
    ctx: &Ctx,
    d: &mut softnic::dmapp::Dmapp,
    log_local: u32,
    verify: bool,
) -> anyhow::Result<Option<Row>> {
    check_ranks(ctx)?;
    let local = 1usize << log_local;
    let heap = d.get_jobinfo().sheap_seg;
    let table = d.sheap_malloc(local * 8)?;
    let errs = d.sheap_malloc(8)?;
    let mem = d.sheap_region();
    let at = |addr: u64| (addr - mem.as_ptr() as u64) as usize;
    let base = local as u64 * ctx.job.rank as u64;
    for i in 0..local {
        mem.word(at(table) + i * 8)
            .store(base + i as u64, std::sync::atomic::Ordering::Relaxed);
    }
    mem.word(at(errs))
        .store(0, std::sync::atomic::Ordering::Relaxed);
    d.barrier()?;
    let pass = |d: &mut softnic::dmapp::Dmapp| -> anyhow::Result<()> {
        for (owner, off, ran) in stream(ctx.job.rank, ctx.job.size, log_local) {
            if owner == ctx.job.rank {
                mem.word(at(table) + off as usize)
                    .fetch_xor(ran, std::sync::atomic::Ordering::Relaxed);
            } else {
                d.axor_qw_nbi(table + off, &heap, owner, ran)?;
            }
        }
        d.gsync_wait()?;
        Ok(())
    };
    let t = Instant::now();
    pass(d)?;
    d.barrier()?;
    let secs = t.elapsed().as_secs_f64();
    let mut errors = None;
    if verify {
        pass(d)?;
        d.barrier()?;
        let bad = (0..local)
            .filter(|&i| mem.read_u64(at(table) + i * 8) != base + i as u64)
            .count() as u64;
        d.aadd_qw(errs, &heap, 0, bad)?;
        d.barrier()?;
        errors = Some(mem.read_u64(at(errs)));
    }
    d.sheap_free(errs)?;
    d.sheap_free(table)?;
    let total = 4 * local as u64 * ctx.job.size as u64;
    Ok((ctx.job.rank == 0).then(|| {
        let mut r = ctx.row("randomaccess", "dmapp", "dmapp", "axor", local * 8);
        r.iters = total as usize;
        r.gups = Some(total as f64 / secs / 1e9);
        r.mops = Some(total as f64 / secs / 1e6);
        r.errors = errors;
        r.variant = Some("axor-nbi".into());
        r
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_jumps_match_stepping() {
        let mut x = 1u64;
        for n in 0..2000i64 {
            assert_eq!(starts(n), x, "n = {n}");
            x = step(x);
        }
    }
}
