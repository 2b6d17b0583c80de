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
}

impl Row {
    /// This row with the median and 99th percentile of `samples` (µs) as its latency.
    pub fn with_latency(self, samples: &mut [f64]) -> Row {
        let (m, q) = median_p99(samples);
        Row {
            lat_us: Some(m),
            lat_us_p99: Some(q),
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
        "{:<13} {:<8} {:<8} {:<29} {:>9} {:>5} {:>10} {:>10} {:>10} {:>9} {:>9} {:>6}\n",
        "bench",
        "api",
        "conduit",
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
        let op = match &r.variant {
            Some(v) => format!("{}:{v}", r.op),
            None => r.op.clone(),
        };
        t += &format!(
            "{:<13} {:<8} {:<8} {:<29} {:>9} {:>5} {:>10} {:>10} {:>10} {:>9} {:>9} {:>6}\n",
            r.bench,
            r.api,
            r.conduit,
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
