//! The Gemini engine: FMA/BTE put and get, completion statuses, and the 64-bit AMOs
//! (AADD AAND AOR AXOR, AFADD AFAND AFOR AFXOR, AFAX, ACSWAP) executed at the target NIC.
//!
//! [`target`] serves ops arriving from the network against registered memory; [`initiator`]
//! tracks the operations this host's clients started until their replies complete them. FMA
//! and BTE differ only in where the initiator's daemon takes the payload from (the command
//! descriptor or the registered region), so both arrive here as `Put` fragments.

pub mod initiator;
pub mod target;

pub use initiator::{place_packed, Completion, Initiator, Pending, PendingKind};
pub use target::{amo_at, apply_amo, reply_header, serve, Reply, TargetAction};
