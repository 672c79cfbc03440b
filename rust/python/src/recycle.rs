//! Buffers of dropped plans / outputs, handed back to the scheduler for its next step so
//! steady-state steps allocate nothing (a few sets rotate while the caller holds old ones).

use std::sync::{Arc, Mutex};

use ferrobatch_core as core;

/// Shared by a `Scheduler` and the plans / outputs it hands out (which outlive it freely).
#[derive(Clone, Default)]
pub struct Recycler(Arc<Mutex<RecycleBins>>);

#[derive(Default)]
struct RecycleBins {
    plans: Vec<core::StepPlan>,
    outputs: Vec<core::StepOutput>,
}

/// Buffers kept per kind; more are dropped.
const RECYCLE_KEEP: usize = 4;

impl Recycler {
    /// A recycled plan buffer, or a new one.
    pub fn take_plan(&self) -> core::StepPlan {
        self.0
            .lock()
            .ok()
            .and_then(|mut b| b.plans.pop())
            .unwrap_or_default()
    }
    /// A recycled output buffer, or a new one.
    pub fn take_output(&self) -> core::StepOutput {
        self.0
            .lock()
            .ok()
            .and_then(|mut b| b.outputs.pop())
            .unwrap_or_default()
    }
    /// Keep `plan`'s buffers for a later step (unless enough are kept).
    pub fn give_plan(&self, plan: &mut core::StepPlan) {
        if let Ok(mut b) = self.0.lock() {
            if b.plans.len() < RECYCLE_KEEP {
                b.plans.push(std::mem::take(plan));
            }
        }
    }
    /// Keep `output`'s buffers for a later step (unless enough are kept).
    pub fn give_output(&self, output: &mut core::StepOutput) {
        if let Ok(mut b) = self.0.lock() {
            if b.outputs.len() < RECYCLE_KEEP {
                b.outputs.push(std::mem::take(output));
            }
        }
    }
}
