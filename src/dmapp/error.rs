//! DMAPP return codes (`DMAPP_RC_*`, in Cray's order) and the error every call returns.

use crate::client::NicError;
use crate::wire::Status;

/// `dmapp_return_t`: the code of a call's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Rc {
    Success = 0,
    InvalidParam = 1,
    AlignmentError = 2,
    TransactionError = 3,
    ResourceError = 4,
    PermissionError = 5,
    NoSpace = 6,
    NotDone = 7,
    NotSupported = 8,
    NotFound = 9,
    Busy = 10,
    NotUsed = 11,
}

impl Rc {
    /// The C name, as users grep for it.
    pub fn name(self) -> &'static str {
        match self {
            Rc::Success => "DMAPP_RC_SUCCESS",
            Rc::InvalidParam => "DMAPP_RC_INVALID_PARAM",
            Rc::AlignmentError => "DMAPP_RC_ALIGNMENT_ERROR",
            Rc::TransactionError => "DMAPP_RC_TRANSACTION_ERROR",
            Rc::ResourceError => "DMAPP_RC_RESOURCE_ERROR",
            Rc::PermissionError => "DMAPP_RC_PERMISSION_ERROR",
            Rc::NoSpace => "DMAPP_RC_NO_SPACE",
            Rc::NotDone => "DMAPP_RC_NOT_DONE",
            Rc::NotSupported => "DMAPP_RC_NOT_SUPPORTED",
            Rc::NotFound => "DMAPP_RC_NOT_FOUND",
            Rc::Busy => "DMAPP_RC_BUSY",
            Rc::NotUsed => "DMAPP_RC_NOT_USED",
        }
    }
}

/// A failed DMAPP call: its return code and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {what}", rc.name())]
pub struct DmappError {
    pub rc: Rc,
    pub what: String,
}

impl DmappError {
    pub fn new(rc: Rc, what: impl Into<String>) -> DmappError {
        DmappError {
            rc,
            what: what.into(),
        }
    }

    /// Whether this is the "still pending" answer of a test call.
    pub fn is_not_done(&self) -> bool {
        self.rc == Rc::NotDone
    }
}

pub(super) fn err<T>(rc: Rc, what: impl Into<String>) -> Result<T, DmappError> {
    Err(DmappError::new(rc, what))
}

/// A remote operation's failure as the NIC reported it.
impl From<NicError> for DmappError {
    fn from(e: NicError) -> DmappError {
        let rc = match &e {
            NicError::Remote(s) => match s {
                // The descriptor names memory its owner no longer (or never) registered.
                Status::NoSuchRegion | Status::Permission => Rc::PermissionError,
                Status::BadRequest => Rc::InvalidParam,
                Status::Ok => Rc::Success,
                Status::OutOfBounds | Status::NoSuchEndpoint | Status::PeerDead | Status::Fault => {
                    Rc::TransactionError
                }
            },
            NicError::PeerFailed { .. } => Rc::TransactionError,
            NicError::NoSuchRank(..) | NicError::LocalBounds { .. } | NicError::BadSyncId(_) => {
                Rc::InvalidParam
            }
            NicError::Job(_) | NicError::Client(_) | NicError::Memory(_) => Rc::ResourceError,
        };
        DmappError::new(rc, e.to_string())
    }
}
