//! netbench: softnic's benchmarks, run side by side against a plain-UDP floor in one job.
//!
//! Outside a job it launches itself on the local default (`softnic run` semantics); inside,
//! every rank runs the benchmark and rank 0 reports.

mod dmapp_bench;
mod extoll_bench;
mod gasnet_bench;
mod gasnet_ra;
mod gni_bench;
mod mpi_bench;
mod phases;
mod plot;
mod portals_bench;
mod randomaccess;
mod raw_packet;
mod raw_tcp;
mod raw_udp;
mod report;
mod suite;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use report::Row;
use softnic::gni::Nic;
use softnic::job::JobInfo;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Bench {
    /// Latency: put ping-pong, blocking put, get and AFADD (gni); UDP ping-pong (raw-udp).
    Pingpong,
    /// Bandwidth: non-blocking puts (gni); datagram streaming (raw-udp).
    Bw,
    /// HPCC RandomAccess with NIC AXOR updates; GUP/s and verification errors.
    Randomaccess,
    /// Active Message round trips (Short, Medium, Long); needs `--api gasnet`.
    Am,
    /// AMO rate at rank 0 from every other rank, one word or 8192 (DMAPP Fig. 6).
    Amo,
    /// Strided put rate vs target stride (DMAPP Fig. 5): `--strides`, `--nelems`.
    Strided,
    /// Non-blocking put rate vs operations outstanding (DMAPP Fig. 4): `--outstanding`.
    Nbrate,
    /// MPI synchronisation overhead vs processes (fence, PSCW, locks, lock_all, flush) and
    /// collectives, one job per `--sync-ranks`; needs `--api mpi`.
    Sync,
    /// MPI put latency vs puts per lock epoch (`--per-epoch`); needs `--api mpi`.
    Epoch,
    /// Everything above over raw-udp, gni, dmapp, portals and both GASNet conduits (one job
    /// each), plus RandomAccess at every `--ra-ranks` and the DMAPP figures at their rank
    /// counts; one table, JSON lines and figures in `--out`.
    Compare,
    /// Where the one-way trips of a traced run spent their time: reads the stamps in
    /// `--trace` (netbench and the daemons built with `--features phase-trace`, the run given
    /// `SOFTNIC_PHASE_TRACE=<dir>`); per-step medians of the commonest paths.
    Phases,
}

#[derive(Parser, Debug)]
#[command(
    version,
    about = "softnic benchmarks: ping-pong, bandwidth, RandomAccess over every API, against raw UDP"
)]
struct Args {
    #[arg(value_enum)]
    bench: Bench,
    /// raw-udp, gni, dmapp, portals, or all (default: all); with `--api gasnet`: udp, portals
    /// or all.
    #[arg(long)]
    conduit: Option<String>,
    /// gni, dmapp, raw-udp, portals, gasnet, or all (default). A rank attaches to one GASNet
    /// conduit, so each GASNet conduit runs as its own job.
    #[arg(long)]
    api: Option<String>,
    #[arg(long, default_value_t = 2)]
    ranks: u32,
    #[arg(long, default_value_t = 2)]
    hosts: usize,
    /// Message sizes in bytes, comma separated (k and m suffixes allowed).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Option<Vec<usize>>,
    /// Timed iterations; latency rows of messages up to 8 KiB take ten times as many (OSU's
    /// rule).
    #[arg(long, default_value_t = 1000)]
    iters: usize,
    /// RandomAccess table: 2^N 64-bit words per rank.
    #[arg(long, default_value_t = 20)]
    table_log2: u32,
    /// Skip RandomAccess verification.
    #[arg(long)]
    no_verify: bool,
    /// JSON lines on stdout (tables go to stderr).
    #[arg(long)]
    json: bool,
    /// RandomAccess variants to run, comma separated (default: all of the API's): gni `nic-amo`,
    /// `nic-amo-bucketed`; gasnet `get-put`, `am`, `am-bucketed`, `atomics`.
    #[arg(long, value_delimiter = ',')]
    ra_variants: Option<Vec<String>>,
    /// `compare`: the rank counts of the GUPS-vs-ranks figure (besides `--ranks`).
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    ra_ranks: Vec<u32>,
    /// Runs every job this many times, interleaved (A B A B …), and reports each row's median
    /// over the rounds, so that a slow spell of a shared machine moves one round, not the
    /// result (default: 5 for `compare`, else 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: Option<u32>,
    /// Where the JSON lines (`<bench>.jsonl`) and the figures (SVG and PNG) go.
    #[arg(long, default_value = "netbench-out")]
    out: std::path::PathBuf,
    /// Run the jobs on a cluster config's hosts instead of the local default (as `softnic run
    /// --config`). Rank 0 writes its rows to a file under the temp dir: run netbench on the host
    /// of rank 0 (the config's first) or with a shared temp dir.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// `bw --api dmapp`: sending processes per node, one job each (ranks = ppn × hosts).
    #[arg(long, value_delimiter = ',')]
    ppn: Option<Vec<u32>>,
    /// `nbrate`: operations outstanding before each sync.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32,64,128,256"
    )]
    outstanding: Vec<u32>,
    /// `strided`: target strides in elements.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    strides: Vec<u64>,
    /// `sync`: the job sizes (ranks) to measure synchronisation at, one job each.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    sync_ranks: Vec<u32>,
    /// `epoch`: operations per lock epoch.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32,64,128,256"
    )]
    per_epoch: Vec<u32>,
    /// `strided`: elements per call.
    #[arg(long, value_delimiter = ',', default_value = "8,64,512,1024")]
    nelems: Vec<u64>,
    /// With --config: local, ssh or slurm (as `softnic run --spawner`; default the same choice).
    #[arg(long, value_enum, requires = "config")]
    spawner: Option<softnic::job::Spawner>,
    /// The daemons each job starts: a process per host, as on a LAN (`softnic run
    /// --daemon-per-host`); rows say `daemons=per-host`. `compare` also runs its bulk rows so.
    #[arg(long)]
    daemon_per_host: bool,
    /// `phases`: the directory of the traced run's stamps.
    #[arg(long, default_value = "phase-trace")]
    trace: std::path::PathBuf,
}

impl Args {
    /// Message sizes for latency and for bandwidth runs: `--sizes`, or the defaults.
    fn sizes(&self) -> (Vec<usize>, Vec<usize>) {
        match &self.sizes {
            Some(s) => (s.clone(), s.clone()),
            None => (
                vec![8, 64, 512, 1024, 4096, 32768, 262_144, 1 << 20],
                // 8 B for message rates; 4 KiB to 4 MiB, the range issue 26's targets span.
                vec![8, 4096, 65536, 1 << 20, 4 << 20],
            ),
        }
    }

    /// How many times each job runs (`--rounds`).
    fn rounds(&self) -> u32 {
        self.rounds
            .unwrap_or(if self.bench == Bench::Compare { 5 } else { 1 })
    }

    /// Whether the RandomAccess variant `name` was asked for.
    fn ra_variant(&self, name: &str) -> bool {
        self.ra_variants
            .as_ref()
            .is_none_or(|v| v.iter().any(|n| n == name))
    }
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mul) = match s.strip_suffix('k') {
        Some(n) => (n, 1024),
        None => match s.strip_suffix('m') {
            Some(n) => (n, 1 << 20),
            None => (s.as_str(), 1),
        },
    };
    num.parse::<usize>()
        .map(|n| n * mul)
        .map_err(|e| format!("bad size {s:?}: {e}"))
}

/// Calls `f` `warm + iters` times and returns the last `iters` durations in µs.
pub fn time_calls(
    warm: usize,
    iters: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<f64>> {
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warm + iters {
        let t = std::time::Instant::now();
        f()?;
        if i >= warm {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(samples)
}

/// What every benchmark needs to know about the run.
pub struct Ctx {
    /// Rank, size, job id and placement.
    pub job: JobInfo,
    /// The hosts the ranks live on.
    pub hosts: u32,
    pub iters: usize,
    /// The daemons' transport, from the job's config.
    pub transport: Option<String>,
    /// `per-host`: each host's daemon a process of its own (`--daemon-per-host`).
    pub daemons: Option<String>,
}

/// Untimed calls before `timed` timed ones: a tenth of them, and ten more.
fn warmup_for(timed: usize) -> usize {
    timed / 10 + 10
}

/// Messages up to this size take ten times `--iters` in latency rows (OSU's rule:
/// `LARGE_MESSAGE_SIZE`, 10,000 iterations below it and 1,000 above).
pub const SMALL_MAX: usize = 8192;

impl Ctx {
    /// Untimed calls before the timed ones.
    pub fn warmup(&self) -> usize {
        warmup_for(self.iters)
    }

    /// Timed round trips of a point-to-point latency row of `size` bytes: ten times `--iters`
    /// for small messages, as OSU's latency tests count them. A thousand 10 µs round trips are
    /// 10 ms, shorter than this class of machine's moods (a core's speed halves for hundreds
    /// of milliseconds at a time): whole jobs then landed in one mode or the other.
    pub fn lat_iters(&self, size: usize) -> usize {
        if size <= SMALL_MAX {
            self.iters.saturating_mul(10)
        } else {
            self.iters
        }
    }

    /// Untimed round trips before [`Ctx::lat_iters`] timed ones.
    pub fn lat_warmup(&self, size: usize) -> usize {
        warmup_for(self.lat_iters(size))
    }

    pub fn row(&self, bench: &str, api: &str, conduit: &str, op: &str, size: usize) -> Row {
        let through_daemons =
            !api.starts_with("raw-") && !conduit.starts_with("raw-") && conduit != "udp";
        Row {
            bench: bench.into(),
            api: api.into(),
            conduit: conduit.into(),
            op: op.into(),
            size,
            ranks: self.job.size,
            hosts: self.hosts,
            iters: self.iters,
            // Rows of the raw-UDP floor and of the udp conduit never touch the daemons.
            transport: self.transport.clone().filter(|_| through_daemons),
            daemons: self.daemons.clone().filter(|_| through_daemons),
            ..Default::default()
        }
    }
}

fn main() -> anyhow::Result<()> {
    // Started again by itself as a job's daemons (single-threaded, see job::daemon_process).
    if let Some(code) = softnic::job::daemon_process::serve_if_asked() {
        std::process::exit(code);
    }
    let args = Args::parse();
    if args.bench == Bench::Phases {
        let (stamps, names) = phases::load(&args.trace)?;
        print!("{}", phases::report(&stamps, &names, 3));
        return Ok(());
    }
    anyhow::ensure!(
        args.bench != Bench::Am || args.api.as_deref() == Some("gasnet"),
        "the am benchmark is GASNet's: add --api gasnet --conduit udp|portals"
    );
    anyhow::ensure!(
        !matches!(args.bench, Bench::Sync | Bench::Epoch) || args.api.as_deref() == Some("mpi"),
        "the sync and epoch benchmarks are MPI's: add --api mpi"
    );
    if !JobInfo::in_job() {
        std::process::exit(suite::run(&args)?);
    }
    let job = JobInfo::from_env()?;
    let mtu = job.mtu().unwrap_or(softnic::config::DEFAULT_MTU);
    // The hosts this job's ranks live on (however it was launched).
    let hosts = {
        let mut h = job.rank_hosts.clone();
        h.sort_unstable();
        h.dedup();
        h.len() as u32
    };
    let ctx = Ctx {
        hosts,
        iters: args.iters,
        transport: job
            .config
            .as_deref()
            .and_then(|p| softnic::config::Config::load(p).ok())
            .map(|c| c.cluster.transport.name().to_string()),
        daemons: args.daemon_per_host.then(|| "per-host".to_string()),
        job,
    };
    if args.api.as_deref() == Some("gasnet") {
        let conduit = args.conduit.clone().unwrap_or_else(|| "udp".into());
        anyhow::ensure!(
            conduit != "all",
            "inside a job GASNet runs one conduit; run netbench outside `softnic run` for all"
        );
        // Single-threaded here: nothing else reads the environment concurrently.
        std::env::set_var("SOFTNIC_CONDUIT", &conduit);
        // The baseline at its strongest: datagrams as GASNet's udp-conduit sends them, a tag
        // in clear instead of sealed (unless the caller chose).
        if std::env::var_os("SOFTNIC_UDP_AUTH").is_none() {
            std::env::set_var("SOFTNIC_UDP_AUTH", "0");
        }
        return run_gasnet(&args, &ctx);
    }
    if args.api.as_deref() == Some("mpi") {
        let (lat_sizes, bw_sizes) = args.sizes();
        let p = mpi_bench::Parts::default();
        let parts = match args.bench {
            Bench::Pingpong => mpi_bench::Parts { lat: true, ..p },
            Bench::Bw => mpi_bench::Parts { bw: true, ..p },
            Bench::Sync => mpi_bench::Parts { sync: true, ..p },
            Bench::Epoch => mpi_bench::Parts { epoch: true, ..p },
            Bench::Compare => mpi_bench::Parts {
                lat: true,
                bw: true,
                sync: true,
                epoch: true,
            },
            _ => anyhow::bail!("--api mpi runs pingpong, bw, sync, epoch or compare"),
        };
        let rows = mpi_bench::run(&ctx, parts, &lat_sizes, &bw_sizes, &args.per_epoch)?;
        if ctx.job.rank == 0 {
            report::emit(&rows, args.json)?;
        }
        return Ok(());
    }
    let sel = args
        .conduit
        .clone()
        .or(args.api.clone())
        .unwrap_or_else(|| "all".into());
    let want = |name: &str| sel == "all" || sel == name;
    anyhow::ensure!(
        want("raw-udp")
            || want("raw-packet")
            || want("raw-tcp")
            || want("gni")
            || want("dmapp")
            || want("extoll")
            || want("portals"),
        "unknown --conduit/--api {sel:?}: use raw-udp, raw-packet, raw-tcp, gni, dmapp, extoll, portals or all"
    );
    anyhow::ensure!(
        !matches!(args.bench, Bench::Amo | Bench::Strided | Bench::Nbrate) || want("dmapp"),
        "the amo, strided and nbrate benchmarks are DMAPP's: add --api dmapp"
    );
    let mut rows: Vec<Row> = Vec::new();
    // One attachment serves every API: gni first, then Portals on the same endpoint, then gni
    // again for RandomAccess.
    let mut nic = Nic::attach(ctx.job.clone()).context("attaching to the soft NIC")?;
    let (lat_sizes, bw_sizes) = args.sizes();
    let max = lat_sizes
        .iter()
        .chain(&bw_sizes)
        .copied()
        .max()
        .unwrap_or(8)
        .max(8);
    let (lat, bw, ra) = match args.bench {
        Bench::Pingpong => (true, false, false),
        Bench::Bw => (false, true, false),
        Bench::Randomaccess => (false, false, true),
        Bench::Compare => (true, true, true),
        Bench::Am
        | Bench::Amo
        | Bench::Strided
        | Bench::Nbrate
        | Bench::Sync
        | Bench::Epoch
        | Bench::Phases => (false, false, false),
    };
    if (lat || bw) && want("raw-udp") && ctx.job.size >= 2 {
        // Ranks 0 and 1 run it; every rank joins the barriers that keep sizes apart.
        let mut pair = if ctx.job.rank < 2 {
            Some(raw_udp::Pair::connect(&ctx)?)
        } else {
            None
        };
        // Both ends set up before the first measurement (a stream of small messages is over
        // before a late receiver starts reading).
        nic.barrier()?;
        if lat {
            // One datagram per message: sizes above the MTU have no raw-udp ping-pong.
            for &s in lat_sizes.iter().filter(|&&s| s <= mtu) {
                if let Some(p) = pair.as_mut() {
                    rows.extend(raw_udp::pingpong(&ctx, p, s));
                }
                nic.barrier()?;
            }
        }
        if bw {
            for &s in &bw_sizes {
                if let Some(p) = pair.as_mut() {
                    rows.extend(raw_udp::bw(&ctx, p, s, mtu));
                }
                nic.barrier()?;
            }
        }
    }
    if (lat || bw) && want("raw-packet") && ctx.job.size >= 2 {
        // Every rank learns whether ranks 0 and 1 run it from the same facts (permission,
        // addresses, config), so all join the same barriers.
        let mut pair = if ctx.job.rank < 2 {
            raw_packet::Pair::connect(&ctx, mtu)?
        } else {
            None
        };
        nic.barrier()?;
        // Each size both ways (ring, recv), the faster counting.
        if lat {
            for &s in lat_sizes.iter().filter(|&&s| s <= mtu) {
                let mut ways = Vec::new();
                for via in raw_packet::VIAS {
                    if let Some(p) = pair.as_mut() {
                        ways.extend(raw_packet::pingpong(&ctx, p, s, via));
                    }
                    nic.barrier()?;
                }
                rows.extend(raw_packet::faster(ways));
            }
        }
        if bw {
            for &s in &bw_sizes {
                let mut ways = Vec::new();
                for via in raw_packet::VIAS {
                    if let Some(p) = pair.as_mut() {
                        ways.extend(raw_packet::bw(&ctx, p, s, mtu, via));
                    }
                    nic.barrier()?;
                }
                rows.extend(raw_packet::faster(ways));
            }
        }
    }
    if (lat || bw) && want("raw-tcp") && ctx.job.size >= 2 {
        let mut conn = if ctx.job.rank < 2 {
            Some(raw_tcp::Conn::connect(&ctx)?)
        } else {
            None
        };
        if lat {
            for &s in &lat_sizes {
                if let Some(c) = conn.as_mut() {
                    rows.extend(raw_tcp::pingpong(&ctx, c, s)?);
                }
                nic.barrier()?;
            }
        }
        if bw {
            for &s in &bw_sizes {
                if let Some(c) = conn.as_mut() {
                    rows.extend(raw_tcp::bw(&ctx, c, s)?);
                }
                nic.barrier()?;
            }
        }
    }
    if (lat || bw) && want("gni") && ctx.job.size >= 2 {
        let b = gni_bench::Bufs::new(&mut nic, max)?;
        if lat {
            for &s in &lat_sizes {
                rows.extend(gni_bench::put_pingpong(&ctx, &mut nic, &b, s)?);
            }
            for &s in &lat_sizes {
                rows.extend(gni_bench::put_blocking(&ctx, &mut nic, &b, s)?);
            }
            for &s in &lat_sizes {
                rows.extend(gni_bench::get(&ctx, &mut nic, &b, s)?);
            }
            rows.extend(gni_bench::afadd(&ctx, &mut nic, &b)?);
        }
        if bw {
            for &s in &bw_sizes {
                rows.extend(gni_bench::put_bw(&ctx, &mut nic, &b, s)?);
            }
        }
    }
    if want("dmapp") && ctx.job.size >= 2 {
        nic = run_dmapp(&args, &ctx, nic, max, &mut rows)?;
    }
    if (lat || bw || ra) && want("extoll") && ctx.job.size >= 2 {
        nic = run_extoll(&args, &ctx, nic, max, (lat, bw, ra), &mut rows)?;
    }
    if (lat || bw) && want("portals") && ctx.job.size >= 2 {
        let mut portals = softnic::portals::Portals::from_endpoint(nic.into_endpoint());
        let s = portals_bench::setup(&mut portals, max)?;
        if lat {
            for &sz in &lat_sizes {
                rows.extend(portals_bench::put_pingpong(&ctx, &mut portals, &s, sz)?);
            }
            for &sz in &lat_sizes {
                rows.extend(portals_bench::put_blocking(&ctx, &mut portals, &s, sz)?);
            }
            for &sz in &lat_sizes {
                rows.extend(portals_bench::get_like(&ctx, &mut portals, &s, sz, false)?);
            }
            rows.extend(portals_bench::get_like(&ctx, &mut portals, &s, 8, true)?);
        }
        if bw {
            for &sz in &bw_sizes {
                rows.extend(portals_bench::put_bw(&ctx, &mut portals, &s, sz)?);
            }
        }
        nic = Nic::from_endpoint(portals.into_endpoint());
    }
    if ra && want("gni") {
        for v in [
            randomaccess::Variant::NicAmo,
            randomaccess::Variant::NicAmoBucketed,
        ]
        .into_iter()
        .filter(|v| args.ra_variant(v.name()))
        {
            rows.extend(randomaccess::run(
                &ctx,
                &mut nic,
                args.table_log2,
                !args.no_verify,
                v,
            )?);
        }
    }
    nic.barrier()?;
    if ctx.job.rank == 0 {
        report::emit(&rows, args.json)?;
    }
    Ok(())
}

/// The DMAPP rows (seed 001's figures) on the job's NIC, which comes back for what follows.
fn run_dmapp(
    args: &Args,
    ctx: &Ctx,
    nic: Nic,
    max: usize,
    rows: &mut Vec<Row>,
) -> anyhow::Result<Nic> {
    let (mut d, _) = softnic::dmapp::Dmapp::with_nic(nic, None)?;
    let (lat_sizes, bw_sizes) = args.sizes();
    let b = dmapp_bench::Bufs::new(&mut d, max.max(64 * 1024 * 8))?;
    let compare = args.bench == Bench::Compare;
    if matches!(args.bench, Bench::Pingpong | Bench::Compare) {
        for &s in &lat_sizes {
            rows.extend(dmapp_bench::put_pingpong(ctx, &mut d, &b, s)?);
        }
        rows.extend(dmapp_bench::latencies(ctx, &mut d, &b, &lat_sizes)?);
    }
    if matches!(args.bench, Bench::Bw | Bench::Compare) {
        for &s in &bw_sizes {
            rows.extend(dmapp_bench::put_nb_bw(ctx, &mut d, &b, s)?);
        }
    }
    if matches!(args.bench, Bench::Nbrate | Bench::Compare) {
        let small: Vec<usize> = match &args.sizes {
            Some(s) => s.iter().copied().filter(|&s| s <= 1024).collect(),
            None => vec![8, 64, 512, 1024],
        };
        for s in small {
            rows.extend(dmapp_bench::nbrate(ctx, &mut d, &b, s, &args.outstanding)?);
        }
    }
    if matches!(args.bench, Bench::Strided | Bench::Compare) {
        for &n in &args.nelems {
            for &st in &args.strides {
                if compare && !(st == 1 || st == 2 || st == 64) {
                    continue;
                }
                rows.extend(dmapp_bench::strided(ctx, &mut d, &b, st, n)?);
            }
        }
    }
    if matches!(args.bench, Bench::Amo | Bench::Compare) {
        rows.extend(dmapp_bench::amo(ctx, &mut d, &b)?);
    }
    if matches!(args.bench, Bench::Randomaccess | Bench::Compare) && args.ra_variant("axor-nbi") {
        rows.extend(randomaccess::run_dmapp(
            ctx,
            &mut d,
            args.table_log2,
            !args.no_verify,
        )?);
    }
    d.barrier()?;
    Ok(d.into_nic()?)
}

/// The EXTOLL rows (VELO and RMA raw) on the job's NIC, which comes back for what follows.
fn run_extoll(
    args: &Args,
    ctx: &Ctx,
    nic: Nic,
    max: usize,
    (lat, bw, ra): (bool, bool, bool),
    rows: &mut Vec<Row>,
) -> anyhow::Result<Nic> {
    let shared = std::rc::Rc::new(std::cell::RefCell::new(nic.into_endpoint()));
    let max = max.min(softnic::nic::rma::MAX_OP as usize);
    let mut ex = extoll_bench::Ex::open(shared.clone(), max)?;
    let (lat_sizes, bw_sizes) = args.sizes();
    if lat {
        // VELO up to 8 KiB (back-to-back messages beyond one), RMA every size.
        for &s in lat_sizes.iter().filter(|&&s| s <= 8192) {
            rows.extend(extoll_bench::velo_pingpong(ctx, &mut ex, s)?);
        }
        for &s in &lat_sizes {
            rows.extend(extoll_bench::rma_pingpong(ctx, &mut ex, s, false)?);
        }
        for &s in &lat_sizes {
            rows.extend(extoll_bench::rma_get(ctx, &mut ex, s)?);
        }
        rows.extend(extoll_bench::rma_pingpong(ctx, &mut ex, 8, true)?);
    }
    if bw {
        for &s in &bw_sizes {
            rows.extend(extoll_bench::rma_bw(ctx, &mut ex, s)?);
        }
        for s in [8usize, ex.velo.max_message()] {
            rows.extend(extoll_bench::velo_bw(ctx, &mut ex, s)?);
        }
    }
    if ra && ctx.job.size.is_power_of_two() {
        for (name, bucketed) in [("velo", false), ("velo-bucketed", true)] {
            if args.ra_variant(name) {
                rows.extend(extoll_bench::randomaccess(
                    ctx,
                    &mut ex,
                    args.table_log2,
                    !args.no_verify,
                    bucketed,
                )?);
            }
        }
    }
    drop(ex);
    let ep = std::rc::Rc::try_unwrap(shared)
        .map_err(|_| anyhow::anyhow!("the EXTOLL endpoint is still shared"))?
        .into_inner();
    Ok(Nic::from_endpoint(ep))
}

/// The GASNet rows: AM round trips, blocking put/get latency, put_nbi bandwidth.
fn run_gasnet(args: &Args, ctx: &Ctx) -> anyhow::Result<()> {
    let ra_acks = std::rc::Rc::new(std::cell::Cell::new(0u64));
    let (mut g, pongs) = gasnet_bench::init(&ra_acks).context("gasnet attach")?;
    anyhow::ensure!(ctx.job.size >= 2, "GASNet benchmarks need at least 2 ranks");
    let (am, lat, bw, ra) = match args.bench {
        Bench::Am => (true, false, false, false),
        Bench::Pingpong => (false, true, false, false),
        Bench::Bw => (false, false, true, false),
        Bench::Randomaccess => (false, false, false, true),
        Bench::Compare => (true, true, true, true),
        Bench::Amo | Bench::Strided | Bench::Nbrate => {
            anyhow::bail!("the amo, strided and nbrate benchmarks are DMAPP's: use --api dmapp")
        }
        Bench::Sync | Bench::Epoch => {
            anyhow::bail!("the sync and epoch benchmarks are MPI's: use --api mpi")
        }
        Bench::Phases => anyhow::bail!("phases reads a traced run's stamps; it runs no job"),
    };
    let (lat_sizes, bw_sizes) = args.sizes();
    let mut rows = Vec::new();
    if am {
        rows.extend(gasnet_bench::am(ctx, &mut g, &pongs, "am_short", 0)?);
        rows.extend(gasnet_bench::am_flood(ctx, &mut g, &pongs)?);
        let (max_medium, max_long) = (g.am_max_medium(), g.am_max_long_request());
        for &s in &lat_sizes {
            if s <= max_medium {
                rows.extend(gasnet_bench::am(ctx, &mut g, &pongs, "am_medium", s)?);
            }
            if s <= max_long {
                rows.extend(gasnet_bench::am(ctx, &mut g, &pongs, "am_long", s)?);
            }
        }
    }
    if lat {
        for get in [false, true] {
            for &s in &lat_sizes {
                rows.extend(gasnet_bench::blocking(ctx, &mut g, get, s)?);
            }
        }
        rows.extend(gasnet_bench::progress(ctx, &mut g, 8)?);
    }
    if bw {
        for &s in &bw_sizes {
            rows.extend(gasnet_bench::bw(ctx, &mut g, s)?);
        }
    }
    if ra {
        for v in [
            gasnet_ra::Variant::GetPut,
            gasnet_ra::Variant::Am,
            gasnet_ra::Variant::AmBucketed,
            gasnet_ra::Variant::Atomics,
        ]
        .into_iter()
        .filter(|v| args.ra_variant(v.name()))
        {
            rows.extend(gasnet_ra::run(
                ctx,
                &mut g,
                &ra_acks,
                args.table_log2,
                !args.no_verify,
                v,
            )?);
        }
    }
    g.barrier()?;
    if ctx.job.rank == 0 {
        report::emit(&rows, args.json)?;
    }
    Ok(())
}
