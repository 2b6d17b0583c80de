//! Collectives offloaded to the NIC as trees of triggered operations (seed 003 §4 points to
//! Portals 4 triggered operations for this; the scheme follows Hoefler et al.'s Portals 4
//! collectives). A process arms the NIC with operations that fire when counting events reach
//! thresholds, then waits for one counter: forwarding down and up the tree happens in the
//! NIC, without the intermediate processes.
//!
//! Each communicator gets four list entries on the collective portal, each counting into its
//! own counting event (thresholds are cumulative, so nothing is ever reset):
//! - `UP`: empty puts from children ("ready": a barrier is an empty broadcast);
//! - `DOWN`: from the parent (barrier release, broadcast data, allreduce result);
//! - `SLOT`: children's partial reductions, one slot each;
//! - `ACC`: this rank's own atomics combining those slots into its accumulator.
//!
//! Buffers come in two parities (epoch mod 2). Epoch k+2 cannot reach a buffer epoch k still
//! uses: data only flows down a subtree after it said "ready", and a child contributes to
//! epoch k+1 only after it received epoch k's result. A process writes a parity buffer only
//! after the operations that read it last have been acknowledged.
//!
//! The tree is k-ary (FANOUT) over ranks renumbered so the root is 0.

use std::time::{Duration, Instant};

use crate::client::MemRegion;
use crate::nic::memory::Perms;
use crate::portals::{
    md_opt, me_opt, pt_opt, AckReq, AtomicOp, Buffer, Datatype, List, Md, Me, ProcessId, Target,
};

use super::error::{err, ErrorClass, MpiError};
use super::state::State;

/// The collective portal.
pub const COLL_PT: u32 = 24;
/// Children per tree node.
const FANOUT: u32 = 4;
/// Bytes one staging slot holds: larger broadcasts and reductions go point-to-point.
pub const SLOT: usize = 4096;

const UP: u64 = 1;
const DOWN: u64 = 2;
const PART: u64 = 3;
const ACC: u64 = 4;

// Staging region layout, in slots: DOWN[2] | PART[2][FANOUT] | ACC[2].
fn down_off(p: usize) -> u64 {
    (p * SLOT) as u64
}
fn part_off(p: usize, child: usize) -> u64 {
    ((2 + p * FANOUT as usize + child) * SLOT) as u64
}
fn acc_off(p: usize) -> u64 {
    ((2 + 2 * FANOUT as usize + p) * SLOT) as u64
}
/// How long leaving a communicator waits for its last puts' acknowledgements.
const FINAL_WAIT: Duration = Duration::from_secs(30);
const REGION: usize = (4 + 2 * FANOUT as usize) * SLOT;

/// A counting event and the successes this rank expects of it so far.
#[derive(Debug, Clone, Copy)]
struct Counter {
    ct: u32,
    want: u64,
}

/// One communicator's offload state (created on its first triggered collective).
pub struct Tree {
    mem: MemRegion,
    md: u32,
    /// Counts the ACKs of this rank's puts from `mem`; `issued` of them so far.
    md_ct: u32,
    issued: u64,
    /// `issued` at the end of the last epoch that used each parity.
    issued_at: [u64; 2],
    up: Counter,
    down: Counter,
    part: Counter,
    acc: Counter,
    mes: Vec<u32>,
    epoch: u64,
    /// An epoch began and did not end: its collective failed (a member died), so what it
    /// armed may never fire.
    in_epoch: bool,
}

/// Collective match bits: the communicator's collective context and the entry's kind.
fn bits(ctx: u32, kind: u64) -> u64 {
    (ctx as u64) << 8 | kind
}

/// A node of the k-ary tree rooted at `root` (ranks renumbered so the root is 0).
struct Node {
    vr: u32,
    n: u32,
    root: u32,
}

impl Node {
    fn new(rank: u32, n: u32, root: u32) -> Node {
        Node {
            vr: (rank + n - root) % n,
            n,
            root,
        }
    }
    fn real(&self, v: u32) -> u32 {
        (v + self.root) % self.n
    }
    fn parent(&self) -> Option<u32> {
        (self.vr > 0).then(|| self.real((self.vr - 1) / FANOUT))
    }
    /// Which child of its parent this node is (0-based).
    fn index(&self) -> usize {
        ((self.vr - 1) % FANOUT) as usize
    }
    fn children(&self) -> Vec<u32> {
        (1..=FANOUT)
            .map(|i| FANOUT as u64 * self.vr as u64 + i as u64)
            .filter(|&c| c < self.n as u64)
            .map(|c| self.real(c as u32))
            .collect()
    }
}

impl State {
    /// Whether collective context `ctx` has its offload state.
    pub(super) fn has_tree(&self, ctx: u32) -> bool {
        self.trees.contains_key(&ctx)
    }

    /// Sets up collective context `ctx`'s offload state (its first offloaded collective;
    /// the members then synchronize point-to-point, so every entry exists before anyone's
    /// first triggered put).
    pub(super) fn open_tree_for(&mut self, ctx: u32) -> Result<(), MpiError> {
        let t = self.open_tree(ctx)?;
        self.trees.insert(ctx, t);
        Ok(())
    }

    fn tree(&mut self, ctx: u32) -> Result<&mut Tree, MpiError> {
        self.trees
            .get_mut(&ctx)
            .ok_or_else(|| MpiError::new(ErrorClass::Intern, "no offload state for a collective"))
    }

    fn open_tree(&mut self, ctx: u32) -> Result<Tree, MpiError> {
        if !self.coll_pt {
            self.p
                .pt_alloc(self.ni, pt_opt::ONLY_TRUNCATE, None, Some(COLL_PT))?;
            self.coll_pt = true;
        }
        let mem = self.p.endpoint().mem_register(REGION, Perms::READ_WRITE)?;
        let md_ct = self.p.ct_alloc(self.ni)?;
        let md = self.p.md_bind(
            self.ni,
            &Md {
                region: mem.handle,
                segments: vec![(0, REGION as u64)],
                options: md_opt::EVENT_SUCCESS_DISABLE | md_opt::EVENT_CT_ACK,
                eq: None,
                ct: Some(md_ct),
            },
        )?;
        let mut counters = [0u32; 4];
        let mut mes = Vec::with_capacity(4);
        for (i, (kind, off, len)) in [
            (UP, 0, 0),
            (DOWN, down_off(0), 2 * SLOT),
            (PART, part_off(0, 0), 2 * FANOUT as usize * SLOT),
            (ACC, acc_off(0), 2 * SLOT),
        ]
        .into_iter()
        .enumerate()
        {
            let ct = self.p.ct_alloc(self.ni)?;
            counters[i] = ct;
            let mut me = Me::new(
                Buffer {
                    region: mem.handle,
                    offset: off,
                    len: len as u64,
                },
                bits(ctx, kind),
            );
            me.ct = Some(ct);
            me.options = me_opt::OP_PUT
                | me_opt::EVENT_CT_COMM
                | me_opt::EVENT_SUCCESS_DISABLE
                | me_opt::EVENT_LINK_DISABLE;
            me.match_id = ProcessId::Logical {
                rank: crate::portals::RANK_ANY,
            };
            mes.push(self.p.me_append(self.ni, COLL_PT, &me, List::Priority, 0)?);
        }
        let c = |i: usize| Counter {
            ct: counters[i],
            want: 0,
        };
        Ok(Tree {
            mem,
            md,
            md_ct,
            issued: 0,
            issued_at: [0; 2],
            up: c(0),
            down: c(1),
            part: c(2),
            acc: c(3),
            mes,
            epoch: 0,
            in_epoch: false,
        })
    }

    /// Releases context `ctx`'s offload state once this rank's puts arrived (at most
    /// `FINAL_WAIT`; at once after a failed collective, cancelling what is armed). Every put aimed at this rank's entries has
    /// arrived too: each collective ended, and a peer's last puts are this rank's release.
    pub(super) fn close_tree(&mut self, ctx: u32) {
        let Some(t) = self.trees.remove(&ctx) else {
            return;
        };
        let cts = [t.md_ct, t.up.ct, t.down.ct, t.part.ct, t.acc.ct];
        if t.in_epoch {
            // What is armed would wait for arrivals that never come.
            for ct in cts {
                let _ = self.p.ct_cancel_triggered(self.ni, ct);
            }
        } else {
            let deadline = Some(Instant::now() + FINAL_WAIT);
            let _ = self.wait_ct_until(t.md_ct, t.issued, &[], deadline, &[]);
        }
        for h in t.mes {
            let _ = self.p.me_unlink(self.ni, h);
        }
        let _ = self.p.md_release(self.ni, t.md);
        for ct in cts {
            let _ = self.p.ct_free(self.ni, ct);
        }
        let _ = self.p.endpoint().mem_deregister(&t.mem);
    }

    /// Waits until counting event `ct` has `want` successes, making MPI progress meanwhile.
    /// A failure on it or on any of `watch` (an operation of the tree that went wrong, or
    /// that the NIC could not arm) ends the wait with an error, and so does a dead member of
    /// `group` (the world ranks the wait depends on, asked after while it lasts).
    fn wait_ct(
        &mut self,
        ct: u32,
        want: u64,
        watch: &[u32],
        group: &[u32],
    ) -> Result<(), MpiError> {
        self.wait_ct_until(ct, want, watch, None, group)
    }

    fn wait_ct_until(
        &mut self,
        ct: u32,
        want: u64,
        watch: &[u32],
        deadline: Option<Instant>,
        group: &[u32],
    ) -> Result<(), MpiError> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let v = self.p.ct_get(self.ni, ct)?;
            let failed = std::iter::once(ct)
                .chain(watch.iter().copied())
                .position(|w| self.p.ct_get(self.ni, w).is_ok_and(|v| v.failure > 0));
            if let Some(i) = failed {
                return err(
                    ErrorClass::Other,
                    format!(
                        "a collective's NIC operation failed (counter {i}: a peer is gone, or \
                         the NIC could not arm it)"
                    ),
                );
            }
            if v.success >= want {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return err(
                    ErrorClass::Other,
                    "a collective's puts were never acknowledged",
                );
            }
            self.progress()?;
            self.ask_after(group, start)?;
            let eqs = self.eqs();
            self.p
                .idle(&mut spins, start, Some((self.ni, &eqs, &[ct], &[want])))?;
        }
    }

    fn target(&self, world: u32, ctx: u32, kind: u64, off: u64) -> Target {
        Target {
            id: ProcessId::Logical { rank: world },
            pt_index: COLL_PT,
            match_bits: bits(ctx, kind),
            remote_offset: off,
        }
    }

    /// A put of `len` bytes at `off` of the staging region to `to`'s entry `kind`, now or
    /// (with `on`) when that counter reaches its threshold. Data puts count their ACKs.
    #[allow(clippy::too_many_arguments)]
    fn tree_put(
        &mut self,
        ctx: u32,
        off: u64,
        len: usize,
        to: u32,
        kind: u64,
        remote: u64,
        on: Option<Counter>,
    ) -> Result<(), MpiError> {
        let t = self.target(to, ctx, kind, remote);
        let tr = self.trees.get_mut(&ctx).expect("open");
        let md = tr.md;
        // Every put counts its ACK, empty ones too: a rank leaves a communicator (or MPI)
        // only once what its NIC was armed to send has arrived.
        tr.issued += 1;
        let ack = AckReq::CtAck;
        match on {
            None => self.p.put(self.ni, md, off, len as u64, ack, t, 0, 0)?,
            Some(c) => self
                .p
                .triggered_put(self.ni, md, off, len as u64, ack, t, 0, 0, c.ct, c.want)?,
        }
        Ok(())
    }

    /// Arms the puts of `len` bytes at `src` of the staging region into each child's DOWN
    /// buffer of parity `p`, fired when `on` reaches its threshold.
    #[allow(clippy::too_many_arguments)]
    fn forward_down(
        &mut self,
        ctx: u32,
        group: &[u32],
        kids: &[u32],
        src: u64,
        p: usize,
        len: usize,
        on: Counter,
    ) -> Result<(), MpiError> {
        for &c in kids {
            let to = group[c as usize];
            self.tree_put(ctx, src, len, to, DOWN, down_off(p), Some(on))?;
        }
        Ok(())
    }

    fn watch(&self, ctx: u32) -> [u32; 5] {
        let t = &self.trees[&ctx];
        [t.md_ct, t.up.ct, t.down.ct, t.part.ct, t.acc.ct]
    }

    /// Starts an epoch: its parity, after the operations that last read that parity's
    /// buffers were acknowledged.
    fn epoch(&mut self, ctx: u32) -> Result<usize, MpiError> {
        let t = self.tree(ctx)?;
        let p = (t.epoch % 2) as usize;
        t.epoch += 1;
        t.in_epoch = true;
        let (ct, want) = (t.md_ct, t.issued_at[p]);
        let watch = self.watch(ctx);
        self.wait_ct(ct, want, &watch, &[])?;
        Ok(p)
    }

    fn end_epoch(&mut self, ctx: u32, p: usize) {
        let t = self.trees.get_mut(&ctx).expect("open");
        t.issued_at[p] = t.issued;
        t.in_epoch = false;
    }

    /// Broadcast of at most SLOT bytes: each subtree says "ready" up the tree; the root's
    /// data goes down once its children are ready, forwarded by each NIC as it lands. With
    /// no bytes from rank 0 and `barrier` it is the barrier: arrivals up, the release down.
    pub(super) fn tree_bcast(
        &mut self,
        ctx: u32,
        group: &[u32],
        rank: u32,
        buf: &mut [u8],
        root: u32,
        barrier: bool,
    ) -> Result<(), MpiError> {
        let node = Node::new(rank, group.len() as u32, root);
        let kids = node.children();
        let len = buf.len();
        let p = self.epoch(ctx)?;
        let t = self.trees.get_mut(&ctx).expect("open");
        t.up.want += kids.len() as u64;
        let up = t.up;
        let parent = node.parent();
        if parent.is_some() {
            t.down.want += 1;
        } else {
            t.mem.bytes()[down_off(p) as usize..][..len].copy_from_slice(buf);
        }
        let down = t.down;
        // The root sends when its children are ready; others forward what lands.
        let go = if parent.is_some() { down } else { up };
        self.forward_down(ctx, group, &kids, down_off(p), p, len, go)?;
        let watch = self.watch(ctx);
        match parent {
            Some(pa) => {
                let on = (!kids.is_empty()).then_some(up);
                self.tree_put(ctx, 0, 0, group[pa as usize], UP, 0, on)?;
                self.wait_ct(down.ct, down.want, &watch, group)?;
                let t = &self.trees[&ctx];
                buf.copy_from_slice(&t.mem.bytes()[down_off(p) as usize..][..len]);
            }
            // A barrier's root leaves once everyone arrived; a broadcast's root at once.
            None if barrier => self.wait_ct(up.ct, up.want, &watch, group)?,
            None => {}
        }
        self.end_epoch(ctx, p);
        Ok(())
    }

    /// Allreduce of at most min(SLOT, max_atomic_size) bytes: children put their partial
    /// results into slots at the parent, whose NIC combines each into its accumulator by an
    /// atomic to itself; the combined value goes up, the root's result comes down.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn tree_allreduce(
        &mut self,
        ctx: u32,
        group: &[u32],
        rank: u32,
        acc: &mut [u8],
        op: AtomicOp,
        dt: Datatype,
    ) -> Result<(), MpiError> {
        let node = Node::new(rank, group.len() as u32, 0);
        let kids = node.children();
        let len = acc.len();
        let me = group[rank as usize];
        let p = self.epoch(ctx)?;
        let t = self.trees.get_mut(&ctx).expect("open");
        t.mem.bytes()[acc_off(p) as usize..][..len].copy_from_slice(acc);
        t.part.want += kids.len() as u64;
        t.acc.want += kids.len() as u64;
        let (part, accd) = (t.part, t.acc);
        let parent = node.parent();
        if parent.is_some() {
            t.down.want += 1;
        }
        let down = t.down;
        let md = t.md;
        for i in 0..kids.len() {
            let target = self.target(me, ctx, ACC, acc_off(p) - acc_off(0));
            self.p.triggered_atomic(
                self.ni,
                md,
                part_off(p, i),
                len as u64,
                AckReq::NoAck,
                target,
                0,
                0,
                op,
                dt,
                part.ct,
                part.want,
            )?;
        }
        match parent {
            Some(pa) => {
                let slot = part_off(p, node.index()) - part_off(0, 0);
                let on = (!kids.is_empty()).then_some(accd);
                self.tree_put(ctx, acc_off(p), len, group[pa as usize], PART, slot, on)?;
                self.forward_down(ctx, group, &kids, down_off(p), p, len, down)?;
                let watch = self.watch(ctx);
                self.wait_ct(down.ct, down.want, &watch, group)?;
                acc.copy_from_slice(&self.trees[&ctx].mem.bytes()[down_off(p) as usize..][..len]);
            }
            None => {
                self.forward_down(ctx, group, &kids, acc_off(p), p, len, accd)?;
                let watch = self.watch(ctx);
                self.wait_ct(accd.ct, accd.want, &watch, group)?;
                acc.copy_from_slice(&self.trees[&ctx].mem.bytes()[acc_off(p) as usize..][..len]);
            }
        }
        self.end_epoch(ctx, p);
        Ok(())
    }
}
