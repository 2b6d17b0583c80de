//! The ssh spawner: `softnic run --spawner ssh --config FILE -n N -- PROGRAM ARGS` starts, on
//! every host that gets ranks, `softnic host-spawn` over one non-interactive ssh session each,
//! all at once (64 hosts start in about the time of one). Each agent makes sure its host's
//! daemon runs and starts its ranks (see [`super::host_spawn`]). The program, the config and
//! `softnic` itself must be at the same paths on every host (a shared file system, or the same
//! install), as for GASNet's ssh spawner.
//!
//! ssh runs with `BatchMode=yes` (never a password prompt) and the user's own ssh config and
//! agent; `SOFTNIC_SSH_CMD` replaces the command (`ssh -i key -p 2222`, as `GASNET_SSH_CMD`).
//! `SOFTNIC_*` variables and those named by `--env` travel to the ranks. The launcher's stdin
//! goes to rank 0. A failure anywhere ends every host's ranks; so does Ctrl-C; and if the
//! launcher is killed, its ssh clients die with it (parent-death signal), their sessions close
//! and the agents stop their ranks.

use std::ffi::OsStr;
use std::process::{Child, Command, Stdio};

use super::local::{Launch, LaunchError};
use super::placement::place;
use super::supervise::{die_with_parent, install_signal_handler, kill_all, supervise};
use crate::config::Config;

/// A word for a POSIX shell: single-quoted, with `'` written as `'\''`.
pub fn sh_quote(s: &OsStr) -> String {
    format!("'{}'", s.to_string_lossy().replace('\'', r"'\''"))
}

/// The ssh command and its options: `SOFTNIC_SSH_CMD` split at whitespace, or `ssh`.
fn ssh_command() -> Vec<String> {
    match std::env::var("SOFTNIC_SSH_CMD") {
        Ok(v) if !v.trim().is_empty() => v.split_whitespace().map(str::to_string).collect(),
        _ => vec!["ssh".into()],
    }
}

/// What the ranks' environment gets from the launcher's: every `SOFTNIC_*` variable but the
/// job's own, the variables `--env` names, and the launch's explicit pairs.
fn forwarded_env(l: &Launch) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            (k.starts_with("SOFTNIC_") && !super::JOB_VARS.contains(&k.as_str()))
                || l.forward.iter().any(|f| f == k)
        })
        .collect();
    env.extend(l.env.iter().cloned());
    env
}

/// Runs the job over ssh; returns the exit code for the launcher.
pub fn run(l: &Launch) -> Result<i32, LaunchError> {
    let config = l.config.clone().ok_or(LaunchError::NeedConfig("ssh"))?;
    let config = std::fs::canonicalize(&config).unwrap_or(config);
    let cfg = Config::load(&config)?;
    let hosts = l.host_indices(&cfg)?;
    let rank_hosts = place(l.ranks, &hosts, l.ppn, l.map)?;
    install_signal_handler();
    let job_id: u32 = rand::random::<u32>() >> 1;
    let job_key: u64 = rand::random();
    let softnic = match std::env::var_os("SOFTNIC_REMOTE_SOFTNIC") {
        Some(p) => p,
        None => super::softnic_binary()?.into_os_string(),
    };
    let ssh = ssh_command();
    let env = forwarded_env(l);
    let map = rank_hosts
        .iter()
        .map(|h| h.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut used: Vec<u16> = rank_hosts.clone();
    used.sort_unstable();
    used.dedup();

    let mut children: Vec<(u32, Child)> = Vec::new();
    for &h in &used {
        let host = &cfg.hosts[h as usize];
        let mut words: Vec<String> = vec!["exec".into(), sh_quote(&softnic)];
        words.push("host-spawn".into());
        let mut arg = |k: &str, v: &OsStr| {
            words.push(k.into());
            words.push(sh_quote(v));
        };
        arg("--config", config.as_os_str());
        arg("--host", OsStr::new(&host.name));
        arg("--job-id", OsStr::new(&job_id.to_string()));
        arg("--job-key", OsStr::new(&job_key.to_string()));
        arg("--rank-hosts", OsStr::new(&map));
        if let Some(c) = &l.conduit {
            arg("--conduit", OsStr::new(c));
        }
        for (k, v) in &env {
            arg("--setenv", OsStr::new(&format!("{k}={v}")));
        }
        if l.label {
            words.push("--label".into());
        }
        words.push("--".into());
        words.push(sh_quote(&l.program));
        words.extend(l.args.iter().map(|a| sh_quote(a)));

        let mut cmd = Command::new(&ssh[0]);
        cmd.args(&ssh[1..]).args(["-o", "BatchMode=yes", "-T"]);
        // Rank 0's host reads the launcher's stdin; the others read nothing.
        if rank_hosts.first() != Some(&h) {
            cmd.arg("-n").stdin(Stdio::null());
        }
        cmd.arg("--").arg(host.ssh_target()).arg(words.join(" "));
        // ssh dies with the launcher, and its session with it.
        die_with_parent(&mut cmd, rustix::process::Signal::Term);
        match cmd.spawn() {
            Ok(c) => children.push((h as u32, c)),
            Err(source) => {
                kill_all(&mut children);
                return Err(LaunchError::Ssh {
                    command: ssh[0].clone(),
                    source,
                });
            }
        }
    }
    let names: Vec<(String, String)> = cfg
        .hosts
        .iter()
        .map(|h| (h.name.clone(), h.ssh_target()))
        .collect();
    let mut timed_out = super::supervise::deadline_news(l.timeout, || {});
    Ok(supervise(
        &mut children,
        |h, code, what| {
            if let Some(m) = super::supervise::timeout_report(h, what) {
                return Some(m);
            }
            let (name, target) = &names[h as usize];
            // 255 is ssh's own failure; any other code the host's agent has told already.
            (code == 255).then(|| {
                format!(
                    "ssh to host {name} ({target}) {what}: check that \
                     `{} -o BatchMode=yes {target} true` works",
                    ssh.join(" ")
                )
            })
        },
        &mut timed_out,
    ))
}

/// `--hosts` as host names, `--hostfile`, or `SOFTNIC_SSH_SERVERS` (names separated by
/// spaces or commas, as `GASNET_SSH_SERVERS`).
pub fn host_names(
    hosts: Option<&str>,
    hostfile: Option<&std::path::Path>,
) -> std::io::Result<Vec<String>> {
    let text = match (hosts, hostfile) {
        (Some(h), _) => h.to_string(),
        (None, Some(f)) => std::fs::read_to_string(f)?
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim().to_string())
            .collect::<Vec<_>>()
            .join(" "),
        (None, None) => std::env::var("SOFTNIC_SSH_SERVERS").unwrap_or_default(),
    };
    Ok(text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    /// Words as one shell command line.
    fn quoted(words: &[OsString]) -> String {
        words
            .iter()
            .map(|w| sh_quote(w))
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn quoting_survives_a_shell() {
        let words: Vec<OsString> = ["a b", "it's", "$HOME", "`x`", "", "\\n"]
            .iter()
            .map(OsString::from)
            .collect();
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("printf '%s|' {}", quoted(&words)))
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "a b|it's|$HOME|`x`||\\n|"
        );
    }

    #[test]
    fn host_lists() {
        assert_eq!(host_names(Some("a, b c"), None).unwrap(), ["a", "b", "c"]);
        let f = std::env::temp_dir().join(format!("softnic-hostfile-{}", std::process::id()));
        std::fs::write(&f, "n1\n# comment\nn2  # two\n\n").unwrap();
        assert_eq!(host_names(None, Some(&f)).unwrap(), ["n1", "n2"]);
        let _ = std::fs::remove_file(&f);
    }
}
