//! The datagram envelope: a fixed header, a body of ops, a keyed authentication tag.
//!
//! Layout (little endian):
//! `magic u16 | version u8 | flags u8 | src_host u16 | dst_host u16 | src_epoch u32 |
//!  dst_epoch u32 | seq u64 | ack u64 | sack u64 | body… | tag [16]`.
//! `seq == 0` marks a pure acknowledgement (no body). `ack` is the next sequence number the
//! sender expects from the receiver; bit i of `sack` says `ack + 1 + i` arrived out of order.
//! The epochs name the session between the two hosts: the sender's incarnation towards the
//! receiver and what it believes the receiver's is (0: not yet known); see
//! [`crate::transport::reliable`]. The tag is a BLAKE3 keyed hash (the cluster secret) of
//! everything before it. BLAKE3 costs about the same for every started 64-byte block: a lone
//! acknowledgement op (24 bytes) after this 40-byte header is authenticated in one block.

use super::{get_u16, get_u32, get_u64, WireError};

pub const MAGIC: u16 = 0x4e53; // "SN"
pub const VERSION: u8 = 4;
pub const HEADER_LEN: usize = 40;
pub const TAG_LEN: usize = 16;

/// Header flag: the sender has the receiver's epoch (`dst_epoch`) as its session peer. An
/// answer to a stale datagram names the epoch without it.
pub const FLAG_IN_SESSION: u8 = 1;
/// Header flag: the sender opened its session from an answer and does not yet know that the
/// receiver took its epoch; the receiver acknowledges at once.
pub const FLAG_CONFIRM: u8 = 2;
/// Header flag: a pure datagram whose body is padding, to the largest datagram size: a path
/// MTU probe (`softnic doctor`). The receiver notes its size and ignores the body.
pub const FLAG_PADDED: u8 = 4;

/// A 32-byte datagram key: the cluster secret shared by all daemons (the simple mode), or the
/// key of one pair of hosts (see [`crate::keys`]).
#[derive(Clone)]
pub struct Key(pub [u8; 32]);

impl Key {
    fn tag(&self, bytes: &[u8]) -> [u8; TAG_LEN] {
        let h = blake3::keyed_hash(&self.0, bytes);
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&h.as_bytes()[..TAG_LEN]);
        t
    }
}

/// The keys of one host's datagrams: one cluster secret for every peer, or one per peer.
#[derive(Debug, Clone)]
pub enum Keys {
    Cluster(Key),
    /// Entry `i`: the key of the pair (this host, host i); this host's own entry is unused.
    PerPeer(Vec<Key>),
}

impl Keys {
    /// The key of datagrams to and from host `peer`.
    pub fn for_peer(&self, peer: u16) -> Option<&Key> {
        match self {
            Keys::Cluster(k) => Some(k),
            Keys::PerPeer(v) => v.get(peer as usize),
        }
    }
}

impl From<Key> for Keys {
    fn from(k: Key) -> Keys {
        Keys::Cluster(k)
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DatagramHeader {
    pub flags: u8,
    pub src_host: u16,
    pub dst_host: u16,
    /// The sender's incarnation towards the receiver: random per start, new when the sender
    /// gave the receiver up for dead.
    pub src_epoch: u32,
    /// The receiver's incarnation as the sender knows it (0: unknown).
    pub dst_epoch: u32,
    pub seq: u64,
    pub ack: u64,
    pub sack: u64,
}

impl DatagramHeader {
    /// Writes the header into the first [`HEADER_LEN`] bytes of `buf`.
    pub fn write(&self, buf: &mut [u8]) {
        buf[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        buf[2] = VERSION;
        buf[3] = self.flags;
        buf[4..6].copy_from_slice(&self.src_host.to_le_bytes());
        buf[6..8].copy_from_slice(&self.dst_host.to_le_bytes());
        buf[8..12].copy_from_slice(&self.src_epoch.to_le_bytes());
        buf[12..16].copy_from_slice(&self.dst_epoch.to_le_bytes());
        buf[16..24].copy_from_slice(&self.seq.to_le_bytes());
        buf[24..32].copy_from_slice(&self.ack.to_le_bytes());
        buf[32..40].copy_from_slice(&self.sack.to_le_bytes());
    }

    /// Appends the tag over `buf[..len]` at `buf[len..len + TAG_LEN]`; returns the total length.
    pub fn seal(key: &Key, buf: &mut [u8], len: usize) -> usize {
        let t = key.tag(&buf[..len]);
        buf[len..len + TAG_LEN].copy_from_slice(&t);
        len + TAG_LEN
    }

    /// The sending host a datagram claims (not yet authenticated: it picks the key to check
    /// the tag with); `None` unless it is long enough and has the magic and version.
    pub fn claimed_src(dgram: &[u8]) -> Option<u16> {
        (dgram.len() >= HEADER_LEN + TAG_LEN && get_u16(dgram, 0) == MAGIC && dgram[2] == VERSION)
            .then(|| get_u16(dgram, 4))
    }

    /// Checks envelope and tag; returns the header and the body slice.
    pub fn open<'a>(key: &Key, dgram: &'a [u8]) -> Result<(DatagramHeader, &'a [u8]), WireError> {
        if dgram.len() < HEADER_LEN + TAG_LEN {
            return Err(WireError::Truncated(dgram.len()));
        }
        let magic = get_u16(dgram, 0);
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if dgram[2] != VERSION {
            return Err(WireError::BadVersion(dgram[2]));
        }
        let body_end = dgram.len() - TAG_LEN;
        let want = key.tag(&dgram[..body_end]);
        // Constant-time comparison: do not leak how many tag bytes matched.
        let diff = want
            .iter()
            .zip(&dgram[body_end..])
            .fold(0u8, |d, (a, b)| d | (a ^ b));
        if diff != 0 {
            return Err(WireError::BadTag);
        }
        let h = DatagramHeader {
            flags: dgram[3],
            src_host: get_u16(dgram, 4),
            dst_host: get_u16(dgram, 6),
            src_epoch: get_u32(dgram, 8),
            dst_epoch: get_u32(dgram, 12),
            seq: get_u64(dgram, 16),
            ack: get_u64(dgram, 24),
            sack: get_u64(dgram, 32),
        };
        Ok((h, &dgram[HEADER_LEN..body_end]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> Key {
        Key([7; 32])
    }

    #[test]
    fn round_trip_and_tag() {
        let h = DatagramHeader {
            flags: 1,
            src_host: 3,
            dst_host: 4,
            src_epoch: 9,
            dst_epoch: 12,
            seq: 10,
            ack: 11,
            sack: 0b101,
        };
        let mut buf = vec![0u8; 100];
        h.write(&mut buf);
        buf[HEADER_LEN..HEADER_LEN + 3].copy_from_slice(b"abc");
        let n = DatagramHeader::seal(&key(), &mut buf, HEADER_LEN + 3);
        let (got, body) = DatagramHeader::open(&key(), &buf[..n]).unwrap();
        assert_eq!(got, h);
        assert_eq!(body, b"abc");
        assert_eq!(
            DatagramHeader::open(&Key([8; 32]), &buf[..n]),
            Err(WireError::BadTag)
        );
        buf[HEADER_LEN] ^= 1;
        assert_eq!(
            DatagramHeader::open(&key(), &buf[..n]),
            Err(WireError::BadTag)
        );
        assert_eq!(
            DatagramHeader::open(&key(), &buf[..10]),
            Err(WireError::Truncated(10))
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_open(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(DatagramHeader::open(&key(), &bytes).is_err());
        }
    }
}
