//! One process's Portals network interface at the NIC: the portal table with its priority and
//! overflow lists and unexpected headers, event queues, counting events, and the delivery of
//! incoming messages — all in the NIC, without the process.
//!
//! Delivery (Portals 4 matching): a message to a disabled entry fails with PT_DISABLED; else the
//! priority list is searched, then the overflow list (a match there also records an unexpected
//! header); with no match the message is dropped — or, on a PTL_PT_FLOWCTRL entry, the entry is
//! disabled (PTL_EVENT_PT_DISABLED) and the message fails with PT_DISABLED, as it does when the
//! entry's event queue or the unexpected-header space runs out. Appending to the priority list
//! first searches the unexpected headers (PTL_EVENT_*_OVERFLOW), atomically with respect to
//! arriving messages because the NIC serialises both.

use std::collections::{HashMap, VecDeque};

use super::atomic::{self, AtomicError};
use super::events::{CtEvent, EventQueue, Limits};
use super::initiator::{Md, OpSpec, Outgoing};
use super::matching::{Linked, MatchEntry, ReqKind};
use super::triggered::Triggered;
use super::types::{
    me, pt, Event, EventKind, List, NiFail, ProcessId, PtlError, SearchOp, StatusRegister,
};
use crate::nic::memory::Region;
use crate::wire::Status;

/// An incoming message as the target NIC sees it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub kind: ReqKind,
    pub initiator: ProcessId,
    pub uid: u32,
    pub pt_index: u32,
    pub match_bits: u64,
    pub remote_offset: u64,
    /// Requested length (the payload's for puts and atomics, the wanted bytes for gets).
    pub rlength: u64,
    pub hdr_data: u64,
    /// Payload of puts, atomics and swaps.
    pub data: &'a [u8],
    /// Comparand or mask of swaps.
    pub operand: &'a [u8],
}

/// What the initiator is told.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Response {
    pub ni_fail: NiFail,
    pub mlength: u64,
    /// The offset actually used in the target entry.
    pub offset: u64,
    /// Whether the target entry allows an acknowledgement (not PTL_ME_ACK_DISABLE).
    pub ack: bool,
    /// Reply data of gets, fetching atomics and swaps.
    pub data: Vec<u8>,
}

impl Response {
    /// The response to a request served in full: no failure, the whole `rlength` matched at
    /// the requested `remote_offset`, no data. What the initiator can rebuild from its own
    /// request, so a target may send only the request's name (`PtlAcks`).
    pub fn in_full(rlength: u64, remote_offset: u64) -> Response {
        Response {
            ni_fail: NiFail::Ok,
            mlength: rlength,
            offset: remote_offset,
            ack: true,
            data: Vec::new(),
        }
    }

    fn fail(f: NiFail) -> Response {
        Response {
            ni_fail: f,
            ack: true,
            ..Default::default()
        }
    }
}

/// A message that landed in an overflow entry and waits for a matching append.
#[derive(Debug, Clone, Copy)]
struct Unexpected {
    kind: ReqKind,
    initiator: ProcessId,
    uid: u32,
    match_bits: u64,
    rlength: u64,
    mlength: u64,
    remote_offset: u64,
    hdr_data: u64,
    /// Where the data lies, within the overflow entry's region.
    start: u64,
    /// The overflow entry holding the data.
    entry: u32,
}

struct PtEntry {
    options: u32,
    eq: Option<u32>,
    enabled: bool,
    priority: Vec<u32>,
    overflow: Vec<u32>,
    unexpected: VecDeque<Unexpected>,
}

/// Objects addressed by handle: a slot index plus a generation, so stale handles are refused.
pub(super) struct Slots<T> {
    items: Vec<(u32, Option<T>)>,
    free: Vec<usize>,
    pub(super) live: usize,
}

impl<T> Slots<T> {
    fn new() -> Self {
        Slots {
            items: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }
    pub(super) fn insert(&mut self, v: T) -> u32 {
        let i = self.free.pop().unwrap_or_else(|| {
            self.items.push((0, None));
            self.items.len() - 1
        });
        let slot = &mut self.items[i];
        slot.0 = slot.0.wrapping_add(1) & 0xff;
        slot.1 = Some(v);
        self.live += 1;
        (slot.0 << 24) | i as u32
    }
    pub(super) fn get(&self, h: u32) -> Option<&T> {
        let (g, i) = (h >> 24, (h & 0xff_ffff) as usize);
        self.items
            .get(i)
            .filter(|s| s.0 == g)
            .and_then(|s| s.1.as_ref())
    }
    pub(super) fn get_mut(&mut self, h: u32) -> Option<&mut T> {
        let (g, i) = (h >> 24, (h & 0xff_ffff) as usize);
        self.items
            .get_mut(i)
            .filter(|s| s.0 == g)
            .and_then(|s| s.1.as_mut())
    }
    /// Handles of the live objects.
    pub(super) fn handles(&self) -> impl Iterator<Item = u32> + '_ {
        self.items
            .iter()
            .enumerate()
            .filter(|(_, s)| s.1.is_some())
            .map(|(i, s)| (s.0 << 24) | i as u32)
    }

    pub(super) fn remove(&mut self, h: u32) -> Option<T> {
        let (g, i) = (h >> 24, (h & 0xff_ffff) as usize);
        let slot = self.items.get_mut(i).filter(|s| s.0 == g)?;
        let v = slot.1.take()?;
        self.free.push(i);
        self.live -= 1;
        Some(v)
    }
}

/// The NIC-side state of one process's Portals interface.
pub struct PortalsNi {
    pub matching: bool,
    pub limits: Limits,
    table: Vec<Option<PtEntry>>,
    entries: Slots<Linked>,
    eqs: Slots<EventQueue>,
    cts: Slots<CtEvent>,
    pub(super) mds: Slots<Md>,
    pub(super) outgoing: Slots<Outgoing>,
    pub(super) triggered: Vec<Triggered>,
    /// Triggered operations that fired, for the daemon to start.
    pub(super) fired: VecDeque<OpSpec>,
    /// Counting events changed since the last [`PortalsNi::take_dirty_cts`], each with the
    /// notice count at its first change since then, in that order.
    dirty_cts: Vec<(u32, u64)>,
    /// Full events posted and counting-event changes so far: what the process can notice.
    notices: u64,
    unexpected_total: usize,
    /// PtlNIStatus: messages dropped, permission and operation violations.
    pub dropped: u64,
    pub perm_violations: u64,
    pub op_violations: u64,
    /// Where the last atomic landed: (portal index, address of its entry's start, entry
    /// length), to prefetch the targets of the atomics queued behind it (see
    /// [`PortalsNi::prefetch_atomic`]). Kept as an address: it may go stale, which costs a
    /// useless prefetch and nothing else.
    atomic_hint: Option<(u32, usize, u64)>,
    /// Gets of at least this many bytes are answered as a stream read from the entry's memory
    /// while the reply goes out (see [`GetStream`]); `None`: every reply is copied at once.
    pub stream_gets_from: Option<u64>,
    /// The stream the last [`PortalsNi::deliver`] asked for, for the caller to take.
    get_stream: Option<GetStream>,
    /// The put stream the last [`PortalsNi::deliver_first`] opened, for the caller to take.
    put_stream: Option<PutStream>,
    /// What streamed gets and puts still owe the target process, by token: posted once the
    /// last byte was read or written ([`PortalsNi::streamed`]).
    deferred: HashMap<u64, Deferred>,
    next_token: u64,
}

/// A get's reply to be read from the matched entry's memory as it goes out: `len` bytes at
/// `at` of `region`. Its GET event (and counting event, and an auto-unlink's event) wait for
/// the last byte to be read, because a process told its memory was read may change it.
#[derive(Clone)]
pub struct GetStream {
    pub region: Region,
    pub at: u64,
    pub len: u64,
    pub token: u64,
}

/// A put matched on its first fragment: its data lands `len` bytes at `at` of `region` as
/// the fragments come (as a NIC writes a message behind its header instead of buffering it
/// whole). Its PUT event, counting event and an auto-unlink's event wait for the last one.
#[derive(Clone)]
pub struct PutStream {
    pub region: Region,
    pub at: u64,
    pub len: u64,
    pub token: u64,
}

/// The events a streamed get or put holds back.
#[derive(Default)]
struct Deferred {
    eq: Option<u32>,
    /// Counting event and the success it adds.
    ct: Option<(u32, u64)>,
    events: Vec<Event>,
}

impl PortalsNi {
    /// Starts loading the word an atomic on portal `pt` at `remote_offset` will most likely
    /// update (the place the previous atomic on `pt` matched), so that a run of random updates
    /// waits for several cache misses at once instead of one after another. A prefetch never
    /// faults, so a guess that is wrong or stale is harmless.
    pub fn prefetch_atomic(&self, pt: u32, remote_offset: u64) {
        #[cfg(target_arch = "x86_64")]
        if let Some(a) = self.atomic_guess(pt, remote_offset) {
            // SAFETY: a prefetch is a hint that never faults, whatever the address.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0};
                _mm_prefetch::<_MM_HINT_ET0>(a as *const i8);
            }
        }
    }

    /// The address an atomic on `pt` at `remote_offset` would update if it matched where the
    /// previous atomic on `pt` did.
    pub(super) fn atomic_guess(&self, pt: u32, remote_offset: u64) -> Option<usize> {
        let (hint_pt, base, len) = self.atomic_hint?;
        (hint_pt == pt && remote_offset < len).then(|| base.wrapping_add(remote_offset as usize))
    }

    pub fn new(matching: bool, limits: Limits) -> PortalsNi {
        PortalsNi {
            matching,
            limits,
            table: (0..=limits.max_pt_index).map(|_| None).collect(),
            entries: Slots::new(),
            eqs: Slots::new(),
            cts: Slots::new(),
            mds: Slots::new(),
            outgoing: Slots::new(),
            triggered: Vec::new(),
            fired: VecDeque::new(),
            dirty_cts: Vec::new(),
            notices: 0,
            unexpected_total: 0,
            dropped: 0,
            perm_violations: 0,
            op_violations: 0,
            atomic_hint: None,
            stream_gets_from: None,
            get_stream: None,
            put_stream: None,
            deferred: HashMap::new(),
            next_token: 0,
        }
    }

    /// Posts `ev`, or holds it for a streamed get until its last byte was read.
    fn post_or_hold(&mut self, held: Option<&mut Deferred>, eq: Option<u32>, ev: Event) {
        match held {
            Some(d) => d.events.push(ev),
            None => self.post(eq, ev),
        }
    }

    /// The reply stream the last delivery asked for (a get of at least `stream_gets_from`
    /// bytes): the caller sends it and reports its end with [`PortalsNi::streamed`].
    pub fn take_get_stream(&mut self) -> Option<GetStream> {
        self.get_stream.take()
    }

    /// The put stream the last [`PortalsNi::deliver_first`] opened: the caller writes the
    /// message's later fragments there and reports its end with [`PortalsNi::streamed`].
    pub fn take_put_stream(&mut self) -> Option<PutStream> {
        self.put_stream.take()
    }

    /// A streamed get's reply was read, or a streamed put's data written, to its end
    /// (`fail` Ok), or could not be (`fail` says why: its memory went away, its initiator
    /// died): the events it held back are posted, a failure as such.
    pub fn streamed(&mut self, token: u64, fail: NiFail) {
        let Some(d) = self.deferred.remove(&token) else {
            return;
        };
        let ok = fail == NiFail::Ok;
        if let Some((c, n)) = d.ct {
            let by = match ok {
                true => CtEvent {
                    success: n,
                    failure: 0,
                },
                false => CtEvent {
                    success: 0,
                    failure: 1,
                },
            };
            self.bump_ct(c, by);
        }
        for mut e in d.events {
            if !ok && matches!(e.kind, EventKind::Get | EventKind::Put) {
                e.ni_fail = fail;
            }
            self.post(d.eq, e);
        }
    }

    // ------------------------------------------------------------------ EQ and CT

    /// PtlEQAlloc.
    /// PtlNIStatus: one status register.
    pub fn status(&self, r: StatusRegister) -> u64 {
        match r {
            StatusRegister::DropCount => self.dropped,
            StatusRegister::PermissionViolations => self.perm_violations,
            StatusRegister::OperationViolations => self.op_violations,
        }
    }

    pub fn eq_alloc(&mut self, count: usize) -> Result<u32, PtlError> {
        if count == 0 {
            return Err(PtlError::ArgInvalid);
        }
        if self.eqs.live >= self.limits.max_eqs {
            return Err(PtlError::NoSpace);
        }
        Ok(self.eqs.insert(EventQueue::new(count)))
    }

    /// PtlEQFree: refused while a portal table entry still reports to it.
    pub fn eq_free(&mut self, eq: u32) -> Result<(), PtlError> {
        self.eqs.get(eq).ok_or(PtlError::ArgInvalid)?;
        if self.table.iter().flatten().any(|p| p.eq == Some(eq)) {
            return Err(PtlError::InUse);
        }
        self.eqs.remove(eq);
        Ok(())
    }

    /// PtlEQGet.
    pub fn eq_get(&mut self, eq: u32) -> Result<(Event, bool), PtlError> {
        self.eqs.get_mut(eq).ok_or(PtlError::ArgInvalid)?.get()
    }

    /// PtlCTAlloc.
    pub fn ct_alloc(&mut self) -> Result<u32, PtlError> {
        if self.cts.live >= self.limits.max_cts {
            return Err(PtlError::NoSpace);
        }
        Ok(self.cts.insert(CtEvent::default()))
    }

    pub fn ct_free(&mut self, ct: u32) -> Result<(), PtlError> {
        self.cts.remove(ct).map(|_| ()).ok_or(PtlError::ArgInvalid)
    }

    pub fn ct_get(&self, ct: u32) -> Result<CtEvent, PtlError> {
        self.cts.get(ct).copied().ok_or(PtlError::ArgInvalid)
    }

    pub fn ct_set(&mut self, ct: u32, v: CtEvent) -> Result<(), PtlError> {
        *self.cts.get_mut(ct).ok_or(PtlError::ArgInvalid)? = v;
        self.mark_ct(ct);
        self.fire_triggered(ct);
        Ok(())
    }

    pub fn ct_inc(&mut self, ct: u32, by: CtEvent) -> Result<(), PtlError> {
        self.cts.get(ct).ok_or(PtlError::ArgInvalid)?;
        self.bump_ct(ct, by);
        Ok(())
    }

    /// Every counting-event change goes through here, so triggered operations see it.
    pub(super) fn bump_ct(&mut self, ct: u32, by: CtEvent) {
        if let Some(c) = self.cts.get_mut(ct) {
            c.inc(by);
            self.mark_ct(ct);
            self.fire_triggered(ct);
        }
    }

    pub(super) fn mark_ct(&mut self, ct: u32) {
        if !self.dirty_cts.iter().any(|&(c, _)| c == ct) {
            self.dirty_cts.push((ct, self.notices));
        }
        self.notices += 1;
    }

    /// Counting events changed since the last call: each with its value and the notice count
    /// at its first change (events posted before it carry smaller stamps), in that order.
    pub fn take_dirty_cts(&mut self, out: &mut Vec<(u32, CtEvent, u64)>) {
        for (ct, stamp) in self.dirty_cts.drain(..) {
            if let Some(v) = self.cts.get(ct) {
                out.push((ct, *v, stamp));
            }
        }
    }

    /// The event queue `eq`, for the daemon to move events to the process.
    pub fn eq_mut(&mut self, eq: u32) -> Option<&mut EventQueue> {
        self.eqs.get_mut(eq)
    }

    /// Stores a counting event's value without firing triggers (the trigger loop's own write).
    pub(super) fn ct_store(&mut self, ct: u32, v: CtEvent) {
        if let Some(c) = self.cts.get_mut(ct) {
            *c = v;
            self.mark_ct(ct);
        }
    }

    pub(super) fn eq_ref(&self, eq: u32) -> Option<&EventQueue> {
        self.eqs.get(eq)
    }

    pub(super) fn post(&mut self, eq: Option<u32>, e: Event) {
        if let Some(q) = eq.and_then(|h| self.eqs.get_mut(h)) {
            q.push(e, self.notices);
            self.notices += 1;
        }
    }

    /// Full events posted and counting-event changes so far. A delivery that moved it told
    /// the process something (its answer may follow); one that did not was silent.
    pub fn notices(&self) -> u64 {
        self.notices
    }

    // ------------------------------------------------------------------ portal table

    /// PtlPTAlloc: at `want` or, with `None` (PTL_PT_ANY), the first free index.
    pub fn pt_alloc(
        &mut self,
        options: u32,
        eq: Option<u32>,
        want: Option<u32>,
    ) -> Result<u32, PtlError> {
        if options & !(pt::FLOWCTRL | pt::ONLY_USE_ONCE | pt::ONLY_TRUNCATE) != 0 {
            return Err(PtlError::ArgInvalid);
        }
        if let Some(h) = eq {
            self.eqs.get(h).ok_or(PtlError::ArgInvalid)?;
        } else if options & pt::FLOWCTRL != 0 {
            return Err(PtlError::PtEqNeeded);
        }
        let idx = match want {
            Some(i) => {
                let slot = self.table.get(i as usize).ok_or(PtlError::ArgInvalid)?;
                if slot.is_some() {
                    return Err(PtlError::PtInUse);
                }
                i
            }
            None => self
                .table
                .iter()
                .position(|p| p.is_none())
                .ok_or(PtlError::PtFull)? as u32,
        };
        self.table[idx as usize] = Some(PtEntry {
            options,
            eq,
            enabled: true,
            priority: Vec::new(),
            overflow: Vec::new(),
            unexpected: VecDeque::new(),
        });
        Ok(idx)
    }

    /// PtlPTFree: refused while entries are attached.
    pub fn pt_free(&mut self, idx: u32) -> Result<(), PtlError> {
        let p = self.pt(idx)?;
        if !p.priority.is_empty() || !p.overflow.is_empty() {
            return Err(PtlError::PtInUse);
        }
        let n = p.unexpected.len();
        self.unexpected_total -= n;
        self.table[idx as usize] = None;
        Ok(())
    }

    pub fn pt_enable(&mut self, idx: u32) -> Result<(), PtlError> {
        self.pt_mut(idx)?.enabled = true;
        Ok(())
    }

    pub fn pt_disable(&mut self, idx: u32) -> Result<(), PtlError> {
        self.pt_mut(idx)?.enabled = false;
        Ok(())
    }

    pub fn pt_enabled(&self, idx: u32) -> Result<bool, PtlError> {
        Ok(self.pt(idx)?.enabled)
    }

    fn pt(&self, idx: u32) -> Result<&PtEntry, PtlError> {
        self.table
            .get(idx as usize)
            .and_then(|p| p.as_ref())
            .ok_or(PtlError::ArgInvalid)
    }

    fn pt_mut(&mut self, idx: u32) -> Result<&mut PtEntry, PtlError> {
        self.table
            .get_mut(idx as usize)
            .and_then(|p| p.as_mut())
            .ok_or(PtlError::ArgInvalid)
    }

    /// Disables a flow-controlled entry and tells its owner.
    fn flow_control(&mut self, idx: u32) -> Response {
        let p = self.table[idx as usize].as_mut().expect("caller checked");
        p.enabled = false;
        let eq = p.eq;
        // The queue keeps a slot for this event (see `deliver`).
        self.post(
            eq,
            Event::bare(EventKind::PtDisabled, idx, 0, NiFail::PtDisabled),
        );
        self.dropped += 1;
        Response::fail(NiFail::PtDisabled)
    }

    // ------------------------------------------------------------------ lists

    /// PtlMEAppend / PtlLEAppend. Returns the entry's handle (which names nothing if a use-once
    /// entry was consumed at once by an unexpected message).
    pub fn append(
        &mut self,
        idx: u32,
        e: MatchEntry,
        list: List,
        user_ptr: u64,
    ) -> Result<u32, PtlError> {
        let popts = self.pt(idx)?.options;
        if popts & pt::ONLY_USE_ONCE != 0 && !e.has(me::USE_ONCE) {
            return Err(PtlError::ArgInvalid);
        }
        if popts & pt::ONLY_TRUNCATE != 0 && e.has(me::NO_TRUNCATE) {
            return Err(PtlError::ArgInvalid);
        }
        if e.start
            .checked_add(e.length)
            .is_none_or(|end| end > e.region.len() as u64)
        {
            return Err(PtlError::ArgInvalid);
        }
        if let Some(ct) = e.ct {
            self.cts.get(ct).ok_or(PtlError::ArgInvalid)?;
        }
        let p = self.pt(idx)?;
        let len = if list == List::Priority {
            p.priority.len()
        } else {
            p.overflow.len()
        };
        if len >= self.limits.max_list_size {
            return Err(PtlError::ListTooLong);
        }
        if self.entries.live >= self.limits.max_entries {
            return Err(PtlError::NoSpace);
        }
        let eq = p.eq;
        let opts = e.options;
        let h = self.entries.insert(Linked {
            entry: e,
            user_ptr,
            pt_index: idx,
            local_offset: 0,
            linked: true,
            pending_headers: 0,
        });
        if list == List::Priority && self.matching {
            let use_once = opts & me::USE_ONCE != 0;
            let consumed = self.consume_unexpected(idx, h, if use_once { 1 } else { usize::MAX });
            if use_once && consumed > 0 {
                self.entries.remove(h);
                return Ok(h);
            }
        }
        let p = self.pt_mut(idx)?;
        match list {
            List::Priority => p.priority.push(h),
            List::Overflow => p.overflow.push(h),
        }
        if opts & me::EVENT_LINK_DISABLE == 0 {
            self.post(eq, Event::bare(EventKind::Link, idx, user_ptr, NiFail::Ok));
        }
        Ok(h)
    }

    /// A one-way append (nobody waits for the call's answer): a refusal is reported as a
    /// PTL_EVENT_LINK with a failure on the portal's event queue, even when the entry asked for
    /// no link event. Without a portal (or its queue) the refusal is returned to the caller.
    pub fn append_oneway(
        &mut self,
        idx: u32,
        e: MatchEntry,
        list: List,
        user_ptr: u64,
    ) -> Result<(), PtlError> {
        match self.append(idx, e, list, user_ptr) {
            Ok(_) => Ok(()),
            Err(err) => self.link_refused(idx, user_ptr, err),
        }
    }

    /// Reports a one-way append's refusal `err` as a failed PTL_EVENT_LINK (see
    /// [`PortalsNi::append_oneway`]).
    pub fn link_refused(&mut self, idx: u32, user_ptr: u64, err: PtlError) -> Result<(), PtlError> {
        let fail = match err {
            PtlError::NoSpace | PtlError::ListTooLong => NiFail::NoSpace,
            _ => NiFail::ArgInvalid,
        };
        match self.pt(idx).ok().and_then(|p| p.eq) {
            Some(eq) => {
                self.post(Some(eq), Event::bare(EventKind::Link, idx, user_ptr, fail));
                Ok(())
            }
            None => Err(err),
        }
    }

    /// Hands up to `max` unexpected headers matching entry `h` to it (PTL_EVENT_*_OVERFLOW),
    /// removing them; returns how many.
    fn consume_unexpected(&mut self, idx: u32, h: u32, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            let Some(pos) = self.find_unexpected(idx, h) else {
                break;
            };
            let u = self.table[idx as usize]
                .as_mut()
                .expect("checked")
                .unexpected
                .remove(pos)
                .expect("found");
            self.unexpected_total -= 1;
            let kind = overflow_kind(u.kind);
            self.report_header(idx, h, &u, kind, NiFail::Ok);
            self.release_header(u.entry);
            n += 1;
        }
        n
    }

    fn find_unexpected(&self, idx: u32, h: u32) -> Option<usize> {
        let e = &self.entries.get(h)?.entry;
        let p = self.table[idx as usize].as_ref()?;
        p.unexpected.iter().position(|u| {
            e.criteria(self.matching, &u.initiator, u.match_bits)
                && !(e.has(me::NO_TRUNCATE) && u.rlength > e.length)
        })
    }

    /// Posts the event describing an unexpected header to entry `h`'s owner.
    fn report_header(
        &mut self,
        idx: u32,
        h: u32,
        u: &Unexpected,
        kind: EventKind,
        ni_fail: NiFail,
    ) {
        let Some(l) = self.entries.get(h) else { return };
        let (opts, user_ptr, ct) = (l.entry.options, l.user_ptr, l.entry.ct);
        let eq = self.table[idx as usize].as_ref().and_then(|p| p.eq);
        if kind != EventKind::Search && opts & me::EVENT_CT_OVERFLOW != 0 {
            if let Some(c) = ct {
                let n = if opts & me::EVENT_CT_BYTES != 0 {
                    u.mlength
                } else {
                    1
                };
                self.bump_ct(
                    c,
                    CtEvent {
                        success: n,
                        failure: 0,
                    },
                );
            }
        }
        let silent = kind != EventKind::Search
            && opts & (me::EVENT_OVER_DISABLE | me::EVENT_COMM_DISABLE) != 0;
        if !silent {
            self.post(
                eq,
                Event {
                    kind,
                    initiator: u.initiator,
                    pt_index: idx,
                    uid: u.uid,
                    match_bits: u.match_bits,
                    rlength: u.rlength,
                    mlength: u.mlength,
                    remote_offset: u.remote_offset,
                    start: u.start,
                    user_ptr,
                    hdr_data: u.hdr_data,
                    ni_fail,
                    atomic: atomic_of(u.kind),
                },
            );
        }
    }

    /// An unexpected header into overflow entry `oh` was consumed: free the entry once it is
    /// unlinked and no header refers to its buffer any more (PTL_EVENT_AUTO_FREE).
    fn release_header(&mut self, oh: u32) {
        let Some(l) = self.entries.get_mut(oh) else {
            return;
        };
        l.pending_headers -= 1;
        if !l.linked && l.pending_headers == 0 {
            let (idx, user_ptr, opts) = (l.pt_index, l.user_ptr, l.entry.options);
            self.entries.remove(oh);
            if opts & me::EVENT_UNLINK_DISABLE == 0 {
                let eq = self
                    .table
                    .get(idx as usize)
                    .and_then(|p| p.as_ref())
                    .and_then(|p| p.eq);
                self.post(
                    eq,
                    Event::bare(EventKind::AutoFree, idx, user_ptr, NiFail::Ok),
                );
            }
        }
    }

    /// PtlMESearch: SEARCH_ONLY reports the first matching unexpected header (PTL_EVENT_SEARCH);
    /// SEARCH_DELETE hands every matching header over as an append would and deletes them. With
    /// no match, a PTL_EVENT_SEARCH with PTL_NI_NO_MATCH.
    pub fn search(
        &mut self,
        idx: u32,
        e: MatchEntry,
        op: SearchOp,
        user_ptr: u64,
    ) -> Result<(), PtlError> {
        self.pt(idx)?;
        let h = self.entries.insert(Linked {
            entry: e,
            user_ptr,
            pt_index: idx,
            local_offset: 0,
            linked: false,
            pending_headers: 0,
        });
        let found = match op {
            SearchOp::SearchOnly => match self.find_unexpected(idx, h) {
                Some(pos) => {
                    let u = self.table[idx as usize]
                        .as_ref()
                        .expect("checked")
                        .unexpected[pos];
                    self.report_header(idx, h, &u, EventKind::Search, NiFail::Ok);
                    1
                }
                None => 0,
            },
            SearchOp::SearchDelete => self.consume_unexpected(idx, h, usize::MAX),
        };
        self.entries.remove(h);
        if found == 0 {
            let eq = self.pt(idx)?.eq;
            self.post(
                eq,
                Event::bare(EventKind::Search, idx, user_ptr, NiFail::NoMatch),
            );
        }
        Ok(())
    }

    /// PtlMEUnlink / PtlLEUnlink (no event).
    pub fn unlink(&mut self, h: u32) -> Result<(), PtlError> {
        let l = self.entries.get_mut(h).ok_or(PtlError::ArgInvalid)?;
        if !l.linked {
            return Err(PtlError::ArgInvalid);
        }
        l.linked = false;
        let (idx, keep) = (l.pt_index, l.pending_headers > 0);
        if let Some(p) = self.table[idx as usize].as_mut() {
            p.priority.retain(|&x| x != h);
            p.overflow.retain(|&x| x != h);
        }
        if !keep {
            self.entries.remove(h);
        }
        Ok(())
    }

    /// The unused room of a locally managed entry (for tests and PtlMEUnlink decisions).
    pub fn local_offset(&self, h: u32) -> Option<u64> {
        self.entries.get(h).map(|l| l.local_offset)
    }

    pub fn is_linked(&self, h: u32) -> bool {
        self.entries.get(h).is_some_and(|l| l.linked)
    }

    pub fn unexpected_len(&self, idx: u32) -> usize {
        self.pt(idx).map_or(0, |p| p.unexpected.len())
    }

    // ------------------------------------------------------------------ delivery

    /// Delivers an incoming message: matching, data placement, events, unlinking, flow control.
    pub fn deliver(&mut self, req: &Request<'_>) -> Response {
        let Ok(p) = self.pt(req.pt_index) else {
            self.dropped += 1;
            return Response::fail(NiFail::Dropped);
        };
        if !p.enabled {
            self.dropped += 1;
            return Response::fail(NiFail::PtDisabled);
        }
        let (flowctrl, eq) = (p.options & pt::FLOWCTRL != 0, p.eq);
        // Flow control keeps room for the PT_DISABLED event itself.
        if flowctrl
            && eq
                .and_then(|q| self.eqs.get(q))
                .is_some_and(|q| !q.has_room(2))
        {
            return self.flow_control(req.pt_index);
        }
        if let Some(h) = self.find_match(req, List::Priority) {
            return self.deliver_to(h, req, false);
        }
        if let Some(h) = self.find_match(req, List::Overflow) {
            let keeps_header = self
                .entries
                .get(h)
                .is_some_and(|l| !l.entry.has(me::UNEXPECTED_HDR_DISABLE));
            if !keeps_header {
                return self.deliver_to(h, req, false);
            }
            if self.unexpected_total >= self.limits.max_unexpected_headers {
                if flowctrl {
                    return self.flow_control(req.pt_index);
                }
                self.dropped += 1;
                return Response::fail(NiFail::Dropped);
            }
            return self.deliver_to(h, req, true);
        }
        if flowctrl {
            return self.flow_control(req.pt_index);
        }
        self.dropped += 1;
        Response::fail(NiFail::Dropped)
    }

    /// The first fragment of a put in several (`req.data` that fragment, `req.rlength` the
    /// whole): matched now if an entry of the priority list takes it, its first bytes written
    /// and the rest left to a [`PutStream`] (`take_put_stream`; none if the match failed, the
    /// response says why). `None`, having changed nothing: no such entry, or the portal would
    /// drop the message or turn to flow control — the caller puts the message together and
    /// calls [`PortalsNi::deliver`], which decides as for any message (overflow entries and
    /// unexpected headers see only whole messages).
    pub fn deliver_first(&mut self, req: &Request<'_>) -> Option<Response> {
        if req.kind != ReqKind::Put {
            return None;
        }
        let p = self.pt(req.pt_index).ok()?;
        let full_eq = |q: Option<u32>| {
            q.and_then(|q| self.eqs.get(q))
                .is_some_and(|q| !q.has_room(2))
        };
        if !p.enabled || p.options & pt::FLOWCTRL != 0 && full_eq(p.eq) {
            return None;
        }
        let h = self.find_match(req, List::Priority)?;
        Some(self.deliver_to_as(h, req, false, true))
    }

    fn find_match(&self, req: &Request<'_>, list: List) -> Option<u32> {
        let p = self.table[req.pt_index as usize].as_ref()?;
        let l = if list == List::Priority {
            &p.priority
        } else {
            &p.overflow
        };
        l.iter().copied().find(|&h| {
            self.entries.get(h).is_some_and(|l| {
                l.entry
                    .criteria(self.matching, &req.initiator, req.match_bits)
                    && l.placement(req.remote_offset, req.rlength).is_some()
            })
        })
    }

    fn deliver_to(&mut self, h: u32, req: &Request<'_>, overflow: bool) -> Response {
        self.deliver_to_as(h, req, overflow, false)
    }

    /// [`PortalsNi::deliver_to`]; `streamed_put`: `req.data` is the first fragment of the
    /// put, whose matched length stands and whose events wait (see [`PutStream`]).
    fn deliver_to_as(
        &mut self,
        h: u32,
        req: &Request<'_>,
        overflow: bool,
        streamed_put: bool,
    ) -> Response {
        let idx = req.pt_index;
        let eq = self.table[idx as usize].as_ref().and_then(|p| p.eq);
        let l = self.entries.get(h).expect("matched entry exists");
        let e = &l.entry;
        let (opts, ct, user_ptr) = (e.options, e.ct, l.user_ptr);
        let fail = |this: &mut Self, f: NiFail| {
            if f == NiFail::OpViolation {
                this.op_violations += 1;
            }
            if let Some(c) = ct.filter(|_| opts & me::EVENT_CT_COMM != 0) {
                this.bump_ct(
                    c,
                    CtEvent {
                        success: 0,
                        failure: 1,
                    },
                );
            }
            Response::fail(f)
        };
        if e.uid != u32::MAX && e.uid != req.uid {
            self.perm_violations += 1;
            return fail(self, NiFail::PermViolation);
        }
        if opts & req.kind.needs() != req.kind.needs() {
            return fail(self, NiFail::OpViolation);
        }
        let (offset, mut mlength) = l
            .placement(req.remote_offset, req.rlength)
            .expect("matched");
        // An offset past the entry truncates the message to zero bytes; never address beyond it.
        let at = e.start + offset.min(e.length);
        let mut data = Vec::new();
        // A long get from a priority entry is read as its reply goes out.
        let stream = (req.kind == ReqKind::Get
            && !overflow
            && self.stream_gets_from.is_some_and(|m| mlength >= m.max(1)))
        .then(|| e.region.clone());
        let put_stream = streamed_put.then(|| e.region.clone());
        match req.kind {
            _ if mlength == 0 => {}
            ReqKind::Get if stream.is_some() => {}
            ReqKind::Put => {
                if !streamed_put {
                    mlength = mlength.min(req.data.len() as u64);
                }
                let now = (mlength as usize).min(req.data.len());
                if let Err(why) = e.region.write(at, &req.data[..now]) {
                    return fail(self, copy_fail(why));
                }
            }
            ReqKind::Get => {
                if let Err(why) = e.region.append_to(at, mlength as usize, &mut data) {
                    return fail(self, copy_fail(why));
                }
            }
            ReqKind::Atomic(op, dt) | ReqKind::FetchAtomic(op, dt) | ReqKind::Swap(op, dt) => {
                if !e.region.is_mapped() {
                    // Memory reached by copy: no atomic instruction can act on it.
                    return fail(self, NiFail::OpViolation);
                }
                let w = dt.size() as u64;
                mlength = mlength.min(req.data.len() as u64) / w * w;
                let fetch = !matches!(req.kind, ReqKind::Atomic(..));
                if fetch {
                    data = vec![0; mlength as usize];
                }
                let Ok(ptr) = e.region.mapped_at(at, mlength) else {
                    return fail(self, NiFail::Segv);
                };
                if opts & me::MANAGE_LOCAL == 0 {
                    let base = (ptr as usize).wrapping_sub(offset.min(e.length) as usize);
                    self.atomic_hint = Some((idx, base, e.length));
                }
                // SAFETY: [at, at+mlength) lies inside the entry (placement) and so inside its
                // region (checked at append); the region stays mapped while `e` holds it.
                let r = unsafe {
                    atomic::apply(
                        ptr,
                        op,
                        dt,
                        &req.data[..mlength as usize],
                        req.operand,
                        fetch.then_some(&mut data[..]),
                    )
                };
                match r {
                    Ok(()) => {}
                    Err(AtomicError::Unsupported) | Err(AtomicError::BadLength) => {
                        return fail(self, NiFail::OpViolation)
                    }
                }
            }
        }
        let l = self.entries.get_mut(h).expect("exists");
        if opts & me::MANAGE_LOCAL != 0 {
            l.local_offset += mlength;
            if opts & me::MAY_ALIGN != 0 {
                l.local_offset = l.local_offset.next_multiple_of(8);
            }
        }
        let room = l.entry.length.saturating_sub(l.local_offset);
        let unlink = opts & me::USE_ONCE != 0
            || (opts & me::MANAGE_LOCAL != 0 && l.entry.min_free > 0 && room < l.entry.min_free);
        if overflow {
            l.pending_headers += 1;
        }
        let mut deferred = (stream.is_some() || put_stream.is_some()).then(|| Deferred {
            eq,
            ..Deferred::default()
        });
        if let Some(c) = ct.filter(|_| opts & me::EVENT_CT_COMM != 0) {
            let n = if opts & me::EVENT_CT_BYTES != 0 {
                mlength
            } else {
                1
            };
            match deferred.as_mut() {
                Some(d) => d.ct = Some((c, n)),
                None => self.bump_ct(
                    c,
                    CtEvent {
                        success: n,
                        failure: 0,
                    },
                ),
            }
        }
        if opts & (me::EVENT_COMM_DISABLE | me::EVENT_SUCCESS_DISABLE) == 0 {
            let kind = match req.kind {
                ReqKind::Put => EventKind::Put,
                ReqKind::Get => EventKind::Get,
                ReqKind::Atomic(..) => EventKind::Atomic,
                ReqKind::FetchAtomic(..) | ReqKind::Swap(..) => EventKind::FetchAtomic,
            };
            let ev = Event {
                kind,
                initiator: req.initiator,
                pt_index: idx,
                uid: req.uid,
                match_bits: req.match_bits,
                rlength: req.rlength,
                mlength,
                remote_offset: offset,
                start: at,
                user_ptr,
                hdr_data: req.hdr_data,
                ni_fail: NiFail::Ok,
                atomic: atomic_of(req.kind),
            };
            self.post_or_hold(deferred.as_mut(), eq, ev);
        }
        if overflow {
            let u = Unexpected {
                kind: req.kind,
                initiator: req.initiator,
                uid: req.uid,
                match_bits: req.match_bits,
                rlength: req.rlength,
                mlength,
                remote_offset: req.remote_offset,
                hdr_data: req.hdr_data,
                start: at,
                entry: h,
            };
            self.table[idx as usize]
                .as_mut()
                .expect("exists")
                .unexpected
                .push_back(u);
            self.unexpected_total += 1;
        }
        if unlink {
            let l = self.entries.get_mut(h).expect("exists");
            l.linked = false;
            let keep = l.pending_headers > 0;
            if let Some(p) = self.table[idx as usize].as_mut() {
                p.priority.retain(|&x| x != h);
                p.overflow.retain(|&x| x != h);
            }
            if opts & me::EVENT_UNLINK_DISABLE == 0 {
                let ev = Event::bare(EventKind::AutoUnlink, idx, user_ptr, NiFail::Ok);
                self.post_or_hold(deferred.as_mut(), eq, ev);
            }
            if !keep {
                self.entries.remove(h);
            }
        }
        if let Some(d) = deferred {
            let token = self.next_token;
            self.next_token += 1;
            self.deferred.insert(token, d);
            if let Some(region) = stream {
                self.get_stream = Some(GetStream {
                    region,
                    at,
                    len: mlength,
                    token,
                });
            } else if let Some(region) = put_stream {
                self.put_stream = Some(PutStream {
                    region,
                    at,
                    len: mlength,
                    token,
                });
            }
        }
        Response {
            ni_fail: NiFail::Ok,
            mlength,
            offset,
            ack: opts & me::ACK_DISABLE == 0,
            data,
        }
    }
}

/// What a failed copy to or from an entry's memory (its status, from [`Region`]) tells the
/// initiator: its process exited (undeliverable, as to a process that is gone) or the address
/// is bad.
pub(crate) fn copy_fail(why: Status) -> NiFail {
    match why {
        Status::NoSuchEndpoint => NiFail::Undeliverable,
        _ => NiFail::Segv,
    }
}

fn overflow_kind(k: ReqKind) -> EventKind {
    match k {
        ReqKind::Put => EventKind::PutOverflow,
        ReqKind::Get => EventKind::GetOverflow,
        ReqKind::Atomic(..) => EventKind::AtomicOverflow,
        ReqKind::FetchAtomic(..) | ReqKind::Swap(..) => EventKind::FetchAtomicOverflow,
    }
}

fn atomic_of(k: ReqKind) -> Option<(super::atomic::AtomicOp, super::atomic::Datatype)> {
    match k {
        ReqKind::Atomic(op, dt) | ReqKind::FetchAtomic(op, dt) | ReqKind::Swap(op, dt) => {
            Some((op, dt))
        }
        _ => None,
    }
}
