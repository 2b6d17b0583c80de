//! Watching a launcher's children (ranks, or the ssh sessions of remote hosts): the first one
//! that fails, a failure reported from elsewhere (a PMI abort), or Ctrl-C ends them all, with
//! one message naming who and why.

use std::os::fd::OwnedFd;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Ctrl-C, SIGTERM and SIGHUP set a flag the supervision loop reads.
pub fn install_signal_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
    });
}

/// Whether a signal asked this process to stop.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// The exit code of a job that ran past its `--timeout` (as coreutils' `timeout`).
pub const TIMED_OUT: i32 = 124;
/// The id `supervise` hears a timeout under (no rank or host has it).
const TIMEOUT_ID: u32 = u32::MAX;

/// A deadline for `supervise`'s news: past it, once, `on_timeout` runs and the job ends.
pub fn deadline_news(
    timeout: Option<Duration>,
    on_timeout: impl Fn(),
) -> impl FnMut() -> Option<(u32, i32, String)> {
    let deadline = timeout.map(|t| (Instant::now() + t, t));
    move || {
        let (at, t) = deadline?;
        (Instant::now() >= at).then(|| {
            on_timeout();
            let what = format!(
                "ran past its time limit of {} s (--timeout)",
                t.as_secs_f64()
            );
            (TIMEOUT_ID, TIMED_OUT, what)
        })
    }
}

/// How `supervise` tells a timeout (`None` for anything else).
pub fn timeout_report(id: u32, what: &str) -> Option<String> {
    (id == TIMEOUT_ID).then(|| format!("the job {what}"))
}

/// Waits for `children` (each with its id: a rank, or a host index) until all have ended; the
/// first failure, a failure `news` reports `(id, code, what)`, or an interruption stops the
/// others. A failure is told as `report(id, code, what)` says (nothing when it returns `None`:
/// someone told it already). Returns the exit code for the launcher: 0, the failure's, or 130.
pub fn supervise(
    children: &mut [(u32, Child)],
    report: impl Fn(u32, i32, &str) -> Option<String>,
    mut news: impl FnMut() -> Option<(u32, i32, String)>,
) -> i32 {
    // A child's end wakes the loop through its pidfd (none: the loop polls).
    let pidfds: Vec<Option<OwnedFd>> = children
        .iter()
        .map(|(_, c)| crate::shm::process_memory::pidfd(c.id() as libc::pid_t).ok())
        .collect();
    // The running children's pidfds; `None` for one without a pidfd or whose state could
    // not be read (looked at again soon instead of waited on).
    let mut still: Vec<Option<&OwnedFd>> = Vec::with_capacity(children.len());
    loop {
        if INTERRUPTED.swap(false, Ordering::SeqCst) {
            let running = children
                .iter_mut()
                .filter_map(|(_, c)| c.try_wait().ok())
                .filter(Option::is_none)
                .count();
            eprintln!("softnic: interrupted; stopping {running} rank(s)");
            kill_all(children);
            return 130;
        }
        let mut failed = news();
        still.clear();
        for (i, (r, c)) in children.iter_mut().enumerate() {
            if failed.is_some() {
                break;
            }
            match c.try_wait() {
                Ok(Some(st)) if !st.success() => {
                    let (what, code) = describe(st);
                    failed = Some((*r, code.max(1), what));
                }
                Ok(Some(_)) => {}
                Ok(None) => still.push(pidfds[i].as_ref()),
                Err(_) => still.push(None),
            }
        }
        if let Some((r, code, what)) = failed {
            if let Some(m) = report(r, code, &what) {
                eprintln!("softnic: {m}; ending the job");
            }
            kill_all(children);
            return code;
        }
        if still.is_empty() {
            return 0;
        }
        wait_for_an_end(&still);
    }
}

/// Without pidfds, how often the supervision loop looks at its children.
const POLL_EVERY: Duration = Duration::from_millis(5);
/// With them, how long it waits for one to end before it looks at the news and for signals:
/// a launcher that woke every few milliseconds took the ranks' cores from them as often
/// (~390 `wait4` a second in a two-rank job).
const LOOK_EVERY: Duration = Duration::from_millis(50);

/// Waits until one of the running children (their pidfds, `still`) ends or [`LOOK_EVERY`]
/// passes; [`POLL_EVERY`] when one of them has none.
fn wait_for_an_end(still: &[Option<&OwnedFd>]) {
    use rustix::event::{poll, PollFd, PollFlags};
    let fds: Option<Vec<PollFd<'_>>> = still
        .iter()
        .map(|f| f.map(|f| PollFd::new(f, PollFlags::IN)))
        .collect();
    match fds {
        Some(mut fds) => {
            // A signal (EINTR) only ends this wait early; any other refusal must not turn the
            // loop into a spin.
            if let Err(e) = poll(&mut fds, LOOK_EVERY.as_millis() as i32) {
                if e != rustix::io::Errno::INTR {
                    std::thread::sleep(POLL_EVERY);
                }
            }
        }
        None => std::thread::sleep(POLL_EVERY),
    }
}

pub fn describe(status: std::process::ExitStatus) -> (String, i32) {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => (format!("exited with status {c}"), c),
        (None, Some(s)) => (format!("was killed by signal {s}"), 128 + s),
        _ => ("ended".into(), 1),
    }
}

pub fn kill_all(children: &mut [(u32, Child)]) {
    terminate(&mut children.iter_mut().map(|(_, c)| c).collect::<Vec<_>>());
}

/// Asks every child to stop (SIGTERM), kills those still running after 2 s, and reaps all.
pub fn terminate(children: &mut [&mut Child]) {
    for c in children.iter_mut() {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(c),
            rustix::process::Signal::Term,
        );
    }
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        if children
            .iter_mut()
            .all(|c| matches!(c.try_wait(), Ok(Some(_))))
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Makes `cmd`'s process die with this one: the kernel sends it `signal` when the thread that
/// started it ends; and if this process is already gone when the child gets to ask (between
/// fork and the prctl), the child gives up instead of running orphaned.
pub fn die_with_parent(cmd: &mut std::process::Command, signal: rustix::process::Signal) {
    use std::os::unix::process::CommandExt;
    let parent = rustix::process::getpid();
    // SAFETY: between fork and exec only the async-signal-safe prctl and getppid run.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(signal))?;
            match rustix::process::getppid() == Some(parent) {
                true => Ok(()),
                false => Err(std::io::Error::other("the parent is gone")),
            }
        });
    }
}
