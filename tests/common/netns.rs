//! Hosts as network namespaces joined by a veth pair, and the loss of an unreliable LAN made
//! by the kernel (nftables). Root only; callers say why they skip otherwise.

use std::process::Command;

pub fn ip(args: &[&str]) -> Result<String, String> {
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
pub struct Pair {
    pub ns: Vec<String>,
    pub ifs: [String; 2],
}

impl Pair {
    pub fn new(tag: &str) -> Result<Pair, String> {
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

    /// A second network between the two namespaces: a veth pair called `name` on both sides
    /// (as a uniform cluster's data interface), addresses `prefix`.1 and `prefix`.2 /24.
    pub fn add_network(&self, name: &str, prefix: &str) -> Result<(), String> {
        ip(&[
            "link",
            "add",
            name,
            "netns",
            &self.ns[0],
            "type",
            "veth",
            "peer",
            "name",
            name,
            "netns",
            &self.ns[1],
        ])?;
        for i in 0..2 {
            let ns = &self.ns[i];
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{prefix}.{}/24", i + 1),
                "dev",
                name,
            ])?;
            ip(&["-n", ns, "link", "set", name, "up"])?;
        }
        Ok(())
    }

    /// Interface `i`'s MAC as `ip` prints it.
    pub fn mac(&self, i: usize) -> Result<String, String> {
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

/// Loads nftables `rules` in namespace `ns`.
pub fn nft(ns: &str, rules: &str) -> Result<(), String> {
    let mut c = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("nft: {e} (install nftables)"))?;
    use std::io::Write;
    c.stdin.take().unwrap().write_all(rules.as_bytes()).unwrap();
    let out = c.wait_with_output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("nft: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// Installs the loss of an unreliable LAN in namespace `ns`: the kernel drops one incoming UDP
/// datagram in ten at random (nftables `numgen random`; netem is not available everywhere).
pub fn drop_tenth_of_udp(ns: &str) -> Result<(), String> {
    nft(
        ns,
        "table inet softnic_loss {\n\
         \tchain input {\n\
         \t\ttype filter hook input priority 0;\n\
         \t\tmeta l4proto udp numgen random mod 10 0 drop\n\
         \t}\n\
         }\n",
    )
}

/// Two namespace hosts (`tag` names the pair), each with its own softnicd on UDP with
/// 1472-byte datagrams and a `peer_timeout_ms` of 3 s; loss is added by the caller.
pub fn udp_daemons(tag: &str, port: u16) -> (Pair, super::Daemons) {
    let pair = Pair::new(tag).unwrap();
    let dir = std::env::temp_dir().join(format!(
        "softnic-ns{tag}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let mut cfg = softnic::config::Config::local_default(2, port, dir);
    cfg.cluster.transport = softnic::config::TransportKind::Udp;
    cfg.cluster.mtu = 1472;
    // Two daemons on one machine: leave their placement to the scheduler.
    cfg.cluster.nic_cpu = None;
    cfg.cluster.peer_timeout_ms = 3000;
    for (i, h) in cfg.hosts.iter_mut().enumerate() {
        h.addr = format!("10.77.0.{}:{port}", i + 1).parse().unwrap();
    }
    cfg.validate().unwrap();
    let d = super::Daemons::start_config(cfg, &pair.ns);
    (pair, d)
}
