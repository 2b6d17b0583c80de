//! TCP driver: the same authenticated datagrams, length-prefixed on TCP streams.
//!
//! Each host listens on its configured address and opens one outgoing connection to each peer,
//! used only to send; accepted connections are used only to receive. No connection needs to be
//! identified: every frame is a datagram whose header names its sender and whose tag proves it.
//! The reliable-delivery layer runs on top unchanged, so semantics (ordering, exactly-once,
//! dead peers) are the same as over UDP; TCP's own reliability only makes retransmissions rare.
//! A broken outgoing connection is reopened (at most every 100 ms); what it held is retransmitted
//! by the transport. A frame longer than the largest datagram closes that connection (hostile).

use std::collections::VecDeque;
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
/// Bytes buffered for one peer before further datagrams are dropped (the transport resends).
const MAX_BUFFERED: usize = 16 << 20;
const RECONNECT_EVERY: Duration = Duration::from_millis(100);

struct Outgoing {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    buf: VecDeque<u8>,
    last_attempt: Option<Instant>,
}

struct Incoming {
    stream: TcpStream,
    buf: Vec<u8>,
    start: usize,
}

impl Incoming {
    /// The next complete frame's range in `buf`, if one is there; `Err` for a hostile length.
    fn frame(&self) -> Result<Option<(usize, usize)>, ()> {
        let avail = &self.buf[self.start..];
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
    /// Where [`TcpDriver::recv_with`] puts a datagram.
    scratch: Vec<u8>,
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
                    buf: VecDeque::new(),
                    last_attempt: None,
                })
            })
            .collect();
        let fault = FaultInjector::new(fault, addr.port() as u64 ^ 0x7cb);
        Ok(TcpDriver {
            local: addr,
            device: device.map(str::to_string),
            scratch: Vec::new(),
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

    /// Queues one datagram for host `to` and pushes out what the socket takes.
    pub fn send(&mut self, to: u16, bytes: &[u8]) {
        let copies = self.fault.as_mut().map_or(1, |f| f.copies(&mut self.stats));
        let Some(Some(o)) = self.out.get_mut(to as usize) else {
            return;
        };
        if o.buf.len() + bytes.len() + 4 > MAX_BUFFERED {
            self.stats.send_would_block += 1;
            return;
        }
        for _ in 0..copies {
            o.buf.extend((bytes.len() as u32).to_le_bytes());
            o.buf.extend(bytes);
        }
        self.flush_one(to as usize);
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
        while !o.buf.is_empty() {
            let (a, _) = o.buf.as_slices();
            match s.write(a) {
                Ok(0) => break,
                Ok(n) => {
                    o.buf.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Broken (peer restarted, refused while connecting): drop and reconnect later;
                    // the transport retransmits what was lost with it.
                    tracing::debug!("connection to {} broke: {e}", o.addr);
                    let _ = self.registry.deregister(s);
                    o.stream = None;
                    o.buf.clear();
                    self.stats.send_errors += 1;
                    return;
                }
            }
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut s, _)) => {
                    let _ = s.set_nodelay(true);
                    if self
                        .registry
                        .register(&mut s, self.token, Interest::READABLE)
                        .is_ok()
                    {
                        self.inc.push(Incoming {
                            stream: s,
                            buf: Vec::with_capacity(1 << 16),
                            start: 0,
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

    /// Hands the next complete datagram to `f` (copied out of the stream buffer first);
    /// `false` once everything is drained.
    pub fn recv_with(&mut self, f: &mut dyn FnMut(&mut [u8])) -> bool {
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(MAX_FRAME, 0);
        let got = self.recv(&mut buf);
        if let Some(n) = got {
            f(&mut buf[..n]);
        }
        self.scratch = buf;
        got.is_some()
    }

    /// The next received datagram, if one is complete; `None` once everything is drained.
    pub fn recv(&mut self, out: &mut [u8]) -> Option<usize> {
        self.accept();
        self.flush();
        let n = self.inc.len();
        for k in 0..n {
            let i = (self.next_inc + k) % n;
            if let Some(len) = self.recv_from(i, out) {
                self.next_inc = i;
                return Some(len);
            }
        }
        // Drop closed connections.
        self.inc.retain(|c| c.start != usize::MAX);
        None
    }

    fn recv_from(&mut self, i: usize, out: &mut [u8]) -> Option<usize> {
        let c = &mut self.inc[i];
        if c.start == usize::MAX {
            return None;
        }
        loop {
            match c.frame() {
                Ok(Some((at, len))) => {
                    let n = len.min(out.len());
                    out[..n].copy_from_slice(&c.buf[at..at + n]);
                    c.start = at + len;
                    if c.start == c.buf.len() {
                        c.buf.clear();
                        c.start = 0;
                    }
                    return Some(n);
                }
                Ok(None) => {}
                Err(()) => {
                    tracing::warn!("closing a TCP connection that sent an oversized frame");
                    self.stats.send_errors += 1;
                    let _ = self.registry.deregister(&mut c.stream);
                    c.start = usize::MAX;
                    return None;
                }
            }
            // Need more bytes: compact, then read.
            if c.start > 0 {
                c.buf.drain(..c.start);
                c.start = 0;
            }
            let old = c.buf.len();
            c.buf.resize(old + 65_536, 0);
            match c.stream.read(&mut c.buf[old..]) {
                Ok(0) => {
                    c.buf.truncate(old);
                    let _ = self.registry.deregister(&mut c.stream);
                    c.start = usize::MAX;
                    return None;
                }
                Ok(n) => c.buf.truncate(old + n),
                Err(e) => {
                    c.buf.truncate(old);
                    if e.kind() != io::ErrorKind::WouldBlock
                        && e.kind() != io::ErrorKind::Interrupted
                    {
                        let _ = self.registry.deregister(&mut c.stream);
                        c.start = usize::MAX;
                    }
                    return None;
                }
            }
        }
    }
}
