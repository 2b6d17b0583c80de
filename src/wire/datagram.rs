//! The datagram envelope: a fixed header, a body of ops (encrypted), an authentication tag.
//!
//! Layout (little endian):
//! `magic u16 | version u8 | flags u8 | src_host u16 | dst_host u16 | src_epoch u32 |
//!  dst_epoch u32 | seq u64 | ack u64 | sack u64 | nonce u64 | body… | tag [16]`.
//! `seq == 0` marks a pure acknowledgement (no body). `ack` is the next sequence number the
//! sender expects from the receiver; bit i of `sack` says `ack + 1 + i` arrived out of order.
//! The epochs name the session between the two hosts: the sender's incarnation towards the
//! receiver and what it believes the receiver's is (0: not yet known); see
//! [`crate::transport::reliable`].
//!
//! Sealing is AEGIS-128X2 or AEGIS-128X4 (the AEGIS family of the IRTF CFRG draft, through
//! the `aegis` crate, whose libaegis picks AES-NI, VAES or AVX-512 code at run time): the body
//! is encrypted in place, the header is associated data, the 16-byte tag covers both. Each
//! sending host seals with the member its CPU runs fastest and says which in the header
//! ([`FLAG_X4`], authenticated with the rest of it); a receiver opens either. Chosen by
//! measurement (in place, one core, 65,000 B): on an EPYC with AVX2 and VAES, AEGIS-128X2
//! 2.4–2.9 µs against 4.2–5.2 for AEGIS-256X4, 3.9–4.9 for AEGIS-256X2 and 4.3–5.8 for
//! AEGIS-128X4 (whose AVX2 code runs out of registers); on one with AVX-512 and VAES,
//! AEGIS-128X4 0.75–0.85 against AEGIS-128X2's 1.75 (and AEGIS-256X4 took 1.60 against
//! AES-256-GCM's 2.8 in aws-lc). A bulk stream pays it twice per datagram (seal and open) on
//! the threads that bound it. The 128-bit key matches the keys it is derived from (X25519
//! agreement, ~128-bit security); the tag is 128 bits either way. The two ciphers never share
//! a key: each has its own, derived apart.
//! Each sending host seals with its own key derived from the shared secret (cluster or pair)
//! and its index; the nonce is the sender's epoch and `nonce`, a per-process counter that
//! starts at a random value, so no two datagrams under one key share a nonce.
//!
//! One exception, for the udp conduit's baseline only ([`Key::tagging`]): the body in clear
//! and a job tag where the AEAD tag goes, as GASNet's udp-conduit protects its messages.

use aegis::aegis128x2::Aegis128X2;
use aegis::aegis128x4::Aegis128X4;

pub use super::aegis_raw::Cipher;
use super::{aegis_raw, get_u16, get_u32, get_u64, WireError};

pub const MAGIC: u16 = 0x4e53; // "SN"
pub const VERSION: u8 = 8;
pub const HEADER_LEN: usize = 48;
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
/// Header flag: the body is sealed with AEGIS-128X4 (else AEGIS-128X2). Set by the sealing and
/// consumed by the opening: the header [`DatagramHeader::open`] returns never carries it.
pub const FLAG_X4: u8 = 8;

/// A 32-byte datagram key: the cluster secret shared by all daemons (the simple mode), or the
/// key of one pair of hosts (see [`crate::keys`]).
#[derive(Clone)]
pub struct Key(pub [u8; 32]);

impl Key {
    /// The keys host `sender`'s datagrams under this secret are sealed with (one per cipher),
    /// sealing with the cipher this CPU runs fastest.
    pub fn sealing(&self, sender: u16) -> SealKey {
        let half = |k: [u8; 32]| -> [u8; 16] { k[..16].try_into().expect("16 of 32 bytes") };
        SealKey::Aead(AeadKeys {
            x2: half(self.derive("softnic 2026-11 datagram sealing key (AEGIS-128X2)", sender)),
            x4: half(self.derive("softnic 2026-11 datagram sealing key (AEGIS-128X4)", sender)),
            seal_with: Cipher::fastest_here(),
        })
    }

    /// Host `sender`'s datagrams under this secret carry a tag in clear instead of being
    /// sealed: the protection of GASNet's udp-conduit (AM-2 tags), which only keeps other
    /// jobs' datagrams out — anyone who sees one can forge the next. For the udp conduit's
    /// baseline mode only (`SOFTNIC_UDP_AUTH=0`).
    pub fn tagging(&self, sender: u16) -> SealKey {
        let k = self.derive("softnic 2026-11 datagram tag in clear (AM-2 style)", sender);
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&k[..TAG_LEN]);
        SealKey::Tag(tag)
    }

    /// 32 bytes for host `sender` under this secret, by purpose (`context`).
    fn derive(&self, context: &str, sender: u16) -> [u8; 32] {
        let mut material = [0u8; 34];
        material[..32].copy_from_slice(&self.0);
        material[32..].copy_from_slice(&sender.to_le_bytes());
        blake3::derive_key(context, &material)
    }
}

/// How one sending host's datagrams are protected (see [`Key::sealing`], [`Key::tagging`]).
pub enum SealKey {
    /// AEGIS under these keys.
    Aead(AeadKeys),
    /// The body in clear and this tag after it.
    Tag([u8; TAG_LEN]),
}

/// One sending host's AEGIS keys: it seals with `seal_with`; a receiver opens with the cipher
/// the datagram names.
pub struct AeadKeys {
    x2: [u8; 16],
    x4: [u8; 16],
    seal_with: Cipher,
}

impl AeadKeys {
    fn key(&self, c: Cipher) -> &[u8; 16] {
        match c {
            Cipher::X2 => &self.x2,
            Cipher::X4 => &self.x4,
        }
    }

    /// Encrypts `body` in place with `c` under its key, `header` (written, marked) as
    /// associated data and the source of the nonce; returns the tag.
    fn encrypt(&self, c: Cipher, header: &[u8], body: &mut [u8]) -> [u8; TAG_LEN] {
        let (key, n) = (self.key(c), nonce(header));
        match c {
            Cipher::X2 => Aegis128X2::<TAG_LEN>::new(key, &n).encrypt_in_place(body, header),
            Cipher::X4 => Aegis128X4::<TAG_LEN>::new(key, &n).encrypt_in_place(body, header),
        }
    }

    /// [`AeadKeys::encrypt`]'s inverse: checks `tag` and decrypts `body` in place.
    fn decrypt(
        &self,
        c: Cipher,
        header: &[u8],
        body: &mut [u8],
        tag: &[u8; TAG_LEN],
    ) -> Result<(), WireError> {
        let (key, n) = (self.key(c), nonce(header));
        let opened = match c {
            Cipher::X2 => Aegis128X2::<TAG_LEN>::new(key, &n).decrypt_in_place(body, tag, header),
            Cipher::X4 => Aegis128X4::<TAG_LEN>::new(key, &n).decrypt_in_place(body, tag, header),
        };
        opened.map_err(|_| WireError::BadTag)
    }
}

impl SealKey {
    /// The same keys, sealing with `c` (whatever this CPU runs fastest): for tests of either
    /// cipher on any machine.
    pub fn sealing_with(self, c: Cipher) -> SealKey {
        match self {
            SealKey::Aead(k) => SealKey::Aead(AeadKeys { seal_with: c, ..k }),
            tag => tag,
        }
    }
}

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(..)")
    }
}

/// Marks in `header` which cipher seals its body (before sealing: the header is associated
/// data).
fn mark(header: &mut [u8], c: Cipher) {
    match c {
        Cipher::X2 => header[3] &= !FLAG_X4,
        Cipher::X4 => header[3] |= FLAG_X4,
    }
}

/// A datagram's nonce: the sender's epoch and its per-datagram counter, from the header.
fn nonce(header: &[u8]) -> [u8; 16] {
    let mut n = [0u8; 16];
    n[..4].copy_from_slice(&header[8..12]);
    n[4..12].copy_from_slice(&header[40..48]);
    n
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
    /// The sender's datagram counter: with `src_epoch`, the AEAD nonce (never repeated).
    pub nonce: u64,
}

/// Appends `len` bytes read from `src` to `buf` (one copy, straight into its spare capacity).
///
/// # Safety
/// `src..src + len` must be readable for the duration of the call and must not overlap `buf`.
pub unsafe fn extend_from_raw(buf: &mut Vec<u8>, src: *const u8, len: usize) {
    buf.reserve(len);
    let at = buf.len();
    // SAFETY: the caller's promise for the source; the destination is spare capacity reserved
    // above, initialised by the copy before the length covers it.
    unsafe {
        std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr().add(at), len);
        buf.set_len(at + len);
    }
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
        buf[40..48].copy_from_slice(&self.nonce.to_le_bytes());
    }

    /// Seals the datagram in `buf[..len]` (header written, body after it) in place: encrypts
    /// the body and puts the tag at `buf[len..len + TAG_LEN]`; returns the total length.
    pub fn seal(key: &SealKey, buf: &mut [u8], len: usize) -> usize {
        let (header, rest) = buf.split_at_mut(HEADER_LEN);
        let (body, tail) = rest.split_at_mut(len - HEADER_LEN);
        let tag = match key {
            SealKey::Aead(k) => {
                mark(header, k.seal_with);
                k.encrypt(k.seal_with, header, body)
            }
            SealKey::Tag(tag) => *tag,
        };
        tail[..TAG_LEN].copy_from_slice(&tag);
        len + TAG_LEN
    }

    /// [`DatagramHeader::seal`] of `buf[..len]` (header written, body so far after it) with
    /// `tail_len` more body bytes read from `tail`; `buf` grows to the returned length. The
    /// tail's whole cipher blocks are encrypted from where they lie straight into `buf`, one
    /// pass (the bytes that complete the body's last partial block, and the tail's own last
    /// partial block, are copied in and encrypted in place). Measured, 65,000 B from a
    /// 1 MiB source: 23–27 GB/s, against 13–15 for copying the whole tail in and then sealing
    /// in place (AEGIS-128X2, AVX2 and VAES; AEGIS-256X4 with AVX-512: 38 against 27.5). The cipher loads each source block once and absorbs
    /// what it loaded, so what is sealed is what was read, even if the owner writes these
    /// bytes meanwhile, as under DMA.
    ///
    /// # Safety
    /// `tail..tail + tail_len` must be readable (mapped) for the duration of the call and must
    /// not overlap `buf`.
    pub unsafe fn seal_with_tail(
        key: &SealKey,
        buf: &mut Vec<u8>,
        len: usize,
        tail: *const u8,
        tail_len: usize,
    ) -> usize {
        buf.truncate(len);
        let body_end = len + tail_len;
        buf.reserve(tail_len + TAG_LEN);
        let SealKey::Aead(k) = key else {
            // SAFETY: the caller's promise.
            unsafe { extend_from_raw(buf, tail, tail_len) };
            buf.resize(body_end + TAG_LEN, 0);
            return Self::seal(key, buf, body_end);
        };
        let c = k.seal_with;
        let rate = c.rate();
        let lead = ((rate - (len - HEADER_LEN) % rate) % rate).min(tail_len);
        let whole = (tail_len - lead) / rate * rate;
        // SAFETY (three reads of the tail): in bounds of it, by the caller's promise.
        unsafe { extend_from_raw(buf, tail, lead) };
        let (header, body) = buf.split_at_mut(HEADER_LEN);
        mark(header, c);
        let mut enc = aegis_raw::Encryptor::new(c, k.key(c), &nonce(header), header);
        enc.update_in_place(body);
        let at = len + lead;
        // SAFETY: bytes another process may write, handed only to the cipher (C code, opaque
        // here), which reads each block once, and written into the spare capacity reserved
        // above, every byte of it, so `at + whole` bytes are initialised.
        unsafe {
            enc.update_into(tail.add(lead), whole, buf.spare_capacity_mut());
            buf.set_len(at + whole);
        }
        unsafe { extend_from_raw(buf, tail.add(lead + whole), tail_len - lead - whole) };
        enc.update_in_place(&mut buf[at + whole..]);
        buf.extend_from_slice(&enc.finalize());
        body_end + TAG_LEN
    }

    /// Whether a datagram (not yet authenticated) says it is a path MTU probe
    /// ([`FLAG_PADDED`]): for the driver, which sends those alone.
    pub fn is_probe(dgram: &[u8]) -> bool {
        dgram.len() >= HEADER_LEN && get_u16(dgram, 0) == MAGIC && dgram[3] & FLAG_PADDED != 0
    }

    /// The sending host a datagram claims (not yet authenticated: it picks the key to check
    /// the tag with); `None` unless it is long enough and has the magic and version.
    pub fn claimed_src(dgram: &[u8]) -> Option<u16> {
        (dgram.len() >= HEADER_LEN + TAG_LEN && get_u16(dgram, 0) == MAGIC && dgram[2] == VERSION)
            .then(|| get_u16(dgram, 4))
    }

    /// Checks envelope and tag and decrypts the body in place with the cipher the header names;
    /// returns the header (without [`FLAG_X4`]) and the body. On failure the body's bytes are
    /// unspecified (the datagram is dropped anyway).
    pub fn open<'a>(
        key: &SealKey,
        dgram: &'a mut [u8],
    ) -> Result<(DatagramHeader, &'a [u8]), WireError> {
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
        let mut h = DatagramHeader {
            flags: dgram[3],
            src_host: get_u16(dgram, 4),
            dst_host: get_u16(dgram, 6),
            src_epoch: get_u32(dgram, 8),
            dst_epoch: get_u32(dgram, 12),
            seq: get_u64(dgram, 16),
            ack: get_u64(dgram, 24),
            sack: get_u64(dgram, 32),
            nonce: get_u64(dgram, 40),
        };
        let (header, rest) = dgram.split_at_mut(HEADER_LEN);
        let (body, tag) = rest.split_at_mut(rest.len() - TAG_LEN);
        match key {
            SealKey::Aead(k) => {
                let tag: &[u8; TAG_LEN] = (&*tag).try_into().expect("a whole tag");
                let c = match h.flags & FLAG_X4 {
                    0 => Cipher::X2,
                    _ => Cipher::X4,
                };
                k.decrypt(c, header, body, tag)?;
                h.flags &= !FLAG_X4;
            }
            SealKey::Tag(t) if tag[..] == t[..] => {}
            SealKey::Tag(_) => return Err(WireError::BadTag),
        }
        Ok((h, &*body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key() -> SealKey {
        Key([7; 32]).sealing(3)
    }

    /// The header the envelope tests use (3 → 4).
    fn header(flags: u8, sack: u64) -> DatagramHeader {
        DatagramHeader {
            flags,
            src_host: 3,
            dst_host: 4,
            src_epoch: 9,
            dst_epoch: 12,
            seq: 10,
            ack: 11,
            sack,
            nonce: 77,
        }
    }

    /// Header `h` and the body "abc", protected with `key`.
    fn protected(key: &SealKey, h: &DatagramHeader) -> Vec<u8> {
        let mut buf = vec![0u8; 100];
        h.write(&mut buf);
        buf[HEADER_LEN..HEADER_LEN + 3].copy_from_slice(b"abc");
        let n = DatagramHeader::seal(key, &mut buf, HEADER_LEN + 3);
        buf.truncate(n);
        buf
    }

    /// The udp conduit's baseline mode: the body travels in clear with the sender's tag; a
    /// datagram of another job or claiming another sender, or with the tag changed, is refused.
    #[test]
    fn tagged_datagrams_carry_the_body_in_clear_and_check_the_tag() {
        let h = header(0, 0);
        let key = Key([7; 32]).tagging(3);
        let tagged = || protected(&key, &h);
        let mut buf = tagged();
        assert_eq!(
            &buf[HEADER_LEN..HEADER_LEN + 3],
            b"abc",
            "the body is in clear"
        );
        let (got, body) = DatagramHeader::open(&key, &mut buf).unwrap();
        assert_eq!((got, body), (h, &b"abc"[..]));
        for other in [
            Key([8; 32]).tagging(3),
            Key([7; 32]).tagging(4),
            Key([7; 32]).sealing(3),
        ] {
            assert_eq!(
                DatagramHeader::open(&other, &mut tagged()).map(|_| ()),
                Err(WireError::BadTag)
            );
        }
        let mut b = tagged();
        let last = b.len() - 1;
        b[last] ^= 1;
        assert_eq!(
            DatagramHeader::open(&key, &mut b).map(|_| ()),
            Err(WireError::BadTag)
        );
        // A sealed datagram does not pass for a tagged one.
        assert!(DatagramHeader::open(&key, &mut protected(&self::key(), &h)).is_err());
    }

    #[test]
    fn round_trip_and_tag() {
        let h = header(1, 0b101);
        let sealed = || protected(&key(), &h);
        let mut buf = sealed();
        assert_ne!(
            &buf[HEADER_LEN..HEADER_LEN + 3],
            b"abc",
            "the body is encrypted"
        );
        let (got, body) = DatagramHeader::open(&key(), &mut buf).unwrap();
        assert_eq!(got, h);
        assert_eq!(body, b"abc");
        // Another secret, another sender's key, a flipped bit of body or header: refused.
        for k in [Key([8; 32]).sealing(3), Key([7; 32]).sealing(4)] {
            assert_eq!(
                DatagramHeader::open(&k, &mut sealed()).map(|_| ()),
                Err(WireError::BadTag)
            );
        }
        for bit in [HEADER_LEN, 5, 41] {
            let mut b = sealed();
            b[bit] ^= 1;
            assert!(DatagramHeader::open(&key(), &mut b).is_err(), "bit {bit}");
        }
        assert_eq!(
            DatagramHeader::open(&key(), &mut sealed()[..10]).map(|_| ()),
            Err(WireError::Truncated(10))
        );
    }

    /// Whichever cipher the sender seals with, the receiver opens it; the header says which,
    /// and that is authenticated like the rest of it: a datagram whose flag is flipped is
    /// refused, and the flag never reaches the transport.
    #[test]
    fn either_cipher_opens_and_its_flag_is_authenticated() {
        let h = header(FLAG_CONFIRM, 3);
        for c in [Cipher::X2, Cipher::X4] {
            let sealed = || protected(&key().sealing_with(c), &h);
            let mut buf = sealed();
            assert_eq!(buf[3] & FLAG_X4 != 0, c == Cipher::X4, "{c:?} marked");
            let (got, body) = DatagramHeader::open(&key(), &mut buf).unwrap();
            assert_eq!((got, body), (h, &b"abc"[..]), "{c:?}");
            let mut flipped = sealed();
            flipped[3] ^= FLAG_X4;
            assert_eq!(
                DatagramHeader::open(&key(), &mut flipped).map(|_| ()),
                Err(WireError::BadTag),
                "{c:?} read as the other"
            );
        }
    }

    /// Sealing is AEGIS-128X2 or AEGIS-128X4, each under its own key, with the nonce made of
    /// the sender's epoch and counter (checked against the crate's one-shot encryption with
    /// that nonce built by hand), and sealing with a tail read from elsewhere gives the same
    /// bytes wherever the tail starts; a body with a flipped bit is refused.
    #[test]
    fn sealing_with_a_tail_matches_sealing_in_place() {
        for c in [Cipher::X2, Cipher::X4] {
            sealing_with_a_tail_matches_sealing_in_place_with(c);
        }
    }

    fn sealing_with_a_tail_matches_sealing_in_place_with(c: Cipher) {
        let k = key().sealing_with(c);
        let SealKey::Aead(keys) = &k else {
            unreachable!("sealing gives AEAD keys")
        };
        assert_ne!(keys.x2, keys.x4, "a key of its own per cipher");
        for body_len in [0, 1, 1000, 8191, 8192, 3 * 8192 + 5, 65000] {
            let mut buf = vec![0u8; HEADER_LEN + body_len + TAG_LEN];
            DatagramHeader {
                src_epoch: 0x0102_0304,
                seq: body_len as u64,
                nonce: 0x0506_0708_090a_0b0c,
                ..Default::default()
            }
            .write(&mut buf);
            for (i, b) in buf[HEADER_LEN..HEADER_LEN + body_len]
                .iter_mut()
                .enumerate()
            {
                *b = i as u8;
            }
            mark(&mut buf, c);
            let plain = buf.clone();
            let n = DatagramHeader::seal(&k, &mut buf, HEADER_LEN + body_len);
            assert_eq!(n, buf.len());
            let (header, rest) = plain.split_at(HEADER_LEN);
            let mut nonce = [0u8; 16];
            nonce[..12].copy_from_slice(&[4, 3, 2, 1, 0x0c, 0x0b, 0x0a, 9, 8, 7, 6, 5]);
            let (ct, t) =
                match c {
                    Cipher::X2 => Aegis128X2::<TAG_LEN>::new(&keys.x2, &nonce)
                        .encrypt(&rest[..body_len], header),
                    Cipher::X4 => Aegis128X4::<TAG_LEN>::new(&keys.x4, &nonce)
                        .encrypt(&rest[..body_len], header),
                };
            assert_eq!(
                &buf[HEADER_LEN..HEADER_LEN + body_len],
                &ct[..],
                "{c:?}, {body_len} bytes"
            );
            assert_eq!(
                &buf[HEADER_LEN + body_len..],
                &t[..],
                "{c:?}, {body_len} bytes"
            );
            for split in [
                0,
                1,
                17,
                63,
                64,
                65,
                127,
                128,
                129,
                body_len / 2,
                body_len.saturating_sub(1),
                body_len,
            ] {
                let split = split.min(body_len);
                let mut head = plain[..HEADER_LEN + split].to_vec();
                let tail = plain[HEADER_LEN + split..HEADER_LEN + body_len].to_vec();
                // SAFETY: `tail` is a live buffer of its own.
                let n = unsafe {
                    DatagramHeader::seal_with_tail(
                        &k,
                        &mut head,
                        HEADER_LEN + split,
                        tail.as_ptr(),
                        tail.len(),
                    )
                };
                assert_eq!(n, head.len());
                assert_eq!(
                    head, buf,
                    "{c:?}, body of {body_len} bytes, tail from {split}"
                );
            }
            let mut flipped = buf.clone();
            let (_, body) = DatagramHeader::open(&k, &mut buf).unwrap();
            assert_eq!(body, &plain[HEADER_LEN..HEADER_LEN + body_len]);
            flipped[HEADER_LEN + body_len / 2] ^= 0x40;
            assert!(DatagramHeader::open(&k, &mut flipped).is_err());
        }
    }

    proptest! {
        #[test]
        fn random_bytes_never_open(mut bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(DatagramHeader::open(&key(), &mut bytes).is_err());
        }
    }
}
