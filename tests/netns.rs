//! Daemons on two "machines": network namespaces of their own joined by a veth pair, so
//! datagrams and frames cross real interfaces with real MACs — the LAN path (`interface` and
//! `mac` in the config for the packet transport). Needs root to make namespaces (CI runs as
//! root); says so and skips otherwise.

mod common;

use std::process::Command;

use common::*;
use softnic::config::{Config, TransportKind};
use softnic::nic::memory::Perms;

fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Two namespaces with a veth pair between them (10.77.0.1 and .2), deleted on drop.
struct Pair {
    ns: Vec<String>,
    ifs: [String; 2],
}

impl Pair {
    fn new(tag: &str) -> Result<Pair, String> {
        let id = std::process::id() % 100_000;
        let mut p = Pair {
            ns: Vec::new(),
            ifs: [format!("sv{id}{tag}0"), format!("sv{id}{tag}1")],
        };
        for i in 0..2 {
            let ns = format!("sn{id}{tag}{i}");
            ip(&["netns", "add", &ns])?;
            p.ns.push(ns);
        }
        let (a, b) = (&p.ifs[0], &p.ifs[1]);
        ip(&[
            "link", "add", a, "netns", &p.ns[0], "type", "veth", "peer", "name", b, "netns",
            &p.ns[1],
        ])?;
        for i in 0..2 {
            let (ns, dev) = (&p.ns[i], &p.ifs[i]);
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("10.77.0.{}/24", i + 1),
                "dev",
                dev,
            ])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(p)
    }

    /// Interface `i`'s MAC as `ip` prints it.
    fn mac(&self, i: usize) -> Result<String, String> {
        let out = ip(&["-n", &self.ns[i], "-br", "link", "show", &self.ifs[i]])?;
        out.split_whitespace()
            .nth(2)
            .map(str::to_string)
            .ok_or_else(|| format!("no MAC in {out:?}"))
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

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
fn daemons_in_two_namespaces_over_a_veth_pair_packet_and_udp() {
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
            "daemons_in_two_namespaces_over_a_veth_pair_packet_and_udp",
            2,
        );
        let stat = d.stat();
        assert!(stat.contains(transport.name()), "{stat}");
        assert!(
            d.counter("packets_received") > 2 * 100_000 / 1500,
            "the put and get crossed as many datagrams:\n{stat}"
        );
        assert_eq!(d.counter("auth_failures"), 0, "{stat}");
        drop(d);
    }
}
