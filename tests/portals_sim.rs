//! Portals matching through host cores (the daemon's NIC) over the seeded lossy simulated
//! network, driven by the same Portals calls a client sends down its command ring: messages
//! between a pair of NIs are matched in the order they were sent, exactly once, whatever the
//! network loses, duplicates or reorders; fragmented messages arrive whole.

use softnic::nic::host::ANNOUNCE_MAX_BYTES;
use softnic::nic::memory::{HeapBacking, Perms, Region};
use softnic::nic::portals::initiator::md;
use softnic::nic::portals::types::{me, RANK_ANY};
use softnic::nic::portals::{AckReq, OpSpec, ProcessId, ReqKind};
use softnic::nic::portals::{EventKind, NiFail};
use softnic::nic::sim::SimCluster;
use softnic::shm::event_ring::{ring_bytes, CtSlot, EventRing, CT_SLOT_LEN};
use softnic::shm::ptl_call::{result_of, Buf, MeArgs, PtlCall};
use softnic::shm::{Command, CommandKind};
use softnic::transport::sim::SimConfig;
use softnic::transport::TransportConfig;

const EQ_COUNT: usize = 4096;

fn region(len: usize) -> Region {
    Region::new(HeapBacking::new(len), Perms::READ_WRITE)
}

/// One rank's process on a simulated host: its session, its registered memory, its calls.
struct Proc {
    host: u16,
    session: u64,
    next_req: u64,
}

impl Proc {
    fn new(c: &mut SimCluster, host: u16, rank: u32) -> Proc {
        let session = 10 + rank as u64;
        c.attach(host, session, 1, 99, rank, 2).unwrap();
        Proc {
            host,
            session,
            next_req: 1,
        }
    }

    fn register(&self, c: &mut SimCluster, r: &Region) -> u32 {
        c.register(self.host, self.session, r.clone()).unwrap()
    }

    fn submit(&mut self, c: &mut SimCluster, call: &PtlCall, oneway: bool) -> u64 {
        let mut inline = Vec::new();
        call.encode_into(&mut inline);
        let req = if oneway { 0 } else { self.next_req };
        self.next_req += 1;
        let cmd = Command {
            kind: CommandKind::Portals,
            client_req: req,
            len: inline.len() as u64,
            ..Default::default()
        };
        c.submit(self.host, self.session, cmd, &inline);
        req
    }

    /// A data movement (`trigger`: armed on a counting event), posted one-way.
    fn start(&mut self, c: &mut SimCluster, op: OpSpec, trigger: Option<(u32, u64)>) {
        self.submit(c, &PtlCall::Op { ni: 0, op, trigger }, true);
    }

    /// A call that returns a handle, run to its completion.
    fn call(&mut self, c: &mut SimCluster, call: PtlCall) -> u64 {
        let req = self.submit(c, &call, false);
        let s = self.session;
        c.run_until(1_000_000_000, |c| {
            c.completions(s).iter().any(|e| e.client_req == req)
        })
        .unwrap();
        let e = c
            .take_completions(s)
            .into_iter()
            .find(|e| e.client_req == req);
        let e = e.unwrap();
        result_of(e.status, e.value).unwrap_or_else(|err| panic!("{call:?}: {err:?}"))
    }

    fn eq(&mut self, c: &mut SimCluster) -> (u32, EventRing) {
        self.eq_of(c, EQ_COUNT)
    }

    /// An event queue of `count` events in a ring of this process's memory.
    fn eq_of(&mut self, c: &mut SimCluster, count: usize) -> (u32, EventRing) {
        let len = ring_bytes(count);
        let mem = region(len);
        let handle = self.register(c, &mem);
        let eq = self.call(
            c,
            PtlCall::EqAlloc {
                ni: 0,
                count: count as u32,
                ring: Buf {
                    region: handle,
                    offset: 0,
                    length: len as u64,
                },
            },
        );
        (eq as u32, EventRing::new(mem, 0, len as u64).unwrap())
    }

    fn append(
        &mut self,
        c: &mut SimCluster,
        buf: (u32, u64, u64),
        options: u32,
        bits: u64,
        user_ptr: u64,
    ) {
        self.call(
            c,
            PtlCall::Append {
                ni: 0,
                pt: 0,
                overflow: false,
                user_ptr,
                me: MeArgs {
                    buf: Buf {
                        region: buf.0,
                        offset: buf.1,
                        length: buf.2,
                    },
                    ct: None,
                    uid: u32::MAX,
                    options: me::OP_PUT | me::OP_GET | options,
                    match_id: (0, RANK_ANY, 0),
                    match_bits: bits,
                    ignore_bits: 0,
                    min_free: 0,
                },
            },
        );
    }
}

#[test]
fn matching_order_and_exactly_once_under_loss_duplication_reordering() {
    for seed in [1u64, 2, 3] {
        let mut c = lossy_pair(seed);
        let (mut i, mut t) = matching_pair(&mut c);
        let (teq, mut teq_ring) = t.eq(&mut c);
        t.pt_alloc(&mut c, 0, 0, Some(teq));
        // Bits 1: a packing buffer (locally managed): arrival order is visible in memory.
        let packed = region(8 * 400);
        let h = t.register(&mut c, &packed);
        t.append(&mut c, (h, 0, 8 * 400), me::MANAGE_LOCAL, 1, 0);
        // Bits 2: 50 use-once entries, each matched by the next message in order.
        let slots = region(8 * 50);
        let h = t.register(&mut c, &slots);
        for k in 0..50u64 {
            t.append(&mut c, (h, k * 8, 8), me::USE_ONCE, 2, k);
        }
        // Bits 4: a large buffer for a fragmented put and gets back.
        let big = region(20_000);
        let h = t.register(&mut c, &big);
        t.append(&mut c, (h, 0, 20_000), 0, 4, 0);

        let (ieq, mut ieq_ring) = i.eq(&mut c);
        let src = region(8 * 400 + 20_000);
        for k in 0..400u64 {
            src.write(k * 8, &k.to_le_bytes()).unwrap();
        }
        let pattern: Vec<u8> = (0..20_000u32).map(|x| (x * 7 % 251) as u8).collect();
        src.write(3200, &pattern).unwrap();
        let md_bind = |i: &mut Proc, c: &mut SimCluster, r: &Region| {
            let region = i.register(c, r);
            i.md_bind(c, region, r.len() as u64, 0, Some(ieq))
        };
        let md = md_bind(&mut i, &mut c, &src);
        let back = region(20_000);
        let gmd = md_bind(&mut i, &mut c, &back);
        let put = |bits, offset, length| OpSpec {
            kind: ReqKind::Put,
            ack_req: AckReq::Ack,
            md,
            offset,
            length,
            get_md: None,
            get_offset: 0,
            target: ProcessId::Physical { nid: 1, pid: 1 },
            pt_index: 0,
            match_bits: bits,
            remote_offset: 0,
            user_ptr: offset,
            hdr_data: 0,
            operand: Vec::new(),
            inline: Vec::new(),
        };
        for k in 0..300u64 {
            i.start(&mut c, put(1, k * 8, 8), None);
            if k < 50 {
                i.start(&mut c, put(2, k * 8, 8), None);
            }
        }
        i.start(&mut c, put(4, 3200, 20_000), None);
        for g in 0..10u64 {
            let get = OpSpec {
                kind: ReqKind::Get,
                get_md: Some(gmd),
                get_offset: g * 2000,
                remote_offset: g * 2000,
                ..put(4, 0, 2000)
            };
            i.start(&mut c, get, None);
        }
        let mut ievents = Vec::new();
        c.run_until(60_000_000_000, |c| {
            c.host_mut(0).unwrap().deliver_events();
            while let Some(e) = ieq_ring.pop() {
                ievents.push(e);
            }
            ievents
                .iter()
                .filter(|(e, _)| matches!(e.kind, EventKind::Ack | EventKind::Reply))
                .count()
                >= 361
        })
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));

        for k in 0..300u64 {
            assert_eq!(
                packed.to_vec(k * 8, 8),
                k.to_le_bytes(),
                "seed {seed}: put {k} packed in send order"
            );
        }
        for k in 0..50u64 {
            assert_eq!(
                slots.to_vec(k * 8, 8),
                k.to_le_bytes(),
                "seed {seed}: use-once entry {k} got message {k}"
            );
        }
        assert_eq!(
            big.to_vec(0, 20_000),
            &pattern[..],
            "seed {seed}: fragmented put whole"
        );
        assert_eq!(
            back.to_vec(0, 20_000),
            &pattern[..],
            "seed {seed}: gets back"
        );
        let mut acks = 0;
        let mut replies = 0;
        for (e, dropped) in ievents {
            assert!(!dropped);
            assert_eq!(e.ni_fail, NiFail::Ok);
            match e.kind {
                EventKind::Ack => acks += 1,
                EventKind::Reply => replies += 1,
                _ => {}
            }
        }
        assert_eq!(
            (acks, replies),
            (351, 10),
            "seed {seed}: every op completed exactly once"
        );
        let mut puts = 0;
        c.host_mut(1).unwrap().deliver_events();
        while let Some((e, _)) = teq_ring.pop() {
            if e.kind == EventKind::Put {
                puts += 1;
            }
        }
        assert_eq!(puts, 351, "seed {seed}: each put delivered once");
        assert_eq!(
            c.host(1).unwrap().stats.streamed_portals_puts,
            1,
            "seed {seed}: the fragmented put to a posted entry was written as it came"
        );
        assert!(
            c.net.stats.lost > 20 && c.net.stats.duplicated > 10 && c.net.stats.reordered > 10,
            "{:?}",
            c.net.stats
        );
    }
}

#[test]
fn a_put_cut_off_by_its_initiators_crash_fails_the_delivery_it_streamed_into() {
    // A window of four datagrams: the initiator has sent only the start of its put when it
    // crashes.
    let mut c = SimCluster::new(
        2,
        TransportConfig {
            window: 4,
            ..Default::default()
        },
        SimConfig {
            mtu: 1472,
            ..Default::default()
        },
    );
    let (mut i, mut t) = matching_pair(&mut c);
    let (teq, mut teq_ring) = t.eq(&mut c);
    t.pt_alloc(&mut c, 0, 0, Some(teq));
    let dst = region(100_000);
    let h = t.register(&mut c, &dst);
    t.append(&mut c, (h, 0, 100_000), me::USE_ONCE, 4, 7);
    let src = region(100_000);
    let sh = i.register(&mut c, &src);
    let md = i.md_bind(&mut c, sh, 100_000, 0, None);
    let put = OpSpec {
        kind: ReqKind::Put,
        ack_req: AckReq::Ack,
        md,
        offset: 0,
        length: 100_000,
        get_md: None,
        get_offset: 0,
        target: ProcessId::Physical { nid: 1, pid: 1 },
        pt_index: 0,
        match_bits: 4,
        remote_offset: 0,
        user_ptr: 0,
        hdr_data: 0,
        operand: Vec::new(),
        inline: Vec::new(),
    };
    i.start(&mut c, put, None);
    c.run_until(1_000_000_000, |c| {
        c.host(1).unwrap().stats.streamed_portals_puts == 1
    })
    .unwrap();
    c.host_mut(1).unwrap().deliver_events();
    let mut events = Vec::new();
    while let Some((e, _)) = teq_ring.pop() {
        events.push(e);
    }
    assert!(
        events.iter().all(|e| e.kind != EventKind::Put),
        "no PUT event before the last byte: {events:?}"
    );
    c.crash(0);
    c.run_for(50_000_000);
    c.restart(0);
    c.run_until(1_000_000_000, |c| {
        c.host_mut(1).unwrap().deliver_events();
        while let Some((e, _)) = teq_ring.pop() {
            events.push(e);
        }
        events.iter().any(|e| e.kind == EventKind::Put)
    })
    .expect("the held PUT event is posted once the initiator is known gone");
    let put = events.iter().find(|e| e.kind == EventKind::Put).unwrap();
    assert_eq!(
        (put.ni_fail, put.user_ptr, put.rlength),
        (NiFail::Undeliverable, 7, 100_000)
    );
}

/// The cluster of the conduit tests: two hosts, 30% loss, 20% duplication and reordering.
fn lossy_pair(seed: u64) -> SimCluster {
    SimCluster::new(
        2,
        TransportConfig {
            peer_timeout: 60_000_000_000,
            ..Default::default()
        },
        SimConfig {
            seed,
            loss: 0.3,
            duplicate: 0.2,
            reorder: 0.2,
            mtu: 1472,
            ..Default::default()
        },
    )
}

/// Two hosts on a network that loses nothing.
fn clean_pair(seed: u64) -> SimCluster {
    SimCluster::new(
        2,
        TransportConfig::default(),
        SimConfig {
            seed,
            ..Default::default()
        },
    )
}

/// Rank 0 on host 0 (the initiator) and rank 1 on host 1 (the target), each with a matching
/// interface 0.
fn matching_pair(c: &mut SimCluster) -> (Proc, Proc) {
    let mut i = Proc::new(c, 0, 0);
    let mut t = Proc::new(c, 1, 1);
    for p in [&mut i, &mut t] {
        p.call(
            c,
            PtlCall::NiInit {
                ni: 0,
                matching: true,
            },
        );
    }
    (i, t)
}

impl Proc {
    /// PtlPTAlloc of portal `index` with `options`, its events to `eq`.
    fn pt_alloc(&mut self, c: &mut SimCluster, index: u32, options: u32, eq: Option<u32>) {
        self.call(
            c,
            PtlCall::PtAlloc {
                ni: 0,
                options,
                eq,
                index: Some(index),
            },
        );
    }

    /// PtlMDBind over the first `len` bytes of registered `region`.
    fn md_bind(
        &mut self,
        c: &mut SimCluster,
        region: u32,
        len: u64,
        options: u32,
        eq: Option<u32>,
    ) -> u32 {
        self.call(
            c,
            PtlCall::MdBind {
                ni: 0,
                region,
                segments: vec![(0, len)],
                options,
                eq,
                ct: None,
            },
        ) as u32
    }

    /// A counting event in this process's memory.
    fn ct(&mut self, c: &mut SimCluster) -> (u32, CtSlot) {
        let mem = region(CT_SLOT_LEN as usize);
        let handle = self.register(c, &mem);
        let slot = Buf {
            region: handle,
            offset: 0,
            length: CT_SLOT_LEN,
        };
        let ct = self.call(c, PtlCall::CtAlloc { ni: 0, slot });
        (ct as u32, CtSlot::new(mem, 0).unwrap())
    }

    /// PtlMEAppend of `me` on portal `pt`.
    fn append_me(
        &mut self,
        c: &mut SimCluster,
        pt: u32,
        overflow: bool,
        me: MeArgs,
        user_ptr: u64,
    ) {
        self.call(
            c,
            PtlCall::Append {
                ni: 0,
                pt,
                overflow,
                user_ptr,
                me,
            },
        );
    }
}

/// A match entry of the conduit's AM portal: `len` bytes of `region`, any sender, bits 7.
fn am_entry(region: u32, len: u64, options: u32, min_free: u64, ct: Option<u32>) -> MeArgs {
    MeArgs {
        buf: Buf {
            region,
            offset: 0,
            length: len,
        },
        ct,
        uid: u32::MAX,
        options: me::OP_PUT | options,
        match_id: (0, RANK_ANY, 0),
        match_bits: 7,
        ignore_bits: 0,
        min_free,
    }
}

/// `n` Active-Message-like requests of `len` bytes from the initiator's MD (request k from
/// offset k·len, `hdr_data` = `user_ptr` = k) to portal `pt` of rank 1, each asking for an ACK;
/// runs until every one is acknowledged and returns the ACK events by request.
fn send_requests(
    c: &mut SimCluster,
    i: &mut Proc,
    ieq: &mut EventRing,
    md: u32,
    pt: u32,
    ks: &[u64],
    len: u64,
) -> Vec<(u64, softnic::nic::portals::Event)> {
    for &k in ks {
        let op = OpSpec {
            kind: ReqKind::Put,
            ack_req: AckReq::Ack,
            md,
            offset: k * len,
            length: len,
            get_md: None,
            get_offset: 0,
            target: ProcessId::Physical { nid: 1, pid: 1 },
            pt_index: pt,
            match_bits: 7,
            remote_offset: 0,
            user_ptr: k,
            hdr_data: k,
            operand: Vec::new(),
            inline: Vec::new(),
        };
        let call = PtlCall::Op {
            ni: 0,
            op,
            trigger: None,
        };
        i.submit(c, &call, true);
    }
    let mut acks = Vec::new();
    c.run_until(60_000_000_000, |c| {
        c.host_mut(0).unwrap().deliver_events();
        while let Some((e, dropped)) = ieq.pop() {
            assert!(!dropped);
            if e.kind == EventKind::Ack {
                acks.push((e.user_ptr, e));
            }
        }
        acks.len() >= ks.len()
    })
    .unwrap();
    acks
}

/// The NIC side of the GASNet portals conduit, through host cores under 30% loss and 20%
/// duplication and reordering: requests pack into two locally managed receive buffers (ReqRB,
/// `min_free`) that unlink themselves when full, then fall into the catch-basin (an overflow
/// entry that truncates to nothing, keeps no header and only counts); on a flow-controlled
/// portal whose event queue fills, the entry is disabled and the rest fail PT_DISABLED, and
/// after PtlPTEnable the resent requests land. Every request is acknowledged exactly once
/// with the outcome its arrival order implies, and lands at most once.
#[test]
fn conduit_am_portal_packing_catch_basin_and_flow_control_under_loss() {
    const LEN: u64 = 100;
    const N: u64 = 60;
    for seed in [4u64, 5, 6] {
        let mut c = lossy_pair(seed);
        let (mut i, mut t) = matching_pair(&mut c);
        let (ieq, mut ieq_ring) = i.eq(&mut c);
        let src = region((N * LEN) as usize);
        for k in 0..N {
            src.write(k * LEN, &[k as u8; LEN as usize]).unwrap();
        }
        let src_h = i.register(&mut c, &src);
        let md = i.md_bind(&mut c, src_h, N * LEN, 0, Some(ieq));

        // Portal 0: the AM portal with two ReqRBs of 1024 bytes, min_free 256 (8 requests
        // each), and the catch-basin behind them.
        let (teq, mut teq_ring) = t.eq_of(&mut c, 64);
        t.pt_alloc(
            &mut c,
            0,
            softnic::nic::portals::types::pt::FLOWCTRL,
            Some(teq),
        );
        let rb = region(2048);
        let rb_h = t.register(&mut c, &rb);
        for b in 0..2u64 {
            let mut e = am_entry(
                rb_h,
                1024,
                me::MANAGE_LOCAL | me::EVENT_LINK_DISABLE,
                256,
                None,
            );
            e.buf.offset = b * 1024;
            t.append_me(&mut c, 0, false, e, 100 + b);
        }
        let (basin_ct, basin) = t.ct(&mut c);
        let basin_opts = me::UNEXPECTED_HDR_DISABLE
            | me::EVENT_COMM_DISABLE
            | me::EVENT_CT_COMM
            | me::EVENT_LINK_DISABLE;
        let basin_me = am_entry(rb_h, 0, basin_opts, 0, Some(basin_ct));
        t.append_me(&mut c, 0, true, basin_me, 200);

        let ks: Vec<u64> = (0..N).collect();
        let acks = send_requests(&mut c, &mut i, &mut ieq_ring, md, 0, &ks, LEN);
        let got: Vec<u64> = acks.iter().map(|a| a.0).collect();
        assert_eq!(got, ks, "seed {seed}: one ACK per request, in order");
        for (k, e) in &acks {
            assert_eq!(e.ni_fail, NiFail::Ok, "seed {seed}: request {k}");
            let want = if *k < 16 { LEN } else { 0 };
            assert_eq!(
                e.mlength, want,
                "seed {seed}: request {k} packed or truncated"
            );
        }
        for k in 0..16u64 {
            assert_eq!(
                rb.to_vec(k / 8 * 1024 + k % 8 * LEN, LEN as usize),
                [k as u8; LEN as usize]
            );
        }
        assert_eq!(
            basin.load().success,
            N - 16,
            "seed {seed}: the basin counted the rest"
        );
        c.host_mut(1).unwrap().deliver_events();
        let mut puts = Vec::new();
        let mut unlinks = 0;
        while let Some((e, dropped)) = teq_ring.pop() {
            assert!(!dropped);
            match e.kind {
                EventKind::Put => puts.push(e.hdr_data),
                EventKind::AutoUnlink => unlinks += 1,
                k => panic!("seed {seed}: unexpected {k:?}"),
            }
        }
        assert_eq!(
            puts,
            (0..16).collect::<Vec<_>>(),
            "seed {seed}: one PUT per packed request"
        );
        assert_eq!(unlinks, 2, "seed {seed}: both ReqRBs unlinked themselves");

        // Portal 1: flow-controlled, an event queue of 16 and one roomy buffer; the queue
        // fills, the entry is disabled, the rest fail; enabled again, the failed ones land.
        let (feq, mut feq_ring) = t.eq_of(&mut c, 16);
        t.pt_alloc(
            &mut c,
            1,
            softnic::nic::portals::types::pt::FLOWCTRL,
            Some(feq),
        );
        let big = region((N * LEN) as usize);
        let big_h = t.register(&mut c, &big);
        let e = am_entry(
            big_h,
            N * LEN,
            me::MANAGE_LOCAL | me::EVENT_LINK_DISABLE,
            0,
            None,
        );
        t.append_me(&mut c, 1, false, e, 300);
        let acks = send_requests(&mut c, &mut i, &mut ieq_ring, md, 1, &ks, LEN);
        let landed: Vec<u64> = acks
            .iter()
            .filter(|(_, e)| e.ni_fail == NiFail::Ok)
            .map(|a| a.0)
            .collect();
        let failed: Vec<u64> = acks
            .iter()
            .filter(|(_, e)| e.ni_fail == NiFail::PtDisabled)
            .map(|a| a.0)
            .collect();
        let m = landed.len() as u64;
        assert!(
            m > 0 && m < N,
            "seed {seed}: {m} landed before flow control"
        );
        assert_eq!(
            landed,
            (0..m).collect::<Vec<_>>(),
            "seed {seed}: a prefix landed"
        );
        assert_eq!(
            failed,
            (m..N).collect::<Vec<_>>(),
            "seed {seed}: the rest failed"
        );
        // As the conduit does: handle the events, enable the entry, send the failed ones
        // again; each round lands a prefix of them until the queue fills once more.
        let mut failed = failed;
        for round in 0.. {
            assert!(round < 10, "seed {seed}: still failing: {failed:?}");
            c.host_mut(1).unwrap().deliver_events();
            let mut events = Vec::new();
            while let Some((e, _)) = feq_ring.pop() {
                events.push(e.kind);
            }
            assert_eq!(
                events.last(),
                Some(&EventKind::PtDisabled),
                "seed {seed}: {events:?}"
            );
            t.call(
                &mut c,
                PtlCall::PtEnable {
                    ni: 0,
                    index: 1,
                    enable: true,
                },
            );
            let again = send_requests(&mut c, &mut i, &mut ieq_ring, md, 1, &failed, LEN);
            let n_ok = again
                .iter()
                .take_while(|(_, e)| e.ni_fail == NiFail::Ok)
                .count();
            assert!(
                n_ok > 0,
                "seed {seed}: an enabled entry took none of {again:?}"
            );
            assert!(
                again[n_ok..]
                    .iter()
                    .all(|(_, e)| e.ni_fail == NiFail::PtDisabled),
                "seed {seed}: {again:?}"
            );
            failed = failed[n_ok..].to_vec();
            if failed.is_empty() {
                break;
            }
        }
        for k in 0..N {
            assert_eq!(
                big.to_vec(k * LEN, LEN as usize),
                [k as u8; LEN as usize],
                "seed {seed}: request {k} packed once, in order"
            );
        }
        assert!(
            c.net.stats.lost > 10 && c.net.stats.duplicated > 5,
            "{:?}",
            c.net.stats
        );
    }
}

/// An 8-byte put from offset 0 of `md` to portal 0, match bits 1, of rank `nid` (on host
/// `nid`).
fn put8(md: u32, nid: u32, ack_req: AckReq) -> OpSpec {
    OpSpec {
        kind: ReqKind::Put,
        ack_req,
        md,
        offset: 0,
        length: 8,
        get_md: None,
        get_offset: 0,
        target: ProcessId::Physical { nid, pid: nid },
        pt_index: 0,
        match_bits: 1,
        remote_offset: 0,
        user_ptr: 0,
        hdr_data: 0,
        operand: Vec::new(),
        inline: Vec::new(),
    }
}

/// A Portals put names its target to the daemon (which tells that process to keep its core
/// for it, `Waiter::keep_core`); a get does not.
#[test]
fn a_portals_put_names_its_target_a_get_does_not() {
    let mut c = lossy_pair(5);
    let (mut i, _t) = matching_pair(&mut c);
    let src = region(64);
    let handle = i.register(&mut c, &src);
    let md = i.md_bind(&mut c, handle, 64, 0, None);
    let tag = c.host(0).unwrap().session_job(i.session).unwrap();
    c.host_mut(0).unwrap().poll_addressed();
    let put = put8(md, 1, AckReq::NoAck);
    let get = OpSpec {
        kind: ReqKind::Get,
        get_md: Some(md),
        ..put.clone()
    };
    i.start(&mut c, put.clone(), None);
    assert_eq!(c.host_mut(0).unwrap().poll_addressed(), Some((1, tag, 1)));
    i.start(&mut c, get, None);
    assert_eq!(c.host_mut(0).unwrap().poll_addressed(), None);
    // Armed, a triggered put names its target only when it fires.
    let (ct, _slot) = i.ct(&mut c);
    i.start(&mut c, put.clone(), Some((ct, 1)));
    assert_eq!(c.host_mut(0).unwrap().poll_addressed(), None, "armed");
    let inc = PtlCall::CtInc {
        ni: 0,
        ct,
        success: 1,
        failure: 0,
    };
    i.submit(&mut c, &inc, true);
    assert_eq!(
        c.host_mut(0).unwrap().poll_addressed(),
        Some((1, tag, 1)),
        "fired"
    );
    // A put longer than its target would spin for is not named either.
    let long_len = ANNOUNCE_MAX_BYTES + 8;
    let big = region(long_len as usize);
    let big_handle = i.register(&mut c, &big);
    let big_md = i.md_bind(&mut c, big_handle, long_len, 0, None);
    for (length, named) in [(ANNOUNCE_MAX_BYTES, true), (long_len, false)] {
        let op = OpSpec {
            md: big_md,
            length,
            ..put.clone()
        };
        i.start(&mut c, op, None);
        let want = named.then_some((1, tag, 1));
        assert_eq!(c.host_mut(0).unwrap().poll_addressed(), want, "{length} B");
    }
    // An MD whose puts nobody waits for (softnic's QUIET option, MPI's windows).
    let quiet = i.md_bind(&mut c, handle, 64, md::QUIET, None);
    let op = OpSpec { md: quiet, ..put };
    i.start(&mut c, op, None);
    assert_eq!(c.host_mut(0).unwrap().poll_addressed(), None, "quiet");
}

/// The acknowledgement of a silent delivery (no event at the target) waits a little for
/// company: when the target answers at once (a process polling its memory, as SHMEM's
/// `wait_until`), the answer's datagram carries it; when none comes, it leaves alone, soon.
#[test]
fn a_silent_deliverys_ack_rides_on_the_targets_answer() {
    let mut c = clean_pair(9);
    let (mut i, mut t) = matching_pair(&mut c);
    let (ieq, mut iring) = i.eq(&mut c);
    let (imem, tmem) = (region(64), region(64));
    let (ih, th) = (i.register(&mut c, &imem), t.register(&mut c, &tmem));
    for p in [&mut i, &mut t] {
        p.pt_alloc(&mut c, 0, 0, None);
    }
    // Each exposes bytes 32..64 with no event; each sends from bytes 0..8.
    i.append(&mut c, (ih, 32, 32), me::EVENT_COMM_DISABLE, 1, 0);
    t.append(&mut c, (th, 32, 32), me::EVENT_COMM_DISABLE, 1, 0);
    let imd = i.md_bind(&mut c, ih, 64, 0, Some(ieq));
    let tmd = t.md_bind(&mut c, th, 64, 0, None);
    let acked = |ring: &mut EventRing| {
        std::iter::from_fn(|| ring.pop()).any(|(e, _)| e.kind == EventKind::Ack)
    };
    for round in 1..=3u64 {
        imem.write(0, &round.to_le_bytes()).unwrap();
        tmem.write(0, &round.to_le_bytes()).unwrap();
        let before = c.host(1).unwrap().op_datagrams_sent();
        i.start(&mut c, put8(imd, 1, AckReq::Ack), None);
        c.run_until(1_000_000_000, |_| tmem.to_vec(32, 8) == round.to_le_bytes())
            .unwrap();
        t.start(&mut c, put8(tmd, 0, AckReq::NoAck), None);
        let mut got_ack = false;
        c.run_until(1_000_000_000, |_| {
            got_ack |= acked(&mut iring);
            got_ack && imem.to_vec(32, 8) == round.to_le_bytes()
        })
        .unwrap();
        // Round 1 also opens the hosts' session (greetings).
        if round > 1 {
            assert_eq!(
                c.host(1).unwrap().op_datagrams_sent() - before,
                1,
                "round {round}: one datagram back, the answer carrying the ACK"
            );
        }
    }
    // Unanswered, the ACK still comes, within the lazy wait and the network's delay.
    let start = c.now;
    i.start(&mut c, put8(imd, 1, AckReq::Ack), None);
    c.run_until(1_000_000_000, |_| acked(&mut iring)).unwrap();
    let took = c.now - start;
    assert!(
        took < 2 * SimConfig::default().delay_ns + 10_000,
        "{took} ns"
    );
}

/// A message that rides with the answer to one of its receiver's own requests (a ping-pong's
/// reply carrying the acknowledgement of the message before: MPI's send, recv) reaches its
/// process first: its event is queued before that acknowledgement's.
#[test]
fn a_message_is_told_before_the_acknowledgement_that_rode_with_it() {
    let mut c = clean_pair(11);
    let (mut i, mut t) = matching_pair(&mut c);
    let (ieq, mut iring) = i.eq(&mut c);
    let (teq, mut tring) = t.eq(&mut c);
    let (imem, tmem) = (region(64), region(64));
    let (ih, th) = (i.register(&mut c, &imem), t.register(&mut c, &tmem));
    i.pt_alloc(&mut c, 0, 0, Some(ieq));
    t.pt_alloc(&mut c, 0, 0, Some(teq));
    // Each exposes bytes 32..64 with full events; each sends from bytes 0..8.
    i.append(&mut c, (ih, 32, 32), 0, 1, 0);
    t.append(&mut c, (th, 32, 32), 0, 1, 0);
    let imd = i.md_bind(&mut c, ih, 64, md::EVENT_SEND_DISABLE, Some(ieq));
    let tmd = t.md_bind(&mut c, th, 64, md::EVENT_SEND_DISABLE, None);
    for round in 1..=3u64 {
        i.start(&mut c, put8(imd, 1, AckReq::Ack), None);
        c.run_until(1_000_000_000, |_| {
            std::iter::from_fn(|| tring.pop()).any(|(e, _)| e.kind == EventKind::Put)
        })
        .unwrap();
        let before = c.host(1).unwrap().op_datagrams_sent();
        t.start(&mut c, put8(tmd, 0, AckReq::NoAck), None);
        let mut told = Vec::new();
        c.run_until(1_000_000_000, |_| {
            told.extend(std::iter::from_fn(|| iring.pop()).map(|(e, _)| e.kind));
            told.len() >= 2
        })
        .unwrap();
        // Round 1 also opens the hosts' session (greetings).
        if round > 1 {
            assert_eq!(
                c.host(1).unwrap().op_datagrams_sent() - before,
                1,
                "round {round}: the answer carries the ACK"
            );
            assert_eq!(told, [EventKind::Put, EventKind::Ack], "round {round}");
        }
    }
}

/// An event queue counts the events its process has not yet consumed against its capacity;
/// once the process has consumed them, the queue takes as many again, without a drop, however
/// long the daemon idled in between (it learns of the room before it next posts an event,
/// not by looking on every turn).
#[test]
fn an_event_queue_its_process_emptied_takes_a_full_queue_again() {
    const CAP: usize = 4;
    let mut c = clean_pair(3);
    let (mut i, mut t) = matching_pair(&mut c);
    let (teq, mut tring) = t.eq_of(&mut c, CAP);
    let (imem, tmem) = (region(64), region(64));
    let (ih, th) = (i.register(&mut c, &imem), t.register(&mut c, &tmem));
    t.pt_alloc(&mut c, 0, 0, Some(teq));
    t.append(&mut c, (th, 0, 64), me::EVENT_LINK_DISABLE, 1, 0);
    let imd = i.md_bind(&mut c, ih, 64, 0, None);
    for round in 0..3 {
        for _ in 0..CAP {
            i.start(&mut c, put8(imd, 1, AckReq::NoAck), None);
        }
        // All land while the process looks away: its ring holds a full queue.
        let until = c.now + 50_000_000;
        c.run_until(1_000_000_000, |c| c.now >= until).unwrap();
        let got: Vec<_> = std::iter::from_fn(|| tring.pop()).collect();
        assert_eq!(got.len(), CAP, "round {round}: {got:?}");
        assert!(
            got.iter()
                .all(|(e, dropped)| e.kind == EventKind::Put && !dropped),
            "round {round}: {got:?}"
        );
        // Consumed; the daemon idles a while without news before the next ones come.
        let until = c.now + 50_000_000;
        c.run_until(1_000_000_000, |c| c.now >= until).unwrap();
    }
}

/// A put asking for no acknowledgement (PTL_NO_ACK_REQ) is complete once it has left: its MD
/// can be released before the target has it, and the target sends nothing back for it —
/// neither for one datagram nor for a put streamed in many.
#[test]
fn a_put_without_ack_is_complete_once_sent_and_never_answered() {
    const LEN: usize = 256 << 10;
    let mut c = clean_pair(12);
    let (mut i, mut t) = matching_pair(&mut c);
    let (teq, mut tring) = t.eq(&mut c);
    let (imem, tmem) = (region(LEN), region(LEN));
    let (ih, th) = (i.register(&mut c, &imem), t.register(&mut c, &tmem));
    t.pt_alloc(&mut c, 0, 0, Some(teq));
    t.append(&mut c, (th, 0, LEN as u64), 0, 1, 0);
    let put_came = |c: &mut SimCluster, ring: &mut EventRing| {
        let mut came = false;
        c.run_until(1_000_000_000, |_| {
            came |= std::iter::from_fn(|| ring.pop()).any(|(e, _)| e.kind == EventKind::Put);
            came
        })
        .unwrap();
    };
    // The hosts' session opens (greetings both ways) with a first message.
    let md = i.md_bind(&mut c, ih, 8, 0, None);
    i.start(&mut c, put8(md, 1, AckReq::Ack), None);
    put_came(&mut c, &mut tring);
    for (round, len) in [(1u8, 8usize), (2, LEN)] {
        imem.write(0, &vec![round; len]).unwrap();
        let until = c.now + 20 * SimConfig::default().delay_ns;
        c.run_until(1_000_000_000, |c| c.now >= until).unwrap();
        let md = i.md_bind(&mut c, ih, LEN as u64, 0, None);
        let before = c.host(1).unwrap().op_datagrams_sent();
        let put = OpSpec {
            length: len as u64,
            ..put8(md, 1, AckReq::NoAck)
        };
        i.start(&mut c, put, None);
        if len == 8 {
            // Sent with the command that started it: released at once, the target far away.
            i.call(&mut c, PtlCall::MdRelease { ni: 0, md });
            assert_ne!(tmem.to_vec(len as u64 - 1, 1), [round], "not delivered yet");
        }
        put_came(&mut c, &mut tring);
        assert_eq!(tmem.to_vec(0, len), vec![round; len]);
        if len != 8 {
            // Its last fragment has left; no answer is on its way.
            i.call(&mut c, PtlCall::MdRelease { ni: 0, md });
        }
        let until = c.now + 20 * SimConfig::default().delay_ns;
        c.run_until(1_000_000_000, |c| c.now >= until).unwrap();
        assert_eq!(
            c.host(1).unwrap().op_datagrams_sent(),
            before,
            "{len} B: the target answered a put that asked for no acknowledgement"
        );
        assert_eq!(c.host(0).unwrap().outstanding(), 0);
    }
}
