//! Direct operations of the portals conduit: Extended puts, gets and remote atomics as Portals
//! put, get and (fetching) atomics on RAR, completed from their ACK and REPLY events on
//! SAFE_EQ; local buffers outside the segment go through the bounce region.

use super::{err, PortalsConduit, Rma, BOUNCE_LEN, CHUNK, MAX_RMA, RMA_TAG};
use crate::gasnet::atomic::PortalsCall;
use crate::gasnet::conduit::{GetDest, RmaDone};
use crate::gasnet::{AdOp, GasnetError};
use crate::portals::{AckReq, EventKind, NiFail};

impl PortalsConduit {
    /// Starts tracking a direct operation of `pieces` pieces (`data`: a get's destination).
    fn begin_rma(&mut self, op: u64, pieces: usize, data: Option<Vec<u8>>) {
        self.rma.insert(
            op,
            Rma {
                remaining: pieces,
                ok: true,
                data,
                pieces: vec![None; pieces],
            },
        );
    }

    /// A direct piece finished (ACK of a put, REPLY of a get).
    pub(super) fn rma_event(&mut self, user_ptr: u64, kind: EventKind, fail: NiFail) {
        if kind != EventKind::Ack && kind != EventKind::Reply {
            return;
        }
        let (op, piece) = ((user_ptr & !RMA_TAG) >> 16, (user_ptr & 0xffff) as usize);
        let Some(r) = self.rma.get_mut(&op) else {
            return;
        };
        self.rma_in_flight -= 1;
        r.ok &= fail == NiFail::Ok;
        if let Some(Some(b)) = r.pieces.get(piece).copied() {
            if let Some(data) = r.data.as_mut() {
                let at = piece * CHUNK;
                let n = (data.len() - at).min(CHUNK);
                data[at..at + n].copy_from_slice(&self.bounce.bytes()[b as usize..b as usize + n]);
            }
            self.ring.free(b);
        }
        r.remaining -= 1;
        if r.remaining == 0 {
            let r = self.rma.remove(&op).expect("present");
            self.finished.push(RmaDone {
                op,
                ok: r.ok,
                data: r.data.unwrap_or_default(),
            });
        }
    }

    /// `len` bytes of bounce space (at most a piece), waiting for the oldest pieces to finish
    /// when it is short.
    pub(super) fn bounce_alloc(&mut self, len: usize) -> Result<u64, GasnetError> {
        debug_assert!(len <= CHUNK && CHUNK <= BOUNCE_LEN);
        loop {
            if let Some(at) = self.ring.alloc(len) {
                return Ok(at);
            }
            self.wait_step()?;
        }
    }

    /// Bounce space for piece `piece` of direct operation `op`, released when it completes.
    fn bounce_piece(&mut self, op: u64, piece: usize, len: usize) -> Result<u64, GasnetError> {
        let b = self.bounce_alloc(len)?;
        if let Some(r) = self.rma.get_mut(&op) {
            r.pieces[piece] = Some(b);
        }
        Ok(b)
    }

    /// Waits for room for one more direct piece.
    fn rma_slot(&mut self) -> Result<(), GasnetError> {
        while self.rma_in_flight >= MAX_RMA {
            self.wait_step()?;
        }
        self.rma_in_flight += 1;
        Ok(())
    }

    pub(super) fn direct_put(
        &mut self,
        node: u32,
        dest_offset: u64,
        src: &[u8],
        op: u64,
    ) -> Result<(), GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let pieces = src.len().div_ceil(CHUNK).max(1);
        // A source inside the segment goes from there; any other from the bounce region.
        let base = self.seg.as_ptr() as usize;
        let in_seg = (src.as_ptr() as usize) >= base
            && (src.as_ptr() as usize) + src.len() <= base + self.seg.len();
        self.begin_rma(op, pieces, None);
        for i in 0..pieces {
            let part = &src[(i * CHUNK).min(src.len())..((i + 1) * CHUNK).min(src.len())];
            self.rma_slot()?;
            let (md, off) = if in_seg {
                (self.seg_md, (part.as_ptr() as usize - base) as u64)
            } else {
                let b = self.bounce_piece(op, i, part.len())?;
                self.bounce.bytes()[b as usize..b as usize + part.len()].copy_from_slice(part);
                (self.bounce_md, b)
            };
            let t = self.rar(node, dest_offset + (i * CHUNK) as u64);
            self.p
                .put(
                    self.ni,
                    md,
                    off,
                    part.len() as u64,
                    AckReq::Ack,
                    t,
                    RMA_TAG | (op << 16) | i as u64,
                    0,
                )
                .map_err(err)?;
        }
        Ok(())
    }

    pub(super) fn direct_get(
        &mut self,
        node: u32,
        src_offset: u64,
        len: usize,
        dest: GetDest,
        op: u64,
    ) -> Result<(), GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let pieces = len.div_ceil(CHUNK).max(1);
        let data = matches!(dest, GetDest::Buffer).then(|| vec![0u8; len]);
        self.begin_rma(op, pieces, data);
        for i in 0..pieces {
            let n = (len - (i * CHUNK).min(len)).min(CHUNK);
            self.rma_slot()?;
            let (md, off) = match dest {
                GetDest::Segment(base) => (self.seg_md, base + (i * CHUNK) as u64),
                GetDest::Buffer => (self.bounce_md, self.bounce_piece(op, i, n)?),
            };
            let t = self.rar(node, src_offset + (i * CHUNK) as u64);
            self.p
                .get(
                    self.ni,
                    md,
                    off,
                    n as u64,
                    t,
                    RMA_TAG | (op << 16) | i as u64,
                )
                .map_err(err)?;
        }
        Ok(())
    }

    pub(super) fn direct_atomic(
        &mut self,
        node: u32,
        offset: u64,
        atomic: AdOp,
        [a, b]: [u64; 2],
        op: u64,
    ) -> Result<(), GasnetError> {
        if node >= self.n {
            return Err(GasnetError::BadNode(node));
        }
        let p = atomic.portals(a, b);
        let fetch = p.call != PortalsCall::Atomic;
        self.begin_rma(op, 1, fetch.then(|| vec![0; 8]));
        self.rma_slot()?;
        // Bounce bytes [prior value | operand]: the NIC reads the operand and writes the prior
        // value back, which completion copies out.
        let at = self.bounce_piece(op, 0, 16)?;
        self.bounce.bytes()[at as usize + 8..at as usize + 16]
            .copy_from_slice(&p.operand.to_le_bytes());
        let (t, up, md) = (self.rar(node, offset), RMA_TAG | (op << 16), self.bounce_md);
        match p.call {
            PortalsCall::Atomic => {
                self.p
                    .atomic(self.ni, md, at + 8, 8, AckReq::Ack, t, up, 0, p.op, p.dt)
            }
            PortalsCall::Fetch => {
                self.p
                    .fetch_atomic(self.ni, md, at, md, at + 8, 8, t, up, 0, p.op, p.dt)
            }
            PortalsCall::Swap { compare } => self.p.swap(
                self.ni,
                md,
                at,
                md,
                at + 8,
                8,
                t,
                up,
                0,
                &compare.to_le_bytes(),
                p.op,
                p.dt,
            ),
        }
        .map_err(err)?;
        Ok(())
    }
}
