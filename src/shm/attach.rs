//! Attach protocol: small messages over a UNIX SOCK_SEQPACKET socket, with file descriptors
//! (control block, doorbells, registered memfds) passed as SCM_RIGHTS.
//!
//! Message: `kind u32 | 0 u32 | 6 × u64 fields | text…`. The socket is only used off the hot
//! path: attach, registration, statistics, liveness. Closing it detaches the client.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::net::{
    recvmsg, sendmsg, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketType,
};

use crate::wire::{get_u32, get_u64};

/// 2: `HelloOk` names the datagram body.
pub const PROTOCOL_VERSION: u64 = 2;
const FIELDS: usize = 6;
const FIXED: usize = 8 + FIELDS * 8;
/// Largest message (the statistics text is the longest).
pub const MAX_MESSAGE: usize = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First message. The daemon answers `HelloOk` with the control memfd and two eventfds
    /// (daemon doorbell, client doorbell).
    Hello {
        job: u32,
        job_key: u64,
        rank: u32,
        size: u32,
    },
    /// Register the attached sealed memfd with remote permissions `perms`.
    Register {
        perms: u8,
    },
    Deregister {
        region: u32,
    },
    Stat,
    Ping,
    /// Make every peer answer soon (`softnic doctor`); answered `Pong`.
    Probe,
    /// Register `[addr, addr+len)` of the client's own address space, reached by the daemon by
    /// copy (process_vm_readv/writev), with remote permissions `perms` (0: the local side of
    /// operations only).
    RegisterProcess {
        addr: u64,
        len: u64,
        perms: u8,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// `body`: the bytes a datagram of this host's transport carries behind its header (see
    /// [`crate::client::Client::datagram_body`]).
    HelloOk {
        host: u16,
        nhosts: u16,
        body: u32,
    },
    Registered {
        region: u32,
    },
    Done,
    Stat(String),
    Pong,
    Error(String),
}

fn pack(kind: u32, f: [u64; FIELDS], text: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(FIXED + text.len());
    b.extend_from_slice(&kind.to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    for v in f {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(text.as_bytes());
    b.truncate(MAX_MESSAGE);
    b
}

fn unpack(b: &[u8]) -> io::Result<(u32, [u64; FIELDS], String)> {
    if b.len() < FIXED {
        return Err(bad("attach message shorter than its header"));
    }
    let mut f = [0u64; FIELDS];
    for (i, v) in f.iter_mut().enumerate() {
        *v = get_u64(b, 8 + i * 8);
    }
    Ok((
        get_u32(b, 0),
        f,
        String::from_utf8_lossy(&b[FIXED..]).into_owned(),
    ))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        match *self {
            Request::Hello {
                job,
                job_key,
                rank,
                size,
            } => pack(
                1,
                [
                    PROTOCOL_VERSION,
                    job as u64,
                    job_key,
                    rank as u64,
                    size as u64,
                    0,
                ],
                "",
            ),
            Request::Register { perms } => pack(2, [perms as u64, 0, 0, 0, 0, 0], ""),
            Request::Deregister { region } => pack(3, [region as u64, 0, 0, 0, 0, 0], ""),
            Request::Stat => pack(4, [0; FIELDS], ""),
            Request::Ping => pack(5, [0; FIELDS], ""),
            Request::Probe => pack(7, [0; FIELDS], ""),
            Request::RegisterProcess { addr, len, perms } => {
                pack(6, [addr, len, perms as u64, 0, 0, 0], "")
            }
        }
    }

    pub fn decode(b: &[u8]) -> io::Result<Request> {
        let (k, f, _) = unpack(b)?;
        let u32f = |v: u64| u32::try_from(v).map_err(|_| bad("field out of range"));
        Ok(match k {
            1 => {
                if f[0] != PROTOCOL_VERSION {
                    return Err(bad("client speaks another attach protocol version"));
                }
                Request::Hello {
                    job: u32f(f[1])?,
                    job_key: f[2],
                    rank: u32f(f[3])?,
                    size: u32f(f[4])?,
                }
            }
            2 => Request::Register {
                perms: (f[0] & 3) as u8,
            },
            3 => Request::Deregister {
                region: u32f(f[0])?,
            },
            4 => Request::Stat,
            5 => Request::Ping,
            7 => Request::Probe,
            6 => Request::RegisterProcess {
                addr: f[0],
                len: f[1],
                perms: u8::try_from(f[2])
                    .ok()
                    .filter(|p| *p <= 3)
                    .ok_or_else(|| bad("permissions out of range"))?,
            },
            _ => return Err(bad("unknown attach request")),
        })
    }
}

impl Response {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Response::HelloOk { host, nhosts, body } => pack(
                101,
                [*host as u64, *nhosts as u64, *body as u64, 0, 0, 0],
                "",
            ),
            Response::Registered { region } => pack(102, [*region as u64, 0, 0, 0, 0, 0], ""),
            Response::Done => pack(103, [0; FIELDS], ""),
            Response::Stat(s) => pack(104, [0; FIELDS], s),
            Response::Pong => pack(105, [0; FIELDS], ""),
            Response::Error(s) => pack(200, [0; FIELDS], s),
        }
    }

    pub fn decode(b: &[u8]) -> io::Result<Response> {
        let (k, f, text) = unpack(b)?;
        Ok(match k {
            101 => Response::HelloOk {
                host: f[0] as u16,
                nhosts: f[1] as u16,
                body: u32::try_from(f[2]).map_err(|_| bad("datagram body out of range"))?,
            },
            102 => Response::Registered {
                region: f[0] as u32,
            },
            103 => Response::Done,
            104 => Response::Stat(text),
            105 => Response::Pong,
            200 => Response::Error(text),
            _ => return Err(bad("unknown attach response")),
        })
    }
}

/// Sends one message with `fds` attached.
pub fn send(sock: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut space = [0u8; rustix::cmsg_space!(ScmRights(4))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !anc.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("too many descriptors for one message"));
    }
    let n = sendmsg(sock, &[IoSlice::new(msg)], &mut anc, SendFlags::NOSIGNAL)?;
    if n != msg.len() {
        return Err(io::Error::other("short send on a SEQPACKET socket"));
    }
    Ok(())
}

/// Receives one message into `buf`, collecting passed descriptors in `fds`. `Ok(0)` = peer closed.
pub fn recv(sock: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut space = [0u8; rustix::cmsg_space!(ScmRights(4))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let r = recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut anc,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    for m in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            fds.extend(it);
        }
    }
    if r.flags.contains(RecvFlags::TRUNC) {
        return Err(bad("attach message or its descriptors were truncated"));
    }
    Ok(r.bytes)
}

/// Connects a client socket to a daemon's attach socket.
pub fn connect(path: &Path) -> io::Result<OwnedFd> {
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::connect_unix(&fd, &SocketAddrUnix::new(path)?)?;
    Ok(fd)
}

/// Sends a request and waits for its response (client side; blocking).
pub fn call(
    sock: &OwnedFd,
    req: &Request,
    fds: &[BorrowedFd<'_>],
) -> io::Result<(Response, Vec<OwnedFd>)> {
    let sent = send(sock.as_fd(), &req.encode(), fds);
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut got = Vec::new();
    // A daemon that refuses this process says why as soon as it accepts, then closes: the
    // request may find the socket closed, and the reason is still there to read.
    let n = match (sent, recv(sock.as_fd(), &mut buf, &mut got)) {
        (_, Ok(n)) if n > 0 => n,
        (Err(e), _) => return Err(e),
        (Ok(()), r) => r?,
    };
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "daemon closed the attach socket",
        ));
    }
    Ok((Response::decode(&buf[..n])?, got))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for r in [
            Request::Hello {
                job: 3,
                job_key: 99,
                rank: 1,
                size: 4,
            },
            Request::Register { perms: 3 },
            Request::Deregister { region: 5 },
            Request::RegisterProcess {
                addr: 0x7f00_0000_1000,
                len: 1 << 20,
                perms: 3,
            },
            Request::Stat,
            Request::Probe,
            Request::Ping,
        ] {
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }
        for r in [
            Response::HelloOk {
                host: 1,
                nhosts: 2,
                body: 64_936,
            },
            Response::Stat("x y".into()),
            Response::Error("no".into()),
        ] {
            assert_eq!(Response::decode(&r.encode()).unwrap(), r);
        }
        assert!(Request::decode(&[1, 2, 3]).is_err());
        assert!(Request::decode(&pack(77, [0; FIELDS], "")).is_err());
    }
}
