//! Engine tests, organised by the Portals 4 specification's sections and written from its
//! words: matching, list semantics, offsets, truncation, events, flow control, bad input.

use super::atomic::{AtomicOp, Datatype};
use super::types::{me, pt, RANK_ANY};
use super::*;
use crate::nic::memory::{HeapBacking, Perms, Region};

const ME_ALL: u32 = me::OP_PUT | me::OP_GET;

fn rank(r: u32) -> ProcessId {
    ProcessId::Logical { rank: r }
}

fn region(len: usize) -> Region {
    Region::new(HeapBacking::new(len), Perms::READ_WRITE)
}

fn entry(r: &Region, start: u64, length: u64, options: u32, bits: u64, ignore: u64) -> MatchEntry {
    MatchEntry {
        region: r.clone(),
        start,
        length,
        ct: None,
        uid: u32::MAX,
        options,
        match_id: rank(RANK_ANY),
        match_bits: bits,
        ignore_bits: ignore,
        min_free: 0,
    }
}

fn put<'a>(pt: u32, bits: u64, data: &'a [u8]) -> Request<'a> {
    Request {
        kind: ReqKind::Put,
        initiator: rank(1),
        uid: 0,
        pt_index: pt,
        match_bits: bits,
        remote_offset: 0,
        rlength: data.len() as u64,
        hdr_data: 0xabc,
        data,
        operand: &[],
    }
}

/// An NI with one portal table entry (index 0) reporting to an EQ of `eq_len` events.
fn ni(pt_options: u32, eq_len: usize) -> (PortalsNi, u32) {
    let mut n = PortalsNi::new(true, Limits::default());
    let eq = n.eq_alloc(eq_len).unwrap();
    assert_eq!(n.pt_alloc(pt_options, Some(eq), Some(0)).unwrap(), 0);
    (n, eq)
}

fn events(n: &mut PortalsNi, eq: u32) -> Vec<Event> {
    let mut v = Vec::new();
    while let Ok((e, _)) = n.eq_get(eq) {
        v.push(e);
    }
    v
}

fn kinds(n: &mut PortalsNi, eq: u32) -> Vec<EventKind> {
    events(n, eq).iter().map(|e| e.kind).collect()
}

// ---------------------------------------------------------------- matching (match bits, ids)

#[test]
fn ignore_bits_mask_insignificant_match_bits() {
    let (mut n, eq) = ni(0, 64);
    let r = region(64);
    n.append(
        0,
        entry(&r, 0, 64, ME_ALL, 0x1200, 0x00ff),
        List::Priority,
        7,
    )
    .unwrap();
    assert_eq!(
        n.deliver(&put(0, 0x12ab, b"x")).ni_fail,
        NiFail::Ok,
        "low byte ignored"
    );
    assert_eq!(
        n.deliver(&put(0, 0x13ab, b"x")).ni_fail,
        NiFail::Dropped,
        "high byte significant"
    );
    let ev = events(&mut n, eq);
    assert_eq!(
        ev.iter().map(|e| e.kind).collect::<Vec<_>>(),
        [EventKind::Link, EventKind::Put]
    );
    assert_eq!(
        (ev[1].match_bits, ev[1].user_ptr, ev[1].hdr_data),
        (0x12ab, 7, 0xabc)
    );
}

#[test]
fn match_id_filters_initiators() {
    let (mut n, _) = ni(0, 64);
    let r = region(64);
    let mut e = entry(&r, 0, 64, ME_ALL, 0, 0);
    e.match_id = rank(2);
    n.append(0, e, List::Priority, 0).unwrap();
    let mut m = put(0, 0, b"abc");
    assert_eq!(
        n.deliver(&m).ni_fail,
        NiFail::Dropped,
        "rank 1 is not accepted"
    );
    m.initiator = rank(2);
    assert_eq!(n.deliver(&m).ni_fail, NiFail::Ok);
    m.initiator = ProcessId::Physical { nid: 2, pid: 0 };
    assert_eq!(
        n.deliver(&m).ni_fail,
        NiFail::Dropped,
        "physical never matches logical"
    );
}

#[test]
fn first_matching_entry_in_list_order_wins() {
    let (mut n, eq) = ni(0, 64);
    let (a, b) = (region(16), region(16));
    n.append(0, entry(&a, 0, 16, ME_ALL, 0, u64::MAX), List::Priority, 1)
        .unwrap();
    n.append(0, entry(&b, 0, 16, ME_ALL, 0, u64::MAX), List::Priority, 2)
        .unwrap();
    n.deliver(&put(0, 5, b"hi"));
    assert_eq!(a.to_vec(0, 2), b"hi");
    assert_eq!(b.to_vec(0, 2), &[0, 0]);
    assert_eq!(events(&mut n, eq).last().unwrap().user_ptr, 1);
}

// ---------------------------------------------------------------- list semantics

#[test]
fn use_once_entries_unlink_after_one_message() {
    let (mut n, eq) = ni(0, 64);
    let r = region(64);
    let h = n
        .append(
            0,
            entry(&r, 0, 64, ME_ALL | me::USE_ONCE, 0, 0),
            List::Priority,
            9,
        )
        .unwrap();
    assert_eq!(n.deliver(&put(0, 0, b"one")).ni_fail, NiFail::Ok);
    assert!(!n.is_linked(h));
    assert_eq!(n.deliver(&put(0, 0, b"two")).ni_fail, NiFail::Dropped);
    assert_eq!(
        kinds(&mut n, eq),
        [EventKind::Link, EventKind::Put, EventKind::AutoUnlink]
    );
    assert_eq!(
        n.unlink(h),
        Err(PtlError::ArgInvalid),
        "its handle is stale"
    );
}

#[test]
fn priority_list_before_overflow_list_then_unexpected_search_on_append() {
    let (mut n, eq) = ni(0, 64);
    let (pri, ovf) = (region(64), region(1024));
    n.append(
        0,
        entry(&ovf, 0, 1024, ME_ALL | me::MANAGE_LOCAL, 0, u64::MAX),
        List::Overflow,
        100,
    )
    .unwrap();
    n.append(
        0,
        entry(&pri, 0, 64, ME_ALL | me::USE_ONCE, 1, 0),
        List::Priority,
        1,
    )
    .unwrap();
    // Bits 1 go to the priority entry; bits 2 fall through to the overflow entry.
    n.deliver(&put(0, 1, b"expected"));
    n.deliver(&put(0, 2, b"unexpected"));
    assert_eq!(pri.to_vec(0, 8), b"expected");
    assert_eq!(ovf.to_vec(0, 10), b"unexpected");
    assert_eq!(n.unexpected_len(0), 1);
    let ev = events(&mut n, eq);
    let put_ovf = ev
        .iter()
        .filter(|e| e.kind == EventKind::Put && e.user_ptr == 100)
        .count();
    assert_eq!(
        put_ovf, 1,
        "arrival in an overflow entry posts a PUT event for it"
    );
    // A matching use-once append consumes the header at once: PUT_OVERFLOW, not linked.
    let h = n
        .append(
            0,
            entry(&pri, 0, 64, ME_ALL | me::USE_ONCE, 2, 0),
            List::Priority,
            5,
        )
        .unwrap();
    assert!(!n.is_linked(h));
    assert_eq!(n.unexpected_len(0), 0);
    let ev = events(&mut n, eq);
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].kind, ev[0].user_ptr, ev[0].mlength, ev[0].start),
        (EventKind::PutOverflow, 5, 10, 0)
    );
    // A non-matching append waits for future messages.
    let h = n
        .append(0, entry(&pri, 0, 64, ME_ALL, 3, 0), List::Priority, 6)
        .unwrap();
    assert!(n.is_linked(h));
    assert_eq!(kinds(&mut n, eq), [EventKind::Link]);
}

#[test]
fn persistent_append_consumes_every_matching_header() {
    let (mut n, eq) = ni(0, 64);
    let ovf = region(1024);
    n.append(
        0,
        entry(&ovf, 0, 1024, ME_ALL | me::MANAGE_LOCAL, 0, u64::MAX),
        List::Overflow,
        0,
    )
    .unwrap();
    for b in [7, 8, 7] {
        n.deliver(&put(0, b, b"m"));
    }
    events(&mut n, eq);
    n.append(0, entry(&region(8), 0, 8, ME_ALL, 7, 0), List::Priority, 1)
        .unwrap();
    assert_eq!(
        kinds(&mut n, eq),
        [
            EventKind::PutOverflow,
            EventKind::PutOverflow,
            EventKind::Link
        ]
    );
    assert_eq!(n.unexpected_len(0), 1, "the header with bits 8 stays");
}

#[test]
fn overflow_entry_is_freed_after_its_headers_are_consumed() {
    let (mut n, eq) = ni(0, 64);
    let ovf = region(64);
    n.append(
        0,
        entry(&ovf, 0, 64, ME_ALL | me::USE_ONCE, 0, u64::MAX),
        List::Overflow,
        50,
    )
    .unwrap();
    n.deliver(&put(0, 4, b"data"));
    assert_eq!(
        kinds(&mut n, eq),
        [EventKind::Link, EventKind::Put, EventKind::AutoUnlink]
    );
    n.append(
        0,
        entry(&region(8), 0, 8, ME_ALL | me::USE_ONCE, 4, 0),
        List::Priority,
        1,
    )
    .unwrap();
    let ev = events(&mut n, eq);
    assert_eq!(
        ev.iter().map(|e| e.kind).collect::<Vec<_>>(),
        [EventKind::PutOverflow, EventKind::AutoFree]
    );
    assert_eq!(ev[1].user_ptr, 50);
}

#[test]
fn me_search_only_and_delete() {
    let (mut n, eq) = ni(0, 64);
    let ovf = region(256);
    n.append(
        0,
        entry(&ovf, 0, 256, ME_ALL | me::MANAGE_LOCAL, 0, u64::MAX),
        List::Overflow,
        0,
    )
    .unwrap();
    n.deliver(&put(0, 11, b"probe me"));
    events(&mut n, eq);
    let probe = entry(&region(8), 0, 8, ME_ALL, 11, 0);
    n.search(0, probe.clone(), SearchOp::SearchOnly, 3).unwrap();
    let ev = events(&mut n, eq);
    assert_eq!(
        (ev[0].kind, ev[0].ni_fail, ev[0].rlength, ev[0].user_ptr),
        (EventKind::Search, NiFail::Ok, 8, 3)
    );
    assert_eq!(n.unexpected_len(0), 1, "SEARCH_ONLY leaves the header");
    n.search(0, probe.clone(), SearchOp::SearchDelete, 4)
        .unwrap();
    assert_eq!(kinds(&mut n, eq), [EventKind::PutOverflow]);
    assert_eq!(n.unexpected_len(0), 0);
    n.search(0, probe, SearchOp::SearchOnly, 5).unwrap();
    let ev = events(&mut n, eq);
    assert_eq!(
        (ev[0].kind, ev[0].ni_fail),
        (EventKind::Search, NiFail::NoMatch)
    );
}

// ---------------------------------------------------------------- offsets and truncation

#[test]
fn locally_managed_offsets_pack_messages_and_min_free_unlinks() {
    let (mut n, eq) = ni(0, 64);
    let r = region(32);
    let mut e = entry(&r, 0, 32, ME_ALL | me::MANAGE_LOCAL, 0, u64::MAX);
    e.min_free = 10;
    let h = n.append(0, e, List::Priority, 0).unwrap();
    let a = n.deliver(&put(0, 0, b"aaaaaaaaaa"));
    let b = n.deliver(&Request {
        remote_offset: 999,
        ..put(0, 0, b"bbbbbbbbbb")
    });
    assert_eq!(
        (a.offset, b.offset),
        (0, 10),
        "the remote offset is ignored"
    );
    assert_eq!(r.to_vec(0, 20), b"aaaaaaaaaabbbbbbbbbb");
    assert_eq!(n.local_offset(h), Some(20));
    assert!(n.is_linked(h), "12 bytes free is not below min_free");
    n.deliver(&put(0, 0, b"ccc"));
    assert!(!n.is_linked(h), "9 bytes free is below min_free");
    assert_eq!(kinds(&mut n, eq).last(), Some(&EventKind::AutoUnlink));
}

#[test]
fn may_align_keeps_messages_on_8_byte_boundaries() {
    let (mut n, _) = ni(0, 64);
    let r = region(64);
    n.append(
        0,
        entry(
            &r,
            0,
            64,
            ME_ALL | me::MANAGE_LOCAL | me::MAY_ALIGN,
            0,
            u64::MAX,
        ),
        List::Priority,
        0,
    )
    .unwrap();
    n.deliver(&put(0, 0, b"abc"));
    assert_eq!(n.deliver(&put(0, 0, b"def")).offset, 8);
}

#[test]
fn truncation_and_no_truncate() {
    let (mut n, eq) = ni(0, 64);
    let (small, big) = (region(4), region(16));
    n.append(
        0,
        entry(&small, 0, 4, ME_ALL, 0, u64::MAX),
        List::Priority,
        1,
    )
    .unwrap();
    let r = n.deliver(&put(0, 0, b"123456"));
    assert_eq!(
        (r.ni_fail, r.mlength),
        (NiFail::Ok, 4),
        "truncated to the room"
    );
    let ev = events(&mut n, eq);
    assert_eq!((ev[1].rlength, ev[1].mlength), (6, 4));
    // With NO_TRUNCATE a too-long message does not match: it goes to the next entry.
    let (mut n, _) = ni(0, 64);
    n.append(
        0,
        entry(&small, 0, 4, ME_ALL | me::NO_TRUNCATE, 0, u64::MAX),
        List::Priority,
        1,
    )
    .unwrap();
    n.append(
        0,
        entry(&big, 0, 16, ME_ALL, 0, u64::MAX),
        List::Priority,
        2,
    )
    .unwrap();
    assert_eq!(n.deliver(&put(0, 0, b"123456")).mlength, 6);
    assert_eq!(big.to_vec(0, 6), b"123456");
    // Remote offset beyond the entry: truncated to zero bytes.
    let r = n.deliver(&Request {
        remote_offset: 100,
        ..put(0, 0, b"zz")
    });
    assert_eq!((r.ni_fail, r.mlength), (NiFail::Ok, 0));
}

// ---------------------------------------------------------------- permissions

#[test]
fn operation_and_user_permissions() {
    let (mut n, _) = ni(0, 64);
    let r = region(16);
    let ct = n.ct_alloc().unwrap();
    let mut e = entry(&r, 0, 16, me::OP_GET | me::EVENT_CT_COMM, 0, u64::MAX);
    e.ct = Some(ct);
    n.append(0, e, List::Priority, 0).unwrap();
    assert_eq!(n.deliver(&put(0, 0, b"no")).ni_fail, NiFail::OpViolation);
    assert_eq!(r.to_vec(0, 2), &[0, 0]);
    assert_eq!(
        n.ct_get(ct).unwrap(),
        CtEvent {
            success: 0,
            failure: 1
        }
    );
    let (mut n, _) = ni(0, 64);
    let mut e = entry(&r, 0, 16, ME_ALL, 0, u64::MAX);
    e.uid = 42;
    n.append(0, e, List::Priority, 0).unwrap();
    assert_eq!(n.deliver(&put(0, 0, b"no")).ni_fail, NiFail::PermViolation);
    assert_eq!(n.perm_violations, 1);
}

// ---------------------------------------------------------------- get, atomics, events

#[test]
fn get_atomic_fetch_and_swap_at_the_target() {
    let (mut n, eq) = ni(0, 64);
    let r = region(64);
    r.write(0, &10u64.to_le_bytes()).unwrap();
    n.append(0, entry(&r, 0, 64, ME_ALL, 0, u64::MAX), List::Priority, 0)
        .unwrap();
    let get = Request {
        kind: ReqKind::Get,
        rlength: 8,
        ..put(0, 0, &[])
    };
    assert_eq!(n.deliver(&get).data, 10u64.to_le_bytes());
    let five = 5u64.to_le_bytes();
    let add = Request {
        kind: ReqKind::Atomic(AtomicOp::Sum, Datatype::Uint64),
        ..put(0, 0, &five)
    };
    assert!(n.deliver(&add).data.is_empty());
    let fetch = Request {
        kind: ReqKind::FetchAtomic(AtomicOp::Sum, Datatype::Uint64),
        ..put(0, 0, &five)
    };
    assert_eq!(n.deliver(&fetch).data, 15u64.to_le_bytes());
    let new = 99u64.to_le_bytes();
    let cmp = 20u64.to_le_bytes();
    let cswap = Request {
        kind: ReqKind::Swap(AtomicOp::Cswap, Datatype::Uint64),
        operand: &cmp,
        ..put(0, 0, &new)
    };
    assert_eq!(n.deliver(&cswap).data, 20u64.to_le_bytes());
    assert_eq!(r.to_vec(0, 8), 99u64.to_le_bytes());
    let ev: Vec<_> = kinds(&mut n, eq);
    assert_eq!(
        ev,
        [
            EventKind::Link,
            EventKind::Get,
            EventKind::Atomic,
            EventKind::FetchAtomic,
            EventKind::FetchAtomic
        ]
    );
    let bad = Request {
        kind: ReqKind::Atomic(AtomicOp::Bxor, Datatype::Double),
        ..put(0, 0, &five)
    };
    assert_eq!(
        n.deliver(&bad).ni_fail,
        NiFail::OpViolation,
        "BXOR is not defined on DOUBLE"
    );
}

/// A long get is answered from the entry's memory as its reply goes out: nothing is copied at
/// delivery, and its GET event, counting event and auto-unlink event wait until the reply was
/// read to its end (a process told its memory was read may change it), failing if it was not.
#[test]
fn a_streamed_get_holds_its_events_until_the_reply_was_read() {
    let (mut n, eq) = ni(0, 64);
    n.stream_gets_from = Some(100);
    let r = region(4096);
    r.write(1000, &[7; 300]).unwrap();
    let ct = n.ct_alloc().unwrap();
    let opts = ME_ALL | me::USE_ONCE | me::EVENT_CT_COMM | me::EVENT_CT_BYTES;
    for bits in [1, 2] {
        let mut e = entry(&r, 1000, 300, opts, bits, 0);
        e.ct = Some(ct);
        n.append(0, e, List::Priority, 0).unwrap();
    }
    let _ = kinds(&mut n, eq);
    let get = |bits, rlength| Request {
        kind: ReqKind::Get,
        rlength,
        ..put(0, bits, &[])
    };
    // Shorter than the threshold: copied at once, events at once.
    let resp = n.deliver(&get(1, 99));
    assert_eq!(
        (resp.data, n.take_get_stream().is_none()),
        (vec![7; 99], true)
    );
    assert_eq!(kinds(&mut n, eq), [EventKind::Get, EventKind::AutoUnlink]);
    assert_eq!(n.ct_get(ct).unwrap().success, 99);
    // Long enough: a stream over the entry's bytes, and no event yet.
    let resp = n.deliver(&get(2, 300));
    assert_eq!(
        (resp.ni_fail, resp.mlength, resp.data.len()),
        (NiFail::Ok, 300, 0)
    );
    let s = n.take_get_stream().expect("streamed");
    assert_eq!((s.at, s.len), (1000, 300));
    let mut bytes = Vec::new();
    s.region
        .append_to(s.at, s.len as usize, &mut bytes)
        .unwrap();
    assert_eq!(bytes, [7; 300]);
    assert!(
        kinds(&mut n, eq).is_empty(),
        "held back while the reply streams"
    );
    assert_eq!(n.ct_get(ct).unwrap().success, 99);
    n.streamed(s.token, NiFail::Ok);
    let ev = events(&mut n, eq);
    assert_eq!(
        ev.iter()
            .map(|e| (e.kind, e.mlength, e.ni_fail))
            .collect::<Vec<_>>(),
        [
            (EventKind::Get, 300, NiFail::Ok),
            (EventKind::AutoUnlink, 0, NiFail::Ok)
        ]
    );
    assert_eq!(n.ct_get(ct).unwrap().success, 399);
    n.streamed(s.token, NiFail::Ok);
    assert!(kinds(&mut n, eq).is_empty(), "a token ends once");
    // A stream that could not be read to its end fails its event and counts a failure.
    let mut e = entry(&r, 1000, 300, ME_ALL | me::EVENT_CT_COMM, 3, 0);
    e.ct = Some(ct);
    n.append(0, e, List::Priority, 0).unwrap();
    let _ = kinds(&mut n, eq);
    n.deliver(&get(3, 200));
    let s = n.take_get_stream().expect("streamed");
    n.streamed(s.token, NiFail::Segv);
    let ev = events(&mut n, eq);
    assert_eq!(
        (ev.len(), ev[0].kind, ev[0].ni_fail),
        (1, EventKind::Get, NiFail::Segv)
    );
    assert_eq!(n.ct_get(ct).unwrap().failure, 1);
}

#[test]
fn a_put_in_fragments_matches_on_its_first_and_streams_behind_it() {
    let (mut n, eq) = ni(0, 64);
    let r = region(1000);
    let ct = n.ct_alloc().unwrap();
    let mut e = entry(
        &r,
        100,
        300,
        ME_ALL | me::USE_ONCE | me::EVENT_CT_COMM,
        1,
        0,
    );
    e.ct = Some(ct);
    n.append(0, e, List::Priority, 0).unwrap();
    let _ = kinds(&mut n, eq);
    // The first 64 of 500 bytes: matched now (truncated to the entry's 300), written, and
    // every event held back.
    let first = Request {
        rlength: 500,
        ..put(0, 1, &[5; 64])
    };
    let resp = n.deliver_first(&first).expect("a priority entry takes it");
    assert_eq!((resp.ni_fail, resp.mlength), (NiFail::Ok, 300));
    let s = n.take_put_stream().expect("streamed");
    assert_eq!((s.at, s.len), (100, 300));
    assert_eq!(r.to_vec(100, 64), vec![5; 64]);
    assert!(
        kinds(&mut n, eq).is_empty(),
        "held back while the data comes"
    );
    assert_eq!(n.ct_get(ct).unwrap().success, 0);
    // The entry was used up at the match: a second message does not find it.
    assert!(n.deliver_first(&put(0, 1, &[1; 8])).is_none());
    n.streamed(s.token, NiFail::Ok);
    let ev = events(&mut n, eq);
    assert_eq!(
        ev.iter()
            .map(|e| (e.kind, e.mlength, e.rlength, e.start))
            .collect::<Vec<_>>(),
        [
            (EventKind::Put, 300, 500, 100),
            (EventKind::AutoUnlink, 0, 0, 0)
        ]
    );
    assert_eq!(n.ct_get(ct).unwrap().success, 1);

    // A stream that could not be written to its end fails its event.
    n.append(0, entry(&r, 0, 1000, ME_ALL, 2, 0), List::Priority, 0)
        .unwrap();
    let _ = kinds(&mut n, eq);
    n.deliver_first(&put(0, 2, &[1; 8])).unwrap();
    let s = n.take_put_stream().unwrap();
    n.streamed(s.token, NiFail::Segv);
    let ev = events(&mut n, eq);
    assert_eq!((ev[0].kind, ev[0].ni_fail), (EventKind::Put, NiFail::Segv));
}

#[test]
fn a_put_in_fragments_without_a_priority_entry_is_left_whole_and_unchanged() {
    // Only an overflow entry: its unexpected header must describe a whole message, so the
    // first fragment changes nothing and the message is delivered once put together.
    let (mut n, eq) = ni(0, 64);
    let r = region(64);
    n.append(0, entry(&r, 0, 64, ME_ALL, 0, u64::MAX), List::Overflow, 0)
        .unwrap();
    let _ = kinds(&mut n, eq);
    let first = Request {
        rlength: 32,
        ..put(0, 0, &[9; 16])
    };
    assert!(n.deliver_first(&first).is_none());
    assert!(n.take_put_stream().is_none());
    assert!(kinds(&mut n, eq).is_empty());
    assert_eq!(r.to_vec(0, 16), vec![0; 16], "nothing written");
    assert_eq!(n.deliver(&put(0, 0, &[9; 32])).ni_fail, NiFail::Ok);
    assert_eq!(kinds(&mut n, eq), [EventKind::Put]);
    // Gets are never streamed in; a portal that would turn to flow control is not either.
    let get = Request {
        kind: ReqKind::Get,
        ..put(0, 0, &[])
    };
    assert!(n.deliver_first(&get).is_none());
    let (mut f, _) = ni(pt::FLOWCTRL, 4);
    assert!(f.deliver_first(&put(0, 0, b"x")).is_none());
    assert!(f.pt_enabled(0).unwrap(), "no flow control for a fragment");
}

#[test]
fn the_next_atomic_is_guessed_where_the_last_one_matched() {
    let (mut n, _) = ni(0, 64);
    let r = region(64);
    n.append(0, entry(&r, 16, 32, ME_ALL, 0, u64::MAX), List::Priority, 0)
        .unwrap();
    assert_eq!(n.atomic_guess(0, 8), None, "no atomic yet");
    let one = 1u64.to_le_bytes();
    let add = Request {
        kind: ReqKind::Atomic(AtomicOp::Sum, Datatype::Uint64),
        remote_offset: 8,
        ..put(0, 0, &one)
    };
    assert_eq!(n.deliver(&add).ni_fail, NiFail::Ok);
    let base = r.mapped_at(0, 64).unwrap() as usize;
    assert_eq!(n.atomic_guess(0, 24), Some(base + 16 + 24));
    assert_eq!(n.atomic_guess(0, 32), None, "past the entry");
    assert_eq!(n.atomic_guess(1, 8), None, "another portal");
}

#[test]
fn event_disable_options_and_counting_events() {
    let (mut n, eq) = ni(0, 64);
    let r = region(64);
    let (c1, c2) = (n.ct_alloc().unwrap(), n.ct_alloc().unwrap());
    let mut e = entry(
        &r,
        0,
        64,
        ME_ALL | me::EVENT_COMM_DISABLE | me::EVENT_LINK_DISABLE | me::EVENT_CT_COMM,
        1,
        0,
    );
    e.ct = Some(c1);
    n.append(0, e, List::Priority, 0).unwrap();
    let mut e = entry(
        &r,
        0,
        64,
        ME_ALL | me::EVENT_SUCCESS_DISABLE | me::EVENT_CT_COMM | me::EVENT_CT_BYTES,
        2,
        0,
    );
    e.ct = Some(c2);
    n.append(0, e, List::Priority, 0).unwrap();
    n.deliver(&put(0, 1, b"abc"));
    n.deliver(&put(0, 1, b"abc"));
    n.deliver(&put(0, 2, b"abcde"));
    assert_eq!(
        kinds(&mut n, eq),
        [EventKind::Link],
        "only the second entry's link event"
    );
    assert_eq!(n.ct_get(c1).unwrap().success, 2, "counts events");
    assert_eq!(n.ct_get(c2).unwrap().success, 5, "counts bytes");
    n.ct_set(c1, CtEvent::default()).unwrap();
    n.ct_inc(
        c1,
        CtEvent {
            success: 3,
            failure: 0,
        },
    )
    .unwrap();
    assert_eq!(n.ct_get(c1).unwrap().success, 3);
}

#[test]
fn ack_disable_is_reported_to_the_initiator() {
    let (mut n, _) = ni(0, 64);
    n.append(
        0,
        entry(&region(8), 0, 8, ME_ALL | me::ACK_DISABLE, 0, u64::MAX),
        List::Priority,
        0,
    )
    .unwrap();
    assert!(!n.deliver(&put(0, 0, b"x")).ack);
}

#[test]
fn full_event_queue_reports_dropped_events() {
    let (mut n, eq) = ni(0, 3);
    n.append(
        0,
        entry(&region(64), 0, 64, ME_ALL, 0, u64::MAX),
        List::Priority,
        0,
    )
    .unwrap();
    for _ in 0..5 {
        assert_eq!(
            n.deliver(&put(0, 0, b"x")).ni_fail,
            NiFail::Ok,
            "no flow control: delivery goes on"
        );
    }
    assert!(n.eq_get(eq).unwrap().1, "PTL_EQ_DROPPED");
    assert!(!n.eq_get(eq).unwrap().1);
}

// ---------------------------------------------------------------- flow control

#[test]
fn flow_control_disables_the_entry_and_recovery_reenables_it() {
    let (mut n, eq) = ni(pt::FLOWCTRL, 64);
    let r = region(64);
    // No entry at all: resources exhausted.
    assert_eq!(n.deliver(&put(0, 0, b"x")).ni_fail, NiFail::PtDisabled);
    assert!(!n.pt_enabled(0).unwrap());
    let ev = events(&mut n, eq);
    assert_eq!(
        (ev[0].kind, ev[0].ni_fail),
        (EventKind::PtDisabled, NiFail::PtDisabled)
    );
    // While disabled, everything fails the same way, without more events.
    n.append(0, entry(&r, 0, 64, ME_ALL, 0, u64::MAX), List::Overflow, 0)
        .unwrap();
    events(&mut n, eq);
    assert_eq!(n.deliver(&put(0, 0, b"x")).ni_fail, NiFail::PtDisabled);
    assert!(events(&mut n, eq).is_empty());
    // Recovery: resources re-posted, entry re-enabled.
    n.pt_enable(0).unwrap();
    assert_eq!(n.deliver(&put(0, 0, b"y")).ni_fail, NiFail::Ok);
}

#[test]
fn flow_control_on_a_nearly_full_event_queue() {
    let (mut n, eq) = ni(pt::FLOWCTRL, 4);
    n.append(
        0,
        entry(&region(64), 0, 64, ME_ALL, 0, u64::MAX),
        List::Priority,
        0,
    )
    .unwrap();
    let mut fails = 0;
    for _ in 0..5 {
        if n.deliver(&put(0, 0, b"x")).ni_fail == NiFail::PtDisabled {
            fails += 1;
        }
    }
    assert!(fails >= 1);
    let ev = events(&mut n, eq);
    assert_eq!(
        ev.last().unwrap().kind,
        EventKind::PtDisabled,
        "the disable event always fits"
    );
    assert_eq!(ev.len(), 4);
}

#[test]
fn flow_control_when_unexpected_headers_run_out() {
    let limits = Limits {
        max_unexpected_headers: 2,
        ..Limits::default()
    };
    let mut n = PortalsNi::new(true, limits);
    let eq = n.eq_alloc(64).unwrap();
    n.pt_alloc(pt::FLOWCTRL, Some(eq), Some(0)).unwrap();
    n.append(
        0,
        entry(&region(64), 0, 64, ME_ALL | me::MANAGE_LOCAL, 0, u64::MAX),
        List::Overflow,
        0,
    )
    .unwrap();
    assert_eq!(n.deliver(&put(0, 0, b"1")).ni_fail, NiFail::Ok);
    assert_eq!(n.deliver(&put(0, 0, b"2")).ni_fail, NiFail::Ok);
    assert_eq!(n.deliver(&put(0, 0, b"3")).ni_fail, NiFail::PtDisabled);
}

// ---------------------------------------------------------------- interfaces and bad input

#[test]
fn non_matching_interface_list_entries_take_every_message() {
    let mut n = PortalsNi::new(false, Limits::default());
    let eq = n.eq_alloc(8).unwrap();
    n.pt_alloc(0, Some(eq), None).unwrap();
    let r = region(8);
    let mut e = entry(&r, 0, 8, ME_ALL, 1, 0);
    e.match_id = rank(77);
    n.append(0, e, List::Priority, 0).unwrap();
    assert_eq!(
        n.deliver(&put(0, 0xffff, b"le")).ni_fail,
        NiFail::Ok,
        "bits and ids do not matter"
    );
}

#[test]
fn a_refused_one_way_append_is_reported_by_a_failed_link_event() {
    let limits = Limits {
        max_list_size: 1,
        ..Limits::default()
    };
    let mut n = PortalsNi::new(true, limits);
    let eq = n.eq_alloc(8).unwrap();
    n.pt_alloc(0, Some(eq), Some(0)).unwrap();
    let r = region(16);
    let quiet = ME_ALL | me::EVENT_LINK_DISABLE;
    n.append_oneway(0, entry(&r, 0, 16, quiet, 1, 0), List::Priority, 10)
        .unwrap();
    assert!(events(&mut n, eq).is_empty(), "a linked entry stays quiet");
    n.append_oneway(0, entry(&r, 0, 16, quiet, 2, 0), List::Priority, 11)
        .unwrap();
    n.append_oneway(0, entry(&r, 8, 16, quiet, 3, 0), List::Overflow, 12)
        .unwrap();
    let got: Vec<_> = events(&mut n, eq)
        .iter()
        .map(|e| (e.kind, e.user_ptr, e.ni_fail))
        .collect();
    assert_eq!(
        got,
        [
            (EventKind::Link, 11, NiFail::NoSpace),
            (EventKind::Link, 12, NiFail::ArgInvalid)
        ],
        "a full list, then an entry past its region's end"
    );
    assert_eq!(
        n.deliver(&put(0, 1, b"x")).ni_fail,
        NiFail::Ok,
        "the linked entry works"
    );
    assert_eq!(
        n.append_oneway(5, entry(&r, 0, 16, quiet, 1, 0), List::Priority, 0),
        Err(PtlError::ArgInvalid),
        "no portal, no queue to report on: the caller hears it"
    );
}

#[test]
fn bad_arguments_get_the_specified_return_codes() {
    let mut n = PortalsNi::new(true, Limits::default());
    let eq = n.eq_alloc(8).unwrap();
    let r = region(16);
    assert_eq!(
        n.pt_alloc(pt::FLOWCTRL, None, None),
        Err(PtlError::PtEqNeeded)
    );
    assert_eq!(
        n.pt_alloc(0, Some(eq ^ 0x0100_0000), None),
        Err(PtlError::ArgInvalid),
        "stale EQ handle"
    );
    assert_eq!(
        n.pt_alloc(0, Some(eq), Some(10_000)),
        Err(PtlError::ArgInvalid)
    );
    assert_eq!(
        n.pt_alloc(1 << 9, Some(eq), None),
        Err(PtlError::ArgInvalid),
        "unknown option"
    );
    assert_eq!(n.pt_alloc(0, Some(eq), Some(5)), Ok(5));
    assert_eq!(n.pt_alloc(0, Some(eq), Some(5)), Err(PtlError::PtInUse));
    assert_eq!(
        n.pt_alloc(0, Some(eq), None),
        Ok(0),
        "PTL_PT_ANY takes the first free index"
    );
    assert_eq!(
        n.append(7, entry(&r, 0, 16, ME_ALL, 0, 0), List::Priority, 0),
        Err(PtlError::ArgInvalid)
    );
    assert_eq!(
        n.append(5, entry(&r, 8, 16, ME_ALL, 0, 0), List::Priority, 0),
        Err(PtlError::ArgInvalid),
        "past the region"
    );
    let h = n
        .append(5, entry(&r, 0, 16, ME_ALL, 0, 0), List::Priority, 0)
        .unwrap();
    assert_eq!(n.pt_free(5), Err(PtlError::PtInUse));
    assert_eq!(n.eq_free(eq), Err(PtlError::InUse));
    n.unlink(h).unwrap();
    assert_eq!(n.unlink(h), Err(PtlError::ArgInvalid));
    n.pt_free(5).unwrap();
    assert_eq!(n.pt_free(5), Err(PtlError::ArgInvalid));
    assert_eq!(
        n.deliver(&put(5, 0, b"x")).ni_fail,
        NiFail::Dropped,
        "freed index"
    );
    assert_eq!(n.ct_get(12345), Err(PtlError::ArgInvalid));
    let mut once = PortalsNi::new(true, Limits::default());
    let q = once.eq_alloc(8).unwrap();
    once.pt_alloc(pt::ONLY_USE_ONCE | pt::ONLY_TRUNCATE, Some(q), Some(0))
        .unwrap();
    assert_eq!(
        once.append(0, entry(&r, 0, 16, ME_ALL, 0, 0), List::Priority, 0),
        Err(PtlError::ArgInvalid)
    );
    assert_eq!(
        once.append(
            0,
            entry(&r, 0, 16, ME_ALL | me::USE_ONCE | me::NO_TRUNCATE, 0, 0),
            List::Priority,
            0
        ),
        Err(PtlError::ArgInvalid)
    );
    let small = Limits {
        max_list_size: 1,
        max_eqs: 1,
        ..Limits::default()
    };
    let mut lim = PortalsNi::new(true, small);
    let q = lim.eq_alloc(8).unwrap();
    assert_eq!(lim.eq_alloc(8), Err(PtlError::NoSpace));
    lim.pt_alloc(0, Some(q), Some(0)).unwrap();
    lim.append(0, entry(&r, 0, 16, ME_ALL, 0, 0), List::Priority, 0)
        .unwrap();
    assert_eq!(
        lim.append(0, entry(&r, 0, 16, ME_ALL, 0, 0), List::Priority, 0),
        Err(PtlError::ListTooLong)
    );
}

mod hostile {
    use super::*;
    use proptest::prelude::*;

    fn kind(k: u8, op: u8, dt: u8) -> ReqKind {
        let op = AtomicOp::from_u8(op % 18).unwrap();
        let dt = Datatype::from_u8(dt % 12).unwrap();
        match k % 5 {
            0 => ReqKind::Put,
            1 => ReqKind::Get,
            2 => ReqKind::Atomic(op, dt),
            3 => ReqKind::FetchAtomic(op, dt),
            _ => ReqKind::Swap(op, dt),
        }
    }

    proptest! {
        /// Whatever a peer sends, delivery neither panics nor reports more than it could hold.
        #[test]
        fn random_requests_never_panic(
            reqs in proptest::collection::vec(
                (any::<u8>(), any::<u8>(), any::<u8>(), 0u32..4, any::<u64>(), any::<u64>(), any::<u64>(),
                 proptest::collection::vec(any::<u8>(), 0..80), proptest::collection::vec(any::<u8>(), 0..20)),
                1..40),
            opts in proptest::collection::vec(any::<u32>(), 3),
        ) {
            let mut n = PortalsNi::new(true, Limits { max_unexpected_headers: 8, ..Limits::default() });
            let eq = n.eq_alloc(16).unwrap();
            n.pt_alloc(pt::FLOWCTRL, Some(eq), Some(0)).unwrap();
            n.pt_alloc(0, Some(eq), Some(1)).unwrap();
            let r = region(64);
            for (i, o) in opts.iter().enumerate() {
                let mut e = entry(&r, (i * 8) as u64, 40, o & 0x1ffff, i as u64, 0xf0);
                e.min_free = (o >> 20) as u64 % 16;
                let list = if i == 2 { List::Overflow } else { List::Priority };
                let _ = n.append((i % 2) as u32, e, list, i as u64);
            }
            for (k, op, dt, pt_index, bits, off, rlen, data, operand) in reqs {
                let req = Request {
                    kind: kind(k, op, dt),
                    initiator: rank(1),
                    uid: 0,
                    pt_index,
                    match_bits: bits % 4,
                    remote_offset: off % 128,
                    rlength: rlen % 200,
                    hdr_data: 0,
                    data: &data,
                    operand: &operand,
                };
                let resp = n.deliver(&req);
                prop_assert!(resp.mlength <= 40 && resp.mlength <= req.rlength);
                prop_assert!(resp.data.len() as u64 <= resp.mlength);
                let _ = n.search(0, entry(&r, 0, 8, ME_ALL, bits % 4, 0), SearchOp::SearchDelete, 0);
                while n.eq_get(eq).is_ok() {}
                if !n.pt_enabled(0).unwrap() {
                    n.pt_enable(0).unwrap();
                }
            }
        }
    }
}

#[test]
fn a_catch_basin_takes_what_nothing_matched_without_unexpected_headers() {
    let (mut n, eq) = ni(0, 64);
    let r = region(64);
    let basin = me::OP_PUT | me::UNEXPECTED_HDR_DISABLE;
    n.append(0, entry(&r, 0, 0, basin, 0, u64::MAX), List::Overflow, 7)
        .unwrap();
    let resp = n.deliver(&put(0, 5, b"hello"));
    assert_eq!(
        (resp.ni_fail, resp.mlength),
        (NiFail::Ok, 0),
        "truncated to nothing"
    );
    assert_eq!(n.unexpected_len(0), 0, "no header kept");
    let ev = events(&mut n, eq);
    let ev = ev.last().unwrap();
    assert_eq!((ev.kind, ev.user_ptr, ev.rlength), (EventKind::Put, 7, 5));
    // A later priority entry finds nothing to take over (no PUT_OVERFLOW).
    n.append(0, entry(&r, 0, 64, ME_ALL, 0, u64::MAX), List::Priority, 8)
        .unwrap();
    assert!(kinds(&mut n, eq)
        .iter()
        .all(|k| *k != EventKind::PutOverflow));
    assert_eq!(n.deliver(&put(0, 5, b"hello")).mlength, 5);
}

/// What the daemon uses to decide whether an acknowledgement may wait for the target's answer:
/// a delivery with a full event (or a counting-event change) is noticed by the process, a
/// delivery into an entry with its events disabled is silent.
#[test]
fn notices_count_what_the_process_can_see() {
    let (mut n, _eq) = ni(0, 64);
    let r = region(128);
    n.append(0, entry(&r, 0, 64, ME_ALL, 1, 0), List::Priority, 1)
        .unwrap();
    let quiet = ME_ALL | me::EVENT_COMM_DISABLE | me::EVENT_LINK_DISABLE;
    n.append(0, entry(&r, 64, 64, quiet, 2, 0), List::Priority, 2)
        .unwrap();
    let before = n.notices();
    assert_eq!(n.deliver(&put(0, 2, b"silent")).ni_fail, NiFail::Ok);
    assert_eq!(n.notices(), before, "no event, no notice");
    assert_eq!(n.deliver(&put(0, 1, b"seen")).ni_fail, NiFail::Ok);
    assert_eq!(n.notices(), before + 1, "one PUT event");
    let ct = n.ct_alloc().unwrap();
    n.ct_inc(
        ct,
        CtEvent {
            success: 1,
            failure: 0,
        },
    )
    .unwrap();
    assert_eq!(n.notices(), before + 2, "a counting event moved");
}
