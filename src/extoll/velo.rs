//! VELO (after velo2): [`Velo::open`] gives a port whose mailbox — a ring of fixed slots in this
//! process's memory, written only by its NIC — receives the job's messages (`nic::velo`).
//! [`Velo::send`] a message of up to 64 bytes (120 with `SOFTNIC_VELO_SLOT=128`) with a tag to
//! a connected rank; [`Velo::recv`] or [`Velo::probe_recv`] the next one, in order per sender.
//!
//! Flow control: each sender holds `SOFTNIC_VELO_CREDITS` (default 64) credits per
//! destination; a message takes one, its acknowledgement (sent once the message is in the
//! receiver's mailbox) gives it back. A receiver that does not poll therefore holds back only
//! the senders writing to it: [`Velo::try_send`] says [`VeloError::WouldBlock`], [`Velo::send`]
//! waits. Nothing is overwritten or lost.

use std::sync::atomic::Ordering;

use super::{Conn, Shared};
use crate::client::{wait_until, Endpoint, MemRegion, NicError};
use crate::nic::velo::{read_status, Geometry, FIRST_OF_TWO, SECOND};
use crate::shm::{Command, CommandKind, CMD_LAZY};
use crate::wire::Status;

#[derive(Debug, thiserror::Error)]
pub enum VeloError {
    #[error("a VELO message of {len} bytes is over the maximum of {max}")]
    TooLong { len: usize, max: usize },
    #[error("no credit left towards rank {0}: its mailbox is full (try again after polling)")]
    WouldBlock(u32),
    #[error("rank {0} is not in this job")]
    NoSuchRank(u32),
    #[error("the next message has {need} bytes, the buffer {have}")]
    BufferTooSmall { need: usize, have: usize },
    #[error("a message to rank {rank} was not delivered: {status:?}")]
    SendFailed { rank: u32, status: Status },
    #[error("cannot open the VELO port: {0}")]
    Open(String),
    #[error(transparent)]
    Nic(#[from] NicError),
}

/// The VELO port of this process.
pub struct Velo {
    ep: Shared,
    mailbox: MemRegion,
    geometry: Geometry,
    /// Slots consumed (published in the mailbox's first word).
    read: u64,
    credits: Vec<u32>,
    window: u32,
    /// A failed delivery not yet reported.
    failed: Option<(u32, Status)>,
}

impl Velo {
    /// Attaches to this rank's NIC and opens the port (collective: returns once every rank's
    /// port is open).
    pub fn open() -> Result<Velo, VeloError> {
        let ep = Endpoint::init()?;
        Self::open_on(std::rc::Rc::new(std::cell::RefCell::new(ep)))
    }

    /// Opens the port on an endpoint this process already holds (collective).
    pub fn open_on(ep: Shared) -> Result<Velo, VeloError> {
        Self::open_with_credits(ep, super::env_num("SOFTNIC_VELO_CREDITS", 64))
    }

    /// [`Velo::open_on`] with `credits` per destination (a layer sending messages of many
    /// VELO messages each needs at least that many).
    pub fn open_with_credits(ep: Shared, credits: u32) -> Result<Velo, VeloError> {
        let slot = super::env_num("SOFTNIC_VELO_SLOT", 64);
        let nslots = super::env_num("SOFTNIC_VELO_SLOTS", 1024);
        let geometry = Geometry::new(slot, nslots).ok_or_else(|| {
            VeloError::Open(format!(
                "SOFTNIC_VELO_SLOT={slot} / SOFTNIC_VELO_SLOTS={nslots}: slots of 64 or 128 \
                 bytes, a power of two of them, at least 4"
            ))
        })?;
        let window = credits.max(1);
        let cmd = Command {
            kind: CommandKind::VeloOpen,
            operand: slot as u64,
            operand2: nslots as u64,
            ..Default::default()
        };
        let mailbox = match super::open_port(&ep, geometry.region_len() as usize, cmd) {
            Ok(m) => m,
            Err(super::PortError::Nic(e)) => return Err(e.into()),
            Err(super::PortError::Refused(s)) => {
                return Err(VeloError::Open(format!(
                    "the NIC refused it: {s:?} (a port is open already?)"
                )))
            }
        };
        let size = ep.borrow().size();
        Ok(Velo {
            ep,
            mailbox,
            geometry,
            read: 0,
            credits: vec![window; size as usize],
            window,
            failed: None,
        })
    }

    /// The endpoint, to open RMA (or another API) beside.
    pub fn endpoint(&self) -> Shared {
        self.ep.clone()
    }

    pub fn rank(&self) -> u32 {
        self.ep.borrow().rank()
    }

    pub fn size(&self) -> u32 {
        self.ep.borrow().size()
    }

    /// The largest message this port sends and receives.
    pub fn max_message(&self) -> usize {
        self.geometry.max_message()
    }

    /// Credits left towards `rank` (after taking the acknowledgements that came back).
    pub fn credits(&mut self, rank: u32) -> u32 {
        self.collect();
        self.credits.get(rank as usize).copied().unwrap_or(0)
    }

    /// Whether `need` credits towards `rank` are there, taking the acknowledgements that came
    /// back only when those already counted fall short (a look at the completion queue costs a
    /// cache line the NIC writes).
    pub fn has_credits(&mut self, rank: u32, need: u32) -> bool {
        let have = |v: &Velo| v.credits.get(rank as usize).is_some_and(|&c| c >= need);
        if have(self) {
            return true;
        }
        self.collect();
        have(self)
    }

    /// Whether messages sent are not yet known to be in their mailboxes (as of the last
    /// acknowledgements taken).
    pub fn unacknowledged(&self) -> bool {
        self.credits.iter().any(|&c| c != self.window)
    }

    /// Whether the next message is in the mailbox (a look at memory, nothing taken).
    pub fn has_message(&self) -> bool {
        let g = self.geometry;
        let at = g.slot_at(self.read) as usize;
        read_status(&g, self.read, self.mailbox.word(at).load(Ordering::Acquire)).is_some()
    }

    /// A connection to `rank`.
    pub fn connect(&self, rank: u32) -> Result<Conn, VeloError> {
        Conn::to(&self.ep, rank).ok_or(VeloError::NoSuchRank(rank))
    }

    /// Takes the acknowledgements that came back: credits return, failures are kept (and
    /// reported by the next send).
    pub fn collect(&mut self) {
        let mut ep = self.ep.borrow_mut();
        for (rank, status, _) in ep.take_noted() {
            if let Some(c) = self.credits.get_mut(rank as usize) {
                *c += 1;
            }
            if status != Status::Ok as u32 && self.failed.is_none() {
                self.failed = Some((rank, Status::from_u32(status)));
            }
        }
    }

    fn report_failure(&mut self) -> Result<(), VeloError> {
        match self.failed.take() {
            Some((rank, status)) => Err(VeloError::SendFailed { rank, status }),
            None => Ok(()),
        }
    }

    /// Sends `buf` with `tag` to `conn`'s mailbox if a credit is left; `WouldBlock` if not.
    /// A delivery that failed earlier (the receiver left, its host died) is reported here.
    pub fn try_send(&mut self, conn: Conn, buf: &[u8], tag: u8) -> Result<(), VeloError> {
        let max = self.max_message();
        if buf.len() > max {
            return Err(VeloError::TooLong {
                len: buf.len(),
                max,
            });
        }
        let r = conn.rank as usize;
        if r >= self.credits.len() {
            return Err(VeloError::NoSuchRank(conn.rank));
        }
        // Take returned credits before they run low: the acknowledgements may stay lazy (riding
        // on other traffic) while half the window is left, and the noted list stays short.
        if self.credits[r] <= self.window / 2 {
            self.collect();
        }
        self.report_failure()?;
        if self.credits[r] == 0 {
            return Err(VeloError::WouldBlock(conn.rank));
        }
        self.credits[r] -= 1;
        let cmd = Command {
            kind: CommandKind::VeloSend,
            host: conn.host,
            rank: conn.rank,
            len: buf.len() as u64,
            operand: tag as u64,
            // Plenty of credit left: the acknowledgement may wait for other traffic.
            flags: if self.credits[r] > self.window / 2 {
                CMD_LAZY
            } else {
                0
            },
            ..Default::default()
        };
        self.ep.borrow_mut().post_noted(cmd, buf, conn.rank)?;
        Ok(())
    }

    /// Sends, waiting for a credit when the receiver's mailbox is full.
    pub fn send(&mut self, conn: Conn, buf: &[u8], tag: u8) -> Result<(), VeloError> {
        loop {
            match self.try_send(conn, buf, tag) {
                Err(VeloError::WouldBlock(_)) => {
                    self.ep.borrow_mut().wait_any()?;
                }
                r => return r,
            }
        }
    }

    /// The next message, if one is there: copied into `buf`, returning (length, source rank,
    /// tag). `BufferTooSmall` leaves it in the mailbox.
    pub fn probe_recv(&mut self, buf: &mut [u8]) -> Result<Option<(usize, u32, u8)>, VeloError> {
        let g = self.geometry;
        let i = self.read;
        let at = g.slot_at(i) as usize;
        let Some(s) = read_status(&g, i, self.mailbox.word(at).load(Ordering::Acquire)) else {
            return Ok(None);
        };
        if s.len > buf.len() {
            return Err(VeloError::BufferTooSmall {
                need: s.len,
                have: buf.len(),
            });
        }
        let p = g.payload();
        let first = s.len.min(p);
        let bytes = self.mailbox.bytes();
        buf[..first].copy_from_slice(&bytes[at + 8..at + 8 + first]);
        let mut used = 1;
        if s.kind == FIRST_OF_TWO {
            let at2 = g.slot_at(i + 1) as usize;
            let second = read_status(&g, i + 1, self.mailbox.word(at2).load(Ordering::Acquire));
            // The NIC writes the second slot before the first: it is there.
            debug_assert!(second.is_some_and(|x| x.kind == SECOND));
            buf[first..s.len].copy_from_slice(&bytes[at2 + 8..at2 + 8 + (s.len - first)]);
            used = 2;
        }
        self.read += used;
        self.mailbox.word(0).store(self.read, Ordering::Release);
        Ok(Some((s.len, s.src, s.tag)))
    }

    /// Waits for the next message (spinning, then yielding, then napping).
    pub fn recv(&mut self, buf: &mut [u8]) -> Result<(usize, u32, u8), VeloError> {
        if let Some(m) = self.probe_recv(buf)? {
            return Ok(m);
        }
        let (g, mailbox) = (self.geometry, self.mailbox.clone());
        let i = self.read;
        let waiter = self.ep.borrow().client().waiter();
        let ep = self.ep.clone();
        wait_until(
            &waiter,
            || {
                let at = g.slot_at(i) as usize;
                read_status(&g, i, mailbox.word(at).load(Ordering::Acquire)).is_some()
            },
            || ep.borrow_mut().progress(),
        );
        Ok(self.probe_recv(buf)?.expect("a fresh slot was seen"))
    }

    /// Waits until every message sent so far is in its receiver's mailbox; reports the first
    /// that could not be delivered.
    pub fn flush(&mut self) -> Result<(), VeloError> {
        loop {
            self.collect();
            self.report_failure()?;
            if self.credits.iter().all(|&c| c == self.window) {
                return Ok(());
            }
            self.ep.borrow_mut().wait_any()?;
        }
    }
}
