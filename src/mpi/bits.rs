//! Match bits of point-to-point messages on the `recv` portal (seed 003 §3.1): high to low,
//! 4 protocol bits, a 12-bit context id, the 16-bit source rank in the communicator and the
//! 32-bit tag. ANY_SOURCE and ANY_TAG become ignore bits of the receive's match entry.

/// Protocols in the top four bits. SHORT and RNDV share bit 60 so one overflow entry takes
/// both (they carry at most the eager limit); LONG (eager long) has its own, truncating one.
pub const SHORT: u64 = 0b0001;
pub const RNDV: u64 = 0b0011;
pub const LONG: u64 = 0b0100;

pub const PROTO_SHIFT: u32 = 60;
pub const CTX_SHIFT: u32 = 48;
pub const SRC_SHIFT: u32 = 32;
pub const PROTO_MASK: u64 = 0xf << PROTO_SHIFT;
pub const SRC_MASK: u64 = 0xffff << SRC_SHIFT;
pub const TAG_MASK: u64 = 0xffff_ffff;

/// Contexts and ranks that fit the fields.
pub const MAX_CONTEXTS: u32 = 1 << 12;
pub const MAX_RANKS: u32 = 1 << 16;

pub fn encode(proto: u64, ctx: u32, src: u32, tag: u32) -> u64 {
    proto << PROTO_SHIFT
        | (ctx as u64 & 0xfff) << CTX_SHIFT
        | (src as u64 & 0xffff) << SRC_SHIFT
        | tag as u64
}

pub fn proto(bits: u64) -> u64 {
    bits >> PROTO_SHIFT
}
pub fn src(bits: u64) -> u32 {
    ((bits & SRC_MASK) >> SRC_SHIFT) as u32
}
pub fn tag(bits: u64) -> u32 {
    (bits & TAG_MASK) as u32
}

/// The match bits and ignore bits of a receive: any protocol; source and tag unless wild.
pub fn receive(ctx: u32, src: Option<u32>, tag: Option<u32>) -> (u64, u64) {
    let bits = encode(0, ctx, src.unwrap_or(0), tag.unwrap_or(0));
    let mut ignore = PROTO_MASK;
    if src.is_none() {
        ignore |= SRC_MASK;
    }
    if tag.is_none() {
        // ANY_TAG takes only user tags (0..=TAG_UB); internal traffic has contexts of its own.
        ignore |= TAG_MASK;
    }
    (bits, ignore)
}

/// `hdr_data` of LONG and RNDV sends: the send id naming the sender's `read` entry, and the
/// whole message's length (a RNDV put carries only its first part).
pub fn hdr(send_id: u32, total: u64) -> u64 {
    (send_id as u64 & 0xff_ffff) << 40 | (total & ((1 << 40) - 1))
}
pub fn hdr_send_id(h: u64) -> u32 {
    (h >> 40) as u32
}
pub fn hdr_total(h: u64) -> u64 {
    h & ((1 << 40) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_wildcards_ignore_them() {
        let b = encode(RNDV, 0xabc, 0x1234, 0xdead_beef);
        assert_eq!((proto(b), src(b), tag(b)), (RNDV, 0x1234, 0xdead_beef));
        assert_eq!((b >> CTX_SHIFT) & 0xfff, 0xabc);
        let (m, i) = receive(0xabc, None, Some(7));
        let sent = encode(SHORT, 0xabc, 99, 7);
        assert_eq!((m ^ sent) & !i, 0, "ANY_SOURCE accepts any source");
        let other_ctx = encode(SHORT, 0xabd, 99, 7);
        assert_ne!((m ^ other_ctx) & !i, 0, "contexts never match each other");
        let h = hdr(0x12_3456, 5 << 30);
        assert_eq!((hdr_send_id(h), hdr_total(h)), (0x12_3456, 5 << 30));
        // One overflow entry (SHORT with bit 61 ignored) takes SHORT and RNDV, never LONG.
        let ign = 0b0010 << PROTO_SHIFT;
        assert_eq!((SHORT ^ RNDV) << PROTO_SHIFT & !ign, 0);
        assert_ne!((SHORT ^ LONG) << PROTO_SHIFT & !ign, 0);
    }
}
