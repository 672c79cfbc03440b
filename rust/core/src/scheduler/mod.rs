//! The continuous-batching scheduler: budgets, admission, chunked prefill, prefix cache,
//! preemption (swap-out / soft reset), plan building and update. KV memory (chunks, swap
//! slots, prefix cache) belongs to [`crate::kv::KvManager`]; the scheduler decides which
//! request gets what and asks it.
//!
//! Module tree, by concern:
//! * `config`: configuration, validation, derived limits.
//! * `requests`: the request API (`add_request`, `check_fits`, `cancel`, `recompute`).
//! * `budget`: the token / row / cache-read budgets of a step.
//! * `placement`: running requests into rows (`schedule()` phase 1).
//! * `preemption`: victim choice, swap-out or soft reset.
//! * `admission`: swapped and waiting requests into rows (phase 2).
//! * `steady`: the steady decode path (a plan advanced in place) and the state it carries.
//! * `ahead`: running requests into an ahead plan (`schedule_ahead()` phase 1).
//! * `build`: the plan's per-row arrays and block tables (phase 3).
//! * `update`: applying sampled tokens, finishing requests, reporting deltas.
//! * `invariants`: `check_invariants()`, the whole state.
//!
//! # Step
//! `schedule()` builds a [`StepPlan`] in three phases:
//! 1. running requests in queue order (`fifo`: decodes, then in-flight prefills;
//!    `prefill_first`: in-flight prefills, then decodes). A row that needs chunks the pool
//!    does not have is first shrunk (prefills only), else it preempts: the victim is the
//!    running request with the largest `(priority, arrival)` key not already placed in this
//!    step (possibly the requester itself), never the last active one. A victim is swapped
//!    out when `cpu_offload_blocks` has room for all its chunks, else soft-reset. Then the
//!    row retries within the same call.
//!    With `priority_preemption`, before phase 1: while the best-keyed swapped or waiting
//!    request could not be admitted (a row, one token's chunks above the safety margin),
//!    the running request of strictly lower priority with the largest key (and fewer than
//!    `MAX_PRIORITY_PREEMPTIONS` priority preemptions so far) is preempted the same way;
//!    queued requests age (`preemption` docs: the starvation bound).
//! 2. swapped and waiting requests, merged in `(priority, arrival)` order (head of line:
//!    admission stops at the first one that does not fit), while the free fraction of the
//!    pool is at least `safety_margin` (ignored when nothing is running). Admission is
//!    atomic: prefix hits are taken and chunks allocated only once everything fits.
//! 3. the arrays are built from the chosen rows.
//!
//! `update()` advances every row, appends sampled tokens, checks stop conditions, registers
//! newly full computed blocks in the prefix cache, frees finished requests and returns the
//! deltas.
//!
//! # One plan ahead
//! `schedule()` needs no plan outstanding. `schedule_ahead()` needs exactly one and plans the
//! step after it before its tokens are known (placeholders + `prev_token_index`, no
//! preemption); `update()` applies to the oldest outstanding plan. Chunk lifetime: no chunk
//! referenced by an outstanding plan is freed, evicted or reallocated while it is outstanding
//! (frees of requests it references are deferred to its update, held in its `Flight`).
//!
//! # Deadlock freedom
//! `add_request` rejects anything whose whole lifetime (`prompt + max_new_tokens - 1`
//! cached tokens) needs more chunks than the pool, or more cache reads than
//! `max_batch_cache_tokens`. A lone active request therefore always fits (every other chunk
//! is free or cached), preemption never takes the last active request, and admission with
//! nothing running ignores the safety margin: whenever a request is unfinished, `schedule()`
//! returns a plan.

mod admission;
mod ahead;
mod budget;
mod build;
mod config;
mod cost;
mod fair;
mod invariants;
mod placement;
mod preemption;
mod requests;
mod spec;
mod steady;
mod update;

#[cfg(test)]
mod fair_tests;
#[cfg(test)]
mod sim_tests;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};

pub use admission::MAX_ADMISSION_DEFERRALS;
pub use config::{AttentionType, SchedulerConfig, SchedulerType};
pub use cost::{Coef, CostModel, Geometry, StepShape};
pub use spec::ngram_lookup;

use crate::alloc::Layout;
use crate::kv::{Held, KvManager};
use crate::plan::{StepOutput, StepPlan};
use crate::pool::ChunkPool;
use crate::request::{Request, RequestState};
use crate::swap::SwapPool;
use crate::{ChunkId, Error, Result};
use budget::Budget;
use steady::{PlanShape, SteadyState};

/// Counters and gauges (`Scheduler.stats()`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub num_blocks: usize,
    /// Allocatable chunks: uninitialized + cached.
    pub num_free_blocks: usize,
    /// Free chunks that keep a hashed block (reclaimed LRU-first when needed).
    pub num_cached_blocks: usize,
    /// Chunks with refcount > 0. `num_used_blocks + num_free_blocks == num_blocks`.
    pub num_used_blocks: usize,
    pub waiting: usize,
    pub running: usize,
    pub swapped: usize,
    pub finished: u64,
    /// Prompt tokens served from the prefix cache (summed over admissions).
    pub prefix_hit_tokens: u64,
    /// Tokens of the (compute) prompts admitted (summed over admissions).
    pub prompt_tokens: u64,
    /// Admissions put off a step to share a block another row of that step fills.
    pub deferred_admissions: u64,
    pub num_preemptions: u64,
    /// Preemptions made for a waiting request of higher priority (`priority_preemption`;
    /// counted in `num_preemptions` too).
    pub priority_preemptions: u64,
    pub num_offloads: u64,
    pub num_soft_resets: u64,
    /// Requests recomputed on the caller's demand (`recompute()`), not by preemption.
    pub num_recomputes: u64,
    pub num_evictions: u64,
    pub num_swap_free: usize,
    pub steps: u64,
    pub generated_tokens: u64,
    /// Last `schedule()` / `schedule_ahead()`: rows that found the pool short of chunks
    /// (before preemption; `schedule_ahead()` leaves them out).
    pub stalled_requests: usize,
    /// Last `schedule()` / `schedule_ahead()`: chunks those rows were missing in total.
    pub stalled_blocks: usize,
    /// Speculative rows planned (`schedule()` rows with proposals).
    pub spec_rows: u64,
    /// Proposed tokens those rows carried.
    pub spec_proposed: u64,
    /// Proposed tokens accepted by their updates.
    pub spec_accepted: u64,
    /// Steps planned with the step-time budget binding (`max_step_ms`).
    pub time_budget_steps: u64,
    /// Last `schedule()`: the predicted milliseconds its prefill chunks were allowed
    /// (0.0 when the time budget did not bind).
    pub prefill_budget_ms: f64,
    /// Last `schedule()`: the prefill tokens that allowance buys at its first prefill row's
    /// context (`max_batch_tokens` when the time budget did not bind).
    pub prefill_budget_tokens: usize,
    /// Last `schedule()`: its predicted time (ms; 0.0 without `max_step_ms`).
    pub step_predicted_ms: f64,
    /// Step times reported (`report_step_time`) and taken by the cost model.
    pub cost_samples: u64,
    /// The cost model's coefficients (ms): per step, per query token, per row, per
    /// thousand keys attended in full / sliding layers.
    pub cost_coef: [f64; 5],
}

/// What one outstanding plan owes, settled by its `update()`.
#[derive(Clone, Debug, Default)]
struct Flight {
    /// `step` of the plan.
    step: u64,
    /// Sampled rows of the plan.
    sampled: usize,
    /// Chunk references and swap slots held for the plan (released by its update).
    held: Held,
    /// The plan may have rows of requests that finished or were cancelled (reported by an
    /// update made while it was outstanding): its update takes the general path, which
    /// skips them.
    dead_rows: bool,
    /// The plan has the rows (requests, order) of the plan built just before it, so its
    /// update's deltas repeat the previous update's requests (`output_repeats_requests`).
    repeats: bool,
    /// The plan has a speculative row (`spec`): its update takes the general path, and no
    /// plan is built ahead of it.
    spec: bool,
    /// The plan's shape for the cost model (with `max_step_ms` only).
    shape: Option<StepShape>,
    /// With the time budget binding: the coefficients it was planned with and the
    /// milliseconds its prefill chunks were allowed (checked by `check_invariants`).
    time: Option<(Coef, f64)>,
}

/// Which outstanding plan: the newest (`plan`, flight `cur`: the only one when one is
/// outstanding) or the oldest of two (`prev_plan`, flight `old`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PlanSlot {
    Oldest,
    Newest,
}

/// The scheduler. See the module docs.
#[derive(Clone, Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    margin: f64,
    /// Longest request lifetime (`prompt + max_new_tokens - 1`) that `check_fits` accepts.
    max_lifetime: usize,
    /// The one owner of chunks, swap slots and the prefix cache.
    kv: KvManager,
    reqs: Vec<Option<Request>>,
    free_idx: Vec<u32>,
    ids: HashMap<String, u32>,
    waiting: BTreeMap<(i64, u64), u32>,
    swapped: BTreeMap<(i64, u64), u32>,
    /// Active requests (hold device chunks), sorted by key.
    running: Vec<u32>,
    arrivals: u64,
    step: u64,
    /// The newest plan (outstanding or not); its `Flight` is `cur`.
    plan: StepPlan,
    /// With two plans outstanding: the oldest one (its `Flight` is `old`). Otherwise a spare
    /// buffer.
    prev_plan: StepPlan,
    /// Outstanding plans: 0, 1 (`plan`) or 2 (`prev_plan`, then `plan`).
    outstanding: u8,
    cur: Flight,
    old: Flight,
    /// `step` of the plan the running `update()` applies.
    upd_step: u64,
    /// `schedule_ahead()` scratch: slab index -> row of the outstanding plan (`u32::MAX`).
    row_of: Vec<u32>,
    /// `schedule_ahead()` scratch: (token index, previous sampled index) of placeholders.
    ahead_tokens: Vec<(u32, i32)>,
    /// What the steady decode path carries between calls.
    steady: SteadyState,
    out: StepOutput,
    pending_cancel: Vec<u32>,
    /// Finished requests already reported, with the step of the last plan that has a row of
    /// theirs: the slab slot is freed by the first update after that plan's update (the
    /// deltas name it until then, and that plan's update must still see it finished).
    to_remove: Vec<(u32, u64)>,
    order_buf: Vec<u32>,
    hits_buf: Vec<ChunkId>,
    /// Hashes of the blocks the step being planned makes full (`schedule()` only, and only
    /// while requests wait): a waiting request whose next block is one of them is admitted
    /// a step later, with that block as a prefix hit (see `admission`).
    filling: Vec<u64>,
    collect_filling: bool,
    /// Waiting requests put off in this step's admission (back in `waiting` after it).
    deferred_buf: Vec<u32>,
    /// Slab indices of requests with a pending proposal (`propose`).
    proposed: Vec<u32>,
    /// `propose_ngram` scratch.
    spec_buf: Vec<crate::Token>,
    /// The step-time cost model (`max_step_ms`), fed by `report_step_time`.
    cost: CostModel,
    geo: Geometry,
    /// The shape of the plan the last `update()` applied, waiting for its measured time.
    last_shape: Option<StepShape>,
    stats: Stats,
}

impl Scheduler {
    /// Validate `cfg` (errors name the field) and build an empty scheduler.
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        let d = config::validate(&cfg)?;
        let cost = CostModel::default();
        let stats = Stats {
            num_blocks: cfg.num_blocks,
            prefill_budget_tokens: cfg.max_batch_tokens,
            cost_coef: cost.coef().0,
            ..Default::default()
        };
        let geo = Geometry {
            has_full: d.layout.has_full,
            window: if d.layout.has_sliding {
                cfg.sliding_window
            } else {
                None
            },
        };
        let plan = StepPlan {
            has_full: d.layout.has_full,
            has_sliding: d.layout.has_sliding,
            ..Default::default()
        };
        let prev_plan = plan.clone();
        Ok(Scheduler {
            kv: KvManager::new(
                cfg.num_blocks,
                d.layout,
                d.prefix,
                cfg.hash_mask,
                cfg.cpu_offload_blocks,
            ),
            margin: d.margin,
            max_lifetime: d.max_lifetime,
            cfg,
            reqs: Vec::new(),
            free_idx: Vec::new(),
            ids: HashMap::new(),
            waiting: BTreeMap::new(),
            swapped: BTreeMap::new(),
            running: Vec::new(),
            arrivals: 0,
            step: 0,
            plan,
            prev_plan,
            outstanding: 0,
            cur: Flight::default(),
            old: Flight::default(),
            upd_step: 0,
            row_of: Vec::new(),
            ahead_tokens: Vec::new(),
            steady: SteadyState::default(),
            out: StepOutput::default(),
            pending_cancel: Vec::new(),
            to_remove: Vec::new(),
            order_buf: Vec::new(),
            hits_buf: Vec::new(),
            filling: Vec::new(),
            collect_filling: false,
            deferred_buf: Vec::new(),
            proposed: Vec::new(),
            spec_buf: Vec::new(),
            cost,
            geo,
            last_shape: None,
            stats,
        })
    }

    // ----- schedule --------------------------------------------------------------------

    /// Plan the next step (None when nothing can run). Errors if a plan is outstanding.
    pub fn schedule(&mut self) -> Result<Option<&StepPlan>> {
        if self.outstanding > 0 {
            return Err(Error::runtime(
                "schedule() called while a plan is outstanding: call update() first",
            ));
        }
        let mut b = self.begin_step();
        b = self.bind_time(b);
        self.cur.repeats = false;
        self.cur.spec = false;
        self.filling.clear();
        self.collect_filling =
            self.cfg.defer_shared_prefixes && self.kv.prefix_caching() && !self.waiting.is_empty();
        // Phase 1: the running rows, advanced in place on a steady step, else placed anew
        // (always with proposals: speculative rows).
        let ready = self.steady.take_ready();
        // a waiting request of higher priority takes running requests' places first
        if self.cfg.priority_preemption {
            self.age_queued();
        }
        let preempting = self.cfg.priority_preemption && self.priority_victim().is_some();
        let steady = ready
            && !preempting
            && self.proposed.is_empty()
            && self.advance_steady::<false>(&mut b);
        if steady && self.plan.ahead {
            // Advanced from an ahead plan: every input id is known now.
            self.plan.ahead = false;
            self.plan.prev_token_index.clear();
        }
        // Rows `..from` were advanced in place (all their columns written).
        let from = if steady { self.plan.rows.len() } else { 0 };
        if !steady {
            self.plan.clear();
            if preempting {
                self.preempt_for_priority();
            }
            self.place_running_rows(&mut b);
        }
        if !self.proposed.is_empty() {
            self.clear_proposals();
        }
        // Phase 2: swapped and waiting requests (with the time budget binding: the oldest
        // in-flight prefill, then admissions, then the other in-flight prefills, see `fair`).
        if b.time.is_some() {
            self.place_prefills_fairly(&mut b);
        } else {
            self.admit(&mut b);
        }
        if self.plan.rows.is_empty() {
            debug_assert!(self.plan.swap_out.is_empty() && self.plan.swap_in.is_empty());
            debug_assert!(
                self.running.is_empty() && self.waiting.is_empty() && self.swapped.is_empty()
            );
            if self.plan.swap_out.is_empty() && self.plan.swap_in.is_empty() {
                return Ok(None);
            }
        }
        // Phase 3: the arrays.
        build::fill_row_arrays(&mut self.plan, from);
        self.build_block_tables(from);
        self.outstanding = 1;
        self.cur.step = self.step;
        self.cur.sampled = self.plan.logits_indices.len();
        self.stats.steps += 1;
        self.record_shape(&b);
        // Advanced in place with nothing appended: still the running rows in order.
        let repeated = steady && self.plan.rows.len() == from;
        self.steady.plan = if repeated || self.is_steady_plan() {
            PlanShape::Steady
        } else {
            PlanShape::General
        };
        self.cur.repeats = repeated;
        Ok(Some(&self.plan))
    }

    /// Plan the step that follows the outstanding plan, before its sampled tokens are known
    /// (async batching: the engine plans step N+1 while step N runs). Requires exactly one
    /// outstanding plan (else a `Runtime` error naming the problem); the new plan is then
    /// outstanding too, and `update()` applies to the oldest first.
    ///
    /// Every request sampled in the outstanding plan is assumed to get one token whose value
    /// is not known yet and not to stop; it gets a one-token row whose input id is that
    /// token: `input_ids` holds 0 there and `prev_token_index` the index of the token among
    /// the outstanding plan's sampled tokens. Requests whose finish is certain (that token
    /// reaches `max_new_tokens`) are left out. Prefill rows of the outstanding plan continue
    /// their prompt; other running requests are placed from their state, and waiting
    /// requests are admitted (budgets, safety margin and head of line as usual; a swapped
    /// request at the head stops admission: resuming needs a swap-in).
    ///
    /// Never preempts: no swap-out, swap-in or soft reset; a row that cannot get its chunks
    /// is left out (counted in `stalled_requests` / `stalled_blocks`), and chunks come only
    /// from the free lists (uninitialized, then eviction of unreferenced cached blocks).
    /// Returns None, with nothing changed but the stats, when no row fits: then `update()`
    /// the outstanding plan and go back to `schedule()`.
    ///
    /// Chunk lifetime: no chunk referenced by an outstanding plan (block tables, slot
    /// mappings, swap pairs) is freed, evicted or reallocated while it is outstanding:
    /// frees of requests it references are deferred to its update (see `cancel`, `update`),
    /// and swap-out sources it released at plan time are pinned here until its update.
    /// Prefix lookups only see blocks registered by earlier updates (computed content).
    pub fn schedule_ahead(&mut self) -> Result<Option<&StepPlan>> {
        match self.outstanding {
            0 => {
                return Err(Error::runtime(
                    "schedule_ahead() needs exactly one outstanding plan but none is: \
                     call schedule() first",
                ))
            }
            2 => {
                return Err(Error::runtime(
                    "schedule_ahead() needs exactly one outstanding plan but two are: \
                     call update() first",
                ))
            }
            _ => {}
        }
        if self.cur.spec {
            // Its accepted counts decide the next positions: nothing can be planned ahead.
            return Ok(None);
        }
        self.steady.take_ready();
        let mut b = self.begin_step();
        // Swap-out sources the outstanding plan freed at plan time (its copy runs before
        // its forward): pinned until its update.
        self.kv
            .pin_swap_sources(&self.plan.swap_out, &mut self.cur.held);
        self.ahead_tokens.clear();
        // Phase 1: a steady outstanding plan is kept for its update and advanced in place,
        // one token further (like `schedule()`); otherwise the running rows are placed from
        // where the outstanding plan leaves them, into a fresh plan.
        let n = self.plan.rows.len();
        let steady = self.ahead_is_steady() && {
            self.plan.copy_arrays_to(&mut self.prev_plan);
            self.prev_plan.rows.clone_from(&self.plan.rows);
            self.advance_steady::<true>(&mut b)
        };
        let from = if steady {
            let p = &mut self.plan;
            p.ahead = true;
            p.prev_token_index.clear();
            p.prev_token_index.extend(0..n as i32);
            n
        } else {
            self.place_ahead_rows(&mut b);
            0
        };
        // Phase 2: waiting requests (no swap-in ahead).
        self.admit_ahead(&mut b);
        if self.plan.rows.is_empty() {
            std::mem::swap(&mut self.plan, &mut self.prev_plan);
            return Ok(None);
        }
        // Phase 3: the arrays, and the placeholders' sources.
        build::fill_row_arrays(&mut self.plan, from);
        self.build_block_tables(from);
        let p = &mut self.plan;
        p.prev_token_index.resize(p.input_ids.len(), -1);
        for &(t, j) in &self.ahead_tokens {
            p.prev_token_index[t as usize] = j;
        }
        // `cur` (the outstanding plan's flight) becomes `old`; `old` was settled: empty.
        debug_assert!(self.old.held.is_empty());
        std::mem::swap(&mut self.old, &mut self.cur);
        let repeated = steady && self.plan.rows.len() == from;
        self.cur.step = self.step;
        self.cur.sampled = self.plan.logits_indices.len();
        self.cur.repeats = repeated;
        self.cur.spec = false;
        self.cur.time = None;
        self.cur.shape = None;
        self.outstanding = 2;
        // Advanced in place with nothing appended: still every running request, in order.
        self.steady.plan = if repeated {
            PlanShape::Steady
        } else {
            PlanShape::General
        };
        self.stats.steps += 1;
        Ok(Some(&self.plan))
    }

    // ----- update ----------------------------------------------------------------------

    /// Apply the sampled tokens (one per `logits_indices` entry, in order) of the oldest
    /// outstanding plan (FIFO) and return the deltas. Without an outstanding plan,
    /// `update(&[])` only reports pending cancellations.
    ///
    /// Rows of requests that finished (stop) in an earlier update or were cancelled after
    /// the plan was built are ignored: no delta, token dropped. Chunks whose frees were
    /// deferred past this plan (see [`Scheduler::cancel`]) are freed first; a request that
    /// finishes here while a newer outstanding plan has a row of it keeps its chunks held
    /// for that plan until its update.
    pub fn update(&mut self, sampled: &[i32]) -> Result<&StepOutput> {
        self.check_sampled(sampled)?;
        let two = self.outstanding == 2;
        let oldest = if two {
            PlanSlot::Oldest
        } else {
            PlanSlot::Newest
        };
        // The forward (and copies) of this plan are done: release what was held for it.
        if self.outstanding > 0 {
            self.last_shape = match oldest {
                PlanSlot::Oldest => self.old.shape.take(),
                PlanSlot::Newest => self.cur.shape.take(),
            };
        }
        let dead_rows = self.settle(oldest);
        self.upd_step = self.flight(oldest).step;
        self.drop_reported();
        self.out.clear();
        self.steady.take_ready();
        let prev_deltas = std::mem::take(&mut self.steady.deltas);
        if two {
            // The rows below are the oldest plan's: swapped back after the loop.
            std::mem::swap(&mut self.plan.rows, &mut self.prev_plan.rows);
        }
        let any_finished = if self.outstanding == 0 {
            false
        } else if sampled.len() == self.plan.rows.len()
            && self.pending_cancel.is_empty()
            && !dead_rows
            && !self.flight(oldest).spec
        {
            // Every row sampled, nothing cancelled since the plan was built (a cancellation
            // is always queued in `pending_cancel`) and no row finished by an earlier update.
            self.update_every_row(sampled, oldest, prev_deltas)
        } else {
            self.update_rows(sampled)
        };
        if two {
            std::mem::swap(&mut self.plan.rows, &mut self.prev_plan.rows);
        }
        if any_finished {
            let reqs = &self.reqs;
            self.running.retain(|&i| {
                reqs[i as usize].as_ref().expect("live").state != RequestState::Finished
            });
        }
        // The newer plan, still outstanding, may have rows of what finished or was
        // cancelled here.
        if two && (any_finished || !self.pending_cancel.is_empty()) {
            self.cur.dead_rows = true;
        }
        self.report_cancellations();
        // With two, the newer plan (`plan`, `cur`) is now the only one.
        self.outstanding = self.outstanding.saturating_sub(1);
        Ok(&self.out)
    }

    /// Start a new step: counters reset, full budgets returned.
    fn begin_step(&mut self) -> Budget {
        self.step += 1;
        self.collect_filling = false;
        self.stats.stalled_requests = 0;
        self.stats.stalled_blocks = 0;
        Budget::new(&self.cfg)
    }

    // ----- accessors -------------------------------------------------------------------

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    pub fn layout(&self) -> &Layout {
        self.kv.layout()
    }
    /// Effective safety margin.
    pub fn safety_margin(&self) -> f64 {
        self.margin
    }
    /// Whether prefix caching is active.
    pub fn prefix_caching(&self) -> bool {
        self.kv.prefix_caching()
    }
    /// The KV memory owner (read-only).
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }
    pub fn pool(&self) -> &ChunkPool {
        self.kv.pool()
    }
    pub fn swap_pool(&self) -> &SwapPool {
        self.kv.swap()
    }
    /// Request in slab slot `idx` (finished ones stay until the update after they were
    /// reported).
    pub fn request(&self, idx: u32) -> Option<&Request> {
        self.reqs.get(idx as usize).and_then(|r| r.as_ref())
    }
    /// Slab index of an unfinished (or not yet reported) request.
    pub fn request_index(&self, id: &str) -> Option<u32> {
        self.ids.get(id).copied()
    }
    /// Live (not finished) requests, by slab index.
    pub fn live_requests(&self) -> impl Iterator<Item = (u32, &Request)> {
        self.reqs.iter().enumerate().filter_map(|(i, r)| match r {
            Some(r) if r.state != RequestState::Finished => Some((i as u32, r)),
            _ => None,
        })
    }
    /// Swap slots held for outstanding plans: read by their swap-in, or written by their
    /// swap-out for a request cancelled since (released by those plans' updates).
    pub fn deferred_swap_slots(&self) -> Vec<u32> {
        self.flights()
            .flat_map(|f| f.held.slots().iter().copied())
            .collect()
    }
    /// Chunk references held for outstanding plans rather than by requests: chunks of
    /// requests that finished or were cancelled while a plan referencing them was
    /// outstanding, and pinned swap-out sources (freed by those plans' updates).
    pub fn deferred_chunks(&self) -> Vec<ChunkId> {
        self.flights()
            .flat_map(|f| f.held.chunks().iter().copied())
            .collect()
    }
    /// Flights of the outstanding plans, oldest first.
    fn flights(&self) -> impl Iterator<Item = &Flight> {
        let n = self.outstanding as usize;
        [&self.old, &self.cur].into_iter().skip(2 - n)
    }
    /// The newest plan (the outstanding one, or the newer of two).
    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }
    /// The outstanding plans, oldest first (0, 1 or 2).
    pub fn outstanding_plans(&self) -> impl Iterator<Item = &StepPlan> {
        let n = self.outstanding as usize;
        [&self.prev_plan, &self.plan].into_iter().skip(2 - n)
    }
    /// Number of outstanding plans (0, 1 or 2).
    pub fn num_outstanding(&self) -> usize {
        self.outstanding as usize
    }
    /// Export the arrays of the plan just built: they are copied into `spare`'s buffers
    /// (reusing their capacity; see [`StepPlan::copy_arrays_to`]). The scheduler keeps its
    /// own, which a steady decode step advances in place.
    pub fn export_plan(&mut self, spare: &mut StepPlan) {
        self.plan.copy_arrays_to(spare);
    }
    /// Export the deltas of the last `update()` by exchanging buffers with `spare` (cleared).
    pub fn export_output(&mut self, spare: &mut StepOutput) {
        spare.clear();
        std::mem::swap(&mut self.out, spare);
    }
    pub fn has_outstanding_plan(&self) -> bool {
        self.outstanding > 0
    }
    /// True while a request is waiting, running or swapped, or a cancellation is unreported.
    /// If `schedule()` returns None while this is true, only reports remain: `update(&[])`.
    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty()
            || !self.waiting.is_empty()
            || !self.swapped.is_empty()
            || !self.pending_cancel.is_empty()
    }
    /// Whether the deltas of the last `update()` name the same requests, in the same order,
    /// as the update before it (both one delta per row of the same rows).
    pub fn output_repeats_requests(&self) -> bool {
        self.steady.deltas_repeat()
    }
    /// Whether the plan just returned by `schedule()` / `schedule_ahead()` has the same rows
    /// (requests, order) as the plan before it, advanced in place by one decode token each.
    pub fn plan_repeats_rows(&self) -> bool {
        self.cur.repeats
    }

    /// Chunks `allocate` can hand out now: uninitialized ones *and* cached ones (free chunks
    /// that still keep a hashed block, evicted LRU-first when needed). O(1).
    pub fn num_free_blocks(&self) -> usize {
        self.kv.pool().num_free()
    }
    /// Free chunks that keep a hashed block (part of `num_free_blocks`). O(1).
    pub fn num_cached_blocks(&self) -> usize {
        self.kv.pool().num_cached()
    }
    /// Requests waiting for admission (never run, or soft-reset). O(1).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    /// Requests holding device chunks (prefilling or decoding). O(1).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// Requests offloaded to the CPU swap pool. O(1).
    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }
    /// Rows the last plan found short of chunks (`stats().stalled_requests`): in `schedule()`
    /// counted before preemption makes room, in `schedule_ahead()` (which never preempts)
    /// the running requests it left out. O(1).
    pub fn num_stalled(&self) -> usize {
        self.stats.stalled_requests
    }

    /// With `priority_preemption`: a waiting or swapped request can't be admitted and a
    /// running one of lower priority could make room (only `schedule()` preempts, so a
    /// pipelined caller should plan with it next).
    pub fn wants_priority_preemption(&self) -> bool {
        self.cfg.priority_preemption && self.priority_victim().is_some()
    }

    pub fn stats(&self) -> Stats {
        let pool = self.kv.pool();
        let mut s = self.stats.clone();
        s.num_free_blocks = pool.num_free();
        s.num_cached_blocks = pool.num_cached();
        s.num_used_blocks = pool.num_used();
        s.waiting = self.waiting.len();
        s.running = self.running.len();
        s.swapped = self.swapped.len();
        s.num_evictions = pool.num_evictions();
        s.num_swap_free = self.kv.swap().num_free();
        s
    }

    #[inline]
    fn req(&self, idx: u32) -> &Request {
        self.reqs[idx as usize].as_ref().expect("live slab slot")
    }
    #[inline]
    fn req_mut(&mut self, idx: u32) -> &mut Request {
        self.reqs[idx as usize].as_mut().expect("live slab slot")
    }

    fn flight(&self, slot: PlanSlot) -> &Flight {
        match slot {
            PlanSlot::Oldest => &self.old,
            PlanSlot::Newest => &self.cur,
        }
    }

    /// The outstanding plan built in step `step`, if any.
    #[inline]
    fn flight_of(&self, step: u64) -> Option<PlanSlot> {
        if self.outstanding >= 1 && step == self.cur.step {
            Some(PlanSlot::Newest)
        } else if self.outstanding == 2 && step == self.old.step {
            Some(PlanSlot::Oldest)
        } else {
            None
        }
    }
}
