//! The Portals 4 API over the soft NIC (`PtlNIInit`, `PtlMEAppend`, `PtlPut`, … in Rust form).
//!
//! Matching, data placement and events happen in the NIC (softnicd), as on an offloading NIC:
//! calls go to it through the command ring; event queues and counting events are read straight
//! from shared memory the NIC writes. Calls that return handles wait for the NIC's answer;
//! data movement does not (it is checked here against this process's own MDs and limits, so
//! the NIC's refusals are for misbehaving clients only).
//!
//! Process identifiers: logical NIs name ranks; physical NIs name `(nid, pid)` = (host index,
//! rank), as `get_phys_id` reports.

use rustc_hash::FxHashMap as HashMap;
use std::time::{Duration, Instant};

use crate::client::{Endpoint, MemHandle, MemRegion, NicError};
use crate::nic::memory::{Perms, Region};
use crate::nic::portals::{OpSpec, ReqKind};
use crate::shm::event_ring::{ring_bytes, CtSlot, EventRing, CT_SLOT_LEN};
use crate::shm::ptl_call::{result_of, Buf, MeArgs, PtlCall};
use crate::shm::{Command, CommandKind};

pub use crate::nic::portals::atomic::{AtomicOp, Datatype};
pub use crate::nic::portals::initiator::md as md_opt;
pub use crate::nic::portals::types::{me as me_opt, pt as pt_opt, NID_ANY, PID_ANY, RANK_ANY};
pub use crate::nic::portals::{
    AckReq, CtEvent, Event, EventKind, Limits, List, NiFail, ProcessId, PtlError, SearchOp,
    StatusRegister,
};

#[derive(Debug, thiserror::Error)]
pub enum PortalsError {
    #[error(transparent)]
    Ptl(#[from] PtlError),
    #[error(transparent)]
    Nic(#[from] NicError),
}

/// An interface (`ptl_handle_ni_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NiHandle(u8);

/// Memory a list entry covers: `len` bytes at `offset` of a registered region — shared memory
/// ([`MemRegion::handle`]) or this process's own memory registered with
/// [`crate::client::Client::register_process`] (puts and gets only: the NIC reaches it by copy,
/// so atomics there fail with PTL_NI_OP_VIOLATION).
#[derive(Clone)]
pub struct Buffer {
    pub region: MemHandle,
    pub offset: u64,
    pub len: u64,
}

/// A match list entry (`ptl_me_t`); list entries of non-matching interfaces use the same with
/// the matching fields ignored.
#[derive(Clone)]
pub struct Me {
    pub buf: Buffer,
    pub ct: Option<u32>,
    /// `u32::MAX` lets any user in.
    pub uid: u32,
    pub options: u32,
    pub match_id: ProcessId,
    pub match_bits: u64,
    pub ignore_bits: u64,
    pub min_free: u64,
}

impl Me {
    /// An entry over `buf` accepting puts and gets from anyone with exactly `match_bits`.
    pub fn new(buf: Buffer, match_bits: u64) -> Me {
        Me {
            buf,
            ct: None,
            uid: u32::MAX,
            options: me_opt::OP_PUT | me_opt::OP_GET,
            match_id: ProcessId::Logical { rank: RANK_ANY },
            match_bits,
            ignore_bits: 0,
            min_free: 0,
        }
    }
}

/// A memory descriptor (`ptl_md_t`): pieces of one region (one piece unless `md_opt::IOVEC`).
#[derive(Clone)]
pub struct Md {
    /// A registered region: shared memory, or this process's own memory registered with
    /// [`crate::client::Client::register_process`].
    pub region: MemHandle,
    pub segments: Vec<(u64, u64)>,
    pub options: u32,
    pub eq: Option<u32>,
    pub ct: Option<u32>,
}

/// Where an operation goes: process, portal index, match bits, offset.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub id: ProcessId,
    pub pt_index: u32,
    pub match_bits: u64,
    pub remote_offset: u64,
}

struct NiInfo {
    matching: bool,
    logical: bool,
    limits: Limits,
    eqs: HashMap<u32, (EventRing, MemRegion)>,
    cts: HashMap<u32, CtSlot>,
    ct_mem: MemRegion,
    free_ct_slots: Vec<u64>,
    mds: HashMap<u32, MdInfo>,
    /// Allocated portal table entries and their event queues.
    pts: HashMap<u32, Option<u32>>,
    /// PtlSetMap's mapping (logical index → physical id), if one was set.
    map: Option<Vec<ProcessId>>,
}

/// What the library keeps of a bound MD.
struct MdInfo {
    len: u64,
    /// A `PTL_MD_VOLATILE` MD's memory and segments: sends from it are copied into the call.
    volatile: Option<(Region, Vec<(u64, u64)>)>,
}

const CT_SLOTS: usize = 4096;

/// What a sleeping wait watches: an interface, its event queues, counting events and their
/// tests.
pub(crate) type WaitOn<'a> = (NiHandle, &'a [u32], &'a [u32], &'a [u64]);

/// A process's Portals library.
pub struct Portals {
    ep: Endpoint,
    nis: Vec<Option<NiInfo>>,
    /// Where calls are encoded (kept: an operation allocates nothing).
    scratch: Vec<u8>,
    /// Where a volatile MD's bytes are copied for the call (kept likewise).
    inline: Vec<u8>,
}

impl Portals {
    /// Attaches to this rank's NIC (collective, as [`Endpoint::init`]).
    pub fn init() -> Result<Portals, PortalsError> {
        Ok(Self::from_endpoint(Endpoint::init()?))
    }

    /// The Portals library on an attached endpoint (one another API may have used).
    pub fn from_endpoint(ep: Endpoint) -> Portals {
        Portals {
            ep,
            nis: (0..crate::shm::ptl_call::MAX_NIS).map(|_| None).collect(),
            scratch: Vec::with_capacity(256),
            inline: Vec::new(),
        }
    }

    /// The endpoint underneath (registration, rank, size, barrier).
    pub fn endpoint(&mut self) -> &mut Endpoint {
        &mut self.ep
    }

    /// The endpoint, for another API to take over.
    pub fn into_endpoint(self) -> Endpoint {
        self.ep
    }

    /// The put data one datagram carries (an extension, not in Portals 4): a put to another
    /// host longer than this is sent as fragments of this size and a last one with the rest,
    /// so puts whose lengths are multiples of it fill every datagram they take.
    pub fn put_fragment_len(&self) -> usize {
        crate::wire::OpRef::max_data(
            crate::wire::OpKind::PtlReq,
            self.ep.client().datagram_body(),
        )
        .max(1)
    }

    fn cmd(&self) -> Command {
        Command {
            kind: CommandKind::Portals,
            host: self.ep.client().host,
            ..Default::default()
        }
    }

    fn call(&mut self, c: &PtlCall) -> Result<u64, PortalsError> {
        c.encode_into(&mut self.scratch);
        let cmd = Command {
            len: self.scratch.len() as u64,
            ..self.cmd()
        };
        let (status, value) = self.ep.call_raw(cmd, &self.scratch)?;
        Ok(result_of(status, value)?)
    }

    fn oneway(&mut self, c: &PtlCall) -> Result<(), PortalsError> {
        c.encode_into(&mut self.scratch);
        let cmd = Command {
            len: self.scratch.len() as u64,
            ..self.cmd()
        };
        Ok(self.ep.post_oneway(cmd, &self.scratch)?)
    }

    fn info(&self, ni: NiHandle) -> Result<&NiInfo, PtlError> {
        self.nis
            .get(ni.0 as usize & 0x7f)
            .and_then(|n| n.as_ref())
            .ok_or(PtlError::ArgInvalid)
    }

    fn info_mut(&mut self, ni: NiHandle) -> Result<&mut NiInfo, PtlError> {
        self.nis
            .get_mut(ni.0 as usize & 0x7f)
            .and_then(|n| n.as_mut())
            .ok_or(PtlError::ArgInvalid)
    }

    // ------------------------------------------------------------------ interfaces

    /// PtlNIInit: a matching or non-matching, logical or physical interface; the actual limits.
    pub fn ni_init(
        &mut self,
        matching: bool,
        logical: bool,
    ) -> Result<(NiHandle, Limits), PortalsError> {
        let idx = (if matching { 0 } else { 1 }) + if logical { 0 } else { 2 };
        let wire_ni = idx as u8 | if logical { 0 } else { 0x80 };
        if self.nis[idx].is_none() {
            self.call(&PtlCall::NiInit {
                ni: wire_ni,
                matching,
            })?;
            let ct_mem = self
                .ep
                .mem_register(CT_SLOTS * CT_SLOT_LEN as usize, Perms(0))?;
            self.nis[idx] = Some(NiInfo {
                matching,
                logical,
                limits: Limits::default(),
                eqs: HashMap::default(),
                cts: HashMap::default(),
                ct_mem,
                free_ct_slots: (0..CT_SLOTS as u64).rev().collect(),
                mds: HashMap::default(),
                pts: HashMap::default(),
                map: None,
            });
        }
        let h = NiHandle(idx as u8);
        Ok((h, self.info(h)?.limits))
    }

    /// PtlNIFini: the interface goes, with every event queue, counting event, portal, entry
    /// and descriptor allocated on it; its handle (and theirs) become invalid. A later
    /// `ni_init` opens it afresh.
    pub fn ni_fini(&mut self, ni: NiHandle) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::NiFini { ni: wni })?;
        let info = self.nis[ni.0 as usize & 0x7f]
            .take()
            .ok_or(PtlError::ArgInvalid)?;
        for (_, (_, mem)) in info.eqs {
            self.ep.mem_deregister(&mem)?;
        }
        self.ep.mem_deregister(&info.ct_mem)?;
        Ok(())
    }

    /// PtlNIStatus: the value of one of the interface's status registers.
    pub fn ni_status(&mut self, ni: NiHandle, r: StatusRegister) -> Result<u64, PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::NiStatus {
            ni: wni,
            register: r as u32,
        })
    }

    /// PtlGetId: this process as its interface addresses it.
    pub fn get_id(&self, ni: NiHandle) -> Result<ProcessId, PtlError> {
        let info = self.info(ni)?;
        if !info.logical {
            return Ok(self.get_phys_id());
        }
        let me = self.get_phys_id();
        let rank = match &info.map {
            Some(m) => m
                .iter()
                .position(|p| *p == me)
                .ok_or(PtlError::ArgInvalid)? as u32,
            None => self.ep.rank(),
        };
        Ok(ProcessId::Logical { rank })
    }

    /// PtlGetPhysId.
    pub fn get_phys_id(&self) -> ProcessId {
        ProcessId::Physical {
            nid: self.ep.client().host as u32,
            pid: self.ep.rank(),
        }
    }

    /// PtlGetUid.
    pub fn get_uid(&self) -> u32 {
        rustix::process::geteuid().as_raw()
    }

    /// The job's placement: rank → physical identifier (host index, rank).
    fn job_map(&self) -> Vec<ProcessId> {
        let ranks = self.ep.job().rank_hosts.len() as u32;
        (0..ranks).filter_map(|r| self.placed(r)).collect()
    }

    /// Where the job placed `rank`: its host and, as the pid, the rank itself.
    fn placed(&self, rank: u32) -> Option<ProcessId> {
        let host = *self.ep.job().rank_hosts.get(rank as usize)?;
        Some(ProcessId::Physical {
            nid: host as u32,
            pid: rank,
        })
    }

    /// PtlGetMap: logical index → physical identifier (the job's placement until set).
    pub fn get_map(&self, ni: NiHandle) -> Result<Vec<ProcessId>, PtlError> {
        Ok(self.info(ni)?.map.clone().unwrap_or_else(|| self.job_map()))
    }

    /// PtlSetMap: logical index i of interface `ni` names `map[i]`, which must be a physical
    /// identifier of a process of this job (any order, any subset).
    pub fn set_map(&mut self, ni: NiHandle, map: &[ProcessId]) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        let job = self.job_map();
        let mut ranks = Vec::with_capacity(map.len());
        for p in map {
            match p {
                ProcessId::Physical { pid, .. } if job.get(*pid as usize) == Some(p) => {
                    ranks.push(*pid)
                }
                _ => return Err(PtlError::ArgInvalid.into()),
            }
        }
        self.call(&PtlCall::SetMap { ni: wni, ranks })?;
        self.info_mut(ni)?.map = Some(map.to_vec());
        Ok(())
    }

    /// (host, rank) of a process identifier as interface `ni` names it.
    fn locate(&self, ni: NiHandle, id: ProcessId) -> Result<(u16, u32), PtlError> {
        let info = self.info(ni)?;
        let phys = match (info.logical, id) {
            (true, ProcessId::Logical { rank }) => match &info.map {
                Some(m) => *m.get(rank as usize).ok_or(PtlError::ArgInvalid)?,
                // The job's placement, read in place: an operation builds no map.
                None => self.placed(rank).ok_or(PtlError::ArgInvalid)?,
            },
            (false, p @ ProcessId::Physical { .. }) => p,
            _ => return Err(PtlError::ArgInvalid),
        };
        let ProcessId::Physical { nid, pid } = phys else {
            return Err(PtlError::ArgInvalid);
        };
        let host = self.ep.rank_host(pid).map_err(|_| PtlError::ArgInvalid)?;
        if host as u32 != nid {
            return Err(PtlError::ArgInvalid);
        }
        Ok((host, pid))
    }

    fn wire_ni(&self, ni: NiHandle) -> Result<u8, PtlError> {
        let i = self.info(ni)?;
        Ok(ni.0 | if i.logical { 0 } else { 0x80 })
    }

    // ------------------------------------------------------------------ event queues

    /// PtlEQAlloc.
    pub fn eq_alloc(&mut self, ni: NiHandle, count: usize) -> Result<u32, PortalsError> {
        let wni = self.wire_ni(ni)?;
        if count == 0 || count > 1 << 20 {
            return Err(PtlError::ArgInvalid.into());
        }
        let len = ring_bytes(count);
        let mem = self.ep.mem_register(len, Perms(0))?;
        let ring = EventRing::new(region_of(&mem), 0, len as u64).ok_or(PtlError::ArgInvalid)?;
        let eq = self.call(&PtlCall::EqAlloc {
            ni: wni,
            count: count as u32,
            ring: Buf {
                region: mem.handle.0,
                offset: 0,
                length: len as u64,
            },
        })? as u32;
        self.info_mut(ni)?.eqs.insert(eq, (ring, mem));
        Ok(eq)
    }

    /// PtlEQFree.
    pub fn eq_free(&mut self, ni: NiHandle, eq: u32) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::EqFree { ni: wni, eq })?;
        if let Some((_, mem)) = self.info_mut(ni)?.eqs.remove(&eq) {
            self.ep.mem_deregister(&mem)?;
        }
        Ok(())
    }

    /// PtlEQGet: the next event and whether events were dropped before it (PTL_EQ_DROPPED).
    pub fn eq_get(&mut self, ni: NiHandle, eq: u32) -> Result<(Event, bool), PtlError> {
        let (ring, _) = self
            .info_mut(ni)?
            .eqs
            .get_mut(&eq)
            .ok_or(PtlError::ArgInvalid)?;
        ring.pop().ok_or(PtlError::EqEmpty)
    }

    /// PtlEQWait.
    pub fn eq_wait(&mut self, ni: NiHandle, eq: u32) -> Result<(Event, bool), PortalsError> {
        self.eq_poll(ni, &[eq], None).map(|(e, d, _)| (e, d))
    }

    /// PtlEQPoll: the first event of any of `eqs` (and which), waiting up to `timeout`
    /// (`None`: for ever); PTL_EQ_EMPTY when the time runs out.
    pub fn eq_poll(
        &mut self,
        ni: NiHandle,
        eqs: &[u32],
        timeout: Option<Duration>,
    ) -> Result<(Event, bool, usize), PortalsError> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            for (i, &eq) in eqs.iter().enumerate() {
                match self.eq_get(ni, eq) {
                    Ok((e, d)) => return Ok((e, d, i)),
                    Err(PtlError::EqEmpty) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if timeout.is_some_and(|t| start.elapsed() >= t) {
                return Err(PtlError::EqEmpty.into());
            }
            self.idle(&mut spins, start, Some((ni, eqs, &[], &[])))?;
        }
    }

    /// Adaptive waiting: spin, yield, then sleep on the NIC's doorbell (not missing events
    /// that land in `eqs` meanwhile). Libraries on Portals with waits of their own (MPI's)
    /// take their turns through it too.
    pub(crate) fn idle(
        &mut self,
        spins: &mut u32,
        start: Instant,
        on: Option<WaitOn<'_>>,
    ) -> Result<(), PortalsError> {
        *spins += 1;
        self.ep.progress();
        if *spins < crate::client::SPIN_BEFORE_YIELD || self.ep.client().keep_core() {
            std::hint::spin_loop();
        } else if start.elapsed() < Duration::from_micros(500) {
            self.ep.client().yield_now();
        } else {
            match on {
                Some((ni, eqs, cts, tests)) => {
                    self.sleep(ni, eqs, cts, tests, Duration::from_millis(2))?
                }
                None => self
                    .ep
                    .client()
                    .sleep_until_news(Duration::from_millis(2))
                    .map_err(NicError::from)?,
            }
        }
        Ok(())
    }

    /// Sleeps on the NIC's doorbell until an event may be waiting in one of `eqs` (or a
    /// completion arrived, or `max` passed). Returns at once if one already is.
    pub fn eq_sleep(
        &mut self,
        ni: NiHandle,
        eqs: &[u32],
        max: Duration,
    ) -> Result<(), PortalsError> {
        self.sleep(ni, eqs, &[], &[], max)
    }

    /// [`Portals::eq_sleep`] that also returns at once when one of the counting events
    /// `cts` has reached its entry of `tests` (successes plus failures).
    pub fn sleep(
        &mut self,
        ni: NiHandle,
        eqs: &[u32],
        cts: &[u32],
        tests: &[u64],
        max: Duration,
    ) -> Result<(), PortalsError> {
        let info = self.info(ni)?;
        let rings: Vec<&EventRing> = eqs
            .iter()
            .filter_map(|eq| info.eqs.get(eq).map(|(r, _)| r))
            .collect();
        let counts: Vec<(&CtSlot, u64)> = cts
            .iter()
            .zip(tests)
            .filter_map(|(ct, t)| info.cts.get(ct).map(|s| (s, *t)))
            .collect();
        let ready = || {
            rings.iter().any(|r| r.pending())
                || counts.iter().any(|(s, t)| {
                    let v = s.load();
                    v.success + v.failure >= *t
                })
        };
        for (s, t) in &counts {
            s.set_wake_at((*t).max(1));
        }
        let r = self.ep.client().sleep_until_news_unless(max, &ready);
        for (s, _) in &counts {
            s.set_wake_at(0);
        }
        r.map_err(NicError::from)?;
        Ok(())
    }

    // ------------------------------------------------------------------ counting events

    /// PtlCTAlloc.
    pub fn ct_alloc(&mut self, ni: NiHandle) -> Result<u32, PortalsError> {
        let wni = self.wire_ni(ni)?;
        let info = self.info_mut(ni)?;
        let slot = info.free_ct_slots.pop().ok_or(PtlError::NoSpace)?;
        let mem = info.ct_mem.clone();
        let r = self.call(&PtlCall::CtAlloc {
            ni: wni,
            slot: Buf {
                region: mem.handle.0,
                offset: slot * CT_SLOT_LEN,
                length: CT_SLOT_LEN,
            },
        });
        let info = self.info_mut(ni)?;
        match r {
            Ok(ct) => {
                let cs =
                    CtSlot::new(region_of(&mem), slot * CT_SLOT_LEN).ok_or(PtlError::ArgInvalid)?;
                info.cts.insert(ct as u32, cs);
                Ok(ct as u32)
            }
            Err(e) => {
                info.free_ct_slots.push(slot);
                Err(e)
            }
        }
    }

    /// PtlCTFree.
    pub fn ct_free(&mut self, ni: NiHandle, ct: u32) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::CtFree { ni: wni, ct })?;
        let info = self.info_mut(ni)?;
        if info.cts.remove(&ct).is_some() {
            // Slots are not recycled by handle; the NIC stops writing a freed CT's slot.
        }
        Ok(())
    }

    /// PtlCTGet.
    pub fn ct_get(&self, ni: NiHandle, ct: u32) -> Result<CtEvent, PtlError> {
        Ok(self
            .info(ni)?
            .cts
            .get(&ct)
            .ok_or(PtlError::ArgInvalid)?
            .load())
    }

    /// PtlCTWait: until the success count reaches `test` or a failure is counted.
    pub fn ct_wait(&mut self, ni: NiHandle, ct: u32, test: u64) -> Result<CtEvent, PortalsError> {
        self.ct_poll(ni, &[ct], &[test], None).map(|(v, _)| v)
    }

    /// PtlCTPoll over several counting events; PTL_CT_NONE_REACHED on timeout.
    pub fn ct_poll(
        &mut self,
        ni: NiHandle,
        cts: &[u32],
        tests: &[u64],
        timeout: Option<Duration>,
    ) -> Result<(CtEvent, usize), PortalsError> {
        if cts.len() != tests.len() || cts.is_empty() {
            return Err(PtlError::ArgInvalid.into());
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            for (i, (&ct, &t)) in cts.iter().zip(tests).enumerate() {
                let v = self.ct_get(ni, ct)?;
                if v.reached(t) {
                    return Ok((v, i));
                }
            }
            if timeout.is_some_and(|t| start.elapsed() >= t) {
                return Err(PtlError::CtNoneReached.into());
            }
            self.idle(&mut spins, start, Some((ni, &[], cts, tests)))?;
        }
    }

    /// PtlCTSet.
    pub fn ct_set(&mut self, ni: NiHandle, ct: u32, v: CtEvent) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::CtSet {
            ni: wni,
            ct,
            success: v.success,
            failure: v.failure,
        })
        .map(|_| ())
    }

    /// PtlCTInc.
    pub fn ct_inc(&mut self, ni: NiHandle, ct: u32, by: CtEvent) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::CtInc {
            ni: wni,
            ct,
            success: by.success,
            failure: by.failure,
        })
        .map(|_| ())
    }

    /// PtlCTCancelTriggered.
    pub fn ct_cancel_triggered(&mut self, ni: NiHandle, ct: u32) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::CtCancelTriggered { ni: wni, ct })
            .map(|_| ())
    }

    /// PtlTriggeredCTInc / PtlTriggeredCTSet.
    pub fn triggered_ct(
        &mut self,
        ni: NiHandle,
        ct: u32,
        threshold: u64,
        target: u32,
        set: bool,
        v: CtEvent,
    ) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::CtTriggered {
            ni: wni,
            ct,
            threshold,
            target,
            set,
            success: v.success,
            failure: v.failure,
        })
        .map(|_| ())
    }

    // ------------------------------------------------------------------ portal table

    /// PtlPTAlloc (`index: None` is PTL_PT_ANY).
    pub fn pt_alloc(
        &mut self,
        ni: NiHandle,
        options: u32,
        eq: Option<u32>,
        index: Option<u32>,
    ) -> Result<u32, PortalsError> {
        let wni = self.wire_ni(ni)?;
        let idx = self.call(&PtlCall::PtAlloc {
            ni: wni,
            options,
            eq,
            index,
        })? as u32;
        self.info_mut(ni)?.pts.insert(idx, eq);
        Ok(idx)
    }

    pub fn pt_free(&mut self, ni: NiHandle, index: u32) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::PtFree { ni: wni, index })?;
        self.info_mut(ni)?.pts.remove(&index);
        Ok(())
    }

    pub fn pt_enable(&mut self, ni: NiHandle, index: u32) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::PtEnable {
            ni: wni,
            index,
            enable: true,
        })
        .map(|_| ())
    }

    pub fn pt_disable(&mut self, ni: NiHandle, index: u32) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::PtEnable {
            ni: wni,
            index,
            enable: false,
        })
        .map(|_| ())
    }

    // ------------------------------------------------------------------ list entries

    fn me_args(&self, logical: bool, me: &Me) -> Result<MeArgs, PtlError> {
        let match_id = match (logical, me.match_id) {
            (true, ProcessId::Logical { rank }) => (0, rank, 0),
            (false, ProcessId::Physical { nid, pid }) => (1, nid, pid),
            _ => return Err(PtlError::ArgInvalid),
        };
        Ok(MeArgs {
            buf: Buf {
                region: me.buf.region.0,
                offset: me.buf.offset,
                length: me.buf.len,
            },
            ct: me.ct,
            uid: me.uid,
            options: me.options,
            match_id,
            match_bits: me.match_bits,
            ignore_bits: me.ignore_bits,
            min_free: me.min_free,
        })
    }

    /// PtlMEAppend (PtlLEAppend on a non-matching interface).
    pub fn me_append(
        &mut self,
        ni: NiHandle,
        pt: u32,
        me: &Me,
        list: List,
        user_ptr: u64,
    ) -> Result<u32, PortalsError> {
        let c = self.append_call(ni, pt, me, list, user_ptr)?;
        self.call(&c).map(|h| h as u32)
    }

    fn append_call(
        &self,
        ni: NiHandle,
        pt: u32,
        me: &Me,
        list: List,
        user_ptr: u64,
    ) -> Result<PtlCall, PtlError> {
        Ok(PtlCall::Append {
            ni: self.wire_ni(ni)?,
            pt,
            overflow: list == List::Overflow,
            user_ptr,
            me: self.me_args(self.info(ni)?.logical, me)?,
        })
    }

    /// PtlMEAppend without waiting for the NIC's answer (softnic's extension): the entry has
    /// no handle, so it can only leave its list by being used up (USE_ONCE, MANAGE_LOCAL) or
    /// by the portal's freeing. If the NIC refuses it, a PTL_EVENT_LINK with `ni_fail`
    /// NoSpace or ArgInvalid and this `user_ptr` arrives on the portal's event queue, which
    /// the portal must therefore have.
    pub fn me_append_oneway(
        &mut self,
        ni: NiHandle,
        pt: u32,
        me: &Me,
        list: List,
        user_ptr: u64,
    ) -> Result<(), PortalsError> {
        if !matches!(self.info(ni)?.pts.get(&pt), Some(Some(_))) {
            return Err(PtlError::ArgInvalid.into());
        }
        let c = self.append_call(ni, pt, me, list, user_ptr)?;
        self.oneway(&c)
    }

    /// PtlLEAppend: a list entry on a non-matching interface (match fields ignored).
    pub fn le_append(
        &mut self,
        ni: NiHandle,
        pt: u32,
        le: &Me,
        list: List,
        user_ptr: u64,
    ) -> Result<u32, PortalsError> {
        if self.info(ni)?.matching {
            return Err(PtlError::ArgInvalid.into());
        }
        self.me_append(ni, pt, le, list, user_ptr)
    }

    /// PtlLEUnlink.
    pub fn le_unlink(&mut self, ni: NiHandle, handle: u32) -> Result<(), PortalsError> {
        self.me_unlink(ni, handle)
    }

    /// PtlLESearch.
    pub fn le_search(
        &mut self,
        ni: NiHandle,
        pt: u32,
        le: &Me,
        op: SearchOp,
        user_ptr: u64,
    ) -> Result<(), PortalsError> {
        if self.info(ni)?.matching {
            return Err(PtlError::ArgInvalid.into());
        }
        self.me_search(ni, pt, le, op, user_ptr)
    }

    /// PtlMEUnlink / PtlLEUnlink.
    pub fn me_unlink(&mut self, ni: NiHandle, handle: u32) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::Unlink { ni: wni, handle }).map(|_| ())
    }

    /// PtlMESearch: results arrive as events (PTL_EVENT_SEARCH or *_OVERFLOW).
    pub fn me_search(
        &mut self,
        ni: NiHandle,
        pt: u32,
        me: &Me,
        op: SearchOp,
        user_ptr: u64,
    ) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        let args = self.me_args(self.info(ni)?.logical, me)?;
        self.call(&PtlCall::Search {
            ni: wni,
            pt,
            delete: op == SearchOp::SearchDelete,
            user_ptr,
            me: args,
        })
        .map(|_| ())
    }

    // ------------------------------------------------------------------ memory descriptors

    /// PtlMDBind.
    /// A `PTL_MD_VOLATILE` MD must lie in memory registered through this library's endpoint
    /// (its sends are copied from there before the call returns): elsewhere, ArgInvalid.
    pub fn md_bind(&mut self, ni: NiHandle, md: &Md) -> Result<u32, PortalsError> {
        let wni = self.wire_ni(ni)?;
        let len: u64 = md.segments.iter().map(|s| s.1).sum();
        let volatile = match md.options & md_opt::VOLATILE {
            0 => None,
            _ => {
                let r = self.ep.region(md.region).ok_or(PtlError::ArgInvalid)?;
                let inside = md
                    .segments
                    .iter()
                    .all(|&(at, n)| at.checked_add(n).is_some_and(|end| end <= r.len() as u64));
                if !inside {
                    return Err(PtlError::ArgInvalid.into());
                }
                Some((region_of(r), md.segments.clone()))
            }
        };
        let h = self.call(&PtlCall::MdBind {
            ni: wni,
            region: md.region.0,
            segments: md.segments.clone(),
            options: md.options,
            eq: md.eq,
            ct: md.ct,
        })? as u32;
        self.info_mut(ni)?.mds.insert(h, MdInfo { len, volatile });
        Ok(h)
    }

    /// PtlMDRelease.
    pub fn md_release(&mut self, ni: NiHandle, md: u32) -> Result<(), PortalsError> {
        let wni = self.wire_ni(ni)?;
        self.call(&PtlCall::MdRelease { ni: wni, md })?;
        self.info_mut(ni)?.mds.remove(&md);
        Ok(())
    }

    // ------------------------------------------------------------------ data movement

    /// Starts `op` (its target as the interface names it) or, with `trigger`, hands it to the
    /// NIC to start once the counter reaches the threshold.
    fn op(
        &mut self,
        ni: NiHandle,
        op: OpSpec,
        trigger: Option<(u32, u64)>,
    ) -> Result<(), PortalsError> {
        // Atomics longer than max_atomic_size go as several operations (triggered ones too).
        let max = match op.kind {
            ReqKind::Atomic(_, dt) => {
                let w = dt.size() as u64;
                (self.info(ni)?.limits.max_atomic_size / w * w).max(w)
            }
            _ => u64::MAX,
        };
        if op.length <= max {
            return self.op_one(ni, op, trigger);
        }
        let mut done = 0;
        while done < op.length {
            let part = OpSpec {
                offset: op.offset + done,
                length: (op.length - done).min(max),
                remote_offset: op.remote_offset + done,
                ..op.clone()
            };
            done += part.length;
            self.op_one(ni, part, trigger)?;
        }
        Ok(())
    }

    fn op_one(
        &mut self,
        ni: NiHandle,
        mut op: OpSpec,
        trigger: Option<(u32, u64)>,
    ) -> Result<(), PortalsError> {
        // Kept between calls (an error drops it: the next call allocates anew).
        let mut inline = std::mem::take(&mut self.inline);
        let wni = self.wire_ni(ni)?;
        let info = self.info(ni)?;
        let (host, rank) = self.locate(ni, op.target)?;
        let md = info.mds.get(&op.md).ok_or(PtlError::ArgInvalid)?;
        let sends = op.kind != ReqKind::Get;
        if op.length > info.limits.max_msg_size
            || (sends && op.offset.checked_add(op.length).is_none_or(|e| e > md.len))
        {
            return Err(PtlError::ArgInvalid.into());
        }
        inline.clear();
        if let (true, Some((region, segments))) = (sends, &md.volatile) {
            if op.length > info.limits.max_volatile_size {
                return Err(PtlError::ArgInvalid.into());
            }
            // The segments lie inside the region (checked at bind), the range inside the MD.
            crate::nic::portals::initiator::gather(
                region,
                segments,
                op.offset,
                op.length,
                &mut inline,
            )
            .map_err(|_| PtlError::ArgInvalid)?;
        }
        op.inline = inline;
        if let Some(g) = op.get_md {
            let glen = info.mds.get(&g).ok_or(PtlError::ArgInvalid)?.len;
            if op
                .get_offset
                .checked_add(op.length)
                .is_none_or(|e| e > glen)
            {
                return Err(PtlError::ArgInvalid.into());
            }
        }
        let (aop, swap) = match op.kind {
            ReqKind::Atomic(o, d) | ReqKind::FetchAtomic(o, d) => (Some((o, d)), false),
            ReqKind::Swap(o, d) => (Some((o, d)), true),
            ReqKind::Put | ReqKind::Get => (None, false),
        };
        if let Some((o, d)) = aop {
            let w = d.size() as u64;
            if !o.supports(d) || o.is_swap() != swap || !op.length.is_multiple_of(w) {
                return Err(PtlError::ArgInvalid.into());
            }
            if swap && o != AtomicOp::Swap && (op.length != w || (op.operand.len() as u64) < w) {
                return Err(PtlError::ArgInvalid.into());
            }
        }
        op.target = ProcessId::Physical {
            nid: host as u32,
            pid: rank,
        };
        let call = PtlCall::Op {
            ni: wni,
            op,
            trigger,
        };
        // Triggered ones too go one-way once their counter is known to be ours: the NIC
        // counts a failure on it if it has no room to arm the operation.
        if let Some((ct, _)) = trigger {
            if !self.info(ni)?.cts.contains_key(&ct) {
                return Err(PtlError::ArgInvalid.into());
            }
        }
        let r = self.oneway(&call);
        if let PtlCall::Op { op, .. } = call {
            self.inline = op.inline;
        }
        r
    }

    /// PtlPut.
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &mut self,
        ni: NiHandle,
        md: u32,
        offset: u64,
        length: u64,
        ack_req: AckReq,
        t: Target,
        user_ptr: u64,
        hdr_data: u64,
    ) -> Result<(), PortalsError> {
        let op = movement(
            ReqKind::Put,
            (md, offset),
            None,
            length,
            ack_req,
            t,
            (user_ptr, hdr_data),
        );
        self.op(ni, op, None)
    }

    /// PtlGet: the reply lands in `md` at `offset`.
    pub fn get(
        &mut self,
        ni: NiHandle,
        md: u32,
        offset: u64,
        length: u64,
        t: Target,
        user_ptr: u64,
    ) -> Result<(), PortalsError> {
        let op = movement(
            ReqKind::Get,
            (md, offset),
            Some((md, offset)),
            length,
            NO_ACK,
            t,
            (user_ptr, 0),
        );
        self.op(ni, op, None)
    }

    /// PtlAtomic, split at max_atomic_size into several operations when longer.
    #[allow(clippy::too_many_arguments)]
    pub fn atomic(
        &mut self,
        ni: NiHandle,
        md: u32,
        offset: u64,
        length: u64,
        ack_req: AckReq,
        t: Target,
        user_ptr: u64,
        hdr_data: u64,
        op: AtomicOp,
        dt: Datatype,
    ) -> Result<(), PortalsError> {
        let op = movement(
            ReqKind::Atomic(op, dt),
            (md, offset),
            None,
            length,
            ack_req,
            t,
            (user_ptr, hdr_data),
        );
        self.op(ni, op, None)
    }

    /// PtlFetchAtomic: old values land in `get_md` at `get_offset`.
    #[allow(clippy::too_many_arguments)]
    pub fn fetch_atomic(
        &mut self,
        ni: NiHandle,
        get_md: u32,
        get_offset: u64,
        put_md: u32,
        put_offset: u64,
        length: u64,
        t: Target,
        user_ptr: u64,
        hdr_data: u64,
        op: AtomicOp,
        dt: Datatype,
    ) -> Result<(), PortalsError> {
        let kind = ReqKind::FetchAtomic(op, dt);
        let (get, put) = ((get_md, get_offset), (put_md, put_offset));
        let op = fetching(kind, get, put, length, t, (user_ptr, hdr_data), &[]);
        self.op(ni, op, None)
    }

    /// PtlSwap (SWAP, CSWAP*, MSWAP): `operand` is the comparand or mask.
    #[allow(clippy::too_many_arguments)]
    pub fn swap(
        &mut self,
        ni: NiHandle,
        get_md: u32,
        get_offset: u64,
        put_md: u32,
        put_offset: u64,
        length: u64,
        t: Target,
        user_ptr: u64,
        hdr_data: u64,
        operand: &[u8],
        op: AtomicOp,
        dt: Datatype,
    ) -> Result<(), PortalsError> {
        let kind = ReqKind::Swap(op, dt);
        let (get, put) = ((get_md, get_offset), (put_md, put_offset));
        let op = fetching(kind, get, put, length, t, (user_ptr, hdr_data), operand);
        self.op(ni, op, None)
    }

    /// PtlAtomicSync: atomics issued before it are ordered before operations after it. The NIC
    /// applies them in issue order per target, so this has nothing to wait for.
    pub fn atomic_sync(&mut self) -> Result<(), PortalsError> {
        Ok(())
    }

    /// PtlTriggeredPut: issued by the NIC once `ct` reaches `threshold`. Like every triggered
    /// call here it is posted without waiting for the NIC: an operation the NIC has no room
    /// to arm (`max_triggered_ops`) counts one failure on `ct` instead of a PTL_NO_SPACE.
    #[allow(clippy::too_many_arguments)]
    pub fn triggered_put(
        &mut self,
        ni: NiHandle,
        md: u32,
        offset: u64,
        length: u64,
        ack_req: AckReq,
        t: Target,
        user_ptr: u64,
        hdr_data: u64,
        ct: u32,
        threshold: u64,
    ) -> Result<(), PortalsError> {
        let op = movement(
            ReqKind::Put,
            (md, offset),
            None,
            length,
            ack_req,
            t,
            (user_ptr, hdr_data),
        );
        self.op(ni, op, Some((ct, threshold)))
    }

    /// PtlTriggeredGet.
    #[allow(clippy::too_many_arguments)]
    pub fn triggered_get(
        &mut self,
        ni: NiHandle,
        md: u32,
        offset: u64,
        length: u64,
        t: Target,
        user_ptr: u64,
        ct: u32,
        threshold: u64,
    ) -> Result<(), PortalsError> {
        let op = movement(
            ReqKind::Get,
            (md, offset),
            Some((md, offset)),
            length,
            NO_ACK,
            t,
            (user_ptr, 0),
        );
        self.op(ni, op, Some((ct, threshold)))
    }

    /// PtlTriggeredAtomic.
    #[allow(clippy::too_many_arguments)]
    pub fn triggered_atomic(
        &mut self,
        ni: NiHandle,
        md: u32,
        offset: u64,
        length: u64,
        ack_req: AckReq,
        t: Target,
        user_ptr: u64,
        hdr_data: u64,
        op: AtomicOp,
        dt: Datatype,
        ct: u32,
        threshold: u64,
    ) -> Result<(), PortalsError> {
        let op = movement(
            ReqKind::Atomic(op, dt),
            (md, offset),
            None,
            length,
            ack_req,
            t,
            (user_ptr, hdr_data),
        );
        self.op(ni, op, Some((ct, threshold)))
    }

    /// PtlTriggeredFetchAtomic.
    #[allow(clippy::too_many_arguments)]
    pub fn triggered_fetch_atomic(
        &mut self,
        ni: NiHandle,
        get_md: u32,
        get_offset: u64,
        put_md: u32,
        put_offset: u64,
        length: u64,
        t: Target,
        user_ptr: u64,
        hdr_data: u64,
        op: AtomicOp,
        dt: Datatype,
        ct: u32,
        threshold: u64,
    ) -> Result<(), PortalsError> {
        let kind = ReqKind::FetchAtomic(op, dt);
        let (get, put) = ((get_md, get_offset), (put_md, put_offset));
        let op = fetching(kind, get, put, length, t, (user_ptr, hdr_data), &[]);
        self.op(ni, op, Some((ct, threshold)))
    }

    /// PtlTriggeredSwap.
    #[allow(clippy::too_many_arguments)]
    pub fn triggered_swap(
        &mut self,
        ni: NiHandle,
        get_md: u32,
        get_offset: u64,
        put_md: u32,
        put_offset: u64,
        length: u64,
        t: Target,
        user_ptr: u64,
        hdr_data: u64,
        operand: &[u8],
        op: AtomicOp,
        dt: Datatype,
        ct: u32,
        threshold: u64,
    ) -> Result<(), PortalsError> {
        let kind = ReqKind::Swap(op, dt);
        let (get, put) = ((get_md, get_offset), (put_md, put_offset));
        let op = fetching(kind, get, put, length, t, (user_ptr, hdr_data), operand);
        self.op(ni, op, Some((ct, threshold)))
    }

    /// Whether interface `ni` matches (PTL_NI_MATCHING).
    pub fn is_matching(&self, ni: NiHandle) -> Result<bool, PtlError> {
        Ok(self.info(ni)?.matching)
    }
}

/// Fetching operations ask for no acknowledgement: their reply is the completion.
const NO_ACK: AckReq = AckReq::NoAck;

/// A fetch-atomic or swap: `put` is read and sent, the old values land in `get`; a swap's
/// `operand` is its comparand or mask.
fn fetching(
    kind: ReqKind,
    get: (u32, u64),
    put: (u32, u64),
    length: u64,
    t: Target,
    tags: (u64, u64),
    operand: &[u8],
) -> OpSpec {
    OpSpec {
        operand: operand.to_vec(),
        ..movement(kind, put, Some(get), length, NO_ACK, t, tags)
    }
}

/// The operation a data-movement call describes: `src` is the payload (or, for a get, the
/// reply buffer again), `get` where replied data lands, `tags` the user pointer and header
/// data.
fn movement(
    kind: ReqKind,
    src: (u32, u64),
    get: Option<(u32, u64)>,
    length: u64,
    ack_req: AckReq,
    t: Target,
    tags: (u64, u64),
) -> OpSpec {
    OpSpec {
        kind,
        md: src.0,
        offset: src.1,
        length,
        get_md: get.map(|g| g.0),
        get_offset: get.map_or(0, |g| g.1),
        ack_req,
        target: t.id,
        pt_index: t.pt_index,
        match_bits: t.match_bits,
        remote_offset: t.remote_offset,
        user_ptr: tags.0,
        hdr_data: tags.1,
        operand: Vec::new(),
        inline: Vec::new(),
    }
}

/// The NIC-memory view of a registered region, for reading rings this process shares and
/// copying a volatile MD's bytes.
fn region_of(m: &MemRegion) -> Region {
    m.nic_region()
}
