//! AEGIS-128X2 and AEGIS-128X4 incremental encryption through the C library the `aegis` crate
//! bundles (libaegis), for the one place its safe interface costs a pass: encrypting from
//! registered memory into a datagram's spare capacity. The crate's `Encryptor::update` takes
//! the output as `&mut [u8]`, so those bytes had to be zeroed first (measured with
//! AEGIS-256X4, 65,000 B: 31 GB/s with the zeroing, 38 without). libaegis's
//! `aegis128x{2,4}_state_encrypt_update` write every output byte and never read one, so their
//! output may be memory not yet initialised.
//!
//! The ciphers are the crate's (the same library and build; see the tests against it below);
//! only the calls are made here, by the signatures of libaegis's public headers
//! (`aegis128x2.h`, `aegis128x4.h`).

use std::ffi::c_int;
use std::mem::MaybeUninit;

/// libaegis's `aegis128x2_state` is 448 bytes and `aegis128x4_state` 832, aligned to 64 (the
/// `aegis` crate checks the same sizes against its copies of the headers); this one has room
/// to spare, so a future build with a larger state still writes only into it.
#[repr(C, align(64))]
struct State([u8; 1024]);

extern "C" {
    fn aegis_init() -> c_int;
    fn aegis128x2_state_init(
        st: *mut State,
        ad: *const u8,
        adlen: usize,
        npub: *const u8,
        k: *const u8,
    );
    fn aegis128x2_state_encrypt_update(
        st: *mut State,
        c: *mut u8,
        m: *const u8,
        mlen: usize,
    ) -> c_int;
    fn aegis128x2_state_encrypt_final(st: *mut State, mac: *mut u8, maclen: usize) -> c_int;
    fn aegis128x4_state_init(
        st: *mut State,
        ad: *const u8,
        adlen: usize,
        npub: *const u8,
        k: *const u8,
    );
    fn aegis128x4_state_encrypt_update(
        st: *mut State,
        c: *mut u8,
        m: *const u8,
        mlen: usize,
    ) -> c_int;
    fn aegis128x4_state_encrypt_final(st: *mut State, mac: *mut u8, maclen: usize) -> c_int;
}

/// Which member of the family a datagram is sealed with (see `wire::datagram`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cipher {
    /// AEGIS-128X2: two AES lanes; the fastest where only AVX2 is there.
    X2,
    /// AEGIS-128X4: four lanes, one AVX-512 register each step; twice X2's speed where
    /// AVX-512 and VAES are there, half of it where its AVX2 code runs out of registers.
    X4,
}

impl Cipher {
    /// The one this CPU seals fastest with.
    pub fn fastest_here() -> Cipher {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("vaes")
            {
                return Cipher::X4;
            }
        }
        Cipher::X2
    }

    /// The bytes the cipher absorbs per step: input cut at multiples of it is encrypted
    /// where it lies, without the library buffering a partial block.
    pub fn rate(self) -> usize {
        match self {
            Cipher::X2 => 64,
            Cipher::X4 => 128,
        }
    }
}

/// One message being encrypted (16-byte tag); its state is wiped on drop.
/// The state stays `MaybeUninit`: libaegis writes what it uses of it, and Rust never reads it
/// (no 1 KiB clear per datagram).
pub(super) struct Encryptor {
    st: MaybeUninit<State>,
    cipher: Cipher,
}

impl Encryptor {
    /// Starts a message under `key` and `nonce` with associated data `ad`.
    pub fn new(cipher: Cipher, key: &[u8; 16], nonce: &[u8; 16], ad: &[u8]) -> Encryptor {
        static INIT: std::sync::Once = std::sync::Once::new();
        // SAFETY: feature detection, idempotent (the crate calls it too).
        INIT.call_once(|| assert_eq!(unsafe { aegis_init() }, 0, "libaegis init"));
        let mut e = Encryptor {
            st: MaybeUninit::uninit(),
            cipher,
        };
        let init = match cipher {
            Cipher::X2 => aegis128x2_state_init,
            Cipher::X4 => aegis128x4_state_init,
        };
        // SAFETY: the pointers are valid for the lengths given; the state has room (and,
        // aligned to 64, libaegis finds its place at its start wherever the value moves).
        unsafe {
            init(
                e.st.as_mut_ptr(),
                ad.as_ptr(),
                ad.len(),
                nonce.as_ptr(),
                key.as_ptr(),
            )
        };
        e
    }

    /// Encrypts `buf` in place.
    pub fn update_in_place(&mut self, buf: &mut [u8]) {
        // SAFETY: in and out are the same valid slice, which libaegis allows.
        unsafe { self.raw(buf.as_mut_ptr(), buf.as_ptr(), buf.len()) }
    }

    /// Encrypts `len` bytes at `src` into `out`, which need not be initialised: all of
    /// `out[..len]` is written, none of it read.
    ///
    /// # Safety
    /// `src..src + len` must be readable for the duration of the call and not overlap
    /// `out`; `out` must hold at least `len` elements.
    pub unsafe fn update_into(&mut self, src: *const u8, len: usize, out: &mut [MaybeUninit<u8>]) {
        assert!(out.len() >= len, "output shorter than the input");
        // SAFETY: the caller's promise for `src`; `out` is valid for `len` writes.
        unsafe { self.raw(out.as_mut_ptr().cast(), src, len) }
    }

    /// The tag.
    pub fn finalize(mut self) -> [u8; 16] {
        let mut tag = [0u8; 16];
        let fin = match self.cipher {
            Cipher::X2 => aegis128x2_state_encrypt_final,
            Cipher::X4 => aegis128x4_state_encrypt_final,
        };
        // SAFETY: `tag` has room for the 16 bytes asked for.
        let rc = unsafe { fin(self.st.as_mut_ptr(), tag.as_mut_ptr(), 16) };
        assert_eq!(rc, 0, "libaegis refused a 16-byte tag");
        tag
    }

    /// # Safety
    /// `m..m + len` readable, `c..c + len` writable.
    unsafe fn raw(&mut self, c: *mut u8, m: *const u8, len: usize) {
        let update = match self.cipher {
            Cipher::X2 => aegis128x2_state_encrypt_update,
            Cipher::X4 => aegis128x4_state_encrypt_update,
        };
        // SAFETY: the caller's promise.
        let rc = unsafe { update(self.st.as_mut_ptr(), c, m, len) };
        // Only a message beyond 2^61 bytes fails.
        assert_eq!(rc, 0, "libaegis refused an update");
    }
}

impl Drop for Encryptor {
    fn drop(&mut self) {
        // Key-derived state: wiped as the crate wipes its own.
        // SAFETY: a valid, aligned place of this type (writing needs nothing initialised).
        unsafe { std::ptr::write_volatile(self.st.as_mut_ptr(), State([0; 1024])) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aegis::aegis128x2::Aegis128X2;
    use aegis::aegis128x4::Aegis128X4;

    /// The same ciphertext and tag as the crate's one-shot encryption, whatever the pieces,
    /// for both ciphers.
    #[test]
    fn matches_the_crate() {
        let (key, nonce) = ([7u8; 16], [9u8; 16]);
        let ad = b"header bytes";
        let msg: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
        for cipher in [Cipher::X2, Cipher::X4] {
            let (want, want_tag) = match cipher {
                Cipher::X2 => Aegis128X2::<16>::new(&key, &nonce).encrypt(&msg, ad),
                Cipher::X4 => Aegis128X4::<16>::new(&key, &nonce).encrypt(&msg, ad),
            };
            for cut in [0, 1, 63, 64, 100, 128, 4096, 5000] {
                let mut e = Encryptor::new(cipher, &key, &nonce, ad);
                let mut head = msg[..cut].to_vec();
                e.update_in_place(&mut head);
                let mut rest: Vec<MaybeUninit<u8>> = vec![MaybeUninit::uninit(); msg.len() - cut];
                // SAFETY: the source is a live slice of that length, apart from `rest`.
                unsafe { e.update_into(msg[cut..].as_ptr(), msg.len() - cut, &mut rest) };
                let tag = e.finalize();
                // SAFETY: `update_into` wrote every element.
                let rest: Vec<u8> = rest
                    .into_iter()
                    .map(|b| unsafe { b.assume_init() })
                    .collect();
                assert_eq!([head, rest].concat(), want, "{cipher:?} cut at {cut}");
                assert_eq!(tag, want_tag, "{cipher:?} cut at {cut}");
            }
        }
    }
}
