//! Initiator-side and triggered-operation tests: an initiator interface wired straight to a
//! target interface (the wire and the daemon come on top of exactly these calls).

use super::atomic::{AtomicOp, Datatype};
use super::initiator::md;
use super::types::{me, RANK_ANY};
use super::*;
use crate::nic::memory::{GoneBacking, HeapBacking, Perms, Region};

fn rank(r: u32) -> ProcessId {
    ProcessId::Logical { rank: r }
}

fn region(len: usize) -> Region {
    Region::new(HeapBacking::new(len), Perms::READ_WRITE)
}

/// Initiator (with an EQ and a CT) and target (PT 0 with one persistent ME over `tr`).
struct Pair {
    a: PortalsNi,
    b: PortalsNi,
    a_eq: u32,
    a_ct: u32,
    b_eq: u32,
}

fn pair(tr: &Region, me_opts: u32) -> Pair {
    let mut a = PortalsNi::new(true, Limits::default());
    let mut b = PortalsNi::new(true, Limits::default());
    let a_eq = a.eq_alloc(64).unwrap();
    let a_ct = a.ct_alloc().unwrap();
    let b_eq = b.eq_alloc(64).unwrap();
    b.pt_alloc(0, Some(b_eq), Some(0)).unwrap();
    let e = MatchEntry {
        region: tr.clone(),
        start: 0,
        length: tr.len() as u64,
        ct: None,
        uid: u32::MAX,
        options: me::OP_PUT | me::OP_GET | me_opts,
        match_id: rank(RANK_ANY),
        match_bits: 0,
        ignore_bits: u64::MAX,
        min_free: 0,
    };
    b.append(0, e, List::Priority, 0).unwrap();
    Pair {
        a,
        b,
        a_eq,
        a_ct,
        b_eq,
    }
}

fn spec(kind: ReqKind, md: u32, length: u64, ack_req: AckReq) -> OpSpec {
    OpSpec {
        kind,
        md,
        offset: 0,
        length,
        get_md: Some(md),
        get_offset: 0,
        ack_req,
        target: rank(1),
        pt_index: 0,
        match_bits: 0,
        remote_offset: 0,
        user_ptr: 77,
        hdr_data: 5,
        operand: Vec::new(),
        inline: Vec::new(),
    }
}

impl Pair {
    /// Binds one piece `[0, len)` of `r` at the initiator, with its EQ and CT.
    fn bind(&mut self, r: Region, len: u64, options: u32) -> u32 {
        self.a
            .md_bind(r, vec![(0, len)], options, Some(self.a_eq), Some(self.a_ct))
            .unwrap()
    }

    /// Starts `s` at the initiator, delivers it at the target, completes it at the initiator.
    fn run(&mut self, s: OpSpec) -> Response {
        let (id, resp) = self.serve(&s);
        self.a.complete(id, &resp);
        resp
    }

    /// Starts `s` at the initiator and delivers it at the target: the operation's id and the
    /// target's response, not yet completed.
    fn serve(&mut self, s: &OpSpec) -> (u32, Response) {
        let mut payload = Vec::new();
        let id = self.a.start(s.clone(), &mut payload).unwrap();
        let req = Request {
            kind: s.kind,
            initiator: rank(0),
            uid: 0,
            pt_index: s.pt_index,
            match_bits: s.match_bits,
            remote_offset: s.remote_offset,
            rlength: s.length,
            hdr_data: s.hdr_data,
            data: &payload,
            operand: &s.operand,
        };
        (id, self.b.deliver(&req))
    }

    fn a_kinds(&mut self) -> Vec<EventKind> {
        let mut v = Vec::new();
        while let Ok((e, _)) = self.a.eq_get(self.a_eq) {
            v.push(e.kind);
        }
        v
    }
}

#[test]
fn put_event_sequences_for_every_ack_request() {
    for (ack, want_events, counted) in [
        (AckReq::Ack, vec![EventKind::Send, EventKind::Ack], 1),
        (AckReq::CtAck, vec![EventKind::Send], 1),
        (AckReq::OcAck, vec![EventKind::Send], 1),
        (AckReq::NoAck, vec![EventKind::Send], 0),
    ] {
        let tr = region(64);
        let mut p = pair(&tr, 0);
        let src = region(16);
        src.write(0, b"sixteen bytes!!!").unwrap();
        let m = p.bind(src, 16, md::EVENT_CT_ACK);
        p.run(spec(ReqKind::Put, m, 16, ack));
        assert_eq!(tr.to_vec(0, 16), b"sixteen bytes!!!");
        assert_eq!(p.a_kinds(), want_events, "{ack:?}");
        assert_eq!(p.a.ct_get(p.a_ct).unwrap().success, counted, "{ack:?}");
    }
}

/// A volatile MD's bytes come with the call: the NIC sends those, whatever its memory holds
/// by the time it starts the operation, and refuses inline bytes that do not fit the call.
/// A pair whose initiator has a volatile MD over memory that no longer holds what the put
/// of 16 B it returns was called with (its inline bytes).
fn volatile_put(tr: &Region) -> (Pair, OpSpec) {
    let mut p = pair(tr, 0);
    let src = region(1024);
    src.write(0, b"overwritten.....").unwrap();
    let m = p.bind(src, 1024, md::VOLATILE);
    let mut s = spec(ReqKind::Put, m, 16, AckReq::Ack);
    s.inline = b"as it was called".to_vec();
    (p, s)
}

#[test]
fn inline_bytes_are_sent_instead_of_the_md_memory() {
    let tr = region(64);
    let (mut p, s) = volatile_put(&tr);
    p.run(s.clone());
    assert_eq!(tr.to_vec(0, 16), b"as it was called");
    assert_eq!(p.a_kinds(), [EventKind::Send, EventKind::Ack]);
    let limit = Limits::default().max_volatile_size;
    for bad in [
        OpSpec {
            length: 8,
            ..s.clone()
        },
        OpSpec {
            kind: ReqKind::Get,
            ..s.clone()
        },
        OpSpec {
            length: limit + 1,
            inline: vec![0; limit as usize + 1],
            ..s.clone()
        },
    ] {
        assert_eq!(
            p.a.start(bad, &mut Vec::new()),
            Err(PtlError::ArgInvalid),
            "inline bytes that are not the whole send, or longer than max_volatile_size"
        );
    }
}

/// A put too long for one datagram streams from its MD; one from a volatile MD (a small MTU
/// makes a fragment shorter than max_volatile_size) streams the call's bytes instead.
#[test]
fn a_streamed_put_reads_the_calls_bytes_not_the_md() {
    let tr = region(64);
    let (mut p, mut s) = volatile_put(&tr);
    let (_, from) = p.a.start_streamed(s.clone()).unwrap();
    let mut got = Vec::new();
    from.gather(0, 10, &mut got).unwrap();
    from.gather(10, 6, &mut got).unwrap();
    assert_eq!(got, b"as it was called");
    assert!(
        from.mapped(0, 16).is_none(),
        "the call's bytes are not read in place"
    );
    assert_eq!(
        from.gather(10, 7, &mut got),
        Err(crate::wire::Status::OutOfBounds)
    );
    // Without inline bytes the stream reads the MD.
    s.inline.clear();
    let (_, from) = p.a.start_streamed(s).unwrap();
    let mut got = Vec::new();
    from.gather(0, 16, &mut got).unwrap();
    assert_eq!(got, b"overwritten.....");
}

#[test]
fn ack_disabled_at_the_target_means_no_ack() {
    let tr = region(64);
    let mut p = pair(&tr, me::ACK_DISABLE);
    let m = p.bind(region(8), 8, md::EVENT_CT_ACK);
    p.run(spec(ReqKind::Put, m, 8, AckReq::Ack));
    assert_eq!(p.a_kinds(), [EventKind::Send]);
    assert_eq!(p.a.ct_get(p.a_ct).unwrap().success, 0);
}

#[test]
fn get_replies_scatter_into_an_iovec_md() {
    let tr = region(64);
    tr.write(0, b"abcdefghij").unwrap();
    let mut p = pair(&tr, 0);
    let dst = region(64);
    // Two pieces: 4 bytes at 40, 6 bytes at 10.
    let m =
        p.a.md_bind(
            dst.clone(),
            vec![(40, 4), (10, 6)],
            md::IOVEC | md::EVENT_CT_REPLY | md::EVENT_CT_BYTES,
            Some(p.a_eq),
            Some(p.a_ct),
        )
        .unwrap();
    let r = p.run(spec(ReqKind::Get, m, 10, AckReq::NoAck));
    assert_eq!(r.mlength, 10);
    assert_eq!(dst.to_vec(40, 4), b"abcd");
    assert_eq!(dst.to_vec(10, 6), b"efghij");
    assert_eq!(p.a_kinds(), [EventKind::Reply], "gets post no SEND");
    assert_eq!(p.a.ct_get(p.a_ct).unwrap().success, 10, "bytes counted");
}

#[test]
fn failures_reach_the_initiator_event_and_failure_count() {
    let tr = region(64);
    let mut p = pair(&tr, 0);
    let m = p.bind(region(8), 8, md::EVENT_CT_REPLY | md::EVENT_SUCCESS_DISABLE);
    let mut s = spec(ReqKind::Get, m, 8, AckReq::NoAck);
    s.pt_index = 9; // not allocated at the target
    assert_eq!(p.run(s).ni_fail, NiFail::Dropped);
    let (e, _) = p.a.eq_get(p.a_eq).unwrap();
    assert_eq!(
        (e.kind, e.ni_fail, e.user_ptr),
        (EventKind::Reply, NiFail::Dropped, 77),
        "failures are never disabled"
    );
    assert_eq!(
        p.a.ct_get(p.a_ct).unwrap(),
        CtEvent {
            success: 0,
            failure: 1
        }
    );
}

#[test]
fn fetch_atomic_and_swap_reply_with_the_old_value() {
    let tr = region(64);
    tr.write(0, &40u64.to_le_bytes()).unwrap();
    let mut p = pair(&tr, 0);
    let buf = region(32);
    buf.write(0, &2u64.to_le_bytes()).unwrap();
    let m =
        p.a.md_bind(buf.clone(), vec![(0, 32)], 0, Some(p.a_eq), None)
            .unwrap();
    let mut s = spec(
        ReqKind::FetchAtomic(AtomicOp::Sum, Datatype::Uint64),
        m,
        8,
        AckReq::NoAck,
    );
    s.get_offset = 16;
    p.run(s);
    assert_eq!(buf.to_vec(16, 8), 40u64.to_le_bytes());
    assert_eq!(tr.to_vec(0, 8), 42u64.to_le_bytes());
    let mut s = spec(
        ReqKind::Swap(AtomicOp::Cswap, Datatype::Uint64),
        m,
        8,
        AckReq::NoAck,
    );
    s.operand = 42u64.to_le_bytes().to_vec();
    s.get_offset = 24;
    p.run(s);
    assert_eq!(buf.to_vec(24, 8), 42u64.to_le_bytes());
    assert_eq!(
        tr.to_vec(0, 8),
        2u64.to_le_bytes(),
        "swapped in the payload"
    );
    assert_eq!(
        p.a_kinds(),
        [
            EventKind::Send,
            EventKind::Reply,
            EventKind::Send,
            EventKind::Reply
        ]
    );
    let mut ev = Vec::new();
    while let Ok((e, _)) = p.b.eq_get(p.b_eq) {
        ev.push(e.kind);
    }
    assert_eq!(
        ev,
        [
            EventKind::Link,
            EventKind::FetchAtomic,
            EventKind::FetchAtomic
        ]
    );
}

#[test]
fn md_rules_and_bad_arguments() {
    let tr = region(64);
    let mut p = pair(&tr, 0);
    let r = region(16);
    assert_eq!(
        p.a.md_bind(r.clone(), vec![(8, 16)], 0, None, None),
        Err(PtlError::ArgInvalid),
        "past the region"
    );
    assert_eq!(
        p.a.md_bind(r.clone(), vec![(0, 4), (4, 4)], 0, None, None),
        Err(PtlError::ArgInvalid),
        "pieces need IOVEC"
    );
    assert_eq!(
        p.a.md_bind(r.clone(), vec![(0, 4)], 1 << 30, None, None),
        Err(PtlError::ArgInvalid),
        "unknown option"
    );
    let m =
        p.a.md_bind(r, vec![(0, 16)], 0, Some(p.a_eq), None)
            .unwrap();
    assert_eq!(
        p.a.start(spec(ReqKind::Put, m, 17, AckReq::Ack), &mut Vec::new())
            .err(),
        Some(PtlError::ArgInvalid)
    );
    assert_eq!(
        p.a.start(
            spec(
                ReqKind::Atomic(AtomicOp::Bxor, Datatype::Float),
                m,
                4,
                AckReq::Ack
            ),
            &mut Vec::new()
        )
        .err(),
        Some(PtlError::ArgInvalid)
    );
    assert_eq!(
        p.a.start(
            spec(
                ReqKind::Atomic(AtomicOp::Sum, Datatype::Int32),
                m,
                6,
                AckReq::Ack
            ),
            &mut Vec::new()
        )
        .err(),
        Some(PtlError::ArgInvalid)
    );
    assert_eq!(
        p.a.start(
            spec(
                ReqKind::Atomic(AtomicOp::Swap, Datatype::Int32),
                m,
                4,
                AckReq::Ack
            ),
            &mut Vec::new()
        )
        .err(),
        Some(PtlError::ArgInvalid),
        "swaps belong to PtlSwap"
    );
    let mut cs = spec(
        ReqKind::Swap(AtomicOp::Cswap, Datatype::Int32),
        m,
        8,
        AckReq::NoAck,
    );
    cs.operand = vec![0; 4];
    assert_eq!(
        p.a.start(cs, &mut Vec::new()).err(),
        Some(PtlError::ArgInvalid),
        "CSWAP takes one element"
    );
    // Release while in flight is refused; after completion it works.
    let id =
        p.a.start(spec(ReqKind::Put, m, 8, AckReq::Ack), &mut Vec::new())
            .unwrap();
    assert_eq!(p.a.md_release(m), Err(PtlError::InUse));
    p.a.complete(
        id,
        &Response {
            ack: true,
            mlength: 8,
            ..Default::default()
        },
    );
    p.a.md_release(m).unwrap();
    assert_eq!(p.a.md_release(m), Err(PtlError::ArgInvalid));
    p.a.complete(id, &Response::default()); // late duplicate: ignored
}

#[test]
fn triggered_chains_fire_in_order_and_can_be_cancelled() {
    let mut n = PortalsNi::new(true, Limits::default());
    let (c1, c2, c3) = (
        n.ct_alloc().unwrap(),
        n.ct_alloc().unwrap(),
        n.ct_alloc().unwrap(),
    );
    let m = n.md_bind(region(8), vec![(0, 8)], 0, None, None).unwrap();
    let op = |bits| OpSpec {
        match_bits: bits,
        ..spec(ReqKind::Put, m, 8, AckReq::NoAck)
    };
    // c1 reaching 2 bumps c2; c2 reaching 1 fires two puts in posting order and sets c3.
    n.triggered(
        c1,
        2,
        TriggeredAction::CtInc {
            ct: c2,
            by: CtEvent {
                success: 1,
                failure: 0,
            },
        },
    )
    .unwrap();
    n.triggered(c2, 1, TriggeredAction::Op(op(1))).unwrap();
    n.triggered(c2, 1, TriggeredAction::Op(op(2))).unwrap();
    n.triggered(
        c2,
        1,
        TriggeredAction::CtSet {
            ct: c3,
            value: CtEvent {
                success: 9,
                failure: 0,
            },
        },
    )
    .unwrap();
    n.triggered(c3, 100, TriggeredAction::Op(op(3))).unwrap();
    n.ct_inc(
        c1,
        CtEvent {
            success: 1,
            failure: 0,
        },
    )
    .unwrap();
    assert!(n.take_fired().is_none(), "threshold not reached yet");
    n.ct_inc(
        c1,
        CtEvent {
            success: 1,
            failure: 0,
        },
    )
    .unwrap();
    assert_eq!(n.take_fired().map(|s| s.match_bits), Some(1));
    assert_eq!(n.take_fired().map(|s| s.match_bits), Some(2));
    assert!(n.take_fired().is_none());
    assert_eq!(n.ct_get(c3).unwrap().success, 9);
    // Already reached: fires at once. Cancelled: never.
    n.triggered(c1, 1, TriggeredAction::Op(op(4))).unwrap();
    assert_eq!(n.take_fired().map(|s| s.match_bits), Some(4));
    n.ct_cancel_triggered(c3).unwrap();
    n.ct_set(
        c3,
        CtEvent {
            success: 1000,
            failure: 0,
        },
    )
    .unwrap();
    assert!(n.take_fired().is_none());
    assert_eq!(
        n.triggered(999, 1, TriggeredAction::Op(op(5))),
        Err(PtlError::ArgInvalid)
    );
}

#[test]
fn target_counting_events_release_triggered_operations() {
    // The MPI-over-Portals pattern: a counting event on the target entry releases a triggered
    // put at the target's NIC, without the target process.
    let mut b = PortalsNi::new(true, Limits::default());
    let eq = b.eq_alloc(16).unwrap();
    b.pt_alloc(0, Some(eq), Some(0)).unwrap();
    let ct = b.ct_alloc().unwrap();
    let tr = region(64);
    let e = MatchEntry {
        region: tr.clone(),
        start: 0,
        length: 64,
        ct: Some(ct),
        uid: u32::MAX,
        options: me::OP_PUT | me::EVENT_CT_COMM,
        match_id: rank(RANK_ANY),
        match_bits: 1,
        ignore_bits: 0,
        min_free: 0,
    };
    b.append(0, e, List::Priority, 0).unwrap();
    let bm = b.md_bind(region(8), vec![(0, 8)], 0, None, None).unwrap();
    b.triggered(
        ct,
        2,
        TriggeredAction::Op(spec(ReqKind::Put, bm, 8, AckReq::NoAck)),
    )
    .unwrap();
    let put = |bits| Request {
        kind: ReqKind::Put,
        initiator: rank(0),
        uid: 0,
        pt_index: 0,
        match_bits: bits,
        remote_offset: 0,
        rlength: 4,
        hdr_data: 0,
        data: b"ping",
        operand: &[],
    };
    b.deliver(&put(1));
    assert!(
        b.take_fired().is_none(),
        "one arrival is below the threshold"
    );
    assert_eq!(
        b.deliver(&put(2)).ni_fail,
        NiFail::Dropped,
        "a non-matching message counts nothing"
    );
    assert!(b.take_fired().is_none());
    b.deliver(&put(1));
    assert_eq!(
        b.take_fired().map(|s| s.md),
        Some(bm),
        "the second arrival releases the put"
    );
}

/// Memory reached by copy whose reads and writes fail (its process unmapped it).
#[test]
fn memory_that_is_gone_fails_as_a_segmentation_violation() {
    let tr = region(64);
    let mut p = pair(&tr, 0);
    let gone = Region::new(std::sync::Arc::new(GoneBacking(64)), Perms(0));
    let m = p.bind(gone, 64, md::EVENT_CT_ACK | md::EVENT_CT_REPLY);
    // A put whose source cannot be read starts nothing and reports where its ACK would.
    assert_eq!(
        p.a.start(spec(ReqKind::Put, m, 8, AckReq::Ack), &mut Vec::new())
            .err(),
        Some(PtlError::ArgInvalid)
    );
    let (e, _) = p.a.eq_get(p.a_eq).unwrap();
    assert_eq!((e.kind, e.ni_fail), (EventKind::Ack, NiFail::Segv));
    assert_eq!(p.a.ct_get(p.a_ct).unwrap().failure, 1);
    // A reply that cannot land fails the same way.
    let r = p.run(spec(ReqKind::Get, m, 8, AckReq::NoAck));
    assert_eq!(r.ni_fail, NiFail::Ok, "the target served it");
    let (e, _) = p.a.eq_get(p.a_eq).unwrap();
    assert_eq!((e.kind, e.ni_fail), (EventKind::Reply, NiFail::Segv));
    assert_eq!(p.a.ct_get(p.a_ct).unwrap().failure, 2);
}

#[test]
fn an_ack_in_full_completes_as_the_targets_response_would() {
    // The same atomic twice: completed with the target's own response, and in full (the
    // batched acknowledgement) — same events, same count; a host that was not asked is ignored.
    let mut outcomes = Vec::new();
    for in_full in [false, true] {
        let tr = region(64);
        let mut p = pair(&tr, 0);
        let src = region(8);
        src.write(0, &5u64.to_le_bytes()).unwrap();
        let m = p.bind(src, 8, md::EVENT_CT_ACK);
        let s = OpSpec {
            target: ProcessId::Physical { nid: 3, pid: 1 },
            remote_offset: 16,
            ..spec(
                ReqKind::Atomic(AtomicOp::Bxor, Datatype::Uint64),
                m,
                8,
                AckReq::Ack,
            )
        };
        let (id, resp) = p.serve(&s);
        assert_eq!((resp.mlength, resp.offset), (8, 16), "served in full");
        if in_full {
            p.a.complete_in_full(id, 2);
            assert_eq!(p.a.outgoing_len(), 1, "another host's ack is ignored");
            p.a.complete_in_full(id, 3);
        } else {
            p.a.complete(id, &resp);
        }
        assert_eq!(p.a.outgoing_len(), 0);
        let mut events = Vec::new();
        while let Ok((e, _)) = p.a.eq_get(p.a_eq) {
            events.push((e.kind, e.mlength, e.remote_offset, e.ni_fail));
        }
        outcomes.push((events, p.a.ct_get(p.a_ct).unwrap()));
    }
    assert_eq!(
        outcomes[0].0.last(),
        Some(&(EventKind::Ack, 8, 16, NiFail::Ok))
    );
    assert_eq!(outcomes[0], outcomes[1]);
}
