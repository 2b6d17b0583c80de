//! Active Message encoding: `handler u8 | flags u8 (category, reply) | nargs u8 | placement u8
//! | offset u64 (Long) | args nargs × u32 | payload`.
//!
//! Placement 1 marks a Long whose payload the conduit already put into the destination's
//! segment (at `offset`); its AM payload is then `length u32 | conduit's tag u64`.

use crate::wire::{get_u32, get_u64};

/// AM categories (Short: args only; Medium: payload to a buffer; Long: payload into the
/// destination's segment at an offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    Short,
    Medium,
    Long,
}

/// GASNet's maximum number of handler arguments.
pub const MAX_ARGS: usize = 16;
pub const HEADER_LEN: usize = 12;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AmHeader {
    pub handler: u8,
    pub category: Category,
    pub reply: bool,
    pub nargs: u8,
    pub args: [u32; MAX_ARGS],
    pub offset: u64,
    /// Long only: the payload is already in place (see the module doc).
    pub in_place: bool,
}

/// The AM payload of an in-place Long: the payload's length and the conduit's tag.
pub const IN_PLACE_LEN: usize = 12;

pub fn encoded_len(nargs: usize, payload: usize) -> usize {
    HEADER_LEN + 4 * nargs + payload
}

/// Marks `am` — an encoded Long header followed by `IN_PLACE_LEN` bytes of room — as an
/// in-place Long naming `len` and `tag`.
pub fn mark_in_place(am: &mut [u8], len: u32, tag: u64) {
    let at = am.len() - IN_PLACE_LEN;
    am[3] = 1;
    am[at..at + 4].copy_from_slice(&len.to_le_bytes());
    am[at + 4..].copy_from_slice(&tag.to_le_bytes());
}

/// The length and tag of an in-place Long's AM payload (decode checked its size).
pub fn in_place_fields(payload: &[u8]) -> (u32, u64) {
    (get_u32(payload, 0), get_u64(payload, 4))
}

/// Appends the encoding of an AM to `out`.
pub fn encode(h: &AmHeader, payload: &[u8], out: &mut Vec<u8>) {
    let cat = match h.category {
        Category::Short => 0,
        Category::Medium => 1,
        Category::Long => 2,
    };
    out.push(h.handler);
    out.push(cat | if h.reply { 4 } else { 0 });
    out.push(h.nargs);
    out.push(h.in_place as u8);
    out.extend_from_slice(&h.offset.to_le_bytes());
    for a in &h.args[..h.nargs as usize] {
        out.extend_from_slice(&a.to_le_bytes());
    }
    out.extend_from_slice(payload);
}

/// Decodes an AM; `None` if it is malformed.
pub fn decode(b: &[u8]) -> Option<(AmHeader, &[u8])> {
    if b.len() < HEADER_LEN {
        return None;
    }
    let nargs = b[2] as usize;
    if nargs > MAX_ARGS || b.len() < HEADER_LEN + 4 * nargs || b[3] > 1 {
        return None;
    }
    let category = match b[1] & 3 {
        0 => Category::Short,
        1 => Category::Medium,
        2 => Category::Long,
        _ => return None,
    };
    let mut args = [0u32; MAX_ARGS];
    for (i, a) in args.iter_mut().take(nargs).enumerate() {
        *a = get_u32(b, HEADER_LEN + 4 * i);
    }
    let h = AmHeader {
        handler: b[0],
        category,
        reply: b[1] & 4 != 0,
        nargs: nargs as u8,
        args,
        offset: get_u64(b, 4),
        in_place: b[3] == 1,
    };
    let payload = &b[HEADER_LEN + 4 * nargs..];
    if h.in_place && (category != Category::Long || payload.len() != IN_PLACE_LEN) {
        return None;
    }
    Some((h, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let mut args = [0; MAX_ARGS];
        args[..3].copy_from_slice(&[1, 2, 3]);
        let h = AmHeader {
            handler: 200,
            category: Category::Long,
            reply: true,
            nargs: 3,
            args,
            offset: 77,
            in_place: false,
        };
        let mut b = Vec::new();
        encode(&h, b"pay", &mut b);
        assert_eq!(b.len(), encoded_len(3, 3));
        assert_eq!(decode(&b), Some((h, &b"pay"[..])));
    }

    #[test]
    fn in_place_long_round_trip_and_checks() {
        let h = AmHeader {
            handler: 150,
            category: Category::Long,
            reply: false,
            nargs: 1,
            args: [9; MAX_ARGS],
            offset: 4096,
            in_place: false,
        };
        let mut am = Vec::new();
        encode(&h, &[0; IN_PLACE_LEN], &mut am);
        mark_in_place(&mut am, 100_000, 42);
        let (got, p) = decode(&am).unwrap();
        assert!(got.in_place && got.offset == 4096 && got.args[0] == 9);
        assert_eq!(in_place_fields(p), (100_000, 42));
        // In place is only for Long, with exactly its fields.
        assert_eq!(decode(&am[..am.len() - 1]), None);
        let mut short = am.clone();
        short[1] = 0;
        assert_eq!(decode(&short), None);
    }

    proptest! {
        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = decode(&b);
        }
    }
}
