//! Per-host keys. Each host holds an X25519 key pair (`softnic keygen`); the config lists every
//! host's public key. Two hosts derive the key of their pair from their Diffie-Hellman secret
//! with HKDF-SHA256 (both sides get the same), and every datagram between them is tagged with
//! it, so a host can speak only as itself: it holds no other pair's key. The local default keeps
//! one cluster secret for every pair (the simple mode). Cryptography from well-kept crates
//! (x25519-dalek, hkdf, sha2); nothing hand-rolled.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use x25519_dalek::{PublicKey, StaticSecret};

use crate::wire::Key;
pub use crate::wire::Keys;

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read the private key file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the private key file {path} is readable by others (mode {mode:o}): `chmod 600 {path}`"
    )]
    Exposed { path: String, mode: u32 },
    #[error("{what} is not 64 hex digits")]
    Malformed { what: String },
    #[error("{path} exists already: remove it first, or choose another --out")]
    Exists { path: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

/// 32 bytes from 64 hex digits.
pub fn parse_hex32(s: &str, what: &str) -> Result<[u8; 32], KeyError> {
    let s = s.trim();
    let bad = || KeyError::Malformed { what: what.into() };
    if s.len() != 64 {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16).map_err(|_| bad())?;
    }
    Ok(out)
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A host's key pair.
pub struct HostKey {
    secret: StaticSecret,
}

impl HostKey {
    /// A fresh key pair from the operating system's random source.
    pub fn generate() -> HostKey {
        let bytes: [u8; 32] = rand::random();
        HostKey {
            secret: StaticSecret::from(bytes),
        }
    }

    /// Reads a private key file (64 hex digits), refusing one that others may read.
    pub fn load(path: &Path) -> Result<HostKey, KeyError> {
        let p = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|source| KeyError::Read {
            path: p.clone(),
            source,
        })?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(KeyError::Exposed { path: p, mode });
        }
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
            path: p.clone(),
            source,
        })?;
        let bytes = parse_hex32(&text, &format!("the private key in {p}"))?;
        Ok(HostKey {
            secret: StaticSecret::from(bytes),
        })
    }

    /// Writes the private key to a new file of mode 0600 (never over an existing one).
    pub fn save(&self, path: &Path) -> Result<(), KeyError> {
        let p = path.display().to_string();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| match source.kind() {
                std::io::ErrorKind::AlreadyExists => KeyError::Exists { path: p.clone() },
                _ => KeyError::Write {
                    path: p.clone(),
                    source,
                },
            })?;
        writeln!(f, "{}", hex(self.secret.as_bytes()))
            .map_err(|source| KeyError::Write { path: p, source })
    }

    pub fn public(&self) -> [u8; 32] {
        PublicKey::from(&self.secret).to_bytes()
    }

    /// The key of the pair (this host, the host with public key `peer`): HKDF-SHA256 over
    /// the X25519 secret, salted with both public keys in a fixed order so both sides agree.
    pub fn pair_key(&self, peer: &[u8; 32]) -> Key {
        let shared = self.secret.diffie_hellman(&PublicKey::from(*peer));
        let me = self.public();
        let (a, b) = if me <= *peer {
            (me, *peer)
        } else {
            (*peer, me)
        };
        let salt = [a, b].concat();
        let hk = hkdf::Hkdf::<sha2::Sha256>::new(Some(&salt), shared.as_bytes());
        let mut out = [0u8; 32];
        hk.expand(b"softnic datagram key v1", &mut out)
            .expect("32 bytes is a valid HKDF-SHA256 length");
        Key(out)
    }

    /// Every pair key of host `me` given all hosts' public keys (entry `me` is unused).
    pub fn pair_keys(&self, me: usize, publics: &[[u8; 32]]) -> Keys {
        Keys::PerPeer(
            publics
                .iter()
                .enumerate()
                .map(|(i, p)| match i == me {
                    true => Key([0; 32]),
                    false => self.pair_key(p),
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_of_a_pair_derive_the_same_key_and_pairs_differ() {
        let (a, b, c) = (
            HostKey::generate(),
            HostKey::generate(),
            HostKey::generate(),
        );
        let ab = a.pair_key(&b.public());
        assert_eq!(ab.0, b.pair_key(&a.public()).0);
        assert_ne!(ab.0, a.pair_key(&c.public()).0);
        assert_ne!(ab.0, c.pair_key(&b.public()).0);
    }

    #[test]
    fn key_files_are_private_and_never_overwritten() {
        let dir = std::env::temp_dir().join(format!("softnic-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("host.key");
        let _ = std::fs::remove_file(&path);
        let k = HostKey::generate();
        k.save(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(HostKey::load(&path).unwrap().public(), k.public());
        assert!(matches!(k.save(&path), Err(KeyError::Exists { .. })));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = HostKey::load(&path).err().unwrap();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, "not hex\n").unwrap();
        assert!(matches!(
            HostKey::load(&path),
            Err(KeyError::Malformed { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
