//! `netbench phases`: where the one-way trips of a traced run spent their time, from the
//! stamps of `softnic::phase_trace` (a build with `--features phase-trace`, run with
//! `SOFTNIC_PHASE_TRACE=<dir>`). A one-way trip runs from a rank's `RankPost` to the next
//! `RankArrived` in another process, with every NIC stamp between; trips that passed the same
//! phases in the same order are grouped, and each step of the commonest groups gets its median.

use std::collections::HashMap;

use anyhow::Context;
use softnic::phase_trace::Phase;

/// One stamp of one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub ns: u64,
    pub cpu: u8,
    pub phase: Phase,
    /// Which file (process) it came from.
    pub proc_index: usize,
}

/// Reads every `*.phases` file in `dir`; returns the stamps of all, merged by time and cut
/// to the span every process was recording, and each process's role name.
pub fn load(dir: &std::path::Path) -> anyhow::Result<(Vec<Stamp>, Vec<String>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading the stamps in {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "phases"))
        .collect();
    files.sort();
    anyhow::ensure!(
        !files.is_empty(),
        "no *.phases files in {} (a process writes its file once its buffer is full: run longer, \
         e.g. more --iters)",
        dir.display()
    );
    let mut per_proc = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let text = std::fs::read_to_string(f)?;
        per_proc.push(parse(&text, i).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?);
    }
    let names = roles(&per_proc);
    Ok((merge(per_proc), names))
}

/// The stamps of one file: lines "ns cpu code".
pub fn parse(text: &str, proc_index: usize) -> Result<Vec<Stamp>, String> {
    text.lines()
        .enumerate()
        .map(|(n, line)| {
            let mut f = line.split_ascii_whitespace().map(str::parse::<u64>);
            let (Some(Ok(ns)), Some(Ok(cpu)), Some(Ok(code)), None) =
                (f.next(), f.next(), f.next(), f.next())
            else {
                return Err(format!("line {}: not \"ns cpu code\"", n + 1));
            };
            let phase = u8::try_from(code)
                .ok()
                .and_then(Phase::from_code)
                .ok_or_else(|| format!("line {}: unknown phase {code}", n + 1))?;
            Ok(Stamp {
                ns,
                cpu: cpu.min(255) as u8,
                phase,
                proc_index,
            })
        })
        .collect()
}

/// "NIC" for a process that stamped NIC phases, else "rank A", "rank B", … in file order.
fn roles(per_proc: &[Vec<Stamp>]) -> Vec<String> {
    let mut next_rank = 0u8;
    per_proc
        .iter()
        .map(|s| {
            if s.iter().any(|x| !x.phase.by_rank()) {
                "NIC".to_string()
            } else {
                next_rank += 1;
                format!("rank {}", (b'A' + next_rank - 1) as char)
            }
        })
        .collect()
}

/// All processes' stamps by time, within the span each of them was recording.
fn merge(per_proc: Vec<Vec<Stamp>>) -> Vec<Stamp> {
    let from = per_proc
        .iter()
        .filter_map(|s| s.first())
        .map(|s| s.ns)
        .max();
    let to = per_proc.iter().filter_map(|s| s.last()).map(|s| s.ns).min();
    let (Some(from), Some(to)) = (from, to) else {
        return Vec::new();
    };
    let mut all: Vec<Stamp> = per_proc
        .into_iter()
        .flatten()
        .filter(|s| (from..=to).contains(&s.ns))
        .collect();
    all.sort_by_key(|s| s.ns);
    all
}

/// The one-way trips: from a `RankPost` to the next `RankArrived` of another process.
pub fn one_ways(stamps: &[Stamp]) -> Vec<&[Stamp]> {
    let mut out = Vec::new();
    let mut start: Option<usize> = None;
    for (i, s) in stamps.iter().enumerate() {
        match (s.phase, start) {
            (Phase::RankPost, _) => start = Some(i),
            (Phase::RankArrived, Some(b)) if s.proc_index != stamps[b].proc_index => {
                out.push(&stamps[b..=i]);
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// The way a trip went: each stamp's process, phase and CPU.
type Route = Vec<(usize, Phase, u8)>;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The report: how many trips, their median, and the steps of the `groups` commonest
/// sequences of phases (role, phase, CPU) with each step's median in µs.
pub fn report(stamps: &[Stamp], names: &[String], groups: usize) -> String {
    use std::fmt::Write;
    let trips = one_ways(stamps);
    let mut out = String::new();
    if trips.is_empty() {
        out.push_str(
            "no one-way trips in the common span (did every process trace the same run?)\n",
        );
        return out;
    }
    let us = |a: &Stamp, b: &Stamp| (b.ns - a.ns) as f64 / 1000.0;
    let mut all: Vec<f64> = trips.iter().map(|t| us(&t[0], &t[t.len() - 1])).collect();
    let _ = writeln!(
        out,
        "{} one-way trips, median {:.2} µs",
        trips.len(),
        median(&mut all)
    );
    let key = |t: &[Stamp]| -> Route { t.iter().map(|s| (s.proc_index, s.phase, s.cpu)).collect() };
    let mut by_key: HashMap<Route, Vec<&[Stamp]>> = HashMap::new();
    for t in &trips {
        by_key.entry(key(t)).or_default().push(t);
    }
    let mut ranked: Vec<_> = by_key.into_iter().collect();
    ranked.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
    for (k, ts) in ranked.into_iter().take(groups) {
        let mut total: Vec<f64> = ts.iter().map(|t| us(&t[0], &t[t.len() - 1])).collect();
        let _ = writeln!(
            out,
            "\n{} trips ({:.0}%), median {:.2} µs:",
            ts.len(),
            100.0 * ts.len() as f64 / trips.len() as f64,
            median(&mut total)
        );
        for (i, &(p, phase, cpu)) in k.iter().enumerate() {
            let who = names.get(p).map_or("?", String::as_str);
            if i == 0 {
                let _ = writeln!(out, "  {:>8.2}  {who} {phase:?} (cpu {cpu})", 0.0);
                continue;
            }
            let mut step: Vec<f64> = ts.iter().map(|t| us(&t[i - 1], &t[i])).collect();
            let _ = writeln!(
                out,
                "  {:>+8.2}  {who} {phase:?} (cpu {cpu})",
                median(&mut step)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(lines: &[(u64, u8, Phase)]) -> String {
        lines
            .iter()
            .map(|(ns, cpu, p)| format!("{ns} {cpu} {}\n", *p as u8))
            .collect()
    }

    #[test]
    fn trips_are_put_together_across_processes_and_their_steps_timed() {
        use Phase::*;
        // Two ranks ping-ponging through one NIC: every trip takes 1 µs to be taken, 3 to be
        // sent, 1 to be seen. Rank B's first stamp (5.1 µs) starts the span every process
        // recorded, so the first trip is cut; the last post has no arrival and makes none.
        let mut a = Vec::new();
        let mut b = Vec::new();
        let mut nic = Vec::new();
        for k in 0..4u64 {
            let t = 10_000 * k;
            let (from, to) = if k % 2 == 0 {
                (&mut a, &mut b)
            } else {
                (&mut b, &mut a)
            };
            from.push((t, 0, RankPost));
            nic.push((t + 1_000, 1, CommandTaken));
            nic.push((t + 1_100, 1, SendStart));
            nic.push((t + 4_100, 1, SendEnd));
            to.push((t + 5_100, 0, RankArrived));
        }
        a.push((50_000, 0, RankPost));
        nic.push((60_000, 1, CommandTaken));
        b.push((60_000, 0, RankArrived));
        let per = vec![
            parse(&file(&a), 0).unwrap(),
            parse(&file(&b), 1).unwrap(),
            parse(&file(&nic), 2).unwrap(),
        ];
        let names = roles(&per);
        assert_eq!(names, ["rank A", "rank B", "NIC"]);
        let all = merge(per);
        let trips = one_ways(&all);
        assert_eq!(trips.len(), 3);
        assert!(trips.iter().all(|t| t.len() == 5));
        let r = report(&all, &names, 2);
        assert!(r.starts_with("3 one-way trips, median 5.10 µs"), "{r}");
        assert!(r.contains("2 trips (67%), median 5.10 µs"), "{r}");
        assert!(r.contains("+3.00  NIC SendEnd (cpu 1)"), "{r}");
        assert!(r.contains("+1.00  rank A RankArrived (cpu 0)"), "{r}");
        assert!(r.contains("+1.00  rank B RankArrived (cpu 0)"), "{r}");
    }

    #[test]
    fn a_malformed_line_is_refused_with_where() {
        assert_eq!(
            parse("5 0 1\n6 0\n", 0),
            Err("line 2: not \"ns cpu code\"".into())
        );
        assert_eq!(parse("5 0 99\n", 0), Err("line 1: unknown phase 99".into()));
    }
}
