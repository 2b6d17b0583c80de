//! softnic: launch jobs (`softnic run`) and read daemon counters (`softnic stat`).

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use softnic::config::{Config, FaultArgs, TransportKind};
use softnic::job::host_spawn::{self, HostSpawn};
use softnic::job::local::{self, Launch};
use softnic::job::placement::Map;
use softnic::job::{doctor, slurm, ssh, Spawner};
use softnic::shm::attach::{self, Request, Response};

#[derive(Parser, Debug)]
#[command(version, about = "Launch softnic jobs and inspect soft NIC daemons")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run PROGRAM as N ranks. Without --config: the local default, H simulated hosts on
    /// 127.0.0.2.. whose NICs this launcher starts and stops.
    Run {
        #[arg(short = 'n', long = "ranks")]
        n: u32,
        /// A number: simulated hosts of the local default (default 2). Names (a,b,c): the
        /// config's hosts to run on (default all; also --hostfile or SOFTNIC_SSH_SERVERS).
        #[arg(long)]
        hosts: Option<String>,
        /// A file of host names, one per line (# comments), as --hosts.
        #[arg(long, conflicts_with = "hosts")]
        hostfile: Option<PathBuf>,
        /// How ranks start: local (this machine) or ssh (the config's hosts); default:
        /// SOFTNIC_SPAWNER, else ssh when a config host is not on this machine, else local.
        #[arg(long, value_enum)]
        spawner: Option<Spawner>,
        /// At most this many ranks per host.
        #[arg(long)]
        ppn: Option<u32>,
        /// Rank layout over hosts: block (fill a host, then the next) or cyclic.
        #[arg(long, value_enum, default_value = "cyclic")]
        map: Map,
        /// Pass this launcher environment variable to the ranks (repeatable; SOFTNIC_* always
        /// go).
        #[arg(long = "env", value_name = "NAME")]
        forward: Vec<String>,
        /// Prefix each output line of a rank with `[rank] ` (ssh spawner).
        #[arg(long)]
        label: bool,
        /// End the job after SECONDS (as mpiexec's -timeout): its ranks are stopped, the local
        /// spawner prints what the job's daemons count, and the exit code is 124.
        #[arg(long, value_name = "SECONDS")]
        timeout: Option<f64>,
        /// A cluster config; its daemons are started here unless --attach.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Use already running softnicd daemons of --config.
        #[arg(long, requires = "config")]
        attach: bool,
        /// The daemons started here (local spawner): a process per host, as on a LAN, each NIC
        /// on a core of its own while cores remain for the ranks; default one process for all.
        #[arg(long, conflicts_with = "attach")]
        daemon_per_host: bool,
        /// The network between hosts: an interface name (eth1) or a CIDR (10.2.0.0/16); each
        /// host is at its config address on it (exported as SOFTNIC_IFACE).
        #[arg(long, requires = "config")]
        iface: Option<String>,
        /// Conduit for GASNet programs (exported as SOFTNIC_CONDUIT).
        #[arg(long)]
        conduit: Option<String>,
        /// The local default's transport between daemons (default: packet where this process
        /// may open packet sockets, i.e. root or CAP_NET_RAW, else udp; SOFTNIC_TRANSPORT
        /// overrides).
        #[arg(long, value_enum, conflicts_with = "config")]
        transport: Option<TransportKind>,
        /// Fault injection in the daemons started here.
        #[command(flatten)]
        faults: FaultArgs,
        /// The program and its arguments (after --).
        #[arg(last = true, required = true)]
        program: Vec<OsString>,
    },
    /// Make sure this host's daemon runs (started by the slurm spawner on every node).
    #[command(hide = true)]
    DaemonUp {
        #[arg(long)]
        config: PathBuf,
    },
    /// The ssh spawner's agent on a host (started by `softnic run --spawner ssh`).
    #[command(hide = true)]
    HostSpawn {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        host: String,
        #[arg(long)]
        job_id: u32,
        #[arg(long)]
        job_key: u64,
        #[arg(long, value_delimiter = ',')]
        rank_hosts: Vec<u16>,
        #[arg(long)]
        conduit: Option<String>,
        /// NAME=VALUE for the ranks' environment (repeatable).
        #[arg(long)]
        setenv: Vec<String>,
        #[arg(long)]
        label: bool,
        #[arg(last = true, required = true)]
        program: Vec<OsString>,
    },
    /// Make this host's key pair for per-host keys: writes the private key (mode 0600, never
    /// over an existing file) and prints the public key for the host's `[[host]]` entry.
    Keygen {
        /// Where the private key goes (the config's cluster.private_key_file).
        #[arg(long, default_value = "/etc/softnic/host.key")]
        out: PathBuf,
    },
    /// Check every daemon of a config this machine can reach: make them all answer each
    /// other, then print what each sees of its peers (session, round trip, last heard,
    /// authentication failures) and what to fix. Exit status 1 when something is wrong.
    Doctor {
        #[arg(long)]
        config: PathBuf,
    },
    /// Print a daemon's counters.
    Stat {
        /// Cluster config (default: $SOFTNIC_CONFIG, set inside jobs).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Host name (default: every host of the config).
        #[arg(long)]
        host: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    // Started again by itself as a job's daemons (single-threaded, see job::daemon_process).
    if let Some(code) = softnic::job::daemon_process::serve_if_asked() {
        std::process::exit(code);
    }
    softnic::logging::init("warn");
    match Cli::parse().cmd {
        Cmd::Run {
            n,
            hosts,
            hostfile,
            spawner,
            ppn,
            map,
            forward,
            label,
            timeout,
            config,
            attach,
            daemon_per_host,
            iface,
            conduit,
            transport,
            faults,
            program,
        } => {
            let timeout = match timeout {
                None => None,
                Some(t) => Some(
                    Duration::try_from_secs_f64(t)
                        .ok()
                        .filter(|d| !d.is_zero())
                        .with_context(|| format!("--timeout {t}: a positive number of seconds"))?,
                ),
            };
            if let Some(i) = iface {
                // Before any thread: every config load of this launcher, of the daemons it
                // starts and of the ranks (SOFTNIC_* go everywhere) selects the same network.
                std::env::set_var("SOFTNIC_IFACE", i);
            }
            let fault = faults.fault();
            let mut program = program.into_iter();
            // --hosts N is the local default's size; names pick config hosts.
            let (nhosts, names) = match hosts.as_deref().map(str::parse::<usize>) {
                Some(Ok(n)) => (n, Vec::new()),
                _ => (2, ssh::host_names(hosts.as_deref(), hostfile.as_deref())?),
            };
            if config.is_none() && !names.is_empty() {
                bail!("--hosts with names (or --hostfile, SOFTNIC_SSH_SERVERS) needs --config");
            }
            let cfg = match &config {
                Some(p) => Some(Config::load(p)?),
                None => None,
            };
            let l = Launch {
                ranks: n,
                hosts: nhosts,
                config,
                attach,
                daemon_per_host,
                fault,
                transport,
                conduit,
                program: program.next().expect("clap requires a program"),
                args: program.collect(),
                env: Vec::new(),
                forward,
                host_names: names,
                ppn,
                map,
                label,
                timeout,
            };
            let code = match Spawner::choose(spawner, cfg.as_ref())? {
                Spawner::Local => local::run(&l)?,
                Spawner::Ssh => ssh::run(&l)?,
                Spawner::Slurm => slurm::run(&l)?,
            };
            std::process::exit(code);
        }
        Cmd::DaemonUp { config } => {
            let cfg = Config::load(&config)?;
            let me = softnic::job::this_host(&cfg, &config)?;
            host_spawn::ensure_daemon(&cfg, &config, me)?;
            Ok(())
        }
        Cmd::HostSpawn {
            config,
            host,
            job_id,
            job_key,
            rank_hosts,
            conduit,
            setenv,
            label,
            program,
        } => {
            let env = setenv
                .iter()
                .map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .with_context(|| format!("--setenv {kv:?} is not NAME=VALUE"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let mut program = program.into_iter();
            let h = HostSpawn {
                config,
                host,
                job_id,
                job_key,
                rank_hosts,
                label,
                conduit,
                env,
                program: program.next().expect("clap requires a program"),
                args: program.collect(),
            };
            std::process::exit(host_spawn::run(&h)?);
        }
        Cmd::Keygen { out } => {
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
            }
            let key = softnic::keys::HostKey::generate();
            key.save(&out)?;
            eprintln!(
                "private key written to {} (mode 0600); put this line in this host's [[host]]:",
                out.display()
            );
            println!("public_key = \"{}\"", softnic::keys::hex(&key.public()));
            Ok(())
        }
        Cmd::Doctor { config } => {
            let cfg = Config::load(&config)?;
            let n = cfg.hosts.len() as u16;
            let ask = |h: u16, req: &Request| -> Option<Response> {
                let s = attach::connect(&cfg.socket_path(h)).ok()?;
                attach::call(&s, req, &[]).ok().map(|r| r.0)
            };
            // Make every peer answer, give the answers time to come, then look.
            let reached: Vec<bool> = (0..n)
                .map(|h| matches!(ask(h, &Request::Probe), Some(Response::Pong)))
                .collect();
            std::thread::sleep(Duration::from_millis(1500));
            let views: Vec<_> = (0..n)
                .map(|h| match (reached[h as usize], ask(h, &Request::Stat)) {
                    (true, Some(Response::Stat(t))) => Some(doctor::parse_stat(&t, &cfg)),
                    _ => None,
                })
                .collect();
            let r = doctor::diagnose(&cfg, &views, env!("CARGO_PKG_VERSION"));
            print!("{}", r.table);
            for note in &r.notes {
                println!("note: {note}");
            }
            if r.problems.is_empty() {
                println!("ok: every daemon reached from here hears every peer");
                return Ok(());
            }
            for p in &r.problems {
                println!("fix: {p}");
            }
            std::process::exit(1);
        }
        Cmd::Stat { config, host } => {
            let path = config
                .or_else(|| std::env::var_os("SOFTNIC_CONFIG").map(Into::into))
                .context("no --config and no SOFTNIC_CONFIG")?;
            let cfg = Config::load(&path)?;
            let hosts: Vec<u16> = match host {
                Some(h) => vec![cfg.host_index(&h)?],
                None => (0..cfg.hosts.len() as u16).collect(),
            };
            for h in hosts {
                let p = cfg.socket_path(h);
                if !local::health_check(&p, Duration::from_millis(500)) {
                    bail!(
                        "no daemon answers for host {} at {}",
                        cfg.hosts[h as usize].name,
                        p.display()
                    );
                }
                let t = local::daemon_stat(&p, None).map_err(|e| anyhow::anyhow!(e))?;
                println!("{t}");
            }
            Ok(())
        }
    }
}
