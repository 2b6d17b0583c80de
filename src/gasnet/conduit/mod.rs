//! Conduits: how Active Messages move between nodes. The GASNet layer above is the same for
//! all of them; a conduit only sends encoded AMs and delivers arrived ones in order.

pub mod portals;
pub mod udp;

use super::GasnetError;

pub trait Conduit {
    fn node(&self) -> u32;
    fn nodes(&self) -> u32;
    /// Largest encoded AM one send takes.
    fn max_am(&self) -> usize;
    /// Sends an encoded AM to `dest` (itself included), making progress while it waits for room.
    fn send(&mut self, dest: u32, am: &[u8]) -> Result<(), GasnetError>;
    /// Makes progress; hands each arrived AM to `deliver` in arrival order. Returns whether
    /// anything happened.
    fn poll(&mut self, deliver: &mut dyn FnMut(u32, &[u8])) -> Result<bool, GasnetError>;
    /// The conduit's name (`udp`, `portals`, …).
    fn name(&self) -> &'static str;
}
