//! Portals matching through host cores (the daemon's NIC) over the seeded lossy simulated
//! network, driven by the same Portals calls a client sends down its command ring: messages
//! between a pair of NIs are matched in the order they were sent, exactly once, whatever the
//! network loses, duplicates or reorders; fragmented messages arrive whole.

use softnic::nic::memory::{HeapBacking, Perms, Region};
use softnic::nic::portals::types::{me, RANK_ANY};
use softnic::nic::portals::{AckReq, OpSpec, ProcessId, ReqKind};
use softnic::nic::portals::{EventKind, NiFail};
use softnic::nic::sim::SimCluster;
use softnic::shm::event_ring::{ring_bytes, EventRing};
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
        let len = ring_bytes(EQ_COUNT);
        let mem = region(len);
        let handle = self.register(c, &mem);
        let eq = self.call(
            c,
            PtlCall::EqAlloc {
                ni: 0,
                count: EQ_COUNT as u32,
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
        let mut c = SimCluster::new(
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
        );
        let mut i = Proc::new(&mut c, 0, 0);
        let mut t = Proc::new(&mut c, 1, 1);
        for p in [&mut i, &mut t] {
            p.call(
                &mut c,
                PtlCall::NiInit {
                    ni: 0,
                    matching: true,
                },
            );
        }
        let (teq, mut teq_ring) = t.eq(&mut c);
        t.call(
            &mut c,
            PtlCall::PtAlloc {
                ni: 0,
                options: 0,
                eq: Some(teq),
                index: Some(0),
            },
        );
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
            i.call(
                c,
                PtlCall::MdBind {
                    ni: 0,
                    region,
                    segments: vec![(0, r.len() as u64)],
                    options: 0,
                    eq: Some(ieq),
                    ct: None,
                },
            ) as u32
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
        };
        for k in 0..300u64 {
            i.submit(
                &mut c,
                &PtlCall::Op {
                    ni: 0,
                    op: put(1, k * 8, 8),
                    trigger: None,
                },
                true,
            );
            if k < 50 {
                i.submit(
                    &mut c,
                    &PtlCall::Op {
                        ni: 0,
                        op: put(2, k * 8, 8),
                        trigger: None,
                    },
                    true,
                );
            }
        }
        i.submit(
            &mut c,
            &PtlCall::Op {
                ni: 0,
                op: put(4, 3200, 20_000),
                trigger: None,
            },
            true,
        );
        for g in 0..10u64 {
            let get = OpSpec {
                kind: ReqKind::Get,
                get_md: Some(gmd),
                get_offset: g * 2000,
                remote_offset: g * 2000,
                ..put(4, 0, 2000)
            };
            i.submit(
                &mut c,
                &PtlCall::Op {
                    ni: 0,
                    op: get,
                    trigger: None,
                },
                true,
            );
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
        assert!(
            c.net.stats.lost > 20 && c.net.stats.duplicated > 10 && c.net.stats.reordered > 10,
            "{:?}",
            c.net.stats
        );
    }
}
