//! One host's soft NIC: its transport and socket, its attached clients, and the glue between
//! command rings, the Gemini engine and the transport. One daemon process may run several
//! (the local default simulates hosts on 127.0.0.x, each with its own socket).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

// Fx: the daemon looks these up per operation; keys are small ids from its own clients and
// authenticated peers.
use rustc_hash::FxHashMap as HashMap;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::config::Config;
use crate::config::TransportKind;
use crate::nic::gemini::{serve, Completion, Initiator, Pending, PendingKind, Reply, TargetAction};
use crate::nic::memory::{Endpoints, Perms, Region};
use crate::shm::attach::{self, Request, Response};
use crate::shm::process_memory::ProcessMemory;
use crate::shm::{Command, CommandKind, CqEntry, Mapping, CMD_IMPLICIT};
use crate::transport::packet::PacketDriver;
use crate::transport::tcp::TcpDriver;
use crate::transport::udp::UdpDriver;
use crate::transport::{Driver, PushError, Transport, TransportConfig, TransportEvent};
use crate::wire::{AmoOp, OpHeader, OpIter, OpKind, OpRef, Status};

use super::rx_watch::{Next, RxWatch};
use super::session::{Attached, Session};

/// Largest region a client may register (1 TiB: a sanity bound, not a quota).
const MAX_REGION: usize = 1 << 40;
/// Commands taken from one ring per turn, so that one busy client cannot starve the others.
const CMD_BUDGET: usize = 256;
const RX_BUDGET: usize = 256;

/// Counters of this host beyond the transport's.
#[derive(Debug, Default, Clone)]
pub struct HostStats {
    pub cmd_put: u64,
    pub cmd_get: u64,
    pub cmd_amo: u64,
    pub served_put: u64,
    pub served_get: u64,
    pub served_amo: u64,
    pub local_ops: u64,
    pub bad_commands: u64,
    /// Doorbells rung to wake a sleeping client.
    pub client_wakes: u64,
    pub cmd_portals: u64,
    pub served_portals: u64,
    pub malformed_ops: u64,
    pub clients_attached: u64,
    pub clients_detached: u64,
    pub attach_refused: u64,
}

/// An outbound item waiting for room in the transport (kept in order per peer).
pub(super) enum OutItem {
    Reply(Reply),
    Stream(Stream),
    /// An op owned in encoded form (Portals requests and responses that found no room).
    Encoded(Vec<u8>),
}

/// Bulk data streamed from a region as fragments: a BTE put or a get reply.
pub(super) struct Stream {
    kind: StreamKind,
    h: OpHeader,
    src: Region,
    src_off: u64,
    len: u64,
    sent: u64,
    started: bool,
}

pub(super) enum StreamKind {
    Put {
        region: u32,
        dst_off: u64,
        lazy_ack: bool,
    },
    GetReply,
}

/// Did a command go through, or must the ring wait for room?
pub(super) enum Flow {
    Done,
    Backpressure,
}

/// How many ops ahead of the one being served an atomic's target is prefetched.
const PREFETCH_AHEAD: usize = 8;

pub struct HostNic {
    pub index: u16,
    pub name: String,
    pub(super) nhosts: u16,
    pub transport: Transport,
    pub driver: Driver,
    pub listener: OwnedFd,
    socket_path: PathBuf,
    pub(super) endpoints: Endpoints,
    initiator: Initiator,
    pub sessions: Vec<Option<Session>>,
    /// The CPU the daemon's thread is pinned to, published to every client at attach.
    pub(super) nic_cpu: Option<u32>,
    next_gen: u64,
    jobs: HashMap<u32, (u64, usize)>,
    pub(super) out: Vec<VecDeque<OutItem>>,
    completions: Vec<Completion>,
    /// Completions with a raw status (Portals return codes).
    pub(super) raw_completions: Vec<(u64, CqEntry)>,
    /// Portals interfaces of the attached processes, by (job, rank).
    pub(super) portals: HashMap<(u32, u32), super::portals::PortalsProc>,
    pub(super) ptl_asm: crate::nic::portals::wire::Reassembly,
    /// Scratch for the payload of the Portals operation being started.
    pub(super) ptl_payload: Vec<u8>,
    pub(super) ptl_acks: super::portals::AckBatch,
    pub(super) ptl_scratch: super::portals::MirrorScratch,
    /// An interface was reached (so its events or counts may have changed) or a ring still
    /// held unconsumed events at the last mirror: the next turn mirrors.
    pub(super) ptl_dirty: bool,
    rx: Vec<u8>,
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
    pub stats: HostStats,
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

/// Datagram size and window for a packet driver: what a ring slot holds, and never more in
/// flight than half the ring (peers share it), as for a UDP receive buffer.
fn packet_sizes(d: &PacketDriver, mtu: usize, window: usize) -> (usize, usize) {
    (
        mtu.min(d.max_datagram()),
        window_within(d.ring_slots() / 2, window),
    )
}

impl HostNic {
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
            .key()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let peers = cfg.hosts.iter().map(|h| h.addr).collect();
        let addr = cfg.hosts[index as usize].addr;
        let fault = cfg.fault.clone();
        let driver = match cfg.cluster.transport {
            TransportKind::Udp => {
                let d = UdpDriver::bind(addr, peers, fault).map_err(|e| {
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
                TcpDriver::bind(addr, peers, fault, registry.try_clone()?, token).map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot listen on TCP {addr}: {e}"))
                })?,
            ),
        };
        let (mtu, window) = match &driver {
            Driver::Udp(d) => udp_sizes(d.recv_buffer(), cfg.cluster.mtu, cfg.cluster.window),
            Driver::Packet(d) => packet_sizes(d, cfg.cluster.mtu, cfg.cluster.window),
            Driver::Tcp(_) => (cfg.cluster.mtu, cfg.cluster.window),
        };
        let tcfg = TransportConfig {
            mtu,
            window,
            max_queued: cfg.cluster.window,
            peer_timeout: cfg.cluster.peer_timeout_ms * 1_000_000,
            ..Default::default()
        };
        let transport = Transport::new(index, nhosts, key, tcfg, rand::random());
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
        Ok(HostNic {
            index,
            name: cfg.hosts[index as usize].name.clone(),
            nhosts,
            transport,
            driver,
            listener,
            socket_path,
            endpoints: Endpoints::default(),
            initiator: Initiator::default(),
            sessions: Vec::new(),
            nic_cpu: None,
            next_gen: 1,
            jobs: HashMap::default(),
            out: (0..nhosts).map(|_| VecDeque::new()).collect(),
            completions: Vec::new(),
            raw_completions: Vec::new(),
            portals: HashMap::default(),
            ptl_asm: Default::default(),
            ptl_payload: Vec::new(),
            ptl_acks: Default::default(),
            ptl_scratch: Default::default(),
            ptl_dirty: false,
            rx: vec![0; 65_536],
            cmd_buf: Vec::with_capacity(8192),
            uid: rustix::process::geteuid().as_raw(),
            allowed_gid: cfg.cluster.allowed_gid,
            sent_to: Vec::new(),
            rx_watch: RxWatch::default(),
            token,
            armed: false,
            stats: HostStats::default(),
        })
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

    /// One pass over everything this host has to do. Returns whether anything happened.
    pub fn turn(&mut self, now: u64) -> bool {
        let mut busy = false;
        self.sent_to.clear();
        for slot in 0..self.sessions.len() {
            busy |= self.drain_commands(slot);
        }
        let counting = matches!(self.driver, Driver::Udp(_));
        // A packet ring is looked at every turn: a look is a read of memory, not a syscall.
        let ring = matches!(self.driver, Driver::Packet(_));
        if self.rx_watch.start(busy, counting) || ring {
            let mut rx = std::mem::take(&mut self.rx);
            for _ in 0..RX_BUDGET {
                let Some(n) = self.driver.recv(&mut rx) else {
                    self.rx_watch.found_empty();
                    break;
                };
                busy = true;
                self.on_datagram(now, &rx[..n]);
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
            self.rx = rx;
        }
        // Events that arrivals produced reach their processes before the transmit work: a
        // process waiting on an ACK sees it ~30 ns sooner (measured, receive to event push:
        // 436 → 343 cycles). What the rest of the turn produces goes out at its end.
        busy |= self.ptl_mirror();
        self.transport.handle_timeout(now);
        while let Some(ev) = self.transport.poll_event() {
            match ev {
                TransportEvent::PeerDead(h) | TransportEvent::PeerReset(h) => {
                    tracing::warn!(host = %self.name, peer = h, "peer {ev:?}: failing its pending operations");
                    self.initiator.fail_host(h, &mut self.completions);
                    self.out[h as usize].clear();
                    self.ptl_peer_dead(h);
                }
            }
        }
        for peer in 0..self.nhosts {
            self.drain_out(peer);
        }
        self.transport.flush(now);
        while let Some((to, d)) = self.transport.poll_transmit(now) {
            self.driver.send(to, d);
            self.sent_to.push(to);
            busy = true;
        }
        self.driver.flush();
        busy |= self.ptl_mirror();
        busy |= !self.completions.is_empty() || !self.raw_completions.is_empty();
        self.post_completions();
        busy
    }

    fn post_completions(&mut self) {
        let mut broken = Vec::new();
        // Both queues are drained in place and keep their capacity for the next turn.
        let typed = self.completions.drain(..).map(|c| {
            (
                c.session,
                CqEntry {
                    client_req: c.client_req,
                    status: c.status as u32,
                    value: c.value,
                },
            )
        });
        for (session, entry) in typed.chain(self.raw_completions.drain(..)) {
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
        for s in self.sessions.iter_mut().flatten() {
            if let Some(a) = s.attached.as_mut() {
                if a.wake_if_sleeping() {
                    self.stats.client_wakes += 1;
                }
            }
        }
        for slot in broken {
            tracing::warn!(host = %self.name, "client let its completion queue overflow: disconnecting it");
            self.detach(slot);
        }
    }

    fn complete(&mut self, session: u64, client_req: u64, status: Status, value: u64) {
        self.completions.push(Completion {
            session,
            client_req,
            status,
            value,
        });
    }

    // ------------------------------------------------------------------ commands (initiator)

    fn drain_commands(&mut self, slot: usize) -> bool {
        let did = self.run_commands(slot);
        // The client gets the consumed ring space back once per drain, not per command.
        if let Some(Some(s)) = self.sessions.get(slot) {
            if let Some(a) = s.attached.as_ref() {
                a.control.cmd_publish();
            }
        }
        did
    }

    fn run_commands(&mut self, slot: usize) -> bool {
        let mut did = false;
        for _ in 0..CMD_BUDGET {
            let Some(Some(s)) = self.sessions.get(slot) else {
                return did;
            };
            let Some(a) = s.attached.as_ref() else {
                return did;
            };
            let mut buf = std::mem::take(&mut self.cmd_buf);
            let peeked = a.control.cmd_peek(&mut buf);
            let (id, job, rank) = (s.id, a.job, a.rank);
            let len = match peeked {
                Ok(Some(len)) => len,
                Ok(None) => {
                    self.cmd_buf = buf;
                    return did;
                }
                Err(e) => {
                    self.cmd_buf = buf;
                    self.stats.bad_commands += 1;
                    tracing::warn!(host = %self.name, rank, "bad command ring ({e}): disconnecting client");
                    self.detach(slot);
                    return true;
                }
            };
            let flow = match Command::decode(&buf) {
                Ok((cmd, inline)) => self.command(id, job, rank, &cmd, inline),
                Err(e) => {
                    self.stats.bad_commands += 1;
                    tracing::warn!(host = %self.name, rank, "bad command ({e}): disconnecting client");
                    self.cmd_buf = buf;
                    self.detach(slot);
                    return true;
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
                }
                Flow::Backpressure => return did,
            }
        }
        did
    }

    fn command(&mut self, session: u64, job: u32, rank: u32, c: &Command, inline: &[u8]) -> Flow {
        match c.kind {
            CommandKind::PutInline | CommandKind::PutFrom => self.stats.cmd_put += 1,
            CommandKind::Get => self.stats.cmd_get += 1,
            CommandKind::Amo | CommandKind::AmoScatter => self.stats.cmd_amo += 1,
            CommandKind::Portals => {
                self.stats.cmd_portals += 1;
                return self.ptl_command(session, job, rank, c.client_req, inline);
            }
        }
        if c.host >= self.nhosts {
            self.complete(session, c.client_req, Status::BadRequest, 0);
            return Flow::Done;
        }
        let h = OpHeader {
            job,
            src_rank: rank,
            dst_rank: c.rank,
            req: 0,
        };
        if c.host == self.index {
            self.stats.local_ops += 1;
            let (status, value) = self.local(h, c, inline);
            self.complete(session, c.client_req, status, value);
            return Flow::Done;
        }
        let host = c.host;
        match self.transport.can_push(host) {
            Err(PushError::Full(_)) => return Flow::Backpressure,
            Err(_) => {
                self.complete(session, c.client_req, Status::PeerDead, 0);
                return Flow::Done;
            }
            Ok(()) => {}
        }
        if !self.out[host as usize].is_empty() {
            return Flow::Backpressure;
        }
        // The local side of BTE puts and gets must be this client's own registered memory.
        let local = match c.kind {
            CommandKind::PutFrom | CommandKind::Get => {
                match self
                    .endpoints
                    .region(job, rank, c.local_region)
                    .and_then(|r| r.check_local(c.local_off, c.len).map(|_| r.clone()))
                    // BTE streams straight from and into mapped memory.
                    .and_then(|r| r.is_mapped().then_some(r).ok_or(Status::Permission))
                {
                    Ok(r) => Some(r),
                    Err(s) => {
                        self.complete(session, c.client_req, s, 0);
                        return Flow::Done;
                    }
                }
            }
            _ => None,
        };
        let pending = |kind| Pending {
            session,
            client_req: c.client_req,
            host,
            kind,
        };
        match c.kind {
            // Served before any host routing (see the top of `command`).
            CommandKind::Portals => {}
            CommandKind::PutInline => {
                let max = OpRef::max_data(OpKind::Put, self.transport.body_capacity());
                let frags = inline.len().div_ceil(max).max(1);
                if self.transport.queued_space(host) < frags + 1 {
                    return Flow::Backpressure;
                }
                let req = self.initiator.start(pending(PendingKind::Put));
                let h = OpHeader { req, ..h };
                let mut off = 0;
                loop {
                    let n = (inline.len() - off).min(max);
                    let op = OpRef::Put {
                        h,
                        region: c.remote_region,
                        offset: c.remote_off + off as u64,
                        total_off: c.remote_off,
                        total_len: inline.len() as u64,
                        last: off + n == inline.len(),
                        lazy_ack: c.flags & CMD_IMPLICIT != 0,
                        data: &inline[off..off + n],
                    };
                    if let Err(e) = self.transport.push_op(host, &op) {
                        tracing::error!("push after reserving room failed: {e}");
                        if let Some(done) = self.initiator.complete(req, Status::PeerDead, 0) {
                            self.completions.push(done);
                        }
                        break;
                    }
                    off += n;
                    if off == inline.len() {
                        break;
                    }
                }
            }
            CommandKind::PutFrom => {
                let req = self.initiator.start(pending(PendingKind::Put));
                self.out[host as usize].push_back(OutItem::Stream(Stream {
                    kind: StreamKind::Put {
                        region: c.remote_region,
                        dst_off: c.remote_off,
                        lazy_ack: c.flags & CMD_IMPLICIT != 0,
                    },
                    h: OpHeader { req, ..h },
                    src: local.expect("checked above"),
                    src_off: c.local_off,
                    len: c.len,
                    sent: 0,
                    started: false,
                }));
            }
            CommandKind::Get => {
                let region = local.expect("checked above");
                let req = self.initiator.start(pending(PendingKind::Get {
                    region,
                    offset: c.local_off,
                    len: c.len,
                }));
                let op = OpRef::Get {
                    h: OpHeader { req, ..h },
                    region: c.remote_region,
                    offset: c.remote_off,
                    len: c.len,
                };
                self.push_or_fail(host, req, &op);
            }
            CommandKind::AmoScatter => {
                let amo = AmoOp::from_u8(c.amo).expect("decode checked the AMO");
                let max =
                    OpRef::max_data(OpKind::AmoScatter, self.transport.body_capacity()) / 16 * 16;
                let frags = inline.len().div_ceil(max).max(1);
                if self.transport.queued_space(host) < frags + 1 {
                    return Flow::Backpressure;
                }
                let req = self.initiator.start(pending(PendingKind::Amo));
                let h = OpHeader { req, ..h };
                let mut chunks = inline.chunks(max).peekable();
                loop {
                    let pairs = chunks.next().unwrap_or(&[]);
                    let last = chunks.peek().is_none();
                    let op = OpRef::AmoScatter {
                        h,
                        region: c.remote_region,
                        op: amo,
                        last,
                        pairs,
                    };
                    if self.transport.push_op(host, &op).is_err() {
                        if let Some(done) = self.initiator.complete(req, Status::PeerDead, 0) {
                            self.completions.push(done);
                        }
                        break;
                    }
                    if last {
                        break;
                    }
                }
            }
            CommandKind::Amo => {
                let amo = AmoOp::from_u8(c.amo).expect("decode checked the AMO");
                let req = self.initiator.start(pending(PendingKind::Amo));
                let op = OpRef::Amo {
                    h: OpHeader { req, ..h },
                    region: c.remote_region,
                    op: amo,
                    offset: c.remote_off,
                    operand: c.operand,
                    operand2: c.operand2,
                };
                self.push_or_fail(host, req, &op);
            }
        }
        Flow::Done
    }

    fn push_or_fail(&mut self, host: u16, req: u64, op: &OpRef<'_>) {
        if self.transport.push_op(host, op).is_err() {
            if let Some(done) = self.initiator.complete(req, Status::PeerDead, 0) {
                self.completions.push(done);
            }
        }
    }

    /// Executes a command whose target is on this host, without the network.
    fn local(&mut self, h: OpHeader, c: &Command, inline: &[u8]) -> (Status, u64) {
        let own = |eps: &Endpoints| {
            eps.region(h.job, h.src_rank, c.local_region)
                .and_then(|r| r.check_local(c.local_off, c.len).map(|_| r.clone()))
        };
        fn put<'a>(h: OpHeader, c: &Command, data: &'a [u8]) -> OpRef<'a> {
            OpRef::Put {
                h,
                region: c.remote_region,
                offset: c.remote_off,
                total_off: c.remote_off,
                total_len: data.len() as u64,
                last: true,
                lazy_ack: false,
                data,
            }
        }
        let action = match c.kind {
            CommandKind::Portals => return (Status::BadRequest, 0),
            CommandKind::PutInline => serve(&self.endpoints, &put(h, c, inline)),
            CommandKind::PutFrom => {
                let src = match own(&self.endpoints) {
                    Ok(r) => r,
                    Err(s) => return (s, 0),
                };
                match src.read(c.local_off, c.len as usize) {
                    Ok(data) => serve(&self.endpoints, &put(h, c, &data)),
                    Err(s) => return (s, 0),
                }
            }
            CommandKind::Get => {
                let dst = match own(&self.endpoints) {
                    Ok(r) => r,
                    Err(s) => return (s, 0),
                };
                match serve(
                    &self.endpoints,
                    &OpRef::Get {
                        h,
                        region: c.remote_region,
                        offset: c.remote_off,
                        len: c.len,
                    },
                ) {
                    TargetAction::StreamGet {
                        region,
                        offset,
                        len,
                        ..
                    } => {
                        let moved = region
                            .read(offset, len as usize)
                            .and_then(|d| dst.write(c.local_off, &d));
                        return (moved.err().unwrap_or(Status::Ok), 0);
                    }
                    other => other,
                }
            }
            CommandKind::AmoScatter => {
                let op = AmoOp::from_u8(c.amo).expect("decode checked the AMO");
                serve(
                    &self.endpoints,
                    &OpRef::AmoScatter {
                        h,
                        region: c.remote_region,
                        op,
                        last: true,
                        pairs: inline,
                    },
                )
            }
            CommandKind::Amo => {
                let op = AmoOp::from_u8(c.amo).expect("decode checked the AMO");
                serve(
                    &self.endpoints,
                    &OpRef::Amo {
                        h,
                        region: c.remote_region,
                        op,
                        offset: c.remote_off,
                        operand: c.operand,
                        operand2: c.operand2,
                    },
                )
            }
        };
        match action {
            TargetAction::Reply(Reply::PutAck { status, .. })
            | TargetAction::Reply(Reply::GetError { status, .. }) => (status, 0),
            TargetAction::Reply(Reply::AmoReply { status, value, .. }) => (status, value),
            _ => (Status::BadRequest, 0),
        }
    }

    // ------------------------------------------------------------------ network (target + replies)

    fn on_datagram(&mut self, now: u64, d: &[u8]) {
        let r = match self.transport.on_datagram(now, d) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(host = %self.name, "dropped datagram: {e}");
                return;
            }
        };
        let peer = r.peer;
        if let Some(body) = r.body {
            self.on_body(now, peer, body);
        }
        while let Some(b) = self.transport.take_ready(peer) {
            self.on_body(now, peer, &b);
            self.transport.give_back(b);
        }
    }

    fn on_body(&mut self, now: u64, peer: u16, body: &[u8]) {
        // Atomics a few ops ahead have their target words loaded while this one is served.
        let mut ahead = OpIter::new(body).skip(PREFETCH_AHEAD);
        for op in OpIter::new(body) {
            if let Some(Ok(next)) = ahead.next() {
                self.ptl_prefetch(&next);
            }
            match op {
                Ok(op) => self.on_op(now, peer, &op),
                Err(e) => {
                    self.stats.malformed_ops += 1;
                    tracing::warn!(host = %self.name, peer, "malformed op from an authenticated peer: {e}");
                }
            }
        }
        self.ptl_flush_acks();
    }

    fn on_op(&mut self, now: u64, peer: u16, op: &OpRef<'_>) {
        match op {
            OpRef::PtlReq { .. } | OpRef::PtlResp { .. } | OpRef::PtlAcks { .. } => {
                self.ptl_on_op(now, peer, op)
            }
            // Active Messages travel between udp-conduit processes, never to a daemon.
            OpRef::Am { .. } => self.stats.malformed_ops += 1,
            OpRef::Put { .. }
            | OpRef::Get { .. }
            | OpRef::Amo { .. }
            | OpRef::AmoScatter { .. } => {
                match op {
                    OpRef::Put { .. } => self.stats.served_put += 1,
                    OpRef::Get { .. } => self.stats.served_get += 1,
                    _ => self.stats.served_amo += 1,
                }
                match serve(&self.endpoints, op) {
                    TargetAction::None => {}
                    TargetAction::Reply(r) => self.send_reply(now, peer, r),
                    TargetAction::StreamGet {
                        h,
                        region,
                        offset,
                        len,
                    } => {
                        self.out[peer as usize].push_back(OutItem::Stream(Stream {
                            kind: StreamKind::GetReply,
                            h,
                            src: region,
                            src_off: offset,
                            len,
                            sent: 0,
                            started: false,
                        }));
                    }
                }
            }
            OpRef::PutAck { h, .. } | OpRef::GetReply { h, .. } | OpRef::AmoReply { h, .. } => {
                // Only the host we sent the request to may answer it.
                if self.initiator.get(h.req).is_some_and(|p| p.host == peer) {
                    if let Some(c) = self.initiator.on_reply(op) {
                        self.completions.push(c);
                    }
                }
            }
        }
    }

    fn send_reply(&mut self, now: u64, peer: u16, r: Reply) {
        if self.out[peer as usize].is_empty() {
            let pushed = match r {
                Reply::PutAck { lazy: true, .. } => {
                    self.transport.push_op_lazy(peer, &r.as_op(), now)
                }
                _ => self.transport.push_op(peer, &r.as_op()),
            };
            match pushed {
                Ok(()) => return,
                Err(PushError::Full(_)) => {}
                Err(_) => return, // a dead peer is not waiting for answers
            }
        }
        self.out[peer as usize].push_back(OutItem::Reply(r));
    }

    /// Moves queued replies and stream fragments into the transport while it has room.
    fn drain_out(&mut self, peer: u16) {
        let p = peer as usize;
        while let Some(item) = self.out[p].front_mut() {
            match item {
                OutItem::Encoded(b) => {
                    let pushed = match OpRef::decode(b) {
                        Ok((op, _)) => self.transport.push_op(peer, &op),
                        Err(_) => Ok(()), // our own encoding: cannot happen; drop it
                    };
                    match pushed {
                        Err(PushError::Full(_)) => return,
                        _ => {
                            self.out[p].pop_front();
                        }
                    }
                }
                OutItem::Reply(r) => match self.transport.push_op(peer, &r.as_op()) {
                    Err(PushError::Full(_)) => return,
                    _ => {
                        self.out[p].pop_front();
                    }
                },
                OutItem::Stream(st) => {
                    if matches!(st.kind, StreamKind::Put { .. })
                        && self.initiator.get(st.h.req).is_none()
                    {
                        self.out[p].pop_front(); // its operation was failed meanwhile
                        continue;
                    }
                    loop {
                        let kind = match st.kind {
                            StreamKind::Put { .. } => OpKind::Put,
                            StreamKind::GetReply => OpKind::GetReply,
                        };
                        let remaining = st.len - st.sent;
                        let room = OpRef::max_data(kind, self.transport.open_room(peer));
                        // Fill the open datagram, unless only a sliver is left in it.
                        let max = if room >= remaining as usize || room >= 1024 {
                            room
                        } else {
                            OpRef::max_data(kind, self.transport.body_capacity())
                        };
                        let n = (remaining as usize).min(max);
                        let last = st.sent + n as u64 == st.len;
                        let data = match st.src.read(st.src_off + st.sent, n) {
                            Ok(d) => d,
                            Err(s) => {
                                // Streams are mapped (checked at the command); never expected.
                                if let Some(c) = self.initiator.complete(st.h.req, s, 0) {
                                    self.completions.push(c);
                                }
                                break;
                            }
                        };
                        let op = match st.kind {
                            StreamKind::Put {
                                region,
                                dst_off,
                                lazy_ack,
                            } => OpRef::Put {
                                h: st.h,
                                region,
                                offset: dst_off + st.sent,
                                total_off: dst_off,
                                total_len: st.len,
                                last,
                                lazy_ack,
                                data: &data,
                            },
                            StreamKind::GetReply => OpRef::GetReply {
                                h: st.h,
                                status: Status::Ok,
                                frag_off: st.sent,
                                last,
                                data: &data,
                            },
                        };
                        match self.transport.push_op(peer, &op) {
                            Ok(()) => {
                                st.sent += n as u64;
                                st.started = true;
                                if last {
                                    break;
                                }
                            }
                            Err(PushError::Full(_)) => return,
                            Err(_) => {
                                if matches!(st.kind, StreamKind::Put { .. }) {
                                    let req = st.h.req;
                                    if let Some(c) =
                                        self.initiator.complete(req, Status::PeerDead, 0)
                                    {
                                        self.completions.push(c);
                                    }
                                }
                                break;
                            }
                        }
                    }
                    self.out[p].pop_front();
                }
            }
        }
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
                    tracing::warn!(host = %self.name, "accept failed: {e}");
                    break;
                }
            };
            let pid = match rustix::net::sockopt::get_socket_peercred(&fd) {
                Ok(c) if c.uid.as_raw() == self.uid || Some(c.gid.as_raw()) == self.allowed_gid => {
                    c.pid.as_raw_nonzero().get()
                }
                Ok(c) => {
                    self.stats.attach_refused += 1;
                    tracing::warn!(host = %self.name, "refusing attach from uid {} gid {}", c.uid.as_raw(), c.gid.as_raw());
                    let _ = attach::send(
                        fd.as_fd(),
                        &Response::Error(
                            "permission denied: the daemon's uid or allowed_gid only".into(),
                        )
                        .encode(),
                        &[],
                    );
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
                    self.detach(slot);
                    return false;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!(host = %self.name, "attach socket error: {e}");
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
            Request::Hello {
                job,
                job_key,
                rank,
                size,
            } => {
                if s.attached.is_some() {
                    return err("already attached".into());
                }
                if rank >= size {
                    return err(format!("rank {rank} is not below the job size {size}"));
                }
                if let Some((k, _)) = self.jobs.get(&job) {
                    if *k != job_key {
                        self.stats.attach_refused += 1;
                        return err(format!("wrong key for job {job}"));
                    }
                }
                if !self.endpoints.insert(job, rank, s.id) {
                    return err(format!(
                        "rank {rank} of job {job} is already attached to this host"
                    ));
                }
                let a = match Attached::new(job, rank) {
                    Ok(a) => a,
                    Err(e) => {
                        self.endpoints.remove(job, rank);
                        return err(format!("cannot create shared memory: {e}"));
                    }
                };
                a.control.set_nic_cpu(self.nic_cpu);
                self.jobs.entry(job).or_insert((job_key, 0)).1 += 1;
                let fds = vec![
                    a.control.mapping().fd().try_clone_to_owned(),
                    a.daemon_bell.try_clone(),
                    a.client_bell.try_clone(),
                ];
                *bell = Some(a.daemon_bell.as_raw_fd());
                let s = self.sessions[slot].as_mut().expect("live session");
                s.attached = Some(a);
                self.stats.clients_attached += 1;
                tracing::info!(host = %self.name, job, rank, "client attached");
                match fds.into_iter().collect::<io::Result<Vec<_>>>() {
                    Ok(f) => (
                        Response::HelloOk {
                            host: self.index,
                            nhosts: self.nhosts,
                        },
                        f,
                    ),
                    Err(e) => err(format!("dup failed: {e}")),
                }
            }
            Request::Register { perms } => {
                let Some(a) = s.attached.as_ref() else {
                    return err("register before hello".into());
                };
                let (job, rank) = (a.job, a.rank);
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
                match self
                    .endpoints
                    .register(job, rank, Region::new(Arc::new(map), Perms(perms)))
                {
                    Ok(region) => (Response::Registered { region }, Vec::new()),
                    Err(st) => err(format!("register failed: {st:?}")),
                }
            }
            Request::RegisterProcess { addr, len } => {
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
                // Local side only: no remote peer may name it.
                match self
                    .endpoints
                    .register(a.job, a.rank, Region::new(Arc::new(mem), Perms(0)))
                {
                    Ok(region) => (Response::Registered { region }, Vec::new()),
                    Err(st) => err(format!("register failed: {st:?}")),
                }
            }
            Request::Deregister { region } => {
                let Some(a) = s.attached.as_ref() else {
                    return err("deregister before hello".into());
                };
                match self.endpoints.deregister(a.job, a.rank, region) {
                    Ok(()) => (Response::Done, Vec::new()),
                    Err(st) => err(format!("deregister failed: {st:?}")),
                }
            }
        }
    }

    /// Drops a client: its memory becomes unreachable (remote ops get NoSuchEndpoint), its
    /// outstanding operations are forgotten, the daemon goes on serving the others.
    pub fn detach(&mut self, slot: usize) {
        let Some(s) = self.sessions.get_mut(slot).and_then(|s| s.take()) else {
            return;
        };
        self.initiator.drop_session(s.id);
        if let Some(a) = s.attached {
            self.portals.remove(&(a.job, a.rank));
            self.endpoints.remove(a.job, a.rank);
            if let Some(e) = self.jobs.get_mut(&a.job) {
                e.1 -= 1;
                if e.1 == 0 {
                    self.jobs.remove(&a.job);
                }
            }
            self.stats.clients_detached += 1;
            tracing::info!(host = %self.name, job = a.job, rank = a.rank, "client detached");
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
        pending || self.out.iter().any(|q| !q.is_empty())
    }

    pub fn stat_text(&self) -> String {
        let t = &self.transport.stats;
        let d = self.driver.stats();
        let s = &self.stats;
        let clients = self
            .sessions
            .iter()
            .flatten()
            .filter(|s| s.attached.is_some())
            .count();
        let out_depth: usize = self.out.iter().map(|q| q.len()).sum();
        let lines = [
            (
                "host",
                format!("{} (index {} of {})", self.name, self.index, self.nhosts),
            ),
            ("transport", self.driver.kind().name().to_string()),
            ("clients", clients.to_string()),
            ("packets_sent", t.datagrams_sent.to_string()),
            ("packets_received", t.datagrams_received.to_string()),
            ("bytes_sent", t.bytes_sent.to_string()),
            ("bytes_received", t.bytes_received.to_string()),
            ("retransmits", t.retransmits.to_string()),
            ("duplicates_suppressed", t.duplicates.to_string()),
            ("out_of_window", t.out_of_window.to_string()),
            ("acks_sent", t.acks_sent.to_string()),
            ("auth_failures", t.auth_failures.to_string()),
            ("malformed_datagrams", t.malformed.to_string()),
            ("malformed_ops", s.malformed_ops.to_string()),
            ("peers_declared_dead", t.peers_declared_dead.to_string()),
            ("fault_dropped", d.fault_dropped.to_string()),
            ("fault_duplicated", d.fault_duplicated.to_string()),
            ("send_would_block", d.send_would_block.to_string()),
            ("send_syscalls", d.send_syscalls.to_string()),
            ("recv_syscalls", d.recv_syscalls.to_string()),
            ("rx_bad_frames", d.rx_bad_frames.to_string()),
            ("gemini_put_issued", s.cmd_put.to_string()),
            ("gemini_get_issued", s.cmd_get.to_string()),
            ("gemini_amo_issued", s.cmd_amo.to_string()),
            ("gemini_put_served", s.served_put.to_string()),
            ("gemini_get_served", s.served_get.to_string()),
            ("gemini_amo_served", s.served_amo.to_string()),
            ("local_ops", s.local_ops.to_string()),
            ("bad_commands", s.bad_commands.to_string()),
            ("client_wakes", s.client_wakes.to_string()),
            ("clients_attached_total", s.clients_attached.to_string()),
            ("clients_detached_total", s.clients_detached.to_string()),
            ("attach_refused", s.attach_refused.to_string()),
            ("ops_outstanding", self.initiator.outstanding().to_string()),
            ("out_queue_depth", out_depth.to_string()),
        ];
        lines
            .iter()
            .map(|(k, v)| format!("{k:<24} {v}\n"))
            .collect()
    }
}

impl Drop for HostNic {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket_path);
    }
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
