//! PE-strided RMA (seed 001 §2.2.3): one call to a list of PEs at a symmetric address —
//! `put_ixpe` (the same data to each), `scatter_ixpe` (slice i to list entry i) and
//! `gather_ixpe` (slice i from list entry i, in list order). Always FMA. The initiator's NIC
//! fans the list out (`nic::host::ixpe`) and answers with one completion; one sync id (or one
//! blocking wait) for the whole list.

use crate::client::MemHandle;
use crate::gni::IxpeMode;

use super::error::err;
use super::{Dmapp, DmappError, Mode, Rc, Reqs, SegDesc, SyncId, Type};

impl Dmapp {
    fn check_ixpe(&self, seg: &SegDesc, pes: &[u32]) -> Result<(), DmappError> {
        if !self.is_symmetric(seg) {
            return err(
                Rc::InvalidParam,
                "PE-strided calls need a symmetric address (the heap or the data segment)",
            );
        }
        for &pe in pes {
            self.check_pe(pe)?;
        }
        Ok(())
    }

    /// Puts `per` bytes for each PE of the list: `slice(i)` is PE i's data.
    #[allow(clippy::too_many_arguments)]
    fn fan_out_put(
        &mut self,
        mode: Mode,
        target_addr: u64,
        seg: &SegDesc,
        pes: &[u32],
        src: &[u8],
        per: usize,
        scatter: bool,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        self.check_ixpe(seg, pes)?;
        Self::check_align(ty, "target address", target_addr)?;
        Self::check_align(ty, "source address", src.as_ptr() as u64)?;
        if per == 0 || pes.is_empty() {
            return self.done(mode);
        }
        for &pe in pes {
            self.remote(target_addr, seg, pe, per as u64)?;
        }
        self.counters.fma_ops += 1;
        let how = if scatter {
            IxpeMode::Scatter
        } else {
            IxpeMode::Put
        };
        let data = if scatter {
            &src[..per * pes.len()]
        } else {
            &src[..per]
        };
        let offset = target_addr - seg.addr;
        let implicit = mode == Mode::Nbi;
        let handle = MemHandle(seg.handle);
        if let Some(reqs) = self
            .nic
            .post_ixpe(how, handle, offset, pes, data, per, None, implicit)?
        {
            return self.finish(mode, Reqs::Many(reqs));
        }
        // A target's share does not fit in one command: one put per PE instead.
        let mut reqs = Vec::with_capacity(pes.len());
        for (i, &pe) in pes.iter().enumerate() {
            let dst = self.remote(target_addr, seg, pe, per as u64)?;
            let part = if scatter {
                &data[i * per..(i + 1) * per]
            } else {
                data
            };
            let posted = self.post_inline(dst, part, implicit)?;
            reqs.extend_from_slice(posted.as_slice());
        }
        self.finish(mode, Reqs::Many(reqs))
    }

    #[allow(clippy::too_many_arguments)]
    fn put_ixpe_any(
        &mut self,
        mode: Mode,
        target_addr: u64,
        target_seg: &SegDesc,
        target_pes: &[u32],
        src: &[u8],
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        let per = Self::bytes_of(nelems, ty, src.len(), "source")?;
        self.fan_out_put(
            mode,
            target_addr,
            target_seg,
            target_pes,
            src,
            per,
            false,
            ty,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn scatter_ixpe_any(
        &mut self,
        mode: Mode,
        target_addr: u64,
        target_seg: &SegDesc,
        target_pes: &[u32],
        src: &[u8],
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        let total = nelems
            .checked_mul(target_pes.len() as u64)
            .ok_or_else(|| super::DmappError::new(Rc::InvalidParam, "element count overflows"))?;
        Self::bytes_of(total, ty, src.len(), "source")?;
        let per = nelems as usize * ty.size();
        self.fan_out_put(
            mode,
            target_addr,
            target_seg,
            target_pes,
            src,
            per,
            true,
            ty,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn gather_ixpe_any(
        &mut self,
        mode: Mode,
        target: &mut [u8],
        source_addr: u64,
        source_seg: &SegDesc,
        source_pes: &[u32],
        nelems: u64,
        ty: Type,
    ) -> Result<Option<SyncId>, DmappError> {
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        self.check_ixpe(source_seg, source_pes)?;
        let total = nelems
            .checked_mul(source_pes.len() as u64)
            .ok_or_else(|| super::DmappError::new(Rc::InvalidParam, "element count overflows"))?;
        let all = Self::bytes_of(total, ty, target.len(), "target buffer")?;
        if all == 0 {
            return err(Rc::InvalidParam, "zero-length get");
        }
        Self::check_align(ty, "source address", source_addr)?;
        Self::check_align(ty, "target address", target.as_ptr() as u64)?;
        let per = nelems as usize * ty.size();
        for &pe in source_pes {
            self.remote(source_addr, source_seg, pe, per as u64)?;
        }
        let l = self.local(target.as_ptr(), all)?;
        self.counters.fma_ops += 1;
        let implicit = mode == Mode::Nbi;
        let posted = self.nic.post_ixpe(
            IxpeMode::Gather,
            MemHandle(source_seg.handle),
            source_addr - source_seg.addr,
            source_pes,
            &[],
            per,
            Some((l.handle, l.off)),
            implicit,
        )?;
        let reqs = match posted {
            Some(reqs) => reqs,
            // (A gather command carries no data: it always fits.)
            None => return err(Rc::ResourceError, "PE list does not fit in a command"),
        };
        for &req in &reqs {
            self.track(mode, req, l, all);
        }
        self.finish(mode, Reqs::Many(reqs))
    }
}

forms!(
    /// `dmapp_put_ixpe`: `nelems` elements of `src` to `target_addr` of every listed PE.
    put_ixpe_any => put_ixpe, put_ixpe_nb, put_ixpe_nbi
    (target_addr: u64, target_seg: &SegDesc, target_pes: &[u32], src: &[u8], nelems: u64,
     ty: Type)
);
forms!(
    /// `dmapp_scatter_ixpe`: list entry i gets elements `i·nelems..(i+1)·nelems` of `src`.
    scatter_ixpe_any => scatter_ixpe, scatter_ixpe_nb, scatter_ixpe_nbi
    (target_addr: u64, target_seg: &SegDesc, target_pes: &[u32], src: &[u8], nelems: u64,
     ty: Type)
);
forms!(
    /// `dmapp_gather_ixpe`: `nelems` elements from each listed PE, concatenated in list order.
    gather_ixpe_any => gather_ixpe, gather_ixpe_nb, gather_ixpe_nbi
    (target: &mut [u8], source_addr: u64, source_seg: &SegDesc, source_pes: &[u32],
     nelems: u64, ty: Type)
);
