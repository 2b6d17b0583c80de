//! Communication calls: put, get, accumulate, get_accumulate, fetch_and_op,
//! compare_and_swap, their request-based forms, and MINLOC/MAXLOC accumulates.

use std::time::{Duration, Instant};

use crate::portals::{AckReq, AtomicOp, Datatype, Target};

use super::super::coll::{bytes, bytes_mut, Op, Type};
use super::super::error::{err, ErrorClass, MpiError};
use super::super::loc::Loc;
use super::{neutral, RmaRequest, Win, ACC_LOCK, STAGING};

/// Largest piece of a put or get staged at once.
const CHUNK: usize = STAGING / 2;

impl Win {
    /// The MD to issue on and the `user_ptr` of the next piece (of request `req`, if any).
    /// Called after the piece is staged (`stage` made room in the event queue too).
    fn via(
        &mut self,
        req: Option<u64>,
        copy: Option<(u64, *mut u8, usize)>,
    ) -> Result<(u32, u64), MpiError> {
        match req {
            None => Ok((self.md, 0)),
            Some(id) => Ok((self.md_req, self.rq.borrow_mut().piece(id, copy)?)),
        }
    }

    /// Issues one piece; a failed call takes back its request piece.
    pub(super) fn issue(
        &mut self,
        req: Option<u64>,
        call: impl FnOnce(&mut crate::mpi::state::State) -> Result<(), crate::portals::PortalsError>,
    ) -> Result<(), MpiError> {
        match self.with_st(|st| Ok(call(st)?)) {
            Ok(()) => {
                self.issued += 1;
                Ok(())
            }
            Err(e) => {
                if let Some(id) = req {
                    self.rq.borrow_mut().unissue(id);
                }
                Err(e)
            }
        }
    }

    /// Runs `body` as request `id`'s issuing and returns the request.
    fn request<'a>(
        &mut self,
        body: impl FnOnce(&mut Self, u64) -> Result<(), MpiError>,
    ) -> Result<RmaRequest<'a>, MpiError> {
        let id = self.rq.borrow_mut().begin();
        let r = body(self, id);
        self.rq.borrow_mut().seal(id, r.is_ok());
        r.map(|()| RmaRequest::new(&self.rq, id))
    }

    fn put_inner(
        &mut self,
        origin: &[u8],
        rank: u32,
        disp: u64,
        req: Option<u64>,
    ) -> Result<(), MpiError> {
        self.send_pieces(origin, CHUNK, rank, disp, req, None)
    }

    /// `data` to `disp` bytes into `rank`'s window in pieces of at most `piece` bytes, each
    /// staged and sent as a put, or (`atomic`) as an atomic with that operation.
    fn send_pieces(
        &mut self,
        data: &[u8],
        piece: usize,
        rank: u32,
        disp: u64,
        req: Option<u64>,
        atomic: Option<(AtomicOp, Datatype)>,
    ) -> Result<(), MpiError> {
        self.dest(rank, disp, data.len() as u64)?;
        let ack = if req.is_some() {
            AckReq::Ack
        } else {
            AckReq::CtAck
        };
        for (i, chunk) in data.chunks(piece).enumerate() {
            let t = self.dest(rank, disp + (i * piece) as u64, chunk.len() as u64)?;
            let at = self.stage(chunk.len())?;
            self.staging.bytes()[at as usize..at as usize + chunk.len()].copy_from_slice(chunk);
            let (md, ptr) = self.via(req, None)?;
            let len = chunk.len() as u64;
            self.issue(req, |st| match atomic {
                None => st.p.put(st.ni, md, at, len, ack, t, ptr, 0),
                Some((a, dt)) => st.p.atomic(st.ni, md, at, len, ack, t, ptr, 0, a, dt),
            })?;
        }
        Ok(())
    }

    /// MPI_Put: `origin` to `disp` bytes into `rank`'s window (copied: reusable at once).
    pub fn put(&mut self, origin: &[u8], rank: u32, disp: u64) -> Result<(), MpiError> {
        self.put_inner(origin, rank, disp, None)
    }

    /// MPI_Rput: as `put`; the request completes when the data is in place at the target.
    pub fn rput(
        &mut self,
        origin: &[u8],
        rank: u32,
        disp: u64,
    ) -> Result<RmaRequest<'static>, MpiError> {
        self.request(|w, id| w.put_inner(origin, rank, disp, Some(id)))
    }

    /// MPI_Get, completed before it returns (the result is in `origin`).
    pub fn get(&mut self, origin: &mut [u8], rank: u32, disp: u64) -> Result<(), MpiError> {
        self.dest(rank, disp, origin.len() as u64)?;
        for (i, chunk) in origin.chunks_mut(CHUNK).enumerate() {
            let t = self.dest(rank, disp + (i * CHUNK) as u64, chunk.len() as u64)?;
            let at = self.stage(chunk.len())?;
            let md = self.md;
            self.issue(None, |st| st.p.get(st.ni, md, at, chunk.len() as u64, t, 0))?;
            self.flush_all_inner()?;
            chunk.copy_from_slice(&self.staging.bytes()[at as usize..at as usize + chunk.len()]);
        }
        Ok(())
    }

    /// MPI_Rget: the result lands in `origin` by the time the request completes.
    pub fn rget<'a>(
        &mut self,
        origin: &'a mut [u8],
        rank: u32,
        disp: u64,
    ) -> Result<RmaRequest<'a>, MpiError> {
        self.request(|w, id| {
            w.dest(rank, disp, origin.len() as u64)?;
            for (i, chunk) in origin.chunks_mut(CHUNK).enumerate() {
                let t = w.dest(rank, disp + (i * CHUNK) as u64, chunk.len() as u64)?;
                let at = w.stage(chunk.len())?;
                let (md, ptr) = w.via(Some(id), Some((at, chunk.as_mut_ptr(), chunk.len())))?;
                w.issue(Some(id), |st| {
                    st.p.get(st.ni, md, at, chunk.len() as u64, t, ptr)
                })?;
            }
            Ok(())
        })
    }

    /// Bytes per atomic piece of `w`-byte elements: max_atomic_size, and max_ordered_size
    /// too when accumulates are ordered (the window's `accumulate_ordering`).
    fn atomic_piece(&self, w: usize, fetching: bool) -> usize {
        let st = self.comm.st.borrow();
        let l = &st.limits;
        let mut max = if fetching {
            l.max_fetch_atomic_size
        } else {
            l.max_atomic_size
        };
        if self.info.accumulate_ordering {
            max = max.min(l.max_ordered_size);
        }
        (max as usize / w * w).max(w)
    }

    fn accumulate_inner(
        &mut self,
        b: &[u8],
        w: usize,
        rank: u32,
        disp: u64,
        op: (AtomicOp, Datatype),
        req: Option<u64>,
    ) -> Result<(), MpiError> {
        let piece = self.atomic_piece(w, false);
        self.send_pieces(b, piece, rank, disp, req, Some(op))
    }

    /// MPI_Accumulate: element-wise `op` into `rank`'s window by the target's NIC (atomic per
    /// element; REPLACE is a put). MINLOC/MAXLOC: [`Win::accumulate_loc`].
    pub fn accumulate<T: Type>(
        &mut self,
        origin: &[T],
        rank: u32,
        disp: u64,
        op: Op,
    ) -> Result<(), MpiError> {
        if op == Op::Replace {
            return self.put(bytes(origin), rank, disp);
        }
        let a = op.atomic(T::DT)?;
        self.accumulate_inner(bytes(origin), size_of::<T>(), rank, disp, (a, T::DT), None)
    }

    /// MPI_Raccumulate.
    pub fn raccumulate<T: Type>(
        &mut self,
        origin: &[T],
        rank: u32,
        disp: u64,
        op: Op,
    ) -> Result<RmaRequest<'static>, MpiError> {
        if op == Op::Replace {
            return self.rput(bytes(origin), rank, disp);
        }
        let a = op.atomic(T::DT)?;
        self.request(|w, id| {
            w.accumulate_inner(
                bytes(origin),
                size_of::<T>(),
                rank,
                disp,
                (a, T::DT),
                Some(id),
            )
        })
    }

    /// The fetching atomic and operand `op` means for get_accumulate/fetch_and_op: REPLACE is
    /// a swap, NO_OP an add of the neutral element (every value preserved, floats' too).
    fn fetching<T: Type>(op: Op) -> Result<(AtomicOp, Option<T>), MpiError> {
        Ok(match op {
            Op::Replace => (AtomicOp::Swap, None),
            Op::NoOp => (AtomicOp::Sum, Some(neutral::<T>())),
            _ => (op.atomic(T::DT)?, None),
        })
    }

    /// Issues get_accumulate pieces of `origin` into staging; returns where each piece's
    /// result lands (staging offset, offset in the result, length).
    fn get_accumulate_inner<T: Type>(
        &mut self,
        origin: &[T],
        result: *mut u8,
        rank: u32,
        disp: u64,
        op: Op,
        req: Option<u64>,
    ) -> Result<Vec<(u64, usize, usize)>, MpiError> {
        let (a, fill) = Self::fetching::<T>(op)?;
        let w = size_of::<T>();
        let src: Vec<u8> = match fill {
            Some(v) => bytes(&vec![v; origin.len()]).to_vec(),
            None => bytes(origin).to_vec(),
        };
        self.dest(rank, disp, src.len() as u64)?;
        let piece = self.atomic_piece(w, true);
        let mut out = Vec::new();
        for (i, chunk) in src.chunks(piece).enumerate() {
            let off = i * piece;
            let t = self.dest(rank, disp + off as u64, chunk.len() as u64)?;
            // Both halves at once: one `stage` can flush, two could hand out overlapping room.
            let put_at = self.stage(2 * chunk.len().next_multiple_of(8))?;
            let get_at = put_at + chunk.len().next_multiple_of(8) as u64;
            self.staging.bytes()[put_at as usize..put_at as usize + chunk.len()]
                .copy_from_slice(chunk);
            // SAFETY: `result` is as long as `origin` (checked by the callers).
            let to = unsafe { result.add(off) };
            let (md, ptr) = self.via(req, Some((get_at, to, chunk.len())))?;
            let len = chunk.len() as u64;
            self.issue(req, |st| {
                if a.is_swap() {
                    st.p.swap(st.ni, md, get_at, md, put_at, len, t, ptr, 0, &[], a, T::DT)
                } else {
                    st.p.fetch_atomic(st.ni, md, get_at, md, put_at, len, t, ptr, 0, a, T::DT)
                }
            })?;
            out.push((get_at, off, chunk.len()));
            if req.is_none() && self.staged + 2 * piece > STAGING {
                // The next pieces would reuse staging: take these results first.
                self.flush_all_inner()?;
                for (at, o, n) in out.drain(..) {
                    // SAFETY: as above.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.staging.bytes()[at as usize..].as_ptr(),
                            result.add(o),
                            n,
                        )
                    };
                }
            }
        }
        Ok(out)
    }

    /// MPI_Get_accumulate: `result` gets the target's old values, then `op` applies `origin`
    /// there element by element, atomically per element (REPLACE swaps, NO_OP only fetches and
    /// ignores `origin`, which may then be empty).
    pub fn get_accumulate<T: Type>(
        &mut self,
        origin: &[T],
        result: &mut [T],
        rank: u32,
        disp: u64,
        op: Op,
    ) -> Result<(), MpiError> {
        let origin = Self::fetch_origin(origin, result.len(), op)?;
        let ptr = bytes_mut(result).as_mut_ptr();
        let left = self.get_accumulate_inner(&origin, ptr, rank, disp, op, None)?;
        self.flush_all_inner()?;
        for (at, o, n) in left {
            // SAFETY: inside `result` (its pieces); the staging bytes are the results.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.staging.bytes()[at as usize..].as_ptr(),
                    ptr.add(o),
                    n,
                )
            };
        }
        Ok(())
    }

    /// MPI_Rget_accumulate: as `get_accumulate`, the old values in `result` once the request
    /// completes.
    pub fn rget_accumulate<'a, T: Type>(
        &mut self,
        origin: &[T],
        result: &'a mut [T],
        rank: u32,
        disp: u64,
        op: Op,
    ) -> Result<RmaRequest<'a>, MpiError> {
        let origin = Self::fetch_origin(origin, result.len(), op)?;
        let ptr = bytes_mut(result).as_mut_ptr();
        self.request(|w, id| {
            w.get_accumulate_inner(&origin, ptr, rank, disp, op, Some(id))
                .map(|_| ())
        })
    }

    /// The origin of a fetching accumulate, checked against the result's length (NO_OP needs
    /// none).
    fn fetch_origin<T: Type>(origin: &[T], n: usize, op: Op) -> Result<Vec<T>, MpiError> {
        if op == Op::NoOp {
            return Ok(vec![T::default(); n]);
        }
        if origin.len() != n {
            return err(
                ErrorClass::Count,
                format!(
                    "get_accumulate: {} origin elements, {n} result elements",
                    origin.len()
                ),
            );
        }
        Ok(origin.to_vec())
    }

    /// One fetching atomic of one element: the old value (waits for it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fetch_one(
        &mut self,
        t: Target,
        data: &[u8],
        operand: &[u8],
        op: AtomicOp,
        dt: Datatype,
    ) -> Result<Vec<u8>, MpiError> {
        let w = data.len();
        let src = self.stage(2 * w.next_multiple_of(8))?;
        let dst = src + w.next_multiple_of(8) as u64;
        self.staging.bytes()[src as usize..src as usize + w].copy_from_slice(data);
        let md = self.md;
        self.issue(None, |st| {
            if op.is_swap() {
                st.p.swap(st.ni, md, dst, md, src, w as u64, t, 0, 0, operand, op, dt)
            } else {
                st.p.fetch_atomic(st.ni, md, dst, md, src, w as u64, t, 0, 0, op, dt)
            }
        })?;
        self.flush_all_inner()?;
        let v = self.staging.bytes()[dst as usize..dst as usize + w].to_vec();
        Ok(v)
    }

    /// MPI_Fetch_and_op: the target's old value; `op` may be REPLACE (a swap) or NO_OP.
    pub fn fetch_and_op<T: Type>(
        &mut self,
        value: T,
        rank: u32,
        disp: u64,
        op: Op,
    ) -> Result<T, MpiError> {
        let t = self.dest(rank, disp, size_of::<T>() as u64)?;
        let (a, fill) = Self::fetching::<T>(op)?;
        let old = self.fetch_one(t, bytes(&[fill.unwrap_or(value)]), &[], a, T::DT)?;
        let mut out = [T::default()];
        bytes_mut(&mut out).copy_from_slice(&old);
        Ok(out[0])
    }

    /// MPI_Compare_and_swap: stores `value` if the target equals `compare`; the old value.
    pub fn compare_and_swap<T: Type>(
        &mut self,
        value: T,
        compare: T,
        rank: u32,
        disp: u64,
    ) -> Result<T, MpiError> {
        let t = self.dest(rank, disp, size_of::<T>() as u64)?;
        let old = self.fetch_one(
            t,
            bytes(&[value]),
            bytes(&[compare]),
            AtomicOp::Cswap,
            T::DT,
        )?;
        let mut out = [T::default()];
        bytes_mut(&mut out).copy_from_slice(&old);
        Ok(out[0])
    }

    /// MPI_Accumulate with MINLOC or MAXLOC on (value, index) pairs. The NIC has no pair
    /// atomics, so, as the seed does, the origin holds the target's accumulate mutex around a
    /// get, the combination and a put: atomic with respect to other MINLOC/MAXLOC
    /// accumulates, in any epoch.
    pub fn accumulate_loc<V: Type + PartialOrd>(
        &mut self,
        origin: &[Loc<V>],
        rank: u32,
        disp: u64,
        op: Op,
    ) -> Result<(), MpiError> {
        let l = op.loc()?;
        let b = Loc::encode(origin);
        self.dest(rank, disp, b.len() as u64)?;
        self.retry(rank, "the accumulate mutex", |w| {
            let t = w.ctrl_target(rank, ACC_LOCK);
            let old = w.fetch_one(
                t,
                &1u64.to_le_bytes(),
                &0u64.to_le_bytes(),
                AtomicOp::Cswap,
                Datatype::Uint64,
            )?;
            Ok(old == 0u64.to_le_bytes())
        })?;
        let mut cur = vec![0u8; b.len()];
        let r = self.get(&mut cur, rank, disp).and_then(|()| {
            Loc::<V>::combine(&mut cur, &b, l);
            self.put(&cur, rank, disp)?;
            self.flush_all_inner()
        });
        let t = self.ctrl_target(rank, ACC_LOCK);
        self.fetch_one(
            t,
            &0u64.to_le_bytes(),
            &[],
            AtomicOp::Swap,
            Datatype::Uint64,
        )?;
        r
    }

    /// Calls `attempt` until it succeeds (up to 120 s). For the first millisecond a loser
    /// only yields between tries, so its next attempt is in flight when the holder lets go
    /// (Linux sleeps ≥ 50 µs however short the request); longer waits back off to 200 µs
    /// sleeps.
    pub(super) fn retry(
        &mut self,
        rank: u32,
        what: &str,
        mut attempt: impl FnMut(&mut Self) -> Result<bool, MpiError>,
    ) -> Result<(), MpiError> {
        const SPIN: Duration = Duration::from_millis(1);
        let start = Instant::now();
        let mut backoff = Duration::from_micros(1);
        loop {
            if attempt(self)? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited > Duration::from_secs(120) {
                return err(
                    ErrorClass::Other,
                    format!("{what} on rank {rank} not granted in 120 s"),
                );
            }
            if waited < SPIN {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_micros(200));
        }
    }
}
