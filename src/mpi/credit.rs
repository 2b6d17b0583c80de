//! Flow control by static credits (seed 003 §3.1.3, the first scheme): every receiver keeps
//! room for `per_peer` unexpected messages from each rank — its overflow space grows with the
//! job — and a sender spends one credit per message, queueing locally (in order) when it has
//! none for that receiver. The receiver gives credits back in batches of half the allowance
//! as its receives consume messages: an atomic add by the NIC to the sender's credit word for
//! it (an entry on a portal of its own), so the sender only reads memory to know what it may
//! send. The receiver's portal stays PTL_PT_FLOWCTRL: should its overflow buffers still
//! run out (a message pinning a buffer that is otherwise free), recovery takes over.

use crate::client::MemRegion;
use crate::nic::memory::Perms;
use crate::portals::{
    md_opt, me_opt, AckReq, AtomicOp, Buffer, Datatype, List, Md, Me, ProcessId, Target, RANK_ANY,
};

use super::error::MpiError;
use super::state::State;

/// The credit words' portal: their events only wake a waiting sender, so they have a queue
/// of their own (a full one loses nothing: the credits are in memory).
pub const CREDIT_PT: u32 = 25;
const CREDIT_BITS: u64 = 1;
const T_CREDIT: u64 = 10 << 60;

/// Flow-control schemes (`SOFTNIC_MPI_FLOW`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowScheme {
    /// Recovery on PTL_EVENT_PT_DISABLED (the default).
    Recovery,
    /// Static credits per pair of ranks, with recovery behind them.
    Credit,
}

pub struct Credits {
    pub per_peer: u64,
    pub eq: u32,
    batch: u64,
    /// Word r: credits receiver r gave back (added by the NIC); then the batch constant.
    words: MemRegion,
    md: u32,
    /// Messages sent to each rank; consumed from and credits returned to each rank.
    used: Vec<u64>,
    consumed: Vec<u64>,
    returned: Vec<u64>,
}

impl Credits {
    /// The credit words, their portal and entry.
    pub fn open(st: &mut State, per_peer: u64) -> Result<Credits, MpiError> {
        let n = st.size as usize;
        let eq = st.p.eq_alloc(st.ni, 256)?;
        st.p.pt_alloc(st.ni, 0, Some(eq), Some(CREDIT_PT))?;
        let words =
            st.p.endpoint()
                .mem_register(8 * (n + 1), Perms::READ_WRITE)?;
        let batch = (per_peer / 2).max(1);
        words.bytes()[8 * n..].copy_from_slice(&batch.to_le_bytes());
        let md = st.p.md_bind(
            st.ni,
            &Md {
                region: words.handle,
                segments: vec![(0, 8 * (n as u64 + 1))],
                options: md_opt::EVENT_SEND_DISABLE | md_opt::EVENT_SUCCESS_DISABLE,
                eq: None,
                ct: None,
            },
        )?;
        let mut me = Me::new(
            Buffer {
                region: words.handle,
                offset: 0,
                len: 8 * n as u64,
            },
            CREDIT_BITS,
        );
        me.options = me_opt::OP_PUT | me_opt::ACK_DISABLE | me_opt::EVENT_LINK_DISABLE;
        me.match_id = ProcessId::Logical { rank: RANK_ANY };
        st.p.me_append(st.ni, CREDIT_PT, &me, List::Priority, T_CREDIT)?;
        Ok(Credits {
            per_peer,
            eq,
            batch,
            words,
            md,
            used: vec![0; n],
            consumed: vec![0; n],
            returned: vec![0; n],
        })
    }

    /// Messages this rank may still send to `dest` now.
    pub fn available(&self, dest: u32) -> u64 {
        let given = self.words.read_u64(8 * dest as usize);
        (self.per_peer + given).saturating_sub(self.used[dest as usize])
    }

    pub fn take(&mut self, dest: u32) {
        self.used[dest as usize] += 1;
    }

    /// A message the receiver refused (recovery): its credit was not spent there.
    pub fn give_back(&mut self, dest: u32) {
        self.used[dest as usize] -= 1;
    }
}

/// A receive consumed a message from world rank `src`: credits go back a batch at a time.
pub fn consumed(st: &mut State, src: u32) -> Result<(), MpiError> {
    let Some(c) = st.flow.credit.as_mut() else {
        return Ok(());
    };
    let Some(n) = c.consumed.get_mut(src as usize) else {
        return Ok(());
    };
    *n += 1;
    if *n - c.returned[src as usize] < c.batch {
        return Ok(());
    }
    c.returned[src as usize] += c.batch;
    let (md, at) = (c.md, 8 * st.size as u64);
    st.stats.credit_returns += 1;
    st.p.atomic(
        st.ni,
        md,
        at,
        8,
        AckReq::NoAck,
        Target {
            id: ProcessId::Logical { rank: src },
            pt_index: CREDIT_PT,
            match_bits: CREDIT_BITS,
            remote_offset: 8 * st.rank as u64,
        },
        0,
        0,
        AtomicOp::Sum,
        Datatype::Uint64,
    )?;
    Ok(())
}
