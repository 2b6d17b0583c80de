//! The Gemini-level API, after Cray's uGNI/DMAPP completion styles: registered memory,
//! put/get and the ten 64-bit AMOs, each blocking, non-blocking with a sync id
//! (`*_nb` + [`Nic::sync_wait`]/[`Nic::sync_test`]), or non-blocking implicit
//! (`*_nbi` + [`Nic::gsync_wait`]/[`Nic::gsync_test`]).
//!
//! Payloads up to the FMA threshold (default 4 KiB, `SOFTNIC_FMA_THRESHOLD`) travel inline in
//! the command descriptor; larger ones are streamed by the daemon straight from registered
//! memory (BTE). A buffer outside registered memory is staged through a bounce region.
//! Region handles count up from 0 in registration order on every rank; handle 0 is the
//! library's own, so ranks that register alike address each other's regions by the same handle.

use crate::client::{Endpoint, BOUNCE_LEN};
use crate::job::JobInfo;
pub use crate::nic::host::ixpe::{IxpeMode, IXPE_ENTRY};
use crate::nic::memory::Perms;
pub use crate::shm::{Command, CommandKind};
use crate::wire::{AmoOp, Status};

pub use crate::client::{wait_until, MemHandle, MemRegion, NicError as GniError};
pub use crate::wire::AmoOp as Amo;

/// `base + k·stride`, or an error when it leaves the 64-bit offset space.
fn offset_of(base: u64, k: usize, stride: i64) -> Result<u64, GniError> {
    u64::try_from(base as i128 + k as i128 * stride as i128)
        .map_err(|_| GniError::Remote(Status::OutOfBounds))
}

/// A remote address: rank, region handle, byte offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote {
    pub rank: u32,
    pub handle: MemHandle,
    pub offset: u64,
}

/// A non-blocking operation's sync id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SyncId(u64);

/// Where the elements of a vector (strided or indexed) operation lie in a region.
#[derive(Debug, Clone, Copy)]
pub enum Layout<'a> {
    /// Element k at `offset + k·stride` (bytes; may be negative, never 0).
    Strided(i64),
    /// Element k at byte offset `idx[k]` of the region (the `offset` is not used).
    Indexed(&'a [u64]),
}

/// The local side of a vector get: a region of this rank (registered memory, or a process
/// region reached by copy) with element k landing at `offset + k·stride`.
#[derive(Debug, Clone, Copy)]
pub struct LocalStrided {
    pub handle: MemHandle,
    pub offset: u64,
    pub stride: i64,
}

/// The NIC as one rank uses it through the Gemini-level API.
pub struct Nic {
    ep: Endpoint,
    fma_threshold: usize,
    scatter_buf: Vec<u8>,
}

impl Nic {
    /// Attaches to this rank's daemon as the launcher described it in the environment.
    pub fn init() -> Result<Nic, GniError> {
        Ok(Self::from_endpoint(Endpoint::init()?))
    }

    pub fn attach(job: JobInfo) -> Result<Nic, GniError> {
        Ok(Self::from_endpoint(Endpoint::attach(job)?))
    }

    /// The Gemini-level API on an attached endpoint (one another API may have used).
    pub fn from_endpoint(ep: Endpoint) -> Nic {
        let fma_threshold = std::env::var("SOFTNIC_FMA_THRESHOLD")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4096usize)
            .min(ep.client().max_inline());
        Nic {
            ep,
            fma_threshold,
            scatter_buf: Vec::new(),
        }
    }

    /// The endpoint, for another API to take over (after [`Nic::gsync_wait`]).
    pub fn into_endpoint(self) -> Endpoint {
        self.ep
    }

    pub fn endpoint(&mut self) -> &mut Endpoint {
        &mut self.ep
    }

    pub fn rank(&self) -> u32 {
        self.ep.rank()
    }
    pub fn size(&self) -> u32 {
        self.ep.size()
    }
    pub fn job(&self) -> &JobInfo {
        self.ep.job()
    }
    pub fn client(&self) -> &crate::client::Client {
        self.ep.client()
    }

    /// Sets the FMA/BTE switch-over size for this process.
    pub fn set_fma_threshold(&mut self, bytes: usize) {
        self.fma_threshold = bytes.min(self.ep.client().max_inline());
    }

    /// Registers `len` bytes of fresh zeroed memory with remote permissions `perms`.
    pub fn mem_register(&mut self, len: usize, perms: Perms) -> Result<MemRegion, GniError> {
        self.ep.mem_register(len, perms)
    }

    pub fn mem_deregister(&mut self, r: &MemRegion) -> Result<(), GniError> {
        self.ep.mem_deregister(r)
    }

    /// Processes every completion already posted.
    pub fn progress(&mut self) {
        self.ep.progress()
    }

    /// Waits for a non-blocking operation; returns the fetched value of a fetching AMO (else 0).
    pub fn sync_wait(&mut self, id: SyncId) -> Result<u64, GniError> {
        self.ep.finish(id.0)
    }

    /// `Some(value)` once the operation completed (successfully), `None` while pending.
    pub fn sync_test(&mut self, id: SyncId) -> Result<Option<u64>, GniError> {
        self.ep.test(id.0)
    }

    /// Waits for every implicit (nbi) operation; reports the first failure among them.
    pub fn gsync_wait(&mut self) -> Result<(), GniError> {
        self.ep.gsync_wait()
    }

    pub fn gsync_test(&mut self) -> Result<bool, GniError> {
        self.ep.gsync_test()
    }

    /// Completes this rank's implicit operations, then a barrier of the whole job over the NIC.
    pub fn barrier(&mut self) -> Result<(), GniError> {
        self.ep.barrier()
    }

    // ------------------------------------------------------------ put

    fn cmd(&self, kind: CommandKind, dst: Remote, len: usize) -> Result<Command, GniError> {
        Ok(Command {
            kind,
            host: self.ep.rank_host(dst.rank)?,
            rank: dst.rank,
            remote_region: dst.handle.0,
            remote_off: dst.offset,
            len: len as u64,
            ..Default::default()
        })
    }

    /// Posts a put of `src` to `dst`; `None` when it had to complete synchronously.
    fn post_put(
        &mut self,
        dst: Remote,
        src: &[u8],
        implicit: bool,
    ) -> Result<Option<u64>, GniError> {
        if src.len() <= self.fma_threshold {
            let c = self.cmd(CommandKind::PutInline, dst, src.len())?;
            return self.ep.post(c, src, implicit).map(Some);
        }
        if let Some((region, off)) = self.ep.registered(src.as_ptr(), src.len()) {
            let mut c = self.cmd(CommandKind::PutFrom, dst, src.len())?;
            c.local_region = region.handle.0;
            c.local_off = off;
            return self.ep.post(c, &[], implicit).map(Some);
        }
        // Outside registered memory: stage through the bounce region, chunk by chunk.
        let mut done = 0;
        while done < src.len() {
            let n = (src.len() - done).min(BOUNCE_LEN);
            self.ep.bounce().bytes()[..n].copy_from_slice(&src[done..done + n]);
            let mut c = self.cmd(
                CommandKind::PutFrom,
                Remote {
                    offset: dst.offset + done as u64,
                    ..dst
                },
                n,
            )?;
            c.local_region = self.ep.bounce().handle.0;
            let req = self.ep.post(c, &[], false)?;
            self.ep.finish(req)?;
            done += n;
        }
        Ok(None)
    }

    /// Blocking put: returns once the data is in the target's memory.
    pub fn put(&mut self, dst: Remote, src: &[u8]) -> Result<(), GniError> {
        match self.post_put(dst, src, false)? {
            Some(req) => self.ep.finish(req).map(|_| ()),
            None => Ok(()),
        }
    }

    /// Non-blocking put. `src` may be reused at once when it is at most the FMA threshold or
    /// outside registered memory; a registered source must stay unchanged until the sync.
    pub fn put_nb(&mut self, dst: Remote, src: &[u8]) -> Result<SyncId, GniError> {
        match self.post_put(dst, src, false)? {
            Some(req) => Ok(SyncId(req)),
            None => Ok(SyncId(self.ep.done_req())),
        }
    }

    /// Non-blocking implicit put, completed by [`Nic::gsync_wait`].
    pub fn put_nbi(&mut self, dst: Remote, src: &[u8]) -> Result<(), GniError> {
        self.post_put(dst, src, true).map(|_| ())
    }

    // ------------------------------------------------------------ get

    fn post_get(
        &mut self,
        local: &MemRegion,
        local_off: u64,
        src: Remote,
        len: usize,
        implicit: bool,
    ) -> Result<u64, GniError> {
        if local_off
            .checked_add(len as u64)
            .is_none_or(|e| e > local.len() as u64)
        {
            return Err(GniError::LocalBounds {
                off: local_off,
                len: len as u64,
                region_len: local.len(),
            });
        }
        let mut c = self.cmd(CommandKind::Get, src, len)?;
        c.local_region = local.handle.0;
        c.local_off = local_off;
        self.ep.post(c, &[], implicit)
    }

    /// Blocking get into any buffer (staged through the bounce region when not registered).
    pub fn get(&mut self, dst: &mut [u8], src: Remote) -> Result<(), GniError> {
        if let Some((r, off)) = self.ep.registered(dst.as_ptr(), dst.len()) {
            let r = r.clone();
            let req = self.post_get(&r, off, src, dst.len(), false)?;
            return self.ep.finish(req).map(|_| ());
        }
        let bounce = self.ep.bounce().clone();
        let mut done = 0;
        while done < dst.len() || (dst.is_empty() && done == 0) {
            let n = (dst.len() - done).min(BOUNCE_LEN);
            let req = self.post_get(
                &bounce,
                0,
                Remote {
                    offset: src.offset + done as u64,
                    ..src
                },
                n,
                false,
            )?;
            self.ep.finish(req)?;
            dst[done..done + n].copy_from_slice(&bounce.bytes()[..n]);
            done += n;
            if n == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Non-blocking get into registered memory.
    pub fn get_nb(
        &mut self,
        local: &MemRegion,
        local_off: u64,
        src: Remote,
        len: usize,
    ) -> Result<SyncId, GniError> {
        self.post_get(local, local_off, src, len, false).map(SyncId)
    }

    /// Non-blocking implicit get into registered memory.
    pub fn get_nbi(
        &mut self,
        local: &MemRegion,
        local_off: u64,
        src: Remote,
        len: usize,
    ) -> Result<(), GniError> {
        self.post_get(local, local_off, src, len, true).map(|_| ())
    }

    // ------------------------------------------------------------ vector put/get

    /// Elements per vector command: what the command ring takes inline.
    fn vector_chunk(&self, per_elem: usize) -> usize {
        (self.ep.client().max_inline() / per_elem).max(1)
    }

    /// Posts a strided or indexed put of `data`, `data.len() / elem` packed elements of `elem`
    /// bytes (1, 4, 8 or 16): one command and one wire op per datagram of elements, each
    /// element checked by the target NIC. Returns the request to wait for; when the put needs
    /// more than one command, all but the last are completed before it returns.
    pub fn post_put_vector(
        &mut self,
        dst: Remote,
        elem: u8,
        layout: Layout<'_>,
        data: &[u8],
        implicit: bool,
    ) -> Result<u64, GniError> {
        let e = elem as usize;
        let n = data.len() / e.max(1);
        if !crate::wire::VShape::valid_elem(elem) || !data.len().is_multiple_of(e) {
            return Err(GniError::Remote(Status::BadRequest));
        }
        let per = e + matches!(layout, Layout::Indexed(_)) as usize * 8;
        let chunk = self.vector_chunk(per);
        self.post_vector(
            CommandKind::PutV,
            dst,
            elem,
            layout,
            n,
            chunk,
            implicit,
            |c, buf, first, k| {
                buf.extend_from_slice(&data[first * e..(first + k) * e]);
                c.len = buf.len() as u64;
                Ok(())
            },
        )
    }

    /// Posts a strided or indexed get of `n` elements of `elem` bytes from `src` into this
    /// rank's region `local`. Like [`Nic::post_put_vector`], one request to wait for.
    pub fn post_get_vector(
        &mut self,
        local: LocalStrided,
        src: Remote,
        elem: u8,
        layout: Layout<'_>,
        n: usize,
        implicit: bool,
    ) -> Result<u64, GniError> {
        if !crate::wire::VShape::valid_elem(elem) || local.stride == 0 {
            return Err(GniError::Remote(Status::BadRequest));
        }
        let chunk = match layout {
            Layout::Indexed(_) => self.vector_chunk(8),
            Layout::Strided(_) => crate::shm::control::MAX_VECTOR_ELEMS as usize,
        };
        self.post_vector(
            CommandKind::GetV,
            src,
            elem,
            layout,
            n,
            chunk,
            implicit,
            |c, _, first, _| {
                c.local_region = local.handle.0;
                c.local_off = offset_of(local.offset, first, local.stride)?;
                c.operand2 = local.stride as u64;
                Ok(())
            },
        )
    }

    /// The commands of a vector transfer of `n` elements, `chunk` per command: each names
    /// its elements' remote places (the stride, or its part of the offset list inline) and
    /// `fill` completes it (the put's elements, the get's landing place). Every command but
    /// the last is waited for unless `implicit`; the last one's request comes back.
    #[allow(clippy::too_many_arguments)]
    fn post_vector(
        &mut self,
        kind: CommandKind,
        remote: Remote,
        elem: u8,
        layout: Layout<'_>,
        n: usize,
        chunk: usize,
        implicit: bool,
        mut fill: impl FnMut(&mut Command, &mut Vec<u8>, usize, usize) -> Result<(), GniError>,
    ) -> Result<u64, GniError> {
        if n == 0 {
            return Err(GniError::Remote(Status::BadRequest));
        }
        if let Layout::Indexed(idx) = layout {
            if idx.len() < n {
                return Err(GniError::Remote(Status::BadRequest));
            }
        }
        let mut buf = std::mem::take(&mut self.scatter_buf);
        let r = self.post_vector_parts(
            kind, remote, elem, layout, n, chunk, implicit, &mut buf, &mut fill,
        );
        self.scatter_buf = buf;
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn post_vector_parts(
        &mut self,
        kind: CommandKind,
        remote: Remote,
        elem: u8,
        layout: Layout<'_>,
        n: usize,
        chunk: usize,
        implicit: bool,
        buf: &mut Vec<u8>,
        fill: &mut impl FnMut(&mut Command, &mut Vec<u8>, usize, usize) -> Result<(), GniError>,
    ) -> Result<u64, GniError> {
        let mut last = None;
        let mut first = 0;
        while first < n {
            let k = chunk.min(n - first);
            if let (Some(prev), false) = (last, implicit) {
                self.ep.finish(prev)?;
            }
            let mut c = self.cmd(kind, remote, 0)?;
            c.elem = elem;
            c.nelems = k as u32;
            buf.clear();
            match layout {
                Layout::Strided(stride) => {
                    c.remote_off = offset_of(remote.offset, first, stride)?;
                    c.operand = stride as u64;
                }
                Layout::Indexed(idx) => {
                    c.indexed = true;
                    for o in &idx[first..first + k] {
                        buf.extend_from_slice(&o.to_le_bytes());
                    }
                    c.len = buf.len() as u64;
                }
            }
            fill(&mut c, buf, first, k)?;
            last = Some(self.ep.post(c, buf, implicit)?);
            first += k;
        }
        Ok(last.expect("n > 0 elements make a command"))
    }

    /// Posts a PE-strided operation (`nic::host::ixpe`) on `handle` at `offset` of every rank
    /// in `ranks`: `Put` sends `data` (`per` bytes) to each, `Scatter` slice i of `data` to
    /// rank i, `Gather` fetches `per` bytes from each into `local` (region, offset), rank i's
    /// at `offset + i·per`. The initiator's NIC fans it out; one request per command, and a
    /// list too long for one command's inline room is split over several. `None` when a
    /// single target's data does not fit in a command (the caller puts it some other way).
    #[allow(clippy::too_many_arguments)]
    pub fn post_ixpe(
        &mut self,
        mode: IxpeMode,
        handle: MemHandle,
        offset: u64,
        ranks: &[u32],
        data: &[u8],
        per: usize,
        local: Option<(MemHandle, u64)>,
        implicit: bool,
    ) -> Result<Option<Vec<u64>>, GniError> {
        let room = self.ep.client().max_inline();
        let each = IXPE_ENTRY
            + match mode {
                IxpeMode::Scatter => per,
                _ => 0,
            };
        let shared = if mode == IxpeMode::Put { per } else { 0 };
        if room < shared + each {
            return Ok(None);
        }
        let chunk = ((room - shared) / each).max(1);
        let mut buf = std::mem::take(&mut self.scatter_buf);
        let mut reqs = Vec::with_capacity(ranks.len().div_ceil(chunk));
        for (k, group) in ranks.chunks(chunk).enumerate() {
            buf.clear();
            for &r in group {
                let host = self.ep.rank_host(r)?;
                buf.extend_from_slice(&r.to_le_bytes());
                buf.extend_from_slice(&host.to_le_bytes());
                buf.extend_from_slice(&[0, 0]);
            }
            let first = k * chunk;
            match mode {
                IxpeMode::Put => buf.extend_from_slice(&data[..per]),
                IxpeMode::Scatter => {
                    buf.extend_from_slice(&data[first * per..(first + group.len()) * per])
                }
                IxpeMode::Gather => {}
            }
            let mut c = Command {
                kind: CommandKind::Ixpe,
                host: self.ep.rank_host(self.rank())?,
                rank: self.rank(),
                remote_region: handle.0,
                remote_off: offset,
                len: buf.len() as u64,
                operand: mode as u64,
                operand2: per as u64,
                nelems: group.len() as u32,
                ..Default::default()
            };
            if let Some((h, off)) = local {
                c.local_region = h.0;
                c.local_off = off + (first * per) as u64;
            }
            match self.ep.post(c, &buf, implicit) {
                Ok(r) => reqs.push(r),
                Err(e) => {
                    self.scatter_buf = buf;
                    return Err(e);
                }
            }
        }
        self.scatter_buf = buf;
        Ok(Some(reqs))
    }

    /// Posts a command built by a layer above (DMAPP) and returns its request id.
    pub fn post_raw(&mut self, c: Command, inline: &[u8], implicit: bool) -> Result<u64, GniError> {
        self.ep.post(c, inline, implicit)
    }

    /// A command of `kind` aimed at `dst`, for a layer above to complete and post.
    pub fn command(&self, kind: CommandKind, dst: Remote, len: usize) -> Result<Command, GniError> {
        self.cmd(kind, dst, len)
    }

    /// Waits for a request posted with [`Nic::post_raw`] or a `post_*_vector`; its value.
    pub fn wait_req(&mut self, req: u64) -> Result<u64, GniError> {
        self.ep.finish(req)
    }

    // ------------------------------------------------------------ AMOs

    fn amo_cmd(
        &self,
        op: AmoOp,
        dst: Remote,
        operand: u64,
        operand2: u64,
    ) -> Result<Command, GniError> {
        let mut c = self.cmd(CommandKind::Amo, dst, 8)?;
        c.amo = Some(op);
        c.operand = operand;
        c.operand2 = operand2;
        Ok(c)
    }

    /// Blocking AMO; returns the previous value for fetching AMOs (0 otherwise).
    /// `operand2` is AFAX's xor mask and ACSWAP's comperand.
    pub fn amo(
        &mut self,
        op: AmoOp,
        dst: Remote,
        operand: u64,
        operand2: u64,
    ) -> Result<u64, GniError> {
        let c = self.amo_cmd(op, dst, operand, operand2)?;
        let req = self.ep.post(c, &[], false)?;
        self.ep.finish(req)
    }

    pub fn amo_nb(
        &mut self,
        op: AmoOp,
        dst: Remote,
        operand: u64,
        operand2: u64,
    ) -> Result<SyncId, GniError> {
        let c = self.amo_cmd(op, dst, operand, operand2)?;
        self.ep.post(c, &[], false).map(SyncId)
    }

    /// Non-blocking implicit AMO (its fetched value, if any, is discarded).
    pub fn amo_nbi(
        &mut self,
        op: AmoOp,
        dst: Remote,
        operand: u64,
        operand2: u64,
    ) -> Result<(), GniError> {
        let c = self.amo_cmd(op, dst, operand, operand2)?;
        self.ep.post(c, &[], true).map(|_| ())
    }

    /// Non-blocking implicit vector of non-fetching AMOs (AADD AAND AOR AXOR) on one rank's
    /// region: `updates` are `(byte offset, operand)` pairs, applied by the target NIC with
    /// CPU atomics. One command and one completion for the whole vector: the aggregation that
    /// bucketed RandomAccess and similar irregular update codes need. Failures surface at
    /// [`Nic::gsync_wait`].
    pub fn amo_scatter_nbi(
        &mut self,
        op: AmoOp,
        rank: u32,
        handle: MemHandle,
        updates: &[(u64, u64)],
    ) -> Result<(), GniError> {
        if op.is_fetching() {
            return Err(GniError::Remote(Status::BadRequest));
        }
        let per = (self.ep.client().max_inline() / 16).max(1);
        let mut buf = std::mem::take(&mut self.scatter_buf);
        for chunk in updates.chunks(per) {
            buf.clear();
            for &(off, v) in chunk {
                buf.extend_from_slice(&off.to_le_bytes());
                buf.extend_from_slice(&v.to_le_bytes());
            }
            let mut c = self.cmd(
                CommandKind::AmoScatter,
                Remote {
                    rank,
                    handle,
                    offset: 0,
                },
                buf.len(),
            )?;
            c.amo = Some(op);
            let r = self.ep.post(c, &buf, true);
            if let Err(e) = r {
                self.scatter_buf = buf;
                return Err(e);
            }
        }
        self.scatter_buf = buf;
        Ok(())
    }

    pub fn afadd(&mut self, dst: Remote, v: u64) -> Result<u64, GniError> {
        self.amo(AmoOp::Afadd, dst, v, 0)
    }

    /// Compare-and-swap: if the word equals `compare`, store `swap`; returns the old value.
    pub fn acswap(&mut self, dst: Remote, swap: u64, compare: u64) -> Result<u64, GniError> {
        self.amo(AmoOp::Acswap, dst, swap, compare)
    }
}
