//! PE-strided operations (DMAPP `put_ixpe`, `scatter_ixpe`, `gather_ixpe`, seed 001 §2.2.3)
//! fanned out by the initiator's NIC: one command names a list of (rank, host) targets and
//! one completion answers for all of them, with the first failure among them.
//!
//! Each target gets an ordinary put (its fragments) or get, tracked by the initiator like any
//! other but completing into a group; what finds no room in the transport waits in the
//! peer's queue behind the process's earlier requests, so nothing is refused half-way.

use crate::nic::gemini::{Completion, Pending, PendingKind};
use crate::shm::{Command, CommandKind};
use crate::wire::{get_u32, OpHeader, OpKind, OpRef, Status};

use super::gemini::put_fragments;
use super::{Flow, HostCore};

/// Request ids of a group's members carry this bit (the rest is the group id).
pub(super) const GROUP_BIT: u64 = 1 << 62;
/// Bytes of one target entry: rank u32, host u16, padding.
pub const IXPE_ENTRY: usize = 8;

/// What an ixpe command does with its targets (`Command::operand`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IxpeMode {
    /// The same `per` bytes to every target.
    Put = 0,
    /// Target i gets bytes `i·per..(i+1)·per` of the data.
    Scatter = 1,
    /// `per` bytes from every target, target i's at `local_off + i·per`.
    Gather = 2,
}

impl IxpeMode {
    pub fn from_u64(v: u64) -> Option<IxpeMode> {
        match v {
            0 => Some(IxpeMode::Put),
            1 => Some(IxpeMode::Scatter),
            2 => Some(IxpeMode::Gather),
            _ => None,
        }
    }
}

/// One command's fan-out: who asked, members not yet complete, the first failure.
pub(super) struct Group {
    session: u64,
    client_req: u64,
    left: u32,
    status: Status,
    value: u64,
}

impl Group {
    pub(super) fn session(&self) -> u64 {
        self.session
    }
}

impl HostCore {
    /// Serves an ixpe command: checks it whole, then starts one operation per target.
    pub(super) fn ixpe_command(
        &mut self,
        now: u64,
        session: u64,
        job: u32,
        rank: u32,
        c: &Command,
        inline: &[u8],
    ) -> Flow {
        let n = c.nelems as usize;
        let per = c.operand2 as usize;
        let mode = IxpeMode::from_u64(c.operand);
        let list = n.checked_mul(IXPE_ENTRY);
        let data_len = match mode {
            Some(IxpeMode::Put) => Some(per),
            Some(IxpeMode::Scatter) => n.checked_mul(per),
            Some(IxpeMode::Gather) => Some(0),
            None => None,
        };
        let well_formed = matches!((list, data_len), (Some(l), Some(d))
            if n > 0 && l.checked_add(d) == Some(inline.len()));
        let local = match mode {
            Some(IxpeMode::Gather) if well_formed => self
                .endpoints
                .region(job, rank, c.local_region)
                .and_then(|r| {
                    let all = (n * per) as u64;
                    r.check_local(c.local_off, all).map(|_| r.clone())
                })
                .map(Some),
            _ => Ok(None),
        };
        let (mode, local) = match (mode, well_formed, local) {
            (Some(m), true, Ok(l)) => (m, l),
            (_, _, Err(status)) => {
                self.complete(session, c.client_req, status, 0);
                return Flow::Done;
            }
            _ => {
                self.complete(session, c.client_req, Status::BadRequest, 0);
                return Flow::Done;
            }
        };
        let (list, data) = inline.split_at(n * IXPE_ENTRY);
        self.next_group += 1;
        let gid = self.next_group & (GROUP_BIT - 1);
        self.groups.insert(
            gid,
            Group {
                session,
                client_req: c.client_req,
                left: n as u32,
                status: Status::Ok,
                value: 0,
            },
        );
        let marker = GROUP_BIT | gid;
        for (i, e) in list.chunks_exact(IXPE_ENTRY).enumerate() {
            let (dst_rank, host) = (get_u32(e, 0), u16::from_le_bytes([e[4], e[5]]));
            let bytes = match mode {
                IxpeMode::Put => data,
                IxpeMode::Scatter => &data[i * per..(i + 1) * per],
                IxpeMode::Gather => &[][..],
            };
            let member = |status| Completion {
                session,
                client_req: marker,
                status,
                value: 0,
            };
            let h = OpHeader {
                job,
                src_rank: rank,
                dst_rank,
                req: 0,
            };
            let local_off = c.local_off + (i * per) as u64;
            if host >= self.nhosts {
                self.completions.push(member(Status::BadRequest));
                continue;
            }
            if host == self.index {
                let sub = Command {
                    kind: match mode {
                        IxpeMode::Gather => CommandKind::Get,
                        _ => CommandKind::PutInline,
                    },
                    host,
                    rank: dst_rank,
                    remote_region: c.remote_region,
                    remote_off: c.remote_off,
                    len: per as u64,
                    local_region: c.local_region,
                    local_off,
                    ..Default::default()
                };
                self.stats.local_ops += 1;
                let (status, _) = self.local(h, &sub, bytes);
                self.completions.push(member(status));
                continue;
            }
            if let Err(e) = self.transport.can_push(host) {
                if !matches!(e, crate::transport::PushError::Full(_)) {
                    self.completions.push(Completion {
                        value: super::gemini::lost(host),
                        ..member(Status::PeerDead)
                    });
                    continue;
                }
            }
            let kind = match &local {
                Some(r) => PendingKind::Get {
                    region: r.clone(),
                    offset: local_off,
                    len: per as u64,
                },
                None => PendingKind::Put,
            };
            let req = self.initiator.start(Pending {
                session,
                client_req: marker,
                host,
                kind,
                started: now,
            });
            let h = OpHeader { req, ..h };
            if local.is_some() {
                let op = OpRef::Get {
                    h,
                    region: c.remote_region,
                    offset: c.remote_off,
                    len: per as u64,
                    notify: false,
                };
                self.push_owned(host, &op, None);
                continue;
            }
            let max = OpRef::max_data(OpKind::Put, self.transport.body_capacity());
            for op in put_fragments(h, c.remote_region, c.remote_off, bytes, false, max) {
                self.push_owned(host, &op, None);
            }
        }
        Flow::Done
    }

    /// A completion on its way to a session: a group member's counts towards its group (and
    /// `None` comes back until the group's last member is in).
    pub(super) fn through_group(&mut self, c: Completion) -> Option<Completion> {
        if c.client_req & GROUP_BIT == 0 {
            return Some(c);
        }
        let gid = c.client_req & (GROUP_BIT - 1);
        // A client's own request id may have the bit too: not a member, it passes.
        let Some(g) = self.groups.get_mut(&gid).filter(|g| g.session == c.session) else {
            return Some(c);
        };
        if g.status.is_ok() && !c.status.is_ok() {
            g.status = c.status;
            g.value = c.value;
        }
        g.left -= 1;
        if g.left > 0 {
            return None;
        }
        let g = self.groups.remove(&gid)?;
        Some(Completion {
            session: g.session,
            client_req: g.client_req,
            status: g.status,
            value: g.value,
        })
    }
}
