//! EXTOLL's engines through real daemons: VELO messages of every size from every rank to every
//! other, exactly once and in order per sender, also under loss and duplication; a receiver
//! that does not poll holds back only its senders; bad input gets a typed error.

mod common;

use std::time::{Duration, Instant};

use common::*;
use softnic::extoll::velo::{Velo, VeloError};

/// Message `k` from `src`: its length, tag and bytes.
fn message(src: u32, k: u64, max: usize) -> (Vec<u8>, u8) {
    let len = (k as usize * 7 + src as usize) % (max + 1);
    let data = (0..len)
        .map(|i| (k as usize * 31 + i * 7 + src as usize) as u8)
        .collect();
    (data, (k % 251) as u8)
}

const PER_PEER: u64 = 300;

fn velo_all_to_all_body() {
    let mut v = Velo::open().unwrap();
    let (me, n) = (v.rank(), v.size());
    let max = v.max_message();
    let conns: Vec<_> = (0..n).map(|r| v.connect(r).unwrap()).collect();
    let mut next = vec![0u64; n as usize];
    let mut got = 0u64;
    let want = PER_PEER * (n as u64 - 1);
    let mut buf = [0u8; 128];
    let check =
        |v: &mut Velo, next: &mut Vec<u64>, got: &mut u64, m: (usize, u32, u8), buf: &[u8]| {
            let (len, src, tag) = m;
            let k = next[src as usize];
            let (data, t) = message(src, k, v.max_message());
            assert_eq!(
                (len, tag),
                (data.len(), t),
                "message {k} from {src}: length/tag"
            );
            assert_eq!(&buf[..len], &data[..], "message {k} from {src}: bytes");
            next[src as usize] += 1;
            *got += 1;
        };
    // Interleave sending to everyone with receiving, so no one waits on a full mailbox alone.
    for k in 0..PER_PEER {
        for r in (0..n).filter(|&r| r != me) {
            let (data, tag) = message(me, k, max);
            loop {
                match v.try_send(conns[r as usize], &data, tag) {
                    Ok(()) => break,
                    Err(VeloError::WouldBlock(_)) => {
                        while let Some(m) = v.probe_recv(&mut buf).unwrap() {
                            check(&mut v, &mut next, &mut got, m, &buf);
                        }
                        v.endpoint().borrow_mut().progress();
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
        while let Some(m) = v.probe_recv(&mut buf).unwrap() {
            check(&mut v, &mut next, &mut got, m, &buf);
        }
    }
    while got < want {
        let m = v.recv(&mut buf).unwrap();
        check(&mut v, &mut next, &mut got, m, &buf);
    }
    v.flush().unwrap();
    assert!(
        v.probe_recv(&mut buf).unwrap().is_none(),
        "nothing more than sent"
    );
    v.endpoint().borrow_mut().barrier().unwrap();
}

#[test]
fn velo_all_to_all_two_ranks() {
    if in_job() {
        return velo_all_to_all_body();
    }
    launch_ok("velo_all_to_all_two_ranks", 2, 2, &[]);
}

#[test]
fn velo_all_to_all_eight_ranks_small_mailboxes() {
    if in_job() {
        return velo_all_to_all_body();
    }
    launch_ok_env(
        "velo_all_to_all_eight_ranks_small_mailboxes",
        8,
        2,
        &[],
        &[("SOFTNIC_VELO_SLOTS", "16"), ("SOFTNIC_VELO_CREDITS", "4")],
    );
}

#[test]
fn velo_all_to_all_128_byte_slots_under_loss() {
    if in_job() {
        return velo_all_to_all_body();
    }
    launch_ok_env(
        "velo_all_to_all_128_byte_slots_under_loss",
        4,
        2,
        &[
            "--fault-drop",
            "0.1",
            "--fault-duplicate",
            "0.1",
            "--fault-seed",
            "5",
        ],
        &[("SOFTNIC_VELO_SLOT", "128")],
    );
}

/// Rank 1 does not poll while ranks 0 and 2 fill its 16-slot mailbox and more; rank 3 gets
/// messages from rank 2 meanwhile. Then rank 1 drains everything, in order.
fn full_mailbox_body() {
    let mut v = Velo::open().unwrap();
    let me = v.rank();
    let mut buf = [0u8; 64];
    const N: u64 = 100;
    match me {
        0 | 2 => {
            let to = v.connect(1).unwrap();
            let mut blocked = false;
            for k in 0..N {
                let (data, tag) = message(me, k, v.max_message());
                loop {
                    match v.try_send(to, &data, tag) {
                        Ok(()) => break,
                        Err(VeloError::WouldBlock(1)) => {
                            blocked = true;
                            v.endpoint().borrow_mut().wait_any().unwrap();
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                if me == 2 && k < 4 {
                    // Other ports are unaffected: rank 3 gets its messages meanwhile.
                    let three = v.connect(3).unwrap();
                    v.send(three, &k.to_le_bytes(), 1).unwrap();
                }
            }
            assert!(
                blocked,
                "a receiver that does not poll holds its senders back"
            );
            // Sending to itself over VELO works too (the local path).
            let mine = v.connect(me).unwrap();
            v.send(mine, b"self", 9).unwrap();
            assert_eq!(v.recv(&mut buf).unwrap(), (4, me, 9));
            v.flush().unwrap();
        }
        1 => {
            // Not polling until the senders must have run out of credit.
            std::thread::sleep(Duration::from_millis(300));
            let mut next = [0u64; 4];
            let t = Instant::now();
            while next[0] < N || next[2] < N {
                let (len, src, tag) = v.recv(&mut buf).unwrap();
                let (data, t2) = message(src, next[src as usize], v.max_message());
                assert_eq!((&buf[..len], tag), (&data[..], t2), "from {src}");
                next[src as usize] += 1;
                assert!(t.elapsed() < Duration::from_secs(60));
            }
        }
        _ => {
            for k in 0..4u64 {
                let (len, src, tag) = v.recv(&mut buf).unwrap();
                assert_eq!((len, src, tag), (8, 2, 1));
                assert_eq!(buf[..8], k.to_le_bytes());
            }
        }
    }
    // Too long: refused before anything is sent.
    let to = v.connect((me + 1) % 4).unwrap();
    match v.try_send(to, &[0; 65], 0) {
        Err(VeloError::TooLong { len: 65, max: 64 }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(v.connect(99), Err(VeloError::NoSuchRank(99))));
    v.endpoint().borrow_mut().barrier().unwrap();
}

#[test]
fn velo_a_full_mailbox_holds_back_only_its_senders() {
    if in_job() {
        return full_mailbox_body();
    }
    launch_ok_env(
        "velo_a_full_mailbox_holds_back_only_its_senders",
        4,
        2,
        &[],
        &[("SOFTNIC_VELO_SLOTS", "16"), ("SOFTNIC_VELO_CREDITS", "8")],
    );
}

// ---------------------------------------------------------------- RMA

use softnic::extoll::rma::{
    Class, Cmd, Notification, Rma, RmaError, NOTIFY_COMPLETER, NOTIFY_REQUESTER, NOTIFY_RESPONDER,
};

/// Waits for `n` notifications, freeing each; returns them in order.
fn notes(rma: &mut Rma, n: usize) -> Vec<Notification> {
    let t = Instant::now();
    (0..n)
        .map(|_| {
            let x = rma.noti_get_block();
            assert!(rma.noti_free());
            assert!(t.elapsed() < Duration::from_secs(120), "notifications late");
            x
        })
        .collect()
}

fn rma_body(sizes: &[u64]) {
    let mut rma = Rma::open().unwrap();
    let (me, n) = (rma.rank(), rma.size());
    let max = *sizes.iter().max().unwrap();
    // Landing slots, one per sender; then this rank's source.
    let land = rma.register((max * n as u64) as usize).unwrap();
    let src = rma.register(max as usize).unwrap();
    rma.endpoint().borrow_mut().barrier().unwrap();
    let conns: Vec<_> = (0..n).map(|r| rma.connect(r).unwrap()).collect();
    for (si, &size) in sizes.iter().enumerate() {
        let data = pattern(size as usize, me as u64 * 100 + si as u64);
        src.mem.bytes()[..size as usize].copy_from_slice(&data);
        let others: Vec<u32> = (0..n).filter(|&r| r != me).collect();
        for &r in &others {
            // The same handles everywhere: the peer's landing NLA is ours, in its slot for us.
            let dst = land.nla_at(me as u64 * max);
            rma.post_put(
                conns[r as usize],
                &src,
                0,
                dst,
                size,
                NOTIFY_REQUESTER | NOTIFY_COMPLETER,
            )
            .unwrap();
        }
        // Ours: a requester per put sent, a completer per put received.
        let got = notes(&mut rma, 2 * others.len());
        let req = got.iter().filter(|x| x.class == Class::Requester).count();
        assert_eq!(req, others.len(), "{got:?}");
        for x in &got {
            x.result().unwrap();
            assert_eq!((x.cmd, x.len as u64), (Cmd::Put, size));
            if x.class == Class::Completer {
                assert_eq!(
                    x.nla,
                    land.nla_at(x.peer as u64 * max),
                    "completer names where"
                );
                let at = (x.peer as u64 * max) as usize;
                let want = pattern(size as usize, x.peer as u64 * 100 + si as u64);
                assert!(
                    land.mem.bytes()[at..at + size as usize] == want[..],
                    "data from {}",
                    x.peer
                );
            } else {
                assert_eq!(x.nla, src.nla);
            }
        }
        rma.endpoint().borrow_mut().barrier().unwrap();
        // Get back what we put at the next rank: requester and completer here, responder there.
        let next = (me + 1) % n;
        let back = rma.register(size as usize).unwrap();
        rma.post_get(
            conns[next as usize],
            &back,
            0,
            land.nla_at(me as u64 * max),
            size,
            NOTIFY_REQUESTER | NOTIFY_RESPONDER | NOTIFY_COMPLETER,
        )
        .unwrap();
        let got = notes(&mut rma, 3);
        let mut classes: Vec<_> = got.iter().map(|x| x.class as u8).collect();
        classes.sort();
        assert_eq!(classes, [1, 2, 3], "{got:?}");
        let resp = got.iter().find(|x| x.class == Class::Responder).unwrap();
        assert_eq!((resp.peer, resp.cmd), ((me + n - 1) % n, Cmd::Get));
        assert!(back.mem.bytes()[..] == data[..], "get size {size}");
        rma.endpoint().borrow_mut().barrier().unwrap();
    }
    // An immediate put with a completer at the target.
    let to = (me + 1) % n;
    rma.immediate_put(
        conns[to as usize],
        land.nla,
        &(me as u64 + 7).to_le_bytes(),
        NOTIFY_COMPLETER,
    )
    .unwrap();
    let x = notes(&mut rma, 1)[0];
    assert_eq!(
        (x.class, x.cmd, x.len),
        (Class::Completer, Cmd::ImmediatePut, 8)
    );
    rma.endpoint().borrow_mut().barrier().unwrap();
    assert_eq!(land.mem.read_u64(0), (me + n - 1) as u64 % n as u64 + 7);
    rma.endpoint().borrow_mut().barrier().unwrap();
}

#[test]
fn rma_every_size_to_eight_mib_two_ranks() {
    if in_job() {
        return rma_body(&[1, 100, 4096, 65537, 1 << 20, 8 << 20]);
    }
    launch_ok("rma_every_size_to_eight_mib_two_ranks", 2, 2, &[]);
}

#[test]
fn rma_four_ranks_under_loss() {
    if in_job() {
        return rma_body(&[1, 4096, 100_000]);
    }
    launch_ok(
        "rma_four_ranks_under_loss",
        4,
        2,
        &[
            "--fault-drop",
            "0.1",
            "--fault-duplicate",
            "0.1",
            "--fault-seed",
            "3",
        ],
    );
}

/// Bad NLAs fail with an error notification and leave the target untouched; sizes out of range
/// are refused at once; a queue nobody frees holds its notifications until it is read.
fn rma_errors_body() {
    let mut rma = Rma::open().unwrap();
    let me = rma.rank();
    let peer = rma.connect(1 - me).unwrap();
    let land = rma.register(4096).unwrap();
    let src = rma.register(4096).unwrap();
    src.mem.bytes().fill(0xab);
    rma.endpoint().borrow_mut().barrier().unwrap();
    if me == 0 {
        // Beyond the region, and a handle nobody registered.
        rma.post_put(peer, &src, 0, land.nla_at(4000), 200, NOTIFY_COMPLETER)
            .unwrap();
        rma.post_put(peer, &src, 0, softnic::extoll::rma::nla(999, 0), 8, 0)
            .unwrap();
        rma.post_get(peer, &src, 0, land.nla_at(4096), 1, 0)
            .unwrap();
        for x in notes(&mut rma, 3) {
            assert_eq!(x.class, Class::Completer);
            assert!(x.result().is_err(), "{x:?}");
        }
        assert!(matches!(
            rma.post_put(peer, &src, 0, land.nla, (8 << 20) + 1, 0),
            Err(RmaError::TooLarge(_))
        ));
        assert!(matches!(
            rma.post_put(peer, &src, 4000, land.nla, 200, 0),
            Err(RmaError::LocalBounds { .. })
        ));
        assert!(matches!(
            rma.immediate_put(peer, land.nla, &[0; 9], 0),
            Err(RmaError::ImmediateSize(9))
        ));
        assert!(matches!(
            rma.immediate_put(peer, land.nla, &[], 0),
            Err(RmaError::ImmediateSize(0))
        ));
    }
    rma.endpoint().borrow_mut().barrier().unwrap();
    if me == 1 {
        assert!(
            land.mem.bytes().iter().all(|&b| b == 0),
            "failed puts left the target untouched"
        );
        assert!(rma.noti_probe().is_none(), "and raised nothing there");
    }
    rma.endpoint().borrow_mut().barrier().unwrap();
    if me == 0 {
        // 40 puts with completer notifications into rank 1's 8-entry queue, which it does not
        // read yet: all requesters come here; nothing is lost there.
        for k in 0..40u64 {
            rma.post_put(
                peer,
                &src,
                k,
                land.nla_at(k * 8),
                8,
                NOTIFY_REQUESTER | NOTIFY_COMPLETER,
            )
            .unwrap();
        }
        for x in notes(&mut rma, 40) {
            assert_eq!((x.class, x.error), (Class::Requester, 0));
        }
    } else {
        std::thread::sleep(Duration::from_millis(300));
        let got = notes(&mut rma, 40);
        for (k, x) in got.iter().enumerate() {
            assert_eq!(
                (x.class, x.nla),
                (Class::Completer, land.nla_at(k as u64 * 8))
            );
        }
        assert!(rma.noti_probe().is_none(), "exactly once");
        assert!(land.mem.bytes()[..320].iter().all(|&b| b == 0xab));
    }
    rma.endpoint().borrow_mut().barrier().unwrap();
}

#[test]
fn rma_bad_addresses_sizes_and_a_full_queue() {
    if in_job() {
        return rma_errors_body();
    }
    launch_ok_env(
        "rma_bad_addresses_sizes_and_a_full_queue",
        2,
        2,
        &[],
        &[("SOFTNIC_RMA_NOTIFICATIONS", "8")],
    );
}
