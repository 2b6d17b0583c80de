//! The ssh spawner on three hosts that are network namespaces on a bridge, each running its
//! own sshd (host and user keys made here) and nothing of softnic: `softnic run --spawner ssh`
//! starts the daemons over ssh and the ranks; again with the kernel dropping 10% of incoming
//! UDP; a killed rank ends the job naming it and host, and nothing of the job is left in any
//! namespace; a killed launcher leaves no rank running either. Root only (CI is root), and
//! sshd must be installed (`.ci/run` installs openssh-server).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::drop_tenth_of_udp;
use common::ssh_hosts::{sh, Cluster, HOSTS};
use common::{example, output_text};

fn ready() -> bool {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: network namespaces need root (CI runs as root)");
        return false;
    }
    if !Path::new("/usr/sbin/sshd").exists() {
        eprintln!("skipped: sshd not installed (apt install openssh-server; CI installs it)");
        return false;
    }
    true
}

#[test]
fn ssh_spawner_on_three_namespace_hosts() {
    if !ready() {
        return;
    }
    let c = Cluster::new().unwrap();
    for i in 0..HOSTS {
        assert!(
            c.processes(i).is_empty(),
            "host {i} runs nothing of softnic yet"
        );
    }
    let t = Instant::now();
    let out = c.run(&["-n", "6"], &example("ring"), &[]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("ring ok 6 ranks"),
        "{}",
        output_text(&out)
    );
    eprintln!(
        "ring, 6 ranks over ssh, daemons started cold: {:?}",
        t.elapsed()
    );
    for i in 0..HOSTS {
        assert_eq!(
            c.processes(i),
            ["softnicd"],
            "host {i}: its daemon, started over ssh"
        );
    }
    // h0's and h1's own `nic_cpu` (0, 1): their daemons' NIC threads run on that CPU alone.
    let allowed = softnic::shm::cores::allowed().unwrap();
    if allowed.len() >= 2 {
        for (i, cpu) in allowed.iter().take(2).enumerate() {
            let pid = c.pids(i, "softnicd")[0];
            let want = cpu.to_string();
            let lists: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
                .unwrap()
                .filter_map(|t| {
                    let st = std::fs::read_to_string(t.ok()?.path().join("status")).ok()?;
                    st.lines()
                        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                        .map(|v| v.trim().to_string())
                })
                .collect();
            assert!(
                lists.contains(&want),
                "host {i}: a NIC thread on CPU {want} alone, threads on {lists:?}"
            );
        }
    } else {
        eprintln!("one CPU allowed: no NIC core to check");
    }
    let out = c.run(
        &["-n", "6", "--map", "block", "--conduit", "portals"],
        &example("am_hello"),
        &[],
    );
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(output_text(&out).contains("am_hello ok 6 nodes (conduit portals)"));
    // --label, --hosts names and --ppn.
    let out = c.run(
        &["-n", "4", "--hosts", "h1,h2", "--ppn", "2", "--label"],
        Path::new("/bin/sh"),
        &["-c", "echo rank $SOFTNIC_RANK on $SOFTNIC_HOST"],
    );
    assert!(out.status.success(), "{}", output_text(&out));
    for (r, h) in [(0, "h1"), (1, "h2"), (2, "h1"), (3, "h2")] {
        let line = format!("[{r}] rank {r} on {h}");
        assert!(
            output_text(&out).contains(&line),
            "{line}:\n{}",
            output_text(&out)
        );
    }

    // netbench's own launcher over ssh: the floor between the hosts' addresses and gni.
    let netbench = example("ring").with_file_name("../netbench");
    let nb_out = std::env::temp_dir().join(format!("softnic-ssh-nb-{}", std::process::id()));
    let out = Command::new(&netbench)
        .args(["pingpong", "--spawner", "ssh", "--config"])
        .arg(&c.config)
        .args([
            "--sizes", "8", "--iters", "200", "--json", "--api", "gni", "--out",
        ])
        .arg(&nb_out)
        .env("SOFTNIC_SSH_CMD", &c.ssh_cmd)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&nb_out);
    assert!(out.status.success(), "{}", output_text(&out));
    let rows = String::from_utf8_lossy(&out.stdout);
    assert!(
        rows.contains(r#""api":"gni","conduit":"gni","op":"put","size":8,"ranks":2,"hosts":2"#),
        "{}",
        output_text(&out)
    );

    // The same with the kernel dropping 10% of incoming UDP on every host.
    for ns in &c.ns {
        drop_tenth_of_udp(ns).unwrap();
    }
    let out = c.run(&["-n", "6"], &example("ring"), &["20"]);
    assert!(out.status.success(), "{}", output_text(&out));
    let out = c.run(
        &["-n", "6", "--conduit", "portals"],
        &example("am_hello"),
        &[],
    );
    assert!(out.status.success(), "{}", output_text(&out));

    // Kill one rank: the job ends naming it and its host; nothing of it is left anywhere.
    let job = c.launch(
        &["-n", "6", "--map", "block"],
        Path::new("/bin/sleep"),
        &["60"],
    );
    let t = Instant::now();
    let victim = loop {
        assert!(t.elapsed() < Duration::from_secs(20), "ranks did not start");
        let ranks = c.ranks(1, "sleep");
        if ranks.len() == 2 {
            break ranks[0];
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let killed = sh(&format!("kill -9 {victim}"));
    let out = job.wait_with_output().unwrap();
    assert!(
        killed.is_ok(),
        "{killed:?}; the job said:\n{}",
        output_text(&out)
    );
    assert!(!out.status.success());
    let msg = output_text(&out);
    assert!(
        msg.contains("on h1 was killed by signal 9; ending the job"),
        "the message names rank and host:\n{msg}"
    );
    c.job_gone(Duration::from_secs(5)).unwrap();

    // Kill the launcher itself: every rank on every host goes within the peer timeout.
    let mut job = c.launch(&["-n", "6"], Path::new("/bin/sleep"), &["60"]);
    let t = Instant::now();
    while (0..HOSTS).map(|i| c.ranks(i, "sleep").len()).sum::<usize>() < 6 {
        assert!(t.elapsed() < Duration::from_secs(20), "ranks did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    job.kill().unwrap();
    job.wait().unwrap();
    c.job_gone(Duration::from_secs(3)).unwrap();
}
