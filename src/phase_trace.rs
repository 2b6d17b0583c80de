//! Where one message's time goes: stamps at the phases of its trip (a rank posts it, the NIC
//! takes the command, sends, the receiving host opens the datagram, the engine writes the
//! mailbox or mirrors the events, a rank sees it), for `netbench phases` to put together.
//!
//! A developer's tool, compiled only with the `phase-trace` feature: without it [`stamp`] is
//! empty and costs nothing. With it, a process stamps only when `SOFTNIC_PHASE_TRACE` names
//! a directory; it keeps [`CAPACITY`] stamps (CLOCK_MONOTONIC, comparable across processes)
//! after skipping its first `SOFTNIC_PHASE_SKIP_MS` milliseconds (warm-up), and writes them
//! to `<dir>/<pid>.phases` once full — so a traced run must outlast the buffer.

/// The points a message passes. Codes are stable: they are what the files hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Phase {
    /// A rank is about to post the message (the benchmark's clock starts).
    RankPost = 1,
    /// A rank sees the message: its flag, mailbox slot or AM handler.
    RankArrived = 2,
    /// The NIC took a command from a rank's ring.
    CommandTaken = 10,
    /// The driver hands frames to the kernel…
    SendStart = 11,
    /// …and the kernel returned (on loopback it delivered them meanwhile).
    SendEnd = 12,
    /// A datagram reached its host core.
    DatagramIn = 13,
    /// It was authenticated and opened.
    DatagramOpened = 14,
    /// The engines are done with its operations (data written, replies queued).
    DatagramDone = 15,
    /// A VELO message was written into its mailbox.
    VeloWritten = 16,
    /// Portals events or counts were mirrored into a process's rings.
    EventsMirrored = 17,
    /// The engines are done with a command (what it sends is queued, not yet sealed).
    CommandDone = 18,
}

impl Phase {
    pub const ALL: [Phase; 11] = [
        Phase::RankPost,
        Phase::RankArrived,
        Phase::CommandTaken,
        Phase::SendStart,
        Phase::SendEnd,
        Phase::DatagramIn,
        Phase::DatagramOpened,
        Phase::DatagramDone,
        Phase::VeloWritten,
        Phase::EventsMirrored,
        Phase::CommandDone,
    ];

    pub fn from_code(code: u8) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| *p as u8 == code)
    }

    /// Stamped by a rank (else by a daemon).
    pub fn by_rank(self) -> bool {
        matches!(self, Phase::RankPost | Phase::RankArrived)
    }
}

/// Stamps a process keeps before it writes them out.
pub const CAPACITY: usize = 100_000;

/// Records that the calling thread reached `phase` now.
#[inline]
pub fn stamp(phase: Phase) {
    #[cfg(feature = "phase-trace")]
    on::stamp(phase);
    #[cfg(not(feature = "phase-trace"))]
    let _ = phase;
}

#[cfg(feature = "phase-trace")]
mod on {
    use super::{Phase, CAPACITY};
    use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
    use std::sync::OnceLock;

    /// Where to write and from when to keep stamps (ns), if tracing.
    struct Setup {
        dir: std::path::PathBuf,
        skip_ns: u64,
        first: OnceLock<u64>,
    }

    static SETUP: OnceLock<Option<Setup>> = OnceLock::new();
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    /// Each stamp's time (ns) and its cpu << 8 | phase code.
    static TIMES: [AtomicU64; CAPACITY] = [const { AtomicU64::new(0) }; CAPACITY];
    static TAGS: [AtomicU16; CAPACITY] = [const { AtomicU16::new(0) }; CAPACITY];

    fn now_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid timespec to write; CLOCK_MONOTONIC always exists.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    pub(super) fn stamp(phase: Phase) {
        let Some(s) = SETUP
            .get_or_init(|| {
                let dir = std::env::var_os("SOFTNIC_PHASE_TRACE")?;
                let skip_ms = std::env::var("SOFTNIC_PHASE_SKIP_MS")
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                Some(Setup {
                    dir: dir.into(),
                    skip_ns: skip_ms * 1_000_000,
                    first: OnceLock::new(),
                })
            })
            .as_ref()
        else {
            return;
        };
        let t = now_ns();
        if t < *s.first.get_or_init(|| t) + s.skip_ns {
            return;
        }
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        if i >= CAPACITY {
            return;
        }
        let cpu = crate::shm::cores::current_cpu().unwrap_or(255).min(255) as u16;
        TIMES[i].store(t, Ordering::Relaxed);
        TAGS[i].store(cpu << 8 | phase as u16, Ordering::Relaxed);
        if i == CAPACITY - 1 {
            write(&s.dir);
        }
    }

    /// Writes every stamp as a line "ns cpu code"; a failure is only reported. A slot another
    /// thread took but has not filled yet (its tag still 0: no phase has code 0) is left out.
    fn write(dir: &std::path::Path) {
        let mut text = String::with_capacity(CAPACITY * 24);
        for (t, tag) in TIMES.iter().zip(&TAGS) {
            let (t, tag) = (t.load(Ordering::Relaxed), tag.load(Ordering::Relaxed));
            if tag == 0 {
                continue;
            }
            text.push_str(&format!("{t} {} {}\n", tag >> 8, tag & 0xff));
        }
        let path = dir.join(format!("{}.phases", std::process::id()));
        if let Err(e) = std::fs::write(&path, text) {
            tracing::warn!("phase trace not written to {}: {e}", path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_phase_reads_back_from_its_code_and_no_two_share_one() {
        let mut codes: Vec<u8> = Phase::ALL.iter().map(|&p| p as u8).collect();
        for p in Phase::ALL {
            assert_eq!(Phase::from_code(p as u8), Some(p));
        }
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), Phase::ALL.len());
        assert_eq!(Phase::from_code(0), None);
        assert!(Phase::RankPost.by_rank() && !Phase::SendEnd.by_rank());
    }
}
