//! Host cores (the daemon's own NIC, without its I/O) on the seeded simulated network: Gemini
//! puts, gets and AMOs from 4 ranks on 3 hosts under heavy loss, duplication and reordering give
//! exactly the model's memory and each AMO is applied once; a crashed host's pending
//! operations fail with a typed status and its restart is admitted at once; hostile datagrams
//! change only counters. Everything is a function of the seed.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use softnic::nic::host::ANNOUNCE_MAX_BYTES;
use softnic::nic::memory::{HeapBacking, Perms, Region};
use softnic::nic::sim::SimCluster;
use softnic::shm::{Command, CommandKind, CqEntry, FailedOp, PeerFailure};
use softnic::transport::sim::SimConfig;
use softnic::transport::TransportConfig;
use softnic::wire::{AmoOp, DatagramHeader, Status, HEADER_LEN, TAG_LEN};

const JOB: u32 = 7;
const KEY: u64 = 0x1234;
const REGION: usize = 1 << 18;
/// Words 0..COUNTERS are AMO targets; puts land in per-source slots; [SRC, SRC+SRC_LEN) is a
/// fixed pattern (BTE source, get source); gets land at GET_AT.
const COUNTERS: u64 = 8;
const SLOT: u64 = 16 << 10;
const SLOTS_AT: u64 = 4096;
const SRC: u64 = 128 << 10;
const SRC_LEN: u64 = 16 << 10;
const GET_AT: u64 = 192 << 10;
/// Ranks 0 and 1 on host 0, rank 2 on host 1, rank 3 on host 2.
const HOST_OF: [u16; 4] = [0, 0, 1, 2];
const NHOSTS: u16 = 3;

fn session(rank: u32) -> u64 {
    100 + rank as u64
}

fn pattern(rank: u32, i: u64) -> u8 {
    (i as u32).wrapping_mul(31).wrapping_add(rank * 7) as u8
}

fn cfg() -> TransportConfig {
    TransportConfig {
        peer_timeout: 2_000_000_000,
        ..Default::default()
    }
}

fn lossy(seed: u64) -> SimConfig {
    SimConfig {
        seed,
        loss: 0.3,
        duplicate: 0.2,
        reorder: 0.2,
        ..Default::default()
    }
}

/// Attaches the 4 ranks of the job (each with one region, the same handle everywhere).
fn attach_job(c: &mut SimCluster, job: u32) -> Vec<Region> {
    (0..4u32)
        .map(|r| {
            let region = Region::new(HeapBacking::new(REGION), Perms::READ_WRITE);
            let mut src = vec![0u8; SRC_LEN as usize];
            for (i, b) in src.iter_mut().enumerate() {
                *b = pattern(r, i as u64);
            }
            region.write(SRC, &src).unwrap();
            let h = HOST_OF[r as usize];
            c.attach(h, session(r), job, KEY, r, 4).unwrap();
            assert_eq!(c.register(h, session(r), region.clone()), Ok(0));
            region
        })
        .collect()
}

fn cmd(kind: CommandKind, req: u64, to: u32) -> Command {
    Command {
        kind,
        client_req: req,
        host: HOST_OF[to as usize],
        rank: to,
        ..Default::default()
    }
}

/// What the job must leave behind.
#[derive(Default)]
struct Model {
    counters: HashMap<(u32, u64), u64>,
    /// Fetched values per counter, to check each AFADD was applied once.
    fetched: HashMap<(u32, u64), Vec<u64>>,
    /// (target rank, offset, bytes) written by puts.
    writes: Vec<(u32, u64, Vec<u8>)>,
    /// (rank, request, target) of each fetching AMO, to read its value from the completion.
    afadds: Vec<(u32, u64, (u32, u64))>,
    /// (rank, land offset, source rank, source offset, len) of each get.
    gets: Vec<(u32, u64, u32, u64, u64)>,
}

/// Submits `per_rank` random operations from every rank; returns the model and how many
/// operations each rank started.
fn workload(c: &mut SimCluster, rng: &mut StdRng, per_rank: u64) -> (Model, [u64; 4]) {
    let mut m = Model::default();
    let mut started = [0u64; 4];
    let mut next_slot: HashMap<(u32, u32), u64> = HashMap::new();
    let mut get_at = [GET_AT; 4];
    for i in 0..per_rank * 4 {
        let from = (i % 4) as u32;
        let to = rng.gen_range(0..4u32);
        let req = started[from as usize] + 1;
        started[from as usize] += 1;
        let s = session(from);
        let h = HOST_OF[from as usize];
        match rng.gen_range(0..5) {
            0 => {
                let w = rng.gen_range(0..COUNTERS) * 8;
                let mut c0 = cmd(CommandKind::Amo, req, to);
                c0.amo = Some(AmoOp::Afadd);
                c0.remote_off = w;
                c0.operand = 1;
                c.submit(h, s, c0, &[]);
                *m.counters.entry((to, w)).or_default() += 1;
                m.afadds.push((from, req, (to, w)));
            }
            1 => {
                let w = rng.gen_range(0..COUNTERS) * 8;
                let k = rng.gen_range(1..1000u64);
                let mut c0 = cmd(CommandKind::Amo, req, to);
                c0.amo = Some(AmoOp::Aadd);
                c0.remote_off = w;
                c0.operand = k;
                c.submit(h, s, c0, &[]);
                *m.counters.entry((to, w)).or_default() += k;
            }
            2 | 3 => {
                // FMA (inline) or BTE (from the fixed source area), into a fresh slice of
                // the source's slot at the target.
                let bte = rng.gen_bool(0.5);
                let len = if bte {
                    rng.gen_range(1..6000u64)
                } else {
                    rng.gen_range(1..300u64)
                };
                let used = next_slot.entry((from, to)).or_default();
                if *used + len > SLOT {
                    started[from as usize] -= 1;
                    continue;
                }
                let off = SLOTS_AT + from as u64 * SLOT + *used;
                *used += len;
                if bte {
                    let src_off = rng.gen_range(0..SRC_LEN - len);
                    let mut c0 = cmd(CommandKind::PutFrom, req, to);
                    c0.remote_off = off;
                    c0.len = len;
                    c0.local_off = SRC + src_off;
                    c.submit(h, s, c0, &[]);
                    let data = (src_off..src_off + len).map(|j| pattern(from, j)).collect();
                    m.writes.push((to, off, data));
                } else {
                    let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                    let mut c0 = cmd(CommandKind::PutInline, req, to);
                    c0.remote_off = off;
                    c0.len = len;
                    c.submit(h, s, c0, &data);
                    m.writes.push((to, off, data));
                }
            }
            _ => {
                let len = rng.gen_range(1..5000u64);
                let at = get_at[from as usize];
                if at + len > REGION as u64 {
                    started[from as usize] -= 1;
                    continue;
                }
                get_at[from as usize] += len;
                let src_off = rng.gen_range(0..SRC_LEN - len);
                let mut c0 = cmd(CommandKind::Get, req, to);
                c0.remote_off = SRC + src_off;
                c0.len = len;
                c0.local_off = at;
                c.submit(h, s, c0, &[]);
                m.gets.push((from, at, to, src_off, len));
            }
        }
    }
    (m, started)
}

/// What each rank got and each host counted, for a failure message.
fn report(c: &SimCluster, started: &[u64; 4]) -> String {
    let mut s = String::new();
    for r in 0..4u32 {
        s += &format!(
            "rank {r}: {} of {} completed\n",
            c.completions(session(r)).len(),
            started[r as usize]
        );
    }
    for h in 0..NHOSTS {
        if let Some(core) = c.host(h) {
            s += &format!("host {h}: {:?}\n", core.stat_lines());
        }
    }
    s
}

/// The job on a lossy cluster of `seed`, and the random source of its workload.
fn lossy_job(seed: u64) -> (SimCluster, Vec<Region>, StdRng) {
    let mut c = SimCluster::new(NHOSTS, cfg(), lossy(seed));
    let regions = attach_job(&mut c, JOB);
    (c, regions, StdRng::seed_from_u64(seed))
}

fn all_done(c: &SimCluster, started: &[u64; 4]) -> bool {
    (0..4u32).all(|r| c.completions(session(r)).len() as u64 >= started[r as usize])
}

fn check_model(c: &mut SimCluster, regions: &[Region], m: &Model, started: &[u64; 4], what: &str) {
    let mut by_req: HashMap<(u32, u64), CqEntry> = HashMap::new();
    for r in 0..4u32 {
        let done = c.take_completions(session(r));
        assert_eq!(
            done.len() as u64,
            started[r as usize],
            "{what}: rank {r} completions"
        );
        for e in done {
            assert_eq!(
                Status::from_u32(e.status),
                Status::Ok,
                "{what}: rank {r} req {}",
                e.client_req
            );
            assert!(
                by_req.insert((r, e.client_req), e).is_none(),
                "{what}: completed twice"
            );
        }
    }
    for ((t, w), v) in &m.counters {
        let got = regions[*t as usize]
            .atomic(*w, Perms::READ)
            .unwrap()
            .load(Ordering::SeqCst);
        assert_eq!(got, *v, "{what}: counter {w} of rank {t}");
    }
    let mut fetched = m.fetched.clone();
    for (r, req, key) in &m.afadds {
        fetched
            .entry(*key)
            .or_default()
            .push(by_req[&(*r, *req)].value);
    }
    for (key, mut vals) in fetched {
        vals.sort();
        vals.dedup();
        let n = m.afadds.iter().filter(|a| a.2 == key).count();
        assert_eq!(
            vals.len(),
            n,
            "{what}: AFADDs on {key:?} fetched distinct values"
        );
    }
    for (t, off, data) in &m.writes {
        assert_eq!(
            regions[*t as usize].to_vec(*off, data.len()),
            *data,
            "{what}: put at {off} of rank {t}"
        );
    }
    for (r, at, from, src_off, len) in &m.gets {
        let want: Vec<u8> = (*src_off..src_off + len)
            .map(|j| pattern(*from, j))
            .collect();
        assert_eq!(
            regions[*r as usize].to_vec(*at, *len as usize),
            want,
            "{what}: get into rank {r}"
        );
    }
}

#[test]
fn gemini_traffic_matches_the_model_under_loss_duplication_reordering() {
    for seed in 1..=6 {
        let (mut c, regions, mut rng) = lossy_job(seed);
        let (m, started) = workload(&mut c, &mut rng, 150);
        c.run_until(30_000_000_000, |c| all_done(c, &started))
            .unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", report(&c, &started)));
        check_model(&mut c, &regions, &m, &started, &format!("seed {seed}"));
        let s = &c.net.stats;
        assert!(
            s.lost > 100 && s.duplicated > 50 && s.reordered > 50,
            "{s:?}"
        );
        for h in 0..NHOSTS {
            let t = &c.host(h).unwrap().transport.stats;
            assert_eq!(t.peers_declared_dead, 0, "seed {seed}: no false death");
            assert_eq!(t.peer_restarts, 0, "seed {seed}");
        }
    }
}

/// Host 2 crashes with operations on it pending; they fail with `PeerDead` (nothing hangs, and
/// nothing on the other hosts is disturbed); it restarts, a new job runs at once.
#[test]
fn crash_fails_pending_operations_and_the_restarted_host_is_admitted_at_once() {
    for seed in 1..=4 {
        let (mut c, _, mut rng) = lossy_job(seed);
        // Sessions open everywhere first, so that every host knows the incarnation that dies.
        c.run_until(1_000_000_000, |c| {
            (0..NHOSTS)
                .all(|h| (0..NHOSTS).all(|p| p == h || c.host(h).unwrap().transport.is_open(p)))
        })
        .unwrap();
        let (_, started) = workload(&mut c, &mut rng, 200);
        c.run_for(300_000 + seed * 100_000);
        // Certainly pending at the crash: AMOs from rank 0 to rank 3, not yet on the wire.
        let mut started = started;
        for _ in 0..20 {
            started[0] += 1;
            let mut c0 = cmd(CommandKind::Amo, started[0], 3);
            c0.amo = Some(AmoOp::Afadd);
            c0.operand = 1;
            c.submit(0, session(0), c0, &[]);
        }
        c.crash(2);
        c.run_for(50_000_000);
        c.restart(2);
        // Survivors learn of the restart from the new incarnation, long before peer_timeout.
        c.run_until(1_000_000_000, |c| {
            (0..3u32).all(|r| c.completions(session(r)).len() as u64 == started[r as usize])
                && (0..2).all(|h| c.host(h).unwrap().transport.stats.peer_restarts == 1)
        })
        .unwrap_or_else(|e| {
            panic!(
                "seed {seed}: pending operations hang: {e}\n{}",
                report(&c, &started)
            )
        });
        let mut failed = 0;
        for r in 0..3u32 {
            for e in c.take_completions(session(r)) {
                match Status::from_u32(e.status) {
                    Status::Ok => {}
                    Status::PeerDead => {
                        failed += 1;
                        assert_eq!(PeerFailure::unpack(e.value).host, 2, "seed {seed}");
                    }
                    // Started after the restart was noticed: rank 3 is not there any more.
                    Status::NoSuchEndpoint => {}
                    s => panic!("seed {seed}: rank {r}: {s:?}"),
                }
            }
        }
        assert!(
            failed >= 20,
            "seed {seed}: what was pending on the crashed host failed"
        );
        for h in 0..2 {
            let t = &c.host(h).unwrap().transport.stats;
            assert_eq!(t.peer_restarts, 1, "seed {seed}: host {h} saw the restart");
        }
        // A new job everywhere (the old one lost its rank 3): works without waiting.
        for r in 0..3u32 {
            let h = HOST_OF[r as usize];
            c.host_mut(h).unwrap().detach(session(r));
        }
        c.take_completions(session(3)); // what rank 3 saw before its host died
        let regions = attach_job(&mut c, JOB + 1);
        let (m, started) = workload(&mut c, &mut rng, 40);
        c.run_until(1_000_000_000, |c| all_done(c, &started))
            .unwrap_or_else(|e| panic!("seed {seed}: job after restart: {e}"));
        check_model(
            &mut c,
            &regions,
            &m,
            &started,
            &format!("seed {seed}, after restart"),
        );
    }
}

/// A host that goes silent (crashed, not restarted) is given up only after peer_timeout, and
/// then every operation pending on it fails.
#[test]
fn silent_host_fails_pending_operations_after_peer_timeout_not_before() {
    let mut c = SimCluster::new(NHOSTS, cfg(), SimConfig::default());
    attach_job(&mut c, JOB);
    c.run_for(10_000_000);
    c.crash(2);
    for i in 0..10 {
        let mut c0 = cmd(CommandKind::Amo, i + 1, 3);
        c0.amo = Some(AmoOp::Afadd);
        c0.operand = 1;
        c.submit(0, session(0), c0, &[]);
    }
    let t0 = c.now;
    c.run_until(1_900_000_000, |c| !c.completions(session(0)).is_empty())
        .expect_err("failed before peer_timeout");
    c.run_until(1_000_000_000, |c| c.completions(session(0)).len() == 10)
        .expect("failed soon after peer_timeout");
    assert!(c.now - t0 >= 2_000_000_000);
    for e in c.take_completions(session(0)) {
        assert_eq!(Status::from_u32(e.status), Status::PeerDead);
        // The failure names the host, the operation and how long it waited.
        let f = PeerFailure::unpack(e.value);
        assert_eq!((f.host, f.op), (2, Some(FailedOp::Amo)));
        assert!((2_000..2_500).contains(&f.waited_ms), "{f:?}");
    }
    assert_eq!(c.host(0).unwrap().transport.stats.peers_declared_dead, 1);
}

/// Random bytes, truncations and authenticated datagrams with header fields at extremes and
/// bodies of random ops, delivered to a host in the middle of a job: counted and dropped; the
/// job's results are exact and no peer is declared dead or reset.
#[test]
fn hostile_datagrams_change_only_counters() {
    for seed in 1..=3 {
        let (mut c, regions, mut rng) = lossy_job(seed);
        let (m, started) = workload(&mut c, &mut rng, 100);
        let key = c.key().clone();
        let mut n = 0;
        c.run_until(30_000_000_000, |c| {
            n += 1;
            if n % 3 == 0 {
                let to = rng.gen_range(0..NHOSTS);
                let d = hostile(&mut rng, &key, to);
                c.inject(to, &d);
            }
            all_done(c, &started)
        })
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        check_model(
            &mut c,
            &regions,
            &m,
            &started,
            &format!("seed {seed}, hostile"),
        );
        let mut dropped = 0;
        for h in 0..NHOSTS {
            let core = c.host(h).unwrap();
            let t = &core.transport.stats;
            assert_eq!(t.peers_declared_dead, 0, "seed {seed}: host {h}");
            assert_eq!(t.peer_restarts, 0, "seed {seed}: host {h}");
            dropped += t.auth_failures + t.malformed + t.stale + core.stats.malformed_ops;
        }
        assert!(
            dropped > 50,
            "seed {seed}: hostile input counted ({dropped})"
        );
    }
}

fn hostile(rng: &mut StdRng, key: &softnic::wire::Key, to: u16) -> Vec<u8> {
    let extreme = |rng: &mut StdRng| match rng.gen_range(0..5) {
        0 => 0,
        1 => 1,
        2 => u64::MAX,
        3 => u64::MAX / 2,
        _ => rng.gen(),
    };
    match rng.gen_range(0..3) {
        // Random bytes of random length.
        0 => (0..rng.gen_range(0..200)).map(|_| rng.gen()).collect(),
        // Authenticated, then truncated or bit-flipped.
        1 | 2 => {
            let body_len = rng.gen_range(0..120);
            let mut b = vec![0u8; HEADER_LEN + body_len + TAG_LEN];
            let src_host = if rng.gen_bool(0.8) {
                rng.gen_range(0..NHOSTS)
            } else {
                rng.gen()
            };
            DatagramHeader {
                flags: if rng.gen_bool(0.8) { 0 } else { rng.gen() },
                src_host,
                dst_host: to,
                src_epoch: extreme(rng) as u32,
                dst_epoch: extreme(rng) as u32,
                seq: extreme(rng),
                ack: extreme(rng),
                sack: extreme(rng),
                nonce: rng.gen(),
            }
            .write(&mut b);
            for x in &mut b[HEADER_LEN..HEADER_LEN + body_len] {
                *x = rng.gen();
            }
            // A plausible op kind first, so op decoding is exercised too.
            if body_len > 0 {
                b[HEADER_LEN] = rng.gen_range(0..16);
            }
            let len = DatagramHeader::seal(&key.sealing(src_host), &mut b, HEADER_LEN + body_len);
            b.truncate(len);
            if rng.gen_bool(0.2) {
                let cut = rng.gen_range(0..b.len());
                b.truncate(cut);
            }
            b
        }
        _ => unreachable!(),
    }
}

/// A process that joins a job with the wrong key on a host where the job has no rank yet (no
/// one there can compare keys) forms a job apart: its put to the real job's rank fails
/// NoSuchEndpoint and that rank's memory stays untouched, and the real job's ops do not
/// reach it either.
#[test]
fn a_wrong_key_on_another_host_reaches_nothing_of_the_job() {
    let mut c = SimCluster::new(NHOSTS, cfg(), SimConfig::default());
    let victim = Region::new(HeapBacking::new(4096), Perms::READ_WRITE);
    c.attach(0, session(0), JOB, KEY, 0, 2).unwrap();
    assert_eq!(c.register(0, session(0), victim.clone()), Ok(0));
    let intruder = Region::new(HeapBacking::new(4096), Perms::READ_WRITE);
    c.attach(1, session(1), JOB, KEY ^ 1, 1, 2).unwrap();
    assert_eq!(c.register(1, session(1), intruder.clone()), Ok(0));
    let put = |to_host: u16, to: u32| Command {
        kind: CommandKind::PutInline,
        client_req: 1,
        host: to_host,
        rank: to,
        len: 8,
        ..Default::default()
    };
    c.submit(1, session(1), put(0, 0), &[0xee; 8]);
    c.submit(0, session(0), put(1, 1), &[0xdd; 8]);
    c.run_until(1_000_000_000, |c| {
        !c.completions(session(1)).is_empty() && !c.completions(session(0)).is_empty()
    })
    .unwrap();
    for s in [session(0), session(1)] {
        let e = &c.take_completions(s)[0];
        assert_eq!(Status::from_u32(e.status), Status::NoSuchEndpoint);
    }
    assert_eq!(victim.to_vec(0, 8), [0; 8]);
    assert_eq!(intruder.to_vec(0, 8), [0; 8]);
}

/// A process's small put to a host is not held behind another process's bulk transfer to the
/// same host: rank 0 streams 64 BTE puts of 16 KiB to rank 2, rank 1 (same host) then puts
/// 8 bytes to rank 2; rank 1's put completes while most of rank 0's are still on their way.
#[test]
fn a_small_put_passes_another_process_bulk_to_the_same_host() {
    let mut c = SimCluster::new(NHOSTS, cfg(), SimConfig::default());
    let _regions = attach_job(&mut c, JOB);
    for k in 0..64u64 {
        let mut b = cmd(CommandKind::PutFrom, k + 1, 2);
        b.local_off = SRC;
        b.len = SRC_LEN;
        b.remote_off = SLOTS_AT;
        c.submit(HOST_OF[0], session(0), b, &[]);
    }
    let mut small = cmd(CommandKind::PutInline, 1, 2);
    small.remote_off = GET_AT;
    small.len = 8;
    c.submit(HOST_OF[1], session(1), small, &[7u8; 8]);
    c.run_until(10_000_000_000, |c| !c.completions(session(1)).is_empty())
        .expect("the small put completes");
    let bulk_done = c.completions(session(0)).len();
    assert!(
        bulk_done < 32,
        "the small put waited for {bulk_done} of the 64 bulk puts"
    );
    assert_eq!(c.completions(session(1))[0].status, Status::Ok as u32);
    c.run_until(10_000_000_000, |c| c.completions(session(0)).len() == 64)
        .expect("the bulk completes too");
}

/// Strided and indexed puts and gets, and a PE-strided scatter and gather fanned out by the
/// initiator's NIC, over a lossy, duplicating, reordering network: every element lands once,
/// in its place, and each command completes exactly once.
#[test]
fn vector_and_pe_strided_operations_survive_loss() {
    let mut c = SimCluster::new(NHOSTS, cfg(), lossy(41));
    let regions = attach_job(&mut c, JOB);
    // Rank 0: 3000 QWs of pattern to rank 3 at stride 3 (several datagrams of elements).
    let n = 3000u32;
    let data: Vec<u8> = (0..n as u64 * 8).map(|i| pattern(0, i)).collect();
    let mut v = cmd(CommandKind::PutV, 1, 3);
    v.elem = 8;
    v.nelems = n;
    v.remote_off = SLOTS_AT;
    v.operand = 24u64; // stride 3 QWs, in bytes
    v.len = data.len() as u64;
    c.submit(HOST_OF[0], session(0), v, &data);
    // Rank 2: an indexed put of 100 DWs to rank 0, offsets reversed.
    let idx: Vec<u64> = (0..100u64).map(|k| GET_AT + (99 - k) * 4).collect();
    let mut inline: Vec<u8> = idx.iter().flat_map(|o| o.to_le_bytes()).collect();
    inline.extend((0..400u64).map(|i| pattern(2, i)));
    let mut x = cmd(CommandKind::PutV, 1, 0);
    x.elem = 4;
    x.nelems = 100;
    x.indexed = true;
    x.len = inline.len() as u64;
    c.submit(HOST_OF[2], session(2), x, &inline);
    c.run_until(60_000_000_000, |c| {
        !c.completions(session(0)).is_empty() && !c.completions(session(2)).is_empty()
    })
    .expect("both vector puts complete");
    assert_eq!(c.take_completions(session(0))[0].status, Status::Ok as u32);
    assert_eq!(c.take_completions(session(2))[0].status, Status::Ok as u32);
    for k in 0..n as u64 {
        let at = SLOTS_AT + k * 24;
        assert_eq!(
            regions[3].to_vec(at, 8),
            data[k as usize * 8..k as usize * 8 + 8]
        );
    }
    for k in 0..100u64 {
        let want: Vec<u8> = (k * 4..k * 4 + 4).map(|i| pattern(2, i)).collect();
        assert_eq!(
            regions[0].to_vec(GET_AT + (99 - k) * 4, 4),
            want,
            "ixput element {k}"
        );
    }
    // Rank 3 gets them back from rank 0's indexed places into its own memory at stride 2 DWs.
    let mut g = cmd(CommandKind::GetV, 1, 0);
    g.elem = 4;
    g.nelems = 100;
    g.indexed = true;
    g.local_off = GET_AT;
    g.operand2 = 8;
    let list: Vec<u8> = idx.iter().flat_map(|o| o.to_le_bytes()).collect();
    g.len = list.len() as u64;
    c.submit(HOST_OF[3], session(3), g, &list);
    // Rank 1 scatters 64 bytes each to ranks 3, 1 (itself) and 2; then gathers them back.
    let targets = [3u32, 1, 2];
    let mut scatter: Vec<u8> = targets
        .iter()
        .flat_map(|&r| {
            let mut e = r.to_le_bytes().to_vec();
            e.extend(HOST_OF[r as usize].to_le_bytes());
            e.extend([0, 0]);
            e
        })
        .collect();
    let list_len = scatter.len();
    scatter.extend((0..192u64).map(|i| pattern(1, i)));
    let s = Command {
        kind: CommandKind::Ixpe,
        client_req: 7,
        host: HOST_OF[1],
        rank: 1,
        remote_off: 100 << 10,
        operand: 1, // scatter
        operand2: 64,
        nelems: 3,
        len: scatter.len() as u64,
        ..Default::default()
    };
    c.submit(HOST_OF[1], session(1), s, &scatter);
    c.run_until(60_000_000_000, |c| {
        !c.completions(session(3)).is_empty() && !c.completions(session(1)).is_empty()
    })
    .expect("the vector get and the scatter complete");
    assert_eq!(c.take_completions(session(3))[0].status, Status::Ok as u32);
    for k in 0..100u64 {
        let want: Vec<u8> = (k * 4..k * 4 + 4).map(|i| pattern(2, i)).collect();
        assert_eq!(
            regions[3].to_vec(GET_AT + k * 8, 4),
            want,
            "ixget element {k}"
        );
    }
    let done = c.take_completions(session(1));
    assert_eq!(done.len(), 1, "one completion for the whole list");
    assert_eq!((done[0].client_req, done[0].status), (7, Status::Ok as u32));
    for (i, &r) in targets.iter().enumerate() {
        let want: Vec<u8> = (i as u64 * 64..i as u64 * 64 + 64)
            .map(|b| pattern(1, b))
            .collect();
        assert_eq!(
            regions[r as usize].to_vec(s.remote_off, 64),
            want,
            "scatter to rank {r}"
        );
    }
    let gather = Command {
        kind: CommandKind::Ixpe,
        client_req: 8,
        operand: 2,
        local_off: GET_AT,
        len: list_len as u64,
        ..s
    };
    c.submit(HOST_OF[1], session(1), gather, &scatter[..list_len]);
    c.run_until(60_000_000_000, |c| !c.completions(session(1)).is_empty())
        .expect("the gather completes");
    let done = c.take_completions(session(1));
    assert_eq!((done.len(), done[0].status), (1, Status::Ok as u32));
    let want: Vec<u8> = (0..192u64).map(|b| pattern(1, b)).collect();
    assert_eq!(
        regions[1].to_vec(GET_AT, 192),
        want,
        "gathered in list order"
    );
    // A list naming a rank on no host fails as a whole, once.
    let mut bad = scatter[..list_len].to_vec();
    bad[12..14].copy_from_slice(&9u16.to_le_bytes());
    c.submit(
        HOST_OF[1],
        session(1),
        Command {
            client_req: 9,
            ..gather
        },
        &bad,
    );
    c.run_until(60_000_000_000, |c| !c.completions(session(1)).is_empty())
        .expect("the bad gather completes");
    let done = c.take_completions(session(1));
    assert_eq!((done.len(), done[0].client_req), (1, 9));
    assert_eq!(done[0].status, Status::BadRequest as u32);
}

/// EXTOLL's engines over the lossy simulated network: VELO messages of every size from rank 0
/// to rank 3's mailbox arrive once and in order, wrapping its ring (the phase flips), two-slot
/// messages whole; RMA puts and gets raise each notification where it belongs, once; a bad
/// NLA fails with an error notification at the origin and leaves the target untouched; more
/// than 8 MiB is refused.
#[test]
fn velo_and_rma_engines_under_loss() {
    use softnic::nic::rma::{self, Class, Cmd, Notification};
    use softnic::nic::velo::{self, Geometry};
    let mut c = SimCluster::new(NHOSTS, cfg(), lossy(77));
    let regions = attach_job(&mut c, JOB);
    // Rank 3's mailbox (16 slots of 64 B) and every rank's notification queue (32 entries).
    let g = Geometry::new(64, 16).unwrap();
    let mailbox = Region::new(HeapBacking::new(g.region_len() as usize), Perms(0));
    let h3 = c.register(HOST_OF[3], session(3), mailbox.clone()).unwrap();
    let mut open = cmd(CommandKind::VeloOpen, 1, 3);
    (open.local_region, open.operand, open.operand2) = (h3, 64, 16);
    c.submit(HOST_OF[3], session(3), open, &[]);
    let queues: Vec<Region> = (0..4u32)
        .map(|r| {
            let q = Region::new(HeapBacking::new(rma::queue_len(32) as usize), Perms(0));
            let h = c
                .register(HOST_OF[r as usize], session(r), q.clone())
                .unwrap();
            let mut o = cmd(CommandKind::RmaOpen, 2, r);
            (o.local_region, o.operand) = (h, 32);
            c.submit(HOST_OF[r as usize], session(r), o, &[]);
            q
        })
        .collect();
    c.run_until(10_000_000_000, |c| {
        (0..4).all(|r| c.completions(session(r)).len() > (r == 3) as usize)
    })
    .expect("ports open");
    for r in 0..4 {
        assert!(c
            .take_completions(session(r))
            .iter()
            .all(|e| e.status == Status::Ok as u32));
    }
    // 40 messages (more than the ring holds: rank 3 reads as they come).
    let mut read = 0u64;
    let mut got: Vec<Vec<u8>> = Vec::new();
    for k in 0..40u64 {
        let len = (k as usize * 5) % 65;
        let data: Vec<u8> = (0..len).map(|i| (k as usize + i) as u8).collect();
        let mut s = cmd(CommandKind::VeloSend, 100 + k, 3);
        (s.len, s.operand) = (len as u64, k % 256);
        c.submit(HOST_OF[0], session(0), s, &data);
        c.run_until(10_000_000_000, |c| {
            c.completions(session(0)).len() as u64 > k
        })
        .expect("delivered");
        let w = mailbox
            .atomic(g.slot_at(read), Perms(0))
            .unwrap()
            .load(Ordering::Acquire);
        let st = velo::read_status(&g, read, w).expect("a fresh slot");
        assert_eq!((st.src, st.tag as u64, st.len), (0, k, len));
        let mut m = mailbox.to_vec(g.slot_at(read) + 8, len.min(56));
        if st.kind == velo::FIRST_OF_TWO {
            m.extend(mailbox.to_vec(g.slot_at(read + 1) + 8, len - 56));
            read += 1;
        }
        read += 1;
        mailbox
            .atomic(0, Perms(0))
            .unwrap()
            .store(read, Ordering::Release);
        got.push(m);
        assert_eq!(got[k as usize], data, "message {k}");
    }
    assert!(c
        .take_completions(session(0))
        .iter()
        .all(|e| e.status == Status::Ok as u32));
    // RMA: rank 0 puts 20 KiB of its SRC pattern to rank 2 at GET_AT, notifying both sides;
    // then gets it back from there into its own GET_AT + 32 KiB with all three notifications.
    let note_at = |q: &Region, i: u64| {
        let at = rma::entry_at(i, 32);
        let w = [
            q.atomic(at, Perms(0)).unwrap().load(Ordering::Acquire),
            q.atomic(at + 8, Perms(0)).unwrap().load(Ordering::Acquire),
        ];
        Notification::decode(w, rma::phase(i, 32))
    };
    let mut put = cmd(CommandKind::RmaPut, 200, 2);
    (put.local_off, put.remote_off, put.len) = (SRC, GET_AT, SRC_LEN);
    put.operand = (rma::NOTIFY_REQUESTER | rma::NOTIFY_COMPLETER) as u64;
    c.submit(HOST_OF[0], session(0), put, &[]);
    c.run_until(10_000_000_000, |c| !c.completions(session(0)).is_empty())
        .expect("the put completes");
    assert_eq!(c.take_completions(session(0))[0].status, Status::Ok as u32);
    assert_eq!(
        regions[2].to_vec(GET_AT, SRC_LEN as usize),
        regions[0].to_vec(SRC, SRC_LEN as usize)
    );
    let req = note_at(&queues[0], 0).expect("requester at the origin");
    assert_eq!(
        (req.class, req.cmd, req.peer, req.nla),
        (Class::Requester, Cmd::Put, 2, rma::nla(0, SRC))
    );
    let comp = note_at(&queues[2], 0).expect("completer at the target");
    assert_eq!(
        (comp.class, comp.peer, comp.len as u64, comp.nla),
        (Class::Completer, 0, SRC_LEN, rma::nla(0, GET_AT))
    );
    assert!(note_at(&queues[2], 1).is_none(), "once");
    let mut get = cmd(CommandKind::RmaGet, 201, 2);
    (get.local_off, get.remote_off, get.len) = (GET_AT + (32 << 10), GET_AT, SRC_LEN);
    get.operand = (rma::NOTIFY_REQUESTER | rma::NOTIFY_COMPLETER | rma::NOTIFY_RESPONDER) as u64;
    c.submit(HOST_OF[0], session(0), get, &[]);
    c.run_until(10_000_000_000, |c| !c.completions(session(0)).is_empty())
        .expect("the get completes");
    assert_eq!(
        regions[0].to_vec(GET_AT + (32 << 10), SRC_LEN as usize),
        regions[0].to_vec(SRC, SRC_LEN as usize)
    );
    let classes: Vec<Class> = (1..3)
        .map(|i| note_at(&queues[0], i).unwrap().class)
        .collect();
    assert_eq!(classes, [Class::Requester, Class::Completer]);
    assert_eq!(note_at(&queues[2], 1).unwrap().class, Class::Responder);
    // A bad NLA: error completer at the origin, the target untouched; 8 MiB + 1: refused.
    c.take_completions(session(0));
    let before = regions[2].to_vec(0, REGION);
    let mut bad = cmd(CommandKind::RmaPut, 202, 2);
    (bad.local_off, bad.remote_off, bad.len) = (SRC, REGION as u64 - 8, 64);
    bad.operand = rma::NOTIFY_COMPLETER as u64;
    c.submit(HOST_OF[0], session(0), bad, &[]);
    let mut huge = cmd(CommandKind::RmaPut, 203, 2);
    huge.len = rma::MAX_OP + 1;
    c.submit(HOST_OF[0], session(0), huge, &[]);
    c.run_until(10_000_000_000, |c| c.completions(session(0)).len() == 2)
        .expect("both answered");
    let done = c.take_completions(session(0));
    assert_eq!(
        done[0].status,
        Status::BadRequest as u32,
        "over 8 MiB refused at once"
    );
    assert_eq!(done[1].status, Status::OutOfBounds as u32);
    let err = note_at(&queues[0], 3).expect("an error notification");
    assert_eq!(
        (err.class, err.status()),
        (Class::Completer, Status::OutOfBounds)
    );
    assert_eq!(regions[2].to_vec(0, REGION), before, "target untouched");
    assert!(
        note_at(&queues[2], 2).is_none(),
        "nothing raised at the target"
    );
}

/// The NIC names whom a command sends a message to — the daemon tells that process, which
/// keeps its core for it (`Waiter::keep_core`) — puts and VELO messages, not gets or AMOs,
/// which the target does not wait for.
#[test]
fn the_nic_names_the_addressee_of_puts_not_of_gets_or_atomics() {
    let mut c = SimCluster::new(NHOSTS, cfg(), SimConfig::default());
    let _regions = attach_job(&mut c, JOB);
    let tag = c.host(0).unwrap().session_job(session(0)).unwrap();
    let take = |c: &mut SimCluster| c.host_mut(0).unwrap().poll_addressed();
    let mut put = cmd(CommandKind::PutInline, 1, 2);
    put.remote_off = SLOTS_AT;
    put.len = 8;
    c.submit(HOST_OF[0], session(0), put, &[1u8; 8]);
    assert_eq!(take(&mut c), Some((HOST_OF[2], tag, 2)), "a put to rank 2");
    assert_eq!(take(&mut c), None, "told once");
    // A put from memory as long as a kept core waits for is named; a longer one is not (it
    // lands later than its target would spin for it).
    for (len, named) in [(ANNOUNCE_MAX_BYTES, true), (ANNOUNCE_MAX_BYTES + 8, false)] {
        let mut long = cmd(CommandKind::PutFrom, 10 + len, 2);
        (long.local_off, long.len, long.remote_off) = (0, len, 0);
        c.submit(HOST_OF[0], session(0), long, &[]);
        let want = named.then_some((HOST_OF[2], tag, 2));
        assert_eq!(take(&mut c), want, "a put of {len} bytes");
    }
    let mut get = cmd(CommandKind::Get, 2, 3);
    get.local_off = GET_AT;
    get.remote_off = SRC;
    get.len = 8;
    c.submit(HOST_OF[0], session(0), get, &[]);
    assert_eq!(take(&mut c), None, "a get");
    let mut amo = cmd(CommandKind::Amo, 3, 3);
    amo.remote_off = 0;
    amo.len = 8;
    c.submit(HOST_OF[0], session(0), amo, &[]);
    assert_eq!(take(&mut c), None, "an AMO");
    c.run_until(1_000_000_000, |c| c.completions(session(0)).len() == 5)
        .expect("all five complete");
}

/// Nobody waits for an RMA put's acknowledgement (its notifications are raised without it),
/// so it waits for company: when the target, told by its completer notification, answers with
/// a put of its own, that answer's datagram carries it.
#[test]
fn an_rma_puts_acknowledgement_rides_on_the_targets_answer() {
    use softnic::nic::rma;
    let mut c = SimCluster::new(
        NHOSTS,
        cfg(),
        SimConfig {
            seed: 5,
            ..Default::default()
        },
    );
    let regions = attach_job(&mut c, JOB);
    // Notification queues, kept alive while the NIC writes into them.
    let _queues: Vec<Region> = [0u32, 2]
        .iter()
        .map(|&r| {
            let q = Region::new(HeapBacking::new(rma::queue_len(32) as usize), Perms(0));
            let h = c
                .register(HOST_OF[r as usize], session(r), q.clone())
                .unwrap();
            let mut o = cmd(CommandKind::RmaOpen, 1, r);
            (o.local_region, o.operand) = (h, 32);
            c.submit(HOST_OF[r as usize], session(r), o, &[]);
            q
        })
        .collect();
    c.run_until(1_000_000_000, |c| {
        [0u32, 2]
            .iter()
            .all(|&r| !c.completions(session(r)).is_empty())
    })
    .expect("ports open");
    let put = |c: &mut SimCluster, from: u32, to: u32, req: u64, v: u64| {
        let mut p = cmd(CommandKind::RmaImmediate, req, to);
        (p.remote_off, p.len) = (GET_AT, 8);
        p.operand = rma::NOTIFY_COMPLETER as u64;
        c.submit(HOST_OF[from as usize], session(from), p, &v.to_le_bytes());
    };
    let landed = |r: &Region, v: u64| r.to_vec(GET_AT, 8) == v.to_le_bytes();
    for round in 1..=3u64 {
        c.take_completions(session(0));
        let before = c.host(HOST_OF[2]).unwrap().op_datagrams_sent();
        put(&mut c, 0, 2, 10 + round, round);
        c.run_until(1_000_000_000, |_| landed(&regions[2], round))
            .unwrap();
        put(&mut c, 2, 0, 10 + round, round);
        c.run_until(1_000_000_000, |c| {
            landed(&regions[0], round) && !c.completions(session(0)).is_empty()
        })
        .unwrap();
        assert_eq!(c.completions(session(0))[0].status, Status::Ok as u32);
        // Round 1 also opens the hosts' session (greetings).
        if round > 1 {
            assert_eq!(
                c.host(HOST_OF[2]).unwrap().op_datagrams_sent() - before,
                1,
                "round {round}: one datagram back, the answer carrying the acknowledgement"
            );
        }
    }
}
