//! AMOs (seed 001 §2.2.4): the Gemini 64-bit set, each blocking, `_nb` and `_nbi`. Fetching
//! AMOs return the old value from the blocking call or from `syncid_wait`; the `_nbi` ones
//! store it in a qword of this PE (`result`), there by the next gsync. Always FMA.

use crate::shm::{CommandKind, CMD_LAND};
use crate::wire::AmoOp;

use super::error::err;
use super::{Dmapp, DmappError, Mode, Rc, Reqs, SegDesc, SyncId};

impl Dmapp {
    /// Posts one AMO; the fetched value of a blocking one, or the sync id of an nb one.
    #[allow(clippy::too_many_arguments)]
    fn amo_any(
        &mut self,
        mode: Mode,
        op: AmoOp,
        result: Option<&mut u64>,
        target_addr: u64,
        seg: &SegDesc,
        pe: u32,
        operand: u64,
        operand2: u64,
    ) -> Result<(u64, Option<SyncId>), DmappError> {
        if mode == Mode::Nb {
            self.nb_room()?;
        }
        if !target_addr.is_multiple_of(8) {
            return err(
                Rc::AlignmentError,
                format!("AMO word {target_addr:#x} is not qword-aligned"),
            );
        }
        let dst = self.remote(target_addr, seg, pe, 8)?;
        let mut c = self.nic.command(CommandKind::Amo, dst, 8)?;
        c.amo = Some(op);
        c.operand = operand;
        c.operand2 = operand2;
        let mut landing = None;
        if let Some(r) = result {
            let p = r as *mut u64 as *const u8;
            if !(p as u64).is_multiple_of(8) {
                return err(Rc::AlignmentError, "result qword is not qword-aligned");
            }
            let l = self.local(p, 8)?;
            c.flags |= CMD_LAND;
            c.local_region = l.handle.0;
            c.local_off = l.off;
            landing = Some(l);
        }
        self.counters.fma_ops += 1;
        let req = self.nic.post_raw(c, &[], mode == Mode::Nbi)?;
        if let Some(l) = landing {
            self.track(mode, req, l, 8);
        }
        if mode == Mode::Blocking {
            return Ok((self.nic.wait_req(req)?, None));
        }
        Ok((0, self.finish(mode, Reqs::One(req))?))
    }
}

/// The non-fetching AMOs: `op_qw`, `op_qw_nb`, `op_qw_nbi`.
macro_rules! non_fetching {
    ($op:expr, $b:ident, $nb:ident, $nbi:ident, $what:literal) => {
        impl Dmapp {
            #[doc = concat!("`dmapp_", stringify!($b), "`: ", $what, "; visible on return.")]
            pub fn $b(
                &mut self,
                target_addr: u64,
                seg: &SegDesc,
                pe: u32,
                operand: u64,
            ) -> Result<(), DmappError> {
                self.amo_any(Mode::Blocking, $op, None, target_addr, seg, pe, operand, 0)
                    .map(|_| ())
            }
            #[doc = concat!("`dmapp_", stringify!($nb), "`: ", $what, ", explicit sync id.")]
            pub fn $nb(
                &mut self,
                target_addr: u64,
                seg: &SegDesc,
                pe: u32,
                operand: u64,
            ) -> Result<SyncId, DmappError> {
                self.amo_any(Mode::Nb, $op, None, target_addr, seg, pe, operand, 0)
                    .map(|(_, id)| id.expect("nb gives a sync id"))
            }
            #[doc = concat!("`dmapp_", stringify!($nbi), "`: ", $what, ", done at gsync.")]
            pub fn $nbi(
                &mut self,
                target_addr: u64,
                seg: &SegDesc,
                pe: u32,
                operand: u64,
            ) -> Result<(), DmappError> {
                self.amo_any(Mode::Nbi, $op, None, target_addr, seg, pe, operand, 0)
                    .map(|_| ())
            }
        }
    };
}

/// The fetching AMOs: blocking returns the old value; `_nb` through `syncid_wait`; `_nbi`
/// into `result`. `$two`: the second operand's name (AFAX's xor mask, ACSWAP's swaperand).
macro_rules! fetching {
    ($op:expr, $b:ident, $nb:ident, $nbi:ident, $what:literal, ($a:ident $(, $two:ident)?)) => {
        impl Dmapp {
            #[doc = concat!("`dmapp_", stringify!($b), "`: ", $what, "; returns the old value.")]
            pub fn $b(
                &mut self,
                target_addr: u64,
                seg: &SegDesc,
                pe: u32,
                $a: u64,
                $($two: u64,)?
            ) -> Result<u64, DmappError> {
                let (x, y) = fetching!(@ops $op, $a $(, $two)?);
                self.amo_any(Mode::Blocking, $op, None, target_addr, seg, pe, x, y)
                    .map(|(v, _)| v)
            }
            #[doc = concat!("`dmapp_", stringify!($nb), "`: ", $what, "; the old value from `syncid_wait`.")]
            pub fn $nb(
                &mut self,
                target_addr: u64,
                seg: &SegDesc,
                pe: u32,
                $a: u64,
                $($two: u64,)?
            ) -> Result<SyncId, DmappError> {
                let (x, y) = fetching!(@ops $op, $a $(, $two)?);
                self.amo_any(Mode::Nb, $op, None, target_addr, seg, pe, x, y)
                    .map(|(_, id)| id.expect("nb gives a sync id"))
            }
            #[doc = concat!("`dmapp_", stringify!($nbi), "`: ", $what, "; the old value in `result` by the next gsync.")]
            #[allow(clippy::too_many_arguments)]
            pub fn $nbi(
                &mut self,
                result: &mut u64,
                target_addr: u64,
                seg: &SegDesc,
                pe: u32,
                $a: u64,
                $($two: u64,)?
            ) -> Result<(), DmappError> {
                let (x, y) = fetching!(@ops $op, $a $(, $two)?);
                self.amo_any(Mode::Nbi, $op, Some(result), target_addr, seg, pe, x, y)
                    .map(|_| ())
            }
        }
    };
    (@ops $op:expr, $a:ident) => { ($a, 0) };
    (@ops $op:expr, $a:ident, $two:ident) => { amo_operands($op, $a, $two) };
}

/// Wire operands of the two-operand AMOs: AFAX (and-mask, xor-mask) as given; ACSWAP
/// (comperand, swaperand) as the engine takes them (swaperand first).
fn amo_operands(op: AmoOp, a: u64, b: u64) -> (u64, u64) {
    match op {
        AmoOp::Acswap => (b, a),
        _ => (a, b),
    }
}

non_fetching!(AmoOp::Aadd, aadd_qw, aadd_qw_nb, aadd_qw_nbi, "atomic add");
non_fetching!(AmoOp::Aand, aand_qw, aand_qw_nb, aand_qw_nbi, "atomic and");
non_fetching!(AmoOp::Aor, aor_qw, aor_qw_nb, aor_qw_nbi, "atomic or");
non_fetching!(AmoOp::Axor, axor_qw, axor_qw_nb, axor_qw_nbi, "atomic xor");
fetching!(
    AmoOp::Afadd,
    afadd_qw,
    afadd_qw_nb,
    afadd_qw_nbi,
    "atomic fetch-and-add",
    (operand)
);
fetching!(
    AmoOp::Afand,
    afand_qw,
    afand_qw_nb,
    afand_qw_nbi,
    "atomic fetch-and-and",
    (operand)
);
fetching!(
    AmoOp::Afor,
    afor_qw,
    afor_qw_nb,
    afor_qw_nbi,
    "atomic fetch-and-or",
    (operand)
);
fetching!(
    AmoOp::Afxor,
    afxor_qw,
    afxor_qw_nb,
    afxor_qw_nbi,
    "atomic fetch-and-xor",
    (operand)
);
fetching!(
    AmoOp::Afax,
    afax_qw,
    afax_qw_nb,
    afax_qw_nbi,
    "fetch, then store (old & and_mask) ^ xor_mask",
    (and_mask, xor_mask)
);
fetching!(
    AmoOp::Acswap,
    acswap_qw,
    acswap_qw_nb,
    acswap_qw_nbi,
    "compare and swap: store swaperand if the word equals comperand",
    (comperand, swaperand)
);
