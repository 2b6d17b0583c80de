//! Collectives. Barrier, and broadcast and allreduce of up to one staging slot, run as trees
//! of triggered operations in the NIC (`triggered`) as `SOFTNIC_MPI_COLL` says (`auto`:
//! beyond two ranks); the rest go over point-to-point messages on the collective context:
//! dissemination barrier, binomial broadcast and reduce, recursive-doubling allreduce (reduce
//! then broadcast when the size is not a power of two), ring allgather. Reductions apply the
//! same element operations the NIC's atomics do (`nic::portals::atomic`).

use crate::nic::portals::atomic::{self, AtomicOp, Datatype};

use super::comm::Comm;
use super::error::{err, ErrorClass, MpiError};
use super::loc::{Loc, LocOp};
use super::state::CollMode;
use super::triggered;

/// Elements MPI can move and reduce: the machine's integers and floats.
///
/// # Safety
/// Implementors are plain numbers: any bit pattern of their size is a value.
pub unsafe trait Type: Copy + Default + 'static {
    const DT: Datatype;
}

macro_rules! types {
    ($($t:ty => $d:ident),*) => { $(unsafe impl Type for $t { const DT: Datatype = Datatype::$d; })* };
}
types!(i8 => Int8, u8 => Uint8, i16 => Int16, u16 => Uint16, i32 => Int32, u32 => Uint32,
       i64 => Int64, u64 => Uint64, f32 => Float, f64 => Double);

/// Reduction operations (MPI_Op).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Sum,
    Prod,
    Min,
    Max,
    Land,
    Lor,
    Lxor,
    Band,
    Bor,
    Bxor,
    /// MPI_REPLACE (accumulate and the fetching ones only).
    Replace,
    /// MPI_NO_OP (get_accumulate and fetch_and_op only).
    NoOp,
    /// MPI_MINLOC and MPI_MAXLOC, on (value, index) pairs ([`Loc`]).
    MinLoc,
    MaxLoc,
}

impl Op {
    /// The NIC's element operation for a reduction with `dt`, or ERR_OP.
    pub(super) fn atomic(self, dt: Datatype) -> Result<AtomicOp, MpiError> {
        let a = match self {
            Op::Sum => AtomicOp::Sum,
            Op::Prod => AtomicOp::Prod,
            Op::Min => AtomicOp::Min,
            Op::Max => AtomicOp::Max,
            Op::Land => AtomicOp::Land,
            Op::Lor => AtomicOp::Lor,
            Op::Lxor => AtomicOp::Lxor,
            Op::Band => AtomicOp::Band,
            Op::Bor => AtomicOp::Bor,
            Op::Bxor => AtomicOp::Bxor,
            Op::Replace | Op::NoOp => {
                return err(ErrorClass::Op, format!("{self:?} is not a reduction"))
            }
            Op::MinLoc | Op::MaxLoc => {
                return err(
                    ErrorClass::Op,
                    format!("{self:?} reduces (value, index) pairs: the *_loc calls take them"),
                )
            }
        };
        if !a.supports(dt) {
            return err(ErrorClass::Op, format!("{self:?} is not defined on {dt:?}"));
        }
        Ok(a)
    }

    /// MINLOC or MAXLOC, or ERR_OP.
    pub(super) fn loc(self) -> Result<LocOp, MpiError> {
        match self {
            Op::MinLoc => Ok(LocOp::Min),
            Op::MaxLoc => Ok(LocOp::Max),
            _ => err(
                ErrorClass::Op,
                format!("{self:?} is not defined on (value, index) pairs: MINLOC or MAXLOC"),
            ),
        }
    }
}

/// How a reduction combines two buffers: an element operation the NIC also applies (and so
/// may run offloaded), or MINLOC/MAXLOC on pairs of one value type.
#[derive(Clone, Copy)]
pub(super) enum Combiner {
    Nic(AtomicOp, Datatype),
    Loc(fn(&mut [u8], &[u8], LocOp), LocOp),
}

impl Combiner {
    fn apply(self, acc: &mut [u8], other: &[u8]) -> Result<(), MpiError> {
        match self {
            Combiner::Nic(op, dt) => combine(acc, other, op, dt),
            Combiner::Loc(f, op) => {
                f(acc, other, op);
                Ok(())
            }
        }
    }
}

pub(super) fn bytes<T: Type>(s: &[T]) -> &[u8] {
    // SAFETY: T is a plain number (Type's contract); the bytes are the slice's own.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

pub(super) fn bytes_mut<T: Type>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes`; any bit pattern written is a valid T.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

/// `acc = acc op other`, element-wise.
fn combine(acc: &mut [u8], other: &[u8], op: AtomicOp, dt: Datatype) -> Result<(), MpiError> {
    // SAFETY: acc is this process's own buffer, valid for its whole length.
    unsafe { atomic::apply(acc.as_mut_ptr(), op, dt, other, &[], None) }
        .map_err(|e| MpiError::new(ErrorClass::Op, format!("{op:?} on {dt:?}: {e:?}")))
}

const BARRIER: u32 = 1;
const BCAST: u32 = 2;
const REDUCE: u32 = 3;
const ALLREDUCE: u32 = 4;
const ALLGATHER: u32 = 5;

impl Comm {
    fn coll_ctx(&self) -> u32 {
        2 * self.ctx + 1
    }

    fn coll_send(&self, buf: &[u8], to: u32, tag: u32) -> Result<(), MpiError> {
        self.isend_ctx(buf, to as i32, tag, self.coll_ctx())?
            .wait()
            .map(|_| ())
    }

    fn coll_recv(&self, buf: &mut [u8], from: u32, tag: u32) -> Result<(), MpiError> {
        self.irecv_ctx(buf, Some(from), Some(tag), self.coll_ctx())?
            .wait()
            .map(|_| ())
    }

    fn coll_exchange(
        &self,
        send: &[u8],
        to: u32,
        recv: &mut [u8],
        from: u32,
        tag: u32,
    ) -> Result<(), MpiError> {
        let r = self.irecv_ctx(recv, Some(from), Some(tag), self.coll_ctx())?;
        let s = self.isend_ctx(send, to as i32, tag, self.coll_ctx())?;
        s.wait()?;
        r.wait().map(|_| ())
    }

    /// Whether this collective of `len` bytes runs offloaded (`SOFTNIC_MPI_COLL`; every
    /// rank decides alike: same mode, same size, same counts).
    fn offloaded(&self, len: usize, reduction: bool) -> bool {
        let st = self.st.borrow();
        let max = if reduction {
            triggered::SLOT.min(st.limits.max_atomic_size as usize)
        } else {
            triggered::SLOT
        };
        let on = match st.coll {
            CollMode::Triggered => true,
            CollMode::P2p => false,
            CollMode::Auto => self.size() > 2,
        };
        on && len <= max && (len > 0 || !reduction)
    }

    /// Before the first offloaded collective: this rank's entries, then a point-to-point
    /// barrier so every member has them.
    fn ensure_tree(&self) -> Result<(), MpiError> {
        if self.st.borrow().has_tree(self.coll_ctx()) {
            return Ok(());
        }
        self.st.borrow_mut().open_tree_for(self.coll_ctx())?;
        self.p2p_barrier()
    }

    /// MPI_Barrier: a tree of triggered puts, or (p2p) dissemination, ⌈log2 n⌉ rounds of
    /// empty messages.
    pub fn barrier(&self) -> Result<(), MpiError> {
        self.check_open()?;
        if self.offloaded(0, false) {
            self.ensure_tree()?;
            return self.st.borrow_mut().tree_bcast(
                self.coll_ctx(),
                &self.group,
                self.rank,
                &mut [],
                0,
                true,
            );
        }
        self.p2p_barrier()
    }

    fn p2p_barrier(&self) -> Result<(), MpiError> {
        let n = self.size();
        let mut k = 1;
        while k < n {
            let to = (self.rank + k) % n;
            let from = (self.rank + n - k) % n;
            self.coll_exchange(&[], to, &mut [], from, BARRIER)?;
            k <<= 1;
        }
        Ok(())
    }

    fn check_root(&self, root: u32) -> Result<(), MpiError> {
        if root >= self.size() {
            return err(
                ErrorClass::Root,
                format!("root {root} is not in this communicator of {}", self.size()),
            );
        }
        Ok(())
    }

    /// MPI_Bcast (binomial tree from `root`).
    pub fn bcast<T: Type>(&self, buf: &mut [T], root: u32) -> Result<(), MpiError> {
        self.check_root(root)?;
        self.bcast_bytes(bytes_mut(buf), root, BCAST)
    }

    fn bcast_bytes(&self, buf: &mut [u8], root: u32, tag: u32) -> Result<(), MpiError> {
        if self.offloaded(buf.len(), false) {
            self.ensure_tree()?;
            return self.st.borrow_mut().tree_bcast(
                self.coll_ctx(),
                &self.group,
                self.rank,
                buf,
                root,
                false,
            );
        }
        let n = self.size();
        let vr = (self.rank + n - root) % n;
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                self.coll_recv(buf, (vr - mask + root) % n, tag)?;
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        while mask > 0 {
            if vr + mask < n {
                self.coll_send(buf, (vr + mask + root) % n, tag)?;
            }
            mask >>= 1;
        }
        Ok(())
    }

    /// MPI_Reduce (binomial tree to `root`); `recv` is written at the root only.
    pub fn reduce<T: Type>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: Op,
        root: u32,
    ) -> Result<(), MpiError> {
        self.check_root(root)?;
        let a = op.atomic(T::DT)?;
        if self.rank == root && recv.len() != send.len() {
            return err(ErrorClass::Count, "reduce: send and receive counts differ");
        }
        let mut acc = bytes(send).to_vec();
        self.reduce_bytes(&mut acc, Combiner::Nic(a, T::DT), root, REDUCE)?;
        if self.rank == root {
            bytes_mut(recv).copy_from_slice(&acc);
        }
        Ok(())
    }

    /// MPI_Reduce with MINLOC or MAXLOC; `recv` is written at the root only.
    pub fn reduce_loc<V: Type + PartialOrd>(
        &self,
        send: &[Loc<V>],
        recv: &mut [Loc<V>],
        op: Op,
        root: u32,
    ) -> Result<(), MpiError> {
        self.check_root(root)?;
        let l = op.loc()?;
        if self.rank == root && recv.len() != send.len() {
            return err(ErrorClass::Count, "reduce: send and receive counts differ");
        }
        let mut acc = Loc::encode(send);
        self.reduce_bytes(&mut acc, Combiner::Loc(Loc::<V>::combine, l), root, REDUCE)?;
        if self.rank == root {
            Loc::decode(&acc, recv);
        }
        Ok(())
    }

    fn reduce_bytes(
        &self,
        acc: &mut [u8],
        how: Combiner,
        root: u32,
        tag: u32,
    ) -> Result<(), MpiError> {
        let n = self.size();
        let vr = (self.rank + n - root) % n;
        let mut tmp = vec![0u8; acc.len()];
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                return self.coll_send(acc, (vr - mask + root) % n, tag);
            }
            if vr + mask < n {
                self.coll_recv(&mut tmp, (vr + mask + root) % n, tag)?;
                how.apply(acc, &tmp)?;
            }
            mask <<= 1;
        }
        Ok(())
    }

    /// MPI_Allreduce: recursive doubling on a power-of-two size, else reduce then broadcast.
    pub fn allreduce<T: Type>(&self, send: &[T], recv: &mut [T], op: Op) -> Result<(), MpiError> {
        let a = op.atomic(T::DT)?;
        if recv.len() != send.len() {
            return err(
                ErrorClass::Count,
                "allreduce: send and receive counts differ",
            );
        }
        let out = bytes_mut(recv);
        out.copy_from_slice(bytes(send));
        self.allreduce_bytes(out, Combiner::Nic(a, T::DT))
    }

    /// MPI_Allreduce with MINLOC or MAXLOC (point-to-point: the NIC has no pair atomics).
    pub fn allreduce_loc<V: Type + PartialOrd>(
        &self,
        send: &[Loc<V>],
        recv: &mut [Loc<V>],
        op: Op,
    ) -> Result<(), MpiError> {
        let l = op.loc()?;
        if recv.len() != send.len() {
            return err(
                ErrorClass::Count,
                "allreduce: send and receive counts differ",
            );
        }
        let mut acc = Loc::encode(send);
        self.allreduce_bytes(&mut acc, Combiner::Loc(Loc::<V>::combine, l))?;
        Loc::decode(&acc, recv);
        Ok(())
    }

    fn allreduce_bytes(&self, acc: &mut [u8], how: Combiner) -> Result<(), MpiError> {
        if let (Combiner::Nic(op, dt), true) = (how, self.offloaded(acc.len(), true)) {
            self.ensure_tree()?;
            return self.st.borrow_mut().tree_allreduce(
                self.coll_ctx(),
                &self.group,
                self.rank,
                acc,
                op,
                dt,
            );
        }
        let n = self.size();
        if !n.is_power_of_two() {
            self.reduce_bytes(acc, how, 0, ALLREDUCE)?;
            return self.bcast_bytes(acc, 0, ALLREDUCE);
        }
        let mut tmp = vec![0u8; acc.len()];
        let mut mask = 1;
        while mask < n {
            let peer = self.rank ^ mask;
            self.coll_exchange(acc, peer, &mut tmp, peer, ALLREDUCE)?;
            // Lower rank's value first: every rank combines in the same order.
            if peer < self.rank {
                how.apply(&mut tmp, acc)?;
                acc.copy_from_slice(&tmp);
            } else {
                how.apply(acc, &tmp)?;
            }
            mask <<= 1;
        }
        Ok(())
    }

    pub(super) fn allreduce_words_and(
        &self,
        mine: &[u64],
        out: &mut [u64],
    ) -> Result<(), MpiError> {
        out.copy_from_slice(mine);
        self.allreduce_bytes(
            bytes_mut(out),
            Combiner::Nic(AtomicOp::Band, Datatype::Uint64),
        )
    }

    /// MPI_Allgather: rank r's `send` lands at `recv[r * send.len()..]` everywhere (ring).
    pub fn allgather<T: Type>(&self, send: &[T], recv: &mut [T]) -> Result<(), MpiError> {
        let n = self.size() as usize;
        let k = send.len();
        if recv.len() != n * k {
            return err(
                ErrorClass::Count,
                format!(
                    "allgather: receive buffer holds {} elements, needs {}",
                    recv.len(),
                    n * k
                ),
            );
        }
        let w = std::mem::size_of_val(send);
        let out = bytes_mut(recv);
        let r = self.rank as usize;
        out[r * w..(r + 1) * w].copy_from_slice(bytes(send));
        let right = ((r + 1) % n) as u32;
        let left = ((r + n - 1) % n) as u32;
        for step in 0..n.saturating_sub(1) {
            let sb = (r + n - step) % n;
            let rb = (r + 2 * n - step - 1) % n;
            let block = out[sb * w..(sb + 1) * w].to_vec();
            self.coll_exchange(
                &block,
                right,
                &mut out[rb * w..(rb + 1) * w],
                left,
                ALLGATHER,
            )?;
        }
        Ok(())
    }
}
