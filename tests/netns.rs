//! Daemons on two "machines": network namespaces of their own joined by a veth pair, so
//! datagrams and frames cross real interfaces with real MACs — the LAN path (`interface` and
//! `mac` in the config for the packet transport). Needs root to make namespaces (CI runs as
//! root); says so and skips otherwise.

mod common;

use std::process::Command;

use common::netns::*;
use common::*;
use softnic::config::{Config, TransportKind};
use softnic::nic::memory::Perms;

/// Rank 0 on one namespace's daemon, rank 1 on the other's: a put larger than one Ethernet
/// frame (segmented), a get back, and fetching atomics both ways.
fn job_body() {
    let mut nic = init();
    let mem = nic.mem_register(1 << 17, Perms::READ_WRITE).unwrap();
    nic.barrier().unwrap();
    let peer = 1 - nic.rank();
    let data = pattern(100_000, nic.rank() as u64);
    nic.put(remote(peer, mem.handle, 0), &data).unwrap();
    assert_eq!(nic.afadd(remote(peer, mem.handle, 120_000), 5).unwrap(), 0);
    nic.barrier().unwrap();
    assert_eq!(&mem.bytes()[..100_000], &pattern(100_000, peer as u64)[..]);
    let mut back = vec![0u8; 100_000];
    nic.get(&mut back, remote(peer, mem.handle, 0)).unwrap();
    assert_eq!(back, data);
    assert_eq!(mem.read_u64(120_000), 5);
    nic.barrier().unwrap();
}

#[test]
fn daemons_in_two_namespaces_over_a_veth_pair_packet_udp_and_tcp() {
    if in_job() {
        return job_body();
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: making network namespaces needs root (CI runs as root)");
        return;
    }
    for (tag, transport, mtu) in [
        ("p", TransportKind::Packet, 1500),
        ("u", TransportKind::Udp, 1472),
        ("t", TransportKind::Tcp, 1472),
    ] {
        let pair = Pair::new(tag).unwrap();
        let dir = std::env::temp_dir().join(format!(
            "softnic-netns-{}-{tag}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let mut cfg = Config::local_default(2, 7700, dir);
        cfg.cluster.transport = transport;
        cfg.cluster.mtu = mtu;
        // Two daemons on one machine: leave their placement to the scheduler.
        cfg.cluster.nic_cpu = None;
        for (i, h) in cfg.hosts.iter_mut().enumerate() {
            h.addr = format!("10.77.0.{}:7700", i + 1).parse().unwrap();
            h.interface = Some(pair.ifs[i].clone());
            h.mac = Some(pair.mac(i).unwrap());
        }
        cfg.validate().unwrap();
        let d = Daemons::start_config(cfg, &pair.ns);
        d.run_job_ok(
            "daemons_in_two_namespaces_over_a_veth_pair_packet_udp_and_tcp",
            2,
        );
        let stat = d.stat();
        assert!(stat.contains(transport.name()), "{stat}");
        // Over TCP the kernel segments the stream: frames of 65,000 bytes whatever the MTU.
        let frame = if transport == TransportKind::Tcp {
            assert_eq!(d.counter("mtu"), 2 * 65_000, "{stat}");
            65_000
        } else {
            1500
        };
        assert!(
            d.counter("packets_received") > 2 * 100_000 / frame,
            "the put and get crossed as many datagrams:\n{stat}"
        );
        assert_eq!(d.counter("auth_failures"), 0, "{stat}");
        if transport == TransportKind::Udp {
            // 1472-byte datagrams: the put's run left in GSO sends, and arrived joined.
            assert!(d.counter("gso_sends") > 0, "{stat}");
            assert!(d.counter("gro_joined") > 0, "{stat}");
        }
        drop(d);
    }
}

/// RandomAccess over gni: `updates` AXORs per rank to words spread over the whole table
/// (2^16 words per rank), then the same again, so every word must be back to zero.
fn random_access(updates: u64, rounds: u32) {
    const WORDS: u64 = 1 << 16;
    let mut nic = init();
    let mem = nic
        .mem_register((WORDS * 8) as usize, Perms::READ_WRITE)
        .unwrap();
    nic.barrier().unwrap();
    let total = WORDS * nic.size() as u64;
    for _ in 0..rounds * 2 {
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ nic.rank() as u64;
        for _ in 0..updates {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let w = x % total;
            let dst = remote((w / WORDS) as u32, mem.handle, (w % WORDS) * 8);
            nic.amo_nbi(softnic::wire::AmoOp::Axor, dst, x, 0)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        nic.gsync_wait().unwrap_or_else(|e| panic!("{e}"));
        nic.barrier().unwrap_or_else(|e| panic!("{e}"));
    }
    let errors = (0..WORDS)
        .filter(|&i| mem.read_u64(i as usize * 8) != 0)
        .count();
    assert_eq!(errors, 0, "RandomAccess verification errors");
    nic.barrier().unwrap();
}

/// Two namespace hosts, each with its own softnicd, the kernel dropping 10% of incoming UDP:
/// RandomAccess verifies exactly; a daemon SIGKILLed in the middle of a job makes the job end
/// with an error naming that host; started again, it takes the next job at once.
#[test]
fn lossy_namespaces_randomaccess_verifies_and_a_killed_daemon_is_named() {
    if in_job() {
        return match std::env::var("SOFTNIC_TEST_PHASE").as_deref() {
            Ok("ra") => random_access(1 << 16, 1),
            Ok("long") => random_access(1 << 16, 1000),
            _ => job_body(),
        };
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: network namespaces and nftables need root (CI runs as root)");
        return;
    }
    let test = "lossy_namespaces_randomaccess_verifies_and_a_killed_daemon_is_named";
    let (pair, mut d) = udp_daemons("l", 7701);
    let config = d.config.clone();
    let run = |phase: &str| {
        Command::new(env!("CARGO_BIN_EXE_softnic"))
            .args(["run", "-n", "2", "--attach", "--config"])
            .arg(&config)
            .arg("--")
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture"])
            .env("SOFTNIC_TEST_PHASE", phase)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };

    // A job that must succeed; how long it took, launch included.
    let run_ok = |phase: &str, what: &str| {
        let t = std::time::Instant::now();
        let out = run(phase).wait_with_output().unwrap();
        let took = t.elapsed();
        assert!(
            out.status.success(),
            "{what}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{what}: {took:?}");
    };

    // RandomAccess loss-free, then with the kernel dropping 10%: exact, and the loss real.
    run_ok("ra", "RandomAccess 2^16 words/rank loss-free");
    for ns in &pair.ns {
        drop_tenth_of_udp(ns).unwrap();
    }
    run_ok("ra", "RandomAccess 2^16 words/rank at 10% loss");
    let retransmits = d.counter("retransmits");
    assert!(
        retransmits > 100,
        "the kernel dropped datagrams:\n{}",
        d.stat()
    );
    assert_eq!(d.counter("peers_declared_dead"), 0, "{}", d.stat());

    // SIGKILL host 1's daemon in the middle of a long job.
    let job = run("long");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    d.kill(1);
    let t = std::time::Instant::now();
    let out = job.wait_with_output().unwrap();
    let waited = t.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the job survived a dead daemon?\n{stderr}"
    );
    assert!(
        waited < std::time::Duration::from_secs(3 + 10),
        "ended {waited:?} after the kill (peer_timeout 3 s)"
    );
    assert!(
        stderr.contains("host 1"),
        "the error names the dead host:\n{stderr}"
    );

    // Started again: the next job works at once.
    d.restart(1);
    run_ok("small", "job right after the restart");
}

/// `softnic doctor` on two namespace hosts: all well, then with host 1's UDP port blocked
/// inbound by nftables it names host 1 and the port, and exits 1.
#[test]
fn doctor_names_the_host_whose_port_is_blocked() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: network namespaces and nftables need root (CI runs as root)");
        return;
    }
    let (pair, d) = udp_daemons("d", 7703);
    let doctor = || {
        Command::new(env!("CARGO_BIN_EXE_softnic"))
            .args(["doctor", "--config"])
            .arg(&d.config)
            .output()
            .unwrap()
    };
    let out = doctor();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("ok: every daemon reached from here hears every peer"),
        "{text}"
    );

    let rules = "table inet softnic_block {\n chain input {\n  type filter hook input priority 0;\n  udp dport 7703 drop\n }\n}\n";
    let mut nft = Command::new("ip")
        .args(["netns", "exec", &pair.ns[1], "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    nft.stdin
        .take()
        .unwrap()
        .write_all(rules.as_bytes())
        .unwrap();
    assert!(nft.wait().unwrap().success());
    // Long enough for what host 1 heard before to age past "recent".
    std::thread::sleep(std::time::Duration::from_millis(3200));
    let out = doctor();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("fix: host h1 receives nothing while its peers hear it: incoming UDP port 7703 is blocked on h1"),
        "{text}"
    );
}

/// Two networks between the namespace hosts, UDP on the first dropped by nftables: with the
/// data network selected — as a CIDR in the config, then by interface name with `--iface` —
/// a job passes, so every datagram went over the selected network, and `softnic stat` says
/// where each daemon is.
#[test]
fn iface_selects_the_network_by_cidr_or_name() {
    if in_job() {
        return job_body();
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: network namespaces and nftables need root (CI runs as root)");
        return;
    }
    let pair = Pair::new("i").unwrap();
    let data = format!("sd{}", std::process::id() % 100_000);
    pair.add_network(&data, "10.78.0").unwrap();
    for i in 0..2 {
        let rules = format!(
            "table inet softnic_mgmt {{\n chain input {{\n  type filter hook input priority 0;\n  iifname \"{}\" meta l4proto udp drop\n }}\n}}\n",
            pair.ifs[i]
        );
        nft(&pair.ns[i], &rules).unwrap();
    }
    for (round, (iface, args)) in [
        (Some("10.78.0.0/24"), vec![]),
        (None, vec!["--iface", data.as_str()]),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = std::env::temp_dir().join(format!(
            "softnic-iface-{}-{round}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let mut cfg = Config::local_default(2, 7704, dir);
        cfg.cluster.transport = TransportKind::Udp;
        cfg.cluster.mtu = 1472;
        cfg.cluster.nic_cpu = None;
        cfg.cluster.peer_timeout_ms = 3000;
        cfg.cluster.iface = iface.map(str::to_string);
        for (i, h) in cfg.hosts.iter_mut().enumerate() {
            h.addr = format!("10.77.0.{}:7704", i + 1).parse().unwrap();
            h.addrs = vec![format!("10.78.0.{}:7704", i + 1).parse().unwrap()];
        }
        cfg.validate().unwrap();
        let d = Daemons::start_config_args(cfg, &pair.ns, &args);
        d.run_job_ok("iface_selects_the_network_by_cidr_or_name", 2);
        let stat = d.stat();
        assert!(
            stat.contains(&format!("10.78.0.1:7704 on {data}"))
                && stat.contains(&format!("10.78.0.2:7704 on {data}")),
            "round {round}: the daemons say where they are:\n{stat}"
        );
        assert!(d.counter("packets_received") > 2 * 100_000 / 1472, "{stat}");
        drop(d);
    }
}

/// `softnic doctor` finds a path MTU below the configured datagram size: host 1's interface
/// takes at most 1400 bytes, so host 0's 1472-byte probes never arrive whole, while small
/// datagrams (greetings, acks) go both ways.
#[test]
fn doctor_names_a_path_mtu_below_the_configured_mtu() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: network namespaces need root (CI runs as root)");
        return;
    }
    let (pair, d) = udp_daemons("m", 7705);
    ip(&[
        "-n",
        &pair.ns[1],
        "link",
        "set",
        "dev",
        &pair.ifs[1],
        "mtu",
        "1400",
    ])
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_softnic"))
        .args(["doctor", "--config"])
        .arg(&d.config)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("datagrams of 1472 bytes from h0 do not reach h1"),
        "{text}"
    );
    assert!(!text.contains("from h1 do not reach h0"), "{text}");
    assert!(
        !text.contains("clock is"),
        "one machine, one clock:\n{text}"
    );
}
