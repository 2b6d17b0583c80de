//! One host's soft NIC in the daemon: the thin driver around its [`HostCore`]. It owns what
//! touches the OS — the datagram socket, the attach socket, the sessions' shared control blocks
//! and doorbells — reads them, hands what it read to the core, and writes out what the core
//! polls. No protocol decision lives here. One daemon process may run several (the local
//! default simulates hosts on 127.0.0.x, each with its own socket).

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::config::Config;
use crate::config::TransportKind;
use crate::nic::host::{Flow, HostCore};
use crate::nic::memory::{Perms, Region};
use crate::phase_trace::{self, Phase};
use crate::shm::attach::{self, Request, Response};
use crate::shm::process_memory::ProcessMemory;
use crate::shm::{Command, Mapping};
use crate::transport::packet::PacketDriver;
use crate::transport::tcp::{self, TcpDriver};
use crate::transport::udp::UdpDriver;
use crate::transport::{Driver, TransportConfig};

use super::rx_watch::{Next, RxWatch};
use super::session::{Attached, Session};

/// Largest region a client may register (1 TiB: a sanity bound, not a quota).
const MAX_REGION: usize = 1 << 40;
/// Commands taken from one ring per turn, so that one busy client cannot starve the others.
const CMD_BUDGET: usize = 256;
const RX_BUDGET: usize = 256;

/// Counters of the driver side (the core keeps the protocol's).
#[derive(Debug, Default, Clone)]
pub struct DriverCounters {
    /// Ring descriptors that failed to decode (their client was disconnected).
    pub bad_commands: u64,
    /// Doorbells rung to wake a sleeping client.
    pub client_wakes: u64,
    /// Times the bulk helper took this host's turns (see `daemon::helper`).
    pub bulk_lends: u64,
    /// The bulk helper turns this host now.
    pub bulk_serving: bool,
}

/// Fewest datagrams of the window a UDP receive buffer must hold.
const MIN_WINDOW: usize = 16;
/// The datagram size is never lowered below what a 1500-byte Ethernet carries.
const MIN_MTU: usize = 1472;

/// Datagram size and window for a UDP receive buffer of `rcvbuf` bytes: never more in flight
/// than the (peer's, like ours) buffer holds — a window that overflows it turns every burst
/// into loss and recovery. When the kernel granted too little for `MIN_WINDOW` datagrams of the
/// configured size (a jumbo `mtu` without root and with a small `rmem_max`), datagrams shrink.
fn udp_sizes(rcvbuf: usize, mtu: usize, window: usize) -> (usize, usize) {
    let mtu = mtu.min((rcvbuf / (2 * MIN_WINDOW)).max(MIN_MTU));
    (mtu, window_within(rcvbuf / (2 * mtu), window))
}

/// The configured window, cut to the datagrams a receive buffer holds (`fits`, half of it:
/// peers share it), never below `MIN_WINDOW`.
fn window_within(fits: usize, window: usize) -> usize {
    fits.clamp(MIN_WINDOW.min(window), window)
}

/// Datagram size and window over TCP: frames of [`tcp::FRAME`] whatever the MTU, and no more
/// in flight than half of what the driver buffers for a peer (the rest is for resends).
fn tcp_sizes(window: usize) -> (usize, usize) {
    (
        tcp::FRAME,
        window_within(tcp::MAX_BUFFERED / (2 * tcp::FRAME), window),
    )
}

/// Datagram size and window for a packet driver: what a ring slot holds, and never more in
/// flight than half the ring (peers share it), as for a UDP receive buffer.
fn packet_sizes(d: &PacketDriver, mtu: usize, window: usize) -> (usize, usize) {
    (
        mtu.min(d.max_datagram()),
        window_within(d.ring_slots() / 2, window),
    )
}

/// An attached client, as a daemon process's hosts tell it of messages on their way.
pub(super) struct Listener {
    /// (host index, job as the engines name it, rank).
    at: (u16, u32, u32),
    session: u64,
    ear: crate::shm::control::Ear,
}

/// Every attached client of a daemon process.
pub(super) type Ears = Arc<std::sync::Mutex<Vec<Listener>>>;

pub struct HostNic {
    /// The NIC itself: transport, engines, sessions' memory.
    pub core: HostCore,
    pub driver: Driver,
    pub listener: OwnedFd,
    socket_path: PathBuf,
    pub sessions: Vec<Option<Session>>,
    /// The CPU the daemon's thread is pinned to, published to every client at attach.
    pub(super) nic_cpu: Option<u32>,
    /// A client attached or detached since the daemon last told them all how many there are.
    pub(super) clients_changed: bool,
    next_gen: u64,
    cmd_buf: Vec<u8>,
    uid: u32,
    allowed_gid: Option<u32>,
    /// The host each datagram of this turn went to (the daemon tells the hosts it serves
    /// itself how many to expect).
    pub sent_to: Vec<u16>,
    /// When a turn looks at the socket.
    pub rx_watch: RxWatch,
    /// The UDP socket's epoll token, and whether it is registered: only while the daemon
    /// sleeps, because a registered socket costs every arriving datagram an epoll callback
    /// (measured: ~0.15–0.35 µs of a ~2.7 µs loopback send).
    token: mio::Token,
    armed: bool,
    pub counters: DriverCounters,
    /// The config's host names, and how this host authenticates (for `softnic stat`).
    names: Vec<String>,
    keys_line: String,
    /// The session whose commands go first this turn (rotates).
    first_session: usize,
    /// The last turn ended when a command's message went out at once (see
    /// [`HostNic::run_commands`]): this one does everything.
    cut_short: bool,
    /// Where this host's transport sends and receives: address, interface, selection.
    link_line: String,
    /// The time of the last turn, and when it was: `now` between turns.
    last_now: (u64, std::time::Instant),
    /// The attached clients of every host this process serves (shared by its hosts), each
    /// told when a message for it leaves (`Waiter::keep_core`).
    pub(super) ears: Ears,
}

impl HostNic {
    /// Whether the process behind an attach socket may attach: the daemon's own user, or a
    /// member (primary or supplementary group) of `allowed_gid`.
    fn may_attach(&self, c: &rustix::net::UCred) -> bool {
        if c.uid.as_raw() == self.uid {
            return true;
        }
        let Some(g) = self.allowed_gid else {
            return false;
        };
        c.gid.as_raw() == g || supplementary_groups(c.pid.as_raw_nonzero().get()).contains(&g)
    }

    /// What a refused process is told: who it is, whom the daemon admits, what to change.
    fn refusal(&self, c: &rustix::net::UCred) -> String {
        format!(
            "permission denied: host {}'s daemon runs as uid {} and admits {}; this process \
             is uid {} gid {} (run as uid {}, or set cluster.allowed_gid to a group of this \
             user and restart the daemon)",
            self.core.name,
            self.uid,
            match self.allowed_gid {
                Some(g) => format!("members of group {g}"),
                None => "no other users (no cluster.allowed_gid)".into(),
            },
            c.uid.as_raw(),
            c.gid.as_raw(),
            self.uid,
        )
    }

    /// Starts host `index` of `cfg`. Its TCP sockets are registered with `registry` under
    /// `token`; a UDP or packet socket only while the daemon sleeps (see [`HostNic::arm`]).
    pub fn new(
        cfg: &Config,
        index: u16,
        registry: &mio::Registry,
        token: mio::Token,
    ) -> io::Result<HostNic> {
        let nhosts = cfg.hosts.len() as u16;
        let key = cfg
            .keys_for(index)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let peers = cfg.hosts.iter().map(|h| h.addr).collect();
        let addr = cfg.hosts[index as usize].addr;
        let fault = cfg.fault.clone();
        let me = &cfg.hosts[index as usize];
        let device = crate::transport::iface::device(&me.name, me.interface.as_deref(), addr)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let link_line = format!(
            "{addr} on {}{}",
            device.as_deref().unwrap_or("any interface"),
            cfg.cluster
                .iface
                .as_ref()
                .map_or(String::new(), |s| format!(" (iface {s})"))
        );
        // A loopback address needs no pin (and `lo` carries nothing else).
        let pin = device.as_deref().filter(|_| !addr.ip().is_loopback());
        let driver = match cfg.cluster.transport {
            TransportKind::Udp => {
                let d = UdpDriver::bind(addr, pin, peers, fault, cfg.cluster.mtu).map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot bind UDP {addr}: {e}"))
                })?;
                Driver::Udp(d)
            }
            TransportKind::Packet => {
                let link = cfg
                    .packet_link(index)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
                let d = PacketDriver::open(addr, index, &link, cfg.cluster.mtu, fault).map_err(
                    |e| {
                        io::Error::new(
                            e.kind(),
                            format!("cannot open a packet socket on {}: {e}", link.interface),
                        )
                    },
                )?;
                Driver::Packet(d)
            }
            TransportKind::Tcp => Driver::Tcp(
                TcpDriver::bind(addr, pin, peers, &key, fault, registry.try_clone()?, token)
                    .map_err(|e| {
                        io::Error::new(e.kind(), format!("cannot listen on TCP {addr}: {e}"))
                    })?,
            ),
        };
        let (mtu, window) = match &driver {
            Driver::Udp(d) => udp_sizes(d.recv_buffer(), cfg.cluster.mtu, cfg.cluster.window),
            Driver::Packet(d) => packet_sizes(d, cfg.cluster.mtu, cfg.cluster.window),
            Driver::Tcp(_) => tcp_sizes(cfg.cluster.window),
        };
        let tcfg = TransportConfig {
            mtu,
            window,
            max_queued: cfg.cluster.window,
            peer_timeout: cfg.cluster.peer_timeout_ms * 1_000_000,
            ..Default::default()
        };
        let keys_line = match &cfg.hosts[index as usize].public_key {
            Some(pk) => format!("per-host, public key {pk}"),
            None => "cluster secret".into(),
        };
        let core = HostCore::new(
            index,
            nhosts,
            cfg.hosts[index as usize].name.clone(),
            key,
            tcfg,
            rand::random(),
        );
        let socket_path = cfg.socket_path(index);
        std::fs::create_dir_all(&cfg.cluster.runtime_dir)?;
        let _ = std::fs::remove_file(&socket_path);
        let listener = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        rustix::net::bind_unix(&listener, &SocketAddrUnix::new(&socket_path)?).map_err(|e| {
            io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("cannot bind {}: {e}", socket_path.display()),
            )
        })?;
        rustix::net::listen(&listener, 128)?;
        // Anyone may knock: who gets in is decided by the peer's credentials at accept, so a
        // user who may not attach hears why at once instead of a bare "permission denied".
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&socket_path, std::fs::Permissions::from_mode(0o666))?;
        }
        Ok(HostNic {
            core,
            driver,
            listener,
            socket_path,
            sessions: Vec::new(),
            nic_cpu: None,
            clients_changed: false,
            next_gen: 1,
            cmd_buf: Vec::with_capacity(8192),
            uid: rustix::process::geteuid().as_raw(),
            allowed_gid: cfg.cluster.allowed_gid,
            sent_to: Vec::new(),
            rx_watch: RxWatch::default(),
            token,
            armed: false,
            counters: DriverCounters::default(),
            names: cfg.hosts.iter().map(|h| h.name.clone()).collect(),
            keys_line,
            first_session: 0,
            cut_short: false,
            link_line,
            last_now: (0, std::time::Instant::now()),
            ears: Default::default(),
        })
    }

    /// The daemon's clock now (the last turn's time plus what passed since).
    fn now(&self) -> u64 {
        self.last_now.0 + self.last_now.1.elapsed().as_nanos() as u64
    }

    // ------------------------------------------------------------------ the turn

    /// Registers the UDP (or packet) socket with epoll, before the daemon sleeps. Registering
    /// reports a socket that already holds datagrams, so nothing that came before is missed.
    pub fn arm(&mut self, registry: &mio::Registry) -> io::Result<()> {
        if self.armed {
            return Ok(());
        }
        match &mut self.driver {
            Driver::Udp(d) => registry.register(d.socket(), self.token, mio::Interest::READABLE)?,
            Driver::Packet(d) => registry.register(
                &mut mio::unix::SourceFd(&d.raw_fd()),
                self.token,
                mio::Interest::READABLE,
            )?,
            Driver::Tcp(_) => return Ok(()),
        }
        self.armed = true;
        Ok(())
    }

    /// Takes that socket out of epoll again once the daemon is awake.
    pub fn disarm(&mut self, registry: &mio::Registry) -> io::Result<()> {
        if !self.armed {
            return Ok(());
        }
        match &mut self.driver {
            Driver::Udp(d) => registry.deregister(d.socket())?,
            Driver::Packet(d) => registry.deregister(&mut mio::unix::SourceFd(&d.raw_fd()))?,
            Driver::Tcp(_) => {}
        }
        self.armed = false;
        Ok(())
    }

    /// One pass over everything this host has to do, at the daemon's time `now` (read at
    /// `at`). Returns whether anything happened.
    pub fn turn(&mut self, now: u64, at: std::time::Instant) -> bool {
        self.last_now = (now, at);
        let mut busy = false;
        self.sent_to.clear();
        // Sessions take turns at going first: a process that always has commands (a stream
        // of non-blocking puts) cannot keep the others' commands behind its own.
        let n = self.sessions.len();
        self.first_session = (self.first_session + 1) % n.max(1);
        let may_cut = !std::mem::take(&mut self.cut_short);
        let (did, sent) = self.drain_all(now, may_cut);
        if sent {
            // A message is on its way: the turn ends here, so that the host it went to
            // (served by this thread, in the local default) opens it before this one goes on
            // with what does not wait for it (the receive its process posted next, the send
            // event); the next turn does everything.
            self.cut_short = true;
            return true;
        }
        busy |= did;
        let counting = matches!(self.driver, Driver::Udp(_));
        // A packet ring is looked at every turn: a look is a read of memory, not a syscall.
        let ring = matches!(self.driver, Driver::Packet(_));
        if self.rx_watch.start(busy, counting) || ring {
            for _ in 0..RX_BUDGET {
                // Opened (decrypted) where the driver holds it: no copy before the engines.
                let core = &mut self.core;
                if !self.driver.recv_with(&mut |d| core.handle_datagram(now, d)) {
                    self.rx_watch.found_empty();
                    break;
                }
                busy = true;
                if self
                    .rx_watch
                    .got(self.driver.bursting(), self.driver.buffered())
                    == Next::Stop
                {
                    break;
                }
            }
            self.rx_watch.end(self.driver.bursting());
            if self.rx_watch.settled() {
                self.driver.settled();
            }
        }
        // Events that arrivals produced reach their processes before the transmit work: a
        // process waiting on an ACK sees it ~30 ns sooner (measured, receive to event push:
        // 436 → 343 cycles). What the rest of the turn produces goes out at its end.
        busy |= self.core.deliver_events();
        self.core.handle_timeout(now);
        busy |= self.transmit(now);
        busy |= self.core.deliver_events();
        busy |= self.post_completions();
        busy
    }

    /// Drains every session's commands, from the one whose turn it is to go first; stops
    /// when a command's message was sent at once (`may_cut`, see [`HostNic::run_commands`]).
    /// Returns whether anything was done and whether it stopped so.
    fn drain_all(&mut self, now: u64, may_cut: bool) -> (bool, bool) {
        let n = self.sessions.len();
        let mut busy = false;
        for k in 0..n {
            let (did, sent) = self.drain_commands(now, (self.first_session + k) % n, may_cut);
            busy |= did;
            if sent {
                return (true, true);
            }
        }
        (busy, false)
    }

    /// Sends every datagram that is due; returns whether any was.
    fn transmit(&mut self, now: u64) -> bool {
        let mut sent = false;
        while let Some((to, d)) = self.core.poll_transmit(now) {
            self.driver.send(to, d);
            self.sent_to.push(to);
            sent = true;
        }
        self.driver.flush();
        sent
    }

    /// Posts the core's completions into the sessions' queues and rings the doorbells of
    /// sleeping sessions that got news. Returns whether anything was posted.
    fn post_completions(&mut self) -> bool {
        let mut any = false;
        let mut broken = Vec::new();
        while let Some((session, entry)) = self.core.poll_completion() {
            any = true;
            let slot = (session & 0xffff_ffff) as usize;
            let Some(Some(s)) = self.sessions.get_mut(slot) else {
                continue;
            };
            if s.id != session {
                continue;
            }
            if let Some(a) = s.attached.as_mut() {
                if !a.post(entry) {
                    broken.push(slot);
                }
            }
        }
        while let Some(session) = self.core.poll_wake() {
            let slot = (session & 0xffff_ffff) as usize;
            if let Some(Some(s)) = self.sessions.get_mut(slot) {
                if let Some(a) = s.attached.as_mut().filter(|_| s.id == session) {
                    a.rung = true;
                }
            }
        }
        for s in self.sessions.iter_mut().flatten() {
            if let Some(a) = s.attached.as_mut() {
                if a.wake_if_sleeping() {
                    self.counters.client_wakes += 1;
                }
            }
        }
        self.tell_addressees();
        for slot in broken {
            tracing::warn!(host = %self.core.name, "client let its completion queue overflow: disconnecting it");
            self.detach(slot);
        }
        any
    }

    /// Tells each process a message was just sent to that it is on its way, if this daemon
    /// process serves it (`Waiter::keep_core`).
    fn tell_addressees(&mut self) {
        let Some(first) = self.core.poll_addressed() else {
            return;
        };
        let ears = self.ears.lock().unwrap_or_else(|e| e.into_inner());
        let mut to = Some(first);
        while let Some(t) = to {
            if let Some(l) = ears.iter().find(|l| l.at == t) {
                l.ear.spoken_to();
            }
            to = self.core.poll_addressed();
        }
    }

    /// Hands a session's published commands to the core, in order, until the ring is empty,
    /// the budget is spent or the core pushes back.
    fn drain_commands(&mut self, now: u64, slot: usize, may_send: bool) -> (bool, bool) {
        let (did, sent) = self.run_commands(now, slot, may_send);
        // The client gets the consumed ring space back once per drain, not per command; one
        // that sleeps on a full ring is woken once half of it is free.
        if let Some(Some(s)) = self.sessions.get_mut(slot) {
            if let Some(a) = s.attached.as_mut() {
                a.control.cmd_publish();
                if did && a.control.cmd_backlog_below_half() {
                    a.room = true;
                }
            }
        }
        (did, sent)
    }

    /// [`HostNic::drain_commands`]'s loop. With `may_send`, what a command sends leaves at
    /// once when nothing was queued behind it or nothing of this host's was on its way, and
    /// the drain stops there: returns whether anything was done and whether it stopped so.
    fn run_commands(&mut self, now: u64, slot: usize, may_send: bool) -> (bool, bool) {
        let mut did = false;
        for _ in 0..CMD_BUDGET {
            let Some(Some(s)) = self.sessions.get(slot) else {
                return (did, false);
            };
            let Some(a) = s.attached.as_ref() else {
                return (did, false);
            };
            let mut buf = std::mem::take(&mut self.cmd_buf);
            // Copied out of shared memory before it is checked: the client may scribble on it.
            let peeked = a.control.cmd_peek(&mut buf);
            let (id, rank) = (s.id, a.rank);
            let (len, alone) = match peeked {
                Ok(Some(len)) => {
                    phase_trace::stamp(Phase::CommandTaken);
                    (len, a.control.cmd_alone(len))
                }
                Ok(None) => {
                    self.cmd_buf = buf;
                    return (did, false);
                }
                Err(e) => {
                    self.cmd_buf = buf;
                    self.counters.bad_commands += 1;
                    tracing::warn!(host = %self.core.name, rank, "bad command ring ({e}): disconnecting client");
                    self.detach(slot);
                    return (true, false);
                }
            };
            // Sent at once if nothing was queued behind it, or nothing of this host's is on
            // its way (then it is the start of a stream, or a ping-pong's answer), or only a
            // call that sends nothing is (a receive posted after a send: MPI's send, recv).
            let at_once = may_send
                && (alone || self.core.transport.quiet() || a.control.cmd_next_stays_local(len));
            let flow = match Command::decode(&buf) {
                Ok((cmd, inline)) => {
                    let flow = self.core.handle_command(now, id, &cmd, inline);
                    phase_trace::stamp(Phase::CommandDone);
                    self.tell_addressees();
                    flow
                }
                Err(e) => {
                    self.counters.bad_commands += 1;
                    tracing::warn!(host = %self.core.name, rank, "bad command ({e}): disconnecting client");
                    self.cmd_buf = buf;
                    self.detach(slot);
                    return (true, false);
                }
            };
            self.cmd_buf = buf;
            match flow {
                Flow::Done => {
                    if let Some(Some(s)) = self.sessions.get(slot) {
                        if let Some(a) = s.attached.as_ref() {
                            a.control.cmd_advance(len);
                        }
                    }
                    did = true;
                    // What it sent leaves now: a process that sends and then posts its
                    // receive (MPI's send, recv) would otherwise keep its message here while
                    // the NIC handles the receive, and the send event would be mirrored
                    // first. Commands that queue up behind each other while datagrams are
                    // on their way still share datagrams.
                    if at_once {
                        self.core.flush_eager(now);
                        if self.transmit(now) {
                            return (true, true);
                        }
                    }
                }
                Flow::Backpressure => return (did, false),
            }
        }
        (did, false)
    }

    // ------------------------------------------------------------------ attach socket

    /// Accepts pending connections; returns the new sessions' slots.
    pub fn accept(&mut self) -> Vec<usize> {
        let mut new = Vec::new();
        loop {
            let fd = match rustix::net::accept_with(
                &self.listener,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::warn!(host = %self.core.name, "accept failed: {e}");
                    break;
                }
            };
            let pid = match rustix::net::sockopt::get_socket_peercred(&fd) {
                Ok(c) if self.may_attach(&c) => c.pid.as_raw_nonzero().get(),
                Ok(c) => {
                    self.core.stats.attach_refused += 1;
                    let why = self.refusal(&c);
                    tracing::warn!(host = %self.core.name, "refusing attach: {why}");
                    let _ = attach::send(fd.as_fd(), &Response::Error(why).encode(), &[]);
                    continue;
                }
                Err(e) => {
                    tracing::warn!("SO_PEERCRED failed: {e}");
                    continue;
                }
            };
            let slot = self
                .sessions
                .iter()
                .position(|s| s.is_none())
                .unwrap_or_else(|| {
                    self.sessions.push(None);
                    self.sessions.len() - 1
                });
            self.next_gen += 1;
            let id = (self.next_gen << 32) | slot as u64;
            self.sessions[slot] = Some(Session {
                id,
                sock: fd,
                pid,
                pidfd: crate::shm::process_memory::pidfd(pid).ok().map(Arc::new),
                attached: None,
            });
            new.push(slot);
        }
        new
    }

    /// Serves the attach requests waiting on `slot`'s socket. After a successful hello,
    /// `bell` receives the daemon doorbell to watch. Returns `false` if the session ended.
    pub fn on_session_readable(&mut self, slot: usize, bell: &mut Option<i32>) -> bool {
        let mut buf = vec![0u8; attach::MAX_MESSAGE];
        loop {
            let Some(Some(s)) = self.sessions.get(slot) else {
                return false;
            };
            let mut fds = Vec::new();
            let n = match attach::recv(s.sock.as_fd(), &mut buf, &mut fds) {
                Ok(0) => {
                    self.leave(slot);
                    return false;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!(host = %self.core.name, "attach socket error: {e}");
                    self.detach(slot);
                    return false;
                }
            };
            let reply = match Request::decode(&buf[..n]) {
                Ok(req) => self.request(slot, req, fds, bell),
                Err(e) => (Response::Error(format!("bad request: {e}")), Vec::new()),
            };
            let Some(Some(s)) = self.sessions.get(slot) else {
                return false;
            };
            let borrowed: Vec<_> = reply.1.iter().map(|f| f.as_fd()).collect();
            if attach::send(s.sock.as_fd(), &reply.0.encode(), &borrowed).is_err() {
                self.detach(slot);
                return false;
            }
        }
    }

    fn request(
        &mut self,
        slot: usize,
        req: Request,
        mut fds: Vec<OwnedFd>,
        bell: &mut Option<i32>,
    ) -> (Response, Vec<OwnedFd>) {
        let err = |s: String| (Response::Error(s), Vec::new());
        let s = self.sessions[slot].as_mut().expect("live session");
        match req {
            Request::Ping => (Response::Pong, Vec::new()),
            Request::Stat => (Response::Stat(self.stat_text()), Vec::new()),
            Request::Probe => {
                let now = self.now();
                self.core.transport.probe(now, wall_ns());
                (Response::Pong, Vec::new())
            }
            Request::Hello {
                job,
                job_key,
                rank,
                size,
            } => {
                if s.attached.is_some() {
                    return err("already attached".into());
                }
                let a = match Attached::new(job, rank) {
                    Ok(a) => a,
                    Err(e) => return err(format!("cannot create shared memory: {e}")),
                };
                if let Err(e) = self.core.attach(s.id, job, job_key, rank, size) {
                    return err(e.to_string());
                }
                a.control.set_nic_cpu(self.nic_cpu);
                let fds = vec![
                    a.control.mapping().fd().try_clone_to_owned(),
                    a.daemon_bell.try_clone(),
                    a.client_bell.try_clone(),
                ];
                *bell = Some(a.daemon_bell.as_raw_fd());
                let s = self.sessions[slot].as_mut().expect("live session");
                let tag = self.core.session_job(s.id).unwrap_or(job);
                self.ears
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Listener {
                        at: (self.core.index, tag, rank),
                        session: s.id,
                        ear: a.control.ear(),
                    });
                s.attached = Some(a);
                self.clients_changed = true;
                match fds.into_iter().collect::<io::Result<Vec<_>>>() {
                    Ok(f) => (
                        Response::HelloOk {
                            host: self.core.index,
                            nhosts: self.core.nhosts,
                            body: self.core.transport.body_capacity() as u32,
                        },
                        f,
                    ),
                    Err(e) => err(format!("dup failed: {e}")),
                }
            }
            Request::Register { perms } => {
                if s.attached.is_none() {
                    return err("register before hello".into());
                }
                if fds.len() != 1 {
                    return err(format!(
                        "register carries {} descriptors, expected one memfd",
                        fds.len()
                    ));
                }
                let map = match Mapping::from_fd(fds.remove(0), 8, MAX_REGION) {
                    Ok(m) => m,
                    Err(e) => return err(format!("cannot map region: {e}")),
                };
                let id = s.id;
                match self
                    .core
                    .register(id, Region::new(Arc::new(map), Perms(perms)))
                {
                    Ok(region) => (Response::Registered { region }, Vec::new()),
                    Err(st) => err(format!("register failed: {st:?}")),
                }
            }
            Request::RegisterProcess { addr, len, perms } => {
                let Some(a) = s.attached.as_ref() else {
                    return err("register before hello".into());
                };
                if len > MAX_REGION as u64 {
                    return err(format!("cannot register {len} bytes: at most {MAX_REGION}"));
                }
                let Some(pidfd) = s.pidfd.clone() else {
                    return err("this kernel has no pidfds: process regions unavailable".into());
                };
                let mem = match ProcessMemory::new(s.pid, pidfd, addr, len) {
                    Ok(m) => m,
                    Err(e) => {
                        return err(format!(
                            "cannot reach [{addr:#x}, +{len}) of process {}: {e} (ptrace \
                             access: same user, and Yama's ptrace_scope allows it or the \
                             client named the daemon its tracer)",
                            s.pid
                        ))
                    }
                };
                let _ = a;
                let id = s.id;
                match self
                    .core
                    .register(id, Region::new(Arc::new(mem), Perms(perms)))
                {
                    Ok(region) => (Response::Registered { region }, Vec::new()),
                    Err(st) => err(format!("register failed: {st:?}")),
                }
            }
            Request::Deregister { region } => {
                if s.attached.is_none() {
                    return err("deregister before hello".into());
                }
                let id = s.id;
                match self.core.deregister(id, region) {
                    Ok(()) => (Response::Done, Vec::new()),
                    Err(st) => err(format!("deregister failed: {st:?}")),
                }
            }
        }
    }

    /// A client closed its socket: the commands it published before are run first, as a NIC
    /// runs the descriptors it was handed (a GASNet node's last implicit reply is one: its
    /// requester would otherwise wait for it), then the client is dropped. Stops early when
    /// the core pushes back: what it cannot take now is lost with the client.
    fn leave(&mut self, slot: usize) {
        let now = self.now();
        while self
            .sessions
            .get(slot)
            .and_then(|s| s.as_ref()?.attached.as_ref())
            .is_some_and(|a| a.control.cmd_pending())
        {
            if !self.drain_commands(now, slot, false).0 {
                break;
            }
        }
        self.detach(slot);
    }

    /// Drops a client: its memory becomes unreachable (remote ops get NoSuchEndpoint), its
    /// outstanding operations are forgotten, the daemon goes on serving the others.
    pub fn detach(&mut self, slot: usize) {
        let Some(s) = self.sessions.get_mut(slot).and_then(|s| s.take()) else {
            return;
        };
        self.clients_changed |= s.attached.is_some();
        let index = self.core.index;
        self.ears
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|l| (l.at.0, l.session) != (index, s.id));
        self.core.detach(s.id);
    }

    /// How many clients are attached here.
    pub fn clients(&self) -> usize {
        self.sessions
            .iter()
            .flatten()
            .filter(|s| s.attached.is_some())
            .count()
    }

    /// Tells every attached client how many the whole process serves.
    pub fn publish_clients(&self, n: usize) {
        for a in self
            .sessions
            .iter()
            .flatten()
            .filter_map(|s| s.attached.as_ref())
        {
            a.control.set_clients(n.min(u32::MAX as usize) as u32);
        }
    }

    /// Whether a client announced that it yields `cpu` while waiting for us.
    pub fn waiter_on(&self, cpu: u32) -> bool {
        self.sessions
            .iter()
            .flatten()
            .filter_map(|s| s.attached.as_ref())
            .any(|a| a.control.waiter_cpu() == Some(cpu))
    }

    /// Whether any client published commands (checked before the daemon sleeps).
    pub fn set_sleeping(&self, v: bool) -> bool {
        let mut pending = false;
        for a in self
            .sessions
            .iter()
            .flatten()
            .filter_map(|s| s.attached.as_ref())
        {
            a.control.set_daemon_sleeping(v);
            pending |= a.control.cmd_pending();
        }
        pending || self.core.has_backlog()
    }

    pub fn stat_text(&self) -> String {
        let d = self.driver.stats();
        let c = &self.core;
        let clients = self
            .sessions
            .iter()
            .flatten()
            .filter(|s| s.attached.is_some())
            .count();
        let mut lines = vec![
            (
                "host",
                format!("{} (index {} of {})", c.name, c.index, c.nhosts),
            ),
            ("transport", self.driver.kind().name().to_string()),
            ("link", self.link_line.clone()),
            ("mtu", c.transport.config().mtu.to_string()),
            ("clients", clients.to_string()),
        ];
        lines.extend([
            ("version", env!("CARGO_PKG_VERSION").to_string()),
            ("keys", self.keys_line.clone()),
        ]);
        lines.extend(c.stat_lines());
        lines.extend([
            ("fault_dropped", d.fault_dropped.to_string()),
            ("fault_duplicated", d.fault_duplicated.to_string()),
            ("send_would_block", d.send_would_block.to_string()),
            ("send_syscalls", d.send_syscalls.to_string()),
            ("recv_syscalls", d.recv_syscalls.to_string()),
            ("gso_sends", d.gso_sends.to_string()),
            ("gro_joined", d.gro_joined.to_string()),
            ("rx_bad_frames", d.rx_bad_frames.to_string()),
            ("refused_connections", d.refused_connections.to_string()),
            ("bad_commands", self.counters.bad_commands.to_string()),
            ("client_wakes", self.counters.client_wakes.to_string()),
            ("bulk_helper_lends", self.counters.bulk_lends.to_string()),
            (
                "bulk_helper_serving",
                u8::from(self.counters.bulk_serving).to_string(),
            ),
        ]);
        let mut text: String = lines
            .iter()
            .map(|(k, v)| format!("{k:<24} {v}\n"))
            .collect();
        // One line per peer: what `softnic doctor` reads.
        let now = self.now();
        for (i, name) in self.names.iter().enumerate() {
            if i == c.index as usize {
                continue;
            }
            let Some(v) = c.transport.peer_view(i as u16, now) else {
                continue;
            };
            let opt = |x: Option<u64>, div: u64| x.map_or("-".into(), |x| (x / div).to_string());
            // Its clock less ours when its probe arrived (the one-way delay is noise here).
            let clock = v.clock.map_or("-".into(), |(theirs, ago)| {
                let ours = wall_ns().saturating_sub(ago);
                ((theirs as i128 - ours as i128) / 1_000_000).to_string()
            });
            text.push_str(&format!(
                "{:<24} {} rtt_us={} heard_ms={} heard={} auth_failures={} largest={} clock_ms={}\n",
                format!("peer {name}"),
                if v.open { "open" } else { "closed" },
                opt(v.srtt_ns, 1_000),
                opt(v.heard_ago_ns, 1_000_000),
                v.heard,
                v.auth_failures,
                v.largest,
                clock,
            ));
        }
        text
    }
}

impl Drop for HostNic {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket_path);
    }
}

/// The wall clock, Unix ns (what `softnic doctor` compares across hosts).
fn wall_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The supplementary groups of process `pid` (its `Groups:` line in /proc; empty if gone).
fn supplementary_groups(pid: i32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| l.strip_prefix("Groups:")).map(|g| {
                g.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_shrink_to_fit_a_small_receive_buffer() {
        // Root (8 MiB granted): the configured sizes, the window capped by the buffer.
        assert_eq!(udp_sizes(16 << 20, 65_000, 512), (65_000, 129));
        assert_eq!(udp_sizes(16 << 20, 8972, 512), (8972, 512));
        // A stock rmem_max (the kernel reports twice 212992): 16 datagrams must fit.
        let (mtu, window) = udp_sizes(425_984, 65_000, 512);
        assert_eq!((mtu, window), (13_312, 16));
        assert!(2 * mtu * window <= 425_984);
        // Never below an Ethernet datagram, and a small configured window is kept.
        assert_eq!(udp_sizes(4096, 8972, 512).0, MIN_MTU);
        assert_eq!(udp_sizes(16 << 20, 8972, 4), (8972, 4));
    }
}
