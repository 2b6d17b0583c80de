//! The udp conduit: the baseline without a daemon, as GASNet's own udp-conduit works. Each
//! process owns a UDP socket and runs the reliable-delivery state machine itself (sequence
//! numbers, acknowledgements, retransmission, duplicate suppression, a bounded window as the
//! credits), so every Active Message is handled by the target process when it polls.
//!
//! Addresses: node n listens on its host's address from the cluster config (127.1.x.y without
//! one) at a port derived from the job id and n ([`JobInfo::rank_addrs`]), so concurrent jobs do
//! not collide and no exchange is needed. The job key authenticates datagrams, or with
//! `SOFTNIC_UDP_AUTH=0` only tags them in clear as GASNet's udp-conduit does (AM-2 tags: other
//! jobs' datagrams are kept out, forgeries are not) — the baseline netbench measures.
//!
//! Datagrams carry up to 65,000 bytes whatever the network's MTU, as AMUDP's do: on a
//! 1500-byte Ethernet the kernel fragments them (measured over a veth pair, 1 MiB put_nbi:
//! 692–767 MB/s, against 312–315 in 1472-byte datagrams). One lost fragment loses the whole
//! datagram, AMUDP's weakness under loss; `SOFTNIC_UDP_MTU` sets a smaller size (a network
//! that drops fragments).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};

use super::Conduit;
use crate::gasnet::{am, GasnetError};
use crate::job::JobInfo;
use crate::transport::udp::UdpDriver;
use crate::transport::{PushError, Transport, TransportConfig};
use crate::wire::{Key, OpHeader, OpIter, OpRef};

pub struct UdpConduit {
    me: u16,
    n: u16,
    job: u32,
    t: Transport,
    d: UdpDriver,
    clock: Instant,
    segment: Vec<u8>,
    /// Buffers of delivered AMs, back from the Core for reuse.
    pool: super::BufPool,
    /// AMs to deliver before the network's: those a node sends itself, and those that arrived
    /// while a send waited for credit. (source, AM)
    local: VecDeque<(u32, Vec<u8>)>,
    /// Every rank on this machine has a core of its own: a wait spins, as GASNet's does when
    /// its node is not overcommitted, instead of yielding (see [`ranks_fit_cores`]).
    spin: bool,
}

/// Whether the ranks on this machine (those at our address, or all loopback ranks when ours
/// is loopback) number no more than its cores. With no daemon, nobody else needs a core: a
/// `sched_yield` per idle poll only delays seeing the datagram it waits for (blocking 8 B put,
/// interleaved on a 2-core VM: see docs/performance.md, stop 59).
fn ranks_fit_cores(peers: &[SocketAddr], me: usize) -> bool {
    let ours = peers[me].ip();
    let here = peers
        .iter()
        .filter(|a| a.ip() == ours || (a.ip().is_loopback() && ours.is_loopback()))
        .count();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    here <= cores
}

/// The salt of the udp conduit's ports (see [`JobInfo::rank_addrs`]).
const PORT_SALT: u16 = 1;

/// `SOFTNIC_UDP_AUTH`: `1` (the default) seals every datagram as the daemons do, `0` tags
/// them in clear as GASNet's udp-conduit does.
fn authenticate() -> Result<bool, GasnetError> {
    match std::env::var("SOFTNIC_UDP_AUTH").as_deref() {
        Err(_) | Ok("1") => Ok(true),
        Ok("0") => Ok(false),
        Ok(v) => Err(GasnetError::Setup(format!(
            "SOFTNIC_UDP_AUTH={v}: 1 (seal datagrams) or 0 (a tag in clear, as GASNet's udp-conduit)"
        ))),
    }
}

/// AMUDP's largest datagram, the udp conduit's unless `SOFTNIC_UDP_MTU` says otherwise.
const AMUDP_MTU: usize = 65_000;

/// `SOFTNIC_UDP_MTU`: the udp conduit's datagram size (576 to 65,507 bytes).
fn datagram_size() -> Result<usize, GasnetError> {
    match std::env::var("SOFTNIC_UDP_MTU") {
        Err(_) => Ok(AMUDP_MTU),
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (576..=65_507).contains(&n) => Ok(n),
            _ => Err(GasnetError::Setup(format!(
                "SOFTNIC_UDP_MTU={v}: a datagram size from 576 to 65507 bytes"
            ))),
        },
    }
}

impl UdpConduit {
    pub fn new(job: &JobInfo, segment_len: usize) -> Result<UdpConduit, GasnetError> {
        if job.size > 65_535 {
            return Err(GasnetError::Setup(
                "the udp conduit addresses at most 65535 nodes".into(),
            ));
        }
        let peers: Vec<SocketAddr> = job
            .rank_addrs(PORT_SALT)
            .map_err(|e| GasnetError::Setup(format!("udp conduit addresses: {e}")))?;
        let key = Key(*blake3::hash(
            &[job.job_key.to_le_bytes(), (job.job_id as u64).to_le_bytes()].concat(),
        )
        .as_bytes());
        let mtu = datagram_size()?;
        let spin = ranks_fit_cores(&peers, job.rank as usize);
        let d = UdpDriver::bind(peers[job.rank as usize], None, peers, None, mtu)
            .map_err(|e| GasnetError::Setup(format!("udp conduit cannot bind: {e}")))?;
        let cfg = TransportConfig {
            mtu,
            window: 128,
            // Few datagrams wait behind the window: a push copies the payload in, and a send
            // of it long after reads it from memory that has gone cold (the kernel's copy
            // into the socket then takes ~3 µs instead of ~1 per 62 KB). With 256 a stream
            // filled the queue, then sent the window in a burst: 1 MiB put_nbi 6.9 GB/s,
            // with 8 10.1–10.3 (interleaved, this machine).
            max_queued: 8,
            authenticate: authenticate()?,
            ..Default::default()
        };
        let t = Transport::new(job.rank as u16, job.size as u16, key, cfg, rand::random());
        Ok(UdpConduit {
            me: job.rank as u16,
            n: job.size as u16,
            job: job.job_id,
            t,
            d,
            clock: Instant::now(),
            segment: vec![0; segment_len],
            pool: Default::default(),
            local: VecDeque::new(),
            spin,
        })
    }

    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    /// Queues an AM for `dest` (its encoding and, for a Long, the payload behind it, copied
    /// once, into the datagram); `Ok(false)` when its window is full.
    fn push(&mut self, dest: u32, am: &[u8], long: &[u8]) -> Result<bool, GasnetError> {
        if dest >= self.n as u32 {
            return Err(GasnetError::BadNode(dest));
        }
        if dest == self.me as u32 {
            self.local.push_back((dest, [am, long].concat()));
            return Ok(true);
        }
        let op = OpRef::Am {
            h: OpHeader {
                job: self.job,
                src_rank: self.me as u32,
                dst_rank: dest,
                req: 0,
            },
            data: &[],
        };
        let pushed = self
            .t
            .push_op_filled(dest as u16, &op, am.len() + long.len(), &mut |b| {
                b.extend_from_slice(am);
                b.extend_from_slice(long);
                true
            });
        match pushed {
            Ok(()) => {}
            Err(PushError::Full(_)) => {
                self.transmit();
                return Ok(false);
            }
            Err(PushError::Dead(p)) => return Err(GasnetError::NodeDead(p as u32)),
            Err(e) => return Err(GasnetError::Setup(e.to_string())),
        }
        self.transmit();
        Ok(true)
    }

    fn transmit(&mut self) {
        let now = self.now();
        self.t.flush(now);
        while let Some((to, dg)) = self.t.poll_transmit(now) {
            self.d.send(to, dg);
        }
        self.d.flush();
    }
}

/// A Long request or reply whose payload `data` carries behind its header: the payload goes
/// into `segment` now and the AM delivered is the in-place form naming its length (one copy,
/// from the datagram into the segment). Anything else, or a Long outside the segment (the Core
/// counts and drops it), is delivered as it came. The AM is built in `out`.
fn place_long(data: &[u8], segment: &mut [u8], out: &mut Vec<u8>) {
    out.clear();
    if let Some((h, payload)) = am::decode(data) {
        let head = data.len() - payload.len();
        let end = h.offset.checked_add(payload.len() as u64);
        if h.category == am::Category::Long
            && !h.in_place
            && end.is_some_and(|e| e <= segment.len() as u64)
        {
            segment[h.offset as usize..h.offset as usize + payload.len()].copy_from_slice(payload);
            out.extend_from_slice(&data[..head]);
            out.resize(head + am::IN_PLACE_LEN, 0);
            am::mark_in_place(out, payload.len() as u32, 0);
            return;
        }
    }
    out.extend_from_slice(data);
}

impl Conduit for UdpConduit {
    fn node(&self) -> u32 {
        self.me as u32
    }

    fn outgoing(&self) -> bool {
        // Our acknowledgements too: a peer waiting for one would keep resending to a node
        // that left (node 0 leaves a barrier last, waiting for the others' acks).
        self.t.unsettled()
    }

    fn nodes(&self) -> u32 {
        self.n as u32
    }

    fn segment(&mut self) -> &mut [u8] {
        &mut self.segment
    }

    fn max_am(&self) -> usize {
        OpRef::max_data(crate::wire::OpKind::Am, self.t.body_capacity())
    }

    fn name(&self) -> &'static str {
        "udp"
    }

    fn keep_core(&mut self) -> bool {
        self.spin
    }

    fn wait_news(&mut self, max: Duration) -> Result<(), GasnetError> {
        if !self.local.is_empty() {
            return Ok(());
        }
        // Sleep no longer than the transport's next timer (a retransmission, a lazy ack).
        let now = self.now();
        let max = match self.t.next_timeout() {
            Some(t) => max.min(Duration::from_nanos(t.saturating_sub(now))),
            None => max,
        };
        if max < Duration::from_millis(1) {
            // poll(2) counts milliseconds: a timer this close is better met awake.
            std::thread::yield_now();
            return Ok(());
        }
        let mut fds = [PollFd::new(self.d.socket(), PollFlags::IN)];
        match poll(&mut fds, max.as_millis() as i32) {
            Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
            Err(e) => Err(GasnetError::Wait(e.to_string())),
        }
    }

    fn request(&mut self, dest: u32, am: &[u8], long: Option<&[u8]>) -> Result<bool, GasnetError> {
        // A full window: the Core runs handlers (acks come with progress) and tries again.
        self.push(dest, am, long.unwrap_or_default())
    }

    fn recycle(&mut self, b: Vec<u8>) {
        self.pool.give(b);
    }

    fn reply(
        &mut self,
        dest: u32,
        _reply_to: u64,
        reply: Option<(&[u8], Option<&[u8]>)>,
    ) -> Result<(), GasnetError> {
        // The udp conduit answers only the requests whose handlers replied.
        let Some((am, long)) = reply else {
            return Ok(());
        };
        let long = long.unwrap_or_default();
        while !self.push(dest, am, long)? {
            // No credit: make progress (acks free the window), keeping what arrives for later.
            let mut stash = Vec::new();
            self.poll(&mut |src, _, b| stash.push((src, b)), &mut |_| {})?;
            self.local.extend(stash);
        }
        Ok(())
    }

    fn poll(
        &mut self,
        deliver: &mut dyn FnMut(u32, u64, Vec<u8>),
        _done: &mut dyn FnMut(super::RmaDone),
    ) -> Result<bool, GasnetError> {
        let mut any = false;
        while let Some((src, b)) = self.local.pop_front() {
            deliver(src, 0, b);
            any = true;
        }
        let now = self.now();
        let UdpConduit {
            t,
            d,
            segment,
            pool,
            ..
        } = self;
        let mut handle = |body: &[u8], deliver: &mut dyn FnMut(u32, u64, Vec<u8>)| {
            for op in OpIter::new(body).flatten() {
                if let OpRef::Am { h, data } = op {
                    let mut b = pool.take();
                    place_long(data, segment, &mut b);
                    deliver(h.src_rank, 0, b);
                }
            }
        };
        // Opened where the driver received it; a Long's payload goes from there to the segment.
        while d.recv_with(&mut |dg| {
            let Ok(r) = t.on_datagram(now, dg) else {
                return;
            };
            if let Some(body) = r.body {
                handle(body, deliver);
            }
            while let Some(b) = t.take_ready(r.peer) {
                handle(&b, deliver);
                t.give_back(b);
            }
        }) {
            any = true;
        }
        self.t.handle_timeout(now);
        if let Some(crate::transport::TransportEvent::PeerDead(p)) = self.t.poll_event() {
            return Err(GasnetError::NodeDead(p as u32));
        }
        self.transmit();
        Ok(any)
    }
}

#[cfg(test)]
mod tests {
    use super::ranks_fit_cores;
    use std::net::SocketAddr;

    fn addrs(ips: &[&str]) -> Vec<SocketAddr> {
        ips.iter()
            .map(|ip| format!("{ip}:20000").parse().unwrap())
            .collect()
    }

    #[test]
    fn ranks_on_other_machines_leave_the_cores_to_us() {
        let cores = std::thread::available_parallelism().unwrap().get();
        // One rank here, the rest elsewhere: always room.
        let mut ips = vec!["10.0.0.1"];
        ips.extend(std::iter::repeat_n("10.0.0.2", cores + 4));
        assert!(ranks_fit_cores(&addrs(&ips), 0));
        // Every loopback address is this machine, whichever 127.x it is.
        let local: Vec<String> = (0..=cores).map(|r| format!("127.1.0.{r}")).collect();
        let local: Vec<&str> = local.iter().map(String::as_str).collect();
        assert!(!ranks_fit_cores(&addrs(&local), 0));
        assert!(ranks_fit_cores(&addrs(&local[..cores]), 0));
    }
}
