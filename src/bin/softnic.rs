//! softnic: launch jobs (`softnic run`) and read daemon counters (`softnic stat`).

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use softnic::config::{Config, FaultArgs, TransportKind};
use softnic::job::local::{self, Launch};
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
        /// Simulated hosts of the local default.
        #[arg(long, default_value_t = 2)]
        hosts: usize,
        /// A cluster config; its daemons are started here unless --attach.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Use already running softnicd daemons of --config.
        #[arg(long, requires = "config")]
        attach: bool,
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
            config,
            attach,
            conduit,
            transport,
            faults,
            program,
        } => {
            let fault = faults.fault();
            let mut program = program.into_iter();
            let l = Launch {
                ranks: n,
                hosts,
                config,
                attach,
                fault,
                transport,
                conduit,
                program: program.next().expect("clap requires a program"),
                args: program.collect(),
                env: Vec::new(),
            };
            let code = local::run(&l)?;
            std::process::exit(code);
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
                let s = attach::connect(&p)?;
                match attach::call(&s, &Request::Stat, &[])?.0 {
                    Response::Stat(t) => println!("{t}"),
                    other => bail!("unexpected answer: {other:?}"),
                }
            }
            Ok(())
        }
    }
}
