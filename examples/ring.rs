//! ring: a token travels around the ring of ranks over the Gemini-level API (each rank puts it
//! into the next rank's memory and waits for it to come round), a few times; then every rank
//! puts a 64 KiB block (BTE) into the next one and checks the block its predecessor sent.
//! Rank 0 prints `ring ok N ranks`. Any mismatch ends the rank with an error naming it.
//!
//! ```sh
//! cargo build --release --examples
//! target/release/softnic run -n 4 -- target/release/examples/ring [ROUNDS]
//! ```

use anyhow::{bail, Context};
use softnic::gni::{wait_until, Nic, Remote};
use softnic::nic::memory::Perms;

const BLOCK: usize = 64 * 1024;
const BLOCK_AT: u64 = 4096;

fn block(rank: u32) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(rank * 7) as u8)
        .collect()
}

fn main() -> anyhow::Result<()> {
    let rounds: u64 = match std::env::args().nth(1) {
        Some(a) => a.parse().context("ROUNDS must be a number")?,
        None => 3,
    };
    let mut nic = Nic::init().context("attaching to the soft NIC")?;
    let (me, n) = (nic.rank(), nic.size());
    let mem = nic.mem_register(BLOCK_AT as usize + BLOCK, Perms::READ_WRITE)?;
    nic.barrier()?;
    let next = Remote {
        rank: (me + 1) % n,
        handle: mem.handle,
        offset: 0,
    };
    let waiter = nic.client().waiter();
    for round in 1..=rounds {
        let base = round << 32;
        if me == 0 {
            nic.put(next, &(base + 1).to_le_bytes())?;
        }
        // The token arrives as base + (hops so far); rank 0 sees it after n hops.
        let want = base + if me == 0 { n as u64 } else { me as u64 };
        let m = mem.clone();
        wait_until(&waiter, || m.read_u64(0) >= base, || nic.progress());
        let got = mem.read_u64(0);
        if got != want {
            bail!("rank {me}: round {round}: token {got:#x}, expected {want:#x}");
        }
        if me != 0 {
            nic.put(next, &(got + 1).to_le_bytes())?;
        }
    }
    nic.put(
        Remote {
            offset: BLOCK_AT,
            ..next
        },
        &block(me),
    )?;
    nic.barrier()?;
    let prev = (me + n - 1) % n;
    if mem.bytes()[BLOCK_AT as usize..] != block(prev)[..] {
        bail!("rank {me}: the block from rank {prev} arrived damaged");
    }
    nic.barrier()?;
    if me == 0 {
        println!("ring ok {n} ranks");
    }
    Ok(())
}
