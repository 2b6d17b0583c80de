//! GASNet conformance, conduit-independent (modelled on GASNet's own tests): Active Messages of
//! every category and argument count with the handler rules, put/get of many sizes at
//! unaligned offsets into and out of the segment, explicit and implicit handles, access regions,
//! memset, barriers with ids and mismatches. The conduit comes from SOFTNIC_CONDUIT.

mod common;

use std::cell::RefCell;
use std::rc::Rc;

use common::*;
use softnic::gasnet::{BarrierFlags, Category, Gasnet, GasnetError, Handle, Handler, Msg, Token};

const ENV_SEG: (&str, &str) = ("SOFTNIC_SEGMENT", "4m");

/// The conduits every test runs over.
const CONDUITS: &[&str] = &["udp", "portals", "extoll"];

fn run(test: &str, n: u32) {
    for conduit in CONDUITS {
        launch_ok_env(test, n, 2, &["--conduit", conduit], &[ENV_SEG]);
    }
}

/// (source, category, arguments, payload, Long offset) of a request handled.
type Request = (u32, Category, Vec<u32>, Vec<u8>, u64);

#[derive(Default)]
struct Seen {
    requests: Vec<Request>,
    replies: Vec<(u32, Vec<u32>)>,
    rule_errors: Vec<String>,
}

fn handlers(seen: &Rc<RefCell<Seen>>) -> Vec<(u8, Handler)> {
    let s1 = seen.clone();
    let req: Handler = Box::new(move |t: &mut Token<'_>, m: Msg<'_>| {
        s1.borrow_mut().requests.push((
            m.src,
            m.category,
            m.args.to_vec(),
            m.payload.to_vec(),
            m.offset,
        ));
        // Reply with the sum of the arguments, then break the one-reply rule.
        let sum: u32 = m.args.iter().fold(0u32, |a, b| a.wrapping_add(*b));
        t.reply_short(201, &[sum, m.args.len() as u32]).unwrap();
        if let Err(e) = t.reply_short(201, &[0]) {
            s1.borrow_mut().rule_errors.push(e.to_string());
        }
    });
    let s2 = seen.clone();
    let rep: Handler = Box::new(move |t: &mut Token<'_>, m: Msg<'_>| {
        s2.borrow_mut().replies.push((m.src, m.args.to_vec()));
        // A reply handler cannot communicate.
        if let Err(e) = t.reply_short(201, &[]) {
            s2.borrow_mut().rule_errors.push(e.to_string());
        }
    });
    vec![(200, req), (201, rep)]
}

#[test]
fn active_messages_every_category_and_argument_count() {
    if !in_job() {
        return run("active_messages_every_category_and_argument_count", 4);
    }
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut g = Gasnet::init(handlers(&seen)).unwrap();
    assert_eq!(
        g.conduit_name(),
        std::env::var("SOFTNIC_CONDUIT").unwrap(),
        "the requested conduit runs"
    );
    let (me, n) = (g.mynode(), g.nodes());
    assert_eq!(g.am_max_args(), 16);
    assert!(g.am_max_medium() >= 512 && g.am_max_long_request() >= 512);
    let peer = (me + 1) % n;
    let mut sent = 0;
    for nargs in 0..=16usize {
        let args: Vec<u32> = (0..nargs as u32).map(|i| i * 10 + me).collect();
        g.am_request_short(peer, 200, &args).unwrap();
        g.am_request_medium(peer, 200, &vec![nargs as u8; nargs * 7], &args)
            .unwrap();
        g.am_request_long(
            peer,
            200,
            &[0xa0 | nargs as u8; 100],
            1000 * (nargs as u64 + 1) + me as u64,
            &args,
        )
        .unwrap();
        sent += 3;
    }
    assert!(
        g.am_request_short(peer, 200, &[0; 17]).is_err(),
        "17 arguments"
    );
    assert!(
        matches!(
            g.am_request_short(peer, 0, &[]),
            Err(GasnetError::BadHandler(0))
        ),
        "index 0 is never valid"
    );
    let s = seen.clone();
    g.block_until(|| s.borrow().replies.len() >= sent && s.borrow().requests.len() >= sent)
        .unwrap();
    g.barrier().unwrap();
    let s = seen.borrow();
    let from = (me + n - 1) % n;
    for (i, (src, cat, args, payload, offset)) in s.requests.iter().take(sent).enumerate() {
        let nargs = i / 3;
        assert_eq!(*src, from);
        assert_eq!(args.len(), nargs);
        assert!(args
            .iter()
            .enumerate()
            .all(|(k, a)| *a == k as u32 * 10 + from));
        match i % 3 {
            0 => assert_eq!((*cat, payload.len()), (Category::Short, 0)),
            1 => assert_eq!(
                (*cat, payload.clone()),
                (Category::Medium, vec![nargs as u8; nargs * 7])
            ),
            _ => {
                assert_eq!(
                    (*cat, *offset),
                    (Category::Long, 1000 * (nargs as u64 + 1) + from as u64)
                );
                assert_eq!(payload, &vec![0xa0 | nargs as u8; 100]);
                let o = *offset as usize;
                assert_eq!(
                    &g.segment()[o..o + 100],
                    &payload[..],
                    "Long payload in the segment"
                );
            }
        }
    }
    for (i, (src, args)) in s.replies.iter().take(sent).enumerate() {
        let nargs = (i / 3) as u32;
        let want: u32 = (0..nargs).map(|k| k * 10 + me).sum();
        assert_eq!((*src, args.clone()), (peer, vec![want, nargs]));
    }
    assert_eq!(
        s.rule_errors.len(),
        2 * sent,
        "second replies and replies from reply handlers refused"
    );
    drop(s);
    g.barrier().unwrap();
}

#[test]
fn put_get_sizes_offsets_and_handles() {
    if !in_job() {
        return run("put_get_sizes_offsets_and_handles", 2);
    }
    let mut g = Gasnet::init(vec![]).unwrap();
    assert_eq!(g.conduit_name(), std::env::var("SOFTNIC_CONDUIT").unwrap());
    let (me, n) = (g.mynode(), g.nodes());
    let peer = (me + 1) % n;
    let pat = |len: usize, seed: usize| -> Vec<u8> {
        (0..len)
            .map(|i| ((i * 31 + seed * 7) % 251) as u8)
            .collect()
    };
    // On the portals conduit puts and gets go straight to Portals, never through AMs.
    let before = g.am_sent();
    g.put(peer, 0, &[1; 100]).unwrap();
    let mut b100 = [0u8; 100];
    g.get(&mut b100, peer, 0).unwrap();
    if g.conduit_name() == "portals" {
        assert_eq!(g.am_sent(), before, "portals conduit: no AM for put/get");
    } else {
        assert!(g.am_sent() > before, "AM-based conduit");
    }
    g.barrier().unwrap();
    // Blocking, from and into plain buffers (out of segment), unaligned remote offsets.
    let mut off = 0u64;
    for (i, size) in [0usize, 1, 7, 8, 4095, 4096, 4097, 65_536, (1 << 20) + 3]
        .into_iter()
        .enumerate()
    {
        let data = pat(size, i + me as usize);
        g.put(peer, off + 3, &data).unwrap();
        let mut back = vec![0u8; size];
        g.get(&mut back, peer, off + 3).unwrap();
        assert_eq!(back, data, "size {size}");
        off += size as u64 + 64;
    }
    // A get into the segment larger than a Medium: on extoll one Long reply lands it in place
    // (this node sends one request, and one reply to the peer's same get; no 8 KiB pieces).
    let last = pat((1 << 20) + 3, 8 + me as usize);
    let (at, len) = (off - last.len() as u64 - 64 + 3, 600_001);
    g.barrier().unwrap();
    let before = g.am_sent();
    let h = g.get_nb(1_300_000, peer, at, len).unwrap();
    g.wait_syncnb(h).unwrap();
    assert!(g.segment()[1_300_000..1_300_000 + len] == last[..len]);
    if g.conduit_name() == "extoll" {
        assert!(g.am_sent() - before <= 2, "{} AMs", g.am_sent() - before);
    }
    g.barrier().unwrap();
    // The same into a plain buffer: on extoll one Long reply into the conduit's landing area,
    // copied out (no 8 KiB Medium pieces either); the area is no AM's to name.
    let before = g.am_sent();
    let mut back = vec![0u8; len];
    g.get(&mut back, peer, at).unwrap();
    assert!(back == last[..len]);
    if g.conduit_name() == "extoll" {
        assert!(g.am_sent() - before <= 2, "{} AMs", g.am_sent() - before);
        assert!(matches!(
            g.am_request_long(peer, 200, &[1; 8], 1 << 48, &[]),
            Err(GasnetError::OutOfSegment(..))
        ));
    }
    g.barrier().unwrap();
    // Explicit handles: several in flight, then wait all / some / try.
    let hs: Vec<Handle> = (0..8u64)
        .map(|k| {
            g.put_nb(peer, 2_000_000 + k * 1000, &pat(999, k as usize))
                .unwrap()
        })
        .collect();
    g.wait_syncnb_all(&hs).unwrap();
    let h = g.get_nb(3_000_000, peer, 2_000_000, 8 * 1000).unwrap();
    while !g.try_syncnb(h).unwrap() {}
    for k in 0..8usize {
        assert_eq!(
            &g.segment()[3_000_000 + k * 1000..3_000_000 + k * 1000 + 999],
            &pat(999, k)[..]
        );
    }
    // Implicit handles and an access region.
    for k in 0..4u64 {
        g.put_nbi(peer, 3_500_000 + k * 10, &[k as u8 + 1; 10])
            .unwrap();
    }
    g.begin_nbi_accessregion();
    g.put_nbi(peer, 3_600_000, b"region").unwrap();
    let region = g.end_nbi_accessregion();
    g.wait_syncnb(region).unwrap();
    g.wait_syncnbi_puts().unwrap();
    g.get_nbi(3_700_000, peer, 3_500_000, 40).unwrap();
    g.wait_syncnbi_all().unwrap();
    assert_eq!(
        &g.segment()[3_700_000..3_700_040],
        &[[1u8; 10], [2; 10], [3; 10], [4; 10]].concat()[..]
    );
    // memset, and out-of-segment remote ranges are refused.
    g.memset(peer, 3_800_000, 0x5a, 100).unwrap();
    let mut b = [0u8; 100];
    g.get(&mut b, peer, 3_800_000).unwrap();
    assert!(b.iter().all(|&x| x == 0x5a));
    assert!(matches!(
        g.put(peer, (4 << 20) - 2, &[1, 2, 3]),
        Err(GasnetError::OutOfSegment(..))
    ));
    g.barrier().unwrap();
}

#[test]
fn large_local_buffers_and_non_bulk_local_completion() {
    if !in_job() {
        // Two cached regions at most, so the cache must evict.
        for conduit in CONDUITS {
            launch_ok_env(
                "large_local_buffers_and_non_bulk_local_completion",
                2,
                2,
                &["--conduit", conduit],
                &[("SOFTNIC_SEGMENT", "16m"), ("GASNET_FIREHOSE_R", "2")],
            );
        }
        // The portals conduit with large local buffers through the registration cache.
        launch_ok_env(
            "large_local_buffers_and_non_bulk_local_completion",
            2,
            2,
            &["--conduit", "portals"],
            &[
                ("SOFTNIC_SEGMENT", "16m"),
                ("GASNET_FIREHOSE_R", "2"),
                ("SOFTNIC_PORTALS_COPY_MAX", "32k"),
            ],
        );
        return;
    }
    let mut g = Gasnet::init(vec![]).unwrap();
    let (me, n) = (g.mynode(), g.nodes());
    let peer = (me + 1) % n;
    let pat = |len: usize, seed: usize| -> Vec<u8> {
        (0..len)
            .map(|i| ((i * 13 + seed * 5) % 253) as u8)
            .collect()
    };
    // Large plain buffers, more of them than the cache holds.
    let sizes = [40_000usize, 300_000, (1 << 20) + 5];
    let bufs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &s)| pat(s, i)).collect();
    let mut backs: Vec<Vec<u8>> = sizes.iter().map(|&s| vec![0u8; s]).collect();
    for round in 0..2 {
        for (i, data) in bufs.iter().enumerate() {
            // Twice: the second time from the cache.
            for _ in 0..2 {
                g.put(peer, 5 + i as u64 * 1_100_000, data).unwrap();
            }
            backs[i].fill(0);
            g.get(&mut backs[i], peer, 5 + i as u64 * 1_100_000)
                .unwrap();
            assert!(backs[i] == *data, "round {round}, size {}", data.len());
        }
    }
    let stats = g.firehose_stats();
    if g.conduit_name() == "portals" && std::env::var_os("SOFTNIC_PORTALS_COPY_MAX").is_some() {
        assert!(stats.misses > 0 && stats.hits > 0, "{stats:?}");
        assert!(
            stats.evicted > 0,
            "six buffers through two regions: {stats:?}"
        );
    } else {
        // The udp conduit has no daemon; the others copy local buffers through bounce memory.
        assert_eq!(stats.misses + stats.hits, 0, "no cache used: {stats:?}");
    }
    g.barrier().unwrap();
    // Non-bulk puts: the source may be changed the moment the call returns, whether it lies
    // in the segment (sent from in place after local completion) or not.
    let big = pat(200_000, 9);
    g.segment()[3_000_000..3_200_000].copy_from_slice(&big);
    let local = g.segment()[3_000_000..3_200_000].to_vec();
    let h = {
        let seg = g.segment().as_ptr();
        // SAFETY: the segment outlives the call; put_nb reads it only until it returns.
        let src = unsafe { std::slice::from_raw_parts(seg.add(3_000_000), 200_000) };
        g.put_nb(peer, 1_000_000, src).unwrap()
    };
    g.segment()[3_000_000..3_200_000].fill(0xee);
    let mut heap = big.clone();
    g.put_nbi(peer, 2_000_000, &heap).unwrap();
    heap.fill(0xdd);
    g.wait_syncnb(h).unwrap();
    g.wait_syncnbi_all().unwrap();
    let mut back = vec![0u8; 200_000];
    g.get(&mut back, peer, 1_000_000).unwrap();
    assert!(back == local, "put_nb sent bytes changed after it returned");
    g.get(&mut back, peer, 2_000_000).unwrap();
    assert!(back == big, "put_nbi sent bytes changed after it returned");
    // Streams of non-bulk puts from one reused buffer, changed after every call, more bytes in
    // flight than a staging area holds (extoll's bounce ring, 8 MiB, wraps onto puts the NIC
    // is still reading).
    let len = 1_200_003;
    let mut heap = vec![0u8; len];
    let mut got = vec![0u8; len];
    for group in 0..2 {
        for slot in 0..10 {
            heap.copy_from_slice(&pat(len, group * 10 + slot));
            g.put_nbi(peer, (slot * len) as u64, &heap).unwrap();
        }
        heap.fill(0xcc);
        g.wait_syncnbi_all().unwrap();
        for slot in 0..10 {
            g.get(&mut got, peer, (slot * len) as u64).unwrap();
            assert!(
                got == pat(len, group * 10 + slot),
                "group {group} slot {slot}: a staged put's bytes changed"
            );
        }
    }
    // Bulk: the source stays untouched until the sync.
    let h = g.put_nb_bulk(peer, 2_500_000, &big).unwrap();
    g.put_nbi_bulk(peer, 2_800_000, &big[..100_000]).unwrap();
    g.wait_syncnb(h).unwrap();
    g.wait_syncnbi_puts().unwrap();
    g.get(&mut back, peer, 2_500_000).unwrap();
    assert!(back == big);
    g.get(&mut back[..100_000], peer, 2_800_000).unwrap();
    assert!(back[..100_000] == big[..100_000]);
    g.barrier().unwrap();
}

#[test]
fn barriers_with_ids_anonymous_and_mismatch() {
    if !in_job() {
        return run("barriers_with_ids_anonymous_and_mismatch", 8);
    }
    let mut g = Gasnet::init(vec![]).unwrap();
    let me = g.mynode();
    // Same id everywhere: fine; split phase with work in between.
    g.barrier_notify(7, BarrierFlags::NONE).unwrap();
    g.am_poll().unwrap();
    g.barrier_wait(7, BarrierFlags::NONE).unwrap();
    // Anonymous participants match anything.
    let f = if me.is_multiple_of(2) {
        BarrierFlags::ANONYMOUS
    } else {
        BarrierFlags::NONE
    };
    g.barrier_notify(9, f).unwrap();
    g.barrier_wait(9, f).unwrap();
    // Different ids: everyone sees the mismatch.
    g.barrier_notify(100 + (me == 3) as u32, BarrierFlags::NONE)
        .unwrap();
    assert!(matches!(
        g.barrier_wait(100 + (me == 3) as u32, BarrierFlags::NONE),
        Err(GasnetError::BarrierMismatch)
    ));
    // A forced mismatch.
    let f = if me == 0 {
        BarrierFlags::MISMATCH
    } else {
        BarrierFlags::NONE
    };
    g.barrier_notify(5, f).unwrap();
    assert!(matches!(
        g.barrier_wait(5, f),
        Err(GasnetError::BarrierMismatch)
    ));
    // Wait without notify, or with another id, is a usage error.
    assert!(matches!(
        g.barrier_wait(1, BarrierFlags::NONE),
        Err(GasnetError::BarrierState)
    ));
    g.barrier_notify(11, BarrierFlags::NONE).unwrap();
    assert!(matches!(
        g.barrier_try(12, BarrierFlags::NONE),
        Err(GasnetError::BarrierState)
    ));
    g.barrier_wait(11, BarrierFlags::NONE).unwrap();
    g.barrier().unwrap();
}

/// Launcher flags: the portals conduit, daemons dropping 10% of datagrams and duplicating 5%.
fn portals_with_faults(seed: &'static str) -> [&'static str; 8] {
    [
        "--conduit",
        "portals",
        "--fault-drop",
        "0.1",
        "--fault-duplicate",
        "0.05",
        "--fault-seed",
        seed,
    ]
}

/// The same suites over the portals conduit with the daemons dropping 10% of datagrams (and
/// duplicating 5%): results stay exact.
#[test]
fn portals_conduit_under_datagram_loss() {
    assert!(!in_job(), "this test only launches the others by name");
    let faults = portals_with_faults("11");
    launch_ok_env(
        "active_messages_every_category_and_argument_count",
        4,
        2,
        &faults,
        &[ENV_SEG],
    );
    launch_ok_env(
        "put_get_sizes_offsets_and_handles",
        2,
        2,
        &faults,
        &[ENV_SEG],
    );
    launch_ok_env(
        "barriers_with_ids_anonymous_and_mismatch",
        8,
        2,
        &faults,
        &[ENV_SEG],
    );
    launch_ok_env(
        "remote_atomics_every_op_and_concurrent_fetch_add",
        4,
        2,
        &faults,
        &[ENV_SEG],
    );
}

/// The same suites over the extoll conduit with the daemons dropping 10% of datagrams and
/// duplicating 10%: results stay exact.
#[test]
fn extoll_conduit_under_datagram_loss() {
    assert!(!in_job(), "this test only launches the others by name");
    let faults = [
        "--conduit",
        "extoll",
        "--fault-drop",
        "0.1",
        "--fault-duplicate",
        "0.1",
        "--fault-seed",
        "13",
    ];
    for (test, n) in [
        ("active_messages_every_category_and_argument_count", 4),
        ("put_get_sizes_offsets_and_handles", 2),
        ("barriers_with_ids_anonymous_and_mismatch", 8),
        ("floods_of_requests_both_ways_without_polling_all_arrive", 2),
    ] {
        launch_ok_env(test, n, 2, &faults, &[ENV_SEG]);
    }
}

/// The portals conduit's suites across two network-namespace hosts, each with its own
/// softnicd, the kernel dropping one incoming UDP datagram in ten (a lossy LAN, not the
/// daemons' own fault injection): results stay exact and no peer is declared dead.
#[test]
fn portals_conduit_in_lossy_namespaces() {
    assert!(!in_job(), "this test only launches the others by name");
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: network namespaces and nftables need root (CI runs as root)");
        return;
    }
    let (pair, d) = netns::udp_daemons("g", 7702);
    for ns in &pair.ns {
        netns::drop_tenth_of_udp(ns).unwrap();
    }
    let conduit = ["--conduit", "portals"];
    for (test, n) in [
        ("active_messages_every_category_and_argument_count", 4),
        ("put_get_sizes_offsets_and_handles", 2),
        ("barriers_with_ids_anonymous_and_mismatch", 4),
        ("remote_atomics_every_op_and_concurrent_fetch_add", 4),
        ("long_payloads_up_to_the_maximum_both_ways", 2),
    ] {
        d.run_job_with(test, n, &conduit, &[ENV_SEG]);
    }
    assert!(
        d.counter("retransmits") > 0,
        "the kernel dropped datagrams:\n{}",
        d.stat()
    );
    assert_eq!(d.counter("peers_declared_dead"), 0, "{}", d.stat());
}

/// The portals conduit's suites over the ssh spawner on three namespace hosts with their own
/// sshd: the daemons are started over ssh, each rank runs on its host.
#[test]
fn portals_conduit_over_ssh_on_namespace_hosts() {
    assert!(!in_job(), "this test only launches the others by name");
    if !rustix::process::geteuid().is_root() || !std::path::Path::new("/usr/sbin/sshd").exists() {
        eprintln!("skipped: namespace hosts with sshd need root and openssh-server (CI has both)");
        return;
    }
    let c = ssh_hosts::Cluster::new().unwrap();
    let exe = std::env::current_exe().unwrap();
    for (test, n) in [
        ("active_messages_every_category_and_argument_count", "6"),
        ("put_get_sizes_offsets_and_handles", "3"),
        ("remote_atomics_every_op_and_concurrent_fetch_add", "6"),
        ("long_payloads_up_to_the_maximum_both_ways", "2"),
    ] {
        let out = c.run_env(
            &["-n", n, "--conduit", "portals"],
            &exe,
            &["--exact", test, "--nocapture", "--test-threads=1"],
            &[ENV_SEG],
        );
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{test}:\n{text}");
        assert!(text.contains("1 passed"), "{test}: no rank ran it:\n{text}");
    }
}

/// The local default runs over the packet transport as root; the portals conduit's suites
/// over the UDP transport, with the same faults, keep that path tested too — in loopback's
/// 65,000-byte datagrams and in a LAN's 1472 (batched, cut by GSO, joined by GRO).
#[test]
fn portals_conduit_over_the_udp_transport_under_datagram_loss() {
    assert!(!in_job(), "this test only launches the others by name");
    let faults = portals_with_faults("12");
    for mtu in ["65000", "1472"] {
        let env = [ENV_SEG, ("SOFTNIC_TRANSPORT", "udp"), ("SOFTNIC_MTU", mtu)];
        launch_ok_env("put_get_sizes_offsets_and_handles", 2, 2, &faults, &env);
        launch_ok_env(
            "long_payloads_up_to_the_maximum_both_ways",
            2,
            2,
            &faults,
            &env,
        );
    }
}

#[test]
fn floods_of_requests_both_ways_without_polling_all_arrive() {
    if !in_job() {
        return run("floods_of_requests_both_ways_without_polling_all_arrive", 2);
    }
    // Each node sends far more than the peer's receive buffers hold before it polls once: a
    // conduit must keep accepting while its own sends wait, or both nodes wait for ever.
    const N: u32 = 2000;
    let got = Rc::new(RefCell::new(0u32));
    let g2 = got.clone();
    let count: Handler = Box::new(move |_: &mut Token<'_>, m: Msg<'_>| {
        assert!(m.payload.iter().all(|&b| b == m.args[0] as u8));
        *g2.borrow_mut() += 1;
    });
    let mut g = Gasnet::init(vec![(150, count)]).unwrap();
    let peer = (g.mynode() + 1) % g.nodes();
    let payload_len = g.am_max_medium();
    for k in 0..N {
        let b = k % 251;
        g.am_request_medium(peer, 150, &vec![b as u8; payload_len], &[b])
            .unwrap();
    }
    let g3 = got.clone();
    g.block_until(|| *g3.borrow() == N).unwrap();
    g.barrier().unwrap();
    assert_eq!(*got.borrow(), N);
}

/// The udp conduit as GASNet's own sends its datagrams (`SOFTNIC_UDP_AUTH=0`: a tag in clear,
/// the baseline netbench measures), and in datagrams of a LAN's size (`SOFTNIC_UDP_MTU=1472`
/// instead of AMUDP's 65,000): Active Messages of every kind and put/get of every size work
/// as sealed; a bad value of either is refused at init, naming the variable.
#[test]
fn udp_conduit_with_tags_in_clear() {
    if !in_job() {
        let clear = [ENV_SEG, ("SOFTNIC_UDP_AUTH", "0")];
        let small = [ENV_SEG, ("SOFTNIC_UDP_MTU", "1472")];
        for test in [
            "active_messages_every_category_and_argument_count",
            "put_get_sizes_offsets_and_handles",
            "floods_of_requests_both_ways_without_polling_all_arrive",
        ] {
            launch_ok_env(test, 2, 2, &["--conduit", "udp"], &clear);
            launch_ok_env(test, 2, 2, &["--conduit", "udp"], &small);
        }
        for (var, bad) in [("SOFTNIC_UDP_AUTH", "maybe"), ("SOFTNIC_UDP_MTU", "100")] {
            let out = launch_env(
                "udp_conduit_with_tags_in_clear",
                2,
                2,
                &["--conduit", "udp"],
                &[ENV_SEG, (var, bad)],
            );
            let text = output_text(&out);
            assert!(!out.status.success(), "{text}");
            assert!(text.contains(&format!("{var}={bad}")), "{text}");
        }
        return;
    }
    // Only reached with a bad setting: init must refuse it.
    let e = Gasnet::init(vec![]).err().expect("a bad setting refused");
    panic!("{e}");
}

/// Remote atomics (GASNet-EX atomic domain ops on u64): every operation against a local model,
/// concurrent fetch-adds from every node on one word (each prior value seen exactly once), NBI
/// updates, and the argument checks. Over portals the target's NIC runs them.
#[test]
fn remote_atomics_every_op_and_concurrent_fetch_add() {
    use softnic::gasnet::AdOp;
    if !in_job() {
        return run("remote_atomics_every_op_and_concurrent_fetch_add", 4);
    }
    let mut g = Gasnet::init(vec![]).unwrap();
    let (me, n) = (g.mynode(), g.nodes());
    let peer = (me + 1) % n;
    // Every node owns word 8 * (me + 1) on its peer: a sequence of all operations, checked
    // against the model (prior values for fetching ops, the word itself at the end).
    let at = 8 * (me as u64 + 1);
    let mut model = 0u64;
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ me as u64;
    for round in 0..3 {
        for op in AdOp::ALL {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // CAS compares sometimes with the current value, sometimes not.
            let a = if round == 1 { model } else { x >> 3 };
            let b = x.rotate_left(17);
            let got = g.ad_op(peer, at, op, a, b).unwrap();
            let want = if op.fetches() { model } else { 0 };
            assert_eq!(got, want, "{op:?} returned");
            model = op.apply(model, a, b);
        }
    }
    let before = g.am_sent();
    assert_eq!(g.ad_op(peer, at, AdOp::Get, 0, 0).unwrap(), model);
    if g.conduit_name() == "portals" {
        assert_eq!(
            g.am_sent(),
            before,
            "portals conduit: the NIC runs atomics, no AM"
        );
    } else {
        assert!(g.am_sent() > before, "AM-based conduit");
    }
    g.barrier().unwrap();
    // All nodes fetch-add on node 0's word 0 at once: every prior value appears once.
    const K: u64 = 200;
    let mut seen: Vec<u64> = (0..K)
        .map(|_| g.ad_op(0, 0, AdOp::Fadd, 1, 0).unwrap())
        .collect();
    g.barrier().unwrap();
    assert_eq!(g.ad_op(0, 0, AdOp::Get, 0, 0).unwrap(), K * n as u64);
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), K as usize, "no prior value twice");
    // NBI: XORs and adds complete with the implicit puts — more than the portals conduit
    // has operand slots for its counted atomics, so slots are reused while others fly.
    let word = 1024 + 8 * me as u64;
    const NBI: u64 = 5000;
    for k in 0..NBI {
        g.ad_op_nbi(peer, word, AdOp::Xor, k * 0x0101, 0).unwrap();
        g.ad_op_nbi(peer, word + 512, AdOp::Add, k, 0).unwrap();
    }
    g.wait_syncnbi_puts().unwrap();
    let xor = (0..NBI).fold(0, |acc, k| acc ^ (k * 0x0101));
    assert_eq!(g.ad_op(peer, word, AdOp::Get, 0, 0).unwrap(), xor);
    assert_eq!(
        g.ad_op(peer, word + 512, AdOp::Get, 0, 0).unwrap(),
        (NBI - 1) * NBI / 2
    );
    // In an access region they belong to its handle.
    g.begin_nbi_accessregion();
    for k in 1..=100u64 {
        g.ad_op_nbi(peer, word + 512, AdOp::Sub, k, 0).unwrap();
    }
    let h = g.end_nbi_accessregion();
    g.wait_syncnb(h).unwrap();
    assert_eq!(
        g.ad_op(peer, word + 512, AdOp::Get, 0, 0).unwrap(),
        (NBI - 1) * NBI / 2 - 100 * 101 / 2
    );
    // Bad arguments are refused before anything is sent.
    assert!(matches!(
        g.ad_op(peer, 4, AdOp::Add, 1, 0),
        Err(GasnetError::Misaligned(4))
    ));
    assert!(matches!(
        g.ad_op(peer, 4 << 20, AdOp::Add, 1, 0),
        Err(GasnetError::OutOfSegment(..))
    ));
    assert!(matches!(
        g.ad_op(n, 0, AdOp::Add, 1, 0),
        Err(GasnetError::BadNode(_))
    ));
    assert!(matches!(
        g.ad_op_nbi(peer, 0, AdOp::Fadd, 1, 0),
        Err(GasnetError::FetchingNbi)
    ));
    g.barrier().unwrap();
}

/// Implicit atomics (the portals conduit's counted ones) to a node that has left fail, and the
/// sync that reports them names the node and the NIC's reason — not a bare count, not a hang.
#[test]
fn implicit_atomics_to_a_node_that_left_fail_naming_node_and_reason() {
    use softnic::gasnet::AdOp;
    const TEST: &str = "implicit_atomics_to_a_node_that_left_fail_naming_node_and_reason";
    if !in_job() {
        return launch_ok_env(TEST, 2, 2, &["--conduit", "portals"], &[ENV_SEG]);
    }
    let mut g = Gasnet::init(vec![]).unwrap();
    g.barrier().unwrap();
    if g.mynode() == 1 {
        // Leaves at once: its daemon forgets it when the process is gone.
        return;
    }
    let start = std::time::Instant::now();
    let e = loop {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "atomics to a node that left kept succeeding"
        );
        g.ad_op_nbi(1, 0, AdOp::Add, 1, 0).unwrap();
        match g.wait_syncnbi_puts() {
            Err(e) => break e.to_string(),
            Ok(()) => std::thread::sleep(std::time::Duration::from_millis(5)),
        }
    };
    // The daemon no longer knows the node: the NIC's PTL_NI_UNDELIVERABLE.
    assert!(
        e.contains("failed at their target (the first to node 1: Undeliverable)"),
        "{e}"
    );
}

/// AM Long of every size up to AMMaxLongRequest/Reply, both directions: the payload is in the
/// segment when the handler runs (over portals, large ones are put in place first and matched
/// with their header by Lid), and many in flight at once all arrive.
#[test]
fn long_payloads_up_to_the_maximum_both_ways() {
    if !in_job() {
        return run("long_payloads_up_to_the_maximum_both_ways", 2);
    }
    const H_LONG: u8 = 160;
    const H_LONG_BACK: u8 = 161;
    // Requests land in the lower half of the segment, replies in the upper.
    let upper = Rc::new(std::cell::Cell::new(0u64));
    let up = upper.clone();
    let pat = |len: usize, seed: u32| -> Vec<u8> {
        (0..len)
            .map(|i| ((i as u32 * 13 + seed * 101) % 253) as u8)
            .collect()
    };
    let bad = Rc::new(RefCell::new(Vec::<String>::new()));
    let back = Rc::new(RefCell::new(Vec::<(u32, usize)>::new()));
    let b1 = bad.clone();
    let on_request: Handler = Box::new(move |t: &mut Token<'_>, m: Msg<'_>| {
        let (len, seed) = (m.payload.len(), m.args[0]);
        let want = pat(len, seed);
        let at = m.offset as usize;
        if m.payload != &want[..] || t.segment()[at..at + len] != want[..] {
            b1.borrow_mut()
                .push(format!("request of {len} bytes arrived wrong"));
        }
        // Send it back, Long too, to the requester's segment in the upper half.
        let copy = t.segment()[at..at + len].to_vec();
        if let Err(e) = t.reply_long(H_LONG_BACK, &copy, m.offset + up.get(), &[seed, len as u32]) {
            b1.borrow_mut().push(format!("reply_long({len}): {e}"));
        }
    });
    let b2 = bad.clone();
    let k = back.clone();
    let on_reply: Handler = Box::new(move |_: &mut Token<'_>, m: Msg<'_>| {
        if m.payload != &pat(m.args[1] as usize, m.args[0])[..] {
            b2.borrow_mut()
                .push(format!("reply of {} bytes arrived wrong", m.args[1]));
        }
        k.borrow_mut().push((m.args[0], m.payload.len()));
    });
    let mut g = Gasnet::init(vec![(H_LONG, on_request), (H_LONG_BACK, on_reply)]).unwrap();
    upper.set(g.segment().len() as u64 / 2);
    let max = g.am_max_long_request().min(g.segment().len() / 2);
    assert_eq!(g.am_max_long_request(), g.am_max_long_reply());
    if g.conduit_name() == "portals" {
        assert!(
            max >= 1 << 20,
            "portals: Long payloads are put in place, up to 1 MiB"
        );
    }
    let peer = (g.mynode() + 1) % g.nodes();
    let mut sizes = vec![0, 1, 8191, 8192, 8193, 65_536, max - 1, max];
    sizes.retain(|&s| s <= max);
    // One size at a time (every size at offset 0), then a burst in flight at once.
    let mut expect: Vec<(u32, usize)> = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        g.am_request_long(peer, H_LONG, &pat(s, i as u32), 0, &[i as u32])
            .unwrap();
        expect.push((i as u32, s));
        let (k, want) = (back.clone(), expect.len());
        g.block_until(|| k.borrow().len() == want).unwrap();
        g.barrier().unwrap();
    }
    for j in 0..16u32 {
        let seed = 100 + j;
        let s = (max - 200).min(40_000) + j as usize * 11;
        g.am_request_long(peer, H_LONG, &pat(s, seed), j as u64 * 65_536, &[seed])
            .unwrap();
        expect.push((seed, s));
    }
    let (k, want) = (back.clone(), expect.len());
    g.block_until(|| k.borrow().len() == want).unwrap();
    g.barrier().unwrap();
    assert_eq!(*bad.borrow(), Vec::<String>::new());
    let mut got = back.borrow().clone();
    got.sort_unstable();
    expect.sort_unstable();
    assert_eq!(got, expect);
    assert!(matches!(
        g.am_request_long(peer, H_LONG, &vec![0; g.am_max_long_request() + 1], 0, &[0]),
        Err(GasnetError::TooLarge(_))
    ));
    g.barrier().unwrap();
}

/// AM flow control: seven nodes flood node 0 with maximal Mediums while it computes without
/// polling. Every request arrives exactly once. Over portals with credits (the default) the
/// senders stall on credit and borrow, and nothing reaches node 0's catch-basin; with credits
/// off (`SOFTNIC_PORTALS_CREDITS=off`, a diagnostic) the catch-basin takes the overflow and
/// the senders send it again.
/// extoll's Longs go to 8 MiB, one RMA operation each: in a segment that holds them twice.
#[test]
fn extoll_longs_up_to_eight_mib() {
    if in_job() {
        return long_payloads_up_to_the_maximum_both_ways();
    }
    for args in [
        &["--conduit", "extoll"][..],
        &[
            "--conduit",
            "extoll",
            "--fault-drop",
            "0.1",
            "--fault-duplicate",
            "0.1",
        ][..],
    ] {
        launch_ok_env(
            "extoll_longs_up_to_eight_mib",
            2,
            2,
            args,
            &[("SOFTNIC_SEGMENT", "20m")],
        );
    }
}

#[test]
fn a_flood_at_a_node_that_does_not_poll_is_flow_controlled() {
    const TEST: &str = "a_flood_at_a_node_that_does_not_poll_is_flow_controlled";
    if !in_job() {
        run(TEST, 8);
        let off = [ENV_SEG, ("SOFTNIC_PORTALS_CREDITS", "off")];
        return launch_ok_env(TEST, 8, 2, &["--conduit", "portals"], &off);
    }
    let mut g = flood_node_zero(200);
    g.barrier().unwrap();
    let f = g.flow_stats();
    if g.conduit_name() != "portals" {
        return;
    }
    let credits = std::env::var("SOFTNIC_PORTALS_CREDITS").map_or(true, |v| v != "off");
    match (g.mynode(), credits) {
        (0, true) => {
            assert_eq!(
                f.caught, 0,
                "credited requests always find a receive buffer"
            );
            assert!(f.loans_granted > 0, "{f:?}");
        }
        (_, true) => assert!(f.credit_stalls > 0 && f.loans_asked > 0, "{f:?}"),
        (0, false) => assert!(f.caught > 0, "{f:?}"),
        (_, false) => assert_eq!(f.credit_stalls, 0, "{f:?}"),
    }
    assert_eq!(f.protocol_errors, 0, "{f:?}");
}

/// (source, args[0]) of each Medium a counting node took.
type Arrived = Rc<RefCell<std::collections::HashSet<(u32, u32)>>>;

/// A node whose handler 150 records each Medium's (source, args[0]), checking that its payload
/// is args[1] repeated and that nothing arrives twice.
fn counting_node() -> (Gasnet, Arrived) {
    let seen = Rc::new(RefCell::new(std::collections::HashSet::new()));
    let s2 = seen.clone();
    let count: Handler = Box::new(move |_: &mut Token<'_>, m: Msg<'_>| {
        assert!(m.payload.iter().all(|&b| b == m.args[1] as u8));
        assert!(
            s2.borrow_mut().insert((m.src, m.args[0])),
            "delivered twice"
        );
    });
    (Gasnet::init(vec![(150, count)]).unwrap(), seen)
}

/// Every node but 0 sends `m` maximal Mediums to node 0, which computes (no GASNet call) for
/// 300 ms after the barrier, then polls until all of them arrived, each once (at most 20 s).
fn flood_node_zero(m: u32) -> Gasnet {
    let (mut g, seen) = counting_node();
    let len = g.am_max_medium();
    g.barrier().unwrap();
    if g.mynode() == 0 {
        std::thread::sleep(std::time::Duration::from_millis(300));
        let want = m as usize * (g.nodes() as usize - 1);
        let s3 = seen.clone();
        let t = std::time::Instant::now();
        let patience = std::time::Duration::from_secs(20);
        g.block_until(|| s3.borrow().len() == want || t.elapsed() > patience)
            .unwrap();
        assert_eq!(seen.borrow().len(), want, "requests lost");
    } else {
        for k in 0..m {
            let b = (k * 7 + g.mynode()) % 251;
            g.am_request_medium(0, 150, &vec![b as u8; len], &[k, b])
                .unwrap();
        }
    }
    g
}

/// Senders flood a node that is not polling and leave at once (no barrier after): what was
/// refused for want of room and waits to be sent again must still arrive — a leaving node
/// first gets its Active Messages delivered.
#[test]
fn senders_that_leave_at_once_still_deliver_everything() {
    const TEST: &str = "senders_that_leave_at_once_still_deliver_everything";
    if !in_job() {
        launch_ok_env(TEST, 4, 2, &["--conduit", "udp"], &[ENV_SEG]);
        let off = [ENV_SEG, ("SOFTNIC_PORTALS_CREDITS", "off")];
        return launch_ok_env(TEST, 4, 2, &["--conduit", "portals"], &off);
    }
    flood_node_zero(300);
}

/// A node leaves right after a barrier that ended a stream (netbench's bw): the barrier's last
/// implicit reply, sent from a host the local default's bulk helper still turned, reaches
/// node 0 — which waited out its 5 s exit drain for it when the daemon dropped commands still
/// in a leaving process's ring. Each of 3 jobs: node 0's leave takes well under that.
#[test]
fn a_node_leaving_after_a_stream_leaves_no_reply_behind() {
    const TEST: &str = "a_node_leaving_after_a_stream_leaves_no_reply_behind";
    if !in_job() {
        for _ in 0..3 {
            launch_ok_env(TEST, 2, 2, &["--conduit", "portals"], &[ENV_SEG]);
        }
        return;
    }
    const MIB: usize = 1 << 20;
    let mut g = Gasnet::init(Vec::new()).unwrap();
    g.barrier().unwrap();
    if g.mynode() == 0 {
        let src = vec![7u8; MIB];
        for _ in 0..300 {
            g.put_nbi(1, 0, &src).unwrap();
        }
        g.wait_syncnbi_all().unwrap();
    }
    g.barrier().unwrap();
    let t = std::time::Instant::now();
    drop(g);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(2),
        "leaving took {:?}: an Active Message was never answered",
        t.elapsed()
    );
}

/// extoll: every argument count with Medium payloads around the room the first VELO message
/// leaves (62 bytes after the length, minus header and arguments), up to 8192 B; 8193 is too
/// large.
#[test]
fn extoll_medium_sizes_around_the_message_boundaries() {
    if !in_job() {
        return launch_ok_env(
            "extoll_medium_sizes_around_the_message_boundaries",
            2,
            2,
            &["--conduit", "extoll"],
            &[ENV_SEG],
        );
    }
    let got = Rc::new(RefCell::new(Vec::<(Vec<u32>, Vec<u8>)>::new()));
    let g1 = got.clone();
    let h: Handler = Box::new(move |_: &mut Token<'_>, m: Msg<'_>| {
        g1.borrow_mut().push((m.args.to_vec(), m.payload.to_vec()));
    });
    let mut g = Gasnet::init(vec![(170, h)]).unwrap();
    assert_eq!(g.am_max_medium(), 8192);
    let peer = (g.mynode() + 1) % g.nodes();
    let mut want = Vec::new();
    for nargs in 0..=16usize {
        let room = 62i64 - 12 - 4 * nargs as i64;
        let mut sizes: Vec<usize> = vec![0, 1, 8192];
        for d in [-1i64, 0, 1] {
            if room + d >= 0 {
                sizes.push((room + d) as usize);
            }
        }
        for s in sizes {
            let args: Vec<u32> = (0..nargs as u32).map(|k| k * 3 + s as u32).collect();
            let payload: Vec<u8> = (0..s).map(|i| (i * 7 + nargs) as u8).collect();
            g.am_request_medium(peer, 170, &payload, &args).unwrap();
            want.push((args, payload));
        }
    }
    assert!(matches!(
        g.am_request_medium(peer, 170, &vec![0; 8193], &[0; 16]),
        Err(GasnetError::TooLarge(_))
    ));
    let (k, n) = (got.clone(), want.len());
    g.block_until(|| k.borrow().len() == n).unwrap();
    g.barrier().unwrap();
    assert_eq!(*got.borrow(), want, "every message, whole and in order");
}
