//! The in-process handle to the local daemon: attach, registration, command submission and
//! completion polling over shared memory. No syscall on the hot path while the daemon is busy.

pub(crate) mod bounce;
mod endpoint;
mod region;

pub(crate) use endpoint::SPIN_BEFORE_YIELD;
pub use endpoint::{wait_until, Endpoint, NicError, BOUNCE_LEN, NOTE_DISCARD};
pub use region::{MemHandle, MemRegion};

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};

use crate::nic::memory::Perms;
use crate::shm::attach::{self, Request, Response};
use crate::shm::control::Waiter;
use crate::shm::{Command, Control, CqEntry, Mapping};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the softnic daemon at {path}: {source} (is softnicd running, or are you inside `softnic run`?)")]
    Connect { path: String, source: io::Error },
    #[error("the daemon refused: {0}")]
    Refused(String),
    #[error("attach protocol error: {0}")]
    Protocol(String),
    #[error(
        "the daemon of host {host} went away (crashed or stopped): start softnicd there again"
    )]
    DaemonGone { host: u16 },
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Polls spent spinning on a full command ring before yielding.
const SPIN_POLLS: u32 = 64;
/// A completion wait spins this long (a round trip through the NIC takes ~10 µs here), then
/// yields for `YIELD_FOR`, then sleeps on the doorbell: a blocking wake-up costs ~30 µs on
/// these machines, and a yield is a context switch when the cores are busy.
const SPIN_FOR: Duration = Duration::from_micros(20);
/// A wait for one operation moving this many bytes or more does not spin, here or in
/// GASNet's backoff: the NIC lends a host of a bulk transfer to its helper thread (see
/// `daemon::helper`), which runs beside the ranks, not on the NIC's core, and would wait the
/// spin out (measured: gni blocking get 256 KiB 65–77 → 41–45 µs; portals conduit blocking
/// put 1 MiB 188 → 158–161, get 1 MiB 186–197 → 141–151; 64 KiB and smaller unchanged).
pub const SPIN_BELOW_BYTES: u64 = 64 << 10;
const YIELD_FOR: Duration = Duration::from_micros(500);
/// The largest datagram body a daemon may name at attach (a loopback frame's).
const DATAGRAM_BODY_MAX: usize = 65_536;
/// How long a full command ring is yielded on before the client sleeps until it half empties.
const FULL_YIELD_FOR: Duration = Duration::from_micros(50);
/// How long a leaving client waits for its daemon to take the commands still in its ring.
const LEAVE_WAIT: Duration = Duration::from_secs(2);

pub struct Client {
    sock: OwnedFd,
    control: Control,
    daemon_bell: OwnedFd,
    client_bell: OwnedFd,
    pub host: u16,
    pub nhosts: u16,
    /// See [`Client::datagram_body`].
    datagram_body: usize,
    waiter: Waiter,
    /// The last command found the ring full past the yielding phase: the NIC pushes back.
    ring_full_streak: std::cell::Cell<bool>,
}

impl Client {
    pub fn attach(
        path: &Path,
        job: u32,
        job_key: u64,
        rank: u32,
        size: u32,
    ) -> Result<Client, ClientError> {
        let sock = attach::connect(path).map_err(|source| ClientError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        let (resp, mut fds) = attach::call(
            &sock,
            &Request::Hello {
                job,
                job_key,
                rank,
                size,
            },
            &[],
        )?;
        let (host, nhosts, body) = match resp {
            Response::HelloOk { host, nhosts, body } => (host, nhosts, body as usize),
            Response::Error(e) => return Err(ClientError::Refused(e)),
            other => {
                return Err(ClientError::Protocol(format!(
                    "unexpected answer to hello: {other:?}"
                )))
            }
        };
        if !(1..=DATAGRAM_BODY_MAX).contains(&body) {
            return Err(ClientError::Protocol(format!(
                "hello named a datagram body of {body} bytes"
            )));
        }
        if fds.len() != 3 {
            return Err(ClientError::Protocol(format!(
                "hello carried {} descriptors, expected 3",
                fds.len()
            )));
        }
        let client_bell = fds.pop().expect("3 fds");
        let daemon_bell = fds.pop().expect("3 fds");
        let map = Mapping::from_fd(fds.pop().expect("3 fds"), 4096, 1 << 30)?;
        // The daemon reaches process regions (register_process) by process_vm_readv/writev:
        // name it our ptrace tracer, as Linux's Yama module asks where it is enabled.
        if let Ok(c) = rustix::net::sockopt::get_socket_peercred(&sock) {
            // SAFETY: PR_SET_PTRACER takes a pid; it fails harmlessly (EINVAL) without Yama.
            unsafe {
                libc::prctl(
                    libc::PR_SET_PTRACER,
                    c.pid.as_raw_nonzero().get() as libc::c_ulong,
                    0,
                    0,
                    0,
                );
            }
        }
        let control = Control::open(map).map_err(|e| ClientError::Protocol(e.to_string()))?;
        Ok(Client {
            sock,
            waiter: control.waiter(),
            control,
            daemon_bell,
            client_bell,
            host,
            nhosts,
            datagram_body: body,
            ring_full_streak: std::cell::Cell::new(false),
        })
    }

    /// The bytes one datagram of this host's NIC carries behind its header: its ops, each an
    /// op header, the op's fields and data (`OpRef::max_data` says how much data fits). A
    /// transfer staged in pieces that are whole numbers of fragments leaves no partly filled
    /// datagram between them, which would cost a send of its own.
    pub fn datagram_body(&self) -> usize {
        self.datagram_body
    }

    /// Registers `map` with remote permissions; returns its handle (handles count up from 0 in
    /// registration order, so processes that register alike get the same handles).
    pub fn register(&self, map: &Mapping, perms: Perms) -> Result<u32, ClientError> {
        match attach::call(
            &self.sock,
            &Request::Register { perms: perms.0 },
            &[map.fd()],
        )?
        .0
        {
            Response::Registered { region } => Ok(region),
            Response::Error(e) => Err(ClientError::Refused(e)),
            other => Err(ClientError::Protocol(format!(
                "unexpected answer to register: {other:?}"
            ))),
        }
    }

    /// Registers `[addr, addr+len)` of this process's own memory, which the daemon reaches by
    /// copy (it was named this process's ptrace tracer at attach): the local side of
    /// operations (a put's source, a get's destination), and with `perms` the target of remote
    /// puts, gets and AMOs too (AMOs there are atomic among NIC AMOs, not with the owner's).
    pub fn register_process(&self, addr: u64, len: u64, perms: Perms) -> Result<u32, ClientError> {
        let req = Request::RegisterProcess {
            addr,
            len,
            perms: perms.0,
        };
        match attach::call(&self.sock, &req, &[])?.0 {
            Response::Registered { region } => Ok(region),
            Response::Error(e) => Err(ClientError::Refused(e)),
            other => Err(ClientError::Protocol(format!(
                "unexpected answer to register: {other:?}"
            ))),
        }
    }

    pub fn deregister(&self, region: u32) -> Result<(), ClientError> {
        match attach::call(&self.sock, &Request::Deregister { region }, &[])?.0 {
            Response::Done => Ok(()),
            Response::Error(e) => Err(ClientError::Refused(e)),
            other => Err(ClientError::Protocol(format!(
                "unexpected answer to deregister: {other:?}"
            ))),
        }
    }

    /// The daemon's statistics text.
    pub fn stat(&self) -> Result<String, ClientError> {
        match attach::call(&self.sock, &Request::Stat, &[])?.0 {
            Response::Stat(s) => Ok(s),
            other => Err(ClientError::Protocol(format!(
                "unexpected answer to stat: {other:?}"
            ))),
        }
    }

    /// The shared control block (diagnostics and fault-injection tests).
    pub fn control(&self) -> &Control {
        &self.control
    }

    pub fn max_inline(&self) -> usize {
        self.control.max_inline()
    }

    pub fn cq_capacity(&self) -> usize {
        self.control.cq_capacity()
    }

    /// Publishes a command, waiting while the ring is full; rings the doorbell only if the
    /// daemon announced that it sleeps.
    pub fn submit(&self, cmd: &Command, inline: &[u8]) -> Result<(), ClientError> {
        let mut spins = 0u32;
        let mut full_since = None;
        while !self.control.cmd_push(cmd, inline) {
            self.ring_if_sleeping();
            spins += 1;
            if spins > SPIN_POLLS {
                // A ring of bulk commands that stays full is a NIC pushing back (a stream
                // outrunning the wire): yielding then keeps a runnable thread beside the
                // daemons doing the work, so sleep until half the ring is free, straight
                // away if the last command had to. Small commands keep yielding: a ring of
                // them drains in microseconds, less than a wake-up costs.
                let since = full_since.get_or_insert_with(Instant::now);
                if cmd.len < SPIN_BELOW_BYTES
                    || !self.ring_full_streak.get() && since.elapsed() < FULL_YIELD_FOR
                {
                    self.yield_now();
                } else {
                    self.ring_full_streak.set(true);
                    self.sleep_for_room()?;
                }
            }
            if spins.is_multiple_of(65_536) && self.daemon_gone() {
                return Err(ClientError::DaemonGone { host: self.host });
            }
        }
        if spins == 0 {
            self.ring_full_streak.set(false);
        }
        self.ring_if_sleeping();
        Ok(())
    }

    /// Gives the core away while waiting for the daemon (announced if it is pinned).
    pub fn yield_now(&self) {
        self.waiter.yield_now();
    }

    /// For a wait past its first polls: whether to keep spinning instead of yielding (see
    /// [`crate::shm::control::Waiter::keep_core`]).
    pub fn keep_core(&self) -> bool {
        self.waiter.keep_core()
    }

    /// A handle that yields like [`Client::yield_now`] without borrowing the client.
    pub fn waiter(&self) -> Waiter {
        self.control.waiter()
    }

    /// For a GASNet wait that outlasts its first spin: whether this thread runs on another
    /// core than the pinned daemon's, moving off the daemon's core for good if it is on it
    /// (`cores::off_core`). `false` when the daemon is not pinned or there is nowhere to go.
    pub fn off_nic_core(&self) -> bool {
        self.control
            .nic_cpu()
            .is_some_and(crate::shm::cores::off_core)
    }

    fn ring_if_sleeping(&self) {
        if self.control.daemon_sleeping() {
            let _ = rustix::io::write(self.daemon_bell.as_fd(), &1u64.to_ne_bytes());
        }
    }

    pub fn poll(&self) -> Option<CqEntry> {
        self.control.cq_pop()
    }

    /// Waits for the next completion: spin, then yield, then sleep on the doorbell.
    pub fn wait(&self) -> Result<CqEntry, ClientError> {
        self.wait_for(0)
    }

    /// [`Client::wait`] for an operation moving `bytes`: from [`SPIN_BELOW_BYTES`] on it
    /// yields from the first look.
    pub fn wait_for(&self, bytes: u64) -> Result<CqEntry, ClientError> {
        let start = Instant::now();
        let mut polls = 0u32;
        // On the pinned NIC's own core a spin only keeps the NIC from the work waited for:
        // a blocking put spun its 20 µs out each time (32 µs instead of 6 in whole runs
        // where the scheduler left the rank there). Yield from the first look instead.
        let spin = bytes < SPIN_BELOW_BYTES
            && match self.control.nic_cpu() {
                Some(nic) => crate::shm::cores::current_cpu() != Some(nic),
                None => true,
            };
        loop {
            if let Some(e) = self.control.cq_pop() {
                return Ok(e);
            }
            polls = polls.wrapping_add(1);
            if spin && !polls.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let waited = start.elapsed();
            if spin && waited < SPIN_FOR {
                continue;
            }
            if waited < SPIN_FOR + YIELD_FOR {
                self.yield_now();
                continue;
            }
            self.sleep_until_news(Duration::from_millis(20))?;
        }
    }

    /// Blocks until the daemon rings or `max` passes (announcing the sleep first).
    pub fn sleep_until_news(&self, max: Duration) -> Result<(), ClientError> {
        self.sleep_until_news_unless(max, &|| false)
    }

    /// Like [`Client::sleep_until_news`], not sleeping when `pending` says news is already
    /// there. `pending` runs after the sleep is announced, so news the daemon publishes in
    /// between rings the doorbell instead of being missed (memory the daemon writes: EQs).
    pub fn sleep_until_news_unless(
        &self,
        max: Duration,
        pending: &dyn Fn() -> bool,
    ) -> Result<(), ClientError> {
        self.control.set_client_sleeping(true);
        // The announcement is out before `pending` reads what the daemon writes.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let gone = !self.control.cq_pending() && !pending() && self.block_on_bell(max);
        self.control.set_client_sleeping(false);
        if gone {
            return Err(ClientError::DaemonGone { host: self.host });
        }
        Ok(())
    }

    /// Blocks until half the command ring is free (the daemon rings then) or 20 ms pass.
    fn sleep_for_room(&self) -> Result<(), ClientError> {
        self.control.set_client_sleeping_for_room();
        // The announcement is out before the ring's head is read.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let gone = !self.control.cmd_half_free() && self.block_on_bell(Duration::from_millis(20));
        self.control.set_client_sleeping(false);
        if gone {
            return Err(ClientError::DaemonGone { host: self.host });
        }
        Ok(())
    }

    /// Sleeps on the doorbell (at most `max`) and consumes its ring; says whether the daemon
    /// went away meanwhile.
    fn block_on_bell(&self, max: Duration) -> bool {
        let mut fds = [
            PollFd::new(&self.client_bell, PollFlags::IN),
            PollFd::new(&self.sock, PollFlags::IN),
        ];
        let _ = poll(&mut fds, max.as_millis() as i32);
        let sock_ev = fds[1].revents();
        if sock_ev.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::IN) && self.daemon_gone()
        {
            return true;
        }
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&self.client_bell, &mut b);
        false
    }

    fn daemon_gone(&self) -> bool {
        let mut fds = [PollFd::new(&self.sock, PollFlags::IN)];
        matches!(poll(&mut fds, 0), Ok(1))
            && fds[0].revents().intersects(PollFlags::HUP | PollFlags::ERR)
    }
}

impl Drop for Client {
    /// A leaving process hands its last commands over before its socket closes: like a NIC
    /// that runs the descriptors it was given, the daemon should see every command published
    /// (an unsynchronised put_nbi, a GASNet node's last implicit reply). Bounded: a daemon
    /// that is gone or stuck does not hold the process.
    fn drop(&mut self) {
        let start = Instant::now();
        while !self.control.cmd_consumed() && start.elapsed() < LEAVE_WAIT {
            self.ring_if_sleeping();
            if self.daemon_gone() {
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}
