//! Datagram and op formats between peer daemons: encode/decode, versioned, authenticated.
//!
//! Everything here is pure. Decoding never trusts its input: every length is checked against the
//! buffer before use and a malformed datagram yields a typed [`WireError`].

mod aegis_raw;
mod datagram;
mod op;

pub use datagram::{
    extend_from_raw, AeadKeys, Cipher, DatagramHeader, Key, Keys, SealKey, FLAG_CONFIRM,
    FLAG_IN_SESSION, FLAG_PADDED, FLAG_X4, HEADER_LEN, MAGIC, TAG_LEN, VERSION,
};
pub use op::{
    ptl_acks, push_ptl_ack, AmoOp, OpHeader, OpIter, OpKind, OpRef, PtlHeader, Status, VShape,
    OP_HEADER_LEN, PTL_ACK_LEN,
};

/// Why a datagram or op was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone, Copy)]
pub enum WireError {
    #[error("datagram truncated: {0} bytes is shorter than a header and tag")]
    Truncated(usize),
    #[error("bad magic {0:#06x}: not a softnic datagram")]
    BadMagic(u16),
    #[error("unsupported wire version {0} (this build speaks {VERSION})")]
    BadVersion(u8),
    #[error("authentication tag mismatch: wrong cluster secret or corrupted datagram")]
    BadTag,
    #[error("op truncated at byte {0} of the datagram body")]
    OpTruncated(usize),
    #[error("unknown op kind {0}")]
    UnknownOp(u8),
    #[error("bad field value in op: {0}")]
    BadField(&'static str),
}

/// Little-endian field readers over a checked slice.
pub(crate) fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}
pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}
