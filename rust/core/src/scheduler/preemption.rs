//! Preemption: when a running row cannot get even one token's chunks, the running request
//! with the largest `(priority, arrival)` not yet placed in this step (possibly the
//! requester) gives its chunks back: swapped out when the swap pool has room, else
//! soft-reset. The last active request is never preempted.

use super::Scheduler;
use crate::RequestState;

impl Scheduler {
    /// The running request with the largest key not placed in this step; the requester
    /// itself when that is it. Never the last active request.
    pub(super) fn pick_victim(&self, requester: u32) -> Option<u32> {
        if self.running.len() <= 1 {
            return None;
        }
        self.running
            .iter()
            .rev()
            .copied()
            .find(|&v| v == requester || self.req(v).touched_step != self.step)
    }

    /// Preempt a running request: swap out when the swap pool has room for all its chunks
    /// (and it shares no chunk with a victim already swapped out in this step: a plan copies
    /// each chunk at most once), else soft reset (back to `Waiting`, to recompute).
    pub(super) fn preempt(&mut self, v: u32) {
        self.remove_running(v);
        self.stats.num_preemptions += 1;
        let step = self.step;
        let r = self.reqs[v as usize].as_mut().expect("live");
        r.touched_step = step;
        let key = r.key;
        if self.kv.try_swap_out(r, &mut self.plan.swap_out) {
            r.state = RequestState::Swapped;
            self.swapped.insert(key, v);
            self.stats.num_offloads += 1;
        } else {
            self.kv.free(r);
            r.num_computed = 0;
            r.num_registered = 0;
            r.state = RequestState::Waiting;
            self.waiting.insert(key, v);
            self.stats.num_soft_resets += 1;
        }
    }
}
