//! `softnic doctor`: what every daemon this machine can reach sees of its peers (after making
//! them all answer, see [`crate::transport::Transport::probe`]), in one table, and what to fix
//! — the answer to "it hangs and I don't know why". It reads the daemons' `softnic stat`
//! (their version, keys and one `peer` line per host) and reasons over all of them together:
//! a host nobody hears is down or unreachable; a host that hears nobody while others hear it
//! has its port blocked inbound; failed authentication names the pair whose keys differ; a
//! probe padded to the largest datagram that does not arrive whole means the path MTU is
//! smaller than `mtu`; clocks apart by more than [`CLOCK_SKEW_MS`] are named.

use crate::config::Config;

/// A peer heard from within this long counts as reachable.
pub const RECENT_MS: u64 = 3_000;
/// Hosts whose wall clocks differ by more than this are named (their logs and traces will not
/// line up).
pub const CLOCK_SKEW_MS: u64 = 1_000;

/// One `peer NAME …` line of a daemon's stat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLine {
    pub open: bool,
    pub rtt_us: Option<u64>,
    pub heard_ms: Option<u64>,
    pub heard: u64,
    pub auth_failures: u64,
    /// The largest datagram that arrived from it (bytes).
    pub largest: u64,
    /// Its wall clock less this host's (ms), from its last padded probe.
    pub clock_ms: Option<i64>,
}

impl PeerLine {
    pub fn hears(&self) -> bool {
        self.heard_ms.is_some_and(|ms| ms <= RECENT_MS)
    }
}

/// What one daemon says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostView {
    pub version: String,
    pub keys: String,
    /// The largest datagram it sends (0: not said).
    pub mtu: u64,
    /// By config host index.
    pub peers: Vec<Option<PeerLine>>,
}

/// Reads a daemon's stat text (hostile input: unknown or malformed lines are skipped).
pub fn parse_stat(text: &str, cfg: &Config) -> HostView {
    let mut v = HostView {
        peers: vec![None; cfg.hosts.len()],
        ..Default::default()
    };
    for line in text.lines() {
        let (k, rest) = line.split_once(' ').unwrap_or((line, ""));
        let rest = rest.trim();
        match k {
            "version" => v.version = rest.to_string(),
            "keys" => v.keys = rest.to_string(),
            "mtu" => v.mtu = rest.parse().unwrap_or(0),
            "peer" => {
                let mut words = rest.split_whitespace();
                let Some(name) = words.next() else { continue };
                let Ok(i) = cfg.host_index(name) else {
                    continue;
                };
                let state = words.next();
                let mut p = PeerLine {
                    open: state == Some("open"),
                    rtt_us: None,
                    heard_ms: None,
                    heard: 0,
                    auth_failures: 0,
                    largest: 0,
                    clock_ms: None,
                };
                for w in words {
                    let Some((key, val)) = w.split_once('=') else {
                        continue;
                    };
                    let n = val.parse::<u64>().ok();
                    match key {
                        "rtt_us" => p.rtt_us = n,
                        "heard_ms" => p.heard_ms = n,
                        "heard" => p.heard = n.unwrap_or(0),
                        "auth_failures" => p.auth_failures = n.unwrap_or(0),
                        "largest" => p.largest = n.unwrap_or(0),
                        "clock_ms" => p.clock_ms = val.parse().ok(),
                        _ => {}
                    }
                }
                v.peers[i as usize] = Some(p);
            }
            _ => {}
        }
    }
    v
}

/// The table and the list of problems.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub table: String,
    pub problems: Vec<String>,
    pub notes: Vec<String>,
}

/// Reasons over the views of the daemons this machine reaches (`views[i]`: host i's, if it
/// answered here).
pub fn diagnose(cfg: &Config, views: &[Option<HostView>], version: &str) -> Report {
    let n = cfg.hosts.len();
    let name = |i: usize| cfg.hosts[i].name.as_str();
    let addr = |i: usize| cfg.hosts[i].addr;
    let mut r = Report::default();
    let mut table = format!(
        "{:<14} {:<14} {:<8} {:>9} {:>10} {:>8} {:>10}  {}\n",
        "from", "to", "session", "rtt (µs)", "heard (ms)", "largest", "clock (ms)", "auth failures"
    );
    for (a, v) in views.iter().enumerate() {
        let Some(v) = v else { continue };
        for (b, p) in v.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            let show = |x: Option<u64>| x.map_or("-".to_string(), |x| x.to_string());
            table.push_str(&format!(
                "{:<14} {:<14} {:<8} {:>9} {:>10} {:>8} {:>10}  {}\n",
                name(a),
                name(b),
                if p.open { "open" } else { "closed" },
                show(p.rtt_us),
                show(p.heard_ms),
                p.largest,
                p.clock_ms.map_or("-".to_string(), |c| format!("{c:+}")),
                p.auth_failures
            ));
        }
    }
    r.table = table;
    let viewers: Vec<usize> = (0..n).filter(|&i| views[i].is_some()).collect();
    if viewers.is_empty() {
        r.problems.push(
            "no daemon of this config answers on this machine: start softnicd here, or run \
             `softnic doctor` on a host of the cluster"
                .into(),
        );
        return r;
    }
    for i in (0..n).filter(|i| views[*i].is_none()) {
        r.notes.push(format!(
            "host {} ({}): its daemon is not reachable from this machine; what its peers see of \
             it is below",
            name(i),
            addr(i)
        ));
    }
    let line = |a: usize, b: usize| views[a].as_ref().and_then(|v| v.peers[b].as_ref());
    let hears = |a: usize, b: usize| line(a, b).is_some_and(PeerLine::hears);
    for &a in &viewers {
        let v = views[a].as_ref().expect("a viewer has a view");
        if v.version != version {
            r.problems.push(format!(
                "host {}'s daemon is softnic {}, this is {version}: install one version everywhere",
                name(a),
                if v.version.is_empty() {
                    "(unknown)"
                } else {
                    &v.version
                },
            ));
        }
        match (
            &cfg.hosts[a].public_key,
            v.keys.strip_prefix("per-host, public key "),
        ) {
            (Some(want), Some(got)) if want != got => r.problems.push(format!(
                "host {}'s daemon uses public key {got}, this config lists {want}: the hosts have \
                 different configs, or {}'s key was made again",
                name(a),
                name(a)
            )),
            (Some(_), None) | (None, Some(_)) => r.problems.push(format!(
                "host {}'s daemon and this config disagree on the key mode (per-host keys or a \
                 cluster secret): restart it with this config",
                name(a)
            )),
            _ => {}
        }
        for b in (0..n).filter(|&b| b != a) {
            if let Some(p) = line(a, b).filter(|p| p.auth_failures > 0) {
                r.problems.push(format!(
                    "{} datagram(s) claiming to come from host {} failed authentication at host \
                     {}: {}'s key and {}'s config entry for it differ (one config file \
                     everywhere? a key made again?)",
                    p.auth_failures,
                    name(b),
                    name(a),
                    name(b),
                    name(a)
                ));
            }
        }
    }
    // Inbound blocked: a host that hears none of its peers while some of them hear it.
    let mut deaf = vec![false; n];
    for &a in &viewers {
        let others: Vec<usize> = (0..n).filter(|&b| b != a).collect();
        let heard_by_someone = viewers.iter().any(|&b| b != a && hears(b, a));
        if !others.is_empty() && others.iter().all(|&b| !hears(a, b)) && heard_by_someone {
            deaf[a] = true;
            r.problems.push(format!(
                "host {} receives nothing while its peers hear it: incoming UDP port {} is \
                 blocked on {} (firewall), or datagrams to {} go elsewhere",
                name(a),
                addr(a).port(),
                name(a),
                addr(a)
            ));
        }
    }
    // Path MTU: host a was asked for padded probes (it is a viewer with its session to b
    // open) and b hears a, but nothing that large arrived.
    for &a in &viewers {
        let mtu = views[a].as_ref().map_or(0, |v| v.mtu);
        for &b in viewers.iter().filter(|&&b| b != a) {
            let (Some(out), Some(inc)) = (line(a, b), line(b, a)) else {
                continue;
            };
            if mtu > 0 && out.open && inc.hears() && inc.largest < mtu {
                r.problems.push(format!(
                    "datagrams of {mtu} bytes from {} do not reach {} (the largest that did: {}):                      the path MTU between them is smaller; lower cluster.mtu (1472 on                      1500-byte Ethernet, 8972 with jumbo frames end to end)",
                    name(a),
                    name(b),
                    inc.largest
                ));
            }
        }
    }
    // Clocks: each pair once, as the later of the two views says.
    for &a in &viewers {
        for b in (0..n).filter(|&b| b > a || !viewers.contains(&b)) {
            let Some(skew) = line(a, b).and_then(|p| p.clock_ms) else {
                continue;
            };
            if skew.unsigned_abs() > CLOCK_SKEW_MS {
                r.problems.push(format!(
                    "host {}'s clock is {:.1} s {} host {}'s: run NTP (chrony) on both, or logs                      and traces will not line up",
                    name(b),
                    skew.unsigned_abs() as f64 / 1000.0,
                    if skew > 0 { "ahead of" } else { "behind" },
                    name(a)
                ));
            }
        }
    }
    // Silent: a host that no viewer hears.
    for b in 0..n {
        let judges: Vec<usize> = viewers
            .iter()
            .copied()
            .filter(|&a| a != b && !deaf[a])
            .collect();
        if judges.is_empty() || deaf[b] {
            continue;
        }
        if judges.iter().all(|&a| !hears(a, b)) {
            r.problems.push(format!(
                "host {} ({}) answers no one: is its softnicd running? is UDP port {} open \
                 there and on the way?",
                name(b),
                addr(b),
                addr(b).port()
            ));
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::local_default(3, 7700, "/tmp/x".into())
    }

    fn view(cfg: &Config, lines: &[&str]) -> Option<HostView> {
        let mut t = "version 0.1.0\nkeys cluster secret\n".to_string();
        for l in lines {
            t.push_str(l);
            t.push('\n');
        }
        Some(parse_stat(&t, cfg))
    }

    const OK: &str = "open rtt_us=40 heard_ms=10 heard=5 auth_failures=0";
    const SILENT: &str = "closed rtt_us=- heard_ms=- heard=0 auth_failures=0";

    #[test]
    fn healthy_cluster_has_no_problems() {
        let c = cfg();
        let views = vec![
            view(&c, &[&format!("peer h1 {OK}"), &format!("peer h2 {OK}")]),
            view(&c, &[&format!("peer h0 {OK}"), &format!("peer h2 {OK}")]),
            view(&c, &[&format!("peer h0 {OK}"), &format!("peer h1 {OK}")]),
        ];
        let r = diagnose(&c, &views, "0.1.0");
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!(r.table.lines().count(), 7);
    }

    #[test]
    fn a_blocked_inbound_port_names_its_host() {
        let c = cfg();
        let views = vec![
            view(
                &c,
                &[
                    &format!("peer h1 {OK}"),
                    "peer h2 closed heard_ms=20 heard=9",
                ],
            ),
            view(
                &c,
                &[
                    &format!("peer h0 {OK}"),
                    "peer h2 closed heard_ms=20 heard=9",
                ],
            ),
            view(
                &c,
                &[&format!("peer h0 {SILENT}"), &format!("peer h1 {SILENT}")],
            ),
        ];
        let r = diagnose(&c, &views, "0.1.0");
        assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
        assert!(
            r.problems[0].contains("host h2 receives nothing"),
            "{:?}",
            r.problems
        );
        assert!(r.problems[0].contains("UDP port 7700 is blocked on h2"));
    }

    #[test]
    fn a_silent_host_and_bad_keys_are_named() {
        let c = cfg();
        let views = vec![
            view(
                &c,
                &[&format!("peer h1 {OK}"), &format!("peer h2 {SILENT}")],
            ),
            view(
                &c,
                &[
                    "peer h0 open rtt_us=40 heard_ms=10 heard=5 auth_failures=3",
                    &format!("peer h2 {SILENT}"),
                ],
            ),
            None,
        ];
        let r = diagnose(&c, &views, "0.1.0");
        let all = r.problems.join("\n");
        assert!(
            all.contains("host h2 (127.0.0.4:7700) answers no one"),
            "{all}"
        );
        assert!(all.contains("claiming to come from host h0 failed authentication at host h1"));
        assert_eq!(r.notes.len(), 1);
        let r = diagnose(&c, &[None, None, None], "0.1.0");
        assert!(r.problems[0].contains("no daemon of this config answers"));
    }

    #[test]
    fn a_small_path_mtu_and_skewed_clocks_are_named() {
        let c = Config::local_default(2, 7700, "/tmp/x".into());
        let v = |peer: &str, largest: u64, clock: &str| {
            let t = format!(
                "version 0.1.0\nkeys cluster secret\nmtu 8972\npeer {peer} open rtt_us=40 \
                 heard_ms=10 heard=5 auth_failures=0 largest={largest} clock_ms={clock}\n"
            );
            Some(parse_stat(&t, &c))
        };
        // h0's jumbo probes reach h1 whole; h1's do not reach h0 (a 1500-byte hop on the way).
        let views = vec![v("h1", 1500, "-2500"), v("h0", 8972, "2500")];
        let r = diagnose(&c, &views, "0.1.0");
        let all = r.problems.join("\n");
        assert_eq!(r.problems.len(), 2, "{all}");
        assert!(
            all.contains(
                "datagrams of 8972 bytes from h1 do not reach h0 (the largest that did: 1500)"
            ),
            "{all}"
        );
        assert!(
            all.contains("host h1's clock is 2.5 s behind host h0's"),
            "{all}"
        );
        assert!(r.table.contains("-2500"), "{}", r.table);
        let views = vec![v("h1", 8972, "3"), v("h0", 8972, "-3")];
        assert!(diagnose(&c, &views, "0.1.0").problems.is_empty());
    }

    #[test]
    fn garbage_stat_lines_are_skipped() {
        let c = cfg();
        let v = parse_stat(
            "peer\npeer nobody open\npeer h1 open heard_ms=x =3 junk\nkeys",
            &c,
        );
        assert_eq!(v.peers[1].as_ref().map(|p| p.heard_ms), Some(None));
        assert!(v.peers[2].is_none());
    }
}
