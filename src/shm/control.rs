//! The control block one client shares with its daemon.
//!
//! Layout: a 4 KiB header (magic, capacities, then one cache line each for the command ring's
//! head and tail, the completion queue's head and tail, the two sleep flags, the NIC's core and
//! the core a yielding client waits on), the command
//! ring (variable-size records), then the completion queue (32-byte entries).
//!
//! Both rings are single-producer single-consumer with release/acquire indices. Each side keeps
//! its own index privately and only publishes it, so whatever the other side scribbles over the
//! shared copy cannot move it; the other side's index is read, validated, and a nonsensical
//! value is a [`ControlError`] (the daemon then disconnects that client).

use std::cell::Cell;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use super::Mapping;
use crate::wire::{get_u16, get_u32, get_u64, AmoOp};

const MAGIC: u64 = 0x3143_494e_5446_4f53; // "SOFTNIC1"
const VERSION: u32 = 4;
const HEADER: usize = 4096;
const CMD_HEAD: usize = 64;
const CMD_TAIL: usize = 128;
const CQ_HEAD: usize = 192;
const CQ_TAIL: usize = 256;
const DAEMON_SLEEPING: usize = 320;
const CLIENT_SLEEPING: usize = 384;
const NIC_CPU: usize = 448;
const WAITER_CPU: usize = 512;
const CLIENTS: usize = 576;
/// Messages sent to this client by the others the daemon's process serves (see
/// [`Waiter::keep_core`]).
const SPOKEN_TO: usize = 640;
const REC_CMD: u32 = 1;
const REC_PAD: u32 = 2;
/// A VELO send in its short form ([`VELO_REC_HEAD`] bytes, then the message; the message's
/// length in the tag word's upper half): EXTOLL's VELO requester takes a small message in one
/// processor write, and so does this ring. A record of at most a cache line never straddles
/// two, so the client writes, and the daemon reads, one line per message instead of the two
/// or three of a full descriptor.
const REC_VELO: u32 = 3;
/// Bytes of a short VELO record before its message: record header, `client_req`, then host
/// u16, VELO tag u8, flags u8, rank u32.
const VELO_REC_HEAD: usize = 24;
const LINE: u64 = 64;
/// Bytes of a command descriptor (after the 8-byte record header).
pub const COMMAND_LEN: usize = 72;
pub const CQ_ENTRY_LEN: usize = 32;

/// [`CLIENT_SLEEPING`]'s value while the client waits for command ring room only.
const SLEEP_FOR_ROOM: u32 = 2;

/// What a client announced it sleeps for (its daemon rings its doorbell only for that).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientSleep {
    Awake,
    /// Any news: completions, events, room.
    ForNews,
    /// Room in its full command ring.
    ForRoom,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ControlError {
    #[error("control block has a bad magic or version: not a softnic control block")]
    BadHeader,
    #[error("ring index out of range: the peer corrupted the shared indices")]
    BadIndex,
    #[error("malformed command record of {0} bytes")]
    BadRecord(usize),
    #[error("unknown command kind {0}")]
    BadCommand(u8),
    #[error("command carries {0} inline bytes, more than its record holds or the limit")]
    BadInline(u64),
    #[error("vector command with a bad element size, mode or count, or a length its shape disagrees with")]
    BadVector,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum CommandKind {
    /// FMA put: payload inline after the descriptor.
    #[default]
    PutInline = 1,
    /// BTE put: the daemon streams `len` bytes from the client's registered `local_region`.
    PutFrom = 2,
    /// Get `len` bytes into the client's registered `local_region`.
    Get = 3,
    /// A Gemini AMO on the 8-byte word at `remote_off`.
    Amo = 4,
    /// Non-fetching AMOs on many words of one region: `len` inline bytes of 16-byte
    /// `(offset, operand)` pairs.
    AmoScatter = 5,
    /// A Portals call (`shm::ptl_call`), `len` inline bytes. `client_req` 0: no completion.
    Portals = 6,
    /// A strided or indexed put of `nelems` elements of `elem` bytes (always FMA): `len`
    /// inline bytes, the `u64` byte offsets first when `indexed`, then the elements packed.
    /// Strided: element k goes to `remote_off + k·operand` (`operand` a signed byte stride).
    PutV = 7,
    /// A strided or indexed get of `nelems` elements: element k comes from `remote_off +
    /// k·operand` (or the k-th inline `u64` offset when `indexed`) and lands at `local_off +
    /// k·operand2` of `local_region` (signed byte strides).
    GetV = 8,
    /// A PE-strided put, scatter or gather (`nic::host::ixpe`): `nelems` targets listed inline
    /// (rank u32, host u16, 2 bytes padding), then the data; `operand` the mode, `operand2`
    /// the bytes per target. One completion for all.
    Ixpe = 9,
    /// Opens this process's VELO port: its mailbox is `local_region`, with `operand`-byte
    /// slots, `operand2` of them (`nic::velo`).
    VeloOpen = 10,
    /// A VELO message of `len` inline bytes, tag `operand`, for the mailbox of `rank`.
    VeloSend = 11,
    /// Opens this process's RMA port: its notification queue is `local_region` with
    /// `operand` entries (`nic::rma`).
    RmaOpen = 12,
    /// An RMA put of `len` bytes of `local_region` from `local_off` to `remote_region` at
    /// `remote_off` of `rank`; `operand` the notify flags.
    RmaPut = 13,
    /// An RMA get of `len` bytes from `remote_region`/`remote_off` into `local_region` at
    /// `local_off`; `operand` the notify flags.
    RmaGet = 14,
    /// An RMA put of the 1–8 inline bytes; `operand` the notify flags.
    RmaImmediate = 15,
}

/// Which operation a peer failure cut short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailedOp {
    Put = 1,
    Get = 2,
    Amo = 3,
}

impl std::fmt::Display for FailedOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FailedOp::Put => "put",
            FailedOp::Get => "get",
            FailedOp::Amo => "AMO",
        })
    }
}

/// What a `PeerDead` completion says in its `value`: the peer host, the operation and how
/// long it waited (packed: host in bits 48..64, operation in 40..48, milliseconds below).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerFailure {
    pub host: u16,
    pub op: Option<FailedOp>,
    pub waited_ms: u64,
}

impl PeerFailure {
    const MS_MASK: u64 = (1 << 40) - 1;

    pub fn pack(&self) -> u64 {
        (self.host as u64) << 48
            | (self.op.map_or(0, |o| o as u64)) << 40
            | self.waited_ms.min(Self::MS_MASK)
    }

    pub fn unpack(v: u64) -> PeerFailure {
        PeerFailure {
            host: (v >> 48) as u16,
            op: match (v >> 40) as u8 {
                1 => Some(FailedOp::Put),
                2 => Some(FailedOp::Get),
                3 => Some(FailedOp::Amo),
                _ => None,
            },
            waited_ms: v & Self::MS_MASK,
        }
    }
}

/// A command descriptor as the client writes it. Decoded from a private copy, never in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Command {
    pub kind: CommandKind,
    /// The AMO of `Amo` and `AmoScatter` commands (decode refuses those without a valid one).
    pub amo: Option<AmoOp>,
    /// [`CMD_IMPLICIT`]…
    pub flags: u8,
    /// Target host index (from the job's rank map).
    pub host: u16,
    pub rank: u32,
    pub remote_region: u32,
    pub client_req: u64,
    pub remote_off: u64,
    pub len: u64,
    pub local_region: u32,
    pub local_off: u64,
    pub operand: u64,
    pub operand2: u64,
    /// Vector commands: element size (1, 4, 8, 16), offsets listed inline, element count.
    pub elem: u8,
    pub indexed: bool,
    pub nelems: u32,
}

/// Most elements one vector command may name.
pub const MAX_VECTOR_ELEMS: u32 = 1 << 24;

impl Command {
    pub fn encode(&self, b: &mut [u8]) {
        b[0] = self.kind as u8;
        b[1] = self.amo.map_or(0, |a| a as u8);
        b[2] = self.flags;
        b[3] = self.elem;
        b[4..6].copy_from_slice(&self.host.to_le_bytes());
        b[6..8].copy_from_slice(&[self.indexed as u8, 0]);
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b[12..16].copy_from_slice(&self.remote_region.to_le_bytes());
        b[16..24].copy_from_slice(&self.client_req.to_le_bytes());
        b[24..32].copy_from_slice(&self.remote_off.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..44].copy_from_slice(&self.local_region.to_le_bytes());
        b[44..48].copy_from_slice(&self.nelems.to_le_bytes());
        b[48..56].copy_from_slice(&self.local_off.to_le_bytes());
        b[56..64].copy_from_slice(&self.operand.to_le_bytes());
        b[64..72].copy_from_slice(&self.operand2.to_le_bytes());
    }

    /// Decodes a record body (descriptor + inline bytes); checks kind and inline length.
    pub fn decode(b: &[u8]) -> Result<(Command, &[u8]), ControlError> {
        if b.len() < COMMAND_LEN {
            return Err(ControlError::BadRecord(b.len()));
        }
        let kind = match b[0] {
            1 => CommandKind::PutInline,
            2 => CommandKind::PutFrom,
            3 => CommandKind::Get,
            4 => CommandKind::Amo,
            5 => CommandKind::AmoScatter,
            6 => CommandKind::Portals,
            7 => CommandKind::PutV,
            8 => CommandKind::GetV,
            9 => CommandKind::Ixpe,
            10 => CommandKind::VeloOpen,
            11 => CommandKind::VeloSend,
            12 => CommandKind::RmaOpen,
            13 => CommandKind::RmaPut,
            14 => CommandKind::RmaGet,
            15 => CommandKind::RmaImmediate,
            k => return Err(ControlError::BadCommand(k)),
        };
        let mut c = Command {
            kind,
            amo: None,
            flags: b[2],
            host: get_u16(b, 4),
            rank: get_u32(b, 8),
            remote_region: get_u32(b, 12),
            client_req: get_u64(b, 16),
            remote_off: get_u64(b, 24),
            len: get_u64(b, 32),
            local_region: get_u32(b, 40),
            local_off: get_u64(b, 48),
            operand: get_u64(b, 56),
            operand2: get_u64(b, 64),
            elem: b[3],
            indexed: b[6] == 1,
            nelems: get_u32(b, 44),
        };
        if kind == CommandKind::Amo || kind == CommandKind::AmoScatter {
            let op = AmoOp::from_u8(b[1]).ok_or(ControlError::BadCommand(b[1]))?;
            if kind == CommandKind::AmoScatter && (op.is_fetching() || !c.len.is_multiple_of(16)) {
                return Err(ControlError::BadInline(c.len));
            }
            c.amo = Some(op);
        }
        if matches!(kind, CommandKind::PutV | CommandKind::GetV) {
            let (e, n) = (c.elem as u64, c.nelems as u64);
            let idx = if c.indexed { n * 8 } else { 0 };
            let want = if kind == CommandKind::PutV {
                idx + n * e
            } else {
                idx
            };
            if !crate::wire::VShape::valid_elem(c.elem)
                || b[6] > 1
                || c.nelems == 0
                || c.nelems > MAX_VECTOR_ELEMS
                || c.len != want
            {
                return Err(ControlError::BadVector);
            }
        }
        let rest = &b[COMMAND_LEN..];
        let inline = if matches!(
            kind,
            CommandKind::PutInline
                | CommandKind::AmoScatter
                | CommandKind::Portals
                | CommandKind::PutV
                | CommandKind::GetV
                | CommandKind::Ixpe
                | CommandKind::VeloSend
                | CommandKind::RmaImmediate
        ) {
            if c.len > rest.len() as u64 {
                return Err(ControlError::BadInline(c.len));
            }
            &rest[..c.len as usize]
        } else {
            &[][..]
        };
        Ok((c, inline))
    }
}

/// Command flag: an implicit (nbi) operation, completed in bulk; its remote ack may be lazy.
pub const CMD_IMPLICIT: u8 = 1;
/// Command flag on an `Amo`: the NIC stores the fetched value in the client's `local_region`
/// at `local_off` (8 bytes) before completing it.
pub const CMD_LAND: u8 = 2;
/// Command flag on a `VeloSend`: the sender has credits to spare, the target may acknowledge
/// lazily.
pub const CMD_LAZY: u8 = 4;

/// A completion-queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CqEntry {
    pub client_req: u64,
    pub status: u32,
    pub value: u64,
}

/// One side's view of a control block.
pub struct Control {
    /// Shared with the [`Waiter`]s handed out.
    map: std::sync::Arc<Mapping>,
    cmd_cap: u64,
    cq_cap: u64,
    /// Private copies of the indices this side owns.
    cmd_head: Cell<u64>,
    cmd_tail: Cell<u64>,
    cq_head: Cell<u64>,
    cq_tail: Cell<u64>,
    /// Last-read copies of the other side's command index (the client's view of the head,
    /// the daemon's of the tail): read again only when the copy says full or empty, so the
    /// two cores do not pass the index cache lines back and forth on every command.
    cmd_head_seen: Cell<u64>,
    cmd_tail_seen: Cell<u64>,
    /// The head the daemon last published; it publishes in batches ([`Control::cmd_publish`]).
    cmd_head_published: Cell<u64>,
}

impl Control {
    /// Bytes a control block with these capacities takes.
    pub fn size(cmd_cap: usize, cq_cap: usize) -> usize {
        HEADER + cmd_cap + cq_cap * CQ_ENTRY_LEN
    }

    /// Creates a fresh control block (the daemon does this at attach).
    pub fn create(cmd_cap: usize, cq_cap: usize) -> std::io::Result<Control> {
        assert!(cmd_cap.is_power_of_two() && cq_cap.is_power_of_two() && cmd_cap >= 4096);
        let map = Mapping::create("softnic-control", Self::size(cmd_cap, cq_cap))?;
        // SAFETY: fresh mapping, nobody else has it yet.
        let b = unsafe { map.slice_mut() };
        b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(cmd_cap as u32).to_le_bytes());
        b[16..20].copy_from_slice(&(cq_cap as u32).to_le_bytes());
        Ok(Self::with(map, cmd_cap as u64, cq_cap as u64))
    }

    /// Opens a control block received from the daemon (the client does this).
    pub fn open(map: Mapping) -> Result<Control, ControlError> {
        // SAFETY: read-only look at the header.
        let b = unsafe { map.slice_mut() };
        if b.len() < HEADER || get_u64(b, 0) != MAGIC || get_u32(b, 8) != VERSION {
            return Err(ControlError::BadHeader);
        }
        let (cmd, cq) = (get_u32(b, 12) as usize, get_u32(b, 16) as usize);
        if !cmd.is_power_of_two() || !cq.is_power_of_two() || Self::size(cmd, cq) > map.len() {
            return Err(ControlError::BadHeader);
        }
        let c = Self::with(map, cmd as u64, cq as u64);
        c.cmd_tail.set(c.atomic(CMD_TAIL).load(Ordering::Acquire));
        c.cmd_head_seen
            .set(c.atomic(CMD_HEAD).load(Ordering::Acquire));
        c.cq_head.set(c.atomic(CQ_HEAD).load(Ordering::Acquire));
        Ok(c)
    }

    fn with(map: Mapping, cmd_cap: u64, cq_cap: u64) -> Control {
        Control {
            map: std::sync::Arc::new(map),
            cmd_cap,
            cq_cap,
            cmd_head: Cell::new(0),
            cmd_tail: Cell::new(0),
            cq_head: Cell::new(0),
            cq_tail: Cell::new(0),
            cmd_head_seen: Cell::new(0),
            cmd_tail_seen: Cell::new(0),
            cmd_head_published: Cell::new(0),
        }
    }

    pub fn mapping(&self) -> &Mapping {
        &self.map
    }

    pub fn cq_capacity(&self) -> usize {
        self.cq_cap as usize
    }

    /// Largest inline payload one command can carry in this ring.
    pub fn max_inline(&self) -> usize {
        (self.cmd_cap as usize / 4) - 8 - COMMAND_LEN
    }

    fn atomic(&self, at: usize) -> &AtomicU64 {
        word(&self.map, at)
    }

    fn flag(&self, at: usize) -> &AtomicU32 {
        flag(&self.map, at)
    }

    fn ring(&self) -> *mut u8 {
        // SAFETY: HEADER is within the mapping.
        unsafe { self.map.as_ptr().add(HEADER) }
    }

    fn cq(&self) -> *mut u8 {
        // SAFETY: the CQ follows the command ring inside the mapping.
        unsafe { self.map.as_ptr().add(HEADER + self.cmd_cap as usize) }
    }

    // ---- client side: command producer ----

    /// Appends a command (with `inline` payload for FMA puts); `false` when the ring is full.
    /// A VELO send goes in its short record ([`REC_VELO`]).
    pub fn cmd_push(&self, cmd: &Command, inline: &[u8]) -> bool {
        let short = cmd.kind == CommandKind::VeloSend
            && cmd.operand <= u8::MAX as u64
            && cmd.len == inline.len() as u64
            && inline.len() <= u16::MAX as usize;
        let head_len = if short {
            VELO_REC_HEAD
        } else {
            8 + COMMAND_LEN
        };
        let need = (head_len + inline.len()).next_multiple_of(8) as u64;
        assert!(
            need <= self.cmd_cap / 4,
            "inline payload larger than max_inline"
        );
        let mut tail = self.cmd_tail.get();
        let pos = tail % self.cmd_cap;
        let contiguous = self.cmd_cap - pos;
        let in_line = LINE - pos % LINE;
        let pad = if need > contiguous {
            contiguous
        } else if short && need <= LINE && need > in_line {
            // Padded to the next line, so that the record is one line.
            in_line
        } else {
            0
        };
        let fits = |head: u64| self.cmd_cap - tail.wrapping_sub(head) >= pad + need;
        if !fits(self.cmd_head_seen.get()) {
            let head = self.atomic(CMD_HEAD).load(Ordering::Acquire);
            self.cmd_head_seen.set(head);
            if !fits(head) {
                return false;
            }
        }
        // SAFETY: every write below stays within [ring, ring + cmd_cap).
        unsafe {
            if pad > 0 {
                let p = self.ring().add(pos as usize);
                std::ptr::copy_nonoverlapping((pad as u32).to_le_bytes().as_ptr(), p, 4);
                std::ptr::copy_nonoverlapping(REC_PAD.to_le_bytes().as_ptr(), p.add(4), 4);
                tail += pad;
            }
            let p = self.ring().add((tail % self.cmd_cap) as usize);
            let mut rec = [0u8; 8 + COMMAND_LEN];
            rec[0..4].copy_from_slice(&(need as u32).to_le_bytes());
            if short {
                let tag = REC_VELO | (inline.len() as u32) << 16;
                rec[4..8].copy_from_slice(&tag.to_le_bytes());
                rec[8..16].copy_from_slice(&cmd.client_req.to_le_bytes());
                rec[16..18].copy_from_slice(&cmd.host.to_le_bytes());
                rec[18] = cmd.operand as u8;
                rec[19] = cmd.flags;
                rec[20..24].copy_from_slice(&cmd.rank.to_le_bytes());
            } else {
                rec[4..8].copy_from_slice(&REC_CMD.to_le_bytes());
                cmd.encode(&mut rec[8..]);
            }
            std::ptr::copy_nonoverlapping(rec.as_ptr(), p, head_len);
            std::ptr::copy_nonoverlapping(inline.as_ptr(), p.add(head_len), inline.len());
        }
        tail += need;
        self.cmd_tail.set(tail);
        self.atomic(CMD_TAIL).store(tail, Ordering::Release);
        true
    }

    /// Whether at least half the ring is free again (the daemon wakes a client sleeping on
    /// a full ring only then, so each wake-up buys it many commands' room).
    pub fn cmd_half_free(&self) -> bool {
        let head = self.atomic(CMD_HEAD).load(Ordering::Acquire);
        self.cmd_tail.get().wrapping_sub(head) <= self.cmd_cap / 2
    }

    /// Whether the daemon has taken every command this client published.
    pub fn cmd_consumed(&self) -> bool {
        self.atomic(CMD_HEAD).load(Ordering::Acquire) == self.cmd_tail.get()
    }

    // ---- daemon side: command consumer ----

    /// Copies the next command record's body into `buf`; returns the record length to pass to
    /// [`Control::cmd_advance`] once the command has been accepted, or `None` if the ring is empty.
    pub fn cmd_peek(&self, buf: &mut Vec<u8>) -> Result<Option<u64>, ControlError> {
        loop {
            let head = self.cmd_head.get();
            let mut tail = self.cmd_tail_seen.get();
            if tail == head {
                tail = self.atomic(CMD_TAIL).load(Ordering::Acquire);
                self.cmd_tail_seen.set(tail);
            }
            let avail = tail.wrapping_sub(head);
            if avail == 0 {
                return Ok(None);
            }
            if avail > self.cmd_cap || !avail.is_multiple_of(8) {
                return Err(ControlError::BadIndex);
            }
            let (pos, len, tag) = self.record_at(head, avail)?;
            match (tag & 0xffff, tag >> 16) {
                (REC_PAD, 0) => {
                    self.cmd_advance(len);
                    continue;
                }
                (REC_CMD, 0) => {
                    let n = len as usize - 8;
                    buf.clear();
                    buf.reserve(n);
                    // SAFETY: the record lies inside the ring (`record_at` checked); the
                    // vector has room for `n` bytes, all of them written before `set_len`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.ring().add(pos + 8),
                            buf.as_mut_ptr(),
                            n,
                        );
                        buf.set_len(n);
                    }
                    return Ok(Some(len));
                }
                (REC_VELO, n) => {
                    self.velo_body(pos, len, n as usize, buf)?;
                    return Ok(Some(len));
                }
                _ => return Err(ControlError::BadRecord(len as usize)),
            }
        }
    }

    /// The short VELO record at `pos` (`len` bytes, an `n`-byte message) expanded to the body
    /// of a full one: descriptor and message.
    fn velo_body(
        &self,
        pos: usize,
        len: u64,
        n: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), ControlError> {
        if (VELO_REC_HEAD + n).next_multiple_of(8) as u64 != len {
            return Err(ControlError::BadRecord(len as usize));
        }
        let mut h = [0u8; VELO_REC_HEAD];
        // SAFETY: the record lies inside the ring (`record_at` checked) and is at least
        // `VELO_REC_HEAD` bytes long.
        unsafe { std::ptr::copy_nonoverlapping(self.ring().add(pos), h.as_mut_ptr(), h.len()) };
        let cmd = Command {
            kind: CommandKind::VeloSend,
            client_req: get_u64(&h, 8),
            host: get_u16(&h, 16),
            operand: h[18] as u64,
            flags: h[19],
            rank: get_u32(&h, 20),
            len: n as u64,
            ..Default::default()
        };
        buf.clear();
        buf.resize(COMMAND_LEN + n, 0);
        cmd.encode(&mut buf[..COMMAND_LEN]);
        // SAFETY: as above; the message's `n` bytes follow the head inside the record.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ring().add(pos + VELO_REC_HEAD),
                buf.as_mut_ptr().add(COMMAND_LEN),
                n,
            )
        };
        Ok(())
    }

    /// Whether the command just peeked (a record of `len` bytes) was the last one published
    /// when the daemon last read the ring's tail: nothing queued behind it then.
    pub fn cmd_alone(&self, len: u64) -> bool {
        self.cmd_head.get().wrapping_add(len) == self.cmd_tail_seen.get()
    }

    /// Whether the command published behind the one just peeked (a record of `len` bytes)
    /// surely sends nothing: a Portals call that only changes local state
    /// (`ptl_call::stays_local`). A hint for when to send (false when nothing is there or it
    /// cannot tell), read from memory the client may still scribble on.
    pub fn cmd_next_stays_local(&self, len: u64) -> bool {
        let at = self.cmd_head.get().wrapping_add(len);
        let avail = self.cmd_tail_seen.get().wrapping_sub(at);
        if avail == 0 || avail > self.cmd_cap {
            return false;
        }
        let Ok((pos, rlen, REC_CMD)) = self.record_at(at, avail) else {
            return false;
        };
        if rlen <= (8 + COMMAND_LEN) as u64 {
            return false;
        }
        let mut b = [0u8; 2];
        // SAFETY: the record lies inside the ring (`record_at` checked) and is longer than
        // its header and command, so both bytes are in it.
        unsafe {
            b[0] = *self.ring().add(pos + 8);
            b[1] = *self.ring().add(pos + 8 + COMMAND_LEN);
        }
        b[0] == CommandKind::Portals as u8 && crate::shm::ptl_call::stays_local(b[1])
    }

    /// The record at ring position `at` with `avail` bytes published from there on: its
    /// offset in the ring, length and tag, checked to lie inside both.
    fn record_at(&self, at: u64, avail: u64) -> Result<(usize, u64, u32), ControlError> {
        let pos = (at % self.cmd_cap) as usize;
        let mut hdr = [0u8; 8];
        // SAFETY: pos is 8-aligned (every index moves in multiples of 8) and < cmd_cap.
        unsafe { std::ptr::copy_nonoverlapping(self.ring().add(pos), hdr.as_mut_ptr(), 8) };
        let len = get_u32(&hdr, 0) as u64;
        let tag = get_u32(&hdr, 4);
        if len < 8 || !len.is_multiple_of(8) || len > avail || pos as u64 + len > self.cmd_cap {
            return Err(ControlError::BadRecord(len as usize));
        }
        Ok((pos, len, tag))
    }

    /// The space is published to the client at once when an eighth of the ring has been
    /// consumed since the last publication, else by [`Control::cmd_publish`].
    pub fn cmd_advance(&self, len: u64) {
        let h = self.cmd_head.get() + len;
        self.cmd_head.set(h);
        if h - self.cmd_head_published.get() >= self.cmd_cap / 8 {
            self.cmd_publish();
        }
    }

    /// Hands the space of every consumed command back to the client (the daemon calls this
    /// at the end of each drain, before it could sleep).
    pub fn cmd_publish(&self) {
        let h = self.cmd_head.get();
        if h != self.cmd_head_published.get() {
            self.cmd_head_published.set(h);
            self.atomic(CMD_HEAD).store(h, Ordering::Release);
        }
    }

    /// Whether at most half the ring holds commands not yet consumed: see
    /// [`Control::cmd_half_free`].
    pub fn cmd_backlog_below_half(&self) -> bool {
        self.atomic(CMD_TAIL)
            .load(Ordering::Acquire)
            .wrapping_sub(self.cmd_head.get())
            <= self.cmd_cap / 2
    }

    /// Whether the client has published commands the daemon has not consumed.
    pub fn cmd_pending(&self) -> bool {
        self.atomic(CMD_TAIL).load(Ordering::Acquire) != self.cmd_head.get()
    }

    // ---- daemon side: completion producer ----

    /// Posts a completion; `Ok(false)` when the queue is full.
    pub fn cq_push(&self, e: &CqEntry) -> Result<bool, ControlError> {
        let tail = self.cq_tail.get();
        let head = self.atomic(CQ_HEAD).load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > self.cq_cap {
            return Err(ControlError::BadIndex);
        }
        if used == self.cq_cap {
            return Ok(false);
        }
        let mut b = [0u8; CQ_ENTRY_LEN];
        b[0..8].copy_from_slice(&e.client_req.to_le_bytes());
        b[8..12].copy_from_slice(&e.status.to_le_bytes());
        b[16..24].copy_from_slice(&e.value.to_le_bytes());
        let at = (tail % self.cq_cap) as usize * CQ_ENTRY_LEN;
        // SAFETY: slot `at` lies inside the CQ area.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.cq().add(at), CQ_ENTRY_LEN) };
        self.cq_tail.set(tail + 1);
        self.atomic(CQ_TAIL).store(tail + 1, Ordering::Release);
        Ok(true)
    }

    // ---- client side: completion consumer ----

    pub fn cq_pop(&self) -> Option<CqEntry> {
        let head = self.cq_head.get();
        let tail = self.atomic(CQ_TAIL).load(Ordering::Acquire);
        if head == tail {
            return None;
        }
        let mut b = [0u8; CQ_ENTRY_LEN];
        let at = (head % self.cq_cap) as usize * CQ_ENTRY_LEN;
        // SAFETY: slot inside the CQ area.
        unsafe { std::ptr::copy_nonoverlapping(self.cq().add(at), b.as_mut_ptr(), CQ_ENTRY_LEN) };
        self.cq_head.set(head + 1);
        self.atomic(CQ_HEAD).store(head + 1, Ordering::Release);
        Some(CqEntry {
            client_req: get_u64(&b, 0),
            status: get_u32(&b, 8),
            value: get_u64(&b, 16),
        })
    }

    pub fn cq_pending(&self) -> bool {
        self.atomic(CQ_TAIL).load(Ordering::Acquire) != self.cq_head.get()
    }

    // ---- sleep announcements (Dekker-style: store flag, full fence, re-check) ----

    pub fn set_daemon_sleeping(&self, v: bool) {
        self.flag(DAEMON_SLEEPING).store(v as u32, Ordering::SeqCst);
    }

    /// After publishing a command: does the daemon need its doorbell rung?
    pub fn daemon_sleeping(&self) -> bool {
        fence(Ordering::SeqCst);
        self.flag(DAEMON_SLEEPING).load(Ordering::SeqCst) != 0
    }

    pub fn set_client_sleeping(&self, v: bool) {
        self.flag(CLIENT_SLEEPING).store(v as u32, Ordering::SeqCst);
    }

    /// The client sleeps on a full command ring: only room (half of it free) wakes it.
    pub fn set_client_sleeping_for_room(&self) {
        self.flag(CLIENT_SLEEPING)
            .store(SLEEP_FOR_ROOM, Ordering::SeqCst);
    }

    /// What a sleeping client waits for.
    pub fn client_sleeping(&self) -> ClientSleep {
        fence(Ordering::SeqCst);
        match self.flag(CLIENT_SLEEPING).load(Ordering::SeqCst) {
            0 => ClientSleep::Awake,
            SLEEP_FOR_ROOM => ClientSleep::ForRoom,
            _ => ClientSleep::ForNews,
        }
    }

    // ---- who shares a core with whom (0 = nobody / unknown, else CPU + 1) ----

    /// The daemon: the CPU its thread is pinned to, if it is.
    pub fn set_nic_cpu(&self, cpu: Option<u32>) {
        self.flag(NIC_CPU).store(encode_cpu(cpu), Ordering::Relaxed);
    }

    pub fn nic_cpu(&self) -> Option<u32> {
        decode_cpu(self.flag(NIC_CPU))
    }

    /// The daemon: how many clients its process serves (every host's), which is how many
    /// processes share the machine's cores besides the NIC (see [`Waiter::yield_now`]).
    pub fn set_clients(&self, n: u32) {
        self.flag(CLIENTS).store(n, Ordering::Relaxed);
    }

    /// The daemon: the CPU a client gives away while it waits (see [`Waiter::yield_now`]).
    pub fn waiter_cpu(&self) -> Option<u32> {
        decode_cpu(self.flag(WAITER_CPU))
    }

    /// The daemon's handle for telling this client of messages on their way (see [`Ear`]).
    pub fn ear(&self) -> Ear {
        Ear(self.map.clone())
    }

    /// A handle that yields the client's core the announced way, borrowing nothing.
    pub fn waiter(&self) -> Waiter {
        Waiter {
            map: self.map.clone(),
        }
    }
}

fn word(map: &Mapping, at: usize) -> &AtomicU64 {
    // SAFETY: fixed, 8-aligned offsets inside the header of a live mapping.
    unsafe { &*(map.as_ptr().add(at) as *const AtomicU64) }
}

fn flag(map: &Mapping, at: usize) -> &AtomicU32 {
    // SAFETY: fixed, 4-aligned offsets inside the header of a live mapping.
    unsafe { &*(map.as_ptr().add(at) as *const AtomicU32) }
}

fn encode_cpu(cpu: Option<u32>) -> u32 {
    cpu.map_or(0, |c| c.saturating_add(1))
}

fn decode_cpu(f: &AtomicU32) -> Option<u32> {
    f.load(Ordering::Relaxed).checked_sub(1)
}

/// Yields a client's core while it waits for the NIC. Where the daemon is pinned and the
/// other cores hold every client of its process (all but one, if the client mostly waits),
/// it keeps off the NIC's core (`cores::keep_off`: a rank left there made every round trip
/// two context switches dearer, gni put 8 B 5.8 against 4.5 µs); one that stays announces
/// the yield (the CPU given away, in the control block), as the daemon then yields only to
/// clients that wait on its core.
pub struct Waiter {
    map: std::sync::Arc<Mapping>,
}

/// Where the daemon tells a client that a message for it is on its way, as it sends one
/// another client of its process asked for or a triggered operation fired (what
/// [`Waiter::keep_core`] goes by).
#[derive(Clone)]
pub struct Ear(std::sync::Arc<Mapping>);

impl Ear {
    /// A message for this client left.
    pub fn spoken_to(&self) {
        word(&self.0, SPOKEN_TO).fetch_add(1, Ordering::Relaxed);
    }
}

/// What [`Waiter::keep_core`] remembers of this thread's waits.
#[derive(Default)]
struct Keep {
    /// The control block it was about (another client's counts mean nothing here).
    block: usize,
    /// This client's command tail at the last look.
    tail: u64,
    /// The message count already dealt with: the one at its last speech, or the one a long
    /// spin was granted for (counts only grow, so the later of the two).
    answered: u64,
    /// Until when the long spin running may go on (a speech ends it).
    until: Option<std::time::Instant>,
    looks: u32,
}

thread_local! {
    static KEEP: std::cell::RefCell<Keep> = std::cell::RefCell::new(Keep::default());
}

/// The longest a waiter keeps its core (see [`Waiter::keep_core`]): well above a one-way
/// trip through the NIC (~3 µs here).
pub const KEEP_CORE_FOR: std::time::Duration = std::time::Duration::from_micros(20);

impl Waiter {
    /// For a wait past its first polls: whether to keep spinning instead of yielding.
    /// Ranks that share a core and wait on each other otherwise hand it back and forth, a
    /// context switch (~1 µs on these machines) each time, and a message for the one
    /// switched out waits for the other's next yield. The daemon counts, in the addressee's
    /// control block, every message (put, VELO or RMA message) that another client of its
    /// process sends it, or a triggered put fires for it: a client for which that count moved
    /// since it last spoke itself has a message on its way, and keeps the core — once per
    /// count, for [`KEEP_CORE_FOR`] at most. The sender yields and is not switched back in
    /// before its answer can be there. Nobody else keeps the core: not a waiter on the NIC's
    /// own core (it would hold up the daemon), not where clients outnumber the other cores
    /// two to one (a spin would hold up several).
    pub fn keep_core(&self) -> bool {
        let Some(nic) = decode_cpu(flag(&self.map, NIC_CPU)) else {
            return false;
        };
        let tail = self.atomic(CMD_TAIL).load(Ordering::Relaxed);
        let heard = self.atomic(SPOKEN_TO).load(Ordering::Relaxed);
        let block = self.map.as_ptr() as usize;
        KEEP.with_borrow_mut(|k| {
            if k.block != block {
                *k = Keep {
                    block,
                    tail,
                    answered: heard,
                    ..Keep::default()
                };
            }
            if k.tail != tail {
                // Spoke since the last look: messages counted so far came before.
                k.tail = tail;
                k.answered = heard;
                k.until = None;
            }
            if let Some(until) = k.until {
                k.looks = k.looks.wrapping_add(1);
                // The clock every 8th look: a read costs about as much as a poll.
                if !k.looks.is_multiple_of(8) || std::time::Instant::now() < until {
                    return true;
                }
                k.until = None;
                return false;
            }
            if heard == k.answered {
                return false;
            }
            let sharing = flag(&self.map, CLIENTS).load(Ordering::Relaxed) as usize;
            if sharing > 2 * super::cores::other_cpus(nic)
                || super::cores::current_cpu() == Some(nic)
            {
                return false;
            }
            k.answered = heard;
            k.until = Some(std::time::Instant::now() + KEEP_CORE_FOR);
            true
        })
    }

    fn atomic(&self, at: usize) -> &AtomicU64 {
        word(&self.map, at)
    }

    pub fn yield_now(&self) {
        let nic = decode_cpu(flag(&self.map, NIC_CPU));
        if let Some(n) = nic {
            let sharing = flag(&self.map, CLIENTS).load(Ordering::Relaxed);
            if super::cores::keep_off(n, sharing) == super::cores::Placed::Moved {
                // The move gave the core away.
                return;
            }
        }
        // Unpinned, nothing is announced: no write to the shared line on every yield.
        let cpu = nic.and_then(|_| super::cores::current_cpu());
        let w = flag(&self.map, WAITER_CPU);
        if cpu.is_some() {
            w.store(encode_cpu(cpu), Ordering::Relaxed);
        }
        std::thread::yield_now();
        if cpu.is_some() {
            w.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pair() -> (Control, Control) {
        let d = Control::create(4096, 4).unwrap();
        let fd = d.mapping().fd().try_clone_to_owned().unwrap();
        let c = Control::open(Mapping::from_fd(fd, 0, 1 << 20).unwrap()).unwrap();
        (d, c)
    }

    #[test]
    fn cores_are_seen_across_the_mapping() {
        let (d, c) = pair();
        assert_eq!(
            (c.nic_cpu(), d.waiter_cpu()),
            (None, None),
            "fresh: unknown"
        );
        // Unpinned: a yield announces nothing.
        c.waiter().yield_now();
        assert_eq!(d.waiter_cpu(), None);
        // A CPU this thread never runs on (from the NIC's own, a waiter moves away: below).
        d.set_nic_cpu(Some(1000));
        assert_eq!(c.nic_cpu(), Some(1000));
        // Pinned: the CPU is announced for the yield's duration only.
        let w = c.waiter();
        flag(&w.map, WAITER_CPU).store(encode_cpu(Some(7)), Ordering::Relaxed);
        assert_eq!(d.waiter_cpu(), Some(7));
        w.yield_now();
        assert_eq!(d.waiter_cpu(), None, "cleared when the yield returns");
        d.set_nic_cpu(Some(u32::MAX));
        assert_eq!(
            c.nic_cpu(),
            Some(u32::MAX - 1),
            "saturates, never wraps to unknown"
        );
    }

    #[test]
    fn a_waiter_keeps_its_core_once_per_message_on_its_way_until_it_speaks() {
        // In a thread of its own: what `keep_core` remembers is the thread's.
        std::thread::spawn(|| {
            let (d, c) = pair();
            let w = c.waiter();
            let ear = d.ear();
            assert!(!w.keep_core(), "unpinned NIC: never");
            // A CPU this thread never runs on; two clients, which the other CPUs hold.
            d.set_nic_cpu(Some(1000));
            d.set_clients(2);
            assert!(!w.keep_core(), "nothing on its way");
            ear.spoken_to();
            assert!(w.keep_core(), "a message on its way: keep the core");
            assert!(w.keep_core(), "for a while");
            // It speaks (a command): the next move is the other's.
            assert!(c.cmd_push(&Command::default(), &[]));
            assert!(!w.keep_core(), "the last speaker yields");
            ear.spoken_to();
            assert!(w.keep_core(), "answered: keep it again");
            let start = std::time::Instant::now();
            while w.keep_core() {
                assert!(
                    start.elapsed() < std::time::Duration::from_secs(1),
                    "a spin ends"
                );
            }
            assert!(start.elapsed() >= KEEP_CORE_FOR, "after KEEP_CORE_FOR");
            assert!(!w.keep_core(), "once per message");
            // More clients than twice the other CPUs: a spin would hold up several.
            d.set_clients(2 * crate::shm::cores::other_cpus(1000) as u32 + 1);
            ear.spoken_to();
            assert!(!w.keep_core(), "crowded: never");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_waiter_keeps_off_the_nics_core_while_the_other_cores_hold_every_client() {
        // In a thread of its own: the affinity it changes must not leak into other tests.
        std::thread::spawn(|| {
            use crate::shm::cores;
            let cpus = cores::allowed().unwrap();
            if cpus.len() < 2 {
                eprintln!("skipped: one CPU allowed, nowhere to move");
                return;
            }
            let (d, c) = pair();
            cores::start_placing();
            let nic = cores::pin(0).unwrap().expect("two CPUs");
            let onto_nic = || {
                cores::set_allowed(&[nic]).unwrap();
                cores::set_allowed(&cpus).unwrap();
            };
            onto_nic();
            d.set_nic_cpu(Some(nic));
            // More clients than the other cores hold: it stays (and announces its yields).
            d.set_clients(cpus.len() as u32);
            c.waiter().yield_now();
            assert!(cores::allowed().unwrap().contains(&nic), "stays");
            // Room for every client: it leaves, announcing nothing.
            d.set_clients(1);
            onto_nic();
            c.waiter().yield_now();
            assert_ne!(cores::current_cpu(), Some(nic), "moved off");
            assert!(!cores::allowed().unwrap().contains(&nic));
            assert_eq!(
                d.waiter_cpu(),
                None,
                "a waiter that moved announces nothing"
            );
            c.waiter().yield_now();
            assert!(!cores::allowed().unwrap().contains(&nic), "and keeps off");
            assert_eq!(cores::allowed_before_leaving().unwrap(), cpus);
            // More clients attached since: it may use every CPU it had again.
            d.set_clients(cpus.len() as u32);
            c.waiter().yield_now();
            assert_eq!(cores::allowed().unwrap(), cpus, "back");
            // A GASNet wait leaves for good: crowding does not bring it back.
            onto_nic();
            assert!(cores::off_core(nic));
            c.waiter().yield_now();
            assert!(
                !cores::allowed().unwrap().contains(&nic),
                "GASNet's move stays"
            );
        })
        .join()
        .unwrap();
    }

    /// The daemon's side of one command: whether nothing was queued behind it, the command,
    /// its inline bytes; its space published back.
    fn take_next(d: &Control, buf: &mut Vec<u8>) -> (bool, Command, Vec<u8>) {
        let len = d.cmd_peek(buf).unwrap().unwrap();
        let alone = d.cmd_alone(len);
        let (cmd, inline) = Command::decode(buf).unwrap();
        let inline = inline.to_vec();
        d.cmd_advance(len);
        d.cmd_publish();
        (alone, cmd, inline)
    }

    #[test]
    fn commands_wrap_and_keep_order() {
        let (d, c) = pair();
        let mut buf = Vec::new();
        for i in 0..500u64 {
            let data = vec![i as u8; (i % 300) as usize];
            let cmd = Command {
                client_req: i,
                len: data.len() as u64,
                ..Default::default()
            };
            assert!(c.cmd_push(&cmd, &data));
            let (alone, got, inline) = take_next(&d, &mut buf);
            assert!(alone, "nothing behind command {i}");
            assert_eq!(got, cmd);
            assert_eq!(inline, data);
        }
        assert_eq!(d.cmd_peek(&mut buf), Ok(None));
    }

    #[test]
    fn velo_sends_take_one_line_and_read_back_whole_between_full_records() {
        let (d, c) = pair();
        let mut buf = Vec::new();
        for i in 0..400u64 {
            // Full records of odd lengths move the short ones to every offset in a line.
            let full = Command {
                client_req: i,
                len: (i % 5) * 8 + 3,
                ..Default::default()
            };
            let fdata = vec![0xa5; full.len as usize];
            let velo = Command {
                kind: CommandKind::VeloSend,
                host: (i % 3) as u16,
                rank: 70_000 + i as u32,
                client_req: 1 << 61 | i << 32 | i,
                operand: i % 256,
                flags: (i % 2) as u8,
                len: i % 121,
                ..Default::default()
            };
            let vdata: Vec<u8> = (0..velo.len).map(|b| (b ^ i) as u8).collect();
            assert!(c.cmd_push(&full, &fdata));
            let before = c.cmd_tail.get();
            assert!(c.cmd_push(&velo, &vdata));
            let rec = (VELO_REC_HEAD as u64 + velo.len).next_multiple_of(8);
            let first = c.cmd_tail.get() - rec;
            assert!(
                first - before < LINE.max(rec),
                "padded at most a line's rest or the ring's end"
            );
            if rec <= LINE {
                assert_eq!(
                    first / LINE,
                    (first + rec - 1) / LINE,
                    "{rec} bytes in one line"
                );
            }
            for (want, data) in [(full, &fdata), (velo, &vdata)] {
                let (_, got, inline) = take_next(&d, &mut buf);
                assert_eq!((got, &inline), (want, data));
            }
        }
        assert_eq!(d.cmd_peek(&mut buf), Ok(None));
    }

    #[test]
    fn a_short_velo_record_that_lies_about_its_length_is_refused() {
        let (d, c) = pair();
        let velo = Command {
            kind: CommandKind::VeloSend,
            len: 8,
            ..Default::default()
        };
        assert!(c.cmd_push(&velo, &[1; 8]));
        // The message's length says 40 bytes in a 32-byte record.
        let tag = REC_VELO | 40 << 16;
        unsafe { std::ptr::copy_nonoverlapping(tag.to_le_bytes().as_ptr(), c.ring().add(4), 4) };
        assert_eq!(
            d.cmd_peek(&mut Vec::new()),
            Err(ControlError::BadRecord(32))
        );
        // A full record's tag with a length in it is no record either.
        let tag = REC_CMD | 1 << 16;
        unsafe { std::ptr::copy_nonoverlapping(tag.to_le_bytes().as_ptr(), c.ring().add(4), 4) };
        assert_eq!(
            d.cmd_peek(&mut Vec::new()),
            Err(ControlError::BadRecord(32))
        );
    }

    #[test]
    fn only_local_portals_calls_behind_a_command_count_as_nothing() {
        use crate::shm::ptl_call::{MeArgs, PtlCall};
        let (d, c) = pair();
        let portals = |call: PtlCall| {
            let mut b = Vec::new();
            call.encode_into(&mut b);
            let cmd = Command {
                kind: CommandKind::Portals,
                len: b.len() as u64,
                ..Default::default()
            };
            assert!(c.cmd_push(&cmd, &b));
        };
        let mut buf = Vec::new();
        let mut next = |d: &Control| {
            let len = d.cmd_peek(&mut buf).unwrap().unwrap();
            let local = d.cmd_next_stays_local(len);
            d.cmd_advance(len);
            local
        };
        c.cmd_push(&Command::default(), &[]);
        portals(PtlCall::Append {
            ni: 0,
            pt: 0,
            overflow: false,
            user_ptr: 0,
            me: MeArgs::default(),
        });
        portals(PtlCall::CtInc {
            ni: 0,
            ct: 0,
            success: 1,
            failure: 0,
        });
        c.cmd_push(&Command::default(), &[]);
        portals(PtlCall::MdRelease { ni: 0, md: 0 });
        assert!(next(&d), "a put, then a receive posted");
        assert!(
            !next(&d),
            "the receive, then a count that may fire triggered ops"
        );
        assert!(!next(&d), "the count, then a put");
        assert!(next(&d), "the put, then a release");
        assert!(!next(&d), "nothing behind the release");
    }

    #[test]
    fn consumed_space_returns_only_when_published() {
        let (d, c) = pair();
        let mut n = 0;
        while c.cmd_push(&Command::default(), &[]) {
            n += 1;
        }
        let mut buf = Vec::new();
        let len = d.cmd_peek(&mut buf).unwrap().unwrap();
        assert!(!d.cmd_alone(len), "a full ring behind it");
        d.cmd_advance(len);
        assert!(
            !c.cmd_push(&Command::default(), &[]),
            "unpublished space is not free"
        );
        d.cmd_publish();
        assert!(c.cmd_push(&Command::default(), &[]));
        // Draining an eighth of the ring publishes without being asked.
        for _ in 0..n / 8 + 1 {
            let len = d.cmd_peek(&mut buf).unwrap().unwrap();
            d.cmd_advance(len);
        }
        assert!(c.cmd_push(&Command::default(), &[]));
    }

    #[test]
    fn half_free_is_seen_alike_on_both_sides() {
        let (d, c) = pair();
        while c.cmd_push(&Command::default(), &[]) {}
        assert!(!c.cmd_half_free() && !d.cmd_backlog_below_half());
        let mut buf = Vec::new();
        // 51 records of 80 bytes: 25 left (2,000 of 4,096 bytes) is the first half-free ring.
        for left in (25..51).rev() {
            let len = d.cmd_peek(&mut buf).unwrap().unwrap();
            d.cmd_advance(len);
            d.cmd_publish();
            assert_eq!(d.cmd_backlog_below_half(), left <= 25, "{left} left");
            assert_eq!(c.cmd_half_free(), left <= 25, "{left} left");
        }
    }

    #[test]
    fn full_ring_and_cq_refuse() {
        let (d, c) = pair();
        let mut n = 0;
        while c.cmd_push(&Command::default(), &[]) {
            n += 1;
        }
        assert_eq!(n, 4096 / 80);
        for i in 0..4 {
            assert_eq!(
                d.cq_push(&CqEntry {
                    client_req: i,
                    status: 0,
                    value: i * 2
                }),
                Ok(true)
            );
        }
        assert_eq!(d.cq_push(&CqEntry::default()), Ok(false));
        assert_eq!(c.cq_pop().unwrap().value, 0);
        assert_eq!(d.cq_push(&CqEntry::default()), Ok(true));
    }

    #[test]
    fn corrupted_indices_are_errors() {
        let (d, c) = pair();
        c.atomic(CMD_TAIL).store(1 << 40, Ordering::SeqCst);
        assert_eq!(d.cmd_peek(&mut Vec::new()), Err(ControlError::BadIndex));
        c.atomic(CQ_HEAD).store(1 << 40, Ordering::SeqCst);
        assert_eq!(d.cq_push(&CqEntry::default()), Err(ControlError::BadIndex));
    }

    proptest! {
        #[test]
        fn garbage_ring_never_panics(bytes in proptest::collection::vec(any::<u8>(), 4096), tail in 0u64..8192) {
            let (d, c) = pair();
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), c.ring(), 4096) };
            c.atomic(CMD_TAIL).store(tail, Ordering::SeqCst);
            let mut buf = Vec::new();
            for _ in 0..100 {
                match d.cmd_peek(&mut buf) {
                    Ok(Some(len)) => { let _ = (Command::decode(&buf), d.cmd_next_stays_local(len)); d.cmd_advance(len); }
                    _ => break,
                }
            }
        }
    }
}
