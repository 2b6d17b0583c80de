//! Outside a job: plans the jobs a command needs, runs them one after another on the launcher,
//! gathers their rows, and prints one table (and plots, for `compare`).
//!
//! A rank attaches to one GASNet conduit for its life, so every GASNet conduit is its own job;
//! GUPS vs ranks needs one job per rank count. Rank 0 of each job appends its rows as JSON lines
//! to the file named by `NETBENCH_ROWS`.

use std::ffi::OsString;
use std::io::BufRead;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::report::{self, Row};
use crate::{Args, Bench};

/// Where rank 0 of a job writes its rows.
pub const ROWS_ENV: &str = "NETBENCH_ROWS";

/// One job of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub label: String,
    pub bench: Bench,
    pub api: String,
    pub conduit: Option<String>,
    pub ranks: u32,
    /// The daemons' transport, when the step names one.
    pub transport: Option<softnic::config::TransportKind>,
    /// A daemon process per host (`--daemon-per-host`) for this step.
    pub daemon_per_host: bool,
    /// Message sizes for this step instead of `--sizes` or the defaults.
    pub sizes: Option<Vec<usize>>,
}

/// The sizes compare runs again with a daemon process per host, unless `--sizes` (issue 26: the
/// bulk figures as a LAN runs its daemons): put_nbi over gni, Portals and the portals conduit.
const PER_HOST_SIZES: [usize; 2] = [1 << 20, 4 << 20];

/// The GASNet conduits, in the order compare runs them.
const GASNET_CONDUITS: [&str; 3] = ["udp", "portals", "extoll"];

/// Whether the local default's daemons use the packet transport here.
fn local_packet() -> bool {
    match std::env::var("SOFTNIC_TRANSPORT") {
        Ok(t) => t == "packet",
        Err(_) => {
            softnic::config::TransportKind::best_local() == softnic::config::TransportKind::Packet
        }
    }
}

/// The jobs `args` asks for.
pub fn plan(args: &Args) -> anyhow::Result<Vec<Step>> {
    plan_for(args, local_packet())
}

/// The jobs `args` asks for when the local default's transport is (or is not) packet: then
/// compare also runs the portals conduit's ping-pongs over the UDP transport, beside.
fn plan_for(args: &Args, packet: bool) -> anyhow::Result<Vec<Step>> {
    let api = args.api.clone().unwrap_or_else(|| "all".into());
    let conduit = args.conduit.clone();
    let step = |bench, api: &str, conduit: Option<&str>, ranks| Step {
        label: match conduit {
            Some(c) => format!("{} {api}/{c} ×{ranks}", bench_name(bench)),
            None => format!("{} {api} ×{ranks}", bench_name(bench)),
        },
        bench,
        api: api.into(),
        conduit: conduit.map(Into::into),
        ranks,
        transport: None,
        daemon_per_host: args.daemon_per_host,
        sizes: None,
    };
    let gasnet_conduits: Vec<&str> = match conduit.as_deref() {
        None | Some("all") => GASNET_CONDUITS.to_vec(),
        Some(c) if GASNET_CONDUITS.contains(&c) => vec![c],
        Some(c) if api == "gasnet" => {
            anyhow::bail!("unknown GASNet conduit {c:?}: use udp, portals, extoll or all")
        }
        Some(_) => vec![],
    };
    if let Some(r) = args
        .ra_ranks
        .iter()
        .find(|r| !r.is_power_of_two() || **r < 2)
    {
        anyhow::bail!("--ra-ranks {r}: RandomAccess runs on a power-of-two number of ranks, ≥ 2");
    }
    let mut steps = Vec::new();
    match (args.bench, api.as_str()) {
        (Bench::Compare, "all") => {
            // Everything: the daemon APIs (raw-udp floor, gni, portals) in one job, then each
            // GASNet conduit, then RandomAccess at every other rank count for GUPS vs ranks.
            steps.push(step(Bench::Compare, "all", conduit.as_deref(), args.ranks));
            for c in &gasnet_conduits {
                steps.push(step(Bench::Compare, "gasnet", Some(c), args.ranks));
            }
            if packet && gasnet_conduits.contains(&"portals") {
                let mut s = step(Bench::Pingpong, "gasnet", Some("portals"), args.ranks);
                s.label += " over the udp transport";
                s.transport = Some(softnic::config::TransportKind::Udp);
                steps.push(s);
            }
            // The bulk rows again with a daemon process per host, unless every job has that.
            if !args.daemon_per_host && args.config.is_none() {
                let all = conduit.as_deref().is_none_or(|c| c == "all");
                let mut per_host = Vec::new();
                if all || conduit.as_deref() == Some("gni") {
                    per_host.push(step(Bench::Bw, "gni", None, args.ranks));
                }
                if all || conduit.as_deref() == Some("portals") {
                    per_host.push(step(Bench::Bw, "portals", None, args.ranks));
                }
                if gasnet_conduits.contains(&"portals") {
                    per_host.push(step(Bench::Bw, "gasnet", Some("portals"), args.ranks));
                }
                for mut s in per_host {
                    s.label += ", a daemon per host";
                    s.daemon_per_host = true;
                    s.sizes = args.sizes.is_none().then(|| PER_HOST_SIZES.to_vec());
                    steps.push(s);
                }
            }
            for &r in args.ra_ranks.iter().filter(|&&r| r != args.ranks) {
                steps.push(step(Bench::Randomaccess, "all", conduit.as_deref(), r));
                for c in &gasnet_conduits {
                    steps.push(step(Bench::Randomaccess, "gasnet", Some(c), r));
                }
            }
            // MPI: everything at the job's size, then synchronisation at the other sizes.
            if conduit.as_deref().is_none_or(|c| c == "all" || c == "mpi") {
                steps.push(step(Bench::Compare, "mpi", None, args.ranks));
                for &r in args.sync_ranks.iter().filter(|&&r| r != args.ranks) {
                    steps.push(step(Bench::Sync, "mpi", None, r));
                }
            }
            // DMAPP's figures at their other rank counts: Fig. 3 at 2 and 4 processes per
            // node, Fig. 6 at 4 and 8 ranks (the compare job itself is the first point).
            if conduit
                .as_deref()
                .is_none_or(|c| c == "all" || c == "dmapp")
            {
                for ppn in [2u32, 4] {
                    let r = ppn * args.hosts as u32;
                    if r != args.ranks {
                        steps.push(step(Bench::Bw, "dmapp", None, r));
                    }
                }
                for r in [4u32, 8] {
                    if r != args.ranks {
                        steps.push(step(Bench::Amo, "dmapp", None, r));
                    }
                }
            }
        }
        (Bench::Sync, "mpi") => {
            for &r in &args.sync_ranks {
                anyhow::ensure!(r >= 2, "--sync-ranks {r}: at least 2");
                steps.push(step(Bench::Sync, "mpi", None, r));
            }
        }
        (Bench::Bw, "dmapp") if args.ppn.is_some() => {
            for &ppn in args.ppn.as_deref().unwrap_or_default() {
                anyhow::ensure!(ppn >= 1, "--ppn 0: at least one process per node");
                steps.push(step(Bench::Bw, "dmapp", None, ppn * args.hosts as u32));
            }
        }
        (b, "gasnet") => {
            for c in &gasnet_conduits {
                steps.push(step(b, "gasnet", Some(c), args.ranks));
            }
        }
        (b, a) => steps.push(step(b, a, conduit.as_deref(), args.ranks)),
    }
    Ok(steps)
}

fn bench_name(b: Bench) -> &'static str {
    match b {
        Bench::Pingpong => "pingpong",
        Bench::Bw => "bw",
        Bench::Randomaccess => "randomaccess",
        Bench::Am => "am",
        Bench::Amo => "amo",
        Bench::Strided => "strided",
        Bench::Nbrate => "nbrate",
        Bench::Sync => "sync",
        Bench::Epoch => "epoch",
        Bench::Compare => "compare",
        Bench::Phases => "phases",
    }
}

/// The command line of one step's ranks: the user's options with the step's bench, api,
/// conduit and ranks.
fn step_args(args: &Args, s: &Step) -> Vec<OsString> {
    let mut v: Vec<String> = vec![bench_name(s.bench).into(), "--api".into(), s.api.clone()];
    if let Some(c) = &s.conduit {
        v.extend(["--conduit".into(), c.clone()]);
    }
    v.extend([
        "--ranks".into(),
        s.ranks.to_string(),
        "--hosts".into(),
        args.hosts.to_string(),
        "--iters".into(),
        args.iters.to_string(),
        "--table-log2".into(),
        args.table_log2.to_string(),
    ]);
    if let Some(sizes) = s.sizes.as_ref().or(args.sizes.as_ref()) {
        let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
        v.extend(["--sizes".into(), list.join(",")]);
    }
    if s.daemon_per_host {
        v.push("--daemon-per-host".into());
    }
    if args.no_verify {
        v.push("--no-verify".into());
    }
    if let Some(ra) = &args.ra_variants {
        v.extend(["--ra-variants".into(), ra.join(",")]);
    }
    let list = |xs: &[u64]| {
        xs.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let outstanding: Vec<u64> = args.outstanding.iter().map(|&o| o as u64).collect();
    let per_epoch: Vec<u64> = args.per_epoch.iter().map(|&o| o as u64).collect();
    v.extend([
        "--per-epoch".into(),
        list(&per_epoch),
        "--outstanding".into(),
        list(&outstanding),
        "--strides".into(),
        list(&args.strides),
        "--nelems".into(),
        list(&args.nelems),
    ]);
    v.into_iter().map(Into::into).collect()
}

/// Runs every step on the local default; prints the merged table (JSON lines too with
/// `--json`), writes `<out>/<bench>.jsonl`, and for `compare` draws the figures. Returns the
/// exit status: 0, or 1 when a step failed (its rows are missing; the others are reported).
pub fn run(args: &Args) -> anyhow::Result<i32> {
    let steps = plan(args)?;
    let rounds = args.rounds();
    let bar = indicatif::ProgressBar::new(steps.len() as u64 * u64::from(rounds));
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
        )
        .expect("static template"),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let program = std::env::current_exe()?;
    let mut rows: Vec<Row> = Vec::new();
    let mut failed = Vec::new();
    // Round after round of every job, so that each job's rounds are spread over the run.
    'rounds: for round in 1..=rounds {
        for s in &steps {
            bar.set_message(if rounds > 1 {
                format!("{} (round {round}/{rounds})", s.label)
            } else {
                s.label.clone()
            });
            let (code, got) = run_step(args, s, &program)?;
            match (code, got) {
                (0, Ok(r)) => rows.extend(r),
                (0, Err(e)) => failed.push(format!("{} (round {round}): {e:#}", s.label)),
                (c, _) => failed.push(format!(
                    "{} (round {round}): exited with status {c}",
                    s.label
                )),
            }
            bar.inc(1);
            // Ctrl-C (the launcher's 130) ends the whole run, not only this job.
            if code == 130 {
                failed.push("interrupted: the remaining jobs did not run".into());
                break 'rounds;
            }
        }
    }
    bar.finish_and_clear();
    let out = args.out.clone();
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    if rounds > 1 {
        // Every round's own rows too, to see how far apart the rounds were.
        let each = out.join(format!("{}-rounds.jsonl", bench_name(args.bench)));
        std::fs::write(&each, report::json_lines(&rows))
            .with_context(|| format!("writing {}", each.display()))?;
    }
    let rows = report::merge_rounds(rows);
    report::print(&rows, args.json);
    let jsonl = out.join(format!("{}.jsonl", bench_name(args.bench)));
    std::fs::write(&jsonl, report::json_lines(&rows))
        .with_context(|| format!("writing {}", jsonl.display()))?;
    eprintln!("netbench: rows in {}", jsonl.display());
    if args.bench == Bench::Compare {
        let paths = crate::plot::write_all(&out, &crate::plot::figures(&rows))?;
        for p in paths {
            eprintln!("netbench: figure {}", p.display());
        }
    }
    for f in &failed {
        eprintln!("netbench: step failed: {f}");
    }
    Ok(if failed.is_empty() { 0 } else { 1 })
}

/// Runs one job on the local default: its exit status and the rows rank 0 wrote.
fn run_step(
    args: &Args,
    s: &Step,
    program: &std::path::Path,
) -> anyhow::Result<(i32, anyhow::Result<Vec<Row>>)> {
    let file = tempfile_path(&s.label);
    let l = softnic::job::local::Launch {
        ranks: s.ranks,
        hosts: args.hosts,
        config: args.config.clone(),
        program: program.to_path_buf().into(),
        args: step_args(args, s),
        env: vec![(ROWS_ENV.into(), file.display().to_string())],
        transport: s.transport,
        daemon_per_host: s.daemon_per_host,
        ..Default::default()
    };
    let launched = match &args.config {
        None => softnic::job::local::run(&l),
        Some(p) => {
            use softnic::job::Spawner;
            let cfg = softnic::config::Config::load(p)?;
            match Spawner::choose(args.spawner, Some(&cfg))? {
                Spawner::Local => softnic::job::local::run(&l),
                Spawner::Ssh => softnic::job::ssh::run(&l),
                Spawner::Slurm => softnic::job::slurm::run(&l),
            }
        }
    };
    let code = launched.with_context(|| format!("launching {}", s.label))?;
    let got = read_rows(&file);
    let _ = std::fs::remove_file(&file);
    Ok((code, got))
}

fn tempfile_path(label: &str) -> PathBuf {
    let tag: String = label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    std::env::temp_dir().join(format!("netbench-{}-{tag}.jsonl", std::process::id()))
}

fn read_rows(path: &std::path::Path) -> anyhow::Result<Vec<Row>> {
    let f = std::fs::File::open(path).context("the job wrote no rows")?;
    std::io::BufReader::new(f)
        .lines()
        .map(|l| Ok(serde_json::from_str(&l?)?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn labels_for(cmd: &str, packet: bool) -> Vec<String> {
        let args = Args::try_parse_from(cmd.split_whitespace()).unwrap();
        plan_for(&args, packet)
            .unwrap()
            .into_iter()
            .map(|s| s.label)
            .collect()
    }

    fn labels(cmd: &str) -> Vec<String> {
        labels_for(cmd, false)
    }

    #[test]
    fn compare_runs_every_api_and_conduit_and_gups_vs_ranks() {
        let udp = [
            "compare all ×2",
            "compare gasnet/udp ×2",
            "compare gasnet/portals ×2",
            "compare gasnet/extoll ×2",
            "bw gni ×2, a daemon per host",
            "bw portals ×2, a daemon per host",
            "bw gasnet/portals ×2, a daemon per host",
            "randomaccess all ×4",
            "randomaccess gasnet/udp ×4",
            "randomaccess gasnet/portals ×4",
            "randomaccess gasnet/extoll ×4",
            "compare mpi ×2",
            "sync mpi ×4",
            "sync mpi ×8",
            "bw dmapp ×4",
            "bw dmapp ×8",
            "amo dmapp ×4",
            "amo dmapp ×8",
        ];
        assert_eq!(labels("netbench compare --ranks 2 --ra-ranks 2,4"), udp);
        let packet = labels_for("netbench compare --ranks 2 --ra-ranks 2,4", true);
        assert_eq!(packet[..4], udp[..4]);
        assert_eq!(
            packet[4],
            "pingpong gasnet/portals ×2 over the udp transport"
        );
        assert_eq!(packet[5..], udp[4..]);
        let args = Args::try_parse_from(["netbench", "compare"]).unwrap();
        let plan = plan_for(&args, true).unwrap();
        assert_eq!(plan[4].transport, Some(softnic::config::TransportKind::Udp));
        // The bulk rows again, a daemon process per host: only those steps, at 1 and 4 MiB.
        for (i, s) in plan.iter().enumerate() {
            assert_eq!(s.daemon_per_host, (5..8).contains(&i), "{}", s.label);
            let a = step_args(&args, s);
            let has = |x: &str| a.iter().any(|v| v == x);
            assert_eq!(has("--daemon-per-host"), s.daemon_per_host, "{}", s.label);
            if s.daemon_per_host {
                assert_eq!(s.bench, Bench::Bw);
                assert!(has("1048576,4194304"), "{a:?}");
            } else {
                assert!(!has("--sizes"), "{}: the defaults", s.label);
            }
        }
    }

    #[test]
    fn with_a_daemon_per_host_every_job_has_one() {
        let args = Args::try_parse_from(["netbench", "compare", "--daemon-per-host"]).unwrap();
        let plan = plan_for(&args, true).unwrap();
        assert!(plan.iter().all(|s| s.daemon_per_host));
        assert!(
            !plan.iter().any(|s| s.label.contains("a daemon per host")),
            "no extra steps"
        );
        let sized = Args::try_parse_from(["netbench", "compare", "--sizes", "4k"]).unwrap();
        let a: Vec<_> = plan_for(&sized, false)
            .unwrap()
            .iter()
            .filter(|s| s.daemon_per_host)
            .map(|s| step_args(&sized, s))
            .collect();
        assert_eq!(a.len(), 3);
        assert!(
            a.iter().all(|a| a.iter().any(|v| v == "4096")),
            "--sizes wins: {a:?}"
        );
        let only_gni = Args::try_parse_from(["netbench", "compare", "--conduit", "gni"]).unwrap();
        let per_host: Vec<_> = plan_for(&only_gni, false)
            .unwrap()
            .into_iter()
            .filter(|s| s.daemon_per_host)
            .map(|s| s.label)
            .collect();
        assert_eq!(per_host, ["bw gni ×2, a daemon per host"]);
    }

    #[test]
    fn compare_repeats_its_jobs_unless_told_otherwise() {
        let rounds = |cmd: &str| {
            Args::try_parse_from(cmd.split_whitespace())
                .unwrap()
                .rounds()
        };
        assert_eq!(rounds("netbench compare"), 5);
        assert_eq!(rounds("netbench compare --rounds 1"), 1);
        assert_eq!(rounds("netbench pingpong"), 1);
        assert!(Args::try_parse_from(["netbench", "compare", "--rounds", "0"]).is_err());
    }

    #[test]
    fn dmapp_bandwidth_runs_one_job_per_processes_per_node() {
        assert_eq!(
            labels("netbench bw --api dmapp --ppn 1,2,4 --hosts 2"),
            ["bw dmapp ×2", "bw dmapp ×4", "bw dmapp ×8"]
        );
        assert_eq!(
            labels("netbench amo --api dmapp --ranks 4"),
            ["amo dmapp ×4"]
        );
    }

    #[test]
    fn mpi_sync_runs_one_job_per_size() {
        assert_eq!(
            labels("netbench sync --api mpi --sync-ranks 2,4,8"),
            ["sync mpi ×2", "sync mpi ×4", "sync mpi ×8"]
        );
        assert_eq!(labels("netbench epoch --api mpi"), ["epoch mpi ×2"]);
        let bad = Args::try_parse_from(["netbench", "sync", "--api", "mpi", "--sync-ranks", "1"])
            .unwrap();
        assert!(plan(&bad).is_err());
    }

    #[test]
    fn gasnet_conduit_all_is_one_job_per_conduit() {
        assert_eq!(
            labels("netbench am --api gasnet --conduit all"),
            [
                "am gasnet/udp ×2",
                "am gasnet/portals ×2",
                "am gasnet/extoll ×2"
            ]
        );
        assert_eq!(
            labels("netbench bw --api gasnet --conduit portals"),
            ["bw gasnet/portals ×2"]
        );
        let bad =
            Args::try_parse_from(["netbench", "am", "--api", "gasnet", "--conduit", "ib"]).unwrap();
        assert!(plan(&bad).is_err());
    }

    #[test]
    fn step_args_round_trip_through_the_parser() {
        let args = Args::try_parse_from(
            "netbench compare --iters 7 --sizes 8,1k --no-verify --table-log2 12"
                .split_whitespace(),
        )
        .unwrap();
        let s = &plan(&args).unwrap()[1];
        let mut argv: Vec<OsString> = vec!["netbench".into()];
        argv.extend(step_args(&args, s));
        let child = Args::try_parse_from(argv).unwrap();
        assert_eq!(child.bench, Bench::Compare);
        assert_eq!(child.api.as_deref(), Some("gasnet"));
        assert_eq!(child.conduit.as_deref(), Some("udp"));
        assert_eq!(child.sizes, Some(vec![8, 1024]));
        assert_eq!(
            (child.iters, child.table_log2, child.no_verify),
            (7, 12, true)
        );
    }
}
