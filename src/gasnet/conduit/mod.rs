//! Conduits: how Active Messages (and, where the network can, puts and gets) move between
//! nodes. The GASNet layer above is the same for all of them.

pub mod portals;
pub mod udp;

use super::{AdOp, GasnetError};

/// Where the data of a direct get goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetDest {
    /// This node's segment, at an offset.
    Segment(u64),
    /// A buffer of the caller: the data comes back in [`RmaDone::data`].
    Buffer,
}

/// A direct put or get that finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RmaDone {
    pub op: u64,
    pub ok: bool,
    pub data: Vec<u8>,
}

pub trait Conduit {
    fn node(&self) -> u32;
    fn nodes(&self) -> u32;
    /// Largest encoded AM one send takes.
    fn max_am(&self) -> usize;
    /// This node's segment (memory the network can reach, where the conduit needs that).
    fn segment(&mut self) -> &mut [u8];
    /// Sends an encoded AM to `dest` (itself included), making progress while it waits for room.
    fn send(&mut self, dest: u32, am: &[u8]) -> Result<(), GasnetError>;
    /// Largest Long payload (AMMaxLongRequest/Reply): by default what one AM carries.
    fn max_long(&self) -> usize {
        self.max_am()
            .saturating_sub(super::am::encoded_len(super::am::MAX_ARGS, 0))
    }
    /// Sends a Long: its encoded header (no payload) and the payload for `dest`'s segment. By
    /// default the payload rides in the AM behind the header (packed); a conduit with RDMA may
    /// put it in place first.
    fn send_long(
        &mut self,
        dest: u32,
        mut header: Vec<u8>,
        payload: &[u8],
    ) -> Result<(), GasnetError> {
        header.extend_from_slice(payload);
        self.send(dest, &header)
    }
    /// Makes progress; hands each arrived AM to `deliver` in arrival order and each finished
    /// direct operation to `done`. Returns whether anything happened.
    fn poll(
        &mut self,
        deliver: &mut dyn FnMut(u32, &[u8]),
        done: &mut dyn FnMut(RmaDone),
    ) -> Result<bool, GasnetError>;
    /// The conduit's name (`udp`, `portals`, …).
    fn name(&self) -> &'static str;
    /// Blocks until something may have arrived for [`Conduit::poll`], or `max` passed, or the
    /// conduit has timers due. Returns at once when news is already there.
    fn wait_news(&mut self, max: std::time::Duration) -> Result<(), GasnetError>;
    /// A put straight through the network (completion later as `RmaDone { op }`); `Ok(false)`
    /// when the conduit has none, and the Extended layer uses Active Messages instead.
    fn rma_put(
        &mut self,
        _node: u32,
        _dest_offset: u64,
        _src: &[u8],
        _op: u64,
    ) -> Result<bool, GasnetError> {
        Ok(false)
    }
    /// A get straight through the network; `Ok(false)` as for [`Conduit::rma_put`].
    fn rma_get(
        &mut self,
        _node: u32,
        _src_offset: u64,
        _len: usize,
        _dest: GetDest,
        _op: u64,
    ) -> Result<bool, GasnetError> {
        Ok(false)
    }
    /// A 64-bit atomic on the word at `offset` of `node`'s segment, run by the network without
    /// the target process (completion as `RmaDone { op }`, whose `data` holds the prior value
    /// for fetching operations); `Ok(false)` when the conduit has none, and the Extended layer
    /// runs it in an Active Message handler at the target instead.
    fn rma_atomic(
        &mut self,
        _node: u32,
        _offset: u64,
        _atomic: AdOp,
        _operands: [u64; 2],
        _op: u64,
    ) -> Result<bool, GasnetError> {
        Ok(false)
    }
}
