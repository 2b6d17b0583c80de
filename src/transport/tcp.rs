//! TCP driver: the same authenticated datagrams, length-prefixed on TCP streams.
//!
//! Each host listens on its configured address and opens one outgoing connection to each peer,
//! used only to send; accepted connections are used only to receive. No connection needs to be
//! identified: every frame is a datagram whose header names its sender and whose tag proves it.
//! The reliable-delivery layer runs on top unchanged, so semantics (ordering, exactly-once,
//! dead peers) are the same as over UDP; TCP's own reliability only makes retransmissions rare.
//! A broken outgoing connection is reopened (at most every 100 ms); what it held is retransmitted
//! by the transport. A frame longer than the largest datagram closes that connection (hostile).
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
/// An accepted connection's receive buffer: several of the largest frames per read.
const RECV_BUF: usize = 256 << 10;
const RECONNECT_EVERY: Duration = Duration::from_millis(100);
/// How often the listener is asked for new connections.
const ACCEPT_EVERY: Duration = Duration::from_millis(2);

struct Outgoing {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    /// Frames queued; `buf[sent..]` is not yet written.
    buf: Vec<u8>,
    sent: usize,
    last_attempt: Option<Instant>,
}

impl Outgoing {
    fn pending(&self) -> usize {
        self.buf.len() - self.sent
    }
}

/// One accepted connection's receive buffer: `buf[start..end]` holds bytes read and not yet
/// handed out. Allocated (and zeroed) once, when the first bytes come (a connection that
/// sends nothing holds none); frames are handed out where they lie.
struct Incoming {
    stream: TcpStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    closed: bool,
}

impl Incoming {
    /// The next complete frame's range in `buf`, if one is there; `Err` for a hostile length.
    fn frame(&self) -> Result<Option<(usize, usize)>, ()> {
        let avail = &self.buf[self.start..self.end];
        if avail.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes(avail[..4].try_into().expect("4 bytes")) as usize;
        if len > MAX_FRAME {
            return Err(());
        }
        if avail.len() < 4 + len {
            return Ok(None);
        }
        Ok(Some((self.start + 4, len)))
    }
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

pub struct TcpDriver {
    /// The listening address: outgoing connections leave from its IP (and `device`).
    local: SocketAddr,
    device: Option<String>,
    /// When the listener was last asked for new connections.
    last_accept: Option<Instant>,
    listener: TcpListener,
    registry: Registry,
    token: Token,
    out: Vec<Option<Outgoing>>,
    inc: Vec<Incoming>,
    next_inc: usize,
    fault: Option<FaultInjector>,
    pub stats: DriverStats,
}

impl TcpDriver {
    /// Listens on `addr`; registers everything it opens with `registry` under `token`.
    /// Listens on `addr` (pinned to interface `device`, if given; outgoing connections too).
    pub fn bind(
        addr: SocketAddr,
        device: Option<&str>,
        peers: Vec<SocketAddr>,
        fault: Option<Fault>,
        registry: Registry,
        token: Token,
    ) -> io::Result<TcpDriver> {
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
        let out = peers
            .into_iter()
            .map(|p| {
                (p != addr).then(|| Outgoing {
                    addr: p,
                    stream: None,
                    buf: Vec::new(),
                    sent: 0,
                    last_attempt: None,
                })
            })
            .collect();
        let fault = FaultInjector::new(fault, addr.port() as u64 ^ 0x7cb);
        Ok(TcpDriver {
            local: addr,
            device: device.map(str::to_string),
            last_accept: None,
            listener,
            registry,
            token,
            out,
            inc: Vec::new(),
            next_inc: 0,
            fault,
            stats: DriverStats::default(),
        })
    }

    /// Queues one datagram for host `to`; it is written at the turn's [`TcpDriver::flush`]
    /// (with the others of the turn: one system call for many frames), or at once when a
    /// burst has queued [`WRITE_AT`] bytes.
    pub fn send(&mut self, to: u16, bytes: &[u8]) {
        let copies = self.fault.as_mut().map_or(1, |f| f.copies(&mut self.stats));
        let Some(Some(o)) = self.out.get_mut(to as usize) else {
            return;
        };
        if o.pending() + bytes.len() + 4 > MAX_BUFFERED {
            self.stats.send_would_block += 1;
            return;
        }
        for _ in 0..copies {
            o.buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            o.buf.extend_from_slice(bytes);
        }
        if o.pending() >= WRITE_AT {
            self.flush_one(to as usize);
        }
    }

    /// Writes buffered bytes of every outgoing connection (call once per turn).
    pub fn flush(&mut self) {
        for i in 0..self.out.len() {
            if self.out[i].as_ref().is_some_and(|o| !o.buf.is_empty()) {
                self.flush_one(i);
            }
        }
    }

    fn flush_one(&mut self, i: usize) {
        let Some(o) = self.out[i].as_mut() else {
            return;
        };
        if o.stream.is_none() {
            if o.last_attempt
                .is_some_and(|t| t.elapsed() < RECONNECT_EVERY)
            {
                return;
            }
            o.last_attempt = Some(Instant::now());
            match connect(self.local, self.device.as_deref(), o.addr) {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    if self
                        .registry
                        .register(&mut s, self.token, Interest::WRITABLE)
                        .is_ok()
                    {
                        o.stream = Some(s);
                    }
                }
                Err(e) => {
                    self.stats.send_errors += 1;
                    tracing::debug!("connect to {} failed: {e}", o.addr);
                    return;
                }
            }
        }
        let Some(s) = o.stream.as_mut() else { return };
        while o.sent < o.buf.len() {
            self.stats.send_syscalls += 1;
            match s.write(&o.buf[o.sent..]) {
                Ok(0) => break,
                Ok(n) => o.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Broken (peer restarted, refused while connecting): drop and reconnect later;
                    // the transport retransmits what was lost with it.
                    tracing::debug!("connection to {} broke: {e}", o.addr);
                    let _ = self.registry.deregister(s);
                    o.stream = None;
                    o.buf.clear();
                    o.sent = 0;
                    self.stats.send_errors += 1;
                    return;
                }
            }
        }
        // Written bytes go: all at once when everything left, else once they are many.
        if o.sent == o.buf.len() {
            o.buf.clear();
            o.sent = 0;
        } else if o.sent >= MAX_BUFFERED / 4 {
            o.buf.drain(..o.sent);
            o.sent = 0;
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut s, _)) => {
                    // Each peer needs one, two across its restart; more are someone else's
                    // (and would each hold a receive buffer): closed at once.
                    if self.inc.len() >= 2 * self.out.len() + 8 {
                        self.stats.refused_connections += 1;
                        continue;
                    }
                    let _ = s.set_nodelay(true);
                    if self
                        .registry
                        .register(&mut s, self.token, Interest::READABLE)
                        .is_ok()
                    {
                        self.inc.push(Incoming {
                            stream: s,
                            buf: Vec::new(),
                            start: 0,
                            end: 0,
                            closed: false,
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

    /// Hands the next complete datagram to `f` where it lies in its connection's buffer;
    /// `false` once everything is drained.
    pub fn recv_with(&mut self, f: &mut dyn FnMut(&mut [u8])) -> bool {
        // New connections are rare (one per peer, again after a restart) and an empty
        // `accept` is dear (the kernel makes and frees a socket file: ~5 µs here, which put
        // every round trip at 3× UDP's), so the listener is asked every few milliseconds.
        if self.last_accept.is_none_or(|t| t.elapsed() >= ACCEPT_EVERY) {
            self.accept();
            self.last_accept = Some(Instant::now());
        }
        let n = self.inc.len();
        for k in 0..n {
            let i = (self.next_inc + k) % n;
            if let Some((at, len)) = self.next_frame(i) {
                self.next_inc = i;
                let c = &mut self.inc[i];
                f(&mut c.buf[at..at + len]);
                c.start = at + len;
                if c.start == c.end {
                    (c.start, c.end) = (0, 0);
                }
                return true;
            }
        }
        // Drop closed connections.
        self.inc.retain(|c| !c.closed);
        false
    }

    /// The next received datagram copied into `out` (truncated to it), if one is complete;
    /// `None` once everything is drained.
    pub fn recv(&mut self, out: &mut [u8]) -> Option<usize> {
        let mut got = None;
        self.recv_with(&mut |d| {
            let n = d.len().min(out.len());
            out[..n].copy_from_slice(&d[..n]);
            got = Some(n);
        });
        got
    }

    /// Where the next complete frame of connection `i` lies, reading more if needed.
    fn next_frame(&mut self, i: usize) -> Option<(usize, usize)> {
        let c = &mut self.inc[i];
        if c.closed {
            return None;
        }
        loop {
            match c.frame() {
                Ok(Some(f)) => return Some(f),
                Ok(None) => {}
                Err(()) => {
                    tracing::warn!("closing a TCP connection that sent an oversized frame");
                    self.stats.rx_bad_frames += 1;
                    let _ = self.registry.deregister(&mut c.stream);
                    c.closed = true;
                    return None;
                }
            }
            // Need more bytes: make room for a whole frame behind what is there, then read. A
            // connection that sent nothing yet is read with a small buffer first, so one that
            // never sends holds no large one.
            let mut first = [0u8; 4096];
            let fresh = c.buf.is_empty();
            if !fresh && c.buf.len() - c.end < MAX_FRAME + 4 {
                c.buf.copy_within(c.start..c.end, 0);
                (c.start, c.end) = (0, c.end - c.start);
            }
            let into: &mut [u8] = if fresh {
                &mut first
            } else {
                &mut c.buf[c.end..]
            };
            self.stats.recv_syscalls += 1;
            match c.stream.read(into) {
                Ok(0) => {
                    let _ = self.registry.deregister(&mut c.stream);
                    c.closed = true;
                    return None;
                }
                Ok(n) if fresh => {
                    c.buf = vec![0; RECV_BUF];
                    c.buf[..n].copy_from_slice(&first[..n]);
                    c.end = n;
                }
                Ok(n) => c.end += n,
                Err(e) => {
                    if e.kind() != io::ErrorKind::WouldBlock
                        && e.kind() != io::ErrorKind::Interrupted
                    {
                        let _ = self.registry.deregister(&mut c.stream);
                        c.closed = true;
                    }
                    return None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two drivers on loopback ports the kernel just handed out (retried if taken meanwhile).
    fn pair(poll: &mio::Poll) -> (TcpDriver, TcpDriver) {
        for _ in 0..20 {
            let free = || {
                let s = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                s.local_addr().unwrap()
            };
            let peers = vec![free(), free()];
            let bind = |a| {
                TcpDriver::bind(
                    a,
                    None,
                    peers.clone(),
                    None,
                    poll.registry().try_clone().unwrap(),
                    Token(0),
                )
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

    /// Frames of every size up to the largest arrive once, whole and in order, however the
    /// stream cut them; a turn's frames leave in few writes, not one each.
    #[test]
    fn frames_arrive_whole_and_in_order_and_leave_batched() {
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
        let mut got = Vec::new();
        let t = Instant::now();
        let mut next = 0;
        while got.len() < lens.len() && t.elapsed() < Duration::from_secs(10) {
            // A turn: ten frames, then the flush.
            for _ in 0..10 {
                if next < lens.len() {
                    a.send(1, &frame(next, lens[next]));
                    next += 1;
                }
            }
            a.flush();
            while b.recv_with(&mut |d| got.push(d.to_vec())) {}
        }
        assert_eq!(got.len(), lens.len(), "every frame arrives");
        for (i, (d, &len)) in got.iter().zip(&lens).enumerate() {
            assert!(
                d == &frame(i, len),
                "frame {i} ({len} B) whole and in order"
            );
        }
        assert!(
            a.stats.send_syscalls < lens.len() as u64 / 4,
            "{} writes for {} frames",
            a.stats.send_syscalls,
            lens.len()
        );
        assert!(!b.recv_with(&mut |_| panic!("nothing more")));
    }

    /// A frame longer than any datagram closes the connection it came on (and is counted).
    #[test]
    fn an_oversized_frame_closes_its_connection() {
        use std::io::Write;
        let poll = mio::Poll::new().unwrap();
        let (_a, mut b) = pair(&poll);
        let mut s = std::net::TcpStream::connect(b.local).unwrap();
        s.write_all(&(MAX_FRAME as u32 + 1).to_le_bytes()).unwrap();
        let t = Instant::now();
        while b.stats.rx_bad_frames == 0 && t.elapsed() < Duration::from_secs(5) {
            assert!(!b.recv_with(&mut |_| panic!("no frame")));
            std::thread::sleep(ACCEPT_EVERY);
        }
        assert_eq!(b.stats.rx_bad_frames, 1);
        assert!(b.inc.is_empty(), "the connection is gone");
    }

    /// Connections beyond what the peers could need are closed as accepted; the ones kept
    /// hold no receive buffer until they send something.
    #[test]
    fn idle_connections_cost_nothing_and_extra_ones_are_refused() {
        let poll = mio::Poll::new().unwrap();
        let (_a, mut b) = pair(&poll);
        let cap = 2 * b.out.len() + 8;
        let conns: Vec<_> = (0..cap + 5)
            .map(|_| std::net::TcpStream::connect(b.local).unwrap())
            .collect();
        let t = Instant::now();
        while b.stats.refused_connections < 5 && t.elapsed() < Duration::from_secs(5) {
            assert!(!b.recv_with(&mut |_| panic!("no frame")));
            std::thread::sleep(ACCEPT_EVERY);
        }
        assert_eq!((b.inc.len(), b.stats.refused_connections), (cap, 5));
        assert!(
            b.inc.iter().all(|c| c.buf.is_empty()),
            "no buffer before data"
        );
        drop(conns);
    }
}
