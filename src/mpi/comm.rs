//! Communicators (a group of world ranks and a context id) and point-to-point calls on them.
//! Each communicator owns two contexts in the match bits: one for the user's messages and one
//! for its collectives, so neither can match the other.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::rc::Rc;
use std::time::Duration;

use super::bits;
use super::error::{err, ErrorClass, MpiError};
use super::state::{State, Status};

/// MPI_ANY_SOURCE and MPI_ANY_TAG.
pub const ANY_SOURCE: i32 = -1;
pub const ANY_TAG: i32 = -1;
/// MPI_TAG_UB: tags are 0..=TAG_UB.
pub const TAG_UB: i32 = i32::MAX;
/// MPI_UNDEFINED as a split colour: the caller joins no new communicator.
pub const UNDEFINED: i32 = -32766;

/// A communicator (MPI_Comm). Dropping the world communicator finalizes MPI (a barrier, then
/// every operation drained); dropping another frees it (MPI_Comm_free).
pub struct Comm {
    pub(super) st: Rc<RefCell<State>>,
    /// Context id: the user's messages use `2 * ctx`, collectives `2 * ctx + 1`.
    pub(super) ctx: u32,
    /// World rank of each member.
    pub(super) group: Rc<[u32]>,
    pub(super) rank: u32,
    world: bool,
}

/// A pending non-blocking operation on a buffer it borrows (MPI_Request). Dropping it waits
/// for it, so the NIC never writes or reads a buffer that is gone.
pub struct Request<'a> {
    st: Rc<RefCell<State>>,
    id: u32,
    live: bool,
    _buf: PhantomData<&'a mut [u8]>,
}

impl Request<'_> {
    /// MPI_Wait.
    pub fn wait(mut self) -> Result<Status, MpiError> {
        self.live = false;
        self.st.borrow_mut().wait(self.id)
    }

    /// MPI_Test: the status once complete (the request is then spent).
    pub fn test(&mut self) -> Result<Option<Status>, MpiError> {
        if !self.live {
            return err(ErrorClass::Arg, "request already completed");
        }
        let mut st = self.st.borrow_mut();
        st.progress()?;
        if !st.is_done(self.id) {
            return Ok(None);
        }
        self.live = false;
        st.take(self.id).map(Some)
    }
}

impl std::fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("id", &self.id)
            .field("live", &self.live)
            .finish()
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if self.live {
            if std::thread::panicking() {
                // Waiting could hold the unwinding rank forever (the peer may be waiting for
                // it), and not waiting would leave the NIC writing into memory unwinding
                // frees: the rank leaves at once, as a crashed one does.
                std::process::abort();
            }
            let _ = self.st.borrow_mut().wait(self.id);
        }
    }
}

/// MPI_Waitall: every status, or the first error (all are waited for either way).
pub fn wait_all(reqs: Vec<Request<'_>>) -> Result<Vec<Status>, MpiError> {
    let mut out = Vec::with_capacity(reqs.len());
    let mut first = None;
    for r in reqs {
        match r.wait() {
            Ok(s) => out.push(s),
            Err(e) => {
                out.push(Status::default());
                first.get_or_insert(e);
            }
        }
    }
    first.map_or(Ok(out), Err)
}

impl Comm {
    pub(super) fn world(st: State) -> Comm {
        let size = st.size;
        let rank = st.rank;
        Comm {
            st: Rc::new(RefCell::new(st)),
            ctx: 0,
            group: (0..size).collect::<Vec<_>>().into(),
            rank,
            world: true,
        }
    }

    /// MPI_Comm_rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// MPI_Comm_size.
    pub fn size(&self) -> u32 {
        self.group.len() as u32
    }

    /// The members as world ranks, in this communicator's order (MPI_Comm_group).
    pub fn group(&self) -> Vec<u32> {
        self.group.to_vec()
    }

    /// The context id (unique among this rank's live communicators; the same on every member).
    pub fn context_id(&self) -> u32 {
        self.ctx
    }

    /// How collectives run from now on, for every communicator of this rank: the control
    /// variable behind `SOFTNIC_MPI_COLL` (as an MPI_T cvar). Every rank must choose alike
    /// before its next collective.
    pub fn set_coll_mode(&self, mode: super::state::CollMode) {
        self.st.borrow_mut().coll = mode;
    }

    /// How collectives run now (`set_coll_mode`, else `SOFTNIC_MPI_COLL`).
    pub fn coll_mode(&self) -> super::state::CollMode {
        self.st.borrow().coll
    }

    /// The protocol beyond the eager limit now (`set_long_protocol`, else
    /// `SOFTNIC_MPI_LONG`).
    pub fn long_protocol(&self) -> super::state::LongProtocol {
        self.st.borrow().long
    }

    /// The protocol of messages beyond the eager limit from now on, for this rank (the
    /// `SOFTNIC_MPI_LONG` control variable; a receiver handles either, whatever its own).
    pub fn set_long_protocol(&self, p: super::state::LongProtocol) {
        self.st.borrow_mut().long = p;
    }

    /// Library counters (unexpected messages, flow-control refusals and resends…).
    pub fn stats(&self) -> super::state::Stats {
        self.st.borrow().stats
    }

    pub(super) fn check_open(&self) -> Result<(), MpiError> {
        if self.st.borrow().finalized {
            return err(
                ErrorClass::Comm,
                "MPI was finalized (the world communicator dropped)",
            );
        }
        Ok(())
    }

    fn dest(&self, r: i32) -> Result<u32, MpiError> {
        if r < 0 || r as u32 >= self.size() {
            return err(
                ErrorClass::Rank,
                format!("rank {r} is not in this communicator of {}", self.size()),
            );
        }
        Ok(self.group[r as usize])
    }

    fn source(&self, r: i32) -> Result<Option<u32>, MpiError> {
        if r == ANY_SOURCE {
            return Ok(None);
        }
        self.dest(r).map(|_| Some(r as u32))
    }

    fn tag(t: i32, any: bool) -> Result<Option<u32>, MpiError> {
        if any && t == ANY_TAG {
            return Ok(None);
        }
        if t < 0 {
            return err(
                ErrorClass::Tag,
                format!("tag {t}: tags are 0..=TAG_UB ({TAG_UB})"),
            );
        }
        Ok(Some(t as u32))
    }

    fn req<'a>(&self, id: u32) -> Request<'a> {
        Request {
            st: self.st.clone(),
            id,
            live: true,
            _buf: PhantomData,
        }
    }

    // ------------------------------------------------------------ point-to-point

    pub(super) fn isend_ctx<'a>(
        &self,
        buf: &'a [u8],
        dest: i32,
        tag: u32,
        ctx: u32,
    ) -> Result<Request<'a>, MpiError> {
        self.check_open()?;
        let w = self.dest(dest)?;
        let id =
            self.st
                .borrow_mut()
                .isend(buf.as_ptr() as u64, buf.len(), w, ctx, self.rank, tag)?;
        Ok(self.req(id))
    }

    pub(super) fn irecv_ctx<'a>(
        &self,
        buf: &'a mut [u8],
        src: Option<u32>,
        tag: Option<u32>,
        ctx: u32,
    ) -> Result<Request<'a>, MpiError> {
        self.check_open()?;
        let peer = src.map(|s| self.group[s as usize]);
        let id = self.st.borrow_mut().irecv(
            buf.as_mut_ptr() as u64,
            buf.len(),
            ctx,
            (src, peer),
            tag,
        )?;
        Ok(self.req(id))
    }

    /// MPI_Isend (standard mode): short messages are copied and complete at once; long ones
    /// when the receiver has them.
    pub fn isend<'a>(&self, buf: &'a [u8], dest: i32, tag: i32) -> Result<Request<'a>, MpiError> {
        let t = Self::tag(tag, false)?.expect("not a wildcard");
        self.isend_ctx(buf, dest, t, 2 * self.ctx)
    }

    /// MPI_Send.
    pub fn send(&self, buf: &[u8], dest: i32, tag: i32) -> Result<(), MpiError> {
        self.isend(buf, dest, tag)?.wait().map(|_| ())
    }

    /// MPI_Irecv (`src` may be ANY_SOURCE, `tag` ANY_TAG).
    pub fn irecv<'a>(
        &self,
        buf: &'a mut [u8],
        src: i32,
        tag: i32,
    ) -> Result<Request<'a>, MpiError> {
        let (s, t) = (self.source(src)?, Self::tag(tag, true)?);
        self.irecv_ctx(buf, s, t, 2 * self.ctx)
    }

    /// MPI_Recv: a message longer than `buf` gives MPI_ERR_TRUNCATE.
    pub fn recv(&self, buf: &mut [u8], src: i32, tag: i32) -> Result<Status, MpiError> {
        self.irecv(buf, src, tag)?.wait()
    }

    /// MPI_Sendrecv.
    pub fn sendrecv(
        &self,
        send: &[u8],
        dest: i32,
        send_tag: i32,
        recv: &mut [u8],
        src: i32,
        recv_tag: i32,
    ) -> Result<Status, MpiError> {
        let r = self.irecv(recv, src, recv_tag)?;
        let s = self.isend(send, dest, send_tag)?;
        s.wait()?;
        r.wait()
    }

    /// MPI_Iprobe: a matching message that has arrived, without receiving it.
    pub fn iprobe(&self, src: i32, tag: i32) -> Result<Option<Status>, MpiError> {
        self.check_open()?;
        let (s, t) = (self.source(src)?, Self::tag(tag, true)?);
        self.st.borrow_mut().iprobe(2 * self.ctx, s, t)
    }

    /// MPI_Probe: waits until a matching message has arrived.
    pub fn probe(&self, src: i32, tag: i32) -> Result<Status, MpiError> {
        loop {
            if let Some(s) = self.iprobe(src, tag)? {
                return Ok(s);
            }
            self.st.borrow_mut().wait_event(Duration::from_millis(1))?;
        }
    }

    // ------------------------------------------------------------ communicators

    /// Agrees on a context id free at every member of this communicator (an allreduce of the
    /// free-id bitmaps); `take` marks it used here.
    fn agree_ctx(&self, take: bool) -> Result<u32, MpiError> {
        let mine = self.st.borrow().ctx_free;
        let mut all = mine;
        self.allreduce_words_and(&mine, &mut all)?;
        let Some(id) = all
            .iter()
            .enumerate()
            .find(|(_, w)| **w != 0)
            .map(|(i, w)| i as u32 * 64 + w.trailing_zeros())
        else {
            return err(
                ErrorClass::Other,
                format!(
                    "no context id left: at most {} communicators and windows at once",
                    bits::MAX_CONTEXTS / 2
                ),
            );
        };
        if take {
            self.st.borrow_mut().ctx_free[(id / 64) as usize] &= !(1 << (id % 64));
        }
        Ok(id)
    }

    /// MPI_Comm_dup.
    pub fn dup(&self) -> Result<Comm, MpiError> {
        self.check_open()?;
        let ctx = self.agree_ctx(true)?;
        Ok(Comm {
            st: self.st.clone(),
            ctx,
            group: self.group.clone(),
            rank: self.rank,
            world: false,
        })
    }

    /// MPI_Comm_split: members of the same `color` form a communicator, ordered by `key` then
    /// by rank here; `UNDEFINED` joins none (`None`).
    pub fn split(&self, color: i32, key: i32) -> Result<Option<Comm>, MpiError> {
        self.check_open()?;
        if color < 0 && color != UNDEFINED {
            return err(
                ErrorClass::Arg,
                format!("split colour {color}: must be >= 0 or UNDEFINED"),
            );
        }
        let mine = [color as i64, key as i64];
        let mut all = vec![0i64; 2 * self.size() as usize];
        self.allgather(&mine, &mut all)?;
        let ctx = self.agree_ctx(color != UNDEFINED)?;
        if color == UNDEFINED {
            return Ok(None);
        }
        let mut members: Vec<(i64, u32)> = (0..self.size())
            .filter(|&r| all[2 * r as usize] == color as i64)
            .map(|r| (all[2 * r as usize + 1], r))
            .collect();
        members.sort();
        let group: Vec<u32> = members
            .iter()
            .map(|&(_, r)| self.group[r as usize])
            .collect();
        let rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("a member of its own colour") as u32;
        Ok(Some(Comm {
            st: self.st.clone(),
            ctx,
            group: group.into(),
            rank,
            world: false,
        }))
    }

    /// MPI_Comm_free (the same as dropping it).
    pub fn free(self) {}
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.world {
            // A panicking rank leaves at once: a barrier would hold the job until it timed out.
            if !std::thread::panicking() {
                let _ = self.finalize();
            }
            return;
        }
        let mut st = self.st.borrow_mut();
        st.close_tree(2 * self.ctx + 1);
        st.ctx_free[(self.ctx / 64) as usize] |= 1 << (self.ctx % 64);
    }
}

impl Comm {
    /// MPI_Finalize: a barrier, then every operation of this rank drained.
    fn finalize(&self) -> Result<(), MpiError> {
        if self.st.borrow().finalized {
            return Ok(());
        }
        let r = self.barrier();
        let mut st = self.st.borrow_mut();
        let ctxs: Vec<u32> = st.trees.keys().copied().collect();
        for c in ctxs {
            st.close_tree(c);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while st.outstanding() && std::time::Instant::now() < deadline {
            st.wait_event(Duration::from_millis(10))?;
        }
        st.finalized = true;
        r
    }
}
