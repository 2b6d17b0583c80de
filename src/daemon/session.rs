//! One attached client process: its attach socket, control block, doorbells and identity.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};

use rustix::event::{eventfd, EventfdFlags};

use crate::shm::control::ClientSleep;
use crate::shm::{Control, CqEntry};

/// Capacity of each client's command ring (bytes) and completion queue (entries).
pub const CMD_RING_BYTES: usize = 256 * 1024;
pub const CQ_ENTRIES: usize = 4096;

pub struct Session {
    pub id: u64,
    pub sock: OwnedFd,
    /// The client's process (SO_PEERCRED), whose private pages process regions reach, and a
    /// pidfd naming that very process (none where the kernel has no pidfds).
    pub pid: libc::pid_t,
    pub pidfd: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    pub attached: Option<Attached>,
}

pub struct Attached {
    pub job: u32,
    pub rank: u32,
    pub control: Control,
    /// The client writes it to wake a sleeping daemon.
    pub daemon_bell: OwnedFd,
    /// The daemon writes it to wake a sleeping client.
    pub client_bell: OwnedFd,
    /// Completions that found the queue full (only a client exceeding its credits causes it).
    pub overflow: VecDeque<CqEntry>,
    /// News for the client (a completion, an event, a message for it).
    pub rung: bool,
    /// Half its command ring is free again after a drain.
    pub room: bool,
}

impl Attached {
    pub fn new(job: u32, rank: u32) -> std::io::Result<Attached> {
        Ok(Attached {
            job,
            rank,
            control: Control::create(CMD_RING_BYTES, CQ_ENTRIES)?,
            daemon_bell: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
            client_bell: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
            overflow: VecDeque::new(),
            rung: false,
            room: false,
        })
    }

    /// Posts a completion; `false` if the client let its queue overflow beyond any excuse.
    pub fn post(&mut self, e: CqEntry) -> bool {
        while let Some(o) = self.overflow.front() {
            match self.control.cq_push(o) {
                Ok(true) => {
                    self.overflow.pop_front();
                }
                Ok(false) => break,
                Err(_) => return false,
            }
        }
        if self.overflow.is_empty() {
            match self.control.cq_push(&e) {
                Ok(true) => {}
                Ok(false) => self.overflow.push_back(e),
                Err(_) => return false,
            }
        } else {
            self.overflow.push_back(e);
        }
        self.rung = true;
        self.overflow.len() <= CQ_ENTRIES
    }

    /// Wakes the client if it announced that it sleeps and has news for it; says whether it
    /// rang.
    pub fn wake_if_sleeping(&mut self) -> bool {
        if !self.rung && !self.room {
            return false;
        }
        let wake = match self.control.client_sleeping() {
            ClientSleep::Awake => false,
            ClientSleep::ForNews => true,
            ClientSleep::ForRoom => self.room,
        };
        self.rung = false;
        self.room = false;
        if wake {
            let _ = rustix::io::write(self.client_bell.as_fd(), &1u64.to_ne_bytes());
        }
        wake
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::Mapping;

    /// The daemon's side of a session and the client's view of its control block.
    fn session() -> (Attached, Control) {
        let a = Attached::new(1, 0).unwrap();
        let fd = a.control.mapping().fd().try_clone_to_owned().unwrap();
        let c = Control::open(Mapping::from_fd(fd, 0, a.control.mapping().len()).unwrap()).unwrap();
        (a, c)
    }

    /// Whether the client's doorbell rang since the last look (reading it clears it).
    fn rang(a: &Attached) -> bool {
        let mut b = [0u8; 8];
        rustix::io::read(a.client_bell.as_fd(), &mut b).is_ok()
    }

    #[test]
    fn a_client_sleeping_for_room_is_woken_by_room_only() {
        let (mut a, c) = session();
        c.set_client_sleeping_for_room();
        a.rung = true;
        assert!(!a.wake_if_sleeping(), "a completion does not wake it");
        assert!(!rang(&a));
        a.room = true;
        assert!(a.wake_if_sleeping());
        assert!(rang(&a));
        assert!(!a.wake_if_sleeping(), "once per news");

        c.set_client_sleeping(true);
        a.room = true;
        assert!(
            a.wake_if_sleeping(),
            "a client sleeping for news wakes for room too"
        );
        a.rung = true;
        assert!(a.wake_if_sleeping());
        assert!(rang(&a));

        c.set_client_sleeping(false);
        a.rung = true;
        a.room = true;
        assert!(!a.wake_if_sleeping(), "an awake client is not rung");
        assert!(!rang(&a));
    }
}
