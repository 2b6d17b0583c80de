//! Staged long receives. The NIC reaches a receive buffer in ordinary (private) memory only
//! through the kernel (`process_vm_writev`: a page walk and a copy into cold memory, on the
//! daemon's one thread, which serves every rank of the host). So a get that fetches the body
//! of a long message into such a buffer lands instead in a registered ring this rank shares
//! with its NIC, and the rank copies it out when the reply event comes: the daemon stores into
//! memory it maps (kept warm as the ring turns) and the copy into the user's buffer runs in
//! the receiving rank, beside its wait. Buffers the NIC maps (`alloc_mem`) are fetched into
//! directly, and so are bodies above [`STAGE_MAX`] (a sender's `read` entry serves one get,
//! so a body is fetched whole).

use std::collections::VecDeque;

use rustc_hash::FxHashMap as HashMap;

use crate::client::bounce::Ring;
use crate::client::MemRegion;
use crate::nic::memory::Perms;
use crate::portals::{md_opt, EventKind, Md, NiFail, NiHandle, Portals, ProcessId, Target};

use super::error::MpiError;
use super::state::State;

/// The ring: a few 1 MiB bodies in flight (the daemon fills one while the rank empties
/// another), small enough to stay in cache: 4 MiB streamed ~10% faster than 8 (measured).
pub(super) const STAGE_LEN: usize = 4 << 20;
/// Bodies up to this many bytes are staged.
pub(super) const STAGE_MAX: u64 = 2 << 20;
/// The user_ptr tag of a staged get (the rest is its offset in the ring).
pub(super) const T_STAGE: u64 = 11 << 60;

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
    /// Gets waiting for room in the ring, in arrival order.
    waiting: VecDeque<StagedGet>,
    /// Gets in the NIC, by their offset in the ring.
    live: HashMap<u64, StagedGet>,
}

impl Stage {
    /// Registers the ring (local access only: it is the target of this rank's own gets) and
    /// binds its MD, whose replies go to `eq`.
    pub fn open(p: &mut Portals, ni: NiHandle, eq: u32) -> Result<Stage, MpiError> {
        let region = p.endpoint().mem_register(STAGE_LEN, Perms(0))?;
        let md = p.md_bind(
            ni,
            &Md {
                region: region.handle,
                segments: vec![(0, STAGE_LEN as u64)],
                options: md_opt::EVENT_SEND_DISABLE,
                eq: Some(eq),
                ct: None,
            },
        )?;
        Ok(Stage {
            region,
            md,
            ring: Ring::new(STAGE_LEN),
            waiting: VecDeque::new(),
            live: HashMap::default(),
        })
    }

    pub fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }
}

impl State {
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
                std::ptr::copy_nonoverlapping(
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

/// The target of a long message's body: the sender's `read` entry for this send id.
pub(super) fn body_target(rank: u32, send_id: u64, remote_offset: u64) -> Target {
    Target {
        id: ProcessId::Logical { rank },
        pt_index: super::state::READ_PT,
        match_bits: send_id,
        remote_offset,
    }
}
