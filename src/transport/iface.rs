//! Which network a cluster's daemons talk over: the interface selection (`--iface`,
//! `SOFTNIC_IFACE`, `cluster.iface`) as an interface name or a CIDR, like `UCX_NET_DEVICES` and
//! `FI_TCP_IFACE`.
//!
//! A host may list an address per network (`addr` and `addrs`). The selection names one
//! network, and every process applies it alike, so all agree on each host's address without
//! exchanging any: a CIDR directly, an interface name through the network its addresses are on
//! here (the same name on every host, as on a uniform cluster). Without a selection each host
//! is at its `addr` and the daemon uses the interface that holds it. The daemon then pins its
//! sockets to that interface, so traffic does not leak onto another network.

use std::net::{IpAddr, SocketAddr};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IfaceError {
    #[error(
        "interface selection {0:?}: expected an interface name (eth1) or a CIDR (10.2.0.0/16)"
    )]
    BadSelection(String),
    #[error("no interface named {name:?} here (interfaces: {have})")]
    NoSuchInterface { name: String, have: String },
    #[error("interface {0} has no IP address")]
    NoAddress(String),
    #[error(
        "host {host} has no address in {network} (its addresses: {have}); add one to its `addrs`"
    )]
    HostNotOnNetwork {
        host: String,
        network: String,
        have: String,
    },
    #[error("host {host}'s address {addr} is on no interface here: wrong host, or add the address (interfaces: {have})")]
    NotLocal {
        host: String,
        addr: IpAddr,
        have: String,
    },
    #[error("cannot list the network interfaces: {0}")]
    List(String),
}

/// A network: an address and the length of its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// What the user selected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    Name(String),
    Cidr(Cidr),
}

impl Selection {
    pub fn parse(s: &str) -> Result<Selection, IfaceError> {
        let bad = || IfaceError::BadSelection(s.into());
        if let Some((a, p)) = s.split_once('/') {
            let addr: IpAddr = a.parse().map_err(|_| bad())?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let prefix: u8 = p.parse().map_err(|_| bad())?;
            if prefix > max {
                return Err(bad());
            }
            return Ok(Selection::Cidr(Cidr { addr, prefix }));
        }
        // Linux interface names: 1 to 15 bytes, no '/', no whitespace.
        if s.is_empty() || s.len() > 15 || s.contains(|c: char| c.is_whitespace() || c == ':') {
            return Err(bad());
        }
        Ok(Selection::Name(s.into()))
    }

    /// The networks this selection means on this host.
    pub fn networks(&self, here: &[LocalIface]) -> Result<Vec<Cidr>, IfaceError> {
        match self {
            Selection::Cidr(c) => Ok(vec![*c]),
            Selection::Name(n) => {
                let i = find(here, n)?;
                if i.addrs.is_empty() {
                    return Err(IfaceError::NoAddress(n.clone()));
                }
                Ok(i.addrs.clone())
            }
        }
    }
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selection::Name(n) => f.write_str(n),
            Selection::Cidr(c) => c.fmt(f),
        }
    }
}

/// One interface of this host with its addresses (each with its network's prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalIface {
    pub name: String,
    pub addrs: Vec<Cidr>,
}

fn names(here: &[LocalIface]) -> String {
    here.iter()
        .map(|i| i.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn find<'a>(here: &'a [LocalIface], name: &str) -> Result<&'a LocalIface, IfaceError> {
    here.iter()
        .find(|i| i.name == name)
        .ok_or_else(|| IfaceError::NoSuchInterface {
            name: name.into(),
            have: names(here),
        })
}

/// Host `host`'s address on `networks`, among `addrs` (its `addr` first).
pub fn pick(host: &str, addrs: &[SocketAddr], networks: &[Cidr]) -> Result<SocketAddr, IfaceError> {
    addrs
        .iter()
        .find(|a| networks.iter().any(|n| n.contains(a.ip())))
        .copied()
        .ok_or_else(|| IfaceError::HostNotOnNetwork {
            host: host.into(),
            network: networks
                .iter()
                .map(Cidr::to_string)
                .collect::<Vec<_>>()
                .join(" or "),
            have: addrs
                .iter()
                .map(|a| a.ip().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The interface of this host that holds `addr` (host `host`'s address): the one its daemon
/// pins its sockets to.
pub fn holding<'a>(
    host: &str,
    addr: IpAddr,
    here: &'a [LocalIface],
) -> Result<&'a LocalIface, IfaceError> {
    // The whole loopback network is local, not only the address lo carries.
    here.iter()
        .find(|i| i.addrs.iter().any(|c| c.addr == addr))
        .or_else(|| {
            here.iter().find(|i| {
                i.addrs
                    .iter()
                    .any(|c| c.addr.is_loopback() && c.contains(addr))
            })
        })
        .ok_or_else(|| IfaceError::NotLocal {
            host: host.into(),
            addr,
            have: here
                .iter()
                .filter(|i| !i.addrs.is_empty())
                .map(|i| {
                    let a: Vec<String> = i.addrs.iter().map(Cidr::to_string).collect();
                    format!("{} {}", i.name, a.join(" "))
                })
                .collect::<Vec<_>>()
                .join("; "),
        })
}

/// The interface host `host`'s sockets use: its configured `interface`, else the one that
/// holds its address `addr` (None for an unspecified address). An address on no interface here
/// is refused now, saying so, rather than by the kernel's bare EADDRNOTAVAIL.
pub fn device(
    host: &str,
    interface: Option<&str>,
    addr: SocketAddr,
) -> Result<Option<String>, IfaceError> {
    let here = local_ifaces()?;
    if let Some(name) = interface {
        return Ok(Some(find(&here, name)?.name.clone()));
    }
    if addr.ip().is_unspecified() {
        return Ok(None);
    }
    Ok(Some(holding(host, addr.ip(), &here)?.name.clone()))
}

/// Pins `sock` to interface `device` (SO_BINDTODEVICE): it then sends and receives only
/// there. Unprivileged since Linux 5.7; where refused, the socket stays bound by address only.
pub fn pin(sock: &socket2::Socket, device: Option<&str>) -> std::io::Result<()> {
    let Some(d) = device else { return Ok(()) };
    match sock.bind_device(Some(d.as_bytes())) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            tracing::warn!("cannot pin a socket to {d} ({e}); it is bound by address only");
            Ok(())
        }
        r => r,
    }
}

/// This host's interfaces with their IPv4 and IPv6 addresses (`getifaddrs`).
pub fn local_ifaces() -> Result<Vec<LocalIface>, IfaceError> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below and only read in between.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(IfaceError::List(
            std::io::Error::last_os_error().to_string(),
        ));
    }
    let mut out: Vec<LocalIface> = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: addresses are sockaddrs of the family they say, or null.
        let addr = unsafe { sockaddr_ip(ifa.ifa_addr) };
        let mask = unsafe { sockaddr_ip(ifa.ifa_netmask) };
        let entry = match out.iter_mut().position(|i| i.name == name) {
            Some(p) => &mut out[p],
            None => {
                out.push(LocalIface {
                    name,
                    addrs: Vec::new(),
                });
                out.last_mut().unwrap()
            }
        };
        if let Some(addr) = addr {
            let prefix = match mask {
                Some(IpAddr::V4(m)) => u32::from(m).count_ones() as u8,
                Some(IpAddr::V6(m)) => u128::from(m).count_ones() as u8,
                None => {
                    if addr.is_ipv4() {
                        32
                    } else {
                        128
                    }
                }
            };
            entry.addrs.push(Cidr { addr, prefix });
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The IP of a sockaddr, if it is one.
///
/// # Safety
/// `sa` is null or points to a sockaddr of the family it names.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    match (*sa).sa_family as i32 {
        libc::AF_INET => {
            let s = &*(sa as *const libc::sockaddr_in);
            Some(IpAddr::from(u32::from_be(s.sin_addr.s_addr).to_be_bytes()))
        }
        libc::AF_INET6 => {
            let s = &*(sa as *const libc::sockaddr_in6);
            Some(IpAddr::from(s.sin6_addr.s6_addr))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, cidrs: &[&str]) -> LocalIface {
        LocalIface {
            name: name.into(),
            addrs: cidrs
                .iter()
                .map(|c| match Selection::parse(c).unwrap() {
                    Selection::Cidr(c) => c,
                    _ => unreachable!(),
                })
                .collect(),
        }
    }

    fn here() -> Vec<LocalIface> {
        vec![
            iface("lo", &["127.0.0.1/8"]),
            iface("eth0", &["10.1.0.5/24"]),
            iface("eth1", &["10.2.0.5/16"]),
        ]
    }

    fn addrs(s: &[&str]) -> Vec<SocketAddr> {
        s.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn selections_parse_or_say_what_is_expected() {
        assert_eq!(Selection::parse("eth1"), Ok(Selection::Name("eth1".into())));
        let Selection::Cidr(c) = Selection::parse("10.2.0.0/16").unwrap() else {
            panic!()
        };
        assert!(c.contains("10.2.255.1".parse().unwrap()));
        assert!(!c.contains("10.3.0.1".parse().unwrap()));
        assert!(!c.contains("::1".parse().unwrap()));
        for bad in [
            "",
            "10.2.0.0/33",
            "x/8",
            "a very long name!",
            "eth0:1",
            "10.0.0.0/",
        ] {
            assert!(
                matches!(Selection::parse(bad), Err(IfaceError::BadSelection(_))),
                "{bad:?}"
            );
        }
        let Selection::Cidr(all) = Selection::parse("0.0.0.0/0").unwrap() else {
            panic!()
        };
        assert!(all.contains("192.168.1.1".parse().unwrap()));
    }

    #[test]
    fn a_name_selects_the_network_of_its_addresses_for_every_host() {
        let nets = Selection::Name("eth1".into()).networks(&here()).unwrap();
        let peer = addrs(&["10.1.0.6:7700", "10.2.0.6:7700"]);
        assert_eq!(pick("n2", &peer, &nets).unwrap(), peer[1]);
        let only_mgmt = addrs(&["10.1.0.7:7700"]);
        let e = pick("n3", &only_mgmt, &nets).unwrap_err();
        assert!(
            e.to_string().contains("n3 has no address in 10.2.0.5/16"),
            "{e}"
        );
        assert!(matches!(
            Selection::Name("ib0".into()).networks(&here()),
            Err(IfaceError::NoSuchInterface { .. })
        ));
    }

    #[test]
    fn the_daemon_pins_to_the_interface_holding_its_address() {
        let h = here();
        assert_eq!(
            holding("n1", "10.2.0.5".parse().unwrap(), &h).unwrap().name,
            "eth1"
        );
        let e = holding("n1", "10.9.0.1".parse().unwrap(), &h).unwrap_err();
        assert!(e.to_string().contains("eth1 10.2.0.5/16"), "{e}");
    }

    #[test]
    fn this_host_has_loopback() {
        let l = local_ifaces().unwrap();
        let lo = holding("me", "127.0.0.3".parse().unwrap(), &l).unwrap();
        assert!(lo.addrs.iter().any(|c| c.prefix == 8), "{lo:?}");
    }
}
