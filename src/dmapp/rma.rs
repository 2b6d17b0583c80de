//! One-sided RMA (seed 001 §2.2.2–2.2.3): contiguous, strided, indexed and PE-strided puts and
//! gets, each blocking, non-blocking explicit (`_nb`, a [`SyncId`]) or implicit (`_nbi`).
//!
//! Counts, strides and indices are in elements of the call's [`Type`]. Local buffers are
//! slices; a non-blocking get's buffer receives its bytes by the time the operation is synced,
//! and a non-blocking put's source must stay unchanged until then when the put is offloaded
//! (at least `offload_threshold` bytes; smaller puts copy it into the command at once).

use crate::gni::{Layout, LocalStrided, Remote};
use crate::shm::CommandKind;

use super::error::err;
use super::{Dmapp, DmappError, Local, Mode, Rc, Reqs, SegDesc, SyncId, Type};

impl Dmapp {
    /// Whether a contiguous transfer of `bytes` goes FMA (below the offload threshold, and
    /// small enough to ride in a command).
    fn fma(&self, bytes: usize) -> bool {
        bytes < self.attrs.offload_threshold as usize
            && bytes <= self.nic_ref().client().max_inline()
    }

    fn nic_ref(&self) -> &crate::gni::Nic {
        &self.nic
    }

    /// A sync id already retired by the NIC (a call with nothing to move).
    pub(super) fn done(&mut self, mode: Mode) -> Result<Option<SyncId>, DmappError> {
        let req = self.nic.endpoint().done_req();
        if mode == Mode::Nb {
            return self.finish(mode, Reqs::One(req));
        }
        self.nic.wait_req(req)?;
        Ok(None)
    }

    /// Posts `data` to `dst` as FMA commands of at most a command's inline room each.
    pub(super) fn post_inline(
        &mut self,
        dst: Remote,
        data: &[u8],
        implicit: bool,
    ) -> Result<Reqs, DmappError> {
        let room = self.nic.client().max_inline();
        let mut more = Vec::new();
        let mut at = 0;
        loop {
            let n = (data.len() - at).min(room);
            let c = self.nic.command(
                CommandKind::PutInline,
                Remote {
                    offset: dst.offset + at as u64,
                    ..dst
                },
                n,
            )?;
            let req = self.nic.post_raw(c, &data[at..at + n], implicit)?;
            at += n;
            if at >= data.len() && more.is_empty() {
                return Ok(Reqs::One(req));
            }
            more.push(req);
            if at >= data.len() {
                return Ok(Reqs::Many(more));
            }
        }
    }

    /// Posts a get of `len` bytes from `src` into local `l`.
    fn post_get(
        &mut self,
        l: Local,
        src: Remote,
        len: usize,
        implicit: bool,
    ) -> Result<u64, DmappError> {
        let mut c = self.nic.command(CommandKind::Get, src, len)?;
        c.local_region = l.handle.0;
        c.local_off = l.off;
        Ok(self.nic.post_raw(c, &[], implicit)?)
    }

    // ------------------------------------------------------------ contiguous

    #[allow(clippy::too_many_arguments)]
    fn put_contig(
        &mut self,
        mode: Mode,
        target_addr: u64,
        seg: &SegDesc,
        pe: u32,
        src: &[u8],
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        let n = Self::bytes_of(nelems, ty, src.len(), "source")?;
        Self::check_align(ty, "target address", target_addr)?;
        Self::check_align(ty, "source address", src.as_ptr() as u64)?;
        let dst = self.remote(target_addr, seg, pe, n as u64)?;
        if n == 0 {
            return self.done(mode);
        }
        let implicit = mode == Mode::Nbi;
        let reqs = if self.fma(n) {
            self.counters.fma_ops += 1;
            self.post_inline(dst, &src[..n], implicit)?
        } else {
            self.counters.bte_ops += 1;
            let l = self.local(src.as_ptr(), n)?;
            let mut c = self.nic.command(CommandKind::PutFrom, dst, n)?;
            c.local_region = l.handle.0;
            c.local_off = l.off;
            let req = self.nic.post_raw(c, &[], implicit)?;
            self.track(mode, req, l, n);
            Reqs::One(req)
        };
        self.finish(mode, reqs)
    }

    #[allow(clippy::too_many_arguments)]
    fn get_contig(
        &mut self,
        mode: Mode,
        target: &mut [u8],
        source_addr: u64,
        seg: &SegDesc,
        pe: u32,
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        let n = Self::bytes_of(nelems, ty, target.len(), "target buffer")?;
        if n == 0 {
            return err(Rc::InvalidParam, "zero-length get");
        }
        Self::check_align(ty, "source address", source_addr)?;
        Self::check_align(ty, "target address", target.as_ptr() as u64)?;
        let src = self.remote(source_addr, seg, pe, n as u64)?;
        if self.fma(n) {
            self.counters.fma_ops += 1;
        } else {
            self.counters.bte_ops += 1;
        }
        let l = self.local(target.as_ptr(), n)?;
        let req = self.post_get(l, src, n, mode == Mode::Nbi)?;
        self.track(mode, req, l, n);
        self.finish(mode, Reqs::One(req))
    }

    // ------------------------------------------------------------ strided and indexed

    /// The remote extent of elements at `addr + k·stride` (k < n) of `size` bytes, checked
    /// against the segment; returns the offset of element 0.
    #[allow(clippy::too_many_arguments)]
    fn strided_remote(
        &self,
        addr: u64,
        seg: &SegDesc,
        pe: u32,
        stride_elems: i64,
        n: u64,
        size: usize,
    ) -> Result<Remote, DmappError> {
        let last = addr as i128 + (n as i128 - 1) * stride_elems as i128 * size as i128;
        let lo = (addr as i128).min(last);
        let hi = (addr as i128).max(last) + size as i128;
        let (Ok(lo), Ok(hi)) = (u64::try_from(lo), u64::try_from(hi)) else {
            return err(
                Rc::TransactionError,
                "strided range leaves the address space",
            );
        };
        let whole = self.remote(lo, seg, pe, hi - lo)?;
        Ok(Remote {
            offset: whole.offset + (addr - lo),
            ..whole
        })
    }

    /// Element offsets `addr + idx[k]·size` in the segment (k < n), each inside it.
    fn indexed_offsets(
        &self,
        addr: u64,
        seg: &SegDesc,
        pe: u32,
        idx: &[i64],
        n: usize,
        size: usize,
    ) -> Result<(Remote, Vec<u64>), DmappError> {
        if idx.len() < n {
            return err(
                Rc::InvalidParam,
                format!("{n} elements but {} indices", idx.len()),
            );
        }
        let base = self.remote(seg.addr, seg, pe, 0)?;
        let mut offs = Vec::with_capacity(n);
        for &i in &idx[..n] {
            let a = addr as i128 + i as i128 * size as i128;
            let ok = u64::try_from(a).ok().filter(|a| {
                *a >= seg.addr
                    && a.checked_add(size as u64)
                        .is_some_and(|e| e <= seg.addr + seg.len)
            });
            match ok {
                Some(a) => offs.push(a - seg.addr),
                None => {
                    return err(
                        Rc::TransactionError,
                        format!("index {i} puts an element outside the segment"),
                    )
                }
            }
        }
        Ok((base, offs))
    }

    /// Strided source elements `k·sst` of `src` packed in order.
    fn pack(src: &[u8], sst: usize, n: usize, size: usize) -> Result<Vec<u8>, DmappError> {
        let need = (n - 1)
            .checked_mul(sst)
            .and_then(|x| x.checked_mul(size))
            .and_then(|x| x.checked_add(size));
        if need.is_none_or(|need| need > src.len()) {
            return err(
                Rc::InvalidParam,
                format!("{n} elements at source stride {sst} do not fit in the source slice"),
            );
        }
        let mut out = Vec::with_capacity(n * size);
        for k in 0..n {
            let at = k * sst * size;
            out.extend_from_slice(&src[at..at + size]);
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn iput_any(
        &mut self,
        mode: Mode,
        target_addr: u64,
        seg: &SegDesc,
        pe: u32,
        src: &[u8],
        tst: i64,
        sst: usize,
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        if tst == 0 || sst == 0 {
            return err(Rc::InvalidParam, "stride 0");
        }
        Self::check_align(ty, "target address", target_addr)?;
        Self::check_align(ty, "source address", src.as_ptr() as u64)?;
        if nelems == 0 {
            self.check_pe(pe)?;
            return self.done(mode);
        }
        let size = ty.size();
        let packed = Self::pack(src, sst, nelems as usize, size)?;
        let dst = self.strided_remote(target_addr, seg, pe, tst, nelems, size)?;
        self.counters.fma_ops += 1;
        let layout = Layout::Strided(tst * size as i64);
        let req = self
            .nic
            .post_put_vector(dst, size as u8, layout, &packed, mode == Mode::Nbi)?;
        self.finish(mode, Reqs::One(req))
    }

    #[allow(clippy::too_many_arguments)]
    fn iget_any(
        &mut self,
        mode: Mode,
        target: &mut [u8],
        source_addr: u64,
        seg: &SegDesc,
        pe: u32,
        tst: usize,
        sst: i64,
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        if tst == 0 || sst == 0 {
            return err(Rc::InvalidParam, "stride 0");
        }
        if nelems == 0 {
            return err(Rc::InvalidParam, "zero-length get");
        }
        Self::check_align(ty, "source address", source_addr)?;
        Self::check_align(ty, "target address", target.as_ptr() as u64)?;
        let size = ty.size();
        let span = (nelems as usize - 1)
            .checked_mul(tst * size)
            .and_then(|x| x.checked_add(size))
            .filter(|s| *s <= target.len());
        let Some(span) = span else {
            return err(
                Rc::InvalidParam,
                format!("{nelems} elements at target stride {tst} do not fit in the target slice"),
            );
        };
        let src = self.strided_remote(source_addr, seg, pe, sst, nelems, size)?;
        let l = self.local(target.as_ptr(), span)?;
        self.counters.fma_ops += 1;
        let local = LocalStrided {
            handle: l.handle,
            offset: l.off,
            stride: (tst * size) as i64,
        };
        let layout = Layout::Strided(sst * size as i64);
        let req = self.nic.post_get_vector(
            local,
            src,
            size as u8,
            layout,
            nelems as usize,
            mode == Mode::Nbi,
        )?;
        self.track(mode, req, l, span);
        self.finish(mode, Reqs::One(req))
    }

    #[allow(clippy::too_many_arguments)]
    fn ixput_any(
        &mut self,
        mode: Mode,
        target_addr: u64,
        seg: &SegDesc,
        pe: u32,
        src: &[u8],
        tidx: &[i64],
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        let size = ty.size();
        let n = Self::bytes_of(nelems, ty, src.len(), "source")? / size;
        Self::check_align(ty, "target address", target_addr)?;
        Self::check_align(ty, "source address", src.as_ptr() as u64)?;
        if n == 0 {
            self.check_pe(pe)?;
            return self.done(mode);
        }
        let (base, offs) = self.indexed_offsets(target_addr, seg, pe, tidx, n, size)?;
        self.counters.fma_ops += 1;
        let req = self.nic.post_put_vector(
            base,
            size as u8,
            Layout::Indexed(&offs),
            &src[..n * size],
            mode == Mode::Nbi,
        )?;
        self.finish(mode, Reqs::One(req))
    }

    #[allow(clippy::too_many_arguments)]
    fn ixget_any(
        &mut self,
        mode: Mode,
        target: &mut [u8],
        source_addr: u64,
        seg: &SegDesc,
        pe: u32,
        sidx: &[i64],
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        if ty == Type::Byte {
            return err(Rc::NotSupported, "indexed gets of bytes (as Cray's DMAPP)");
        }
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        let size = ty.size();
        let n = Self::bytes_of(nelems, ty, target.len(), "target buffer")? / size;
        if n == 0 {
            return err(Rc::InvalidParam, "zero-length get");
        }
        Self::check_align(ty, "source address", source_addr)?;
        Self::check_align(ty, "target address", target.as_ptr() as u64)?;
        let (base, offs) = self.indexed_offsets(source_addr, seg, pe, sidx, n, size)?;
        let l = self.local(target.as_ptr(), n * size)?;
        self.counters.fma_ops += 1;
        let local = LocalStrided {
            handle: l.handle,
            offset: l.off,
            stride: size as i64,
        };
        let req = self.nic.post_get_vector(
            local,
            base,
            size as u8,
            Layout::Indexed(&offs),
            n,
            mode == Mode::Nbi,
        )?;
        self.track(mode, req, l, n * size);
        self.finish(mode, Reqs::One(req))
    }
}

forms!(
    /// `dmapp_put`: `nelems` elements of `ty` from `src` to `target_addr` of `pe` (in
    /// segment `target_seg`).
    put_contig => put, put_nb, put_nbi
    (target_addr: u64, target_seg: &SegDesc, pe: u32, src: &[u8], nelems: u64, ty: Type)
);
forms!(
    /// `dmapp_get`: `nelems` elements of `ty` from `source_addr` of `pe` into `target`.
    get_contig => get, get_nb, get_nbi
    (target: &mut [u8], source_addr: u64, source_seg: &SegDesc, pe: u32, nelems: u64, ty: Type)
);
forms!(
    /// `dmapp_iput`: element k of `src` (at source stride `sst`) to `target_addr + k·tst`.
    iput_any => iput, iput_nb, iput_nbi
    (target_addr: u64, target_seg: &SegDesc, pe: u32, src: &[u8], tst: i64, sst: usize,
     nelems: u64, ty: Type)
);
forms!(
    /// `dmapp_iget`: element k from `source_addr + k·sst` to `target` at stride `tst`.
    iget_any => iget, iget_nb, iget_nbi
    (target: &mut [u8], source_addr: u64, source_seg: &SegDesc, pe: u32, tst: usize, sst: i64,
     nelems: u64, ty: Type)
);
forms!(
    /// `dmapp_ixput`: element k of `src` to `target_addr + tidx[k]` (in elements).
    ixput_any => ixput, ixput_nb, ixput_nbi
    (target_addr: u64, target_seg: &SegDesc, pe: u32, src: &[u8], tidx: &[i64], nelems: u64,
     ty: Type)
);
forms!(
    /// `dmapp_ixget`: element k from `source_addr + sidx[k]` (in elements) to `target[k]`.
    ixget_any => ixget, ixget_nb, ixget_nbi
    (target: &mut [u8], source_addr: u64, source_seg: &SegDesc, pe: u32, sidx: &[i64],
     nelems: u64, ty: Type)
);
