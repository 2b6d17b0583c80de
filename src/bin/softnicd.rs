//! softnicd: the soft NIC daemon of one host (or, with several --host, of several simulated hosts).

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use softnic::config::{Config, FaultArgs};
use softnic::daemon::{signals, Daemon};

const ENV_HELP: &str = "Environment:
  SOFTNIC_LOG              log filter (error, warn, info, debug, trace; tracing EnvFilter syntax)
  SOFTNIC_TRANSPORT        udp or tcp (overrides cluster.transport)
  SOFTNIC_MTU              largest datagram in bytes (overrides cluster.mtu)
  SOFTNIC_PEER_TIMEOUT_MS  silence before a peer is declared dead (overrides cluster.peer_timeout_ms)
  SOFTNIC_RUNTIME_DIR      where attach sockets live (overrides cluster.runtime_dir)
  SOFTNIC_IFACE            the network between hosts, a name or CIDR (overrides cluster.iface)";

/// softnicd: the soft NIC daemon of one host. It serves the processes of its host through shared
/// memory (Gemini-style put/get and 64-bit AMOs, completed without the target process) and
/// talks to the other hosts' daemons over UDP or TCP with its own reliable delivery.
#[derive(Parser, Debug)]
#[command(version, about = "softnicd: the soft NIC daemon of one host (see --help)", after_help = ENV_HELP)]
struct Args {
    /// Cluster configuration (TOML; see cluster-configs/). SOFTNIC_* variables override it.
    #[arg(long)]
    config: PathBuf,
    /// Which [[host]] of the config this daemon serves; repeat to serve several in one process.
    #[arg(long = "host", required = true)]
    hosts: Vec<String>,
    /// The network between hosts: an interface name (eth1) or a CIDR (10.2.0.0/16); each host
    /// is at its config address on it (overrides SOFTNIC_IFACE and cluster.iface).
    #[arg(long)]
    iface: Option<String>,
    #[command(flatten)]
    faults: FaultArgs,
    /// Print the effective settings at start (SOFTNIC_LOG sets the log filter, e.g. debug).
    #[arg(short, long)]
    verbose: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let default = if args.verbose { "info" } else { "warn" };
    softnic::logging::init(default);
    let mut cfg = Config::load(&args.config)?;
    if let Some(i) = &args.iface {
        cfg.cluster.iface = Some(i.clone());
        cfg.select_network()?;
    }
    if let Some(f) = args.faults.fault() {
        cfg.fault = Some(f);
        cfg.validate()?;
    }
    let indices = args
        .hosts
        .iter()
        .map(|h| cfg.host_index(h))
        .collect::<Result<Vec<_>, _>>()?;
    if args.verbose {
        let mut shown = cfg.clone();
        shown.cluster.secret = shown.cluster.secret.as_ref().map(|_| "<hidden>".into());
        eprintln!(
            "softnicd effective settings (hosts {:?}):\n{}",
            args.hosts,
            shown.to_toml()
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    // A handler, not a signal thread: the daemon's process stays single-threaded.
    signals::stop_on(&stop, &[libc::SIGINT, libc::SIGTERM, libc::SIGHUP])
        .context("installing the signal handlers")?;
    let mut d = Daemon::new(&cfg, &indices, stop).context("starting the daemon")?;
    d.run()?;
    Ok(())
}
