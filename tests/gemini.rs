//! The Gemini engine through real daemons on two simulated hosts: put/get of many sizes at
//! unaligned offsets, AMOs under contention, a spin lock, errors, and the same under faults.

mod common;

use common::*;
use softnic::gni::{Amo, GniError, MemHandle, Nic};
use softnic::nic::memory::Perms;
use softnic::wire::Status;

const SIZES: [usize; 9] = [0, 1, 7, 8, 4095, 4096, 4097, 65536, (1 << 20) + 3];
const REGION: usize = 3 << 20;

/// Each rank puts every size into its partner at an unaligned offset, gets it back both into
/// registered memory and into a plain buffer, and (after a barrier) checks what it received.
fn put_get_body(nic: &mut Nic) {
    let me = nic.rank();
    let peer = (me + 1) % nic.size();
    let from = (me + nic.size() - 1) % nic.size();
    let mem = nic.mem_register(REGION, Perms::READ_WRITE).unwrap();
    let local = nic.mem_register(REGION, Perms::READ_WRITE).unwrap();
    nic.barrier().unwrap();
    for (i, &size) in SIZES.iter().enumerate() {
        let off = 13 + i as u64 * 7;
        let data = pattern(size, me as u64 * 100 + i as u64);
        nic.put(remote(peer, mem.handle, off), &data).unwrap();
        // Back into registered memory at another unaligned offset…
        let loff = 5 + i as u64;
        let id = nic
            .get_nb(&local, loff, remote(peer, mem.handle, off), size)
            .unwrap();
        nic.sync_wait(id).unwrap();
        assert_eq!(
            &local.bytes()[loff as usize..loff as usize + size],
            &data[..],
            "get into registered memory, size {size}"
        );
        // …and into a plain buffer (bounce path).
        let mut back = vec![0u8; size];
        nic.get(&mut back, remote(peer, mem.handle, off)).unwrap();
        assert_eq!(back, data, "get into a plain buffer, size {size}");
        // A registered source (BTE path) as well.
        local.bytes()[..size].copy_from_slice(&data);
        nic.put(remote(peer, mem.handle, off + 1), &local.bytes()[..size])
            .unwrap();
        nic.barrier().unwrap();
        let want = pattern(size, from as u64 * 100 + i as u64);
        assert_eq!(
            &mem.bytes()[off as usize + 1..off as usize + 1 + size],
            &want[..],
            "received put, size {size}"
        );
        nic.barrier().unwrap();
    }
}

#[test]
fn put_get_sizes_unaligned() {
    if in_job() {
        return put_get_body(&mut init());
    }
    launch_ok("put_get_sizes_unaligned", 2, 2, &[]);
}

/// The value of `name` in this rank's host's `softnic stat`.
fn stat_value(nic: &Nic, name: &str) -> u64 {
    let text = nic.client().stat().unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).filter(|r| r.starts_with(' ')))
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Both ranks stream 1 MiB puts from registered memory at each other, long enough for the
/// local default's one daemon to hand the last host to its bulk helper: every byte arrives,
/// the lent host's rank goes on making blocking AMOs meanwhile, and once the stream ends the
/// host is handed back and serves a put and a get.
fn bulk_helper_body(nic: &mut Nic) {
    const MIB: usize = 1 << 20;
    const CHUNKS: usize = 8;
    const ROUNDS: u64 = 24;
    let me = nic.rank();
    let peer = 1 - me;
    let mem = nic.mem_register(CHUNKS * MIB, Perms::READ_WRITE).unwrap();
    let src = nic.mem_register(CHUNKS * MIB, Perms::READ_WRITE).unwrap();
    let count = nic.mem_register(8, Perms::READ_WRITE).unwrap();
    for c in 0..CHUNKS {
        src.bytes()[c * MIB..(c + 1) * MIB]
            .copy_from_slice(&pattern(MIB, (me as u64) << 8 | c as u64));
    }
    let want: Vec<Vec<u8>> = (0..CHUNKS)
        .map(|c| pattern(MIB, (peer as u64) << 8 | c as u64))
        .collect();
    nic.barrier().unwrap();
    for round in 0..ROUNDS {
        for c in 0..CHUNKS {
            src.bytes()[c * MIB..c * MIB + 8].copy_from_slice(&round.to_le_bytes());
            let chunk = &src.bytes()[c * MIB..(c + 1) * MIB];
            nic.put_nbi(remote(peer, mem.handle, (c * MIB) as u64), chunk)
                .unwrap();
        }
        if me == 1 {
            nic.afadd(remote(0, count.handle, 0), 1).unwrap();
        }
        nic.gsync_wait().unwrap();
        nic.barrier().unwrap();
        for (c, w) in want.iter().enumerate() {
            let got = &mem.bytes()[c * MIB..(c + 1) * MIB];
            assert_eq!(got[..8], round.to_le_bytes(), "round {round} chunk {c}");
            assert!(got[8..] == w[8..], "round {round} chunk {c} garbled");
        }
        nic.barrier().unwrap();
    }
    if me == 0 {
        assert_eq!(
            u64::from_le_bytes(count.bytes()[..8].try_into().unwrap()),
            ROUNDS
        );
    } else {
        assert!(
            stat_value(nic, "bulk_helper_lends") >= 1,
            "the stream never lent a host"
        );
        let start = std::time::Instant::now();
        while stat_value(nic, "bulk_helper_serving") == 1 {
            assert!(
                start.elapsed().as_secs() < 5,
                "the helper kept the host after the stream"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        nic.put(remote(0, mem.handle, 3), b"back").unwrap();
        let mut back = [0u8; 4];
        nic.get(&mut back, remote(0, mem.handle, 3)).unwrap();
        assert_eq!(&back, b"back");
    }
    nic.barrier().unwrap();
}

#[test]
fn a_stream_lends_a_host_to_the_bulk_helper_and_gets_it_back() {
    if in_job() {
        return bulk_helper_body(&mut init());
    }
    launch_ok(
        "a_stream_lends_a_host_to_the_bulk_helper_and_gets_it_back",
        2,
        2,
        &[],
    );
}

fn afadd_body(nic: &mut Nic) {
    let mem = nic.mem_register(4096, Perms::READ_WRITE).unwrap();
    nic.barrier().unwrap();
    let mut seen = Vec::with_capacity(10_000);
    for _ in 0..10_000 {
        seen.push(nic.afadd(remote(0, mem.handle, 8), 1).unwrap());
    }
    // Each fetched value is distinct within a rank and increasing.
    assert!(seen.windows(2).all(|w| w[0] < w[1]));
    nic.barrier().unwrap();
    if nic.rank() == 0 {
        assert_eq!(mem.read_u64(8), 10_000 * nic.size() as u64);
    }
    nic.barrier().unwrap();
}

#[test]
fn afadd_contention_is_exact() {
    if in_job() {
        return afadd_body(&mut init());
    }
    launch_ok("afadd_contention_is_exact", 4, 2, &[]);
}

fn lock_body(nic: &mut Nic) {
    let mem = nic.mem_register(4096, Perms::READ_WRITE).unwrap();
    nic.barrier().unwrap();
    let lock = remote(0, mem.handle, 0);
    let counter = remote(0, mem.handle, 64);
    for _ in 0..100 {
        while nic.acswap(lock, nic.rank() as u64 + 1, 0).unwrap() != 0 {}
        // Critical section: a non-atomic read-modify-write that only mutual exclusion keeps exact.
        let mut b = [0u8; 8];
        nic.get(&mut b, counter).unwrap();
        let v = u64::from_le_bytes(b) + 1;
        nic.put(counter, &v.to_le_bytes()).unwrap();
        assert_eq!(
            nic.acswap(lock, 0, nic.rank() as u64 + 1).unwrap(),
            nic.rank() as u64 + 1,
            "lock held by us"
        );
    }
    nic.barrier().unwrap();
    if nic.rank() == 0 {
        assert_eq!(mem.read_u64(64), 100 * nic.size() as u64);
    }
    nic.barrier().unwrap();
}

#[test]
fn acswap_spin_lock_excludes() {
    if in_job() {
        return lock_body(&mut init());
    }
    launch_ok("acswap_spin_lock_excludes", 4, 2, &[]);
}

fn all_amos_body(nic: &mut Nic) {
    let mem = nic.mem_register(4096, Perms::READ_WRITE).unwrap();
    nic.barrier().unwrap();
    let me = nic.rank() as u64;
    // AXOR from every rank on both hosts into word 0 of every rank.
    for r in 0..nic.size() {
        for k in 0..64u64 {
            nic.amo_nbi(Amo::Axor, remote(r, mem.handle, 0), (me + 1) << k, 0)
                .unwrap();
        }
    }
    nic.barrier().unwrap();
    let want =
        (0..nic.size() as u64).fold(0u64, |acc, r| (0..64).fold(acc, |a, k| a ^ ((r + 1) << k)));
    assert_eq!(mem.read_u64(0), want);
    nic.barrier().unwrap();
    // Every AMO on the next rank's word 8 + 8*me, checked against its definition.
    if nic.size() > 1 {
        let peer = (nic.rank() + 1) % nic.size();
        let w = remote(peer, mem.handle, 8 + 8 * me);
        let mut model = 0u64;
        let cases = [
            (Amo::Aadd, 5, 0),
            (Amo::Afadd, 7, 0),
            (Amo::Aor, 0xf0, 0),
            (Amo::Afor, 0x0f00, 0),
            (Amo::Aand, 0xfff0, 0),
            (Amo::Afand, 0x0ff0, 0),
            (Amo::Axor, 0x1, 0),
            (Amo::Afxor, 0x3, 0),
            (Amo::Afax, 0xff, 0x100),
            (Amo::Acswap, 99, 0),
            (Amo::Acswap, 77, 0),
        ];
        for (op, a, b) in cases {
            let old = nic.amo(op, w, a, b).unwrap();
            if op.is_fetching() {
                assert_eq!(old, model, "{op:?} fetched");
            }
            softnic::nic::gemini::apply_amo(&std::sync::atomic::AtomicU64::new(model), op, a, b);
            let m = std::sync::atomic::AtomicU64::new(model);
            softnic::nic::gemini::apply_amo(&m, op, a, b);
            model = m.into_inner();
        }
        let mut b = [0u8; 8];
        nic.get(&mut b, w).unwrap();
        assert_eq!(u64::from_le_bytes(b), model);
    }
    nic.barrier().unwrap();
}

#[test]
fn every_amo_from_both_hosts() {
    if in_job() {
        return all_amos_body(&mut init());
    }
    launch_ok("every_amo_from_both_hosts", 2, 2, &[]);
}

fn expect_remote(r: Result<impl std::fmt::Debug, GniError>, want: Status) {
    match r {
        Err(GniError::Remote(s)) => assert_eq!(s, want),
        other => panic!("expected {want:?}, got {other:?}"),
    }
}

fn errors_body(nic: &mut Nic) {
    let rw = nic.mem_register(4096, Perms::READ_WRITE).unwrap();
    let ro = nic.mem_register(4096, Perms::READ).unwrap();
    let wo = nic.mem_register(4096, Perms::WRITE).unwrap();
    for r in [&rw, &ro, &wo] {
        r.bytes().fill(0xab);
    }
    nic.barrier().unwrap();
    let peer = (nic.rank() + 1) % nic.size();
    let big = vec![1u8; 10_000];
    // Out of bounds, wholly and partly, FMA and BTE sized: nothing may change.
    expect_remote(
        nic.put(remote(peer, rw.handle, 4096), &[1]),
        Status::OutOfBounds,
    );
    expect_remote(
        nic.put(remote(peer, rw.handle, 4090), &[1; 8]),
        Status::OutOfBounds,
    );
    expect_remote(
        nic.put(remote(peer, rw.handle, 0), &big),
        Status::OutOfBounds,
    );
    expect_remote(
        nic.put(remote(peer, rw.handle, u64::MAX - 2), &[1; 8]),
        Status::OutOfBounds,
    );
    let mut buf = [0u8; 16];
    expect_remote(
        nic.get(&mut buf, remote(peer, rw.handle, 4088)),
        Status::OutOfBounds,
    );
    expect_remote(
        nic.afadd(remote(peer, rw.handle, 4096), 1),
        Status::OutOfBounds,
    );
    expect_remote(nic.afadd(remote(peer, rw.handle, 4), 1), Status::BadRequest);
    // Permissions.
    expect_remote(
        nic.put(remote(peer, ro.handle, 0), &[1; 8]),
        Status::Permission,
    );
    expect_remote(
        nic.amo(Amo::Aadd, remote(peer, ro.handle, 0), 1, 0),
        Status::Permission,
    );
    expect_remote(
        nic.get(&mut buf, remote(peer, wo.handle, 0)),
        Status::Permission,
    );
    expect_remote(nic.afadd(remote(peer, wo.handle, 0), 1), Status::Permission);
    // Unknown handle and rank.
    expect_remote(
        nic.put(remote(peer, MemHandle(99), 0), &[1]),
        Status::NoSuchRegion,
    );
    assert!(matches!(
        nic.put(remote(nic.size(), rw.handle, 0), &[1]),
        Err(GniError::NoSuchRank(..))
    ));
    // Implicit failures surface at gsync.
    nic.put_nbi(remote(peer, ro.handle, 0), &[1; 8]).unwrap();
    expect_remote(nic.gsync_wait(), Status::Permission);
    nic.barrier().unwrap();
    for r in [&rw, &ro, &wo] {
        assert!(
            r.bytes().iter().all(|&b| b == 0xab),
            "a failed access changed memory"
        );
    }
    nic.barrier().unwrap();
}

#[test]
fn bad_accesses_fail_and_change_nothing() {
    if in_job() {
        return errors_body(&mut init());
    }
    launch_ok("bad_accesses_fail_and_change_nothing", 2, 2, &[]);
}

#[test]
fn self_and_same_host_ops_work() {
    if in_job() {
        let mut nic = init();
        let mem = nic.mem_register(1 << 20, Perms::READ_WRITE).unwrap();
        nic.barrier().unwrap();
        let me = nic.rank();
        let data = pattern(100_000, 3);
        nic.put(remote(me, mem.handle, 1), &data).unwrap();
        assert_eq!(&mem.bytes()[1..100_001], &data[..]);
        assert_eq!(nic.afadd(remote(me, mem.handle, 200_000), 2).unwrap(), 0);
        // Rank 2 lives on the same host as rank 0 (round-robin over 2 hosts).
        let same = (me + 2) % nic.size();
        nic.put(
            remote(same, mem.handle, 300_000 + me as u64 * 8),
            &[me as u8 + 1; 8],
        )
        .unwrap();
        nic.barrier().unwrap();
        assert_eq!(mem.bytes()[300_000 + same as usize * 8], same as u8 + 1);
        nic.barrier().unwrap();
        return;
    }
    launch_ok("self_and_same_host_ops_work", 4, 2, &[]);
}

const FAULTS: &[&str] = &[
    "--fault-drop",
    "0.1",
    "--fault-duplicate",
    "0.05",
    "--fault-seed",
    "7",
];

#[test]
fn put_get_under_faults() {
    if in_job() {
        return put_get_body(&mut init());
    }
    launch_ok("put_get_under_faults", 2, 2, FAULTS);
}

#[test]
fn amos_under_faults() {
    if in_job() {
        let mut nic = init();
        afadd_small(&mut nic);
        all_amos_body(&mut nic);
        return;
    }
    launch_ok("amos_under_faults", 4, 2, FAULTS);
}

fn afadd_small(nic: &mut Nic) {
    let mem = nic.mem_register(4096, Perms::READ_WRITE).unwrap();
    nic.barrier().unwrap();
    for _ in 0..2_000 {
        nic.amo_nbi(Amo::Aadd, remote(0, mem.handle, 0), 1, 0)
            .unwrap();
        nic.afadd(remote(1, mem.handle, 0), 1).unwrap();
    }
    nic.barrier().unwrap();
    if nic.rank() < 2 {
        assert_eq!(
            mem.read_u64(0),
            2_000 * nic.size() as u64,
            "every AMO applied exactly once"
        );
    }
    nic.barrier().unwrap();
}

#[test]
fn amo_scatter_applies_every_update_once() {
    if in_job() {
        let mut nic = init();
        let mem = nic.mem_register(1 << 16, Perms::READ_WRITE).unwrap();
        nic.barrier().unwrap();
        let peer = (nic.rank() + 1) % nic.size();
        // 3000 AADDs over 100 words (larger than one command and one datagram), twice.
        let ups: Vec<(u64, u64)> = (0..3000u64).map(|i| ((i % 100) * 8, i)).collect();
        nic.amo_scatter_nbi(Amo::Aadd, peer, mem.handle, &ups)
            .unwrap();
        nic.amo_scatter_nbi(Amo::Aadd, peer, mem.handle, &ups)
            .unwrap();
        nic.gsync_wait().unwrap();
        // A bad pair fails the vector; the good pairs before it are applied.
        nic.amo_scatter_nbi(Amo::Aor, peer, mem.handle, &[(1 << 20, 1)])
            .unwrap();
        expect_remote(nic.gsync_wait(), Status::OutOfBounds);
        assert!(
            nic.amo_scatter_nbi(Amo::Afadd, peer, mem.handle, &[(0, 1)])
                .is_err(),
            "fetching AMOs are refused"
        );
        nic.barrier().unwrap();
        for w in 0..100u64 {
            let want: u64 = (0..3000u64).filter(|i| i % 100 == w).sum::<u64>() * 2;
            assert_eq!(mem.read_u64(w as usize * 8), want, "word {w}");
        }
        nic.barrier().unwrap();
        return;
    }
    launch_ok("amo_scatter_applies_every_update_once", 2, 2, &[]);
}

const TCP: &[(&str, &str)] = &[("SOFTNIC_TRANSPORT", "tcp")];

#[test]
fn put_get_over_tcp() {
    if in_job() {
        return put_get_body(&mut init());
    }
    launch_ok_env("put_get_over_tcp", 2, 2, &[], TCP);
}

#[test]
fn amos_over_tcp_under_faults() {
    if in_job() {
        let mut nic = init();
        afadd_small(&mut nic);
        all_amos_body(&mut nic);
        return;
    }
    launch_ok_env("amos_over_tcp_under_faults", 4, 2, FAULTS, TCP);
}

#[test]
fn put_get_on_two_separate_daemons() {
    if in_job() {
        return put_get_body(&mut init());
    }
    // One softnicd process per host, as on a LAN.
    Daemons::start(2).run_job_ok("put_get_on_two_separate_daemons", 2);
}
