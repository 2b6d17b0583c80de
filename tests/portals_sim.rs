//! Portals matching through the real transport over the seeded lossy simulated network:
//! messages between a pair of NIs are matched in the order they were sent, exactly once,
//! whatever the network loses, duplicates or reorders; fragmented messages arrive whole.

use std::collections::VecDeque;

use softnic::nic::memory::{HeapBacking, Perms, Region};
use softnic::nic::portals::types::{me, RANK_ANY};
use softnic::nic::portals::wire::{encode_kind, request_ops, response_ops, Reassembly};
use softnic::nic::portals::{
    AckReq, EventKind, Limits, List, MatchEntry, NiFail, OpSpec, PortalsNi, ProcessId, ReqKind,
};
use softnic::transport::sim::{SimConfig, SimNet};
use softnic::transport::{Transport, TransportConfig};
use softnic::wire::{Key, OpHeader, OpIter, OpRef, PtlHeader};

fn region(len: usize) -> Region {
    Region::new(HeapBacking::new(len), Perms::READ_WRITE)
}

fn me_entry(r: &Region, start: u64, length: u64, options: u32, bits: u64) -> MatchEntry {
    MatchEntry {
        region: r.clone(),
        start,
        length,
        ct: None,
        uid: u32::MAX,
        options: me::OP_PUT | me::OP_GET | options,
        match_id: ProcessId::Logical { rank: RANK_ANY },
        match_bits: bits,
        ignore_bits: 0,
        min_free: 0,
    }
}

struct Host {
    t: Transport,
    ni: PortalsNi,
    asm: Reassembly,
    /// Encoded ops waiting for room in the transport.
    backlog: VecDeque<Vec<u8>>,
}

impl Host {
    fn new(i: u16) -> Host {
        let cfg = TransportConfig {
            mtu: 1472,
            window: 64,
            max_queued: 64,
            rto_init: 300_000,
            rto_min: 200_000,
            peer_timeout: 60_000_000_000,
            ..Default::default()
        };
        Host {
            t: Transport::new(i, 2, Key([5; 32]), cfg, 40 + i as u64),
            ni: PortalsNi::new(true, Limits::default()),
            asm: Reassembly::default(),
            backlog: VecDeque::new(),
        }
    }

    fn queue(&mut self, op: &OpRef<'_>) {
        let mut b = vec![0u8; op.encoded_len()];
        op.encode(&mut b);
        self.backlog.push_back(b);
    }

    fn pump(&mut self, peer: u16) {
        while let Some(b) = self.backlog.front() {
            let (op, _) = OpRef::decode(b).expect("own encoding");
            if self.t.push_op(peer, &op).is_err() {
                break;
            }
            self.backlog.pop_front();
        }
    }
}

/// Host 0 starts `specs` (op id → completion); host 1 serves; runs until all complete.
fn run(net: &mut SimNet, hosts: &mut [Host; 2], specs: Vec<OpSpec>) {
    let body = hosts[0].t.body_capacity();
    for (i, s) in specs.into_iter().enumerate() {
        let mut payload = Vec::new();
        let id = hosts[0]
            .ni
            .start(s.clone(), &mut payload)
            .expect("valid op");
        let (kind, op, dt) = encode_kind(s.kind);
        let m = PtlHeader {
            ni: 0,
            kind,
            atomic_op: op,
            datatype: dt,
            pt_index: s.pt_index,
            match_bits: s.match_bits,
            remote_offset: s.remote_offset,
            rlength: s.length,
            hdr_data: s.hdr_data,
            uid: 0,
        };
        let h = OpHeader {
            job: 1,
            src_rank: 0,
            dst_rank: 1,
            req: id as u64,
        };
        assert!(i < 1_000_000);
        for o in request_ops(h, m, &s.operand, &payload, body) {
            hosts[0].queue(&o);
        }
    }
    let mut now = 0u64;
    while hosts[0].ni.outgoing_len() > 0 {
        assert!(now < 600_000_000_000, "did not finish");
        for (i, h) in hosts.iter_mut().enumerate() {
            h.pump(1 - i as u16);
            h.t.flush(now);
            h.t.handle_timeout(now);
            while let Some((to, d)) = h.t.poll_transmit(now) {
                let d = d.to_vec();
                net.send(now, i as u16, to, &d);
            }
        }
        while let Some((to, d)) = net.recv_due(now) {
            let h = &mut hosts[to as usize];
            let Ok(r) = h.t.on_datagram(now, &d) else {
                continue;
            };
            let mut bodies: Vec<Vec<u8>> = r.body.map(|b| b.to_vec()).into_iter().collect();
            while let Some(b) = h.t.take_ready(r.peer) {
                bodies.push(b);
            }
            for b in bodies {
                for op in OpIter::new(&b) {
                    let op = op.expect("valid op");
                    match op {
                        OpRef::PtlReq { .. } => {
                            let Some(Ok(whole)) = h.asm.request(r.peer, &op) else {
                                continue;
                            };
                            let (rh, ..) = whole.parts();
                            let resp = match whole.request(ProcessId::Logical { rank: rh.src_rank })
                            {
                                Ok(req) => h.ni.deliver(&req),
                                Err(f) => panic!("bad kind {f:?}"),
                            };
                            let back = OpHeader {
                                src_rank: rh.dst_rank,
                                dst_rank: rh.src_rank,
                                ..rh
                            };
                            let body = h.t.body_capacity();
                            for o in response_ops(back, &resp, body) {
                                h.queue(&o);
                            }
                        }
                        OpRef::PtlResp { .. } => {
                            if let Some((req, resp)) = h.asm.response(r.peer, &op) {
                                h.ni.complete(req as u32, &resp);
                            }
                        }
                        _ => unreachable!(),
                    }
                }
            }
        }
        now += 50_000;
    }
}

#[test]
fn matching_order_and_exactly_once_under_loss_duplication_reordering() {
    for seed in [1u64, 2, 3] {
        let mut net = SimNet::new(SimConfig {
            seed,
            loss: 0.3,
            duplicate: 0.2,
            reorder: 0.2,
            mtu: 1472,
            ..Default::default()
        });
        let mut hosts = [Host::new(0), Host::new(1)];
        let t = &mut hosts[1].ni;
        let teq = t.eq_alloc(4096).unwrap();
        t.pt_alloc(0, Some(teq), Some(0)).unwrap();
        // Bits 1: a packing buffer (locally managed): arrival order is visible in memory.
        let packed = region(8 * 400);
        t.append(
            0,
            me_entry(&packed, 0, 8 * 400, me::MANAGE_LOCAL, 1),
            List::Priority,
            0,
        )
        .unwrap();
        // Bits 2: 50 use-once entries, each matched by the next message in order.
        let slots = region(8 * 50);
        for i in 0..50u64 {
            t.append(
                0,
                me_entry(&slots, i * 8, 8, me::USE_ONCE, 2),
                List::Priority,
                i,
            )
            .unwrap();
        }
        // Bits 4: a large buffer for a fragmented put and gets back.
        let big = region(20_000);
        t.append(0, me_entry(&big, 0, 20_000, 0, 4), List::Priority, 0)
            .unwrap();

        let i = &mut hosts[0].ni;
        let ieq = i.eq_alloc(4096).unwrap();
        let src = region(8 * 400 + 20_000);
        for k in 0..400u64 {
            src.write(k * 8, &k.to_le_bytes()).unwrap();
        }
        let pattern: Vec<u8> = (0..20_000u32).map(|x| (x * 7 % 251) as u8).collect();
        src.write(3200, &pattern).unwrap();
        let md = i
            .md_bind(src.clone(), vec![(0, 8 * 400 + 20_000)], 0, Some(ieq), None)
            .unwrap();
        let back = region(20_000);
        let gmd = i
            .md_bind(back.clone(), vec![(0, 20_000)], 0, Some(ieq), None)
            .unwrap();
        let put = |bits, offset, length| OpSpec {
            kind: ReqKind::Put,
            md,
            offset,
            length,
            get_md: None,
            get_offset: 0,
            ack_req: AckReq::Ack,
            target: ProcessId::Logical { rank: 1 },
            pt_index: 0,
            match_bits: bits,
            remote_offset: 0,
            user_ptr: offset,
            hdr_data: 0,
            operand: Vec::new(),
        };
        let mut specs = Vec::new();
        for k in 0..300u64 {
            specs.push(put(1, k * 8, 8));
            if k < 50 {
                specs.push(put(2, k * 8, 8));
            }
        }
        specs.push(put(4, 3200, 20_000));
        for g in 0..10u64 {
            specs.push(OpSpec {
                kind: ReqKind::Get,
                get_md: Some(gmd),
                get_offset: g * 2000,
                remote_offset: g * 2000,
                length: 2000,
                ..put(4, 0, 2000)
            });
        }
        run(&mut net, &mut hosts, specs);

        for k in 0..300u64 {
            assert_eq!(
                packed.bytes(k * 8, 8),
                k.to_le_bytes(),
                "seed {seed}: put {k} packed in send order"
            );
        }
        for k in 0..50u64 {
            assert_eq!(
                slots.bytes(k * 8, 8),
                k.to_le_bytes(),
                "seed {seed}: use-once entry {k} got message {k}"
            );
        }
        assert_eq!(
            big.bytes(0, 20_000),
            &pattern[..],
            "seed {seed}: fragmented put whole"
        );
        assert_eq!(
            back.bytes(0, 20_000),
            &pattern[..],
            "seed {seed}: gets back"
        );
        let mut acks = 0;
        let mut replies = 0;
        while let Ok((e, dropped)) = hosts[0].ni.eq_get(ieq) {
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
        while let Ok((e, _)) = hosts[1].ni.eq_get(teq) {
            if e.kind == EventKind::Put {
                puts += 1;
            }
        }
        assert_eq!(puts, 351, "seed {seed}: each put delivered once");
        assert!(
            net.stats.lost > 20 && net.stats.duplicated > 10 && net.stats.reordered > 10,
            "{:?}",
            net.stats
        );
    }
}
