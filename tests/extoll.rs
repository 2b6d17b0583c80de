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
