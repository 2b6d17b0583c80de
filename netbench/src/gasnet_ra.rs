//! HPCC RandomAccess over GASNet. The table lives in each node's segment; an update reaches
//! its owner either as a blocking get then put of the word (`get-put`, the naive UPC
//! read-modify-write: concurrent updates of one word can be lost, which verification counts —
//! HPCC tolerates 1%) or as Active Messages the owner applies (`am`: one Short AM per update,
//! acknowledged by a reply, at most 1024 in flight; `am-bucketed`: updates bucketed per owner
//! into Medium AMs, as HPCC's MPI version buckets them, each acknowledged by a reply)
//! or as one remote atomic XOR per update (`atomics`: GASNet-EX AD ops, NBI, at most 1024 in
//! flight as HPCC allows; the portals conduit runs them in the owner's NIC, the udp conduit in
//! an AM handler at the owner).

use std::cell::Cell;
use std::rc::Rc;
use std::time::Instant;

use softnic::gasnet::{AdOp, Gasnet, Handler, Msg, Token};

use crate::randomaccess::stream;
use crate::report::Row;
use crate::Ctx;

/// Handler indices: an update bucket, and its acknowledgement.
pub const H_RA: u8 = 202;
pub const H_RA_ACK: u8 = 203;
/// One update as a Short AM: offset and value, each as two 32-bit arguments.
pub const H_RA_ONE: u8 = 204;
/// Where the table starts in the segment (past the other benchmarks' buffers).
const TABLE_AT: usize = 16 << 20;
/// Where each rank leaves its verification error count on node 0.
const ERRORS_AT: usize = 12 << 20;
/// The get-put variant's table is capped at 2^this words: a blocking round trip per update.
const GET_PUT_MAX_LOG: u32 = 12;
/// The atomics and am variants' cap: one network operation (or AM) per update.
const ATOMICS_MAX_LOG: u32 = 16;
/// HPCC's look-ahead: at most this many updates in flight.
const LOOKAHEAD: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    GetPut,
    Am,
    AmBucketed,
    Atomics,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::GetPut => "get-put",
            Variant::Am => "am",
            Variant::AmBucketed => "am-bucketed",
            Variant::Atomics => "atomics",
        }
    }
}

fn word(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn xor_word(seg: &mut [u8], at: usize, v: u64) {
    let w = word(seg, at) ^ v;
    seg[at..at + 8].copy_from_slice(&w.to_le_bytes());
}

/// The owner's side: XORs each (offset, value) pair of a bucket into its table, then
/// acknowledges. Pairs outside the table are ignored (counted by the sender's verification).
pub fn handlers(acks: &Rc<Cell<u64>>) -> Vec<(u8, Handler)> {
    let update: Handler = Box::new(|t: &mut Token<'_>, m: Msg<'_>| {
        let seg = t.segment();
        for pair in m.payload.chunks_exact(16) {
            let (off, val) = (word(pair, 0) as usize, word(pair, 8));
            if let Some(at) = TABLE_AT.checked_add(off).filter(|a| a + 8 <= seg.len()) {
                xor_word(seg, at, val);
            }
        }
        if let Err(e) = t.reply_short(H_RA_ACK, &[]) {
            eprintln!("netbench: RandomAccess ack failed: {e}");
            std::process::exit(1);
        }
    });
    let one: Handler = Box::new(|t: &mut Token<'_>, m: Msg<'_>| {
        let arg = |i: usize| m.args.get(i).copied().unwrap_or(0) as u64;
        let (off, val) = (arg(0) | arg(1) << 32, arg(2) | arg(3) << 32);
        let seg = t.segment();
        if let Some(at) = usize::try_from(off)
            .ok()
            .and_then(|o| TABLE_AT.checked_add(o))
            .filter(|a| a + 8 <= seg.len())
        {
            xor_word(seg, at, val);
        }
        if let Err(e) = t.reply_short(H_RA_ACK, &[]) {
            eprintln!("netbench: RandomAccess ack failed: {e}");
            std::process::exit(1);
        }
    });
    let a = acks.clone();
    let ack: Handler = Box::new(move |_: &mut Token<'_>, _: Msg<'_>| a.set(a.get() + 1));
    vec![(H_RA, update), (H_RA_ACK, ack), (H_RA_ONE, one)]
}

/// This rank's share of the update stream, applied once.
fn updates(
    ctx: &Ctx,
    g: &mut Gasnet,
    acks: &Rc<Cell<u64>>,
    log_local: u32,
    v: Variant,
) -> anyhow::Result<()> {
    let per_am = g.am_max_medium() / 16;
    let mut buckets: Vec<Vec<u8>> = (0..ctx.job.size).map(|_| Vec::new()).collect();
    let mut sent = 0u64;
    let first_ack = acks.get();
    let mut w = [0u8; 8];
    for (i, (owner, off, ran)) in stream(ctx.job.rank, ctx.job.size, log_local).enumerate() {
        match v {
            Variant::Atomics => {
                // Own words too: plain stores would race with the NIC's atomics on them.
                g.ad_op_nbi(owner, TABLE_AT as u64 + off, AdOp::Xor, ran, 0)?;
                if (i + 1) % LOOKAHEAD == 0 {
                    g.wait_syncnbi_puts()?;
                }
            }
            _ if owner == ctx.job.rank => xor_word(g.segment(), TABLE_AT + off as usize, ran),
            Variant::GetPut => {
                let at = TABLE_AT as u64 + off;
                g.get(&mut w, owner, at)?;
                g.put(owner, at, &(u64::from_le_bytes(w) ^ ran).to_le_bytes())?;
            }
            Variant::Am => {
                let args = [
                    off as u32,
                    (off >> 32) as u32,
                    ran as u32,
                    (ran >> 32) as u32,
                ];
                g.am_request_short(owner, H_RA_ONE, &args)?;
                sent += 1;
                if sent - (acks.get() - first_ack) >= LOOKAHEAD as u64 {
                    let a = acks.clone();
                    g.block_until(|| sent - (a.get() - first_ack) < LOOKAHEAD as u64)?;
                }
            }
            Variant::AmBucketed => {
                let b = &mut buckets[owner as usize];
                b.extend_from_slice(&off.to_le_bytes());
                b.extend_from_slice(&ran.to_le_bytes());
                if b.len() / 16 == per_am {
                    g.am_request_medium(owner, H_RA, b, &[])?;
                    b.clear();
                    sent += 1;
                }
            }
        }
    }
    g.wait_syncnbi_puts()?;
    for (owner, b) in buckets.iter().enumerate() {
        if !b.is_empty() {
            g.am_request_medium(owner as u32, H_RA, b, &[])?;
            sent += 1;
        }
    }
    // Every bucket applied before anyone reads the table.
    let a = acks.clone();
    g.block_until(|| a.get() - first_ack >= sent)?;
    g.barrier()?;
    Ok(())
}

pub fn run(
    ctx: &Ctx,
    g: &mut Gasnet,
    acks: &Rc<Cell<u64>>,
    log_local: u32,
    verify: bool,
    v: Variant,
) -> anyhow::Result<Option<Row>> {
    crate::randomaccess::check_ranks(ctx)?;
    let log_local = match v {
        Variant::GetPut => log_local.min(GET_PUT_MAX_LOG),
        Variant::Atomics | Variant::Am => log_local.min(ATOMICS_MAX_LOG),
        Variant::AmBucketed => log_local,
    };
    let local = 1usize << log_local;
    anyhow::ensure!(
        TABLE_AT + local * 8 <= g.segment().len(),
        "a 2^{log_local}-word table does not fit the segment: raise GASNET_SEGMENT_SIZE"
    );
    let base = local as u64 * ctx.job.rank as u64;
    let seg = g.segment();
    for i in 0..local {
        seg[TABLE_AT + i * 8..TABLE_AT + i * 8 + 8]
            .copy_from_slice(&(base + i as u64).to_le_bytes());
    }
    g.barrier()?;
    let t = Instant::now();
    updates(ctx, g, acks, log_local, v)?;
    let secs = t.elapsed().as_secs_f64();
    let mut errors = None;
    if verify {
        updates(ctx, g, acks, log_local, v)?;
        let seg = g.segment();
        let bad = (0..local)
            .filter(|&i| word(seg, TABLE_AT + i * 8) != base + i as u64)
            .count() as u64;
        g.put(
            0,
            (ERRORS_AT + ctx.job.rank as usize * 8) as u64,
            &bad.to_le_bytes(),
        )?;
        g.barrier()?;
        if ctx.job.rank == 0 {
            let seg = g.segment();
            errors = Some(
                (0..ctx.job.size as usize)
                    .map(|r| word(seg, ERRORS_AT + r * 8))
                    .sum(),
            );
        }
    }
    let total = 4 * local as u64 * ctx.job.size as u64;
    Ok((ctx.job.rank == 0).then(|| {
        let mut r = ctx.row("randomaccess", "gasnet", g.conduit_name(), "xor", local * 8);
        r.iters = total as usize;
        r.gups = Some(total as f64 / secs / 1e9);
        r.mops = Some(total as f64 / secs / 1e6);
        r.errors = errors;
        r.variant = Some(v.name().into());
        r
    }))
}
