//! Hostile and failing inputs against a real softnicd: killed ranks, forged or garbage
//! datagrams, garbage in a command ring. The daemon must count, drop, disconnect — and go on.

mod common;

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use common::*;
use softnic::client::Client;
use softnic::gni::GniError;
use softnic::nic::memory::Perms;
use softnic::wire::Status;

#[test]
fn killed_rank_leaves_daemon_serving_the_others() {
    if in_job() {
        let mut nic = init();
        let mem = nic.mem_register(1 << 16, Perms::READ_WRITE).unwrap();
        nic.barrier().unwrap();
        if nic.rank() == 2 {
            // The victim keeps the NIC busy until it is SIGKILLed.
            loop {
                nic.put(remote(0, mem.handle, 1024), &[7; 512]).unwrap();
                nic.afadd(remote(1, mem.handle, 8), 1).unwrap();
            }
        }
        // Ranks 0 and 1 keep working with each other and aim at rank 2 until it is gone.
        let peer = 1 - nic.rank();
        let t = Instant::now();
        loop {
            nic.put(remote(peer, mem.handle, 4096), &pattern(3000, 1))
                .unwrap();
            nic.afadd(remote(peer, mem.handle, 16), 1).unwrap();
            match nic.afadd(remote(2, mem.handle, 0), 1) {
                Ok(_) => {}
                Err(GniError::Remote(Status::NoSuchEndpoint)) => break,
                Err(e) => panic!("unexpected error aiming at the killed rank: {e}"),
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "rank 2 never went away"
            );
        }
        // Both survivors finish a counted exchange: 1000 AFADDs each into rank 0's word 24.
        for _ in 0..1000 {
            nic.afadd(remote(0, mem.handle, 24), 1).unwrap();
        }
        let t = Instant::now();
        if nic.rank() == 0 {
            while mem.read_u64(24) < 2000 {
                assert!(t.elapsed() < Duration::from_secs(60));
                std::thread::yield_now();
            }
            assert_eq!(mem.read_u64(24), 2000);
        }
        return;
    }
    let d = Daemons::start(2);
    let (job, key) = (4242, 99);
    let mut ranks: Vec<_> = (0..3)
        .map(|r| {
            d.spawn_rank(
                "killed_rank_leaves_daemon_serving_the_others",
                r,
                3,
                job,
                key,
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let victim = ranks.pop().unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&victim),
        rustix::process::Signal::Kill,
    )
    .unwrap();
    let mut victim = victim;
    victim.wait().unwrap();
    for mut r in ranks {
        assert!(r.wait().unwrap().success(), "a surviving rank failed");
    }
    assert_eq!(d.counter("clients_detached_total"), 3);
    assert_eq!(d.counter("clients "), 0);
    // And a fresh job runs on the same daemons.
    d.run_job_ok("small_job_body", 2);
}

/// A short job used after fault scenarios to show the daemons still work.
#[test]
fn small_job_body() {
    if in_job() {
        let mut nic = init();
        let mem = nic.mem_register(4096, Perms::READ_WRITE).unwrap();
        nic.barrier().unwrap();
        let peer = (nic.rank() + 1) % nic.size();
        nic.put(remote(peer, mem.handle, 0), &[nic.rank() as u8 + 1; 64])
            .unwrap();
        assert_eq!(nic.afadd(remote(peer, mem.handle, 64), 1).unwrap(), 0);
        nic.barrier().unwrap();
        let from = (nic.rank() + nic.size() - 1) % nic.size();
        assert_eq!(mem.bytes()[0], from as u8 + 1);
        return;
    }
    launch_ok("small_job_body", 3, 2, &[]);
}

/// Random bytes, a truncated datagram, and a well-formed one sealed with the wrong secret.
fn hostile_datagrams() -> [Vec<u8>; 3] {
    let mut t = softnic::transport::Transport::new(
        1,
        2,
        softnic::wire::Key([9; 32]),
        Default::default(),
        1,
    );
    let op = softnic::wire::OpRef::PutAck {
        h: Default::default(),
        status: Status::Ok,
    };
    t.push_op(0, &op).unwrap();
    t.flush(0);
    [
        (0..200).map(|i| (i * 37 % 256) as u8).collect(),
        vec![0x53, 0x4e, 1],
        t.poll_transmit(0).unwrap().1.to_vec(),
    ]
}

/// Waits (5 s at most) until the daemons counted that many forged and malformed datagrams.
fn wait_counted(d: &Daemons, auth: u64, malformed: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.counter("auth_failures") < auth || d.counter("malformed_datagrams") < malformed {
        assert!(
            Instant::now() < deadline,
            "garbage not counted:\n{}",
            d.stat()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn garbage_datagrams_are_dropped_and_counted() {
    let d = Daemons::start(2);
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let target = d.cfg.hosts[0].addr;
    for g in hostile_datagrams() {
        s.send_to(&g, target).unwrap();
    }
    wait_counted(&d, 1, 2);
    d.run_job_ok("small_job_body", 2);
}

#[test]
fn garbage_in_a_command_ring_disconnects_only_that_client() {
    let d = Daemons::start(1);
    let path = d.cfg.socket_path(0);
    let bad = Client::attach(&path, 7, 1, 0, 2).unwrap();
    let good = Client::attach(&path, 7, 1, 1, 2).unwrap();
    // Scribble over the ring and publish a nonsensical tail index.
    unsafe {
        let b = bad.control().mapping().slice_mut();
        for (i, x) in b[4096..4096 + 4096].iter_mut().enumerate() {
            *x = (i * 131 % 251) as u8;
        }
        (*(b.as_mut_ptr().add(128) as *const std::sync::atomic::AtomicU64))
            .store(200, std::sync::atomic::Ordering::SeqCst);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if bad.stat().is_err() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the scribbling client was not disconnected"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        good.stat().unwrap().contains("bad_commands             1"),
        "{}",
        good.stat().unwrap()
    );
    assert_eq!(d.counter("clients "), 1);
}

#[test]
fn hostile_tcp_connections_are_closed_and_the_pair_survives_restarts() {
    use std::io::Write;
    let d = Daemons::start_with(2, softnic::config::TransportKind::Tcp);
    let target = d.cfg.hosts[1].addr;
    // A frame claiming 1 GB, garbage of a hello's length, and a half-sent hello then close:
    // none is a genuine hello from host 0's address, so none is taken as host 0's connection.
    let mut a = std::net::TcpStream::connect(target).unwrap();
    a.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
    a.write_all(&[0; 52]).unwrap();
    let mut b = std::net::TcpStream::connect(target).unwrap();
    b.write_all(&[0x42; 100]).unwrap();
    let mut c = std::net::TcpStream::connect(target).unwrap();
    c.write_all(&[1; 10]).unwrap();
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.counter("rx_bad_frames") < 2 {
        assert!(
            Instant::now() < deadline,
            "false hellos not counted:\n{}",
            d.stat()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    d.run_job_ok("small_job_body", 2);
    // The dialling host (0) crashes and comes back: its new hello replaces the connection;
    // then the accepting one (1): host 0 dials it again.
    let mut d = d;
    for host in [0, 1] {
        d.kill(host);
        d.restart(host);
        d.run_job_ok("small_job_body", 2);
    }
}

#[test]
fn a_pinned_daemon_publishes_its_core_and_a_blocked_rank_leaves_it() {
    let allowed = softnic::shm::cores::allowed().unwrap();
    let d = Daemons::start(1);
    let path = d.cfg.socket_path(0);
    // In a thread of its own: the affinity it gives up must not leak into other tests.
    std::thread::spawn(move || {
        let c = Client::attach(&path, 9, 1, 0, 1).unwrap();
        if allowed.len() < 2 {
            assert_eq!(c.control().nic_cpu(), None, "one CPU: nothing to pin to");
            eprintln!("skipped the move: one CPU allowed");
            return;
        }
        // The local default pins the NIC to the last allowed CPU.
        let nic = c
            .control()
            .nic_cpu()
            .expect("the daemon announces its core");
        assert_eq!(nic, *allowed.last().unwrap());
        let mut only = rustix::process::CpuSet::new();
        only.set(nic as usize);
        let mut both = only;
        both.set(allowed[0] as usize);
        // Put this thread on the NIC's core, as the scheduler may, then allow both.
        rustix::process::sched_setaffinity(None, &only).unwrap();
        rustix::process::sched_setaffinity(None, &both).unwrap();
        // (Widening the affinity does not move a thread; the scheduler rarely does, soon.)
        let was_on_nic = softnic::shm::cores::current_cpu() == Some(nic);
        assert!(c.off_nic_core(), "a rank can always leave a core of two");
        assert_ne!(softnic::shm::cores::current_cpu(), Some(nic));
        if was_on_nic {
            let now = rustix::process::sched_getaffinity(None).unwrap();
            assert!(!now.is_set(nic as usize), "and stays off it");
        }
    })
    .join()
    .unwrap();
}

/// Two softnicd processes over the packet transport (raw Ethernet frames on loopback): hostile
/// frames addressed to a host's MAC — random bytes, a truncated datagram, an empty frame, one
/// sealed with the wrong secret — are counted and dropped, and a job then runs across both.
#[test]
fn hostile_frames_on_the_packet_transport_are_dropped_and_counted() {
    use softnic::transport::packet::{loopback_mac, PacketDriver, PacketLink};
    if !softnic::transport::packet::permitted() {
        eprintln!("skipped: packet sockets need CAP_NET_RAW (run as root, as CI does)");
        return;
    }
    let d = Daemons::start_with(2, softnic::config::TransportKind::Packet);
    assert!(d.stat().contains("packet"), "{}", d.stat());
    // An intruder with an address (and so a MAC) of its own on the same loopback.
    let me = std::net::SocketAddr::from(([127, 0, 0, 9], d.cfg.hosts[0].addr.port()));
    let link = PacketLink {
        interface: "lo".into(),
        macs: vec![loopback_mac(d.cfg.hosts[0].addr), loopback_mac(me)],
    };
    let mut x = PacketDriver::open(me, 1, &link, 1472, None).unwrap();
    for g in hostile_datagrams() {
        x.send(0, &g);
    }
    x.send(0, &[]);
    x.flush();
    wait_counted(&d, 1, 3);
    d.run_job_ok("small_job_body", 2);
    assert!(d.counter("packets_received") > 0);
}
