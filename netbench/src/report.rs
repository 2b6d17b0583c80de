//! Result rows: JSON lines on stdout (with `--json`) and a human table.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Row {
    pub bench: String,
    pub api: String,
    pub conduit: String,
    pub op: String,
    pub size: usize,
    pub ranks: u32,
    pub hosts: u32,
    pub iters: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_us_p99: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mb_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mops: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gups: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
    /// How many rounds (`--rounds`) this row is the median of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounds: Option<u32>,
    /// The daemons' transport (udp, tcp, packet) for rows whose traffic goes through them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// `per-host` for rows whose hosts each had a daemon process of their own (`softnic run
    /// --daemon-per-host`, as on a LAN); unset: one process served every host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daemons: Option<String>,
    /// Strided transfers: the target stride in elements.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stride: Option<u64>,
    /// Strided transfers: elements per call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nelems: Option<u64>,
    /// Message-rate runs: operations in flight before each sync.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outstanding: Option<u32>,
    /// Bandwidth runs: sending processes per node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ppn: Option<u32>,
    /// MPI `epoch` runs: operations per lock epoch (`lat_us` is per operation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_epoch: Option<u32>,
}

impl Row {
    /// This row with the median and 99th percentile of `samples` (µs) as its latency, and
    /// their number as `iters`.
    pub fn with_latency(self, samples: &mut [f64]) -> Row {
        let (m, q) = median_p99(samples);
        Row {
            lat_us: Some(m),
            lat_us_p99: Some(q),
            iters: if samples.is_empty() {
                self.iters
            } else {
                samples.len()
            },
            ..self
        }
    }
}

/// Median and 99th percentile of samples (µs), sorting them in place.
pub fn median_p99(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(|a, b| a.total_cmp(b));
    let n = samples.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let med = if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    };
    (
        med,
        samples[((n as f64 * 0.99).ceil() as usize).clamp(1, n) - 1],
    )
}

/// One row per measurement from the rows of several rounds (in order of first appearance):
/// each figure is the median over the rounds that produced it, errors the worst round's.
pub fn merge_rounds(rows: Vec<Row>) -> Vec<Row> {
    // Rows of one measurement differ only in their figures.
    let same = |a: &Row, b: &Row| {
        (
            &a.bench,
            &a.api,
            &a.conduit,
            &a.op,
            &a.variant,
            &a.transport,
            &a.daemons,
        ) == (
            &b.bench,
            &b.api,
            &b.conduit,
            &b.op,
            &b.variant,
            &b.transport,
            &b.daemons,
        ) && (a.size, a.ranks, a.hosts) == (b.size, b.ranks, b.hosts)
            && (a.stride, a.nelems, a.outstanding, a.ppn, a.per_epoch)
                == (b.stride, b.nelems, b.outstanding, b.ppn, b.per_epoch)
    };
    let mut groups: Vec<Vec<Row>> = Vec::new();
    for r in rows {
        match groups.iter_mut().find(|g| same(&g[0], &r)) {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    groups
        .into_iter()
        .map(|v| {
            let med = |f: fn(&Row) -> Option<f64>| {
                let mut xs: Vec<f64> = v.iter().filter_map(f).collect();
                (!xs.is_empty()).then(|| median_p99(&mut xs).0)
            };
            Row {
                lat_us: med(|r| r.lat_us),
                lat_us_p99: med(|r| r.lat_us_p99),
                mb_s: med(|r| r.mb_s),
                mops: med(|r| r.mops),
                gups: med(|r| r.gups),
                errors: v.iter().filter_map(|r| r.errors).max(),
                rounds: Some(v.len() as u32),
                ..v[0].clone()
            }
        })
        .collect()
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

/// The rows as JSON lines.
pub fn json_lines(rows: &[Row]) -> String {
    rows.iter()
        .map(|r| serde_json::to_string(r).expect("row serialises") + "\n")
        .collect()
}

/// Rank 0's rows: appended to the launcher's rows file when there is one, printed otherwise.
pub fn emit(rows: &[Row], json: bool) -> anyhow::Result<()> {
    match std::env::var_os(crate::suite::ROWS_ENV) {
        Some(path) => {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            f.write_all(json_lines(rows).as_bytes())?;
        }
        None => print(rows, json),
    }
    Ok(())
}

pub fn print(rows: &[Row], json: bool) {
    if json {
        print!("{}", json_lines(rows));
    }
    let mut t = String::new();
    t += &format!(
        "{:<13} {:<8} {:<8} {:<7} {:<29} {:>9} {:>5} {:>10} {:>10} {:>10} {:>9} {:>9} {:>6}\n",
        "bench",
        "api",
        "conduit",
        "via",
        "op",
        "size",
        "ranks",
        "lat_us",
        "p99_us",
        "MB/s",
        "Mops",
        "GUP/s",
        "errors"
    );
    for r in rows {
        let mut op = match &r.variant {
            Some(v) => format!("{}:{v}", r.op),
            None => r.op.clone(),
        };
        for (tag, v) in [
            ("st", r.stride),
            ("n", r.nelems),
            ("o", r.outstanding.map(u64::from)),
            ("ppn", r.ppn.map(u64::from)),
            ("e", r.per_epoch.map(u64::from)),
        ] {
            if let Some(v) = v {
                op += &format!(" {tag}={v}");
            }
        }
        if let Some(d) = &r.daemons {
            op += &format!(" daemons={d}");
        }
        t += &format!(
            "{:<13} {:<8} {:<8} {:<7} {:<29} {:>9} {:>5} {:>10} {:>10} {:>10} {:>9} {:>9} {:>6}\n",
            r.bench,
            r.api,
            r.conduit,
            r.transport.as_deref().unwrap_or("-"),
            op,
            r.size,
            r.ranks,
            opt(r.lat_us, 2),
            opt(r.lat_us_p99, 2),
            opt(r.mb_s, 1),
            opt(r.mops, 3),
            opt(r.gups, 5),
            r.errors.map_or("-".into(), |e| e.to_string())
        );
    }
    if json {
        eprint!("{t}");
    } else {
        print!("{t}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lat(op: &str, size: usize, us: f64) -> Row {
        Row {
            bench: "pingpong".into(),
            op: op.into(),
            size,
            lat_us: Some(us),
            ..Default::default()
        }
    }

    #[test]
    fn rounds_merge_into_their_median_in_first_seen_order() {
        let mut ra = lat("xor", 64, 0.0);
        ra.lat_us = None;
        ra.gups = Some(0.3);
        ra.errors = Some(0);
        let mut ra2 = ra.clone();
        ra2.gups = Some(0.1);
        ra2.errors = Some(4);
        let rows = vec![
            lat("put", 8, 10.0),
            lat("put", 1024, 12.0),
            ra,
            lat("put", 8, 13.5),
            lat("put", 1024, 12.2),
            ra2,
            lat("put", 8, 9.8),
            lat("put", 1024, 30.0),
        ];
        let m = merge_rounds(rows);
        assert_eq!(m.len(), 3);
        assert_eq!(
            (m[0].size, m[0].lat_us, m[0].rounds),
            (8, Some(10.0), Some(3))
        );
        assert_eq!((m[1].size, m[1].lat_us), (1024, Some(12.2)));
        // Two rounds: the mean of both; errors: the worse round.
        assert_eq!((m[2].op.as_str(), m[2].rounds), ("xor", Some(2)));
        assert!((m[2].gups.unwrap() - 0.2).abs() < 1e-12);
        assert_eq!((m[2].errors, m[2].lat_us), (Some(4), None));
    }
}
