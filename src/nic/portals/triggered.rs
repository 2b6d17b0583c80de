//! Triggered operations: work the NIC starts by itself when a counting event's success count
//! reaches a threshold (PtlTriggeredPut/Get/Atomic/FetchAtomic/Swap/CTInc/CTSet), in the order
//! they were posted; PtlCTCancelTriggered drops those still waiting. CTInc and CTSet act at
//! once, so chains of triggers run to completion within one counting-event change; data
//! operations are queued for the daemon to start ([`PortalsNi::take_fired`]).

use super::events::CtEvent;
use super::initiator::OpSpec;
use super::ni::PortalsNi;
use super::types::PtlError;

#[derive(Debug, Clone)]
pub enum TriggeredAction {
    Op(OpSpec),
    CtInc { ct: u32, by: CtEvent },
    CtSet { ct: u32, value: CtEvent },
}

#[derive(Debug, Clone)]
pub struct Triggered {
    pub ct: u32,
    pub threshold: u64,
    pub action: TriggeredAction,
}

impl PortalsNi {
    /// Posts a triggered operation on `ct`; fires at once if the threshold is already reached.
    pub fn triggered(
        &mut self,
        ct: u32,
        threshold: u64,
        action: TriggeredAction,
    ) -> Result<(), PtlError> {
        self.ct_get(ct)?;
        match &action {
            TriggeredAction::CtInc { ct: t, .. } | TriggeredAction::CtSet { ct: t, .. } => {
                self.ct_get(*t)?;
            }
            TriggeredAction::Op(spec) => {
                self.mds.get(spec.md).ok_or(PtlError::ArgInvalid)?;
            }
        }
        if self.triggered.len() >= self.limits.max_triggered_ops {
            return Err(PtlError::NoSpace);
        }
        self.triggered.push(Triggered {
            ct,
            threshold,
            action,
        });
        self.fire_triggered(ct);
        Ok(())
    }

    /// PtlCTCancelTriggered.
    pub fn ct_cancel_triggered(&mut self, ct: u32) -> Result<(), PtlError> {
        self.ct_get(ct)?;
        self.triggered.retain(|t| t.ct != ct);
        Ok(())
    }

    /// Whether triggers released operations not taken yet.
    pub fn has_fired(&self) -> bool {
        !self.fired.is_empty()
    }

    /// The next data operation a trigger released.
    pub fn take_fired(&mut self) -> Option<OpSpec> {
        self.fired.pop_front()
    }

    pub(super) fn fire_triggered(&mut self, ct: u32) {
        // Every counting-event change passes here: nothing to do (or allocate) without triggers.
        if self.triggered.is_empty() {
            return;
        }
        let mut work = vec![ct];
        while let Some(c) = work.pop() {
            let Ok(v) = self.ct_get(c) else { continue };
            let mut i = 0;
            while i < self.triggered.len() {
                let t = &self.triggered[i];
                if t.ct != c || v.success < t.threshold {
                    i += 1;
                    continue;
                }
                match self.triggered.remove(i).action {
                    TriggeredAction::Op(spec) => self.fired.push_back(spec),
                    TriggeredAction::CtInc { ct, by } => {
                        if let Ok(mut x) = self.ct_get(ct) {
                            x.inc(by);
                            self.ct_store(ct, x);
                            work.push(ct);
                        }
                    }
                    TriggeredAction::CtSet { ct, value } => {
                        if self.ct_get(ct).is_ok() {
                            self.ct_store(ct, value);
                            work.push(ct);
                        }
                    }
                }
            }
        }
    }
}
