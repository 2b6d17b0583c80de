//! One attached client process: its attach socket, control block, doorbells and identity.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};

use rustix::event::{eventfd, EventfdFlags};

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
    pub rung: bool,
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

    /// Wakes the client if it announced that it sleeps and has news; says whether it rang.
    pub fn wake_if_sleeping(&mut self) -> bool {
        if self.rung {
            self.rung = false;
            if self.control.client_sleeping() {
                let _ = rustix::io::write(self.client_bell.as_fd(), &1u64.to_ne_bytes());
                return true;
            }
        }
        false
    }
}
