//! Request-based RMA (MPI_Rput, MPI_Rget, MPI_Raccumulate, MPI_Rget_accumulate): each piece
//! of such an operation goes through the window's request MD with `user_ptr` naming its
//! request and piece; its ACK or REPLY event, taken from the window's queue, finishes the
//! piece and, for a fetch, copies the result from staging to the caller's buffer (before the
//! staging space can be reused: every flush drains the queue first).

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::rc::Rc;
use std::time::Instant;

use crate::client::MemRegion;
use crate::portals::{NiFail, PtlError};

use super::super::error::{err, ErrorClass, MpiError};
use super::super::state::State;

/// Pieces per request the `user_ptr` numbering holds.
const PIECE_BITS: u32 = 20;

/// A pending request-based RMA operation on a buffer it borrows (an `rget`'s result). Waiting
/// for it (or dropping it, which waits) means the operation completed at its target — for a
/// fetch, that the result is in the buffer.
pub struct RmaRequest<'a> {
    rq: Rc<RefCell<Pending>>,
    id: u64,
    live: bool,
    _buf: PhantomData<&'a mut [u8]>,
}

impl RmaRequest<'_> {
    pub(super) fn new<'a>(rq: &Rc<RefCell<Pending>>, id: u64) -> RmaRequest<'a> {
        RmaRequest {
            rq: rq.clone(),
            id,
            live: true,
            _buf: PhantomData,
        }
    }

    /// MPI_Wait.
    pub fn wait(mut self) -> Result<(), MpiError> {
        self.live = false;
        Pending::wait(&self.rq, self.id)
    }

    /// MPI_Test: whether it completed (the request is then spent).
    pub fn test(&mut self) -> Result<bool, MpiError> {
        if !self.live {
            return err(ErrorClass::Arg, "request already completed");
        }
        let mut rq = self.rq.borrow_mut();
        rq.drain()?;
        if !rq.done(self.id) {
            return Ok(false);
        }
        self.live = false;
        rq.take(self.id).map(|_| true)
    }
}

impl std::fmt::Debug for RmaRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RmaRequest")
            .field("id", &self.id)
            .field("live", &self.live)
            .finish()
    }
}

impl Drop for RmaRequest<'_> {
    fn drop(&mut self) {
        if self.live {
            let _ = Pending::wait(&self.rq, self.id);
        }
    }
}

/// Where a fetched piece goes once it arrived.
struct Copy {
    at: u64,
    to: *mut u8,
    len: usize,
}

#[derive(Default)]
struct Entry {
    /// Pieces issued and not yet finished.
    left: u32,
    /// Pieces issued so far (the next piece's number).
    issued: u32,
    /// All pieces are issued.
    sealed: bool,
    fail: Option<NiFail>,
    copies: HashMap<u32, Copy>,
    /// Nobody will take it (issuing failed): forget it once finished.
    orphan: bool,
}

/// The window's request-based operations in flight and their event queue.
pub(in super::super) struct Pending {
    st: Rc<RefCell<State>>,
    eq: u32,
    staging: MemRegion,
    next: u64,
    open: HashMap<u64, Entry>,
    /// Pieces in flight (events still to come).
    pub(super) pieces: usize,
}

impl Pending {
    pub(super) fn new(st: Rc<RefCell<State>>, eq: u32, staging: MemRegion) -> Pending {
        Pending {
            st,
            eq,
            staging,
            next: 1,
            open: HashMap::new(),
            pieces: 0,
        }
    }

    pub(super) fn eq(&self) -> u32 {
        self.eq
    }

    /// A new request.
    pub(super) fn begin(&mut self) -> u64 {
        let id = self.next;
        self.next += 1;
        self.open.insert(id, Entry::default());
        id
    }

    /// The `user_ptr` of the next piece of request `id`, which fetches into staging at
    /// `copy.0` for `copy.2` bytes to go to `copy.1`.
    pub(super) fn piece(
        &mut self,
        id: u64,
        copy: Option<(u64, *mut u8, usize)>,
    ) -> Result<u64, MpiError> {
        let e = self.open.get_mut(&id).expect("begun");
        if e.issued >= (1 << PIECE_BITS) - 1 {
            return err(ErrorClass::Count, "one request of more than 2^20 pieces");
        }
        let p = e.issued;
        e.issued += 1;
        e.left += 1;
        self.pieces += 1;
        if let Some((at, to, len)) = copy {
            e.copies.insert(p, Copy { at, to, len });
        }
        Ok(id << PIECE_BITS | p as u64)
    }

    /// A piece that could not be issued after all (its call failed).
    pub(super) fn unissue(&mut self, id: u64) {
        if let Some(e) = self.open.get_mut(&id) {
            e.left -= 1;
            self.pieces -= 1;
        }
    }

    /// Every piece of `id` is issued (`ok`), or issuing failed: nobody waits for it.
    pub(super) fn seal(&mut self, id: u64, ok: bool) {
        if let Some(e) = self.open.get_mut(&id) {
            e.sealed = true;
            e.orphan = !ok;
            if e.orphan && e.left == 0 {
                self.open.remove(&id);
            }
        }
    }

    fn done(&self, id: u64) -> bool {
        self.open.get(&id).is_none_or(|e| e.sealed && e.left == 0)
    }

    fn take(&mut self, id: u64) -> Result<(), MpiError> {
        match self.open.remove(&id).and_then(|e| e.fail) {
            None => Ok(()),
            Some(f) => err(
                ErrorClass::RmaRange,
                format!("a request-based operation failed at its target: {f:?}"),
            ),
        }
    }

    /// Takes every event waiting in the queue.
    pub(super) fn drain(&mut self) -> Result<(), MpiError> {
        loop {
            let r = {
                let mut st = self.st.borrow_mut();
                let ni = st.ni;
                st.p.eq_get(ni, self.eq)
            };
            let e = match r {
                Ok((e, _)) => e,
                Err(PtlError::EqEmpty) => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            let (id, p) = (
                e.user_ptr >> PIECE_BITS,
                (e.user_ptr & ((1 << PIECE_BITS) - 1)) as u32,
            );
            let Some(ent) = self.open.get_mut(&id) else {
                continue;
            };
            ent.left = ent.left.saturating_sub(1);
            self.pieces = self.pieces.saturating_sub(1);
            if e.ni_fail != NiFail::Ok {
                ent.fail.get_or_insert(e.ni_fail);
            }
            if let Some(c) = ent.copies.remove(&p) {
                if e.ni_fail == NiFail::Ok && !ent.orphan {
                    let src = &self.staging.bytes()[c.at as usize..c.at as usize + c.len];
                    // SAFETY: `to` is the buffer the request borrows for its lifetime, at
                    // least `len` long; the request is alive (not orphaned) or being waited.
                    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), c.to, c.len) };
                }
            }
            if ent.orphan && ent.sealed && ent.left == 0 {
                self.open.remove(&id);
            }
        }
    }

    /// Drains until no piece is in flight (the CT says they all completed: their events are
    /// in the queue or about to be).
    pub(super) fn settle(&mut self) -> Result<(), MpiError> {
        let start = Instant::now();
        let mut spins = 0;
        loop {
            self.drain()?;
            if self.pieces == 0 {
                return Ok(());
            }
            let mut st = self.st.borrow_mut();
            let ni = st.ni;
            st.p.idle(&mut spins, start, Some((ni, &[self.eq], &[], &[])))?;
        }
    }

    fn wait(rq: &Rc<RefCell<Pending>>, id: u64) -> Result<(), MpiError> {
        let start = Instant::now();
        let mut spins = 0;
        loop {
            let mut me = rq.borrow_mut();
            me.drain()?;
            if me.done(id) {
                return me.take(id);
            }
            let eq = me.eq;
            let mut st = me.st.borrow_mut();
            let ni = st.ni;
            st.p.idle(&mut spins, start, Some((ni, &[eq], &[], &[])))?;
        }
    }
}
