//! Dynamic windows (MPI_Win_create_dynamic), by the seed's fallback for a Portals without
//! address-space-wide entries: one match entry per attached segment. Origins address a
//! dynamic window by the target's addresses, so each member publishes its segments in a table
//! in its control words (base, length, generation per slot; generation 0: free); an origin
//! reads a peer's table when an address is in none of the segments it knows, and names a
//! segment by slot and generation in the match bits. A segment detached (and its slot reused)
//! after an origin read the table is not matched by the stale bits: the operation fails with
//! MPI_ERR_RMA_RANGE instead of touching the wrong memory.

use std::sync::atomic::Ordering;

use crate::portals::Target;

use super::super::error::{err, ErrorClass, MpiError};
use super::super::mem::AllocMem;
use super::{expose, Memory, Win, TABLE};

/// Segments one member may have attached at once.
pub(super) const MAX_SEGMENTS: usize = 64;
const ENTRY: usize = 24;
pub(super) const TABLE_LEN: usize = MAX_SEGMENTS * ENTRY;

/// This member's attached segments.
#[derive(Default)]
pub(super) struct Attached {
    slots: Vec<Option<(AllocMem, u32)>>,
    generation: u64,
}

impl Attached {
    /// The match entries of every attached segment (the window is going).
    pub(super) fn take_entries(&mut self) -> Vec<u32> {
        self.slots.drain(..).flatten().map(|(_, h)| h).collect()
    }
}

/// A peer's segment as its table said.
#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    base: u64,
    len: u64,
    slot: u32,
    generation: u64,
}

/// A segment's match bits: bit 63 (never a static window's), the window id, slot and the
/// generation's low 24 bits.
fn bits(id: u64, slot: u32, generation: u64) -> u64 {
    1 << 63 | id << 32 | (slot as u64) << 24 | (generation & 0xff_ffff)
}

impl Win {
    /// MPI_Win_attach: exposes `mem` through this dynamic window (local; peers see it at
    /// their next access to an address in it).
    pub fn attach(&mut self, mem: &AllocMem) -> Result<(), MpiError> {
        if self.freed {
            return err(ErrorClass::Win, "the window was freed");
        }
        let id = self.id();
        let Memory::Dynamic(a) = &mut self.memory else {
            return err(ErrorClass::Win, "attach needs a dynamic window");
        };
        let (base, len) = (mem.address(), mem.len() as u64);
        if a.slots.iter().flatten().any(|(m, _)| {
            let b = m.address();
            base < b + m.len() as u64 && b < base + len
        }) {
            return err(
                ErrorClass::Arg,
                "the memory overlaps a segment already attached",
            );
        }
        let slot = match a.slots.iter().position(Option::is_none) {
            Some(s) => s,
            None if a.slots.len() < MAX_SEGMENTS => {
                a.slots.push(None);
                a.slots.len() - 1
            }
            None => {
                return err(
                    ErrorClass::Other,
                    format!("at most {MAX_SEGMENTS} segments attached to one window"),
                )
            }
        };
        a.generation += 1;
        let g = a.generation;
        let h = {
            let mut st = self.comm.st.borrow_mut();
            expose(
                &mut st,
                mem.region().handle,
                mem.len(),
                bits(id, slot as u32, g),
                None,
            )?
        };
        let Memory::Dynamic(a) = &mut self.memory else {
            unreachable!("checked above")
        };
        a.slots[slot] = Some((mem.clone(), h));
        // The entry exists before the table names it; the generation goes last.
        let at = TABLE as usize + slot * ENTRY;
        self.ctrl.word(at).store(base, Ordering::Relaxed);
        self.ctrl.word(at + 8).store(len, Ordering::Relaxed);
        self.ctrl.word(at + 16).store(g, Ordering::Release);
        Ok(())
    }

    /// MPI_Win_detach: `mem` is no longer exposed (operations still aimed at it fail).
    pub fn detach(&mut self, mem: &AllocMem) -> Result<(), MpiError> {
        let Memory::Dynamic(a) = &mut self.memory else {
            return err(ErrorClass::Win, "detach needs a dynamic window");
        };
        let Some(slot) = a
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|(m, _)| AllocMem::same(m, mem)))
        else {
            return err(ErrorClass::Arg, "the memory is not attached to this window");
        };
        let (_, h) = a.slots[slot].take().expect("found");
        self.ctrl
            .word(TABLE as usize + slot * ENTRY + 16)
            .store(0, Ordering::Release);
        let mut st = self.comm.st.borrow_mut();
        let ni = st.ni;
        st.p.me_unlink(ni, h)?;
        Ok(())
    }

    /// The target of `len` bytes at address `addr` in `rank`'s dynamic window.
    pub(super) fn resolve(&mut self, rank: u32, addr: u64, len: u64) -> Result<Target, MpiError> {
        let find = |segs: &[Segment]| {
            segs.iter()
                .find(|s| {
                    addr >= s.base && addr.checked_add(len).is_some_and(|e| e <= s.base + s.len)
                })
                .copied()
        };
        let seg = match find(&self.segments[rank as usize]) {
            Some(s) => s,
            None => {
                self.read_table(rank)?;
                find(&self.segments[rank as usize]).ok_or_else(|| {
                    MpiError::new(
                        ErrorClass::RmaRange,
                        format!("[{addr:#x}, +{len}) is in no segment attached at rank {rank}"),
                    )
                })?
            }
        };
        Ok(self.target(
            rank,
            bits(self.id(), seg.slot, seg.generation),
            addr - seg.base,
        ))
    }

    /// Reads `rank`'s segment table (a get from its control words; this rank's own directly).
    fn read_table(&mut self, rank: u32) -> Result<(), MpiError> {
        let mut table = vec![0u8; TABLE_LEN];
        if rank == self.comm.rank() {
            for (i, w) in table.chunks_mut(8).enumerate() {
                w.copy_from_slice(
                    &self
                        .ctrl
                        .word(TABLE as usize + i * 8)
                        .load(Ordering::Acquire)
                        .to_le_bytes(),
                );
            }
        } else {
            let at = self.stage(TABLE_LEN)?;
            let t = self.ctrl_target(rank, TABLE);
            let md = self.md;
            self.with_st(|st| {
                st.p.get(st.ni, md, at, TABLE_LEN as u64, t, 0)?;
                Ok(())
            })?;
            self.issued += 1;
            self.flush_all_inner()?;
            table.copy_from_slice(&self.staging.bytes()[at as usize..at as usize + TABLE_LEN]);
        }
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        self.segments[rank as usize] = table
            .chunks(ENTRY)
            .enumerate()
            .filter_map(|(slot, e)| {
                let generation = word(&e[16..24]);
                (generation != 0).then(|| Segment {
                    base: word(&e[..8]),
                    len: word(&e[8..16]),
                    slot: slot as u32,
                    generation,
                })
            })
            .collect();
        Ok(())
    }
}
