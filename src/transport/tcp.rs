//! TCP driver: the same authenticated datagrams, length-prefixed on TCP streams.
//!
//! One connection per pair of hosts carries both directions, so TCP's acknowledgements ride on
//! the replies: with a one-way connection each way every message costs a pure ACK as well (a
//! C ping-pong between two namespaces over a veth: 3.4 µs half round trip on one connection,
//! 5.7 on two). The lower-numbered host dials and opens with a **hello** naming both hosts,
//! tagged (keyed BLAKE3) under the pair's datagram key; the other takes the connection as that
//! peer's only if the tag is right and it comes from the peer's configured address, and closes
//! it otherwise. A newer genuine connection (the peer restarted) replaces the old one, which is
//! still read until it closes. Every frame is a datagram the transport authenticates in turn,
//! so the reliable-delivery layer runs on top unchanged and semantics (ordering, exactly-once,
//! dead peers) are the same as over UDP; TCP's own reliability only makes retransmissions rare.
//! A broken connection is dialled again (at most every 100 ms); what it held is retransmitted
//! by the transport. A frame longer than the largest datagram closes its connection (hostile).
//!
//! A turn's frames are written together at its flush, and read in large pieces into a buffer
//! they are handed out from in place: no system call per frame either way.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Registry, Token};

use super::fault::FaultInjector;
use super::udp::DriverStats;
use crate::config::Fault;
use crate::wire::Keys;

/// Largest frame accepted (the largest UDP payload).
const MAX_FRAME: usize = 65_507;
/// The datagram size over TCP, whatever `cluster.mtu` says: the kernel cuts the stream to the
/// path's MTU (in hardware where the NIC segments), so frames need not fit a packet, and every
/// frame costs a seal, a sequence number and an acknowledgement. Two namespaces over a
/// 1500-byte veth, gni put_nbi 1 MiB: 1.2–2.4 GB/s in 1472-byte frames, 3.1–5.0 in these.
pub const FRAME: usize = 65_000;
/// Bytes buffered for one peer before further datagrams are dropped (the transport resends).
pub const MAX_BUFFERED: usize = 16 << 20;
/// Bytes queued for one peer that are written at once rather than at the turn's flush: a turn
/// producing a burst writes it in pieces of this size, not one system call per frame.
const WRITE_AT: usize = 256 << 10;
/// A connection's receive buffer: several of the largest frames per read.
const RECV_BUF: usize = 256 << 10;
const RECONNECT_EVERY: Duration = Duration::from_millis(100);
/// How often the listener is asked for new connections.
const ACCEPT_EVERY: Duration = Duration::from_millis(2);
/// How long an accepted connection may take to send its hello.
const HELLO_WITHIN: Duration = Duration::from_secs(5);

/// The hello: `magic u32 | dialer u16 | acceptor u16 | nonce [16] | tag [32]`, the tag a keyed
/// BLAKE3 of the 24 bytes before it.
const HELLO_MAGIC: u32 = 0x4854_4e53; // "SNTH"
const HELLO_LEN: usize = 56;
const HELLO_SIGNED: usize = 24;

/// The key hellos between this host and one peer are tagged with, from their datagram key.
fn hello_key(datagram_key: &[u8; 32]) -> [u8; 32] {
    blake3::derive_key("softnic 2026-11 tcp connection hello", datagram_key)
}

fn hello(key: &[u8; 32], dialer: u16, acceptor: u16) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&dialer.to_le_bytes());
    h[6..8].copy_from_slice(&acceptor.to_le_bytes());
    h[8..HELLO_SIGNED].copy_from_slice(&rand::random::<[u8; 16]>());
    let tag = blake3::keyed_hash(key, &h[..HELLO_SIGNED]);
    h[HELLO_SIGNED..].copy_from_slice(tag.as_bytes());
    h
}

/// One TCP connection's receiving side: `buf[start..end]` holds bytes read and not yet handed
/// out. Allocated (and zeroed) once, when the first bytes come (a connection that sends
/// nothing holds none); frames are handed out where they lie.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    closed: bool,
}

/// What the next bytes of a connection hold.
enum Next {
    Frame(usize, usize),
    Hostile,
    More,
}

impl Conn {
    fn new(stream: TcpStream) -> Conn {
        Conn {
            stream,
            buf: Vec::new(),
            start: 0,
            end: 0,
            closed: false,
        }
    }

    fn avail(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// The next complete frame's range in `buf`, if one is there.
    fn frame(&self) -> Next {
        let avail = self.avail();
        if avail.len() < 4 {
            return Next::More;
        }
        let len = u32::from_le_bytes(avail[..4].try_into().expect("4 bytes")) as usize;
        if len > MAX_FRAME {
            return Next::Hostile;
        }
        if avail.len() < 4 + len {
            return Next::More;
        }
        Next::Frame(self.start + 4, len)
    }

    /// Takes `n` bytes handed out.
    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
    }

    /// Reads what the socket has (room for a whole frame behind what is there first); `false`
    /// when nothing came, the connection then marked closed if it ended or broke. A connection
    /// that sent nothing yet is read with a small buffer first, so one that never sends holds
    /// no large one.
    fn fill(&mut self, stats: &mut DriverStats) -> bool {
        stats.recv_syscalls += 1;
        let got = if self.buf.is_empty() {
            let mut first = [0u8; 4096];
            let got = self.stream.read(&mut first);
            if let Ok(n @ 1..) = got {
                self.buf = vec![0; RECV_BUF];
                self.buf[..n].copy_from_slice(&first[..n]);
            }
            got
        } else {
            if self.buf.len() - self.end < MAX_FRAME + 4 {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            self.stream.read(&mut self.buf[self.end..])
        };
        match got {
            Ok(0) => {
                self.closed = true;
                false
            }
            Ok(n) => {
                self.end += n;
                true
            }
            Err(e) => {
                if !matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) {
                    self.closed = true;
                }
                false
            }
        }
    }
}

/// One peer: its connection and the frames waiting for it.
struct Peer {
    addr: SocketAddr,
    /// This host dials it (its index is higher); else it dials this host.
    dials: bool,
    hello_key: [u8; 32],
    conn: Option<Conn>,
    /// Frames queued; `out[sent..]` is not yet written.
    out: Vec<u8>,
    sent: usize,
    last_attempt: Option<Instant>,
}

impl Peer {
    fn pending(&self) -> usize {
        self.out.len() - self.sent
    }

    /// Drops what is written and the rest of a frame written in part (its connection is
    /// being replaced): what is left are whole frames for the next connection.
    fn realign(&mut self) {
        let mut at = 0;
        while at < self.sent {
            let len = u32::from_le_bytes(self.out[at..at + 4].try_into().expect("4 bytes"));
            at += 4 + len as usize;
        }
        self.out.drain(..at.min(self.out.len()));
        self.sent = 0;
    }
}

/// A connection not (or no longer) a peer's: accepted and waiting for its hello, or replaced
/// by a newer one from the same peer and read until it closes.
struct Spare {
    conn: Conn,
    /// `None` once its hello was taken.
    hello_by: Option<Instant>,
}

pub struct TcpDriver {
    /// The listening address: dialled connections leave from its IP (and `device`).
    local: SocketAddr,
    me: u16,
    device: Option<String>,
    /// When the listener was last asked for new connections.
    last_accept: Option<Instant>,
    listener: TcpListener,
    registry: Registry,
    token: Token,
    peers: Vec<Option<Peer>>,
    spare: Vec<Spare>,
    next: usize,
    fault: Option<FaultInjector>,
    pub stats: DriverStats,
}

/// Starts a non-blocking connection to `peer` from `local`'s IP, pinned to `device`.
fn connect(local: SocketAddr, device: Option<&str>, peer: SocketAddr) -> io::Result<TcpStream> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(peer),
        socket2::Type::STREAM,
        None,
    )?;
    s.set_nonblocking(true)?;
    super::iface::pin(&s, device)?;
    if !local.ip().is_unspecified() {
        s.bind(&SocketAddr::new(local.ip(), 0).into())?;
    }
    match s.connect(&peer.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(TcpStream::from_std(s.into()))
}

impl TcpDriver {
    /// Listens on `addr` (pinned to interface `device`, if given; dialled connections too),
    /// which is one of `peers` (this host's index); hellos are tagged under `keys`. Registers
    /// everything it opens with `registry` under `token`.
    pub fn bind(
        addr: SocketAddr,
        device: Option<&str>,
        peers: Vec<SocketAddr>,
        keys: &Keys,
        fault: Option<Fault>,
        registry: Registry,
        token: Token,
    ) -> io::Result<TcpDriver> {
        let me = peers.iter().position(|p| *p == addr).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{addr} is no host's address"),
            )
        })? as u16;
        let s = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            None,
        )?;
        s.set_reuse_address(true)?;
        s.set_nonblocking(true)?;
        super::iface::pin(&s, device)?;
        s.bind(&addr.into())?;
        s.listen(128)?;
        let mut listener = TcpListener::from_std(s.into());
        registry.register(&mut listener, token, Interest::READABLE)?;
        let peers = peers
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                if i == me as usize {
                    return Ok(None);
                }
                let key = keys.for_peer(i as u16).ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, format!("no key for host {i}"))
                })?;
                Ok(Some(Peer {
                    addr: p,
                    dials: (me as usize) < i,
                    hello_key: hello_key(&key.0),
                    conn: None,
                    out: Vec::new(),
                    sent: 0,
                    last_attempt: None,
                }))
            })
            .collect::<io::Result<_>>()?;
        let fault = FaultInjector::new(fault, addr.port() as u64 ^ 0x7cb);
        Ok(TcpDriver {
            local: addr,
            me,
            device: device.map(str::to_string),
            last_accept: None,
            listener,
            registry,
            token,
            peers,
            spare: Vec::new(),
            next: 0,
            fault,
            stats: DriverStats::default(),
        })
    }

    /// Queues one datagram for host `to`; it is written at the turn's [`TcpDriver::flush`]
    /// (with the others of the turn: one system call for many frames), or at once when a
    /// burst has queued [`WRITE_AT`] bytes.
    pub fn send(&mut self, to: u16, bytes: &[u8]) {
        let copies = self.fault.as_mut().map_or(1, |f| f.copies(&mut self.stats));
        let Some(Some(p)) = self.peers.get_mut(to as usize) else {
            return;
        };
        if p.pending() + bytes.len() + 4 > MAX_BUFFERED {
            self.stats.send_would_block += 1;
            return;
        }
        for _ in 0..copies {
            p.out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            p.out.extend_from_slice(bytes);
        }
        if p.pending() >= WRITE_AT {
            self.flush_one(to as usize);
        }
    }

    /// Writes what is queued for every peer, dialling those this host dials and has no
    /// connection to (call once per turn).
    pub fn flush(&mut self) {
        for i in 0..self.peers.len() {
            if self.peers[i]
                .as_ref()
                .is_some_and(|p| p.pending() > 0 || (p.dials && p.conn.is_none()))
            {
                self.flush_one(i);
            }
        }
    }

    fn flush_one(&mut self, i: usize) {
        let Some(p) = self.peers[i].as_mut() else {
            return;
        };
        if p.conn.is_none() {
            if !p.dials
                || p.last_attempt
                    .is_some_and(|t| t.elapsed() < RECONNECT_EVERY)
            {
                return; // the peer dials this host: its frames wait for the connection
            }
            p.last_attempt = Some(Instant::now());
            match connect(self.local, self.device.as_deref(), p.addr) {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    if self
                        .registry
                        .register(&mut s, self.token, Interest::READABLE | Interest::WRITABLE)
                        .is_ok()
                    {
                        p.conn = Some(Conn::new(s));
                        let h = hello(&p.hello_key, self.me, i as u16);
                        p.out.splice(0..0, h);
                    }
                }
                Err(e) => {
                    self.stats.send_errors += 1;
                    tracing::debug!("connect to {} failed: {e}", p.addr);
                    return;
                }
            }
        }
        let Some(c) = p.conn.as_mut() else { return };
        while p.sent < p.out.len() {
            self.stats.send_syscalls += 1;
            match c.stream.write(&p.out[p.sent..]) {
                Ok(0) => break,
                Ok(n) => p.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Broken (peer restarted, refused while connecting): drop and dial again
                    // later (or wait to be dialled); the transport retransmits what was lost.
                    tracing::debug!("connection to {} broke: {e}", p.addr);
                    let _ = self.registry.deregister(&mut c.stream);
                    p.conn = None;
                    p.out.clear();
                    p.sent = 0;
                    self.stats.send_errors += 1;
                    return;
                }
            }
        }
        // Written bytes go: all at once when everything left, else once they are many.
        if p.sent == p.out.len() {
            p.out.clear();
            p.sent = 0;
        } else if p.sent >= MAX_BUFFERED / 4 {
            p.out.drain(..p.sent);
            p.sent = 0;
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut s, _)) => {
                    // Each peer needs one, two across its restart; more are someone else's
                    // (and would each hold a receive buffer): closed at once.
                    if self.spare.len() >= 2 * self.peers.len() + 8 {
                        self.stats.refused_connections += 1;
                        continue;
                    }
                    let _ = s.set_nodelay(true);
                    if self
                        .registry
                        .register(&mut s, self.token, Interest::READABLE | Interest::WRITABLE)
                        .is_ok()
                    {
                        self.spare.push(Spare {
                            conn: Conn::new(s),
                            hello_by: Some(Instant::now() + HELLO_WITHIN),
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("TCP accept failed: {e}");
                    return;
                }
            }
        }
    }

    /// The peer a hello at the front of `c` proves the connection to be from, if it does.
    fn hello_from(&self, c: &Conn) -> Option<u16> {
        let h = c.avail().get(..HELLO_LEN)?;
        let word = |at: usize| u16::from_le_bytes([h[at], h[at + 1]]);
        let (dialer, acceptor) = (word(4), word(6));
        let p = self.peers.get(dialer as usize)?.as_ref()?;
        let genuine = u32::from_le_bytes(h[..4].try_into().ok()?) == HELLO_MAGIC
            && acceptor == self.me
            && !p.dials
            && c.stream.peer_addr().ok()?.ip() == p.addr.ip()
            // Constant time: blake3's Hash compares so.
            && blake3::keyed_hash(&p.hello_key, &h[..HELLO_SIGNED])
                == blake3::Hash::from_bytes(h[HELLO_SIGNED..].try_into().ok()?);
        genuine.then_some(dialer)
    }

    /// Looks at the accepted connections still owing their hello: a genuine one becomes its
    /// peer's connection; a false one, or one too slow, is closed.
    fn take_hellos(&mut self) {
        let now = Instant::now();
        let mut k = 0;
        while k < self.spare.len() {
            let Some(by) = self.spare[k].hello_by else {
                k += 1;
                continue;
            };
            let s = &mut self.spare[k];
            while s.conn.avail().len() < HELLO_LEN && s.conn.fill(&mut self.stats) {}
            if s.conn.avail().len() < HELLO_LEN {
                if now > by {
                    s.conn.closed = true;
                }
                k += 1;
                continue;
            }
            match self.hello_from(&self.spare[k].conn) {
                Some(j) => {
                    let mut s = self.spare.swap_remove(k);
                    s.conn.consume(HELLO_LEN);
                    let p = self.peers[j as usize]
                        .as_mut()
                        .expect("checked by hello_from");
                    if let Some(old) = p.conn.replace(s.conn) {
                        // The peer dialled again: the old connection is read until it closes.
                        p.realign();
                        self.spare.push(Spare {
                            conn: old,
                            hello_by: None,
                        });
                    }
                }
                None => {
                    tracing::warn!("closing a TCP connection whose hello is not a peer's");
                    self.stats.rx_bad_frames += 1;
                    self.spare[k].conn.closed = true;
                    k += 1;
                }
            }
        }
    }

    /// Hands the next complete datagram to `f` where it lies in its connection's buffer;
    /// `false` once everything is drained.
    pub fn recv_with(&mut self, f: &mut dyn FnMut(&mut [u8])) -> bool {
        // New connections are rare (one per peer, again after a restart) and an empty
        // `accept` is dear (the kernel makes and frees a socket file: ~5 µs here, which put
        // every round trip at 3× UDP's), so the listener is asked every few milliseconds.
        // Hellos are looked for as often (a silent connection costs a read each time).
        if self.last_accept.is_none_or(|t| t.elapsed() >= ACCEPT_EVERY) {
            self.accept();
            self.last_accept = Some(Instant::now());
            if self.spare.iter().any(|s| s.hello_by.is_some()) {
                self.take_hellos();
            }
        }
        let (np, ns) = (self.peers.len(), self.spare.len());
        for k in 0..np + ns {
            let i = (self.next + k) % (np + ns);
            let c = if i < np {
                self.peers[i].as_mut().and_then(|p| p.conn.as_mut())
            } else {
                Some(&mut self.spare[i - np])
                    .filter(|s| s.hello_by.is_none())
                    .map(|s| &mut s.conn)
            };
            let Some(c) = c else { continue };
            if let Some((at, len)) = next_frame(c, &mut self.stats) {
                self.next = i;
                f(&mut c.buf[at..at + len]);
                c.consume(4 + len);
                return true;
            }
        }
        self.close_ended();
        false
    }

    /// Forgets connections that ended or were closed as hostile; a peer's own one is dialled
    /// again (or waited for).
    fn close_ended(&mut self) {
        for p in self.peers.iter_mut().flatten() {
            if p.conn.as_ref().is_some_and(|c| c.closed) {
                if let Some(mut c) = p.conn.take() {
                    let _ = self.registry.deregister(&mut c.stream);
                }
                p.out.clear();
                p.sent = 0;
            }
        }
        let registry = &self.registry;
        self.spare.retain_mut(|s| {
            if s.conn.closed {
                let _ = registry.deregister(&mut s.conn.stream);
            }
            !s.conn.closed
        });
    }
}

/// Where the next complete frame of `c` lies, reading more if needed; `None` when none is
/// there yet (or the connection ended, or sent a frame longer than any datagram: then closed).
fn next_frame(c: &mut Conn, stats: &mut DriverStats) -> Option<(usize, usize)> {
    if c.closed {
        return None;
    }
    loop {
        match c.frame() {
            Next::Frame(at, len) => return Some((at, len)),
            Next::Hostile => {
                tracing::warn!("closing a TCP connection that sent an oversized frame");
                stats.rx_bad_frames += 1;
                c.closed = true;
                return None;
            }
            Next::More => {
                if !c.fill(stats) {
                    return None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Key;
    use std::io::Write;

    const KEY: Key = Key([7; 32]);

    /// Two drivers on loopback ports the kernel just handed out (retried if taken meanwhile).
    fn pair(poll: &mio::Poll) -> (TcpDriver, TcpDriver) {
        for _ in 0..20 {
            let free = || {
                let s = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                s.local_addr().unwrap()
            };
            let peers = vec![free(), free()];
            let bind = |a| {
                let r = poll.registry().try_clone().unwrap();
                TcpDriver::bind(a, None, peers.clone(), &KEY.into(), None, r, Token(0))
            };
            if let (Ok(a), Ok(b)) = (bind(peers[0]), bind(peers[1])) {
                return (a, b);
            }
        }
        panic!("no two free loopback ports");
    }

    fn frame(i: usize, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i * 31 + j) as u8).collect()
    }

    /// Moves frames from `from` to `to` until `want` arrived (or 10 s passed).
    fn exchange(
        from: &mut TcpDriver,
        to: &mut TcpDriver,
        dest: u16,
        lens: &[usize],
    ) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        let t = Instant::now();
        let mut next = 0;
        while got.len() < lens.len() && t.elapsed() < Duration::from_secs(10) {
            // A turn: ten frames, then the flush.
            for _ in 0..10 {
                if next < lens.len() {
                    from.send(dest, &frame(next, lens[next]));
                    next += 1;
                }
            }
            from.flush();
            to.flush();
            while to.recv_with(&mut |d| got.push(d.to_vec())) {}
            while from.recv_with(&mut |_| panic!("nothing comes back")) {}
        }
        got
    }

    /// Frames of every size up to the largest arrive once, whole and in order, both ways over
    /// the one connection of the pair, however the stream cut them; a turn's frames leave in
    /// few writes, not one each.
    #[test]
    fn frames_arrive_whole_and_in_order_both_ways_on_one_connection() {
        let poll = mio::Poll::new().unwrap();
        let (mut a, mut b) = pair(&poll);
        let lens: Vec<usize> = (0..400)
            .map(|i| match i % 5 {
                0 => FRAME,
                1 => 1,
                2 => 1472,
                3 => 64_001 - i,
                _ => 300 + i,
            })
            .collect();
        // The acceptor first: its frames wait until the dialler's connection is there.
        let check = |from: &TcpDriver, got: Vec<Vec<u8>>| {
            assert_eq!(got.len(), lens.len(), "every frame arrives");
            for (i, (d, &len)) in got.iter().zip(&lens).enumerate() {
                assert!(
                    d == &frame(i, len),
                    "frame {i} ({len} B) whole and in order"
                );
            }
            assert!(
                from.stats.send_syscalls < lens.len() as u64 / 4,
                "{} writes for {} frames",
                from.stats.send_syscalls,
                lens.len()
            );
        };
        let got = exchange(&mut b, &mut a, 0, &lens);
        check(&b, got);
        let got = exchange(&mut a, &mut b, 1, &lens);
        check(&a, got);
        assert_eq!(
            (a.spare.len(), b.spare.len()),
            (0, 0),
            "one connection, taken"
        );
        assert!(a.peers[1].as_ref().unwrap().conn.is_some());
        assert!(b.peers[0].as_ref().unwrap().conn.is_some());
    }

    /// Connects to `d` as a peer would and sends `bytes`.
    fn dial(d: &TcpDriver, bytes: &[u8]) -> std::net::TcpStream {
        let mut s = std::net::TcpStream::connect(d.local).unwrap();
        s.write_all(bytes).unwrap();
        s
    }

    /// Turns of `d` until `done` (or 5 s).
    fn turns(d: &mut TcpDriver, mut done: impl FnMut(&TcpDriver) -> bool) {
        let t = Instant::now();
        while !done(d) && t.elapsed() < Duration::from_secs(5) {
            while d.recv_with(&mut |_| {}) {}
            std::thread::sleep(ACCEPT_EVERY);
        }
    }

    /// A hello under another key, naming another acceptor, or from the host that should be
    /// dialled instead closes the connection (counted); a genuine one from the peer's address
    /// is taken, and a second genuine one replaces it (the peer restarted).
    #[test]
    fn only_a_genuine_hello_from_a_lower_peer_is_taken() {
        let poll = mio::Poll::new().unwrap();
        let (mut a, mut b) = pair(&poll);
        let key = hello_key(&KEY.0);
        let _c = [
            dial(&b, &hello(&hello_key(&[8; 32]), 0, 1)),
            dial(&b, &hello(&key, 0, 0)),
            dial(&a, &hello(&key, 1, 0)),
            dial(&b, &[0x42; HELLO_LEN]),
        ];
        turns(&mut b, |d| d.stats.rx_bad_frames == 3);
        turns(&mut a, |d| d.stats.rx_bad_frames == 1);
        assert_eq!((a.stats.rx_bad_frames, b.stats.rx_bad_frames), (1, 3));
        assert!(b.peers[0].as_ref().unwrap().conn.is_none());
        // Genuine (the test runs on the peers' address): taken, then replaced.
        let mut first = dial(&b, &hello(&key, 0, 1));
        turns(&mut b, |d| d.peers[0].as_ref().unwrap().conn.is_some());
        assert!(b.peers[0].as_ref().unwrap().conn.is_some());
        let mut second = dial(&b, &hello(&key, 0, 1));
        turns(&mut b, |d| d.spare.iter().any(|s| s.hello_by.is_none()));
        assert_eq!(b.spare.len(), 1, "the first is kept, read until it closes");
        // Both are read; b answers on the second.
        for (s, v) in [(&mut first, 1u8), (&mut second, 2)] {
            s.write_all(&3u32.to_le_bytes()).unwrap();
            s.write_all(&[v; 3]).unwrap();
        }
        let mut got = Vec::new();
        let t = Instant::now();
        while got.len() < 2 && t.elapsed() < Duration::from_secs(5) {
            while b.recv_with(&mut |d| got.push(d[0])) {}
        }
        got.sort();
        assert_eq!(got, [1, 2]);
        b.send(0, &[9; 5]);
        b.flush();
        let mut back = [0u8; 9];
        second
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        second.read_exact(&mut back).unwrap();
        assert_eq!(back, [5, 0, 0, 0, 9, 9, 9, 9, 9]);
        drop(a);
    }

    /// A frame longer than any datagram closes the connection it came on (and is counted).
    #[test]
    fn an_oversized_frame_closes_its_connection() {
        let poll = mio::Poll::new().unwrap();
        let (_a, mut b) = pair(&poll);
        let mut s = dial(&b, &hello(&hello_key(&KEY.0), 0, 1));
        s.write_all(&(MAX_FRAME as u32 + 1).to_le_bytes()).unwrap();
        turns(&mut b, |d| d.stats.rx_bad_frames > 0);
        assert_eq!(b.stats.rx_bad_frames, 1);
        assert!(
            b.peers[0].as_ref().unwrap().conn.is_none(),
            "the connection is gone"
        );
    }

    /// Connections beyond what the peers could need are closed as accepted; the ones kept
    /// hold no receive buffer until they send something.
    #[test]
    fn idle_connections_cost_nothing_and_extra_ones_are_refused() {
        let poll = mio::Poll::new().unwrap();
        let (_a, mut b) = pair(&poll);
        let cap = 2 * b.peers.len() + 8;
        let conns: Vec<_> = (0..cap + 5).map(|_| dial(&b, &[])).collect();
        turns(&mut b, |d| d.stats.refused_connections >= 5);
        assert_eq!((b.spare.len(), b.stats.refused_connections), (cap, 5));
        assert!(
            b.spare.iter().all(|c| c.conn.buf.is_empty()),
            "no buffer before data"
        );
        drop(conns);
    }
}
