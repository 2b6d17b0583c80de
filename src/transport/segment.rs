//! UDP segmentation offload: runs of equal-sized datagrams to one peer leave in one `sendmsg`
//! that the kernel cuts into datagrams (`UDP_SEGMENT`, GSO), and the receiving socket takes
//! datagrams of one flow joined (`UDP_GRO`) with the size they were cut at. On a 1500-byte
//! network every datagram otherwise pays a system call and a trip through the stack of its
//! own; the datagrams on the wire are the same either way, each sealed, sequenced and
//! acknowledged on its own. A kernel or device that refuses GSO is asked once; sends then go
//! as before.

use std::io;
use std::os::fd::RawFd;

/// Segments one GSO send may carry (the kernel's `UDP_MAX_SEGMENTS`).
const SEGMENTS_MAX: usize = 64;
/// Bytes one GSO send may carry: an IPv4 packet's length field less its headers, with room.
const BYTES_MAX: usize = 65_000;
/// Room for one control message carrying an `int` (or a `u16`), 8-byte aligned.
type Control = [u64; 4];

/// How many of `lens` (from the first) one GSO send can carry: every datagram the length of
/// the first but the last, which may be shorter; 1 when no run of two or more starts here.
pub fn run(lens: &[usize]) -> usize {
    let Some(&size) = lens.first() else { return 0 };
    if size == 0 {
        return 1;
    }
    let (mut n, mut total) = (1, size);
    while n < lens.len() && n < SEGMENTS_MAX && total + lens[n] <= BYTES_MAX {
        let len = lens[n];
        if len > size || len == 0 {
            break;
        }
        n += 1;
        total += len;
        if len < size {
            break;
        }
    }
    n
}

/// Writes a control message `level`/`kind` holding `value` into `ctl` and points `msg` at it.
fn set_control(msg: &mut libc::msghdr, ctl: &mut Control, level: i32, kind: i32, value: u16) {
    // SAFETY: CMSG_SPACE/CMSG_LEN are arithmetic; `ctl` (32 bytes) has room for one header
    // (16) and two bytes of data, so CMSG_FIRSTHDR is non-null and CMSG_DATA in bounds.
    unsafe {
        msg.msg_control = ctl.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(2) as usize;
        let c = libc::CMSG_FIRSTHDR(msg);
        (*c).cmsg_level = level;
        (*c).cmsg_type = kind;
        (*c).cmsg_len = libc::CMSG_LEN(2) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), value);
    }
}

/// Sends the datagrams `lens` cuts `data` into, in order, runs of equal sizes as one GSO
/// message each (`*gso`; cleared for good when the kernel refuses it, and the refused ones go
/// again without), the rest one message each, all in `sendmmsg` calls of up to `batch`
/// messages. On an error, how many datagrams were not sent.
pub fn send(
    fd: RawFd,
    data: &mut [u8],
    lens: &[usize],
    gso: &mut bool,
    batch: usize,
    syscalls: &mut u64,
    gso_sends: &mut u64,
) -> Result<(), (io::Error, usize)> {
    let batch = batch.clamp(1, 64);
    let mut iov = [const { std::mem::MaybeUninit::<libc::iovec>::uninit() }; 64];
    let mut msgs = [const { std::mem::MaybeUninit::<libc::mmsghdr>::uninit() }; 64];
    // Written only where a message uses it (as the headers: a whole set is 2 KiB).
    let mut ctl = [const { std::mem::MaybeUninit::<Control>::uninit() }; 64];
    // Datagrams each message carries.
    let mut counts = [0usize; 64];
    let (mut at, mut k) = (0, 0);
    while k < lens.len() {
        let (mut m, mut off, mut j) = (0, at, k);
        while m < batch && j < lens.len() {
            let n = if *gso { run(&lens[j..]) } else { 1 };
            let bytes: usize = lens[j..j + n].iter().sum();
            let v = iov[m].write(libc::iovec {
                iov_base: data[off..].as_mut_ptr() as *mut _,
                iov_len: bytes,
            });
            // SAFETY: an all-zero mmsghdr is a valid empty header.
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_iov = v;
            h.msg_hdr.msg_iovlen = 1;
            if n > 1 {
                let (c, seg) = (ctl[m].write([0; 4]), lens[j] as u16);
                set_control(&mut h.msg_hdr, c, libc::SOL_UDP, libc::UDP_SEGMENT, seg);
            }
            msgs[m].write(h);
            counts[m] = n;
            off += bytes;
            j += n;
            m += 1;
        }
        // SAFETY: msgs[..m] were written above and point at iovecs into `data` and at control
        // buffers in `ctl`, all alive for the call.
        let sent =
            unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr().cast(), m as u32, libc::MSG_DONTWAIT) };
        *syscalls += 1;
        if sent <= 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // EIO: the route's device cannot checksum a GSO send; EINVAL: a kernel or socket
            // that does not know it; EMSGSIZE: segments larger than the device's MTU, which
            // GSO cannot fragment (a plain datagram is fragmented: a path MTU below the
            // configured one, as `softnic doctor` reports). Plain datagrams from here on.
            let refused = matches!(
                e.raw_os_error(),
                Some(libc::EIO | libc::EINVAL | libc::EMSGSIZE)
            );
            if *gso && counts[0] > 1 && refused {
                tracing::debug!("UDP GSO refused ({e}): datagrams go one by one");
                *gso = false;
                continue;
            }
            return Err((e, lens.len() - k));
        }
        for &n in &counts[..sent as usize] {
            if n > 1 {
                *gso_sends += 1;
            }
            at += lens[k..k + n].iter().sum::<usize>();
            k += n;
        }
    }
    Ok(())
}

/// Asks the kernel to hand `fd`'s datagrams over joined where it can (`UDP_GRO`); whether it
/// agreed.
pub fn enable_gro(fd: RawFd) -> bool {
    let on: libc::c_int = 1;
    // SAFETY: setsockopt with a valid socket and an int option value that outlives the call.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_UDP,
            libc::UDP_GRO,
            &on as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

/// A buffer for the control message of one receive.
pub fn control() -> Control {
    [0; 4]
}

/// Points `msg` at `ctl` for a receive (`UDP_GRO`'s segment size comes back there).
pub fn receive_control(msg: &mut libc::msghdr, ctl: &mut Control) {
    msg.msg_control = ctl.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of::<Control>();
}

/// One `recvmsg` into `buf` on a socket with `UDP_GRO`: the bytes received and the size the
/// datagrams among them were joined at (see [`joined_at`]).
pub fn recv_joined(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, usize)> {
    let mut ctl = control();
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    receive_control(&mut msg, &mut ctl);
    // SAFETY: `msg` points at `buf` and `ctl`, both alive for the call.
    let got = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = got as usize;
    Ok((n, joined_at(&msg, n)))
}

/// The size the datagrams of a received buffer of `len` bytes were joined at (`UDP_GRO`'s
/// control message), or `len` when it holds one datagram. Never 0 for a non-empty buffer.
pub fn joined_at(msg: &libc::msghdr, len: usize) -> usize {
    if msg.msg_controllen == 0 || msg.msg_control.is_null() {
        return len;
    }
    // SAFETY: the kernel wrote `msg_controllen` bytes of well-formed control messages into the
    // buffer `msg` points at; CMSG_FIRSTHDR/NXTHDR stay within it and CMSG_DATA of a UDP_GRO
    // message holds an int.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                let size = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                return match usize::try_from(size) {
                    Ok(s) if s > 0 && s < len => s,
                    _ => len,
                };
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_equal_sizes_then_at_most_one_shorter() {
        assert_eq!(run(&[]), 0);
        assert_eq!(run(&[1472]), 1);
        assert_eq!(run(&[1472, 1472, 1472]), 3);
        assert_eq!(
            run(&[1472, 1472, 100, 1472]),
            3,
            "a shorter one ends the run"
        );
        assert_eq!(run(&[100, 1472]), 1, "a longer one cannot follow");
        assert_eq!(run(&[0, 0]), 1, "empty datagrams go alone");
        assert_eq!(run(&[1472; 100]), 44, "at most 65,000 bytes");
        assert_eq!(run(&[64; 100]), 64, "at most 64 segments");
    }
}
