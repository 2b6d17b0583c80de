//! MPI errors: every call returns a typed error that names what was wrong, and whose
//! [`MpiError::class`] is the MPI error class a C program would have seen.

use crate::portals::{NiFail, PortalsError};

/// MPI error classes (MPI-3.1 §8.4), the subset this library can raise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// MPI_ERR_BUFFER
    Buffer,
    /// MPI_ERR_COUNT
    Count,
    /// MPI_ERR_TAG
    Tag,
    /// MPI_ERR_COMM
    Comm,
    /// MPI_ERR_RANK
    Rank,
    /// MPI_ERR_ROOT
    Root,
    /// MPI_ERR_GROUP
    Group,
    /// MPI_ERR_OP
    Op,
    /// MPI_ERR_ARG
    Arg,
    /// MPI_ERR_TRUNCATE
    Truncate,
    /// MPI_ERR_OTHER
    Other,
    /// MPI_ERR_INTERN
    Intern,
    /// MPI_ERR_NO_MEM
    NoMem,
    /// MPI_ERR_WIN
    Win,
    /// MPI_ERR_RMA_SYNC
    RmaSync,
    /// MPI_ERR_RMA_RANGE
    RmaRange,
    /// MPI_ERR_LOCKTYPE
    LockType,
    /// MPI_ERR_DISP
    Disp,
    /// MPI_ERR_PROC_FAILED (ULFM): a peer stopped answering.
    ProcFailed,
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("{class:?}: {what}")]
pub struct MpiError {
    pub class: ErrorClass,
    pub what: String,
}

impl MpiError {
    pub fn new(class: ErrorClass, what: impl Into<String>) -> MpiError {
        MpiError {
            class,
            what: what.into(),
        }
    }

    /// The MPI error class (MPI_Error_class).
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// A remote operation's failure as the NIC reported it.
    pub(crate) fn from_fail(f: NiFail, what: &str) -> MpiError {
        let class = match f {
            NiFail::Undeliverable => ErrorClass::ProcFailed,
            NiFail::PermViolation | NiFail::Segv | NiFail::OpViolation => ErrorClass::RmaRange,
            _ => ErrorClass::Other,
        };
        MpiError::new(class, format!("{what}: the NIC reported {f:?}"))
    }
}

impl From<PortalsError> for MpiError {
    fn from(e: PortalsError) -> MpiError {
        MpiError::new(ErrorClass::Other, format!("Portals: {e}"))
    }
}

impl From<crate::client::NicError> for MpiError {
    fn from(e: crate::client::NicError) -> MpiError {
        MpiError::new(ErrorClass::NoMem, format!("the NIC: {e}"))
    }
}

impl From<crate::portals::PtlError> for MpiError {
    fn from(e: crate::portals::PtlError) -> MpiError {
        MpiError::new(ErrorClass::Other, format!("Portals: {e}"))
    }
}

pub(crate) fn err<T>(class: ErrorClass, what: impl Into<String>) -> Result<T, MpiError> {
    Err(MpiError::new(class, what))
}
