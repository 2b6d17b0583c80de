//! Initiator side: outstanding operations of this host's clients, keyed by request id, until
//! the reply (or a dead peer, or a departed client) completes them.

use crate::nic::memory::Region;
use crate::shm::{FailedOp, PeerFailure};
use crate::wire::{OpRef, Status};

pub enum PendingKind {
    /// Completed by the put ack of the last fragment.
    Put,
    /// Reply fragments land in `region` at `offset + frag_off`.
    Get {
        region: Region,
        offset: u64,
        len: u64,
    },
    Amo,
    /// A fetching AMO whose fetched value the NIC also stores in `region` at `offset` (an
    /// implicit fetching AMO: its value has no completion entry to travel in).
    AmoLand {
        region: Region,
        offset: u64,
    },
    /// A strided or indexed get: reply fragments carry the elements packed in order, and
    /// element k lands at `offset + k·stride` of `region`. Each of the `parts` requests it
    /// was sent as ends with a last fragment.
    GetV {
        region: Region,
        offset: u64,
        stride: i64,
        elem: u8,
        nelems: u32,
        parts: u32,
    },
}

pub struct Pending {
    /// The daemon session (client) that started the operation.
    pub session: u64,
    /// The client's own id for the operation, echoed in its completion.
    pub client_req: u64,
    /// Target host, to fail the operation if that host dies.
    pub host: u16,
    pub kind: PendingKind,
    /// When it started (ns on the driver's clock), to say how long it waited if it fails.
    pub started: u64,
}

/// A finished operation, to be posted to the client's completion queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub session: u64,
    pub client_req: u64,
    pub status: Status,
    /// The fetched value of a fetching AMO.
    pub value: u64,
}

struct Slot {
    gen: u32,
    op: Option<Pending>,
}

/// Outstanding operations. Request ids carry a generation so that a late reply to a slot that
/// was failed and reused is recognised and dropped.
#[derive(Default)]
pub struct Initiator {
    slots: Vec<Slot>,
    free: Vec<u32>,
    outstanding: usize,
}

impl Initiator {
    pub fn start(&mut self, p: Pending) -> u64 {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot { gen: 0, op: None });
                (self.slots.len() - 1) as u32
            }
        };
        let s = &mut self.slots[idx as usize];
        s.gen = s.gen.wrapping_add(1);
        s.op = Some(p);
        self.outstanding += 1;
        ((s.gen as u64) << 32) | idx as u64
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    fn slot(&mut self, req: u64) -> Option<&mut Slot> {
        let s = self.slots.get_mut((req & 0xffff_ffff) as usize)?;
        (s.gen == (req >> 32) as u32 && s.op.is_some()).then_some(s)
    }

    pub fn get(&mut self, req: u64) -> Option<&Pending> {
        self.slot(req).and_then(|s| s.op.as_ref())
    }

    /// Finishes `req` with `status`; `None` if it is unknown (late, duplicate or foreign).
    pub fn complete(&mut self, req: u64, status: Status, value: u64) -> Option<Completion> {
        let s = self.slot(req)?;
        let p = s.op.take()?;
        self.free.push((req & 0xffff_ffff) as u32);
        self.outstanding -= 1;
        Some(Completion {
            session: p.session,
            client_req: p.client_req,
            status,
            value,
        })
    }

    /// Handles a reply op from the network.
    pub fn on_reply(&mut self, op: &OpRef<'_>) -> Option<Completion> {
        match *op {
            OpRef::PutAck { h, status } => {
                matches!(self.get(h.req)?.kind, PendingKind::Put).then_some(())?;
                self.complete(h.req, status, 0)
            }
            OpRef::AmoReply { h, status, value } => match &self.get(h.req)?.kind {
                PendingKind::Amo => self.complete(h.req, status, value),
                PendingKind::AmoLand { region, offset } => {
                    let landed = if status.is_ok() {
                        region.write(*offset, &value.to_le_bytes()).err()
                    } else {
                        None
                    };
                    self.complete(h.req, landed.unwrap_or(status), value)
                }
                _ => None,
            },
            OpRef::GetReply {
                h,
                status,
                frag_off,
                last,
                data,
            } if matches!(self.get(h.req)?.kind, PendingKind::GetV { .. }) => {
                let p = self.slot(h.req)?.op.as_mut()?;
                let PendingKind::GetV {
                    region,
                    offset,
                    stride,
                    elem,
                    nelems,
                    parts,
                } = &mut p.kind
                else {
                    return None;
                };
                let mut st = status;
                if st.is_ok() {
                    st = place_packed(region, *offset, *stride, *elem, *nelems, frag_off, data)
                        .err()
                        .unwrap_or(Status::Ok);
                }
                if last {
                    *parts = parts.saturating_sub(1);
                }
                if *parts == 0 || !st.is_ok() {
                    self.complete(h.req, st, 0)
                } else {
                    None
                }
            }
            OpRef::GetReply {
                h,
                status,
                frag_off,
                last,
                data,
            } => {
                let p = self.get(h.req)?;
                let PendingKind::Get {
                    region,
                    offset,
                    len,
                } = &p.kind
                else {
                    return None;
                };
                let mut st = status;
                if st.is_ok() {
                    let fits = frag_off
                        .checked_add(data.len() as u64)
                        .is_some_and(|e| e <= *len);
                    if fits {
                        if let Err(s) = region.write(offset + frag_off, data) {
                            st = s;
                        }
                    } else {
                        st = Status::BadRequest;
                    }
                }
                if last || !st.is_ok() {
                    self.complete(h.req, st, 0)
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    /// Fails every operation aimed at `host` (declared dead or restarted) at `now`; each
    /// completion's value is a [`PeerFailure`] naming host, operation and time waited.
    pub fn fail_host(&mut self, host: u16, now: u64, out: &mut Vec<Completion>) {
        let failure = |p: &Pending| {
            PeerFailure {
                host,
                op: Some(match p.kind {
                    PendingKind::Put => FailedOp::Put,
                    PendingKind::Get { .. } | PendingKind::GetV { .. } => FailedOp::Get,
                    PendingKind::Amo | PendingKind::AmoLand { .. } => FailedOp::Amo,
                }),
                waited_ms: now.saturating_sub(p.started) / 1_000_000,
            }
            .pack()
        };
        self.fail_where(|p| p.host == host, Status::PeerDead, failure, out)
    }

    /// Forgets every operation of a departed client (nobody is left to tell).
    pub fn drop_session(&mut self, session: u64) {
        let mut sink = Vec::new();
        self.fail_where(
            |p| p.session == session,
            Status::NoSuchEndpoint,
            |_| 0,
            &mut sink,
        )
    }

    fn fail_where(
        &mut self,
        pred: impl Fn(&Pending) -> bool,
        status: Status,
        value: impl Fn(&Pending) -> u64,
        out: &mut Vec<Completion>,
    ) {
        for i in 0..self.slots.len() {
            let s = &self.slots[i];
            if let Some(p) = s.op.as_ref().filter(|p| pred(p)) {
                let req = ((s.gen as u64) << 32) | i as u64;
                let v = value(p);
                out.extend(self.complete(req, status, v));
            }
        }
    }
}

/// Writes packed element bytes `data`, at packed byte offset `at`, to their strided places:
/// element k at `offset + k·stride`. Fragments need not end on element boundaries.
pub fn place_packed(
    region: &Region,
    offset: u64,
    stride: i64,
    elem: u8,
    nelems: u32,
    at: u64,
    data: &[u8],
) -> Result<(), Status> {
    let e = elem as u64;
    let end = at
        .checked_add(data.len() as u64)
        .ok_or(Status::BadRequest)?;
    if end > nelems as u64 * e {
        return Err(Status::BadRequest);
    }
    let mut pos = at;
    let mut rest = data;
    while !rest.is_empty() {
        let (k, within) = (pos / e, pos % e);
        let n = ((e - within) as usize).min(rest.len());
        let base = offset as i128 + k as i128 * stride as i128 + within as i128;
        let dst = u64::try_from(base).map_err(|_| Status::BadRequest)?;
        region.check_local(dst, n as u64)?;
        region.write(dst, &rest[..n])?;
        rest = &rest[n..];
        pos += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nic::memory::{HeapBacking, Perms};
    use crate::wire::OpHeader;

    #[test]
    fn get_fragments_land_and_complete_on_last() {
        let mut i = Initiator::default();
        let r = Region::new(HeapBacking::new(16), Perms::READ_WRITE);
        let req = i.start(Pending {
            started: 0,
            session: 1,
            client_req: 9,
            host: 1,
            kind: PendingKind::Get {
                region: r.clone(),
                offset: 4,
                len: 4,
            },
        });
        let h = OpHeader {
            req,
            ..Default::default()
        };
        assert_eq!(
            i.on_reply(&OpRef::GetReply {
                h,
                status: Status::Ok,
                frag_off: 0,
                last: false,
                data: b"ab"
            }),
            None
        );
        let c = i
            .on_reply(&OpRef::GetReply {
                h,
                status: Status::Ok,
                frag_off: 2,
                last: true,
                data: b"cd",
            })
            .unwrap();
        assert_eq!((c.client_req, c.status), (9, Status::Ok));
        assert_eq!(r.to_vec(4, 4), b"abcd");
        // A duplicate or late reply is ignored.
        assert_eq!(
            i.on_reply(&OpRef::GetReply {
                h,
                status: Status::Ok,
                frag_off: 2,
                last: true,
                data: b"zz"
            }),
            None
        );
        assert_eq!(r.to_vec(4, 4), b"abcd");
    }

    #[test]
    fn oversized_get_reply_is_rejected() {
        let mut i = Initiator::default();
        let r = Region::new(HeapBacking::new(16), Perms::READ_WRITE);
        let req = i.start(Pending {
            started: 0,
            session: 1,
            client_req: 9,
            host: 1,
            kind: PendingKind::Get {
                region: r,
                offset: 12,
                len: 4,
            },
        });
        let h = OpHeader {
            req,
            ..Default::default()
        };
        let c = i
            .on_reply(&OpRef::GetReply {
                h,
                status: Status::Ok,
                frag_off: 2,
                last: true,
                data: b"abcd",
            })
            .unwrap();
        assert_eq!(c.status, Status::BadRequest);
    }

    #[test]
    fn dead_host_fails_its_ops_only() {
        let mut i = Initiator::default();
        let a = i.start(Pending {
            started: 0,
            session: 1,
            client_req: 1,
            host: 1,
            kind: PendingKind::Amo,
        });
        let _b = i.start(Pending {
            started: 0,
            session: 1,
            client_req: 2,
            host: 2,
            kind: PendingKind::Put,
        });
        let mut out = Vec::new();
        i.fail_host(1, 0, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].client_req, out[0].status), (1, Status::PeerDead));
        assert_eq!(i.outstanding(), 1);
        let h = OpHeader {
            req: a,
            ..Default::default()
        };
        assert_eq!(
            i.on_reply(&OpRef::AmoReply {
                h,
                status: Status::Ok,
                value: 1
            }),
            None
        );
    }
}
