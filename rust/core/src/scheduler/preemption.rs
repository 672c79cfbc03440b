//! Preemption: when a running row cannot get even one token's chunks, the running request
//! with the largest `(priority, arrival)` not yet placed in this step (possibly the
//! requester) gives its chunks back: swapped out when the swap pool has room, else
//! soft-reset. The last active request is never preempted.
//!
//! Priority preemption (`priority_preemption`): before a step places its running rows, while
//! the swapped or waiting request with the smallest key could not be admitted (no row, or
//! not one token's chunks above the safety margin; a swapped one: not all its chunks), the
//! running request of strictly lower priority (larger `priority` value) with the largest
//! key is preempted the same way. (Once admitted, a request's growth preempts by key as
//! always: lower priorities first.)
//!
//! Starvation: a request is preempted for priority at most `MAX_PRIORITY_PREEMPTIONS` times,
//! and waiting or swapped requests age: every `PRIORITY_AGING_STEPS` steps each one's
//! priority improves by one. So a request passed over by ever-new requests of priority `p`
//! outranks them after at most `(its priority - p + 1) * PRIORITY_AGING_STEPS` steps of
//! waiting; from then on it is admitted before them and is never their priority victim.

use super::Scheduler;
use crate::RequestState;

/// How many times one request may be preempted for requests of higher priority.
pub const MAX_PRIORITY_PREEMPTIONS: u32 = 3;

/// With `priority_preemption`, every this many `schedule()` calls each waiting or swapped
/// request's priority improves by one (aging).
pub const PRIORITY_AGING_STEPS: u64 = 32;

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

    /// The running request a priority preemption would take now: the best-keyed swapped or
    /// waiting request does not fit, and a running request of strictly lower priority that
    /// has not reached `MAX_PRIORITY_PREEMPTIONS` exists (the largest key of those).
    pub(super) fn priority_victim(&self) -> Option<u32> {
        let w = self.waiting.first_key_value().map(|(k, &i)| (*k, i));
        let s = self.swapped.first_key_value().map(|(k, &i)| (*k, i));
        let (key, head) = match (w, s) {
            (None, None) => return None,
            (Some(a), None) | (None, Some(a)) => a,
            (Some(a), Some(b)) => a.min(b),
        };
        if self.head_fits(head) {
            return None;
        }
        self.running.iter().rev().copied().find(|&v| {
            let r = self.req(v);
            r.key.0 > key.0 && r.priority_preemptions < MAX_PRIORITY_PREEMPTIONS
        })
    }

    /// Whether request `head` (waiting or swapped) would get a row and one token's chunks
    /// (a swapped one: its swapped chunks and one more) above the safety margin now.
    fn head_fits(&self, head: u32) -> bool {
        if self.running.len() >= self.cfg.max_requests_per_batch {
            return false;
        }
        let r = self.req(head);
        let need = if r.state == RequestState::Swapped {
            r.swap_slots.len() + 1
        } else {
            self.kv.layout().max_chunks(1)
        };
        let margin = if self.running.is_empty() {
            0
        } else {
            (self.margin * self.cfg.num_blocks as f64).ceil() as usize
        };
        self.kv.num_free() >= need + margin
    }

    /// Aging: every `PRIORITY_AGING_STEPS` steps, each waiting or swapped request's
    /// priority improves by one (its arrival order is kept).
    pub(super) fn age_queued(&mut self) {
        if !self.step.is_multiple_of(PRIORITY_AGING_STEPS) {
            return;
        }
        for swapped in [false, true] {
            let queue = if swapped {
                &mut self.swapped
            } else {
                &mut self.waiting
            };
            let entries: Vec<_> = std::mem::take(queue).into_iter().collect();
            for ((priority, arrival), idx) in entries {
                let key = (priority.saturating_sub(1), arrival);
                self.reqs[idx as usize].as_mut().expect("live").key = key;
                let queue = if swapped {
                    &mut self.swapped
                } else {
                    &mut self.waiting
                };
                queue.insert(key, idx);
            }
        }
    }

    /// Preempt running requests for the best-keyed waiting or swapped one until it fits or
    /// no running request of lower priority may be preempted (`priority_victim`).
    pub(super) fn preempt_for_priority(&mut self) {
        while let Some(v) = self.priority_victim() {
            self.req_mut(v).priority_preemptions += 1;
            self.stats.priority_preemptions += 1;
            self.preempt(v);
        }
    }
}
