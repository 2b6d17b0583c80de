//! Cluster configuration: TOML, then `SOFTNIC_*` environment overrides, then checks.
//!
//! ```toml
//! [cluster]
//! secret = "<64 hex digits>"      # or secret_file = "/etc/softnic/key"
//! transport = "udp"               # or "tcp", or "packet" (raw Ethernet, needs CAP_NET_RAW)
//! mtu = 1472                      # datagram size over udp and packet (tcp: 65,000 frames)
//! peer_timeout_ms = 10000
//! runtime_dir = "/tmp/softnic"    # attach sockets live here as <host>.sock
//!
//! [fault]                         # optional: seeded fault injection on sent datagrams
//! drop = 0.1
//! duplicate = 0.05
//! seed = 1
//!
//! [[host]]
//! name = "h0"
//! addr = "127.0.0.1:7700"
//! # packet transport off loopback: the host's interface and MAC
//! # interface = "eth0"
//! # mac = "52:54:00:12:34:56"
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::wire::Key;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {path} is not valid TOML for softnic: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    #[default]
    Udp,
    Tcp,
    /// Raw Ethernet frames through a receive ring shared with the kernel (needs CAP_NET_RAW).
    Packet,
}

impl TransportKind {
    /// The name configs and `SOFTNIC_TRANSPORT` use.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Udp => "udp",
            TransportKind::Tcp => "tcp",
            TransportKind::Packet => "packet",
        }
    }

    /// The local default's transport: packet where this process may open packet sockets
    /// (the daemons it starts inherit that), else UDP.
    pub fn best_local() -> TransportKind {
        if crate::transport::packet::permitted() {
            TransportKind::Packet
        } else {
            TransportKind::Udp
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// The cluster secret as 64 hex digits (authenticates every datagram).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// A file holding the secret as 64 hex digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// Per-host keys (instead of a secret): this host's private key, made by `softnic keygen`
    /// (the same path on every host, a different key in each); every `[[host]]` then has its
    /// `public_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_key_file: Option<PathBuf>,
    #[serde(default)]
    pub transport: TransportKind,
    #[serde(default = "default_mtu")]
    pub mtu: usize,
    #[serde(default = "default_window")]
    pub window: usize,
    #[serde(default = "default_peer_timeout")]
    pub peer_timeout_ms: u64,
    #[serde(default = "default_runtime_dir")]
    pub runtime_dir: PathBuf,
    /// Group whose members may attach besides the daemon's own user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_gid: Option<u32>,
    /// Microseconds the daemon spins idle before it yields, then sleeps.
    #[serde(default = "default_spin_us")]
    pub spin_us: u64,
    /// The core the daemon's thread is pinned to, as a NIC has its own silicon: an index into
    /// the CPUs the daemon may use, negative from the end (-1 = the last). Unset: not pinned.
    /// A pinned daemon yields its core only to clients waiting on it, and a rank blocked on one
    /// operation moves off it (each handoff on a shared core costs a context switch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nic_cpu: Option<i64>,
    /// The network the daemons talk over, as an interface name (`eth1`) or a CIDR
    /// (`10.2.0.0/16`); each host is then at its address on that network (`addr` or one of
    /// `addrs`). Unset: each host's `addr`. `SOFTNIC_IFACE` and `--iface` override it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iface: Option<String>,
}

/// Largest datagram without jumbo frames (Ethernet's 1500 less IP and UDP headers).
pub const DEFAULT_MTU: usize = 1472;
/// The local default's datagram size: loopback carries 64 KiB, and a datagram that holds
/// seven times more ops than a jumbo frame means fewer system calls and authentication tags
/// per op (RandomAccess ~2.1 → ~2.6 Mupdates/s, 1 MiB put_nbi ~750 → ~1100 MB/s, measured).
pub const LOOPBACK_MTU: usize = 65_000;

fn default_mtu() -> usize {
    DEFAULT_MTU
}
fn default_window() -> usize {
    512
}
fn default_peer_timeout() -> u64 {
    10_000
}
fn default_runtime_dir() -> PathBuf {
    std::env::temp_dir().join("softnic")
}
fn default_spin_us() -> u64 {
    200
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    #[serde(default)]
    pub drop: f64,
    #[serde(default)]
    pub duplicate: f64,
    #[serde(default)]
    pub seed: u64,
}

/// The fault-injection flags of the binaries that start daemons (testing only).
#[derive(Debug, Clone, clap::Args)]
pub struct FaultArgs {
    /// Fault injection: probability of dropping each datagram sent (testing only).
    #[arg(long, default_value_t = 0.0)]
    pub fault_drop: f64,
    /// Fault injection: probability of sending a datagram twice (testing only).
    #[arg(long, default_value_t = 0.0)]
    pub fault_duplicate: f64,
    /// Seed of the fault injector, for repeatable runs.
    #[arg(long, default_value_t = 1)]
    pub fault_seed: u64,
}

impl FaultArgs {
    /// The faults asked for, if any.
    pub fn fault(&self) -> Option<Fault> {
        (self.fault_drop > 0.0 || self.fault_duplicate > 0.0).then_some(Fault {
            drop: self.fault_drop,
            duplicate: self.fault_duplicate,
            seed: self.fault_seed,
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    pub name: String,
    pub addr: SocketAddr,
    /// This host's addresses on other networks, for `cluster.iface` to choose from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addrs: Vec<SocketAddr>,
    /// The interface this host sends and receives on: the packet transport's (default `lo` for
    /// a loopback address); UDP and TCP sockets are pinned to it (default: the interface that
    /// holds the address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// Packet transport: this host's MAC, `aa:bb:cc:dd:ee:ff` (derived from the address on
    /// loopback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Per-host keys: this host's public key as `softnic keygen` printed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    /// This host's private key file, when not the cluster's `private_key_file` (several hosts
    /// of one config on one machine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_key_file: Option<PathBuf>,
    /// Where the ssh spawner logs in to reach this host (`[user@]name`; default: the
    /// address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh: Option<String>,
    /// This host's daemon's core, as the cluster's `nic_cpu` (which it overrides): hosts of
    /// different shapes, or several hosts on one machine (namespaces, containers), each NIC
    /// on a core of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nic_cpu: Option<i64>,
}

impl Host {
    /// The ssh destination of this host.
    pub fn ssh_target(&self) -> String {
        self.ssh
            .clone()
            .unwrap_or_else(|| self.addr.ip().to_string())
    }
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut m = [0u8; 6];
    let mut parts = s.split(':');
    for b in m.iter_mut() {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(m)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub cluster: Cluster,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<Fault>,
    #[serde(rename = "host")]
    pub hosts: Vec<Host>,
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        let mut c: Config = toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.into(),
            source,
        })?;
        c.apply_env();
        c.validate()?;
        c.select_network()?;
        Ok(c)
    }

    /// Puts every host at its address on the network `cluster.iface` selects (a no-op without
    /// one). Every process of a job applies the same selection, so all agree on the addresses.
    pub fn select_network(&mut self) -> Result<(), ConfigError> {
        use crate::transport::iface::{local_ifaces, pick, Selection};
        let Some(sel) = &self.cluster.iface else {
            return Ok(());
        };
        let invalid = |e: crate::transport::iface::IfaceError| {
            ConfigError::Invalid(format!("iface {sel}: {e}"))
        };
        let sel = Selection::parse(sel).map_err(invalid)?;
        let here = match sel {
            Selection::Name(_) => local_ifaces().map_err(invalid)?,
            Selection::Cidr(_) => Vec::new(),
        };
        let nets = sel.networks(&here).map_err(invalid)?;
        for h in &mut self.hosts {
            let all: Vec<SocketAddr> = std::iter::once(h.addr).chain(h.addrs.drain(..)).collect();
            let chosen = pick(&h.name, &all, &nets).map_err(invalid)?;
            // The others stay in `addrs`, so another selection may still choose among all.
            h.addrs = all.into_iter().filter(|a| *a != chosen).collect();
            h.addr = chosen;
        }
        self.validate()
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: "<string>".into(),
            source,
        })?;
        c.validate()?;
        Ok(c)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("config serialises")
    }

    /// `SOFTNIC_TRANSPORT`, `SOFTNIC_MTU`, `SOFTNIC_PEER_TIMEOUT_MS`, `SOFTNIC_RUNTIME_DIR`,
    /// `SOFTNIC_NIC_CPU` (an index as `nic_cpu`, or `none`), `SOFTNIC_IFACE` (as `iface`).
    pub fn apply_env(&mut self) {
        if let Ok(v) = std::env::var("SOFTNIC_IFACE") {
            self.cluster.iface = (!v.is_empty()).then_some(v);
        }
        if let Ok(v) = std::env::var("SOFTNIC_TRANSPORT") {
            match v.as_str() {
                "udp" => self.cluster.transport = TransportKind::Udp,
                "tcp" => self.cluster.transport = TransportKind::Tcp,
                "packet" => self.cluster.transport = TransportKind::Packet,
                _ => tracing::warn!("ignoring SOFTNIC_TRANSPORT={v}: expected udp, tcp or packet"),
            }
        }
        if let Some(v) = std::env::var("SOFTNIC_MTU")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            self.cluster.mtu = v;
        }
        if let Some(v) = std::env::var("SOFTNIC_PEER_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            self.cluster.peer_timeout_ms = v;
        }
        if let Ok(v) = std::env::var("SOFTNIC_RUNTIME_DIR") {
            self.cluster.runtime_dir = v.into();
        }
        if let Ok(v) = std::env::var("SOFTNIC_NIC_CPU") {
            let set = match v.as_str() {
                "none" | "" => Some(None),
                n => n.parse().ok().map(Some),
            };
            match set {
                Some(cpu) => {
                    // It overrides the hosts' own too.
                    self.cluster.nic_cpu = cpu;
                    self.hosts.iter_mut().for_each(|h| h.nic_cpu = None);
                }
                None => tracing::warn!("ignoring SOFTNIC_NIC_CPU={v}: expected an index or none"),
            }
        }
    }

    /// The core for a daemon serving `indices`: a lone host's own `nic_cpu`, else the
    /// cluster's (one thread serving several hosts has one core).
    pub fn nic_cpu_for(&self, indices: &[u16]) -> Option<i64> {
        match indices {
            [one] => self
                .hosts
                .get(*one as usize)
                .and_then(|h| h.nic_cpu)
                .or(self.cluster.nic_cpu),
            _ => self.cluster.nic_cpu,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |s: String| Err(ConfigError::Invalid(s));
        if self.hosts.is_empty() || self.hosts.len() > 4096 {
            return bad(format!(
                "{} hosts: need 1 to 4096 [[host]] entries",
                self.hosts.len()
            ));
        }
        if !(576..=65_507).contains(&self.cluster.mtu) {
            return bad(format!("mtu {} outside 576..=65507", self.cluster.mtu));
        }
        if !(8..=65_536).contains(&self.cluster.window) {
            return bad(format!("window {} outside 8..=65536", self.cluster.window));
        }
        if self.cluster.peer_timeout_ms < 100 {
            return bad("peer_timeout_ms below 100 would declare healthy peers dead".into());
        }
        for (i, h) in self.hosts.iter().enumerate() {
            if self.hosts[..i]
                .iter()
                .any(|o| o.name == h.name || o.addr == h.addr)
            {
                return bad(format!(
                    "host {} (or its address {}) is listed twice",
                    h.name, h.addr
                ));
            }
        }
        if let Some(sel) = &self.cluster.iface {
            crate::transport::iface::Selection::parse(sel)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        if let Some(f) = &self.fault {
            if !(0.0..1.0).contains(&f.drop) || !(0.0..1.0).contains(&f.duplicate) {
                return bad("fault.drop and fault.duplicate must be in [0, 1)".into());
            }
        }
        for h in &self.hosts {
            if let Some(t) = &h.ssh {
                // It becomes an ssh argument: no options, no spaces.
                if t.is_empty() || t.starts_with('-') || t.chars().any(char::is_whitespace) {
                    return bad(format!("host {}: ssh {t:?} is not a [user@]host", h.name));
                }
            }
            if let Some(m) = &h.mac {
                if parse_mac(m).is_none() {
                    return bad(format!(
                        "host {}: mac {m:?} is not aa:bb:cc:dd:ee:ff",
                        h.name
                    ));
                }
            }
        }
        if self.cluster.transport == TransportKind::Packet {
            for i in 0..self.hosts.len() {
                self.packet_link(i as u16)?;
            }
        }
        if self.per_host_keys() {
            if self.cluster.secret.is_some() || self.cluster.secret_file.is_some() {
                return bad(
                    "use either a cluster secret or per-host keys (public_key), not both".into(),
                );
            }
            if let Some(h) = self
                .hosts
                .iter()
                .find(|h| h.private_key_file.is_none() && self.cluster.private_key_file.is_none())
            {
                return bad(format!(
                    "per-host keys: host {} needs a private key file (cluster.private_key_file, \
                     made by softnic keygen)",
                    h.name
                ));
            }
            let mut seen: Vec<[u8; 32]> = Vec::new();
            for h in &self.hosts {
                let k = match &h.public_key {
                    Some(k) => k,
                    None => {
                        return bad(format!(
                            "host {} has no public_key (every host needs one when any has)",
                            h.name
                        ))
                    }
                };
                let k = crate::keys::parse_hex32(k, &format!("host {}'s public_key", h.name))
                    .map_err(|e| ConfigError::Invalid(e.to_string()))?;
                if seen.contains(&k) {
                    return bad(format!(
                        "host {}'s public_key is another host's too",
                        h.name
                    ));
                }
                seen.push(k);
            }
            return Ok(());
        }
        if self.cluster.secret.is_none() && self.cluster.secret_file.is_none() {
            return bad(
                "set cluster.secret or cluster.secret_file, or per-host keys (softnic keygen)"
                    .into(),
            );
        }
        self.key().map(|_| ())
    }

    /// Whether datagrams use per-host keys (some host has a `public_key`).
    pub fn per_host_keys(&self) -> bool {
        self.hosts.iter().any(|h| h.public_key.is_some())
    }

    /// The datagram keys of host `index`: the cluster secret for every peer, or with per-host
    /// keys, one per peer derived from this host's private key (which must be the one whose
    /// public key the config lists for it) and each peer's public key.
    pub fn keys_for(&self, index: u16) -> Result<crate::keys::Keys, ConfigError> {
        if !self.per_host_keys() {
            return Ok(self.key()?.into());
        }
        let me = self
            .hosts
            .get(index as usize)
            .ok_or_else(|| ConfigError::Invalid(format!("no host {index}")))?;
        let path = me
            .private_key_file
            .as_ref()
            .or(self.cluster.private_key_file.as_ref())
            .ok_or_else(|| ConfigError::Invalid("no cluster.private_key_file".into()))?;
        let key = crate::keys::HostKey::load(path)
            .map_err(|e| ConfigError::Invalid(format!("host {}: {e}", me.name)))?;
        let publics = self
            .hosts
            .iter()
            .map(|h| {
                let k = h.public_key.as_deref().unwrap_or_default();
                crate::keys::parse_hex32(k, &format!("host {}'s public_key", h.name))
                    .map_err(|e| ConfigError::Invalid(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if key.public() != publics[index as usize] {
            return Err(ConfigError::Invalid(format!(
                "the private key in {} is not host {}'s: its public key is {}, the config lists \
                 {} (wrong key file, or the config's public_key for {} is out of date)",
                path.display(),
                me.name,
                crate::keys::hex(&key.public()),
                crate::keys::hex(&publics[index as usize]),
                me.name
            )));
        }
        Ok(key.pair_keys(index as usize, &publics))
    }

    /// The cluster secret.
    pub fn key(&self) -> Result<Key, ConfigError> {
        let text = match (&self.cluster.secret, &self.cluster.secret_file) {
            (Some(s), _) => s.clone(),
            (None, Some(p)) => std::fs::read_to_string(p).map_err(|e| {
                ConfigError::Invalid(format!("cannot read secret_file {}: {e}", p.display()))
            })?,
            (None, None) => return Err(ConfigError::Invalid("no cluster secret".into())),
        };
        parse_hex_key(text.trim())
            .ok_or_else(|| ConfigError::Invalid("the cluster secret must be 64 hex digits".into()))
    }

    pub fn host_index(&self, name: &str) -> Result<u16, ConfigError> {
        self.hosts
            .iter()
            .position(|h| h.name == name)
            .map(|i| i as u16)
            .ok_or_else(|| ConfigError::Invalid(format!("no host named {name:?} in the config")))
    }

    /// Host `index`'s interface and every host's MAC, for the packet transport.
    pub fn packet_link(
        &self,
        index: u16,
    ) -> Result<crate::transport::packet::PacketLink, ConfigError> {
        let me = &self.hosts[index as usize];
        let interface = match (&me.interface, me.addr.ip().is_loopback()) {
            (Some(i), _) => i.clone(),
            (None, true) => "lo".into(),
            (None, false) => {
                return Err(ConfigError::Invalid(format!(
                    "host {}: the packet transport needs its `interface` (off loopback)",
                    me.name
                )))
            }
        };
        let macs = self
            .hosts
            .iter()
            .map(|h| match (&h.mac, h.addr.ip().is_loopback()) {
                (Some(m), _) => parse_mac(m)
                    .ok_or_else(|| ConfigError::Invalid(format!("host {}: bad mac {m:?}", h.name))),
                (None, true) => Ok(crate::transport::packet::loopback_mac(h.addr)),
                (None, false) => Err(ConfigError::Invalid(format!(
                    "host {}: the packet transport needs its `mac` (off loopback)",
                    h.name
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if let Some((i, _)) = macs
            .iter()
            .enumerate()
            .find(|(i, m)| macs[..*i].contains(m))
        {
            return Err(ConfigError::Invalid(format!(
                "host {}: its MAC is another host's too",
                self.hosts[i].name
            )));
        }
        Ok(crate::transport::packet::PacketLink { interface, macs })
    }

    pub fn socket_path(&self, host: u16) -> PathBuf {
        self.cluster
            .runtime_dir
            .join(format!("{}.sock", self.hosts[host as usize].name))
    }

    /// The local default: `n` hosts on 127.0.0.2.., fresh secret, its own runtime dir.
    pub fn local_default(n: usize, base_port: u16, runtime_dir: PathBuf) -> Config {
        let secret: [u8; 32] = rand::random();
        Config {
            cluster: Cluster {
                secret: Some(secret.iter().map(|b| format!("{b:02x}")).collect()),
                secret_file: None,
                private_key_file: None,
                transport: TransportKind::Udp,
                mtu: LOOPBACK_MTU,
                window: default_window(),
                peer_timeout_ms: default_peer_timeout(),
                runtime_dir,
                allowed_gid: None,
                spin_us: default_spin_us(),
                nic_cpu: Some(-1),
                iface: None,
            },
            fault: None,
            hosts: (0..n)
                .map(|i| Host {
                    name: format!("h{i}"),
                    addr: SocketAddr::from(([127, 0, 0, 2 + i as u8], base_port)),
                    addrs: Vec::new(),
                    interface: None,
                    mac: None,
                    public_key: None,
                    private_key_file: None,
                    ssh: None,
                    nic_cpu: None,
                })
                .collect(),
        }
    }
}

fn parse_hex_key(s: &str) -> Option<Key> {
    if s.len() != 64 {
        return None;
    }
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(Key(k))
}

/// A byte count as environment knobs spell it: digits with an optional k, m or g suffix
/// (either case, powers of 1024), as GASNet reads its sizes. `None` when it does not parse.
pub fn parse_size(s: &str) -> Option<u64> {
    let v = s.trim().to_ascii_lowercase();
    let (n, m) = match v.chars().last() {
        Some('k') => (&v[..v.len() - 1], 1u64 << 10),
        Some('m') => (&v[..v.len() - 1], 1 << 20),
        Some('g') => (&v[..v.len() - 1], 1 << 30),
        _ => (&v[..], 1),
    };
    n.trim().parse::<u64>().ok()?.checked_mul(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_default_round_trips_and_validates() {
        let c = Config::local_default(3, 7700, "/tmp/x".into());
        let back = Config::parse(&c.to_toml()).unwrap();
        assert_eq!(back.hosts.len(), 3);
        assert_eq!(back.hosts[2].addr.to_string(), "127.0.0.4:7700");
        assert!(back.key().is_ok());
    }

    #[test]
    fn shipped_configs_parse() {
        let local = Config::parse(include_str!("../cluster-configs/local.toml")).unwrap();
        assert_eq!(local.hosts.len(), 2);
        assert!(local.key().is_ok());
        let lan: Config =
            toml::from_str(include_str!("../cluster-configs/lan-example.toml")).unwrap();
        assert_eq!(lan.hosts.len(), 4);
        assert_eq!(lan.cluster.mtu, 1472);
        assert!(lan.per_host_keys());
        lan.validate().unwrap();
    }

    #[test]
    fn a_hosts_own_nic_cpu_serves_its_lone_daemon() {
        let mut c =
            Config::parse(&Config::local_default(3, 7700, "/tmp/x".into()).to_toml()).unwrap();
        c.hosts[1].nic_cpu = Some(0);
        let back = Config::parse(&c.to_toml()).unwrap();
        assert_eq!(back.hosts[1].nic_cpu, Some(0), "kept through the file");
        assert_eq!(back.nic_cpu_for(&[1]), Some(0), "the host's own");
        assert_eq!(back.nic_cpu_for(&[2]), Some(-1), "else the cluster's");
        assert_eq!(
            back.nic_cpu_for(&[0, 1, 2]),
            Some(-1),
            "one thread, several hosts"
        );
        assert_eq!(
            back.nic_cpu_for(&[9]),
            Some(-1),
            "an unknown host: the cluster's"
        );
    }

    #[test]
    fn iface_puts_every_host_on_the_selected_network() {
        let mut c = Config::local_default(2, 7700, "/tmp/x".into());
        for (i, h) in c.hosts.iter_mut().enumerate() {
            h.addr = format!("10.1.0.{}:7700", i + 1).parse().unwrap();
            h.addrs = vec![format!("10.2.0.{}:7700", i + 1).parse().unwrap()];
        }
        let mut d = c.clone();
        d.cluster.iface = Some("10.2.0.0/16".into());
        d.select_network().unwrap();
        assert_eq!(d.hosts[1].addr.to_string(), "10.2.0.2:7700");
        // A second selection still chooses among all of a host's addresses.
        d.cluster.iface = Some("10.1.0.0/24".into());
        d.select_network().unwrap();
        assert_eq!(d.hosts[1].addr.to_string(), "10.1.0.2:7700");
        assert_eq!(d.hosts[1].addrs, vec!["10.2.0.2:7700".parse().unwrap()]);

        c.hosts[1].addrs.clear();
        c.cluster.iface = Some("10.2.0.0/16".into());
        let e = c.select_network().unwrap_err().to_string();
        assert!(
            e.contains("host h1 has no address in 10.2.0.0/16 (its addresses: 10.1.0.2)"),
            "{e}"
        );
        c.cluster.iface = Some("10.2.0.0/99".into());
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("expected an interface name"));
        c.cluster.iface = Some("nosuchif0".into());
        let e = c.select_network().unwrap_err().to_string();
        assert!(
            e.contains("no interface named \"nosuchif0\" here (interfaces: lo"),
            "{e}"
        );
    }

    #[test]
    fn per_host_key_configs_are_checked() {
        let mut c = Config::local_default(2, 7700, "/tmp/x".into());
        c.cluster.secret = None;
        c.hosts[0].public_key = Some("11".repeat(32));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("host h0 needs a private key file"), "{e}");
        c.cluster.private_key_file = Some("/k".into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("host h1 has no public_key"), "{e}");
        c.hosts[1].public_key = Some("11".repeat(32));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("another host's too"), "{e}");
        c.hosts[1].public_key = Some("zz".repeat(32));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("not 64 hex digits"), "{e}");
        c.hosts[1].public_key = Some("22".repeat(32));
        c.validate().unwrap();
        c.cluster.secret = Some("33".repeat(32));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("not both"), "{e}");
    }

    #[test]
    fn bad_configs_say_what_is_wrong() {
        let c = Config::local_default(2, 7700, "/tmp/x".into());
        let text = c.to_toml().replace("mtu = 65000", "mtu = 10");
        assert!(Config::parse(&text)
            .unwrap_err()
            .to_string()
            .contains("mtu"));
        let text = c.to_toml().replace("[cluster]", "[cluster]\nbogus = 1");
        assert!(Config::parse(&text).is_err());
        let mut c2 = c.clone();
        c2.cluster.secret = Some("abc".into());
        assert!(c2.validate().unwrap_err().to_string().contains("64 hex"));
        assert!(Config::parse("not toml [").is_err());
    }

    #[test]
    fn packet_links_come_from_loopback_addresses_or_the_config() {
        let mut c = Config::local_default(2, 7700, "/tmp/x".into());
        c.cluster.transport = TransportKind::Packet;
        let l = c.packet_link(1).unwrap();
        assert_eq!(l.interface, "lo");
        assert_eq!(l.macs[1], [0x02, 0, 0, 3, 0x1e, 0x14]);
        c.hosts[1].addr = "10.0.0.2:7700".parse().unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("h1") && e.contains("mac"), "{e}");
        c.hosts[1].mac = Some("52:54:00:12:34:56".into());
        let e = c.packet_link(1).unwrap_err().to_string();
        assert!(e.contains("interface"), "{e}");
        c.hosts[1].interface = Some("eth0".into());
        assert_eq!(
            c.packet_link(1).unwrap().macs[1],
            [0x52, 0x54, 0, 0x12, 0x34, 0x56]
        );
        c.hosts[1].mac = Some("52:54:00:12:34".into());
        assert!(c.validate().unwrap_err().to_string().contains("aa:bb"));
        c.hosts[1].mac = Some(
            crate::transport::packet::loopback_mac(c.hosts[0].addr)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":"),
        );
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("another host"));
    }
}
