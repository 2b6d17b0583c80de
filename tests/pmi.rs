//! PMI-1 bootstrap both ways: ranks started by MPICH's Hydra (`mpiexec.hydra`) find their
//! daemons from `SOFTNIC_CONFIG`/`SOFTNIC_HOST` and run the `ring` and `am_hello` examples;
//! `softnic run` serves PMI-1 to an unmodified C program speaking the wire protocol, and a
//! rank's PMI_Abort ends the job naming it. Hydra comes from Debian's `mpich` (CI installs
//! it); the C client needs `cc`. Without them these tests say so and skip.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::*;

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `mpiexec.hydra` with `SOFTNIC_CONFIG` for every rank and, per block of ranks, the host
/// they run on (an MPMD command line: `-n 2 -env SOFTNIC_HOST h0 P : -n 2 -env … P`).
fn hydra(d: &Daemons, blocks: &[(u32, &str)], program: &PathBuf, args: &[&str]) -> Output {
    let mut c = Command::new("mpiexec.hydra");
    c.args(["-genv", "SOFTNIC_CONFIG"]).arg(d.path());
    for (i, (n, host)) in blocks.iter().enumerate() {
        if i > 0 {
            c.arg(":");
        }
        c.args(["-n", &n.to_string(), "-env", "SOFTNIC_HOST", host])
            .arg(program)
            .args(args);
    }
    c.output().unwrap()
}

#[test]
fn hydra_ranks_bootstrap_through_pmi_and_find_their_daemons() {
    if !have("mpiexec.hydra") {
        eprintln!("skipped: mpiexec.hydra not installed (apt install mpich; CI installs it)");
        return;
    }
    let d = Daemons::start(2);
    let out = hydra(&d, &[(2, "h0"), (2, "h1")], &example("ring"), &["4"]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("ring ok 4 ranks"),
        "{}",
        output_text(&out)
    );

    let out = hydra(&d, &[(1, "h0"), (2, "h1")], &example("am_hello"), &[]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("am_hello ok 3 nodes"),
        "{}",
        output_text(&out)
    );

    // Both hosts are on this machine: without SOFTNIC_HOST a rank cannot tell which is its.
    let out = Command::new("mpiexec.hydra")
        .args(["-n", "1", "-genv", "SOFTNIC_CONFIG"])
        .arg(d.path())
        .arg(example("ring"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        output_text(&out).contains("several are on this machine (h0, h1); set SOFTNIC_HOST"),
        "{}",
        output_text(&out)
    );
    // Without a config it says which variable is missing, at once.
    let out = Command::new("mpiexec.hydra")
        .args(["-n", "1"])
        .arg(example("ring"))
        .env_remove("SOFTNIC_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        output_text(&out).contains("SOFTNIC_CONFIG is not set"),
        "{}",
        output_text(&out)
    );
}

/// What a program using two layers does (netbench, then GASNet or a NIC API): ask for its job
/// twice. Both see one job, and every rank ends cleanly — a second PMI bootstrap used to close
/// the first connection, the rank's PMI_Finalize then failed, and Hydra killed the other ranks
/// as it left (exit code 9).
#[test]
fn a_rank_that_asks_for_its_job_twice_leaves_cleanly_under_hydra() {
    const NAME: &str = "a_rank_that_asks_for_its_job_twice_leaves_cleanly_under_hydra";
    if in_job() {
        let a = softnic::job::JobInfo::from_env().unwrap();
        let mut nic = init();
        let b = softnic::job::JobInfo::from_env().unwrap();
        assert_eq!((a.rank, a.job_id, a.job_key), (b.rank, b.job_id, b.job_key));
        assert_eq!((nic.rank(), nic.size()), (a.rank, a.size));
        nic.barrier().unwrap();
        // The last rank leaves later than the others: Hydra must not kill it meanwhile.
        if a.rank + 1 == a.size {
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        return;
    }
    if !have("mpiexec.hydra") {
        eprintln!("skipped: mpiexec.hydra not installed (apt install mpich; CI installs it)");
        return;
    }
    let d = Daemons::start(2);
    let exe = std::env::current_exe().unwrap();
    let args = ["--exact", NAME, "--nocapture", "--test-threads=1"];
    let out = hydra(&d, &[(1, "h0"), (1, "h1")], &exe, &args);
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(
        output_text(&out)
            .matches("test result: ok. 1 passed")
            .count(),
        2,
        "both ranks ran the test to its end:\n{}",
        output_text(&out)
    );
}

#[test]
fn softnic_run_starts_the_examples() {
    let run = |args: &[&str], prog: &str| {
        Command::new(env!("CARGO_BIN_EXE_softnic"))
            .arg("run")
            .args(args)
            .arg("--")
            .arg(example(prog))
            .output()
            .unwrap()
    };
    let out = run(&["-n", "4"], "ring");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(output_text(&out).contains("ring ok 4 ranks"));
    for conduit in ["udp", "portals"] {
        let out = run(&["-n", "3", "--conduit", conduit], "am_hello");
        assert!(out.status.success(), "{}", output_text(&out));
        let want = format!("am_hello ok 3 nodes (conduit {conduit})");
        assert!(output_text(&out).contains(&want), "{}", output_text(&out));
    }
}

/// A PMI-1 client in C, as an MPI library's simple PMI speaks it: init, kvsname, put, barrier,
/// get of the next rank's key, finalize; with argument `abort`, rank 1 calls PMI_Abort(3) and
/// then waits to be killed.
const C_CLIENT: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fd;
static void say(const char *s) { if (write(fd, s, strlen(s)) < 0) exit(10); }
static void hear(char *buf, int n) {
    int i = 0;
    while (i < n - 1 && read(fd, buf + i, 1) == 1 && buf[i] != '\n') i++;
    buf[i] = 0;
}
int main(int argc, char **argv) {
    char line[1024], kvs[256], msg[1024];
    fd = atoi(getenv("PMI_FD"));
    int rank = atoi(getenv("PMI_RANK")), size = atoi(getenv("PMI_SIZE"));
    say("cmd=init pmi_version=1 pmi_subversion=1\n"); hear(line, sizeof line);
    if (!strstr(line, "cmd=response_to_init") || !strstr(line, "rc=0")) return 2;
    say("cmd=get_maxes\n"); hear(line, sizeof line);
    if (!strstr(line, "cmd=maxes")) return 3;
    say("cmd=get_my_kvsname\n"); hear(line, sizeof line);
    char *k = strstr(line, "kvsname=");
    if (!k) return 4;
    snprintf(kvs, sizeof kvs, "%s", k + 8);
    if (argc > 1 && !strcmp(argv[1], "abort") && rank == 1) {
        say("cmd=abort exitcode=3 error_msg=rank_one_gives_up\n");
        sleep(60);
        return 0;
    }
    snprintf(msg, sizeof msg, "cmd=put kvsname=%s key=card-%d value=%d\n", kvs, rank, rank * 7);
    say(msg); hear(line, sizeof line);
    if (!strstr(line, "rc=0")) return 5;
    say("cmd=barrier_in\n"); hear(line, sizeof line);
    if (strcmp(line, "cmd=barrier_out")) return 6;
    int next = (rank + 1) % size;
    snprintf(msg, sizeof msg, "cmd=get kvsname=%s key=card-%d\n", kvs, next);
    say(msg); hear(line, sizeof line);
    char *v = strstr(line, "value=");
    if (!strstr(line, "rc=0") || !v || atoi(v + 6) != next * 7) return 7;
    say("cmd=finalize\n"); hear(line, sizeof line);
    if (strcmp(line, "cmd=finalize_ack")) return 8;
    printf("pmi ok rank %d of %d\n", rank, size);
    return 0;
}
"#;

#[test]
fn softnic_run_serves_pmi1_to_an_unmodified_c_program() {
    if !have("cc") {
        eprintln!("skipped: no C compiler (cc) to build the PMI-1 client");
        return;
    }
    let dir = std::env::temp_dir().join(format!("softnic-pmi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("pmi_client.c");
    let bin = dir.join("pmi_client");
    std::fs::write(&src, C_CLIENT).unwrap();
    let cc = Command::new("cc")
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .unwrap();
    assert!(cc.status.success(), "{}", output_text(&cc));
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_softnic"))
            .args(["run", "-n", "3", "--"])
            .arg(&bin)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&[]);
    assert!(out.status.success(), "{}", output_text(&out));
    for r in 0..3 {
        assert!(
            output_text(&out).contains(&format!("pmi ok rank {r} of 3")),
            "{}",
            output_text(&out)
        );
    }
    let t = std::time::Instant::now();
    let out = run(&["abort"]);
    assert_eq!(out.status.code(), Some(3), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("rank 1 called PMI_Abort(3): rank one gives up"),
        "{}",
        output_text(&out)
    );
    assert!(t.elapsed().as_secs() < 30, "the abort ended the job");
    let _ = std::fs::remove_dir_all(&dir);
}
