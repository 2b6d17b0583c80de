//! Match list entries (ME) and list entries (LE): the match criteria and where data lands.

use super::atomic::{AtomicOp, Datatype};
use super::types::{me, ProcessId};
use crate::nic::memory::Region;

/// What an incoming message asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReqKind {
    Put,
    Get,
    Atomic(AtomicOp, Datatype),
    FetchAtomic(AtomicOp, Datatype),
    Swap(AtomicOp, Datatype),
}

impl ReqKind {
    /// The ME permission bits the operation needs.
    pub fn needs(self) -> u32 {
        match self {
            ReqKind::Put | ReqKind::Atomic(..) => me::OP_PUT,
            ReqKind::Get => me::OP_GET,
            ReqKind::FetchAtomic(..) | ReqKind::Swap(..) => me::OP_PUT | me::OP_GET,
        }
    }
}

/// An entry as the application describes it (`ptl_me_t` / `ptl_le_t`): a buffer of `length`
/// bytes at `start` within a registered region.
#[derive(Clone)]
pub struct MatchEntry {
    pub region: Region,
    pub start: u64,
    pub length: u64,
    pub ct: Option<u32>,
    /// The user id that may access the entry, or `u32::MAX` for any (`ac_id.uid`).
    pub uid: u32,
    pub options: u32,
    pub match_id: ProcessId,
    pub match_bits: u64,
    pub ignore_bits: u64,
    pub min_free: u64,
}

impl MatchEntry {
    /// The match criteria: `match_id` accepts the initiator and the match bits agree outside
    /// the ignore bits. List entries of a non-matching interface accept every message.
    pub fn criteria(&self, matching: bool, initiator: &ProcessId, bits: u64) -> bool {
        !matching
            || (self.match_id.accepts(initiator)
                && ((bits ^ self.match_bits) & !self.ignore_bits) == 0)
    }

    pub fn has(&self, opt: u32) -> bool {
        self.options & opt != 0
    }
}

/// A linked (or unlinked but still referenced) entry with its NIC-side state.
pub struct Linked {
    pub entry: MatchEntry,
    pub user_ptr: u64,
    pub pt_index: u32,
    /// The locally managed offset (PTL_ME_MANAGE_LOCAL).
    pub local_offset: u64,
    pub linked: bool,
    /// Unexpected headers whose data lies in this (overflow) entry's buffer.
    pub pending_headers: usize,
}

impl Linked {
    /// Where a message of `rlength` bytes at `remote_offset` lands: (offset, mlength), or
    /// `None` when PTL_ME_NO_TRUNCATE forbids truncating it (which makes the entry not match).
    pub fn placement(&self, remote_offset: u64, rlength: u64) -> Option<(u64, u64)> {
        let offset = if self.entry.has(me::MANAGE_LOCAL) {
            self.local_offset
        } else {
            remote_offset
        };
        let avail = self.entry.length.saturating_sub(offset);
        if rlength > avail && self.entry.has(me::NO_TRUNCATE) {
            return None;
        }
        Some((offset, rlength.min(avail)))
    }
}
