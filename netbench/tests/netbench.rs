//! netbench end to end on the local default: JSON lines carry the fields DESIGN §5 fixes,
//! RandomAccess verifies with 0 errors on 2 ranks over 2 hosts, and `compare` covers every API
//! and conduit in one run with its figures.

use std::path::PathBuf;
use std::process::Command;

/// A fresh output directory for one test.
fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("netbench-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn rows(args: &[&str]) -> Vec<serde_json::Value> {
    rows_in(args, &out_dir(args[0]))
}

fn rows_in(args: &[&str], out: &std::path::Path) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_netbench"))
        .args(args)
        .arg("--json")
        .arg("--out")
        .arg(out)
        .output()
        .expect("netbench runs");
    assert!(
        out.status.success(),
        "netbench {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect()
}

#[test]
fn randomaccess_verifies_with_zero_errors() {
    let rows = rows(&[
        "randomaccess",
        "--ranks",
        "2",
        "--hosts",
        "2",
        "--table-log2",
        "14",
    ]);
    assert_eq!(
        rows.len(),
        5,
        "one row per variant: gni's two, dmapp's AXOR nbi, extoll's velo and velo-bucketed"
    );
    assert!(rows
        .iter()
        .any(|r| r["api"] == "extoll" && r["variant"] == "velo-bucketed"));
    assert!(rows
        .iter()
        .any(|r| r["api"] == "dmapp" && r["variant"] == "axor-nbi"));
    for r in rows {
        assert_eq!(r["bench"], "randomaccess");
        assert_eq!(
            (r["ranks"].as_u64(), r["hosts"].as_u64()),
            (Some(2), Some(2))
        );
        assert_eq!(r["errors"].as_u64(), Some(0), "{r}");
        assert!(r["gups"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn dmapp_figures_carry_their_parameters() {
    let strided = rows(&[
        "strided",
        "--api",
        "dmapp",
        "--strides",
        "1,2",
        "--nelems",
        "8,64",
        "--iters",
        "20",
    ]);
    assert_eq!(
        strided.len(),
        8,
        "2 strides × 2 lengths × (iput, put_nbi_loop)"
    );
    for r in &strided {
        assert!(
            r["stride"].as_u64().is_some() && r["nelems"].as_u64().is_some(),
            "{r}"
        );
        assert!(r["mops"].as_f64().unwrap() > 0.0, "{r}");
    }
    let nb = rows(&[
        "nbrate",
        "--api",
        "dmapp",
        "--sizes",
        "8",
        "--outstanding",
        "1,4",
        "--iters",
        "20",
    ]);
    let ops: Vec<(String, u64)> = nb
        .iter()
        .map(|r| {
            (
                r["op"].as_str().unwrap().to_string(),
                r["outstanding"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ops,
        [
            ("put_nbi".into(), 1),
            ("put_nbi".into(), 4),
            ("put_nb".into(), 1),
            ("put_nb".into(), 4),
            ("put_blocking".into(), 1)
        ]
    );
    let amo = rows(&["amo", "--api", "dmapp", "--ranks", "3", "--iters", "50"]);
    let mut got: Vec<String> = amo
        .iter()
        .map(|r| {
            format!(
                "{}:{}",
                r["op"].as_str().unwrap(),
                r["variant"].as_str().unwrap()
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            "aadd_nbi:random8k",
            "aadd_nbi:single",
            "afadd:random8k",
            "afadd:single"
        ]
    );
    let bw = rows(&[
        "bw", "--api", "dmapp", "--ppn", "1,2", "--sizes", "4096", "--iters", "20",
    ]);
    let ppn: Vec<u64> = bw.iter().map(|r| r["ppn"].as_u64().unwrap()).collect();
    assert_eq!(ppn, [1, 2]);
    assert!(bw.iter().all(|r| r["mb_s"].as_f64().unwrap() > 0.0));
}

#[test]
fn pingpong_and_bw_rows_have_the_contract_fields() {
    let rows = rows(&["pingpong", "--sizes", "8,5000", "--iters", "50"]);
    for key in [
        "bench", "api", "conduit", "op", "size", "ranks", "hosts", "iters",
    ] {
        assert!(rows.iter().all(|r| r.get(key).is_some()), "missing {key}");
    }
    let ops: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["conduit"].as_str().unwrap().into(),
                r["op"].as_str().unwrap().into(),
            )
        })
        .collect();
    for want in [
        ("raw-udp", "pingpong"),
        ("raw-tcp", "pingpong"),
        ("gni", "put"),
        ("gni", "put_blocking"),
        ("gni", "get"),
        ("gni", "afadd"),
    ] {
        assert!(
            ops.contains(&(want.0.into(), want.1.into())),
            "no {want:?} row"
        );
    }
    assert!(rows.iter().all(|r| r["lat_us"].as_f64().unwrap() > 0.0));
    let bw = rows_bw();
    assert!(bw
        .iter()
        .any(|r| r["conduit"] == "gni" && r["mb_s"].as_f64().unwrap() > 0.0));
    let mut floors = vec!["raw-udp", "raw-tcp"];
    if softnic::transport::packet::permitted() {
        floors.push("raw-packet");
        assert!(
            rows.iter()
                .any(|r| r["conduit"] == "raw-packet" && r["op"] == "pingpong"),
            "no raw-packet ping-pong row"
        );
    } else {
        eprintln!("no raw-packet floor checked: packet sockets need CAP_NET_RAW (run as root)");
    }
    for floor in floors {
        assert!(
            bw.iter()
                .any(|r| r["conduit"] == floor && r["mb_s"].as_f64().unwrap() > 0.0),
            "no {floor} stream row"
        );
    }
}

fn rows_bw() -> Vec<serde_json::Value> {
    rows(&["bw", "--sizes", "65536", "--iters", "20"])
}

#[test]
fn compare_covers_every_api_and_conduit_and_draws_the_figures() {
    let dir = out_dir("compare");
    let rows = rows_in(
        &[
            "compare",
            "--iters",
            "5",
            "--sizes",
            "8,4k",
            "--table-log2",
            "10",
            "--ra-ranks",
            "2,4",
            "--rounds",
            "2",
        ],
        &dir,
    );
    assert!(
        rows.iter().all(|r| r["rounds"] == 2),
        "every row is the median of both rounds"
    );
    let each = std::fs::read_to_string(dir.join("compare-rounds.jsonl")).unwrap();
    assert_eq!(
        each.lines().count(),
        2 * rows.len(),
        "each round's rows are kept"
    );
    let has = |api: &str, conduit: &str, bench: &str| {
        rows.iter()
            .any(|r| r["api"] == api && r["conduit"] == conduit && r["bench"] == bench)
    };
    for (api, conduit) in [
        ("raw-udp", "raw-udp"),
        ("raw-tcp", "raw-tcp"),
        ("gni", "gni"),
        ("dmapp", "dmapp"),
        ("extoll", "extoll"),
        ("portals", "portals"),
        ("gasnet", "udp"),
        ("gasnet", "extoll"),
        ("gasnet", "portals"),
    ]
    .into_iter()
    .chain(softnic::transport::packet::permitted().then_some(("raw-packet", "raw-packet")))
    {
        assert!(
            has(api, conduit, "pingpong"),
            "no {api}/{conduit} latency row"
        );
        assert!(has(api, conduit, "bw"), "no {api}/{conduit} bandwidth row");
    }
    // The bulk rows again, each host's daemon a process of its own.
    for (api, conduit) in [
        ("gni", "gni"),
        ("portals", "portals"),
        ("gasnet", "portals"),
    ] {
        assert!(
            rows.iter().any(|r| r["api"] == api
                && r["conduit"] == conduit
                && r["bench"] == "bw"
                && r["daemons"] == "per-host"),
            "no {api}/{conduit} bandwidth row with a daemon per host"
        );
    }
    for conduit in ["udp", "portals", "extoll"] {
        assert!(has("gasnet", conduit, "am"), "no {conduit} AM row");
        for ranks in [2, 4] {
            assert!(
                rows.iter().any(|r| r["conduit"] == conduit
                    && r["bench"] == "randomaccess"
                    && r["ranks"] == ranks),
                "no {conduit} RandomAccess row at {ranks} ranks"
            );
        }
    }
    for bench in ["nbrate", "strided", "amo"] {
        assert!(has("dmapp", "dmapp", bench), "no DMAPP {bench} row");
    }
    for ranks in [2, 4, 8] {
        assert!(
            rows.iter()
                .any(|r| r["bench"] == "amo" && r["ranks"] == ranks),
            "no DMAPP AMO row at {ranks} ranks"
        );
    }
    let saved = std::fs::read_to_string(dir.join("compare.jsonl")).unwrap();
    assert_eq!(
        saved.lines().count(),
        rows.len(),
        "the JSON lines file holds every row"
    );
    for stem in [
        "latency_put",
        "latency_get",
        "bandwidth",
        "am_roundtrip",
        "gups",
        "dmapp_nbrate",
        "dmapp_strided",
        "dmapp_amo",
        "velo_rma",
        "extoll_overhead",
    ] {
        for ext in ["svg", "png"] {
            let p = dir.join(format!("{stem}.{ext}"));
            assert!(
                p.metadata().is_ok_and(|m| m.len() > 1000),
                "no figure {p:?}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
