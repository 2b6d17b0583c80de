//! Staged long messages. The NIC reaches ordinary (private) memory only through the kernel
//! (`process_vm_readv`/`writev`: a page walk and a copy, on the daemon's one thread, which
//! serves every rank of the host). So long bodies pass through registered rings each rank
//! shares with its NIC, and the rank makes the copy beside its own work:
//! - receives: a get that fetches a body into private memory lands in the receive ring, and
//!   the rank copies it out when the reply event comes (the daemon stores into memory it maps,
//!   kept warm as the ring turns);
//! - sends: a body is copied into the send ring as its message goes, and exposed there on
//!   `read` (see [`Out`]).
//!
//! Buffers the NIC maps (`alloc_mem`) are used in place, and so are bodies above
//! [`STAGE_MAX`] (a sender's `read` entry serves one get, so a body is fetched whole).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap as HashMap;

use crate::client::bounce::Ring;
use crate::client::MemRegion;
use crate::nic::memory::Perms;
use crate::portals::{md_opt, EventKind, Md, NiFail, NiHandle, Portals, ProcessId, Target};

use super::error::{ErrorClass, MpiError};
use super::flow::Msg;
use super::state::State;

/// The ring: a few 1 MiB bodies in flight (the daemon fills one while the rank empties
/// another), small enough to stay in cache: 4 MiB streamed ~10% faster than 8 (measured).
pub(super) const STAGE_LEN: usize = 4 << 20;
/// Bodies up to this many bytes are staged.
pub(super) const STAGE_MAX: u64 = 2 << 20;
/// The user_ptr tag of a staged get (the rest is its offset in the ring).
pub(super) const T_STAGE: u64 = 11 << 60;
/// Bodies at least this long are copied out of the ring with stores that bypass the caches:
/// a rendezvous stream's receive buffers are cold, and ordinary stores read each line before
/// writing it. 1 MiB rendezvous from private memory, ABBA 36 rows a side: medians 2178 →
/// 2468 MB/s (the copy into the send ring stays cached: the NIC reads it next).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const STREAM_OUT_MIN: usize = 512 << 10;

/// A get of a long message's body into the ring, for request `req`, copied to `dst`.
#[derive(Debug, Clone, Copy)]
pub(super) struct StagedGet {
    pub req: u32,
    pub dst: u64,
    pub len: u64,
    pub target: Target,
}

pub(super) struct Stage {
    region: MemRegion,
    md: u32,
    ring: Ring,
    /// The send side: long messages' bodies copied out of private memory for the NIC.
    pub(super) out: Out,
    /// Gets waiting for room in the ring, in arrival order.
    waiting: VecDeque<StagedGet>,
    /// Gets in the NIC, by their offset in the ring.
    live: HashMap<u64, StagedGet>,
}

impl Stage {
    /// Registers the rings and binds their MDs, whose events go to `eq`: the receive ring for
    /// local access only (the target of this rank's own gets), the send ring for remote reads.
    pub fn open(p: &mut Portals, ni: NiHandle, eq: u32) -> Result<Stage, MpiError> {
        let out_len = match super::state::env_size("SOFTNIC_MPI_SEND_STAGE")? {
            None => STAGE_LEN,
            Some(n) if n as u64 >= STAGE_MAX => n,
            Some(n) => {
                return Err(MpiError::new(
                    ErrorClass::Arg,
                    format!(
                    "SOFTNIC_MPI_SEND_STAGE={n}: at least {STAGE_MAX} (the largest staged body)"
                ),
                ))
            }
        };
        let (region, md) = bind_ring(p, ni, eq, STAGE_LEN, Perms(0))?;
        let (out_region, out_md) = bind_ring(p, ni, eq, out_len, Perms::READ)?;
        Ok(Stage {
            region,
            md,
            ring: Ring::new(STAGE_LEN),
            out: Out {
                region: out_region,
                md: out_md,
                ring: Ring::new(out_len),
                waiting_since: None,
            },
            waiting: VecDeque::new(),
            live: HashMap::default(),
        })
    }

    pub fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }
}

/// Where long sends' bodies in private memory are copied for the NIC to read: the sending
/// rank's `memcpy` instead of the daemon's `process_vm_readv` on its one thread (~5–9 GB/s,
/// the rendezvous stream's bottleneck). A send waits for room behind the ones to the same
/// rank (order) only while the ring is giving room back; once a send has waited
/// [`PATIENCE`] with none coming back, bodies are exposed where they are, as without the
/// ring: staged bodies wait for receives their ranks may post only after something of ours,
/// so waiting longer could deadlock.
pub(super) struct Out {
    region: MemRegion,
    pub(super) md: u32,
    ring: Ring,
    /// Since when a send has waited for room without any coming back.
    waiting_since: Option<Instant>,
}

/// How long a send waits for room while none comes back.
pub(super) const PATIENCE: Duration = Duration::from_millis(5);

/// What became of a send waiting to be staged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Staging {
    /// Exposed (staged, or where it is): the put may go.
    Ready,
    /// No room yet: it waits.
    NoRoom,
    /// Its request failed meanwhile: nothing goes.
    Dropped,
}

impl Out {
    pub(super) fn free(&mut self, at: u64) {
        self.ring.free(at);
        self.waiting_since = None;
    }
}

impl State {
    /// Stages a waiting long send's body if the ring has room, or exposes it in place if the
    /// ring ran out of patience, and then exposes it on `read`.
    pub(super) fn stage_body(&mut self, m: &mut Msg) -> Staging {
        let Some((addr, len)) = self.send_body(m.req) else {
            return Staging::Dropped;
        };
        let out = &mut self.stage.out;
        let placed = match out.ring.alloc(len) {
            Some(at) => {
                // SAFETY: the request's buffer is valid for len bytes while it is pending;
                // `at..at+len` lies in the ring's region and is ours until given back.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        addr as *const u8,
                        out.region.as_ptr().add(at as usize),
                        len,
                    )
                };
                let placed = (out.region.handle, out.md, at);
                self.set_staged(m.req, at);
                Ok(placed)
            }
            None => {
                let since = *out.waiting_since.get_or_insert_with(Instant::now);
                if since.elapsed() < PATIENCE {
                    return Staging::NoRoom;
                }
                self.set_cached(m.req)
            }
        };
        match placed.and_then(|(region, md, off)| self.expose_body(m, region, md, off)) {
            Ok(()) => Staging::Ready,
            Err(e) => {
                self.finish(m.req, Some(e));
                Staging::Dropped
            }
        }
    }

    /// Fetches a long message's body through the ring; the request stays busy until its reply
    /// has been copied out (or it failed).
    pub(super) fn stage_get(&mut self, g: StagedGet) -> Result<(), MpiError> {
        let Some(r) = self.req(g.req) else {
            return Ok(());
        };
        r.busy += 1;
        self.stage.waiting.push_back(g);
        self.issue_staged()
    }

    /// Issues waiting gets while the ring has room for them, oldest first. A request that
    /// failed meanwhile (its peer died) fetches nothing more.
    pub(super) fn issue_staged(&mut self) -> Result<(), MpiError> {
        while let Some(&g) = self.stage.waiting.front() {
            if self.req_ref(g.req).is_none_or(|r| r.done) {
                self.stage.waiting.pop_front();
                self.unbusy(g.req);
                continue;
            }
            let Some(at) = self.stage.ring.alloc(g.len as usize) else {
                return Ok(());
            };
            self.stage.waiting.pop_front();
            let sent = self
                .p
                .get(self.ni, self.stage.md, at, g.len, g.target, T_STAGE | at);
            if let Err(e) = sent {
                self.stage.ring.free(at);
                self.unbusy(g.req);
                self.landed_staged(g.req, Some(MpiError::from(e)));
                continue;
            }
            self.stage.live.insert(at, g);
        }
        Ok(())
    }

    /// A staged get's reply: copy the body out, give its room back, and issue what waited.
    pub(super) fn staged_reply(&mut self, at: u64, kind: EventKind, fail: NiFail, mlength: u64) {
        if kind != EventKind::Reply {
            return;
        }
        let Some(g) = self.stage.live.remove(&at) else {
            return;
        };
        let ok = fail == NiFail::Ok;
        if ok && self.req_ref(g.req).is_some_and(|r| !r.done) {
            let n = mlength.min(g.len) as usize;
            // SAFETY: the NIC wrote n <= g.len bytes at `at` inside the ring (its reply event
            // says they are there); `dst` is the receive buffer, valid for them while the
            // request is pending.
            unsafe {
                copy_out(
                    self.stage.region.as_ptr().add(at as usize),
                    g.dst as *mut u8,
                    n,
                )
            };
        }
        self.stage.ring.free(at);
        self.unbusy(g.req);
        let fail = (!ok).then(|| MpiError::from_fail(fail, "fetching a long message"));
        self.landed_staged(g.req, fail);
    }

    fn landed_staged(&mut self, req: u32, fail: Option<MpiError>) {
        if self.req_ref(req).is_some_and(|r| !r.done) {
            self.finish(req, fail);
        } else {
            self.maybe_free(req);
        }
    }
}

/// A registered ring of `len` bytes with `perms` and its MD.
fn bind_ring(
    p: &mut Portals,
    ni: NiHandle,
    eq: u32,
    len: usize,
    perms: Perms,
) -> Result<(MemRegion, u32), MpiError> {
    let region = p.endpoint().mem_register(len, perms)?;
    let md = p.md_bind(
        ni,
        &Md {
            region: region.handle,
            segments: vec![(0, len as u64)],
            options: md_opt::EVENT_SEND_DISABLE,
            eq: Some(eq),
            ct: None,
        },
    )?;
    Ok((region, md))
}

/// The target of a long message's body: the sender's `read` entry for this send id.
pub(super) fn body_target(rank: u32, send_id: u64, remote_offset: u64) -> Target {
    Target {
        id: ProcessId::Logical { rank },
        pt_index: super::state::READ_PT,
        match_bits: send_id,
        remote_offset,
    }
}

/// Copies `n` bytes of a staged body to its receive buffer, long ones by streaming stores.
///
/// # Safety
/// `src` readable and `dst` writable for `n` bytes, not overlapping.
unsafe fn copy_out(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= STREAM_OUT_MIN {
        return stream_copy(src, dst, n);
    }
    std::ptr::copy_nonoverlapping(src, dst, n)
}

/// `copy_nonoverlapping` with non-temporal stores (SSE2, part of x86_64), fenced so that the
/// bytes are visible before anything this thread stores after it (the request's completion).
///
/// # Safety
/// As [`copy_out`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(n);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let mut i = head;
    while i + 64 <= n {
        let s = src.add(i) as *const __m128i;
        let d = dst.add(i) as *mut __m128i;
        let (a, b, c, e) = (
            _mm_loadu_si128(s),
            _mm_loadu_si128(s.add(1)),
            _mm_loadu_si128(s.add(2)),
            _mm_loadu_si128(s.add(3)),
        );
        _mm_stream_si128(d, a);
        _mm_stream_si128(d.add(1), b);
        _mm_stream_si128(d.add(2), c);
        _mm_stream_si128(d.add(3), e);
        i += 64;
    }
    _mm_sfence();
    std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte arrives, whatever the destination's alignment and the length's remainder,
    /// and nothing around the destination is touched.
    #[test]
    fn a_streamed_copy_out_is_exact() {
        let src: Vec<u8> = (0..STREAM_OUT_MIN + 300)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        for len in [
            0,
            1,
            15,
            63,
            64,
            65,
            4097,
            STREAM_OUT_MIN - 1,
            STREAM_OUT_MIN,
            STREAM_OUT_MIN + 77,
        ] {
            for (s_off, d_off) in [(0, 0), (1, 3), (5, 16), (13, 9)] {
                let mut dst = vec![0xAAu8; len + 64];
                // SAFETY: both ranges are inside their vectors (src has 300 bytes to spare)
                // and distinct allocations.
                unsafe { copy_out(src.as_ptr().add(s_off), dst.as_mut_ptr().add(d_off), len) };
                assert_eq!(
                    &dst[d_off..d_off + len],
                    &src[s_off..s_off + len],
                    "len {len}"
                );
                assert!(dst[..d_off].iter().all(|&b| b == 0xAA));
                assert!(dst[d_off + len..].iter().all(|&b| b == 0xAA));
            }
        }
    }
}
