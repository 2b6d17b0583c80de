//! Portals 4 conformance through real daemons on two hosts (and self-communication), organised
//! by the specification's sections. Each test is a job; the ranks run the body.

mod common;

use common::*;
use softnic::nic::memory::Perms;
use softnic::portals::*;

struct Setup {
    p: Portals,
    ni: NiHandle,
    eq: u32,
}

/// Attaches, opens a matching logical interface with one EQ.
fn setup() -> Setup {
    let mut p = Portals::init().expect("attach");
    let (ni, limits) = p.ni_init(true, true).unwrap();
    assert!(
        limits.max_pt_index >= 63
            && limits.max_atomic_size >= 32
            && limits.max_fetch_atomic_size >= 32
    );
    let eq = p.eq_alloc(ni, 256).unwrap();
    Setup { p, ni, eq }
}

fn target(rank: u32, pt: u32, bits: u64, off: u64) -> Target {
    Target {
        id: ProcessId::Logical { rank },
        pt_index: pt,
        match_bits: bits,
        remote_offset: off,
    }
}

fn wait_kind(s: &mut Setup, kind: EventKind) -> Event {
    loop {
        let (e, _) = s.p.eq_wait(s.ni, s.eq).unwrap();
        if e.kind == kind {
            return e;
        }
    }
}

#[test]
fn put_is_matched_by_the_target_nic_and_acknowledged() {
    if !in_job() {
        return launch_ok(
            "put_is_matched_by_the_target_nic_and_acknowledged",
            2,
            2,
            &[],
        );
    }
    let mut s = setup();
    let me = s.p.get_id(s.ni).unwrap();
    let rank = match me {
        ProcessId::Logical { rank } => rank,
        _ => unreachable!(),
    };
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), Some(4)).unwrap();
    assert_eq!(pt, 4);
    if rank == 1 {
        s.p.me_append(
            s.ni,
            pt,
            &Me::new(
                Buffer {
                    region: mem.handle,
                    offset: 0,
                    len: 4096,
                },
                0x42,
            ),
            List::Priority,
            9,
        )
        .unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if rank == 0 {
        mem.bytes()[..11].copy_from_slice(b"hello there");
        let md =
            s.p.md_bind(
                s.ni,
                &Md {
                    region: mem.handle,
                    segments: vec![(0, 4096)],
                    options: 0,
                    eq: Some(s.eq),
                    ct: None,
                },
            )
            .unwrap();
        s.p.put(
            s.ni,
            md,
            0,
            11,
            AckReq::Ack,
            target(1, pt, 0x42, 100),
            7,
            0xfeed,
        )
        .unwrap();
        assert_eq!(wait_kind(&mut s, EventKind::Send).user_ptr, 7);
        let ack = wait_kind(&mut s, EventKind::Ack);
        assert_eq!(
            (ack.ni_fail, ack.mlength, ack.user_ptr),
            (NiFail::Ok, 11, 7)
        );
    } else {
        let e = wait_kind(&mut s, EventKind::Put);
        assert_eq!(
            (
                e.mlength,
                e.match_bits,
                e.hdr_data,
                e.user_ptr,
                e.remote_offset
            ),
            (11, 0x42, 0xfeed, 9, 100)
        );
        assert_eq!(e.initiator, ProcessId::Logical { rank: 0 });
        assert_eq!(&mem.bytes()[100..111], b"hello there");
    }
    s.p.endpoint().barrier().unwrap();
}

fn my_rank(s: &Setup) -> u32 {
    match s.p.get_id(s.ni).unwrap() {
        ProcessId::Logical { rank } => rank,
        ProcessId::Physical { pid, .. } => pid,
    }
}

fn whole(mem: &softnic::gni::MemRegion) -> Buffer {
    Buffer {
        region: mem.handle,
        offset: 0,
        len: mem.len() as u64,
    }
}

/// A portal table entry whose priority list takes every message into the whole of `mem` at
/// rank 1 (no events); everyone waits until it is there.
fn catch_all_at_rank_1(s: &mut Setup, me: u32, mem: &softnic::gni::MemRegion) -> u32 {
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    if me == 1 {
        let mut e = Me::new(whole(mem), 0);
        e.ignore_bits = u64::MAX;
        e.options |= me_opt::EVENT_COMM_DISABLE | me_opt::EVENT_LINK_DISABLE;
        s.p.me_append(s.ni, pt, &e, List::Priority, 0).unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    pt
}

fn md_all(s: &mut Setup, mem: &softnic::gni::MemRegion, options: u32, ct: Option<u32>) -> u32 {
    s.p.md_bind(
        s.ni,
        &Md {
            region: mem.handle,
            segments: vec![(0, mem.len() as u64)],
            options,
            eq: Some(s.eq),
            ct,
        },
    )
    .unwrap()
}

// ---------------------------------------------------------------- data movement (get, atomics)

#[test]
fn get_fetch_atomic_and_swap() {
    if !in_job() {
        return launch_ok("get_fetch_atomic_and_swap", 2, 2, &[]);
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    if me == 1 {
        mem.bytes()[..8].copy_from_slice(&100u64.to_le_bytes());
        mem.bytes()[64..72].copy_from_slice(b"get me!!");
        s.p.me_append(s.ni, pt, &Me::new(whole(&mem), 1), List::Priority, 0)
            .unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        let md = md_all(&mut s, &mem, 0, None);
        s.p.get(s.ni, md, 512, 8, target(1, pt, 1, 64), 1).unwrap();
        assert_eq!(wait_kind(&mut s, EventKind::Reply).mlength, 8);
        assert_eq!(&mem.bytes()[512..520], b"get me!!");
        mem.bytes()[0..8].copy_from_slice(&5u64.to_le_bytes());
        s.p.fetch_atomic(
            s.ni,
            md,
            1024,
            md,
            0,
            8,
            target(1, pt, 1, 0),
            2,
            0,
            AtomicOp::Sum,
            Datatype::Uint64,
        )
        .unwrap();
        let r = wait_kind(&mut s, EventKind::Reply);
        assert_eq!((r.user_ptr, r.ni_fail), (2, NiFail::Ok));
        assert_eq!(
            u64::from_le_bytes(mem.bytes()[1024..1032].try_into().unwrap()),
            100
        );
        // CSWAP: 105 → 7.
        mem.bytes()[8..16].copy_from_slice(&7u64.to_le_bytes());
        s.p.swap(
            s.ni,
            md,
            2048,
            md,
            8,
            8,
            target(1, pt, 1, 0),
            3,
            0,
            &105u64.to_le_bytes(),
            AtomicOp::Cswap,
            Datatype::Uint64,
        )
        .unwrap();
        wait_kind(&mut s, EventKind::Reply);
        assert_eq!(
            u64::from_le_bytes(mem.bytes()[2048..2056].try_into().unwrap()),
            105
        );
        // A long atomic is split at max_atomic_size and all of it lands.
        for i in 0..128u64 {
            mem.bytes()[(i * 8) as usize..(i * 8 + 8) as usize]
                .copy_from_slice(&1u64.to_le_bytes());
        }
        s.p.atomic(
            s.ni,
            md,
            0,
            1024,
            AckReq::Ack,
            target(1, pt, 1, 1024),
            4,
            0,
            AtomicOp::Sum,
            Datatype::Int64,
        )
        .unwrap();
        wait_kind(&mut s, EventKind::Ack);
        wait_kind(&mut s, EventKind::Ack);
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        assert_eq!(u64::from_le_bytes(mem.bytes()[0..8].try_into().unwrap()), 7);
        for i in 0..128usize {
            assert_eq!(
                u64::from_le_bytes(mem.bytes()[1024 + i * 8..1032 + i * 8].try_into().unwrap()),
                1,
                "element {i}"
            );
        }
    }
    s.p.endpoint().barrier().unwrap();
}

/// PTL_MD_VOLATILE: the bytes a put sends are the ones its MD held when PtlPut returned (the
/// process overwrites them at once); a longer send from such an MD, or one over memory the
/// library cannot read, is refused.
#[test]
fn volatile_md_sends_what_it_held_when_put_returned() {
    if !in_job() {
        return launch_ok(
            "volatile_md_sends_what_it_held_when_put_returned",
            2,
            2,
            &[],
        );
    }
    const N: usize = 200;
    const LEN: usize = 64;
    let mut s = setup();
    let me = my_rank(&s);
    let max = s.p.ni_init(true, true).unwrap().1.max_volatile_size;
    assert!(max >= LEN as u64);
    let dst =
        s.p.endpoint()
            .mem_register(N * LEN, Perms::READ_WRITE)
            .unwrap();
    let pt = catch_all_at_rank_1(&mut s, me, &dst);
    if me == 0 {
        let src =
            s.p.endpoint()
                .mem_register(4096, Perms::READ_WRITE)
                .unwrap();
        let md = md_all(
            &mut s,
            &src,
            md_opt::VOLATILE | md_opt::EVENT_SEND_DISABLE,
            None,
        );
        for i in 0..N {
            src.bytes()[..LEN].fill(i as u8);
            let t = target(1, pt, 0, (i * LEN) as u64);
            s.p.put(s.ni, md, 0, LEN as u64, AckReq::Ack, t, 0, 0)
                .unwrap();
            src.bytes()[..LEN].fill(0xee);
        }
        for _ in 0..N {
            assert_eq!(wait_kind(&mut s, EventKind::Ack).ni_fail, NiFail::Ok);
        }
        let t = target(1, pt, 0, 0);
        assert!(
            matches!(
                s.p.put(s.ni, md, 0, max + 1, AckReq::Ack, t, 0, 0),
                Err(PortalsError::Ptl(PtlError::ArgInvalid))
            ),
            "longer than max_volatile_size"
        );
        // Process memory the NIC reaches by copy: bound without VOLATILE, refused with it.
        let private = [0u8; 64];
        let r =
            s.p.endpoint()
                .client()
                .register_process(private.as_ptr() as u64, 64, Perms(0))
                .unwrap();
        let unknown = Md {
            region: softnic::client::MemHandle(r),
            segments: vec![(0, 8)],
            options: md_opt::VOLATILE,
            eq: Some(s.eq),
            ct: None,
        };
        assert!(
            matches!(
                s.p.md_bind(s.ni, &unknown),
                Err(PortalsError::Ptl(PtlError::ArgInvalid))
            ),
            "memory the library cannot read"
        );
        let plain = Md {
            options: 0,
            ..unknown
        };
        assert!(s.p.md_bind(s.ni, &plain).is_ok());
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        for i in 0..N {
            let got = &dst.bytes()[i * LEN..(i + 1) * LEN];
            assert!(got.iter().all(|&b| b == i as u8), "put {i} sent {got:?}");
        }
    }
}

// ---------------------------------------------------------------- overflow, unexpected, search

#[test]
fn unexpected_messages_overflow_and_search() {
    if !in_job() {
        return launch_ok("unexpected_messages_overflow_and_search", 2, 2, &[]);
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(8192, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    if me == 1 {
        let mut ovf = Me::new(whole(&mem), 0);
        ovf.ignore_bits = u64::MAX;
        ovf.options |= me_opt::MANAGE_LOCAL;
        s.p.me_append(s.ni, pt, &ovf, List::Overflow, 50).unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        let src = s.p.endpoint().mem_register(64, Perms::READ_WRITE).unwrap();
        src.bytes()[..5].copy_from_slice(b"early");
        let md = md_all(&mut s, &src, 0, None);
        s.p.put(s.ni, md, 0, 5, AckReq::Ack, target(1, pt, 77, 0), 0, 0)
            .unwrap();
        s.p.put(s.ni, md, 0, 5, AckReq::Ack, target(1, pt, 78, 0), 0, 0)
            .unwrap();
        wait_kind(&mut s, EventKind::Ack);
        wait_kind(&mut s, EventKind::Ack);
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        // Both landed in the overflow entry (PUT events for it).
        assert_eq!(wait_kind(&mut s, EventKind::Put).user_ptr, 50);
        // Probe for 78 without consuming it, then consume it.
        let probe = Me::new(
            Buffer {
                region: mem.handle,
                offset: 0,
                len: 0,
            },
            78,
        );
        s.p.me_search(s.ni, pt, &probe, SearchOp::SearchOnly, 1)
            .unwrap();
        let e = wait_kind(&mut s, EventKind::Search);
        assert_eq!((e.ni_fail, e.rlength, e.user_ptr), (NiFail::Ok, 5, 1));
        s.p.me_search(s.ni, pt, &probe, SearchOp::SearchDelete, 2)
            .unwrap();
        assert_eq!(wait_kind(&mut s, EventKind::PutOverflow).match_bits, 78);
        s.p.me_search(s.ni, pt, &probe, SearchOp::SearchOnly, 3)
            .unwrap();
        assert_eq!(
            wait_kind(&mut s, EventKind::Search).ni_fail,
            NiFail::NoMatch
        );
        // A late append for 77 finds it in the unexpected list: PUT_OVERFLOW, data in the
        // overflow buffer where the event says.
        let mut recv = Me::new(
            Buffer {
                region: mem.handle,
                offset: 4096,
                len: 64,
            },
            77,
        );
        recv.options |= me_opt::USE_ONCE;
        s.p.me_append(s.ni, pt, &recv, List::Priority, 9).unwrap();
        let e = wait_kind(&mut s, EventKind::PutOverflow);
        assert_eq!((e.user_ptr, e.mlength), (9, 5));
        assert_eq!(
            &mem.bytes()[e.start as usize..e.start as usize + 5],
            b"early"
        );
    }
    s.p.endpoint().barrier().unwrap();
}

// ---------------------------------------------------------------- counting events, triggers

#[test]
fn counting_event_completion_and_triggered_put_at_the_target_nic() {
    if !in_job() {
        return launch_ok(
            "counting_event_completion_and_triggered_put_at_the_target_nic",
            2,
            2,
            &[],
        );
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), Some(2)).unwrap();
    let ct = s.p.ct_alloc(s.ni).unwrap();
    // Each rank: an ME counting arrivals.
    let mut e = Me::new(whole(&mem), 3);
    e.ct = Some(ct);
    e.options |= me_opt::EVENT_CT_COMM | me_opt::EVENT_COMM_DISABLE | me_opt::EVENT_LINK_DISABLE;
    s.p.me_append(s.ni, pt, &e, List::Priority, 0).unwrap();
    if me == 1 {
        // Rank 1's NIC answers the 10th arrival by itself with a put back to rank 0.
        mem.bytes()[2048..2052].copy_from_slice(b"pong");
        let md = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
        s.p.triggered_put(
            s.ni,
            md,
            2048,
            4,
            AckReq::NoAck,
            target(0, pt, 3, 3000),
            0,
            0,
            ct,
            10,
        )
        .unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        let ack_ct = s.p.ct_alloc(s.ni).unwrap();
        let md =
            s.p.md_bind(
                s.ni,
                &Md {
                    region: mem.handle,
                    segments: vec![(0, 64)],
                    options: md_opt::EVENT_CT_ACK | md_opt::EVENT_SEND_DISABLE,
                    eq: None,
                    ct: Some(ack_ct),
                },
            )
            .unwrap();
        for i in 0..10u64 {
            s.p.put(s.ni, md, 0, 8, AckReq::CtAck, target(1, pt, 3, i * 8), 0, 0)
                .unwrap();
        }
        let v = s.p.ct_wait(s.ni, ack_ct, 10).unwrap();
        assert_eq!(
            v,
            CtEvent {
                success: 10,
                failure: 0
            },
            "CT-only completion"
        );
        // The triggered put arrives without rank 1 doing anything.
        assert_eq!(s.p.ct_wait(s.ni, ct, 1).unwrap().success, 1);
        assert_eq!(&mem.bytes()[3000..3004], b"pong");
        assert!(
            matches!(s.p.eq_get(s.ni, s.eq), Err(PtlError::EqEmpty)),
            "no full events were asked for"
        );
    }
    s.p.endpoint().barrier().unwrap();
}

// ---------------------------------------------------------------- flow control, EQ overflow

#[test]
fn flow_control_disables_the_entry_and_recovers() {
    if !in_job() {
        return launch_ok("flow_control_disables_the_entry_and_recovers", 2, 2, &[]);
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt =
        s.p.pt_alloc(s.ni, pt_opt::FLOWCTRL, Some(s.eq), Some(7))
            .unwrap();
    s.p.endpoint().barrier().unwrap();
    let md = md_all(&mut s, &mem, 0, None);
    if me == 0 {
        s.p.put(s.ni, md, 0, 8, AckReq::Ack, target(1, pt, 1, 0), 0, 0)
            .unwrap();
        assert_eq!(
            wait_kind(&mut s, EventKind::Ack).ni_fail,
            NiFail::PtDisabled
        );
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        assert_eq!(
            wait_kind(&mut s, EventKind::PtDisabled).ni_fail,
            NiFail::PtDisabled
        );
        // Recovery: post resources, re-enable.
        s.p.me_append(s.ni, pt, &Me::new(whole(&mem), 1), List::Priority, 0)
            .unwrap();
        s.p.pt_enable(s.ni, pt).unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        s.p.put(s.ni, md, 0, 8, AckReq::Ack, target(1, pt, 1, 0), 0, 0)
            .unwrap();
        assert_eq!(wait_kind(&mut s, EventKind::Ack).ni_fail, NiFail::Ok);
    }
    s.p.endpoint().barrier().unwrap();
}

#[test]
fn event_queue_overflow_is_reported() {
    if !in_job() {
        return launch_ok("event_queue_overflow_is_reported", 2, 2, &[]);
    }
    let mut p = Portals::init().unwrap();
    let (ni, _) = p.ni_init(true, true).unwrap();
    let me = p.endpoint().rank();
    let small = p.eq_alloc(ni, 4).unwrap();
    let mem = p.endpoint().mem_register(4096, Perms::READ_WRITE).unwrap();
    let pt = p.pt_alloc(ni, 0, Some(small), None).unwrap();
    if me == 1 {
        let mut e = Me::new(whole(&mem), 0);
        e.ignore_bits = u64::MAX;
        e.options |= me_opt::EVENT_LINK_DISABLE;
        p.me_append(ni, pt, &e, List::Priority, 0).unwrap();
    }
    p.endpoint().barrier().unwrap();
    if me == 0 {
        let eq = p.eq_alloc(ni, 64).unwrap();
        let md = p
            .md_bind(
                ni,
                &Md {
                    region: mem.handle,
                    segments: vec![(0, 64)],
                    options: 0,
                    eq: Some(eq),
                    ct: None,
                },
            )
            .unwrap();
        let put_and_acks = |p: &mut Portals, n: usize| {
            for _ in 0..n {
                p.put(ni, md, 0, 8, AckReq::Ack, target(1, pt, 0, 0), 0, 0)
                    .unwrap();
            }
            let mut acks = 0;
            while acks < n {
                if p.eq_wait(ni, eq).unwrap().0.kind == EventKind::Ack {
                    acks += 1;
                }
            }
        };
        put_and_acks(&mut p, 12);
        p.endpoint().barrier().unwrap();
        p.endpoint().barrier().unwrap();
        // PTL_EQ_DROPPED rides on the first event read after a drop: when the four that fit
        // had all reached the process before the fifth was dropped, only a later one says so.
        put_and_acks(&mut p, 1);
    } else {
        p.endpoint().barrier().unwrap();
    }
    if me == 1 {
        let mut dropped = false;
        let mut n = 0;
        while let Ok((_, d)) = p.eq_get(ni, small) {
            dropped |= d;
            n += 1;
        }
        p.endpoint().barrier().unwrap();
        if !dropped {
            dropped = p.eq_wait(ni, small).unwrap().1;
        }
        assert!(n <= 4 && dropped, "{n} events, dropped {dropped}");
    }
    p.endpoint().barrier().unwrap();
}

// ---------------------------------------------------------------- addressing, self, bad input

#[test]
fn self_communication_on_one_host() {
    if !in_job() {
        return launch_ok("self_communication_on_one_host", 1, 1, &[]);
    }
    let mut s = setup();
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    s.p.me_append(
        s.ni,
        pt,
        &Me::new(
            Buffer {
                region: mem.handle,
                offset: 1024,
                len: 1024,
            },
            5,
        ),
        List::Priority,
        0,
    )
    .unwrap();
    mem.bytes()[..4].copy_from_slice(b"self");
    let md = md_all(&mut s, &mem, 0, None);
    s.p.put(s.ni, md, 0, 4, AckReq::Ack, target(0, pt, 5, 0), 0, 0)
        .unwrap();
    wait_kind(&mut s, EventKind::Ack);
    assert_eq!(&mem.bytes()[1024..1028], b"self");
    s.p.get(s.ni, md, 2048, 4, target(0, pt, 5, 0), 0).unwrap();
    wait_kind(&mut s, EventKind::Reply);
    assert_eq!(&mem.bytes()[2048..2052], b"self");
}

#[test]
fn physical_addressing_and_match_id() {
    if !in_job() {
        return launch_ok("physical_addressing_and_match_id", 2, 2, &[]);
    }
    let mut p = Portals::init().unwrap();
    let (ni, _) = p.ni_init(true, false).unwrap();
    let map = p.get_map(ni).unwrap();
    p.set_map(ni, &map).unwrap();
    assert_eq!(p.get_id(ni).unwrap(), p.get_phys_id());
    let me = p.endpoint().rank();
    let eq = p.eq_alloc(ni, 64).unwrap();
    let mem = p.endpoint().mem_register(4096, Perms::READ_WRITE).unwrap();
    let pt = p.pt_alloc(ni, 0, Some(eq), None).unwrap();
    if me == 1 {
        let mut e = Me::new(whole(&mem), 1);
        e.match_id = map[0]; // only rank 0, physically named
        p.me_append(ni, pt, &e, List::Priority, 0).unwrap();
    }
    p.endpoint().barrier().unwrap();
    if me == 0 {
        let md = p
            .md_bind(
                ni,
                &Md {
                    region: mem.handle,
                    segments: vec![(0, 64)],
                    options: 0,
                    eq: Some(eq),
                    ct: None,
                },
            )
            .unwrap();
        let t = Target {
            id: map[1],
            pt_index: pt,
            match_bits: 1,
            remote_offset: 0,
        };
        p.put(ni, md, 0, 8, AckReq::Ack, t, 0, 0).unwrap();
        loop {
            let (e, _) = p.eq_wait(ni, eq).unwrap();
            if e.kind == EventKind::Ack {
                assert_eq!(e.ni_fail, NiFail::Ok);
                break;
            }
        }
        let bad = Target {
            id: ProcessId::Physical { nid: 99, pid: 1 },
            ..t
        };
        assert!(matches!(
            p.put(ni, md, 0, 8, AckReq::Ack, bad, 0, 0),
            Err(PortalsError::Ptl(PtlError::ArgInvalid))
        ));
    } else {
        let (e, _) = loop {
            let x = p.eq_wait(ni, eq).unwrap();
            if x.0.kind == EventKind::Put {
                break x;
            }
        };
        assert_eq!(e.initiator, map[0]);
    }
    p.endpoint().barrier().unwrap();
}

#[test]
fn bad_handles_and_arguments_get_return_codes() {
    if !in_job() {
        return launch_ok("bad_handles_and_arguments_get_return_codes", 1, 1, &[]);
    }
    let mut s = setup();
    fn ptl<T>(r: Result<T, PortalsError>) -> Option<PtlError> {
        match r {
            Err(PortalsError::Ptl(e)) => Some(e),
            _ => None,
        }
    }
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    assert_eq!(
        ptl(s.p.pt_alloc(s.ni, 0, Some(12345), None)),
        Some(PtlError::ArgInvalid)
    );
    assert_eq!(
        ptl(s.p.pt_alloc(s.ni, pt_opt::FLOWCTRL, None, None)),
        Some(PtlError::PtEqNeeded)
    );
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), Some(3)).unwrap();
    assert_eq!(
        ptl(s.p.pt_alloc(s.ni, 0, Some(s.eq), Some(3))),
        Some(PtlError::PtInUse)
    );
    let h =
        s.p.me_append(s.ni, pt, &Me::new(whole(&mem), 0), List::Priority, 0)
            .unwrap();
    assert_eq!(ptl(s.p.pt_free(s.ni, pt)), Some(PtlError::PtInUse));
    s.p.me_unlink(s.ni, h).unwrap();
    assert_eq!(
        ptl(s.p.me_unlink(s.ni, h)),
        Some(PtlError::ArgInvalid),
        "stale handle"
    );
    assert_eq!(
        ptl(s
            .p
            .me_append(s.ni, 200, &Me::new(whole(&mem), 0), List::Priority, 0)),
        Some(PtlError::ArgInvalid)
    );
    let big = Me::new(
        Buffer {
            region: mem.handle,
            offset: 4000,
            len: 200,
        },
        0,
    );
    assert_eq!(
        ptl(s.p.me_append(s.ni, pt, &big, List::Priority, 0)),
        Some(PtlError::ArgInvalid),
        "past the region"
    );
    // A one-way append cannot answer: its refusal arrives as a failed link event.
    while s.p.eq_get(s.ni, s.eq).is_ok() {}
    s.p.me_append_oneway(s.ni, pt, &big, List::Priority, 77)
        .unwrap();
    let link = wait_kind(&mut s, EventKind::Link);
    assert_eq!((link.user_ptr, link.ni_fail), (77, NiFail::ArgInvalid));
    let free = s.p.pt_alloc(s.ni, 0, None, Some(4)).unwrap();
    assert_eq!(
        ptl(s
            .p
            .me_append_oneway(s.ni, free, &Me::new(whole(&mem), 0), List::Priority, 0)),
        Some(PtlError::ArgInvalid),
        "a portal without an event queue has nowhere to report"
    );
    s.p.pt_free(s.ni, free).unwrap();
    let md = md_all(&mut s, &mem, 0, None);
    assert_eq!(
        ptl(s
            .p
            .put(s.ni, md, 4000, 200, AckReq::Ack, target(0, pt, 0, 0), 0, 0)),
        Some(PtlError::ArgInvalid)
    );
    assert_eq!(
        ptl(s
            .p
            .put(s.ni, 999, 0, 8, AckReq::Ack, target(0, pt, 0, 0), 0, 0)),
        Some(PtlError::ArgInvalid)
    );
    assert_eq!(
        ptl(s.p.atomic(
            s.ni,
            md,
            0,
            8,
            AckReq::Ack,
            target(0, pt, 0, 0),
            0,
            0,
            AtomicOp::Bxor,
            Datatype::Double
        )),
        Some(PtlError::ArgInvalid)
    );
    assert_eq!(s.p.ct_get(s.ni, 4242), Err(PtlError::ArgInvalid));
    assert_eq!(s.p.eq_get(s.ni, 4242).err(), Some(PtlError::ArgInvalid));
    while s.p.eq_get(s.ni, s.eq).is_ok() {}
    let t = std::time::Instant::now();
    let timeout = std::time::Duration::from_millis(20);
    assert_eq!(
        ptl(s.p.eq_poll(s.ni, &[s.eq], Some(timeout))),
        Some(PtlError::EqEmpty)
    );
    assert!(t.elapsed() >= timeout);
    s.p.pt_free(s.ni, pt).unwrap();
    assert_eq!(ptl(s.p.pt_free(s.ni, pt)), Some(PtlError::ArgInvalid));
}

// ---------------------------------------------------------------- ordering under faults

#[test]
fn messages_are_matched_in_send_order_under_faults() {
    if !in_job() {
        return launch_ok(
            "messages_are_matched_in_send_order_under_faults",
            2,
            2,
            &[
                "--fault-drop",
                "0.1",
                "--fault-duplicate",
                "0.05",
                "--fault-seed",
                "3",
            ],
        );
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(8 * 1000, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    if me == 1 {
        let mut e = Me::new(whole(&mem), 9);
        e.options |= me_opt::MANAGE_LOCAL | me_opt::EVENT_COMM_DISABLE;
        s.p.me_append(s.ni, pt, &e, List::Priority, 0).unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        for k in 0..1000u64 {
            mem.bytes()[(k * 8) as usize..(k * 8 + 8) as usize].copy_from_slice(&k.to_le_bytes());
        }
        let ct = s.p.ct_alloc(s.ni).unwrap();
        let md =
            s.p.md_bind(
                s.ni,
                &Md {
                    region: mem.handle,
                    segments: vec![(0, 8000)],
                    options: md_opt::EVENT_CT_ACK | md_opt::EVENT_SEND_DISABLE,
                    eq: None,
                    ct: Some(ct),
                },
            )
            .unwrap();
        for k in 0..1000u64 {
            s.p.put(s.ni, md, k * 8, 8, AckReq::CtAck, target(1, pt, 9, 0), 0, 0)
                .unwrap();
        }
        assert_eq!(
            s.p.ct_wait(s.ni, ct, 1000).unwrap(),
            CtEvent {
                success: 1000,
                failure: 0
            }
        );
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        for k in 0..1000u64 {
            assert_eq!(
                u64::from_le_bytes(
                    mem.bytes()[(k * 8) as usize..(k * 8 + 8) as usize]
                        .try_into()
                        .unwrap()
                ),
                k,
                "message {k} out of order"
            );
        }
    }
    s.p.endpoint().barrier().unwrap();
}

/// Puts longer than a datagram stream from the MD as the window opens (no copy held by the
/// daemon): several 300 KB puts gathered from a two-segment MD, each followed by a small put,
/// under loss and duplication, arrive whole and in order; every SEND event comes before its
/// ACK, and CT_SEND counts each put once.
#[test]
fn large_puts_stream_from_the_md_in_order_under_faults() {
    if !in_job() {
        return launch_ok(
            "large_puts_stream_from_the_md_in_order_under_faults",
            2,
            2,
            &[
                "--fault-drop",
                "0.05",
                "--fault-duplicate",
                "0.05",
                "--fault-seed",
                "11",
            ],
        );
    }
    const BIG: u64 = 300_000;
    const N: u64 = 6;
    let mut s = setup();
    let me = my_rank(&s);
    // Rank 0: the source, in two segments; rank 1: one slot per big put and a word per small.
    let mem =
        s.p.endpoint()
            .mem_register((N * BIG + 4096) as usize, Perms::READ_WRITE)
            .unwrap();
    let pt = catch_all_at_rank_1(&mut s, me, &mem);
    if me == 0 {
        let src = pattern(BIG as usize, 42);
        // The MD sees [100_000.., then 0..200_000]: its bytes 0..BIG are src.
        mem.bytes()[100_000..300_000].copy_from_slice(&src[..200_000]);
        mem.bytes()[..100_000].copy_from_slice(&src[200_000..]);
        let ct = s.p.ct_alloc(s.ni).unwrap();
        let md =
            s.p.md_bind(
                s.ni,
                &Md {
                    region: mem.handle,
                    segments: vec![(100_000, 200_000), (0, 100_000)],
                    options: md_opt::EVENT_CT_SEND | md_opt::IOVEC,
                    eq: Some(s.eq),
                    ct: Some(ct),
                },
            )
            .unwrap();
        let word = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
        mem.bytes()[400_000..400_008].copy_from_slice(&7u64.to_le_bytes());
        for k in 0..N {
            s.p.put(
                s.ni,
                md,
                0,
                BIG,
                AckReq::Ack,
                target(1, pt, 0, k * BIG),
                k,
                0,
            )
            .unwrap();
            // A small put behind it lands after it: its word says which big one came first.
            s.p.put(
                s.ni,
                word,
                400_000,
                8,
                AckReq::Ack,
                target(1, pt, 0, N * BIG + 8 * k),
                100 + k,
                0,
            )
            .unwrap();
        }
        let mut seen = Vec::new();
        while seen
            .iter()
            .filter(|(_, kind)| *kind == EventKind::Ack)
            .count()
            < 2 * N as usize
        {
            let (e, _) = s.p.eq_wait(s.ni, s.eq).unwrap();
            assert_eq!(e.ni_fail, NiFail::Ok, "{e:?}");
            seen.push((e.user_ptr, e.kind));
        }
        for k in 0..N {
            let send = seen.iter().position(|&x| x == (k, EventKind::Send));
            let ack = seen.iter().position(|&x| x == (k, EventKind::Ack));
            assert!(
                send.is_some() && send < ack,
                "put {k}: SEND before ACK in {seen:?}"
            );
        }
        assert_eq!(
            s.p.ct_get(s.ni, ct).unwrap().success,
            N,
            "CT_SEND once per put"
        );
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        let want = pattern(BIG as usize, 42);
        for k in 0..N {
            let got = &mem.bytes()[(k * BIG) as usize..((k + 1) * BIG) as usize];
            assert!(got == &want[..], "put {k} arrived whole");
            let w = (N * BIG + 8 * k) as usize;
            assert_eq!(mem.bytes()[w..w + 8], 7u64.to_le_bytes(), "small put {k}");
        }
    }
    s.p.endpoint().barrier().unwrap();
}

// ---------------------------------------------------------------- matching rules via the NIC

#[test]
fn matching_rules_through_the_nic() {
    if !in_job() {
        return launch_ok("matching_rules_through_the_nic", 2, 2, &[]);
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(8192, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    if me == 1 {
        let b = |off, len| Buffer {
            region: mem.handle,
            offset: off,
            len,
        };
        // Ignore bits: low byte insignificant.
        let mut e = Me::new(b(0, 64), 0x1200);
        e.ignore_bits = 0xff;
        s.p.me_append(s.ni, pt, &e, List::Priority, 1).unwrap();
        // USE_ONCE, then a persistent entry behind it with the same bits.
        let mut once = Me::new(b(64, 64), 0x2000);
        once.options |= me_opt::USE_ONCE;
        s.p.me_append(s.ni, pt, &once, List::Priority, 2).unwrap();
        s.p.me_append(s.ni, pt, &Me::new(b(128, 64), 0x2000), List::Priority, 3)
            .unwrap();
        // Priority before overflow for the same bits.
        let mut ovf = Me::new(b(4096, 1024), 0x3000);
        ovf.options |= me_opt::MANAGE_LOCAL;
        s.p.me_append(s.ni, pt, &ovf, List::Overflow, 4).unwrap();
        s.p.me_append(s.ni, pt, &Me::new(b(192, 64), 0x3000), List::Priority, 5)
            .unwrap();
        // Locally managed with min_free: unlinks when less than 16 bytes remain of 48.
        let mut ml = Me::new(b(256, 48), 0x4000);
        ml.options |= me_opt::MANAGE_LOCAL;
        ml.min_free = 16;
        s.p.me_append(s.ni, pt, &ml, List::Priority, 6).unwrap();
        // Truncation: 8 bytes of room.
        s.p.me_append(s.ni, pt, &Me::new(b(512, 8), 0x5000), List::Priority, 7)
            .unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        let md = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
        let mut acks = Vec::new();
        let mut put = |s: &mut Setup, bits: u64, len: u64| {
            s.p.put(
                s.ni,
                md,
                0,
                len,
                AckReq::Ack,
                target(1, pt, bits, 0),
                bits,
                0,
            )
            .unwrap();
            let e = wait_kind(s, EventKind::Ack);
            acks.push((bits, e.ni_fail, e.mlength));
        };
        put(&mut s, 0x12ab, 8); // ignore bits: matches entry 1
        put(&mut s, 0x13ab, 8); // dropped
        put(&mut s, 0x2000, 8); // the use-once entry
        put(&mut s, 0x2000, 8); // the persistent one behind it
        put(&mut s, 0x3000, 8); // priority entry, not overflow
        for _ in 0..3 {
            put(&mut s, 0x4000, 12); // 12, 24, 36 used: 12 left < 16 → unlinked after the third
        }
        put(&mut s, 0x4000, 12); // nothing left to match
        put(&mut s, 0x5000, 20); // truncated to 8
        assert_eq!(
            acks.iter().map(|a| (a.1, a.2)).collect::<Vec<_>>(),
            [
                (NiFail::Ok, 8),
                (NiFail::Dropped, 0),
                (NiFail::Ok, 8),
                (NiFail::Ok, 8),
                (NiFail::Ok, 8),
                (NiFail::Ok, 12),
                (NiFail::Ok, 12),
                (NiFail::Ok, 12),
                (NiFail::Dropped, 0),
                (NiFail::Ok, 8),
            ]
        );
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        let mut by_entry = Vec::new();
        let mut unlinked = Vec::new();
        while let Ok((e, _)) = s.p.eq_get(s.ni, s.eq) {
            match e.kind {
                EventKind::Put => by_entry.push((e.user_ptr, e.mlength, e.rlength)),
                EventKind::AutoUnlink => unlinked.push(e.user_ptr),
                _ => {}
            }
        }
        assert_eq!(
            by_entry,
            [
                (1, 8, 8),
                (2, 8, 8),
                (3, 8, 8),
                (5, 8, 8),
                (6, 12, 12),
                (6, 12, 12),
                (6, 12, 12),
                (7, 8, 20)
            ]
        );
        assert_eq!(unlinked, [2, 6]);
    }
    s.p.endpoint().barrier().unwrap();
}

#[test]
fn event_sequences_for_each_ack_request() {
    if !in_job() {
        return launch_ok("event_sequences_for_each_ack_request", 2, 2, &[]);
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt = catch_all_at_rank_1(&mut s, me, &mem);
    if me == 0 {
        for (ack, want, counted) in [
            (AckReq::Ack, vec![EventKind::Send, EventKind::Ack], 1),
            (AckReq::CtAck, vec![EventKind::Send], 1),
            (AckReq::OcAck, vec![EventKind::Send], 1),
            (AckReq::NoAck, vec![EventKind::Send], 0),
        ] {
            let ct = s.p.ct_alloc(s.ni).unwrap();
            let md = md_all(&mut s, &mem, md_opt::EVENT_CT_ACK, Some(ct));
            s.p.put(s.ni, md, 0, 16, ack, target(1, pt, 0, 0), 5, 0)
                .unwrap();
            // A get after the put on the same pair completes after it (ordering).
            let gmd = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
            s.p.get(s.ni, gmd, 1024, 8, target(1, pt, 0, 0), 6).unwrap();
            let mut kinds = Vec::new();
            loop {
                let (e, _) = s.p.eq_wait(s.ni, s.eq).unwrap();
                if e.kind == EventKind::Reply {
                    break;
                }
                kinds.push(e.kind);
            }
            assert_eq!(kinds, want, "{ack:?}");
            assert_eq!(s.p.ct_get(s.ni, ct).unwrap().success, counted, "{ack:?}");
            s.p.md_release(s.ni, md).unwrap();
            s.p.md_release(s.ni, gmd).unwrap();
        }
    }
    s.p.endpoint().barrier().unwrap();
}

/// A put's ACK counted, then a later get's REPLY event: the process that sees the event sees
/// the count too, every time (the daemon publishes counts and events in the order the engine
/// changed them; it once pushed a turn's events first, and a process that read the count as
/// soon as the REPLY showed could find it one short).
#[test]
fn a_count_that_changed_before_an_event_is_seen_with_it() {
    if !in_job() {
        return launch_ok(
            "a_count_that_changed_before_an_event_is_seen_with_it",
            2,
            2,
            &[],
        );
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt = catch_all_at_rank_1(&mut s, me, &mem);
    if me == 0 {
        let ct = s.p.ct_alloc(s.ni).unwrap();
        let md = md_all(
            &mut s,
            &mem,
            md_opt::EVENT_CT_ACK | md_opt::EVENT_SEND_DISABLE,
            Some(ct),
        );
        let gmd = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
        for i in 1..=2000u64 {
            s.p.put(s.ni, md, 0, 16, AckReq::CtAck, target(1, pt, 0, 0), 5, 0)
                .unwrap();
            s.p.get(s.ni, gmd, 1024, 8, target(1, pt, 0, 0), 6).unwrap();
            loop {
                let (e, _) = s.p.eq_wait(s.ni, s.eq).unwrap();
                if e.kind == EventKind::Reply {
                    break;
                }
            }
            assert_eq!(s.p.ct_get(s.ni, ct).unwrap().success, i, "round {i}");
        }
    }
    s.p.endpoint().barrier().unwrap();
}

#[test]
fn every_atomic_op_and_datatype_through_the_nic() {
    if !in_job() {
        return launch_ok("every_atomic_op_and_datatype_through_the_nic", 2, 2, &[]);
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(1 << 16, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    let (ops, dts) = (AtomicOp::ALL, Datatype::ALL);
    // Each (op, datatype) case owns 32 bytes of rank 1's memory, pre-filled with a pattern.
    let initial = |case: usize, i: usize| -> u8 { ((case * 7 + i * 3) % 5) as u8 };
    let mut cases = Vec::new();
    for op in ops {
        for dt in dts {
            if op.supports(dt) {
                cases.push((op, dt));
            }
        }
    }
    if me == 1 {
        for c in 0..cases.len() {
            for i in 0..32 {
                mem.bytes()[c * 32 + i] = initial(c, i);
            }
        }
        let mut e = Me::new(whole(&mem), 0);
        e.ignore_bits = u64::MAX;
        e.options |= me_opt::EVENT_COMM_DISABLE;
        s.p.me_append(s.ni, pt, &e, List::Priority, 0).unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    // The reference: the same operation applied here to a local copy by the model that the
    // engine's own unit tests check against an independent definition.
    let operand_of = |c: usize, w: usize| -> Vec<u8> { (0..w).map(|i| initial(c, i)).collect() };
    let data_of =
        |c: usize, len: usize| -> Vec<u8> { (0..len).map(|i| ((c + i) % 4) as u8).collect() };
    let len_of = |op: AtomicOp, dt: Datatype| {
        if op.is_swap() && op != AtomicOp::Swap {
            dt.size()
        } else {
            32 / dt.size() * dt.size()
        }
    };
    if me == 0 {
        let md = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
        for (c, &(op, dt)) in cases.iter().enumerate() {
            let len = len_of(op, dt);
            mem.bytes()[..len].copy_from_slice(&data_of(c, len));
            let t = target(1, pt, 0, (c * 32) as u64);
            if op.is_swap() {
                s.p.swap(
                    s.ni,
                    md,
                    4096,
                    md,
                    0,
                    len as u64,
                    t,
                    c as u64,
                    0,
                    &operand_of(c, dt.size()),
                    op,
                    dt,
                )
                .unwrap();
                assert_eq!(
                    wait_kind(&mut s, EventKind::Reply).ni_fail,
                    NiFail::Ok,
                    "{op:?} {dt:?}"
                );
            } else {
                s.p.atomic(s.ni, md, 0, len as u64, AckReq::Ack, t, c as u64, 0, op, dt)
                    .unwrap();
                assert_eq!(
                    wait_kind(&mut s, EventKind::Ack).ni_fail,
                    NiFail::Ok,
                    "{op:?} {dt:?}"
                );
            }
        }
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        for (c, &(op, dt)) in cases.iter().enumerate() {
            let len = len_of(op, dt);
            let mut want = [0u64; 4];
            let wp = want.as_mut_ptr() as *mut u8;
            for i in 0..32 {
                unsafe { *wp.add(i) = initial(c, i) };
            }
            unsafe {
                softnic::nic::portals::atomic::apply(
                    wp,
                    op,
                    dt,
                    &data_of(c, len),
                    &operand_of(c, dt.size()),
                    None,
                )
                .unwrap()
            };
            let want = unsafe { std::slice::from_raw_parts(wp, 32) };
            assert_eq!(&mem.bytes()[c * 32..c * 32 + 32], want, "{op:?} on {dt:?}");
        }
    }
    s.p.endpoint().barrier().unwrap();
}

#[test]
fn triggered_chains_across_hosts() {
    if !in_job() {
        return launch_ok("triggered_chains_across_hosts", 2, 2, &[]);
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), Some(1)).unwrap();
    let arrivals = s.p.ct_alloc(s.ni).unwrap();
    let mut e = Me::new(whole(&mem), 1);
    e.ct = Some(arrivals);
    e.options |= me_opt::EVENT_CT_COMM | me_opt::EVENT_COMM_DISABLE | me_opt::EVENT_LINK_DISABLE;
    s.p.me_append(s.ni, pt, &e, List::Priority, 0).unwrap();
    if me == 1 {
        // arrivals ≥ 3 bumps `gate` by 2; gate ≥ 2 fires a put back to rank 0 and sets `done`.
        let gate = s.p.ct_alloc(s.ni).unwrap();
        let done = s.p.ct_alloc(s.ni).unwrap();
        s.p.triggered_ct(
            s.ni,
            arrivals,
            3,
            gate,
            false,
            CtEvent {
                success: 2,
                failure: 0,
            },
        )
        .unwrap();
        mem.bytes()[2000..2005].copy_from_slice(b"chain");
        let md = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
        s.p.triggered_put(
            s.ni,
            md,
            2000,
            5,
            AckReq::NoAck,
            target(0, pt, 1, 100),
            0,
            0,
            gate,
            2,
        )
        .unwrap();
        s.p.triggered_ct(
            s.ni,
            gate,
            2,
            done,
            true,
            CtEvent {
                success: 42,
                failure: 0,
            },
        )
        .unwrap();
        s.p.endpoint().barrier().unwrap();
        assert_eq!(s.p.ct_wait(s.ni, done, 42).unwrap().success, 42);
    } else {
        s.p.endpoint().barrier().unwrap();
        let md = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
        for _ in 0..3 {
            s.p.put(s.ni, md, 0, 8, AckReq::NoAck, target(1, pt, 1, 0), 0, 0)
                .unwrap();
        }
        assert_eq!(s.p.ct_wait(s.ni, arrivals, 1).unwrap().success, 1);
        assert_eq!(&mem.bytes()[100..105], b"chain");
    }
    s.p.endpoint().barrier().unwrap();
}

#[test]
fn set_map_renames_processes_logically() {
    if !in_job() {
        return launch_ok("set_map_renames_processes_logically", 2, 2, &[]);
    }
    let mut s = setup();
    let job_rank = s.p.endpoint().rank();
    let map = s.p.get_map(s.ni).unwrap();
    let reversed = vec![map[1], map[0]];
    s.p.set_map(s.ni, &reversed).unwrap();
    assert_eq!(s.p.get_map(s.ni).unwrap(), reversed);
    // Job rank 0 is now logical 1 and the other way round.
    assert_eq!(
        s.p.get_id(s.ni).unwrap(),
        ProcessId::Logical { rank: 1 - job_rank }
    );
    assert!(
        s.p.set_map(s.ni, &[ProcessId::Physical { nid: 77, pid: 0 }])
            .is_err(),
        "not a process of this job"
    );
    let mem =
        s.p.endpoint()
            .mem_register(4096, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    if job_rank == 1 {
        // Only logical 1 — job rank 0 — may match.
        let mut e = Me::new(whole(&mem), 3);
        e.match_id = ProcessId::Logical { rank: 1 };
        s.p.me_append(s.ni, pt, &e, List::Priority, 0).unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if job_rank == 0 {
        let md = md_all(&mut s, &mem, md_opt::EVENT_SEND_DISABLE, None);
        // Logical 0 is job rank 1.
        s.p.put(s.ni, md, 0, 8, AckReq::Ack, target(0, pt, 3, 0), 0, 0)
            .unwrap();
        assert_eq!(wait_kind(&mut s, EventKind::Ack).ni_fail, NiFail::Ok);
    } else {
        assert_eq!(
            wait_kind(&mut s, EventKind::Put).initiator,
            ProcessId::Logical { rank: 1 }
        );
    }
    s.p.endpoint().barrier().unwrap();
}

#[test]
fn an_md_over_private_process_memory_is_reached_by_copy() {
    if !in_job() {
        return launch_ok(
            "an_md_over_private_process_memory_is_reached_by_copy",
            2,
            2,
            &[],
        );
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem =
        s.p.endpoint()
            .mem_register(1 << 20, Perms::READ_WRITE)
            .unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), None).unwrap();
    if me == 1 {
        s.p.me_append(s.ni, pt, &Me::new(whole(&mem), 1), List::Priority, 0)
            .unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        let n = 300_000usize;
        let src: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let mut back = vec![0u8; n];
        let r_src =
            s.p.endpoint()
                .client()
                .register_process(
                    src.as_ptr() as u64,
                    n as u64,
                    softnic::nic::memory::Perms(0),
                )
                .unwrap();
        let r_back =
            s.p.endpoint()
                .client()
                .register_process(
                    back.as_mut_ptr() as u64,
                    n as u64,
                    softnic::nic::memory::Perms(0),
                )
                .unwrap();
        let md = |s: &mut Setup, r: u32| {
            s.p.md_bind(
                s.ni,
                &Md {
                    region: softnic::gni::MemHandle(r),
                    segments: vec![(0, n as u64)],
                    options: 0,
                    eq: Some(s.eq),
                    ct: None,
                },
            )
            .unwrap()
        };
        let (md_src, md_back) = (md(&mut s, r_src), md(&mut s, r_back));
        s.p.put(
            s.ni,
            md_src,
            0,
            n as u64,
            AckReq::Ack,
            target(1, pt, 1, 8),
            1,
            0,
        )
        .unwrap();
        let ack = wait_kind(&mut s, EventKind::Ack);
        assert_eq!((ack.ni_fail, ack.mlength), (NiFail::Ok, n as u64));
        s.p.get(s.ni, md_back, 0, n as u64, target(1, pt, 1, 8), 2)
            .unwrap();
        let reply = wait_kind(&mut s, EventKind::Reply);
        assert_eq!((reply.ni_fail, reply.mlength), (NiFail::Ok, n as u64));
        // The daemon wrote `back` by copy, outside this process's view.
        let got: Vec<u8> = (0..n)
            .map(|i| unsafe { std::ptr::read_volatile(back.as_ptr().add(i)) })
            .collect();
        assert!(
            got == src,
            "the round trip through private memory changed the bytes"
        );
        // Memory the daemon cannot reach is refused at registration, with the reason.
        let err =
            s.p.endpoint()
                .client()
                .register_process(8, 4096, softnic::nic::memory::Perms(0))
                .unwrap_err();
        assert!(err.to_string().contains("cannot reach"), "{err}");
    }
    s.p.endpoint().barrier().unwrap();
}

/// A list entry over the process's own (private) memory: remote puts land in it and remote
/// gets read it, by copy; an atomic on it is refused with PTL_NI_OP_VIOLATION and changes
/// nothing (the NIC cannot act on it atomically with its owner).
#[test]
fn a_list_entry_over_private_process_memory_takes_puts_and_gets_not_atomics() {
    if !in_job() {
        return launch_ok(
            "a_list_entry_over_private_process_memory_takes_puts_and_gets_not_atomics",
            2,
            2,
            &[],
        );
    }
    let mut s = setup();
    let me = my_rank(&s);
    let n = 200_000usize;
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), Some(30)).unwrap();
    let mut private = vec![0u8; n];
    let mem = s.p.endpoint().mem_register(n, Perms::READ_WRITE).unwrap();
    let md =
        s.p.md_bind(
            s.ni,
            &Md {
                region: mem.handle,
                segments: vec![(0, n as u64)],
                options: 0,
                eq: Some(s.eq),
                ct: None,
            },
        )
        .unwrap();
    if me == 1 {
        let r =
            s.p.endpoint()
                .client()
                .register_process(private.as_mut_ptr() as u64, n as u64, Perms::READ_WRITE)
                .unwrap();
        let e = Me::new(
            Buffer {
                region: softnic::gni::MemHandle(r),
                offset: 0,
                len: n as u64,
            },
            5,
        );
        s.p.me_append(s.ni, pt, &e, List::Priority, 0).unwrap();
    }
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        let src = pattern(n, 77);
        mem.bytes().copy_from_slice(&src);
        s.p.put(
            s.ni,
            md,
            0,
            n as u64,
            AckReq::Ack,
            target(1, pt, 5, 0),
            1,
            0,
        )
        .unwrap();
        let ack = wait_kind(&mut s, EventKind::Ack);
        assert_eq!((ack.ni_fail, ack.mlength), (NiFail::Ok, n as u64));
        mem.bytes().fill(0);
        s.p.get(s.ni, md, 0, n as u64, target(1, pt, 5, 0), 2)
            .unwrap();
        let reply = wait_kind(&mut s, EventKind::Reply);
        assert_eq!((reply.ni_fail, reply.mlength), (NiFail::Ok, n as u64));
        assert!(
            mem.bytes()[..] == src[..],
            "the get read back what the put wrote"
        );
        s.p.atomic(
            s.ni,
            md,
            0,
            8,
            AckReq::Ack,
            target(1, pt, 5, 0),
            3,
            0,
            AtomicOp::Sum,
            Datatype::Uint64,
        )
        .unwrap();
        let ack = wait_kind(&mut s, EventKind::Ack);
        assert_eq!(ack.ni_fail, NiFail::OpViolation);
    }
    s.p.endpoint().barrier().unwrap();
    if me == 1 {
        let got: Vec<u8> = (0..n)
            .map(|i| unsafe { std::ptr::read_volatile(private.as_ptr().add(i)) })
            .collect();
        assert!(
            got == pattern(n, 77),
            "the put landed in private memory, the atomic did not"
        );
        assert_eq!(
            s.p.ni_status(s.ni, StatusRegister::OperationViolations)
                .unwrap(),
            1,
            "PtlNIStatus counts the refused atomic"
        );
    }
}

/// PtlNIStatus counts what the interface dropped; PtlNIFini takes the interface with
/// everything on it (old handles fail), and a fresh one starts from nothing.
#[test]
fn ni_status_counts_drops_and_ni_fini_releases_everything() {
    if !in_job() {
        return launch_ok(
            "ni_status_counts_drops_and_ni_fini_releases_everything",
            2,
            2,
            &[],
        );
    }
    let mut s = setup();
    let me = my_rank(&s);
    let mem = s.p.endpoint().mem_register(64, Perms::READ_WRITE).unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), Some(12)).unwrap();
    let ct = s.p.ct_alloc(s.ni).unwrap();
    let md = md_all(&mut s, &mem, md_opt::EVENT_CT_ACK, Some(ct));
    s.p.endpoint().barrier().unwrap();
    if me == 0 {
        // Nothing is linked at rank 1: three puts are dropped there.
        for _ in 0..3 {
            s.p.put(s.ni, md, 0, 8, AckReq::CtAck, target(1, pt, 1, 0), 0, 0)
                .unwrap();
        }
        // PtlCTWait returns at the first failure; the others may still be on their way.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut got = s.p.ct_wait(s.ni, ct, 3).unwrap();
        while got.failure < 3 && std::time::Instant::now() < deadline {
            std::thread::yield_now();
            got = s.p.ct_get(s.ni, ct).unwrap();
        }
        assert_eq!((got.success, got.failure), (0, 3));
    }
    s.p.endpoint().barrier().unwrap();
    let want = if me == 1 { 3 } else { 0 };
    assert_eq!(
        s.p.ni_status(s.ni, StatusRegister::DropCount).unwrap(),
        want
    );
    assert_eq!(
        s.p.ni_status(s.ni, StatusRegister::PermissionViolations)
            .unwrap(),
        0
    );
    s.p.ni_fini(s.ni).unwrap();
    assert!(matches!(s.p.eq_get(s.ni, s.eq), Err(PtlError::ArgInvalid)));
    assert!(s.p.ni_status(s.ni, StatusRegister::DropCount).is_err());
    assert!(s.p.ni_fini(s.ni).is_err(), "a finished interface is gone");
    let (ni, _) = s.p.ni_init(true, true).unwrap();
    let eq = s.p.eq_alloc(ni, 16).unwrap();
    assert_eq!(
        s.p.pt_alloc(ni, 0, Some(eq), Some(12)).unwrap(),
        12,
        "the old interface's portal went with it"
    );
    assert_eq!(s.p.ni_status(ni, StatusRegister::DropCount).unwrap(), 0);
    s.p.endpoint().barrier().unwrap();
}

/// max_ordered_size: operations up to it from one initiator to overlapping memory land in
/// issue order, whatever the network does — a put of many datagrams then a small put over
/// its start, and a run of put-then-add pairs on one word, under loss and duplication.
#[test]
fn operations_up_to_max_ordered_size_land_in_issue_order_under_faults() {
    if !in_job() {
        return launch_ok(
            "operations_up_to_max_ordered_size_land_in_issue_order_under_faults",
            2,
            2,
            &[
                "--fault-drop",
                "0.1",
                "--fault-duplicate",
                "0.05",
                "--fault-seed",
                "11",
            ],
        );
    }
    let (mut p, ni, limits) = {
        let mut p = Portals::init().unwrap();
        let (ni, limits) = p.ni_init(true, true).unwrap();
        (p, ni, limits)
    };
    let n = 300_000usize;
    assert!(limits.max_ordered_size >= n as u64);
    let me = match p.get_id(ni).unwrap() {
        ProcessId::Logical { rank } => rank,
        _ => unreachable!(),
    };
    // Rank 0's MD: the big put's source [0, n), then the small put's 0x55 bytes, the
    // addend 7 and the value each pair puts.
    let mem = p
        .endpoint()
        .mem_register(n + 64, Perms::READ_WRITE)
        .unwrap();
    let pt = p.pt_alloc(ni, 0, None, Some(13)).unwrap();
    if me == 1 {
        let mut e = Me::new(
            Buffer {
                region: mem.handle,
                offset: 0,
                len: n as u64,
            },
            3,
        );
        e.options |= me_opt::EVENT_COMM_DISABLE;
        p.me_append(ni, pt, &e, List::Priority, 0).unwrap();
    }
    p.endpoint().barrier().unwrap();
    if me == 0 {
        let ct = p.ct_alloc(ni).unwrap();
        let md = p
            .md_bind(
                ni,
                &Md {
                    region: mem.handle,
                    segments: vec![(0, n as u64 + 64)],
                    options: md_opt::EVENT_CT_ACK | md_opt::EVENT_SEND_DISABLE,
                    eq: None,
                    ct: Some(ct),
                },
            )
            .unwrap();
        let b = mem.bytes();
        b[..n].fill(0xAA);
        b[n..n + 8].fill(0x55);
        b[n + 8..n + 16].copy_from_slice(&7u64.to_le_bytes());
        let t = target(1, pt, 3, 0);
        p.put(ni, md, 0, n as u64, AckReq::CtAck, t, 0, 0).unwrap();
        p.put(ni, md, n as u64, 8, AckReq::CtAck, t, 0, 0).unwrap();
        let mut issued = 2;
        let w = Target {
            remote_offset: 8,
            ..t
        };
        for k in 0..300u64 {
            // A put of 10k to word 8, then +7: in order, the word ends 10k + 7.
            b[n + 16..n + 24].copy_from_slice(&(k * 10).to_le_bytes());
            p.put(ni, md, n as u64 + 16, 8, AckReq::CtAck, w, 0, 0)
                .unwrap();
            p.atomic(
                ni,
                md,
                n as u64 + 8,
                8,
                AckReq::CtAck,
                w,
                0,
                0,
                AtomicOp::Sum,
                Datatype::Uint64,
            )
            .unwrap();
            issued += 2;
            // The value word changes for the next pair only once these were sent.
            assert_eq!(p.ct_wait(ni, ct, issued).unwrap().failure, 0);
        }
    }
    p.endpoint().barrier().unwrap();
    if me == 1 {
        let b = mem.bytes();
        assert_eq!(&b[..8], &[0x55; 8], "the small put came after the big one");
        assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), 2997);
        assert!(b[16..n].iter().all(|&x| x == 0xAA));
    }
    p.endpoint().barrier().unwrap();
}
