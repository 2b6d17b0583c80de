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
    let mem = s.p.nic().mem_register(4096, Perms::READ_WRITE).unwrap();
    let pt = s.p.pt_alloc(s.ni, 0, Some(s.eq), Some(4)).unwrap();
    assert_eq!(pt, 4);
    if rank == 1 {
        s.p.me_append(
            s.ni,
            pt,
            &Me::new(
                Buffer {
                    region: mem.clone(),
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
    s.p.nic().barrier().unwrap();
    if rank == 0 {
        mem.bytes()[..11].copy_from_slice(b"hello there");
        let md =
            s.p.md_bind(
                s.ni,
                &Md {
                    region: mem.clone(),
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
    s.p.nic().barrier().unwrap();
}
