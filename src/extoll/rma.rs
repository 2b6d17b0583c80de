//! RMA (after librma2): [`Rma::open`] gives a port with a notification queue in this process's
//! memory; [`Rma::register`] memory to get its **NLA**; [`Rma::post_put`], [`Rma::post_get`]
//! and [`Rma::immediate_put`] move data between a local region and a remote NLA (at most 8 MiB
//! an operation); notifications, asked for with the `notify` flags, say when each part is done:
//! a put's requester (origin, source read) and completer (target, data in place); a get's
//! requester (origin, request sent), responder (target, served) and completer (origin, data
//! landed). Each comes exactly once. An operation that fails always raises a completer at the
//! origin carrying the error ([`Notification::result`]).
//!
//! Read them as librma2 does: [`Rma::noti_probe`] (or [`Rma::noti_get_block`], which waits)
//! shows the oldest without taking it, [`Rma::noti_free`] takes it. A full queue holds back
//! the NIC (and, at a put's target, the put's acknowledgement), never loses an entry.

use std::sync::atomic::Ordering;

use super::{Conn, Shared};
use crate::client::{wait_until, Endpoint, MemRegion, NicError, NOTE_DISCARD};
use crate::nic::memory::Perms;
use crate::nic::rma::{entry_at, phase, queue_len, split_nla, MAX_OP};
use crate::shm::{Command, CommandKind};
use crate::wire::Status;

pub use crate::nic::rma::{
    nla, Class, Cmd, Notification, NOTIFY_COMPLETER, NOTIFY_REQUESTER, NOTIFY_RESPONDER,
};

#[derive(Debug, thiserror::Error)]
pub enum RmaError {
    #[error("{0} bytes is more than one RMA operation moves ({MAX_OP})")]
    TooLarge(u64),
    #[error("an immediate put carries 1 to 8 bytes, not {0}")]
    ImmediateSize(usize),
    #[error("local range [{off}, +{len}) lies outside the {region_len}-byte region")]
    LocalBounds {
        off: u64,
        len: u64,
        region_len: usize,
    },
    #[error("rank {0} is not in this job")]
    NoSuchRank(u32),
    #[error("RMA operation failed at the NIC: {0:?}")]
    Failed(Status),
    #[error("cannot open the RMA port: {0}")]
    Open(String),
    #[error(transparent)]
    Nic(#[from] NicError),
}

impl Notification {
    /// `Ok` for a notification of success, the failure it reports otherwise.
    pub fn result(&self) -> Result<(), RmaError> {
        match self.error {
            0 => Ok(()),
            _ => Err(RmaError::Failed(self.status())),
        }
    }
}

/// Registered memory with its NLA.
#[derive(Clone)]
pub struct RmaRegion {
    pub mem: MemRegion,
    pub nla: u64,
}

impl RmaRegion {
    /// The NLA of byte `off` of this region.
    pub fn nla_at(&self, off: u64) -> u64 {
        self.nla + off
    }
}

/// Where an operation's local bytes are: a registered region, or the command itself.
enum LocalSide<'a> {
    Region(&'a RmaRegion, u64),
    Bytes(&'a [u8]),
}

/// This process's RMA port.
pub struct Rma {
    ep: Shared,
    queue: MemRegion,
    n: u64,
    read: u64,
}

impl Rma {
    /// Attaches to this rank's NIC and opens the port (collective).
    pub fn open() -> Result<Rma, RmaError> {
        let ep = Endpoint::init()?;
        Self::open_on(std::rc::Rc::new(std::cell::RefCell::new(ep)))
    }

    /// Opens the port on an endpoint this process already holds (collective).
    pub fn open_on(ep: Shared) -> Result<Rma, RmaError> {
        let n: u64 = super::env_num("SOFTNIC_RMA_NOTIFICATIONS", 4096);
        if !n.is_power_of_two() || n < 4 {
            return Err(RmaError::Open(format!(
                "SOFTNIC_RMA_NOTIFICATIONS={n}: a power of two, at least 4"
            )));
        }
        let cmd = Command {
            kind: CommandKind::RmaOpen,
            operand: n,
            ..Default::default()
        };
        let queue = match super::open_port(&ep, queue_len(n) as usize, cmd) {
            Ok(q) => q,
            Err(super::PortError::Nic(e)) => return Err(e.into()),
            Err(super::PortError::Refused(s)) => {
                return Err(RmaError::Open(format!(
                    "the NIC refused it: {s:?} (a port is open already?)"
                )))
            }
        };
        Ok(Rma {
            ep,
            queue,
            n,
            read: 0,
        })
    }

    pub fn endpoint(&self) -> Shared {
        self.ep.clone()
    }

    pub fn rank(&self) -> u32 {
        self.ep.borrow().rank()
    }

    pub fn size(&self) -> u32 {
        self.ep.borrow().size()
    }

    pub fn connect(&self, rank: u32) -> Result<Conn, RmaError> {
        Conn::to(&self.ep, rank).ok_or(RmaError::NoSuchRank(rank))
    }

    /// Registers `len` bytes of fresh memory for remote access; its NLA names byte 0.
    /// Handles are assigned in registration order, so ranks registering alike get the same
    /// NLAs.
    pub fn register(&mut self, len: usize) -> Result<RmaRegion, RmaError> {
        let mem = self.ep.borrow_mut().mem_register(len, Perms::READ_WRITE)?;
        let nla = nla(mem.handle.0, 0);
        Ok(RmaRegion { mem, nla })
    }

    fn check(local: &RmaRegion, off: u64, len: u64) -> Result<(), RmaError> {
        if len > MAX_OP {
            return Err(RmaError::TooLarge(len));
        }
        match off.checked_add(len) {
            Some(e) if e <= local.mem.len() as u64 => Ok(()),
            _ => Err(RmaError::LocalBounds {
                off,
                len,
                region_len: local.mem.len(),
            }),
        }
    }

    fn post(
        &mut self,
        kind: CommandKind,
        conn: Conn,
        remote_nla: u64,
        len: u64,
        local: LocalSide<'_>,
        notify: u8,
    ) -> Result<(), RmaError> {
        let (remote_region, remote_off) = split_nla(remote_nla);
        let mut cmd = Command {
            kind,
            host: conn.host,
            rank: conn.rank,
            remote_region,
            remote_off,
            len,
            operand: notify as u64,
            ..Default::default()
        };
        let inline = match local {
            LocalSide::Region(r, off) => {
                let (region, base) = split_nla(r.nla);
                cmd.local_region = region;
                cmd.local_off = base + off;
                &[][..]
            }
            LocalSide::Bytes(b) => b,
        };
        self.ep.borrow_mut().post_noted(cmd, inline, NOTE_DISCARD)?;
        Ok(())
    }

    /// Puts `len` bytes of `local` from `local_off` to `remote_nla` of `conn`. The source must
    /// stay unchanged until its requester notification (or the completer's at the target).
    pub fn post_put(
        &mut self,
        conn: Conn,
        local: &RmaRegion,
        local_off: u64,
        remote_nla: u64,
        len: u64,
        notify: u8,
    ) -> Result<(), RmaError> {
        Self::check(local, local_off, len)?;
        self.post(
            CommandKind::RmaPut,
            conn,
            remote_nla,
            len,
            LocalSide::Region(local, local_off),
            notify,
        )
    }

    /// Gets `len` bytes from `remote_nla` of `conn` into `local` at `local_off`.
    pub fn post_get(
        &mut self,
        conn: Conn,
        local: &RmaRegion,
        local_off: u64,
        remote_nla: u64,
        len: u64,
        notify: u8,
    ) -> Result<(), RmaError> {
        Self::check(local, local_off, len)?;
        self.post(
            CommandKind::RmaGet,
            conn,
            remote_nla,
            len,
            LocalSide::Region(local, local_off),
            notify,
        )
    }

    /// Puts 1–8 bytes carried in the command itself.
    pub fn immediate_put(
        &mut self,
        conn: Conn,
        remote_nla: u64,
        value: &[u8],
        notify: u8,
    ) -> Result<(), RmaError> {
        if !(1..=8).contains(&value.len()) {
            return Err(RmaError::ImmediateSize(value.len()));
        }
        self.post(
            CommandKind::RmaImmediate,
            conn,
            remote_nla,
            value.len() as u64,
            LocalSide::Bytes(value),
            notify,
        )
    }

    fn peek(&self) -> Option<Notification> {
        let at = entry_at(self.read, self.n) as usize;
        let w0 = self.queue.word(at).load(Ordering::Acquire);
        let w1 = self.queue.word(at + 8).load(Ordering::Relaxed);
        Notification::decode([w0, w1], phase(self.read, self.n))
    }

    /// Whether a notification waits (a look at memory, nothing taken).
    pub fn has_notification(&self) -> bool {
        self.peek().is_some()
    }

    /// The oldest notification not yet freed, if any (it stays until [`Rma::noti_free`]).
    pub fn noti_probe(&mut self) -> Option<Notification> {
        self.ep.borrow_mut().progress();
        self.peek()
    }

    /// Waits for the oldest notification not yet freed.
    pub fn noti_get_block(&mut self) -> Notification {
        if let Some(n) = self.peek() {
            return n;
        }
        let waiter = self.ep.borrow().client().waiter();
        let ep = self.ep.clone();
        wait_until(
            &waiter,
            || self.peek().is_some(),
            || ep.borrow_mut().progress(),
        );
        self.peek().expect("a notification was seen")
    }

    /// Takes the oldest notification out of the queue (after `noti_probe`/`noti_get_block`);
    /// `false` if there is none.
    pub fn noti_free(&mut self) -> bool {
        if self.peek().is_none() {
            return false;
        }
        self.read += 1;
        self.queue.word(0).store(self.read, Ordering::Release);
        true
    }
}
