//! netbench end to end on the local default: JSON lines carry the fields DESIGN §5 fixes, and
//! RandomAccess verifies with 0 errors on 2 ranks over 2 hosts.

use std::process::Command;

fn rows(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_netbench"))
        .args(args)
        .arg("--json")
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
    assert_eq!(rows.len(), 2, "one row per variant");
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
    assert!(bw.iter().any(|r| r["conduit"] == "raw-udp"));
}

fn rows_bw() -> Vec<serde_json::Value> {
    rows(&["bw", "--sizes", "65536", "--iters", "20"])
}
