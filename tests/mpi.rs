//! MPI over Portals through real daemons: point-to-point (short, eager long, rendezvous;
//! expected and unexpected; wildcards, truncation, probe), flow-control recovery under an
//! unexpected storm, communicators and collectives, and one-sided windows (fence, locks,
//! PSCW, atomicity, epoch and range errors). Each test is a job; the ranks run the body.

mod common;

use common::*;
use softnic::mpi::*;
use std::time::Duration;

/// The message `i` from `src` of `len` bytes: its bytes say who sent it and which it is.
fn msg(src: u32, i: u32, len: usize) -> Vec<u8> {
    pattern(len, (src as u64) << 20 | i as u64)
}

const SIZES: [usize; 11] = [
    0,
    1,
    8,
    100,
    8192,
    8193,
    65_536,
    65_537,
    100_000,
    300_000,
    1 << 20,
];

/// Every rank sends every size to every other, tagged by index, half of them before the
/// receiver posted (unexpected) and half after (expected); ANY_SOURCE receives check order.
fn exchange_all_sizes(world: &Comm) {
    let (me, n) = (world.rank(), world.size());
    for round in 0..2 {
        // Round 0: receives posted first (expected). Round 1: sends first (unexpected).
        let mut bufs: Vec<Vec<u8>> = (0..n * SIZES.len() as u32)
            .map(|k| vec![0u8; SIZES[(k % SIZES.len() as u32) as usize]])
            .collect();
        let msgs: Vec<(u32, u32, Vec<u8>)> = (0..n)
            .filter(|&d| d != me)
            .flat_map(|d| {
                SIZES
                    .iter()
                    .enumerate()
                    .map(move |(i, &l)| (d, i as u32, msg(me, i as u32, l)))
            })
            .collect();
        let mut sends = Vec::new();
        if round == 1 {
            for (d, i, m) in &msgs {
                sends.push(world.isend(m, *d as i32, *i as i32).unwrap());
            }
            world.barrier().unwrap();
        }
        let mut recvs = Vec::new();
        for (k, b) in bufs.iter_mut().enumerate() {
            let (src, i) = (k as u32 / SIZES.len() as u32, k as u32 % SIZES.len() as u32);
            if src != me {
                recvs.push((src, i, world.irecv(b, src as i32, i as i32).unwrap()));
            }
        }
        if round == 0 {
            world.barrier().unwrap();
            for (d, i, m) in &msgs {
                sends.push(world.isend(m, *d as i32, *i as i32).unwrap());
            }
        }
        for (src, i, r) in recvs {
            let st = r.wait().unwrap();
            assert_eq!((st.source, st.tag), (src, i));
            assert_eq!(st.count, SIZES[i as usize]);
        }
        wait_all(sends).unwrap();
        for (k, b) in bufs.iter().enumerate() {
            let (src, i) = (k as u32 / SIZES.len() as u32, k as u32 % SIZES.len() as u32);
            if src != me {
                assert!(
                    *b == msg(src, i, b.len()),
                    "round {round}: message {i} from {src}"
                );
            }
        }
        world.barrier().unwrap();
    }
    // Non-overtaking: many messages, same source and tag, mixed sizes, ANY_SOURCE receives.
    if me == 0 {
        for k in 0..60u32 {
            let l = SIZES[(k as usize * 7) % SIZES.len()];
            for d in 1..n {
                world.send(&msg(0, k, l), d as i32, 5).unwrap();
            }
        }
    } else {
        // Let the sender run ahead so some messages arrive unexpected.
        std::thread::sleep(Duration::from_millis(20));
        for k in 0..60u32 {
            let l = SIZES[(k as usize * 7) % SIZES.len()];
            let mut b = vec![0u8; 1 << 20];
            let st = world.recv(&mut b, ANY_SOURCE, ANY_TAG).unwrap();
            assert_eq!(
                (st.source, st.tag, st.count),
                (0, 5, l),
                "message {k} in order"
            );
            assert!(b[..l] == msg(0, k, l)[..], "message {k}'s bytes");
        }
    }
    world.barrier().unwrap();
}

/// Runs `test` in a 2-rank job on 2 hosts once under each long protocol.
fn launch_under_both_protocols(test: &str, extra: &[&str]) {
    for proto in ["eager", "rendezvous"] {
        launch_ok_env(test, 2, 2, extra, &[("SOFTNIC_MPI_LONG", proto)]);
    }
}

#[test]
fn p2p_sizes_expected_unexpected_in_order_eager() {
    if !in_job() {
        return launch_ok_env(
            "p2p_sizes_expected_unexpected_in_order_eager",
            4,
            2,
            &[],
            &[("SOFTNIC_MPI_LONG", "eager")],
        );
    }
    let world = Mpi::init().unwrap();
    exchange_all_sizes(&world);
}

#[test]
fn p2p_sizes_expected_unexpected_in_order_rendezvous() {
    if !in_job() {
        return launch_ok_env(
            "p2p_sizes_expected_unexpected_in_order_rendezvous",
            4,
            2,
            &[],
            &[("SOFTNIC_MPI_LONG", "rendezvous")],
        );
    }
    let world = Mpi::init().unwrap();
    exchange_all_sizes(&world);
}

#[test]
fn p2p_under_loss_both_protocols() {
    if !in_job() {
        return launch_under_both_protocols(
            "p2p_under_loss_both_protocols",
            &["--fault-drop", "0.1"],
        );
    }
    let world = Mpi::init().unwrap();
    exchange_all_sizes(&world);
}

#[test]
fn truncation_probe_and_argument_errors() {
    if !in_job() {
        return launch_under_both_protocols("truncation_probe_and_argument_errors", &[]);
    }
    let world = Mpi::init().unwrap();
    let me = world.rank();
    let peer = 1 - me as i32;
    // Argument errors, at once.
    assert_eq!(
        world.send(b"x", 2, 0).unwrap_err().class(),
        ErrorClass::Rank
    );
    assert_eq!(
        world.send(b"x", peer, -3).unwrap_err().class(),
        ErrorClass::Tag
    );
    let mut b = [0u8; 4];
    assert_eq!(
        world.recv(&mut b, 9, 0).unwrap_err().class(),
        ErrorClass::Rank
    );
    if me == 0 {
        world.send(&[7u8; 100], 1, 1).unwrap(); // short into 10 bytes
        world.send(&msg(0, 2, 100_000), 1, 2).unwrap(); // long into 50,000 bytes
        world.send(&msg(0, 3, 30_000), 1, 3).unwrap(); // still delivered after both
        world.barrier().unwrap();
        world.send(&msg(0, 4, 12_345), 1, 4).unwrap();
        world.barrier().unwrap();
    } else {
        let mut small = [0u8; 10];
        let e = world.recv(&mut small, 0, 1).unwrap_err();
        assert_eq!(e.class(), ErrorClass::Truncate, "{e}");
        assert_eq!(small, [7u8; 10]);
        let mut half = vec![0u8; 50_000];
        let e = world.recv(&mut half, 0, 2).unwrap_err();
        assert_eq!(e.class(), ErrorClass::Truncate, "{e}");
        let mut ok = vec![0u8; 30_000];
        let st = world.recv(&mut ok, 0, 3).unwrap();
        assert_eq!(st.count, 30_000);
        assert!(ok == msg(0, 3, 30_000));
        // Probe: nothing yet with tag 4 before the sender's barrier.
        assert!(world.iprobe(0, 4).unwrap().is_none());
        world.barrier().unwrap();
        let st = world.probe(ANY_SOURCE, ANY_TAG).unwrap();
        assert_eq!((st.source, st.tag, st.count), (0, 4, 12_345));
        assert_eq!(world.iprobe(0, 4).unwrap().map(|s| s.count), Some(12_345));
        let mut b = vec![0u8; 20_000];
        let st = world.recv(&mut b, 0, 4).unwrap();
        assert_eq!(st.count, 12_345);
        assert_eq!(st.get_count::<u8>(), Some(12_345));
        assert!(b[..12_345] == msg(0, 4, 12_345)[..]);
        assert!(world.iprobe(0, 4).unwrap().is_none(), "received: gone");
        world.barrier().unwrap();
    }
}

/// Long bodies for receives in ordinary memory come through the staging ring: more of them
/// at once than it holds (they wait their turn), one above the staging limit and one into
/// `alloc_mem` (both fetched in place), one truncated; expected, then unexpected.
#[test]
fn long_receives_into_private_memory_wait_their_turn_for_the_staging_ring() {
    if !in_job() {
        return launch_ok_env(
            "long_receives_into_private_memory_wait_their_turn_for_the_staging_ring",
            2,
            2,
            &[],
            &[("SOFTNIC_MPI_LONG", "rendezvous")],
        );
    }
    // (message length, receive length): 20 × 1 MiB and 2 MiB bodies (26 MiB, the ring holds
    // 4), 3 MiB (beyond staging), a truncated one.
    let mut plan: Vec<(usize, usize)> = (0..20)
        .map(|k| {
            if k % 4 == 3 {
                (2 << 20, 2 << 20)
            } else {
                (1 << 20, 1 << 20)
            }
        })
        .collect();
    plan.push((3 << 20, 3 << 20));
    plan.push((700_000, 600_000));
    let world = Mpi::init().unwrap();
    let mem = world.alloc_mem(1 << 20).unwrap();
    for round in 0..2u32 {
        let tag = |k: usize| (round * 100 + k as u32) as i32;
        if world.rank() == 0 {
            if round == 0 {
                world.barrier().unwrap();
            }
            let msgs: Vec<Vec<u8>> = plan
                .iter()
                .enumerate()
                .map(|(k, &(l, _))| msg(round, k as u32, l))
                .collect();
            let in_mem = msg(round, 99, 1 << 20);
            let mut reqs: Vec<_> = msgs
                .iter()
                .enumerate()
                .map(|(k, m)| world.isend(m, 1, tag(k)).unwrap())
                .collect();
            reqs.push(world.isend(&in_mem, 1, tag(99)).unwrap());
            if round == 1 {
                world.barrier().unwrap();
            }
            wait_all(reqs).unwrap();
        } else {
            let before = world.stats().staged_gets;
            if round == 1 {
                world.barrier().unwrap();
            }
            let mut bufs: Vec<Vec<u8>> = plan.iter().map(|&(_, r)| vec![0u8; r]).collect();
            let reqs: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .map(|(k, b)| world.irecv(b, 0, tag(k)).unwrap())
                .collect();
            let m = mem.bytes();
            let in_mem = world.irecv(m, 0, tag(99)).unwrap();
            if round == 0 {
                world.barrier().unwrap();
            }
            for (k, r) in reqs.into_iter().enumerate() {
                let (l, rl) = plan[k];
                match r.wait() {
                    Ok(st) => assert_eq!(st.count, l, "message {k}"),
                    Err(e) => {
                        assert!(rl < l, "message {k}: {e}");
                        assert_eq!(e.class(), ErrorClass::Truncate, "{e}");
                    }
                }
            }
            assert_eq!(in_mem.wait().unwrap().count, 1 << 20);
            for (k, b) in bufs.iter().enumerate() {
                let want = msg(round, k as u32, plan[k].0);
                assert!(
                    b[..] == want[..b.len()],
                    "round {round}: message {k}'s bytes"
                );
            }
            assert!(
                m[..] == msg(round, 99, 1 << 20)[..],
                "the alloc_mem receive"
            );
            // The 20 within the limit and the truncated one; not 3 MiB, not alloc_mem.
            assert_eq!(world.stats().staged_gets - before, 21, "round {round}");
        }
        world.barrier().unwrap();
    }
}

/// Long sends from ordinary memory are copied into the send ring (4 MiB here): more than it
/// holds wait for room, in order; and a receiver that takes a later message first (so the
/// ring gives nothing back) does not deadlock its sender: after the ring's patience the
/// waiting bodies go from where they are.
#[test]
fn long_sends_from_private_memory_wait_for_the_send_ring_but_never_deadlock() {
    if !in_job() {
        return launch_ok_env(
            "long_sends_from_private_memory_wait_for_the_send_ring_but_never_deadlock",
            2,
            2,
            &[],
            &[
                ("SOFTNIC_MPI_LONG", "rendezvous"),
                ("SOFTNIC_MPI_SEND_STAGE", "4194304"),
            ],
        );
    }
    const MIB: usize = 1 << 20;
    let world = Mpi::init().unwrap();
    // Twelve bodies of 1 MiB, received in order: four fit at once, the others wait.
    if world.rank() == 0 {
        let before = world.stats();
        let msgs: Vec<Vec<u8>> = (0..12).map(|k| msg(0, k, MIB)).collect();
        let reqs: Vec<_> = msgs.iter().map(|m| world.isend(m, 1, 1).unwrap()).collect();
        wait_all(reqs).unwrap();
        let s = world.stats();
        assert!(s.stage_waits > before.stage_waits, "none waited for room");
        assert!(
            s.staged_sends - before.staged_sends >= 4,
            "{} staged",
            s.staged_sends - before.staged_sends
        );
    } else {
        for k in 0..12 {
            let mut b = vec![0u8; MIB];
            world.recv(&mut b, 0, 1).unwrap();
            assert!(b == msg(0, k, MIB), "message {k}");
        }
    }
    world.barrier().unwrap();
    // Five bodies with tag 2 fill the ring and one waits; a blocking send with tag 3 queues
    // behind it (same receiver: order), and the receiver wants tag 3 first.
    if world.rank() == 0 {
        let before = world.stats();
        let msgs: Vec<Vec<u8>> = (0..5).map(|k| msg(0, k, MIB)).collect();
        let reqs: Vec<_> = msgs.iter().map(|m| world.isend(m, 1, 2).unwrap()).collect();
        world.send(&msg(0, 99, MIB), 1, 3).unwrap();
        wait_all(reqs).unwrap();
        let staged = world.stats().staged_sends - before.staged_sends;
        assert!(staged <= 4, "{staged} staged: the ring holds four");
    } else {
        let mut b = vec![0u8; MIB];
        let st = world.recv(&mut b, 0, 3).unwrap();
        assert_eq!(st.count, MIB);
        assert!(b == msg(0, 99, MIB), "the blocking send's bytes");
        for k in 0..5 {
            world.recv(&mut b, 0, 2).unwrap();
            assert!(b == msg(0, k, MIB), "message {k} with tag 2");
        }
    }
    world.barrier().unwrap();
}

/// A send ring smaller than the largest staged body would make every such send wait out its
/// patience: init refuses it.
#[test]
fn a_send_ring_too_small_for_a_staged_body_is_refused() {
    if !in_job() {
        return launch_ok_env(
            "a_send_ring_too_small_for_a_staged_body_is_refused",
            2,
            1,
            &[],
            &[("SOFTNIC_MPI_SEND_STAGE", "1000")],
        );
    }
    let e = Mpi::init().err().expect("init with a 1000-byte send ring");
    assert_eq!(e.class(), ErrorClass::Arg, "{e}");
    assert!(e.to_string().contains("SOFTNIC_MPI_SEND_STAGE"), "{e}");
}

/// A rank sends to itself (periodic boundaries, collectives on one rank): short, staged and
/// in-place long messages, the receive posted before and after the send, both protocols.
#[test]
fn messages_to_self_under_both_protocols() {
    if !in_job() {
        return launch_under_both_protocols("messages_to_self_under_both_protocols", &[]);
    }
    let world = Mpi::init().unwrap();
    let me = world.rank();
    let sizes = [0usize, 8, 100_000, 1 << 20, 3 << 20];
    for (k, &len) in sizes.iter().enumerate() {
        let m = msg(me, k as u32, len);
        // Expected: the receive first.
        let mut b = vec![0u8; len];
        let r = world.irecv(&mut b, me as i32, k as i32).unwrap();
        let s = world.isend(&m, me as i32, k as i32).unwrap();
        assert_eq!(r.wait().unwrap().count, len);
        s.wait().unwrap();
        assert!(b == m, "expected message {k} to self");
        // Unexpected: the send first.
        let mut b = vec![0u8; len];
        let s = world.isend(&m, me as i32, 100 + k as i32).unwrap();
        let st = world.recv(&mut b, ANY_SOURCE, 100 + k as i32).unwrap();
        assert_eq!((st.source, st.count), (me, len));
        s.wait().unwrap();
        assert!(b == m, "unexpected message {k} to self");
    }
    world.barrier().unwrap();
}

/// A zero-length receive posted after receives took every bounce slot they may lands nowhere:
/// no slot, no registration of its (dangling) empty buffer; it completes with count 0. The
/// send whose answer completes the receives still finds a slot (receives leave some to sends).
#[test]
fn an_empty_receive_needs_no_slot_and_no_registration() {
    if !in_job() {
        return launch_ok(
            "an_empty_receive_needs_no_slot_and_no_registration",
            2,
            2,
            &[],
        );
    }
    const HELD: usize = 600; // more receives than bounce slots (512)
    let world = Mpi::init().unwrap();
    if world.rank() == 0 {
        let mut bufs = vec![[0u8; 8]; HELD];
        let mut reqs = Vec::new();
        for b in bufs.iter_mut() {
            reqs.push(world.irecv(b, 1, 1).unwrap());
        }
        let mut empty: Vec<u8> = Vec::new();
        let r = world.irecv(&mut empty, 1, 2).unwrap();
        world.send(&[1], 1, 3).unwrap();
        assert_eq!(r.wait().unwrap().count, 0);
        for r in reqs {
            assert_eq!(r.wait().unwrap().count, 8);
        }
        assert!(bufs.iter().all(|b| *b == [7u8; 8]));
    } else {
        world.recv(&mut [0u8; 1], 0, 3).unwrap();
        world.send(&[], 0, 2).unwrap();
        for _ in 0..HELD {
            world.send(&[7u8; 8], 0, 1).unwrap();
        }
    }
    world.barrier().unwrap();
}

/// A sender that dies with long messages half fetched: every receive waiting on it ends
/// (delivered whole, or failed with MPI_ERR_PROC_FAILED — never hung, never blamed on an
/// address), and the staging ring it held is free again for the survivors' long messages.
#[test]
fn a_sender_dying_mid_transfer_ends_its_receives_and_frees_the_staging_ring() {
    if !in_job() {
        return launch_ok_env(
            "a_sender_dying_mid_transfer_ends_its_receives_and_frees_the_staging_ring",
            3,
            2,
            &[],
            &[("SOFTNIC_MPI_LONG", "rendezvous")],
        );
    }
    const N: usize = 20;
    const LEN: usize = 1 << 20;
    let world = Mpi::init().unwrap();
    let me = world.rank();
    let mut bufs: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; LEN]).collect();
    if me == 2 {
        world.barrier().unwrap();
        let msgs: Vec<Vec<u8>> = (0..N).map(|k| msg(2, k as u32, LEN)).collect();
        let reqs: Vec<_> = msgs.iter().map(|m| world.isend(m, 0, 9).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(2));
        // Gone without waiting for them.
        std::mem::forget(reqs);
        std::process::exit(0);
    }
    if me == 0 {
        let t = std::time::Instant::now();
        let reqs: Vec<_> = bufs
            .iter_mut()
            .map(|b| world.irecv(b, 2, 9).unwrap())
            .collect();
        world.barrier().unwrap();
        let whole: Vec<usize> = reqs
            .into_iter()
            .enumerate()
            .filter_map(|(k, r)| match r.wait() {
                Ok(st) => Some((k, st)),
                Err(e) => {
                    assert_eq!(e.class(), ErrorClass::ProcFailed, "message {k}: {e}");
                    None
                }
            })
            .map(|(k, st)| {
                assert_eq!(st.count, LEN);
                k
            })
            .collect();
        assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
        for k in whole {
            assert!(
                bufs[k] == msg(2, k as u32, LEN),
                "delivered message {k} is whole"
            );
        }
    } else {
        world.barrier().unwrap();
    }
    // The survivors: long messages both ways, through the ring again.
    let other = 1 - me as i32;
    let before = world.stats().staged_gets;
    let msgs: Vec<Vec<u8>> = (0..N).map(|k| msg(me, k as u32, LEN)).collect();
    let recvs: Vec<_> = bufs
        .iter_mut()
        .map(|b| world.irecv(b, other, 4).unwrap())
        .collect();
    let sends: Vec<_> = msgs
        .iter()
        .map(|m| world.isend(m, other, 4).unwrap())
        .collect();
    wait_all(recvs).unwrap();
    wait_all(sends).unwrap();
    for (k, b) in bufs.iter().enumerate() {
        assert!(
            *b == msg(other as u32, k as u32, LEN),
            "survivor message {k}"
        );
    }
    assert_eq!(world.stats().staged_gets - before, N as u64);
}

const STORM_N: u32 = 3000;

/// Every other rank sends STORM_N × 1 KiB to rank 0, which starts receiving after `pause_ms`
/// and checks that each message arrives once, in order per sender.
fn storm(pause_ms: u64) -> Comm {
    const LEN: usize = 1024;
    let world = Mpi::init().unwrap();
    let me = world.rank();
    if me == 0 {
        std::thread::sleep(Duration::from_millis(pause_ms));
        let mut next = vec![0u32; world.size() as usize];
        let mut b = vec![0u8; LEN];
        for _ in 0..STORM_N * (world.size() - 1) {
            let st = world.recv(&mut b, ANY_SOURCE, 9).unwrap();
            let s = st.source as usize;
            assert!(
                b == msg(st.source, next[s], LEN),
                "from {s}: message {} out of order",
                next[s]
            );
            next[s] += 1;
        }
        assert!(next[1..].iter().all(|&k| k == STORM_N));
        assert!(world.iprobe(ANY_SOURCE, ANY_TAG).unwrap().is_none());
    } else {
        for k in 0..STORM_N {
            world.send(&msg(me, k, LEN), 0, 9).unwrap();
        }
    }
    world
}

/// Seven ranks flood rank 0 with more unexpected messages than its 16 MiB of overflow
/// buffers hold while it does not receive: its portal is disabled, the senders queue, and
/// after recovery every message arrives once, in order per sender.
#[test]
fn unexpected_storm_trips_flow_control_and_delivers_all_in_order() {
    if !in_job() {
        return launch_ok_env(
            "unexpected_storm_trips_flow_control_and_delivers_all_in_order",
            8,
            2,
            &[],
            &[("SOFTNIC_MPI_FLOW", "recovery")],
        );
    }
    let world = storm(1500);
    let refused = [world.stats().pt_disabled];
    let mut total = [0u64];
    world.allreduce(&refused, &mut total, Op::Sum).unwrap();
    assert!(total[0] > 0, "the storm never tripped flow control");
    if world.rank() == 0 {
        eprintln!("flow control refused {} messages", total[0]);
    }
}

/// The same storm under static credits (`SOFTNIC_MPI_FLOW=credit`, 32 per pair): the senders
/// wait for credits, the receiver's portal is never disabled, and every message arrives
/// once, in order; credits come back as rank 0 receives.
#[test]
fn unexpected_storm_under_static_credits_never_disables_the_portal() {
    if !in_job() {
        return launch_ok_env(
            "unexpected_storm_under_static_credits_never_disables_the_portal",
            8,
            2,
            &[],
            &[
                ("SOFTNIC_MPI_FLOW", "credit"),
                ("SOFTNIC_MPI_CREDITS", "32"),
            ],
        );
    }
    let world = storm(1000);
    if world.rank() == 0 {
        assert!(world.stats().credit_returns >= (STORM_N as u64 / 16) * 7);
    } else {
        assert!(
            world.stats().credit_waits > 0,
            "the sender never ran out of credits"
        );
    }
    let refused = [world.stats().pt_disabled];
    let mut total = [0u64];
    world.allreduce(&refused, &mut total, Op::Sum).unwrap();
    assert_eq!(total[0], 0, "credits kept the receiver's portal enabled");
}

#[test]
fn communicators_and_collectives() {
    if !in_job() {
        // Offloaded and point-to-point collectives, also under loss (the default, auto,
        // offloads beyond two ranks).
        let offload = [("SOFTNIC_MPI_COLL", "triggered")];
        for n in [2, 3, 8] {
            launch_ok_env("communicators_and_collectives", n, 2, &[], &offload);
        }
        launch_ok_env(
            "communicators_and_collectives",
            5,
            2,
            &[],
            &[("SOFTNIC_MPI_COLL", "p2p")],
        );
        launch_ok(
            "communicators_and_collectives",
            6,
            2,
            &["--fault-drop", "0.1"],
        );
        return;
    }
    let world = Mpi::init().unwrap();
    let (me, n) = (world.rank(), world.size());
    world.barrier().unwrap();
    // Back-to-back small collectives with moving roots: the offloaded trees reuse their
    // buffers every other epoch, and a fast rank runs ahead into the next one.
    for i in 0..300u64 {
        let root = (i % n as u64) as u32;
        let mut v = [0u64; 5];
        if me == root {
            v = [i, i + 1, i + 2, i + 3, root as u64];
        }
        world.bcast(&mut v, root).unwrap();
        assert_eq!(v, [i, i + 1, i + 2, i + 3, root as u64], "bcast {i}");
        let mut s = [0u64; 2];
        world
            .allreduce(&[i + me as u64, 1], &mut s, Op::Sum)
            .unwrap();
        assert_eq!(
            s,
            [n as u64 * i + (n * (n - 1) / 2) as u64, n as u64],
            "allreduce {i}"
        );
        if i % 3 == 0 {
            world.barrier().unwrap();
        }
    }
    for root in 0..n {
        let mut v = if me == root {
            vec![root as i64 + 11; 1000]
        } else {
            vec![0i64; 1000]
        };
        world.bcast(&mut v, root).unwrap();
        assert!(v.iter().all(|&x| x == root as i64 + 11));
        let mut r = [0i64; 2];
        world
            .reduce(&[me as i64, 1], &mut r, Op::Sum, root)
            .unwrap();
        if me == root {
            assert_eq!(r, [(n * (n - 1) / 2) as i64, n as i64]);
        }
    }
    let mut r = [0f64; 3];
    world
        .allreduce(&[me as f64, -(me as f64), 0.5], &mut r, Op::Max)
        .unwrap();
    assert_eq!(r, [(n - 1) as f64, 0.0, 0.5]);
    let mut s = [0u64; 1];
    world.allreduce(&[1u64 << me], &mut s, Op::Bor).unwrap();
    assert_eq!(s[0], (1u64 << n) - 1);
    let mut all = vec![0u32; 2 * n as usize];
    world.allgather(&[me, me * me], &mut all).unwrap();
    for r in 0..n {
        assert_eq!(&all[2 * r as usize..2 * r as usize + 2], &[r, r * r]);
    }
    assert_eq!(
        world
            .allreduce(&[1.0f32], &mut [0.0f32], Op::Bxor)
            .unwrap_err()
            .class(),
        ErrorClass::Op
    );
    // Split: odd and even, reversed order by key.
    let sub = world.split((me % 2) as i32, -(me as i32)).unwrap().unwrap();
    let mine: Vec<u32> = (0..n).filter(|r| r % 2 == me % 2).rev().collect();
    assert_eq!(sub.group(), mine);
    assert_eq!(sub.group()[sub.rank() as usize], me);
    let mut sum = [0u32];
    sub.allreduce(&[me], &mut sum, Op::Sum).unwrap();
    assert_eq!(sum[0], mine.iter().sum::<u32>());
    // Messages on the sub-communicator never match the world's (contexts differ).
    let dup = world.dup().unwrap();
    assert_ne!(dup.context_id(), world.context_id());
    if n >= 2 {
        if me == 0 {
            dup.send(b"dup", 1, 3).unwrap();
            world.send(b"world", 1, 3).unwrap();
        } else if me == 1 {
            let mut b = [0u8; 8];
            let st = world.recv(&mut b, 0, 3).unwrap();
            assert_eq!(&b[..st.count], b"world");
            let st = dup.recv(&mut b, 0, 3).unwrap();
            assert_eq!(&b[..st.count], b"dup");
        }
    }
    let none = world.split(if me == 0 { UNDEFINED } else { 1 }, 0).unwrap();
    assert_eq!(none.is_none(), me == 0);
    drop(none);
    // Exhaustion: a clear error, and freeing gives the ids back.
    let mut many = Vec::new();
    let e = loop {
        match world.dup() {
            Ok(c) => many.push(c),
            Err(e) => break e,
        }
    };
    assert_eq!(e.class(), ErrorClass::Other, "{e}");
    assert!(many.len() > 1000, "{} contexts", many.len());
    drop(many);
    let again = world.dup().unwrap();
    again.barrier().unwrap();
}

#[test]
fn one_sided_fence_accumulate_and_atomics() {
    if !in_job() {
        launch_ok("one_sided_fence_accumulate_and_atomics", 4, 2, &[]);
        launch_ok(
            "one_sided_fence_accumulate_and_atomics",
            2,
            2,
            &["--fault-drop", "0.1"],
        );
        return;
    }
    let world = Mpi::init().unwrap();
    let (me, n) = (world.rank(), world.size());
    let mut win = Win::allocate(&world, 1 << 20).unwrap();
    // Outside any epoch: an error, nothing sent.
    assert_eq!(
        win.put(b"x", 0, 0).unwrap_err().class(),
        ErrorClass::RmaSync
    );
    win.fence().unwrap();
    let right = (me + 1) % n;
    let data = msg(me, 0, 300_000);
    win.put(&data, right, 1000).unwrap();
    win.fence().unwrap();
    let left = (me + n - 1) % n;
    assert!(win.local()[1000..301_000] == msg(left, 0, 300_000)[..]);
    let mut back = vec![0u8; 300_000];
    win.get(&mut back, right, 1000).unwrap();
    assert!(back == data);
    // Range and rank errors.
    assert_eq!(
        win.put(b"xy", right, (1 << 20) - 1).unwrap_err().class(),
        ErrorClass::RmaRange
    );
    assert_eq!(win.put(b"x", n, 0).unwrap_err().class(), ErrorClass::Rank);
    win.fence().unwrap();
    // Accumulate: every rank adds to rank 0's words 10 times; exact sums.
    for _ in 0..10 {
        win.accumulate(&[1i64, me as i64, -2], 0, 8, Op::Sum)
            .unwrap();
    }
    win.accumulate(&[me as f64], 0, 64, Op::Max).unwrap();
    win.fence().unwrap();
    if me == 0 {
        let w =
            |k: usize| i64::from_le_bytes(win.local()[8 + 8 * k..16 + 8 * k].try_into().unwrap());
        assert_eq!(
            (w(0), w(1), w(2)),
            (10 * n as i64, 10 * (n * (n - 1) / 2) as i64, -20 * n as i64)
        );
        let f = f64::from_le_bytes(win.local()[64..72].try_into().unwrap());
        assert_eq!(f, (n - 1) as f64);
    }
    // Tickets: fetch_and_op gives distinct values; NO_OP reads; REPLACE swaps.
    let mut mine = Vec::new();
    for _ in 0..50 {
        mine.push(win.fetch_and_op(1u64, 0, 128, Op::Sum).unwrap());
    }
    win.fence().unwrap();
    let mut all = vec![0u64; 50 * n as usize];
    world.allgather(&mine, &mut all).unwrap();
    all.sort();
    assert!(
        all.iter().enumerate().all(|(i, &t)| t == i as u64),
        "tickets distinct and dense"
    );
    assert_eq!(
        win.fetch_and_op(0u64, 0, 128, Op::NoOp).unwrap(),
        50 * n as u64
    );
    win.fence().unwrap();
    // Compare-and-swap: exactly one rank wins.
    let old = win.compare_and_swap(me as u64 + 1, 0u64, 0, 256).unwrap();
    let won = [(old == 0) as u32];
    let mut wins = [0u32];
    world.allreduce(&won, &mut wins, Op::Sum).unwrap();
    assert_eq!(wins[0], 1);
    win.fence().unwrap();
    win.free().unwrap();
}

#[test]
fn one_sided_locks_pscw_and_epoch_errors() {
    if !in_job() {
        launch_ok("one_sided_locks_pscw_and_epoch_errors", 8, 2, &[]);
        return;
    }
    let world = Mpi::init().unwrap();
    let (me, n) = (world.rank(), world.size());
    let mut win = Win::allocate(&world, 4096).unwrap();
    assert_eq!(win.unlock(0).unwrap_err().class(), ErrorClass::RmaSync);
    // Exclusive locks never overlap: a non-atomic read-modify-write of a counter stays exact.
    const ITERS: u64 = 20;
    for _ in 0..ITERS {
        win.lock(LockType::Exclusive, 0, 0).unwrap();
        let mut b = [0u8; 8];
        win.get(&mut b, 0, 0).unwrap();
        let v = u64::from_le_bytes(b) + 1;
        win.put(&v.to_le_bytes(), 0, 0).unwrap();
        win.unlock(0).unwrap();
    }
    assert_eq!(
        win.lock(LockType::Shared, 1, 0)
            .and_then(|_| win.lock(LockType::Shared, 1, 0))
            .unwrap_err()
            .class(),
        ErrorClass::RmaSync
    );
    win.unlock(1).unwrap();
    world.barrier().unwrap();
    if me == 0 {
        win.lock(LockType::Shared, 0, 0).unwrap();
        let mut b = [0u8; 8];
        win.get(&mut b, 0, 0).unwrap();
        assert_eq!(u64::from_le_bytes(b), ITERS * n as u64);
        win.unlock(0).unwrap();
    }
    // lock_all + flush: each rank writes its slot at every rank.
    win.lock_all(0).unwrap();
    for t in 0..n {
        win.put(&[me as u8 + 1], t, 100 + me as u64).unwrap();
        win.flush(t).unwrap();
    }
    win.unlock_all().unwrap();
    world.barrier().unwrap();
    assert!(win.local()[100..100 + n as usize]
        .iter()
        .enumerate()
        .all(|(r, &b)| b == r as u8 + 1));
    // PSCW: even ranks expose to odd ones, which put into them.
    world.barrier().unwrap();
    if me % 2 == 0 {
        let origins: Vec<u32> = (0..n).filter(|r| r % 2 == 1).collect();
        win.post(&origins).unwrap();
        win.wait().unwrap();
        for &o in &origins {
            assert_eq!(win.local()[1000 + o as usize], 0xa0 + o as u8);
        }
        assert_eq!(win.complete().unwrap_err().class(), ErrorClass::RmaSync);
    } else {
        let targets: Vec<u32> = (0..n).filter(|r| r % 2 == 0).collect();
        win.start(&targets).unwrap();
        for &t in &targets {
            win.put(&[0xa0 + me as u8], t, 1000 + me as u64).unwrap();
        }
        win.complete().unwrap();
        assert_eq!(
            win.put(b"x", 0, 0).unwrap_err().class(),
            ErrorClass::RmaSync
        );
    }
    win.free().unwrap();
}

/// A waiting exclusive locker is not overtaken: rank 0 holds a shared lock on itself, rank
/// 1 asks for an exclusive one, and rank 2's later shared lock waits until rank 1 has had
/// its epoch (it then reads rank 1's mark). Before exclusive waiters announced themselves
/// rank 2 got in at once, and shared lockers in a loop could starve a writer for good.
#[test]
fn an_exclusive_waiter_goes_before_later_lockers() {
    if !in_job() {
        launch_ok("an_exclusive_waiter_goes_before_later_lockers", 3, 2, &[]);
        return;
    }
    let world = Mpi::init().unwrap();
    let me = world.rank();
    let mut win = Win::allocate(&world, 4096).unwrap();
    if me == 0 {
        win.lock(LockType::Shared, 0, 0).unwrap();
    }
    world.barrier().unwrap();
    match me {
        0 => {
            // Long enough for rank 1 to fail once and announce itself, and for rank 2 to
            // try while rank 1 waits.
            std::thread::sleep(Duration::from_millis(600));
            win.unlock(0).unwrap();
        }
        1 => {
            win.lock(LockType::Exclusive, 0, 0).unwrap();
            win.put(&7u64.to_le_bytes(), 0, 0).unwrap();
            win.unlock(0).unwrap();
        }
        _ => {
            std::thread::sleep(Duration::from_millis(200));
            win.lock(LockType::Shared, 0, 0).unwrap();
            let mut b = [0u8; 8];
            win.get(&mut b, 0, 0).unwrap();
            win.unlock(0).unwrap();
            assert_eq!(
                u64::from_le_bytes(b),
                7,
                "the shared lock overtook the waiting writer"
            );
        }
    }
    world.barrier().unwrap();
    win.free().unwrap();
}

#[test]
fn one_sided_requests_alloc_mem_dynamic_windows_and_minloc() {
    if !in_job() {
        launch_ok(
            "one_sided_requests_alloc_mem_dynamic_windows_and_minloc",
            4,
            2,
            &[],
        );
        launch_ok(
            "one_sided_requests_alloc_mem_dynamic_windows_and_minloc",
            2,
            2,
            &["--fault-drop", "0.1"],
        );
        return;
    }
    let world = Mpi::init().unwrap();
    let (me, n) = (world.rank(), world.size());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    // Win::create over alloc_mem memory: request-based put and get.
    let mem = world.alloc_mem(256 * 1024).unwrap();
    let mut win = Win::create(&world, &mem, WinInfo::default()).unwrap();
    win.fence().unwrap();
    let data = msg(me, 1, 100_000);
    let r = win.rput(&data, right, 64).unwrap();
    r.wait().unwrap();
    win.fence().unwrap();
    assert!(mem.bytes()[64..100_064] == msg(left, 1, 100_000)[..]);
    let mut back = vec![0u8; 100_000];
    let mut small = [0u8; 8];
    {
        let r1 = win.rget(&mut back, right, 64).unwrap();
        let mut r2 = win.rget(&mut small, right, 64).unwrap();
        while !r2.test().unwrap() {}
        r1.wait().unwrap();
    }
    assert!(back == data);
    assert_eq!(&small[..], &data[..8]);
    // Raccumulate (20 requests in flight) and atomics on created-window memory.
    win.fence().unwrap();
    let reqs: Vec<_> = (0..20)
        .map(|_| win.raccumulate(&[1i64, 2], 0, 200_000, Op::Sum).unwrap())
        .collect();
    for r in reqs {
        r.wait().unwrap();
    }
    win.fence().unwrap();
    if me == 0 {
        let b = &mem.bytes()[200_000..200_016];
        let w = |k: usize| i64::from_le_bytes(b[8 * k..8 * k + 8].try_into().unwrap());
        assert_eq!((w(0), w(1)), (20 * n as i64, 40 * n as i64));
    }
    // Get_accumulate: the first elements are distinct dense tickets; the second rises by 2s.
    let mut mine = Vec::new();
    for _ in 0..30 {
        let mut old = [0u64; 2];
        win.get_accumulate(&[1u64, 2], &mut old, 0, 210_000, Op::Sum)
            .unwrap();
        assert_eq!(old[1], 2 * old[0]);
        mine.push(old[0]);
    }
    win.fence().unwrap();
    let mut all = vec![0u64; 30 * n as usize];
    world.allgather(&mine, &mut all).unwrap();
    all.sort();
    assert!(all.iter().enumerate().all(|(i, &t)| t == i as u64));
    let mut now = [0u64; 2];
    win.get_accumulate(&[], &mut now, 0, 210_000, Op::NoOp)
        .unwrap();
    assert_eq!(now, [30 * n as u64, 60 * n as u64]);
    assert_eq!(
        win.get_accumulate(&[1u64], &mut now, 0, 210_000, Op::Sum)
            .unwrap_err()
            .class(),
        ErrorClass::Count
    );
    win.fence().unwrap();
    // A long get_accumulate (many max_atomic_size pieces) and its request form: REPLACE
    // swaps in this rank's array, each rank in turn, at the right-hand neighbour.
    let k = 3000usize;
    for turn in 0..n {
        if turn == me {
            let mine: Vec<u32> = (0..k as u32).map(|i| i + 1000 * me).collect();
            let mut old = vec![0u32; k];
            if me % 2 == 0 {
                win.get_accumulate(&mine, &mut old, right, 220_000, Op::Replace)
                    .unwrap();
            } else {
                win.rget_accumulate(&mine, &mut old, right, 220_000, Op::Replace)
                    .unwrap()
                    .wait()
                    .unwrap();
            }
            assert!(old.iter().all(|&v| v == 0), "fresh memory before the swap");
        }
        win.fence().unwrap();
    }
    let got: Vec<u32> = mem.bytes()[220_000..220_000 + 4 * k]
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(got
        .iter()
        .enumerate()
        .all(|(i, &v)| v == i as u32 + 1000 * left));
    // MINLOC under fence, MAXLOC from everyone at once under lock_all.
    if me == 0 {
        let low = Loc {
            value: -1e9f64,
            index: -1,
        };
        let init = [
            Loc {
                value: 1e9f64,
                index: -1,
            },
            low,
            low,
        ];
        mem.bytes()[230_000..230_048].copy_from_slice(&Loc::encode(&init));
    }
    win.fence().unwrap();
    let v = ((me * 7) % 3) as f64;
    win.accumulate_loc(
        &[Loc {
            value: v,
            index: me as i32,
        }],
        0,
        230_000,
        Op::MinLoc,
    )
    .unwrap();
    win.fence().unwrap();
    win.lock_all(0).unwrap();
    for k in 0..10 {
        let p = Loc {
            value: (me * 10 + k) as f64,
            index: me as i32,
        };
        win.accumulate_loc(&[p, p], 0, 230_016, Op::MaxLoc).unwrap();
    }
    assert_eq!(
        win.accumulate(&[1u32], 0, 0, Op::MinLoc)
            .unwrap_err()
            .class(),
        ErrorClass::Op
    );
    win.unlock_all().unwrap();
    world.barrier().unwrap();
    if me == 0 {
        let mut out = [Loc::<f64>::default(); 3];
        Loc::decode(&mem.bytes()[230_000..230_048], &mut out);
        assert_eq!(
            out[0],
            Loc {
                value: 0.0,
                index: 0
            },
            "MINLOC: smallest value, then index"
        );
        let top = Loc {
            value: ((n - 1) * 10 + 9) as f64,
            index: n as i32 - 1,
        };
        assert_eq!((out[1], out[2]), (top, top), "MAXLOC");
    }
    win.free().unwrap();
    // MINLOC/MAXLOC as reductions.
    let send = [
        Loc {
            value: (me % 2) as i32,
            index: me as i32,
        },
        Loc {
            value: me as i32,
            index: me as i32,
        },
    ];
    let mut recv = [Loc::default(); 2];
    world.allreduce_loc(&send, &mut recv, Op::MinLoc).unwrap();
    assert_eq!(
        recv,
        [Loc { value: 0, index: 0 }, Loc { value: 0, index: 0 }]
    );
    world
        .reduce_loc(&send, &mut recv, Op::MaxLoc, 1 % n)
        .unwrap();
    if me == 1 % n {
        let top = Loc {
            value: n as i32 - 1,
            index: n as i32 - 1,
        };
        assert_eq!(
            recv,
            [
                Loc {
                    value: (n > 1) as i32,
                    index: (n > 1) as i32
                },
                top
            ]
        );
    }
    // A dynamic window: segments attached, addressed by address, detached.
    let mut dynw = Win::create_dynamic(&world, WinInfo::default()).unwrap();
    let seg = world.alloc_mem(4096).unwrap();
    dynw.attach(&seg).unwrap();
    assert_eq!(dynw.attach(&seg).unwrap_err().class(), ErrorClass::Arg);
    let mut addrs = vec![0u64; n as usize];
    world.allgather(&[seg.address()], &mut addrs).unwrap();
    dynw.fence().unwrap();
    dynw.put(&msg(me, 2, 1000), right, addrs[right as usize] + 8)
        .unwrap();
    assert_eq!(
        dynw.put(b"x", right, addrs[right as usize] + 4096)
            .unwrap_err()
            .class(),
        ErrorClass::RmaRange,
        "past the segment's end"
    );
    dynw.fence().unwrap();
    assert!(seg.bytes()[8..1008] == msg(left, 2, 1000)[..]);
    assert_eq!(
        dynw.fetch_and_op(5u64, right, addrs[right as usize] + 2048, Op::Sum)
            .unwrap(),
        0
    );
    dynw.fence().unwrap();
    assert_eq!(
        u64::from_le_bytes(seg.bytes()[2048..2056].try_into().unwrap()),
        5
    );
    // Detached: operations aimed at it fail; a new segment is found by its address.
    dynw.detach(&seg).unwrap();
    assert_eq!(dynw.detach(&seg).unwrap_err().class(), ErrorClass::Arg);
    let seg2 = world.alloc_mem(8192).unwrap();
    dynw.attach(&seg2).unwrap();
    let mut addrs2 = vec![0u64; n as usize];
    world.allgather(&[seg2.address()], &mut addrs2).unwrap();
    world.barrier().unwrap();
    let stale = dynw
        .put(b"stale", right, addrs[right as usize] + 8)
        .and_then(|()| dynw.flush_all());
    assert_eq!(stale.unwrap_err().class(), ErrorClass::RmaRange);
    dynw.put(&msg(me, 3, 5000), right, addrs2[right as usize] + 100)
        .unwrap();
    dynw.fence().unwrap();
    assert!(seg2.bytes()[100..5100] == msg(left, 3, 5000)[..]);
    assert!(seg.bytes()[8..13] != b"stale"[..]);
    dynw.free().unwrap();
}

/// PSCW with an origin that is gone: the target's post is not waited for, so its wait
/// must notice the failed notification instead of waiting out its 120 s for a count that
/// cannot come.
#[test]
fn a_pscw_wait_fails_soon_when_an_origin_is_gone() {
    if !in_job() {
        return launch_ok("a_pscw_wait_fails_soon_when_an_origin_is_gone", 3, 2, &[]);
    }
    let world = Mpi::init().unwrap();
    let me = world.rank();
    let mut win = Win::allocate(&world, 4096).unwrap();
    world.barrier().unwrap();
    match me {
        2 => std::process::exit(0),
        0 => {
            let t = std::time::Instant::now();
            let e = win
                .post(&[1, 2])
                .and_then(|()| win.wait())
                .expect_err("rank 2 never completes");
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{:?}: {e}",
                t.elapsed()
            );
            // ProcFailed when the ping finds it gone; RmaRange when the post to it failed.
            assert!(
                matches!(e.class(), ErrorClass::ProcFailed | ErrorClass::RmaRange),
                "{e}"
            );
        }
        _ => {
            win.start(&[0]).unwrap();
            win.put(&[1u8; 8], 0, 0).unwrap();
            win.complete().unwrap();
        }
    }
}

/// A rank that dies: receives waiting on it fail with MPI_ERR_PROC_FAILED (the waits ask
/// after their peer), later calls naming it fail at once, the survivors go on and finalize.
#[test]
fn a_dead_rank_fails_the_requests_waiting_on_it() {
    if !in_job() {
        return launch_ok("a_dead_rank_fails_the_requests_waiting_on_it", 3, 2, &[]);
    }
    let world = Mpi::init().unwrap();
    let me = world.rank();
    world.barrier().unwrap();
    if me == 2 {
        // Gone without finalizing: its NIC state goes with its attachment.
        std::process::exit(0);
    }
    let t = std::time::Instant::now();
    let mut b = [0u8; 64];
    let e = world.recv(&mut b, 2, 5).unwrap_err();
    assert_eq!(e.class(), ErrorClass::ProcFailed, "{e}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let mut big = vec![0u8; 100_000];
    assert_eq!(
        world.irecv(&mut big, 2, 6).unwrap_err().class(),
        ErrorClass::ProcFailed,
        "known dead: refused at once"
    );
    assert_eq!(
        world.send(b"x", 2, 1).unwrap_err().class(),
        ErrorClass::ProcFailed
    );
    // The survivors still talk.
    let other = 1 - me as i32;
    let r = world.irecv(&mut b[..4], other, 7).unwrap();
    world.send(&me.to_le_bytes(), other, 7).unwrap();
    r.wait().unwrap();
    assert_eq!(u32::from_le_bytes(b[..4].try_into().unwrap()), other as u32);
}
