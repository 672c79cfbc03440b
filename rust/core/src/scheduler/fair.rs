//! The step-time budget (`max_step_ms`) and the fair sharing of a step's prefill time.
//!
//! **When it binds.** With `max_step_ms` set, `fifo`, at least two requests unfinished
//! (running + waiting + swapped), and one of them not offline (`Request::offline`, set by
//! `set_offline`): someone then waits on the step's length. A request alone (a long prompt
//! with nobody else) prefills in `max_batch_tokens` chunks as without it, and so does an
//! offline batch (`Engine.generate`), whose caller waits for all of it, not on any step:
//! there the budget would only trade throughput for gaps nobody sees (a 1.5B model's 32 x
//! 64 batch on one core took 1.4x as long under it). `schedule_ahead()` plans by tokens
//! only (the engine turns the budget off with async batching).
//!
//! **The budget.** The step starts with `max_step_ms` minus the cost model's fixed cost per
//! step; decode rows are charged their predicted cost and never cut. The prefill chunks then
//! get what is left, but at least `PREFILL_FLOOR · max_step_ms`, and at least the predicted
//! cost of the rest of the step (fixed cost and decodes): prefills progress even when the
//! decodes alone fill the step, and where a decode step of a large model outlasts
//! `max_step_ms` prompts get half the step instead of a sliver while the streams' steps at
//! most double. The first prefill row gets at least one token. Each chunk is the most
//! tokens whose predicted cost (tokens, and keys attended at its context) fits the time
//! left; `max_batch_tokens` stays the hard cap. Chunking costs the long prompt about
//! `a / max_step_ms` of its prefill throughput (`a`: the fixed cost of a step, mostly
//! reading the weights once): pick `max_step_ms` well above a decode step.
//!
//! **Sharing (shortest work first, with a floor for the oldest).** The prefill allowance
//! goes, in order, to
//! 1. the *anchor*, the in-flight prefill with the smallest `(priority, arrival)`: it may
//!    take everything the others would not use (their predicted demand: the other in-flight
//!    prefills' and the waiting / swapped requests' remaining prompts), and at least
//!    `ANCHOR_SHARE` of the allowance;
//! 2. swapped and waiting requests, admitted as usual (key order, head of line): a short
//!    prompt arriving during a long prefill is admitted in the next step, beside it;
//! 3. the other in-flight prefills, shortest remaining prompt first.
//!
//! **No starvation.** The anchor is placed first among the prefills with at least one token
//! (the floor row), so it progresses every step it is not preempted, and finishes its
//! prompt in at most `prompt_len` steps; the next anchor is then the oldest remaining one.
//! A waiting request at the head of the queue is admitted in the first step where memory
//! (as without the budget) and time allow one token; when no prefill is in flight it is
//! itself the floor row. So every request's prefill ends, by induction on the key order
//! (`sim_tests`: `fair_share_*`).

use super::budget::Budget;
use super::cost::StepShape;
use super::placement::OnShortfall;
use super::{Scheduler, SchedulerType};
use crate::request::RequestState;
use crate::{Error, Result};

/// Share of `max_step_ms` the prefill chunks always get, even when decodes fill the step.
pub(super) const PREFILL_FLOOR: f64 = 0.25;

/// Share of the prefill allowance the oldest in-flight prefill always keeps.
pub(super) const ANCHOR_SHARE: f64 = 0.25;

impl Scheduler {
    /// Whether the step-time budget binds the step being planned (module docs).
    fn time_binds(&self) -> bool {
        self.cfg.max_step_ms.is_some()
            && self.cfg.scheduler_type == SchedulerType::Fifo
            && self.running.len() + self.waiting.len() + self.swapped.len() >= 2
            && self.someone_online()
    }

    /// Whether an unfinished request is not offline (running, waiting or swapped).
    fn someone_online(&self) -> bool {
        let mut all = (self.running.iter())
            .chain(self.waiting.values())
            .chain(self.swapped.values());
        all.any(|&i| !self.req(i).offline)
    }

    /// `b` with the step-time budget, when it binds this step.
    pub(super) fn bind_time(&self, b: Budget) -> Budget {
        match self.cfg.max_step_ms {
            Some(ms) if self.time_binds() => b.with_time(ms, self.cost.coef(), self.geo),
            _ => b,
        }
    }

    /// Phase 2 with the time budget binding: the anchor, admissions, the other in-flight
    /// prefills (module docs).
    pub(super) fn place_prefills_fairly(&mut self, b: &mut Budget) {
        let ms = self.cfg.max_step_ms.expect("the time budget binds");
        b.open_prefill(PREFILL_FLOOR * ms);
        let t = b.time.expect("the time budget binds");
        self.cur.time = Some((t.coef, t.left_ms + t.prefill_ms));
        let step = self.step;
        let anchor = self.running.iter().copied().find(|&i| {
            let r = self.req(i);
            r.state == RequestState::Prefilling && r.touched_step != step
        });
        if let Some(a) = anchor.filter(|_| !b.exhausted()) {
            let left = b.time_left();
            let others = self.demand_besides(a, b, left);
            b.withhold(others.min((1.0 - ANCHOR_SHARE) * left));
            self.place_running(a, b, OnShortfall::Preempt);
            b.restore();
        }
        self.admit(b);
        let mut order = std::mem::take(&mut self.order_buf);
        order.clear();
        order.extend(self.running.iter().copied().filter(|&i| {
            let r = self.req(i);
            r.state == RequestState::Prefilling && r.touched_step != step
        }));
        let reqs = &self.reqs;
        order.sort_by_key(|&i| {
            let r = reqs[i as usize].as_ref().expect("live");
            r.tokens.len() - r.num_computed
        });
        for &idx in &order {
            if b.exhausted() {
                break;
            }
            // A victim of an earlier placement in this loop is no longer running.
            let r = self.req(idx);
            if r.state == RequestState::Prefilling && r.touched_step != step {
                self.place_running(idx, b, OnShortfall::Preempt);
            }
        }
        self.order_buf = order;
    }

    /// Predicted milliseconds the prefills other than `anchor` would take this step (their
    /// remaining prompts, each capped at `max_batch_tokens`), counted up to `limit`.
    fn demand_besides(&self, anchor: u32, b: &Budget, limit: f64) -> f64 {
        let cap = self.cfg.max_batch_tokens;
        let mut demand = 0.0;
        let step = self.step;
        let in_flight = self.running.iter().filter(|&&i| {
            let r = self.req(i);
            i != anchor && r.state == RequestState::Prefilling && r.touched_step != step
        });
        let queued = self.waiting.values().chain(self.swapped.values());
        for &i in in_flight.chain(queued) {
            let r = self.req(i);
            demand += b.row_ms(r.num_computed, (r.tokens.len() - r.num_computed).min(cap));
            if demand >= limit {
                break;
            }
        }
        demand
    }

    /// The shape of the plan just built (for the cost model, with `max_step_ms` only) and
    /// the time-budget stats of the step.
    pub(super) fn record_shape(&mut self, b: &Budget) {
        if self.cfg.max_step_ms.is_none() {
            self.cur.shape = None;
            self.cur.time = None;
            return;
        }
        let mut shape = StepShape::empty();
        let mut first_prefill = None;
        for row in &self.plan.rows {
            shape.add(&self.geo.row(row.start as usize, row.q as usize));
            if first_prefill.is_none() && row.q > 1 && row.spec == 0 {
                first_prefill = Some(row.start as usize);
            }
        }
        self.stats.step_predicted_ms = self.cost.predict(&shape.x);
        self.cur.shape = Some(shape);
        if b.time.is_none() {
            self.cur.time = None;
        }
        match self.cur.time {
            Some((coef, allowance)) => {
                self.stats.time_budget_steps += 1;
                self.stats.prefill_budget_ms = allowance;
                self.stats.prefill_budget_tokens = coef.tokens_within(
                    &self.geo,
                    allowance,
                    first_prefill.unwrap_or(0),
                    self.cfg.max_batch_tokens,
                );
            }
            None => {
                self.stats.prefill_budget_ms = 0.0;
                self.stats.prefill_budget_tokens = self.cfg.max_batch_tokens;
            }
        }
    }

    /// Report the measured time of the step whose plan the last `update()` applied (the
    /// forward and sampling, `seconds` > 0). Returns whether the cost model took it: false
    /// without `max_step_ms`, or when that step's time was reported already.
    pub fn report_step_time(&mut self, seconds: f64) -> Result<bool> {
        if !seconds.is_finite() || seconds <= 0.0 {
            return Err(Error::invalid(
                "seconds",
                format!("seconds must be a finite number > 0 (got {seconds})"),
            ));
        }
        match self.last_shape.take() {
            Some(shape) => {
                self.cost.observe(&shape, seconds * 1000.0);
                self.stats.cost_samples += 1;
                self.stats.cost_coef = self.cost.coef().0;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The last `schedule()`'s prefill allowance: (milliseconds, tokens at its first
    /// prefill row's context); (0.0, `max_batch_tokens`) when the time budget did not bind.
    /// O(1).
    pub fn prefill_budget(&self) -> (f64, usize) {
        (
            self.stats.prefill_budget_ms,
            self.stats.prefill_budget_tokens,
        )
    }

    /// The cost model (read-only).
    pub fn cost_model(&self) -> &super::CostModel {
        &self.cost
    }

    /// The time-budget invariants of the outstanding plans: the prefill chunks (rows of
    /// more than one token) of a plan made with the budget binding cost, as predicted when
    /// it was made, at most the allowance it had; the cost model's coefficients are finite
    /// and non-negative.
    pub(super) fn check_time_budget(&self) -> std::result::Result<(), String> {
        let c = self.cost.coef().0;
        if c.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(format!("cost model coefficients {c:?}"));
        }
        for (f, p) in self.flights().zip(self.outstanding_plans()) {
            let Some((coef, allowance)) = f.time else {
                continue;
            };
            let spent: f64 = p
                .rows
                .iter()
                .filter(|r| r.q > 1)
                .map(|r| coef.predict(&self.geo.row(r.start as usize, r.q as usize)))
                .sum();
            if spent > allowance + 1e-6 * allowance.abs().max(1.0) {
                return Err(format!(
                    "plan of step {}: prefill chunks predicted {spent} ms > allowance {allowance} ms",
                    f.step
                ));
            }
        }
        Ok(())
    }
}
