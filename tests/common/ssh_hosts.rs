//! Hosts for the ssh spawner: three network namespaces on a bridge (10.80.0.1–3; the bridge
//! is .254 here), each running its own sshd with host and user keys made for the test and
//! nothing of softnic; a config for them (UDP, 1472-byte datagrams). Root only.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::netns::ip;

pub const HOSTS: usize = 3;

/// Three namespaces on a bridge (10.80.0.1–3; the bridge is .254 in this namespace), an sshd
/// in each; all torn down on drop, with whatever runs in the namespaces.
pub struct Cluster {
    dir: std::path::PathBuf,
    pub ns: Vec<String>,
    bridge: String,
    pub config: std::path::PathBuf,
    pub ssh_cmd: String,
}

pub fn sh(cmd: &str) -> Result<(), String> {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd}: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

impl Cluster {
    pub fn new() -> Result<Cluster, String> {
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
            // Hosts sharing this machine: the first two NICs on a core each (h2's unpinned:
            // two pinned NICs on one core would only take turns).
            let nic_cpu = if i < 2 {
                format!("nic_cpu = {i}\n")
            } else {
                String::new()
            };
            hosts.push_str(&format!(
                "\n[[host]]\nname = \"h{i}\"\naddr = \"{addr}:7720\"\n{nic_cpu}"
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

    /// `softnic run --spawner ssh --config C ARGS -- PROGRAM …`, stdin from /dev/null.
    fn command(&self, args: &[&str], program: &Path, prog_args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_softnic"));
        c.args(["run", "--spawner", "ssh", "--config"])
            .arg(&self.config)
            .args(args)
            .arg("--")
            .arg(program)
            .args(prog_args)
            .env("SOFTNIC_SSH_CMD", &self.ssh_cmd)
            .stdin(Stdio::null());
        c
    }

    /// The job as a child, its output piped.
    pub fn launch(&self, args: &[&str], program: &Path, prog_args: &[&str]) -> Child {
        self.command(args, program, prog_args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    pub fn run(&self, args: &[&str], program: &Path, prog_args: &[&str]) -> Output {
        self.run_env(args, program, prog_args, &[])
    }

    /// [`Cluster::run`] with launcher environment (`SOFTNIC_*` variables reach the ranks).
    pub fn run_env(
        &self,
        args: &[&str],
        program: &Path,
        prog_args: &[&str],
        env: &[(&str, &str)],
    ) -> Output {
        self.command(args, program, prog_args)
            .envs(env.iter().copied())
            .output()
            .unwrap()
    }

    /// The pids in namespace `i`.
    fn ns_pids(&self, i: usize) -> Vec<String> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.ns[i]])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    /// The pids of namespace `i`'s processes named `comm`.
    pub fn pids(&self, i: usize, comm: &str) -> Vec<u32> {
        self.ns_pids(i)
            .iter()
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == comm)
            })
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// The command names of the processes in namespace `i` (but its sshd).
    pub fn processes(&self, i: usize) -> Vec<String> {
        self.ns_pids(i)
            .iter()
            .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
            .map(|c| c.trim().to_string())
            .filter(|c| c != "sshd")
            .collect()
    }

    /// The pids of namespace `i`'s processes named `comm` whose parent is a `softnic` (the
    /// ssh spawner's agent): the ranks.
    pub fn ranks(&self, i: usize, comm: &str) -> Vec<u32> {
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
        self.ns_pids(i)
            .iter()
            .filter(|p| comm_of(p) == comm && comm_of(&parent_of(p)) == "softnic")
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Waits up to `within` until no namespace runs anything of a job (daemons may stay).
    pub fn job_gone(&self, within: Duration) -> Result<(), String> {
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
