//! The real transport and Gemini engine, wired host to host through the seeded simulated
//! network: AMOs and puts exactly once under heavy loss, duplication and reordering, and a dead
//! peer's pending operations failed. Fully deterministic.

use std::sync::atomic::Ordering;

use softnic::nic::gemini::{serve, Completion, Initiator, Pending, PendingKind, TargetAction};
use softnic::nic::memory::{Endpoints, HeapBacking, Perms, Region};
use softnic::transport::sim::{SimConfig, SimNet};
use softnic::transport::{Transport, TransportConfig, TransportEvent};
use softnic::wire::{AmoOp, Key, OpHeader, OpIter, OpRef, Status};

struct Host {
    t: Transport,
    eps: Endpoints,
    init: Initiator,
    done: Vec<Completion>,
}

fn host(i: u16) -> Host {
    let cfg = TransportConfig {
        window: 64,
        max_queued: 64,
        rto_init: 300_000,
        rto_min: 200_000,
        peer_timeout: 2_000_000_000,
        ..Default::default()
    };
    let mut eps = Endpoints::default();
    eps.insert(1, i as u32, 0);
    Host {
        t: Transport::new(i, 2, Key([3; 32]), cfg, 100 + i as u64),
        eps,
        init: Initiator::default(),
        done: Vec::new(),
    }
}

fn deliver(h: &mut Host, peer: u16, body: &[u8]) {
    for op in OpIter::new(body) {
        let op = op.unwrap();
        match op {
            OpRef::Put { .. } | OpRef::Amo { .. } | OpRef::Get { .. } => match serve(&h.eps, &op) {
                TargetAction::Reply(r) => h.t.push_op(peer, &r.as_op()).unwrap(),
                TargetAction::None => {}
                TargetAction::StreamGet { .. } => unreachable!("no gets here"),
            },
            _ => h.done.extend(h.init.on_reply(&op)),
        }
    }
}

/// Runs both hosts from simulated time `*now` until `until` says stop (or 120 s pass).
fn run(
    hosts: &mut [Host; 2],
    net: &mut SimNet,
    now: &mut u64,
    mut until: impl FnMut(&[Host; 2]) -> bool,
) {
    let end = *now + 120_000_000_000;
    while !until(hosts) && *now < end {
        let now_ = *now;
        for (i, h) in hosts.iter_mut().enumerate() {
            h.t.flush(now_);
            h.t.handle_timeout(now_);
            while let Some((to, d)) = h.t.poll_transmit(now_) {
                let d = d.to_vec();
                net.send(now_, i as u16, to, &d);
            }
            while let Some(ev) = h.t.poll_event() {
                if let TransportEvent::PeerDead(p) = ev {
                    h.init.fail_host(p, &mut h.done);
                }
            }
        }

        while let Some((to, d)) = net.recv_due(now_) {
            let h = &mut hosts[to as usize];
            let Ok(r) = h.t.on_datagram(now_, &d) else {
                continue;
            };
            if let Some(b) = r.body {
                let b = b.to_vec();
                deliver(h, r.peer, &b);
            }
            while let Some(b) = h.t.take_ready(r.peer) {
                deliver(h, r.peer, &b);
            }
        }
        *now += 50_000;
    }
}

#[test]
fn amos_and_puts_apply_exactly_once_under_loss_duplication_reordering() {
    for seed in [1, 2, 3] {
        let mut net = SimNet::new(SimConfig {
            seed,
            loss: 0.3,
            duplicate: 0.2,
            reorder: 0.2,
            ..Default::default()
        });
        let mut hosts = [host(0), host(1)];
        let target = Region::new(HeapBacking::new(1 << 16), Perms::READ_WRITE);
        hosts[1].eps.register(1, 1, target.clone()).unwrap();
        let n = 1500u64;
        let mut now = 0;
        for i in 0..n {
            let req = hosts[0].init.start(Pending {
                session: 0,
                client_req: i,
                host: 1,
                kind: PendingKind::Amo,
            });
            let h = OpHeader {
                job: 1,
                src_rank: 0,
                dst_rank: 1,
                req,
            };
            let amo = OpRef::Amo {
                h,
                region: 0,
                op: AmoOp::Afadd,
                offset: 0,
                operand: 1,
                operand2: 0,
            };
            hosts[0]
                .t
                .push_op(1, &amo)
                .unwrap_or_else(|e| panic!("queue room at {now}: {e}"));
            let req = hosts[0].init.start(Pending {
                session: 0,
                client_req: n + i,
                host: 1,
                kind: PendingKind::Put,
            });
            let data = [(i % 251) as u8; 24];
            let off = 8 + (i % 1000) * 24;
            let put = OpRef::Put {
                h: OpHeader { req, ..h },
                region: 0,
                offset: off,
                total_off: off,
                total_len: 24,
                last: true,
                lazy_ack: false,
                data: &data,
            };
            hosts[0].t.push_op(1, &put).unwrap();
            if i % 4 == 3 {
                run(&mut hosts, &mut net, &mut now, |h| {
                    h[0].init.outstanding() == 0
                });
            }
        }
        run(&mut hosts, &mut net, &mut now, |h| {
            h[0].init.outstanding() == 0
        });
        assert_eq!(
            target
                .atomic(0, Perms::READ)
                .unwrap()
                .load(Ordering::SeqCst),
            n,
            "seed {seed}"
        );
        let mut fetched: Vec<u64> = hosts[0]
            .done
            .iter()
            .filter(|c| c.client_req < n)
            .map(|c| c.value)
            .collect();
        fetched.sort();
        assert_eq!(
            fetched,
            (0..n).collect::<Vec<_>>(),
            "each AFADD fetched a distinct value, seed {seed}"
        );
        assert!(hosts[0].done.iter().all(|c| c.status == Status::Ok));
        assert!(net.stats.lost > 200 && net.stats.duplicated > 100 && net.stats.reordered > 100);
    }
}

#[test]
fn dead_peer_fails_pending_operations() {
    let mut net = SimNet::new(SimConfig::default());
    let mut hosts = [host(0), host(1)];
    hosts[1]
        .eps
        .register(1, 1, Region::new(HeapBacking::new(64), Perms::READ_WRITE))
        .unwrap();
    net.set_down(1, true);
    for i in 0..10 {
        let req = hosts[0].init.start(Pending {
            session: 0,
            client_req: i,
            host: 1,
            kind: PendingKind::Amo,
        });
        let h = OpHeader {
            job: 1,
            src_rank: 0,
            dst_rank: 1,
            req,
        };
        hosts[0]
            .t
            .push_op(
                1,
                &OpRef::Amo {
                    h,
                    region: 0,
                    op: AmoOp::Afadd,
                    offset: 0,
                    operand: 1,
                    operand2: 0,
                },
            )
            .unwrap();
    }
    let mut t = 0;
    run(&mut hosts, &mut net, &mut t, |h| h[0].done.len() == 10);
    assert_eq!(hosts[0].done.len(), 10, "every pending op completed");
    assert!(hosts[0].done.iter().all(|c| c.status == Status::PeerDead));
    assert!(t >= 2_000_000_000, "not before peer_timeout");
}
