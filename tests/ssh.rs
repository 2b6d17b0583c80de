//! The ssh spawner on three hosts that are network namespaces on a bridge, each running its
//! own sshd (host and user keys made here) and nothing of softnic: `softnic run --spawner ssh`
//! starts the daemons over ssh and the ranks; again with the kernel dropping 10% of incoming
//! UDP; a killed rank ends the job naming it and host, and nothing of the job is left in any
//! namespace; a killed launcher leaves no rank running either. Root only (CI is root), and
//! sshd must be installed (`.ci/run` installs openssh-server).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::netns::{drop_tenth_of_udp, ip};

const HOSTS: usize = 3;

/// Three namespaces on a bridge (10.80.0.1–3; the bridge is .254 in this namespace), an sshd
/// in each; all torn down on drop, with whatever runs in the namespaces.
struct Cluster {
    dir: PathBuf,
    ns: Vec<String>,
    bridge: String,
    config: PathBuf,
    ssh_cmd: String,
}

fn sh(cmd: &str) -> Result<(), String> {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd}: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

impl Cluster {
    fn new() -> Result<Cluster, String> {
        let id = std::process::id() % 100_000;
        let dir = std::env::temp_dir().join(format!("softnic-ssh-{id}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("run")).map_err(|e| e.to_string())?;
        let mut c = Cluster {
            ns: Vec::new(),
            bridge: format!("sb{id}"),
            config: dir.join("cluster.toml"),
            ssh_cmd: String::new(),
            dir,
        };
        let d = c.dir.display().to_string();
        sh(&format!(
            "ssh-keygen -q -t ed25519 -N '' -f {d}/hostkey && ssh-keygen -q -t ed25519 -N '' -f {d}/userkey && cp {d}/userkey.pub {d}/authorized_keys"
        ))?;
        ip(&["link", "add", &c.bridge, "type", "bridge"])?;
        ip(&["addr", "add", "10.80.0.254/24", "dev", &c.bridge])?;
        ip(&["link", "set", &c.bridge, "up"])?;
        std::fs::create_dir_all("/run/sshd").map_err(|e| e.to_string())?;
        let mut hosts = String::new();
        for i in 0..HOSTS {
            let ns = format!("ss{id}h{i}");
            ip(&["netns", "add", &ns])?;
            c.ns.push(ns.clone());
            let (outer, inner) = (format!("ss{id}v{i}"), format!("ss{id}p{i}"));
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner, "netns", &ns,
            ])?;
            ip(&["link", "set", &outer, "master", &c.bridge, "up"])?;
            let addr = format!("10.80.0.{}", i + 1);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                &inner,
            ])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let conf = format!(
                "ListenAddress {addr}:22\nHostKey {d}/hostkey\nAuthorizedKeysFile {d}/authorized_keys\n\
                 PermitRootLogin yes\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n\
                 PidFile {d}/sshd{i}.pid\n"
            );
            std::fs::write(c.dir.join(format!("sshd{i}.conf")), conf).map_err(|e| e.to_string())?;
            sh(&format!(
                "ip netns exec {ns} /usr/sbin/sshd -f {d}/sshd{i}.conf -E {d}/sshd{i}.log"
            ))?;
            hosts.push_str(&format!(
                "\n[[host]]\nname = \"h{i}\"\naddr = \"{addr}:7720\"\n"
            ));
        }
        let secret: String = (0..32)
            .map(|_| format!("{:02x}", rand::random::<u8>()))
            .collect();
        std::fs::write(
            &c.config,
            format!(
                "[cluster]\nsecret = \"{secret}\"\ntransport = \"udp\"\nmtu = 1472\n\
                 peer_timeout_ms = 3000\nruntime_dir = \"{d}/run\"\n{hosts}"
            ),
        )
        .map_err(|e| e.to_string())?;
        c.ssh_cmd = format!(
            "ssh -i {d}/userkey -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=5"
        );
        Ok(c)
    }

    /// `softnic run --spawner ssh --config C ARGS -- PROGRAM …` as a child.
    fn launch(&self, args: &[&str], program: &Path, prog_args: &[&str]) -> Child {
        Command::new(env!("CARGO_BIN_EXE_softnic"))
            .args(["run", "--spawner", "ssh", "--config"])
            .arg(&self.config)
            .args(args)
            .arg("--")
            .arg(program)
            .args(prog_args)
            .env("SOFTNIC_SSH_CMD", &self.ssh_cmd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    fn run(&self, args: &[&str], program: &Path, prog_args: &[&str]) -> Output {
        self.launch(args, program, prog_args)
            .wait_with_output()
            .unwrap()
    }

    /// The command names of the processes in namespace `i` (but its sshd).
    fn processes(&self, i: usize) -> Vec<String> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.ns[i]])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
            .map(|c| c.trim().to_string())
            .filter(|c| c != "sshd")
            .collect()
    }

    /// The pids of namespace `i`'s processes named `comm` whose parent is a `softnic` (the
    /// ssh spawner's agent): the ranks.
    fn ranks(&self, i: usize, comm: &str) -> Vec<u32> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.ns[i]])
            .output()
            .unwrap();
        let comm_of = |p: &str| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_default()
        };
        let parent_of = |p: &str| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // pid (comm) state ppid …: the comm may hold spaces, so split after ')'.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1).map(str::to_string))
                .unwrap_or_default()
        };
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter(|p| comm_of(p) == comm && comm_of(&parent_of(p)) == "softnic")
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Waits up to `within` until no namespace runs anything of a job (daemons may stay).
    fn job_gone(&self, within: Duration) -> Result<(), String> {
        let t = Instant::now();
        loop {
            let left: Vec<String> = (0..HOSTS)
                .flat_map(|i| self.processes(i))
                .filter(|c| c != "softnicd")
                .collect();
            if left.is_empty() {
                return Ok(());
            }
            if t.elapsed() > within {
                let ps = Command::new("sh")
                    .arg("-c")
                    .arg("ps -eo pid,ppid,stat,comm,args --forest | grep -E 'sshd|softnic|sleep|ssh ' | grep -v grep")
                    .output()
                    .unwrap();
                return Err(format!(
                    "still running: {left:?}\n{}",
                    String::from_utf8_lossy(&ps.stdout)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = sh(&format!(
                "for p in $(ip netns pids {ns}); do kill -9 $p; done; ip netns del {ns}"
            ));
        }
        let _ = ip(&["link", "del", &self.bridge]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

fn text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

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
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("ring ok 6 ranks"), "{}", text(&out));
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
    let out = c.run(
        &["-n", "6", "--map", "block", "--conduit", "portals"],
        &example("am_hello"),
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("am_hello ok 6 nodes (conduit portals)"));
    // --label, --hosts names and --ppn.
    let out = c.run(
        &["-n", "4", "--hosts", "h1,h2", "--ppn", "2", "--label"],
        Path::new("/bin/sh"),
        &["-c", "echo rank $SOFTNIC_RANK on $SOFTNIC_HOST"],
    );
    assert!(out.status.success(), "{}", text(&out));
    for (r, h) in [(0, "h1"), (1, "h2"), (2, "h1"), (3, "h2")] {
        let line = format!("[{r}] rank {r} on {h}");
        assert!(text(&out).contains(&line), "{line}:\n{}", text(&out));
    }

    // The same with the kernel dropping 10% of incoming UDP on every host.
    for ns in &c.ns {
        drop_tenth_of_udp(ns).unwrap();
    }
    let out = c.run(&["-n", "6"], &example("ring"), &["20"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = c.run(
        &["-n", "6", "--conduit", "portals"],
        &example("am_hello"),
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));

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
    assert!(killed.is_ok(), "{killed:?}; the job said:\n{}", text(&out));
    assert!(!out.status.success());
    let msg = text(&out);
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
