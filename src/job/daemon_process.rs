//! The local daemons in a process of their own, single-threaded: in a process with more than
//! one thread every socket call takes and drops a reference on the socket's file, measured
//! +0.23 µs a blocking round trip (see [`crate::daemon::signals`]); a launcher has several.
//!
//! The launcher starts its own binary again with `SOFTNIC_LOCAL_DAEMON` set to its pid and
//! `SOFTNIC_LOCAL_DAEMON_HOSTS` to the config indices of the hosts it serves (all of them, or
//! one each with `softnic run --daemon-per-host`). That process reads the effective
//! configuration (TOML) on stdin, starts the NICs of its hosts, answers one line on stdout
//! (`ready`, or `error: …`), and runs until SIGTERM or until the launcher dies. Only binaries
//! that call [`serve_if_asked`] first thing in `main` can be started so; any other launcher (a
//! test binary) runs its daemons in a thread instead.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use rustix::process::{getppid, set_parent_process_death_signal, Signal};

use crate::config::Config;
use crate::daemon::{signals, Daemon};

/// Set in the daemon process's environment: the launcher's pid.
pub const ENV: &str = "SOFTNIC_LOCAL_DAEMON";
/// Set beside [`ENV`]: the config indices of the hosts this process serves, comma separated.
pub const HOSTS_ENV: &str = "SOFTNIC_LOCAL_DAEMON_HOSTS";
/// How long a starting daemon may take to answer.
const START_WITHIN: Duration = Duration::from_secs(10);

static CAN_SERVE: AtomicBool = AtomicBool::new(false);

/// Call first in `main`. Started as a launcher's daemon process: serves, and returns the exit
/// code to exit with. Otherwise notes that this binary can be started so and returns `None`.
pub fn serve_if_asked() -> Option<i32> {
    let Ok(launcher) = std::env::var(ENV) else {
        CAN_SERVE.store(true, Ordering::Relaxed);
        return None;
    };
    crate::logging::init("warn");
    Some(match serve(&launcher) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!("local daemon: {e}");
            1
        }
    })
}

/// Whether this binary can start its daemons as a process (it called [`serve_if_asked`]).
pub(super) fn can_spawn() -> bool {
    CAN_SERVE.load(Ordering::Relaxed)
}

fn answer(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn serve(launcher: &str) -> Result<(), String> {
    // Dies with the launcher, even one killed by SIGKILL; and not started for a dead one.
    set_parent_process_death_signal(Some(Signal::Term)).map_err(|e| e.to_string())?;
    if getppid().map(|p| p.as_raw_nonzero().to_string()).as_deref() != Some(launcher) {
        return Err("the launcher is gone".into());
    }
    let stop = Arc::new(AtomicBool::new(false));
    signals::stop_on(&stop, &[libc::SIGTERM, libc::SIGHUP]).map_err(|e| e.to_string())?;
    // Ctrl-C is the launcher's: it stops its ranks, then this process.
    signals::ignore(libc::SIGINT).map_err(|e| e.to_string())?;
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .map_err(|e| format!("reading the configuration: {e}"))?;
    let started = Config::parse(&text)
        .map_err(|e| e.to_string())
        .and_then(|cfg| {
            let hosts = served_hosts(std::env::var(HOSTS_ENV).ok().as_deref(), cfg.hosts.len())?;
            Daemon::new(&cfg, &hosts, stop).map_err(|e| e.to_string())
        });
    let mut d = match started {
        Ok(d) => d,
        Err(e) => {
            // The launcher reports it (or tries another port): nothing more to say here.
            answer(&format!("error: {e}"));
            return Ok(());
        }
    };
    answer("ready");
    d.run().map_err(|e| e.to_string())
}

/// The hosts named by `list` (config indices, comma separated; unset: all `n`), each once and
/// each one of the config's.
fn served_hosts(list: Option<&str>, n: usize) -> Result<Vec<u16>, String> {
    let Some(list) = list else {
        return Ok((0..n as u16).collect());
    };
    let mut hosts = Vec::new();
    for part in list.split(',') {
        let i = part
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&i| (i as usize) < n)
            .ok_or_else(|| {
                format!("{HOSTS_ENV}={list}: {part:?} is not a host of the config ({n} hosts)")
            })?;
        if hosts.contains(&i) {
            return Err(format!("{HOSTS_ENV}={list}: host {i} named twice"));
        }
        hosts.push(i);
    }
    Ok(hosts)
}

/// A running daemon process; stopped (SIGTERM, then SIGKILL) when dropped.
pub(super) struct DaemonProcess {
    child: Option<Child>,
}

impl DaemonProcess {
    /// Starts this binary as the daemons of `cfg`'s `hosts`; returns once they serve, or why
    /// not.
    pub(super) fn start(cfg: &Config, hosts: &[u16]) -> Result<DaemonProcess, String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
        let list: Vec<String> = hosts.iter().map(u16::to_string).collect();
        let mut child = Command::new(exe)
            .env(ENV, std::process::id().to_string())
            .env(HOSTS_ENV, list.join(","))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the daemon process: {e}"))?;
        let (mut stdin, stdout) = (child.stdin.take().expect("piped"), child.stdout.take());
        let mut p = DaemonProcess { child: Some(child) };
        let wrote = stdin.write_all(cfg.to_toml().as_bytes());
        // Closing stdin ends the configuration.
        drop(stdin);
        let stdout = stdout.expect("piped");
        // Read in a thread so that a daemon that never answers cannot hang the launcher.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(START_WITHIN);
        match (wrote, line) {
            (Ok(()), Ok(l)) if l.trim() == "ready" => Ok(p),
            (_, Ok(l)) if l.starts_with("error: ") => {
                p.stop();
                Err(l["error: ".len()..].trim().to_string())
            }
            (_, Ok(_)) => {
                let how = p.stop();
                Err(format!("the daemon process {how} while starting"))
            }
            (_, Err(_)) => {
                p.stop();
                Err(format!(
                    "the daemon process did not start within {} s",
                    START_WITHIN.as_secs()
                ))
            }
        }
    }

    /// Stops the process (see [`super::supervise::terminate`]); says how it ended.
    pub(super) fn stop(&mut self) -> String {
        let Some(mut c) = self.child.take() else {
            return "was stopped".into();
        };
        super::supervise::terminate(&mut [&mut c]);
        // Reaped already: `wait` returns the status it got.
        c.wait()
            .map(|st| super::supervise::describe(st).0)
            .unwrap_or_else(|e| e.to_string())
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::served_hosts;

    #[test]
    fn the_hosts_a_daemon_process_serves_are_checked() {
        assert_eq!(served_hosts(None, 3), Ok(vec![0, 1, 2]), "unset: all");
        assert_eq!(served_hosts(Some("1"), 3), Ok(vec![1]));
        assert_eq!(served_hosts(Some("2, 0"), 3), Ok(vec![2, 0]));
        for bad in ["3", "", "x", "-1", "0,0", "1,,2"] {
            let e = served_hosts(Some(bad), 3).unwrap_err();
            assert!(e.contains("SOFTNIC_LOCAL_DAEMON_HOSTS"), "{bad:?}: {e}");
        }
    }
}
