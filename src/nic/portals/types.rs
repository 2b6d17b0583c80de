//! Portals 4 vocabulary in Rust form: process identifiers, option bits, failure types, events,
//! return codes. Names follow the Portals 4.x specification (PTL_ME_USE_ONCE → `me::USE_ONCE`).

use super::atomic::{AtomicOp, Datatype};

/// Wildcards of `match_id` (PTL_NID_ANY, PTL_PID_ANY, PTL_RANK_ANY).
pub const NID_ANY: u32 = u32::MAX;
pub const PID_ANY: u32 = u32::MAX;
pub const RANK_ANY: u32 = u32::MAX;

/// A process as a physical (nid, pid) pair or a logical rank (`ptl_process_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessId {
    Physical { nid: u32, pid: u32 },
    Logical { rank: u32 },
}

impl ProcessId {
    /// Whether `self`, used as a `match_id` (wildcards allowed), accepts `initiator`.
    pub fn accepts(&self, initiator: &ProcessId) -> bool {
        match (self, initiator) {
            (ProcessId::Physical { nid, pid }, ProcessId::Physical { nid: n, pid: p }) => {
                (*nid == NID_ANY || nid == n) && (*pid == PID_ANY || pid == p)
            }
            (ProcessId::Logical { rank }, ProcessId::Logical { rank: r }) => {
                *rank == RANK_ANY || rank == r
            }
            _ => false,
        }
    }
}

/// Portal table entry options (PtlPTAlloc).
pub mod pt {
    pub const FLOWCTRL: u32 = 1 << 0;
    pub const ONLY_USE_ONCE: u32 = 1 << 1;
    pub const ONLY_TRUNCATE: u32 = 1 << 2;
}

/// Match list entry options (`ptl_me_t.options`); list entries (LE) use the same bits minus
/// the matching-only ones (MANAGE_LOCAL, NO_TRUNCATE, MAY_ALIGN, min_free).
pub mod me {
    pub const OP_PUT: u32 = 1 << 1;
    pub const OP_GET: u32 = 1 << 2;
    pub const USE_ONCE: u32 = 1 << 3;
    pub const ACK_DISABLE: u32 = 1 << 4;
    pub const EVENT_COMM_DISABLE: u32 = 1 << 5;
    pub const EVENT_FLOWCTRL_DISABLE: u32 = 1 << 6;
    pub const EVENT_SUCCESS_DISABLE: u32 = 1 << 7;
    pub const EVENT_OVER_DISABLE: u32 = 1 << 8;
    pub const EVENT_UNLINK_DISABLE: u32 = 1 << 9;
    pub const EVENT_CT_COMM: u32 = 1 << 10;
    pub const EVENT_CT_OVERFLOW: u32 = 1 << 11;
    pub const EVENT_CT_BYTES: u32 = 1 << 12;
    /// An overflow-list entry that takes messages without recording unexpected headers (no
    /// later PUT_OVERFLOW): a catch-basin for what nothing else matched.
    pub const UNEXPECTED_HDR_DISABLE: u32 = 1 << 13;
    pub const MANAGE_LOCAL: u32 = 1 << 14;
    pub const NO_TRUNCATE: u32 = 1 << 15;
    pub const MAY_ALIGN: u32 = 1 << 16;
    pub const IS_ACCESSIBLE: u32 = 1 << 17;
    pub const EVENT_LINK_DISABLE: u32 = 1 << 18;
}

/// Why an operation failed (`ptl_ni_fail_t`), reported in full events and counted as
/// failures in counting events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum NiFail {
    #[default]
    Ok = 0,
    Undeliverable = 1,
    PtDisabled = 2,
    Dropped = 3,
    PermViolation = 4,
    OpViolation = 5,
    Segv = 6,
    NoMatch = 7,
    /// In a PTL_EVENT_LINK: the entry of a one-way append was not linked, for want of list
    /// or entry space (the call's PTL_NO_SPACE / PTL_LIST_TOO_LONG).
    NoSpace = 8,
    /// In a PTL_EVENT_LINK: the entry of a one-way append was refused as malformed (the
    /// call's PTL_ARG_INVALID: a bad region, counter or portal option).
    ArgInvalid = 9,
}

/// PtlNIStatus's registers (`ptl_sr_index_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum StatusRegister {
    /// PTL_SR_DROP_COUNT: messages that matched nothing, or found the portal disabled.
    DropCount = 0,
    /// PTL_SR_PERMISSION_VIOLATIONS: messages refused for their user id.
    PermissionViolations = 1,
    /// PTL_SR_OPERATION_VIOLATIONS: messages the matched entry does not allow (or an atomic
    /// on memory the NIC reaches by copy).
    OperationViolations = 2,
}

impl StatusRegister {
    pub fn from_u32(v: u32) -> Option<StatusRegister> {
        Some(match v {
            0 => StatusRegister::DropCount,
            1 => StatusRegister::PermissionViolations,
            2 => StatusRegister::OperationViolations,
            _ => return None,
        })
    }
}

/// Which list an entry goes on (`ptl_list_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum List {
    Priority,
    Overflow,
}

/// PtlMESearch modes (`ptl_search_op_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SearchOp {
    SearchOnly,
    SearchDelete,
}

/// Event kinds (`ptl_event_kind_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Get,
    GetOverflow,
    Put,
    PutOverflow,
    Atomic,
    AtomicOverflow,
    FetchAtomic,
    FetchAtomicOverflow,
    Reply,
    Send,
    Ack,
    PtDisabled,
    Link,
    AutoUnlink,
    AutoFree,
    Search,
}

/// A full event (`ptl_event_t`). `start` is the byte offset, within the registered region of
/// the entry, where the data of the operation lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    pub initiator: ProcessId,
    pub pt_index: u32,
    pub uid: u32,
    pub match_bits: u64,
    pub rlength: u64,
    pub mlength: u64,
    pub remote_offset: u64,
    pub start: u64,
    pub user_ptr: u64,
    pub hdr_data: u64,
    pub ni_fail: NiFail,
    pub atomic: Option<(AtomicOp, Datatype)>,
}

impl Event {
    /// An event with only kind, failure and user pointer set (LINK, AUTO_UNLINK, PT_DISABLED…).
    pub fn bare(kind: EventKind, pt_index: u32, user_ptr: u64, ni_fail: NiFail) -> Event {
        Event {
            kind,
            initiator: ProcessId::Logical { rank: RANK_ANY },
            pt_index,
            uid: 0,
            match_bits: 0,
            rlength: 0,
            mlength: 0,
            remote_offset: 0,
            start: 0,
            user_ptr,
            hdr_data: 0,
            ni_fail,
            atomic: None,
        }
    }
}

/// Return codes of API calls (`PTL_*` other than PTL_OK).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PtlError {
    #[error(
        "PTL_ARG_INVALID: an argument is invalid (bad, stale or freed handle, bad index or option)"
    )]
    ArgInvalid,
    #[error("PTL_NO_SPACE: a limit of the interface was reached")]
    NoSpace,
    #[error("PTL_PT_IN_USE: the portal table entry is allocated or has entries attached")]
    PtInUse,
    #[error("PTL_PT_FULL: no free portal table entry")]
    PtFull,
    #[error("PTL_PT_EQ_NEEDED: flow control needs an event queue on the portal table entry")]
    PtEqNeeded,
    #[error("PTL_LIST_TOO_LONG: the list reached max_list_size")]
    ListTooLong,
    #[error("PTL_IN_USE: the object is in use")]
    InUse,
    #[error("PTL_EQ_EMPTY: no event in the queue")]
    EqEmpty,
    #[error("PTL_EQ_DROPPED: events were dropped because the queue was full")]
    EqDropped,
    #[error("PTL_CT_NONE_REACHED: the counting event did not reach the test before the timeout")]
    CtNoneReached,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_id_wildcards() {
        let p = ProcessId::Physical { nid: 3, pid: 7 };
        assert!(ProcessId::Physical {
            nid: NID_ANY,
            pid: PID_ANY
        }
        .accepts(&p));
        assert!(ProcessId::Physical {
            nid: 3,
            pid: PID_ANY
        }
        .accepts(&p));
        assert!(!ProcessId::Physical {
            nid: 4,
            pid: PID_ANY
        }
        .accepts(&p));
        assert!(!ProcessId::Physical { nid: 3, pid: 8 }.accepts(&p));
        assert!(ProcessId::Logical { rank: RANK_ANY }.accepts(&ProcessId::Logical { rank: 5 }));
        assert!(!ProcessId::Logical { rank: 4 }.accepts(&ProcessId::Logical { rank: 5 }));
        assert!(
            !ProcessId::Logical { rank: RANK_ANY }.accepts(&p),
            "addressing modes never match"
        );
    }
}
