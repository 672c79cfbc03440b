//! The continuous-batching scheduler: budgets, admission, chunked prefill, prefix cache,
//! preemption (swap-out / soft reset), plan building and update.
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
//! (frees of requests it references are deferred to its update; see `schedule_ahead`).
//!
//! # Deadlock freedom
//! `add_request` rejects anything whose whole lifetime (`prompt + max_new_tokens - 1`
//! cached tokens) needs more chunks than the pool, or more cache reads than
//! `max_batch_cache_tokens`. A lone active request therefore always fits (every other chunk
//! is free or cached), preemption never takes the last active request, and admission with
//! nothing running ignores the safety margin: whenever a request is unfinished, `schedule()`
//! returns a plan.

use std::collections::{BTreeMap, HashMap};

use crate::alloc::Layout;
use crate::plan::{Row, StepOutput, StepPlan};
use crate::pool::ChunkPool;
use crate::prefix::BlockHasher;
use crate::request::{FinishReason, Request, RequestState, StopConditions};
use crate::swap::SwapPool;
use crate::{ChunkId, Error, Result, Token};

/// Scheduling policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerType {
    /// Decodes, then in-flight prefills, then new requests.
    Fifo,
    /// In-flight prefills, then decodes, then new requests.
    PrefillFirst,
}

impl SchedulerType {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "fifo" => Ok(SchedulerType::Fifo),
            "prefill_first" => Ok(SchedulerType::PrefillFirst),
            _ => Err(Error::invalid(
                "scheduler_type",
                format!("scheduler_type must be 'fifo' or 'prefill_first' (got {s:?})"),
            )),
        }
    }
}

/// Attention type of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionType {
    Full,
    Sliding,
}

impl AttentionType {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "full_attention" => Ok(AttentionType::Full),
            "sliding_attention" => Ok(AttentionType::Sliding),
            _ => Err(Error::invalid(
                "layer_types",
                format!(
                    "layer_types entries must be 'full_attention' or 'sliding_attention' (got {s:?})"
                ),
            )),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            AttentionType::Full => "full_attention",
            AttentionType::Sliding => "sliding_attention",
        }
    }
}

/// Scheduler configuration (field names as in the Python `Scheduler(...)`).
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub page_size: usize,
    pub max_batch_tokens: usize,
    pub max_requests_per_batch: usize,
    /// Budget on the sum of `seqlens_k` of a step (None = unlimited).
    pub max_batch_cache_tokens: Option<usize>,
    pub scheduler_type: SchedulerType,
    /// None = default (0.15 fifo, 0.0 prefill_first).
    pub safety_margin: Option<f64>,
    pub allow_block_sharing: bool,
    pub layer_types: Vec<AttentionType>,
    pub sliding_window: Option<usize>,
    pub cpu_offload_blocks: usize,
    /// Testing only: mask applied to block hashes (shrink it to force twin hashes).
    pub hash_mask: u64,
}

impl SchedulerConfig {
    /// Defaults as in the Python signature.
    pub fn new(num_blocks: usize, page_size: usize, max_batch_tokens: usize) -> Self {
        SchedulerConfig {
            num_blocks,
            page_size,
            max_batch_tokens,
            max_requests_per_batch: 256,
            max_batch_cache_tokens: None,
            scheduler_type: SchedulerType::Fifo,
            safety_margin: None,
            allow_block_sharing: true,
            layer_types: vec![AttentionType::Full],
            sliding_window: None,
            cpu_offload_blocks: 0,
            hash_mask: u64::MAX,
        }
    }
}

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
    pub num_preemptions: u64,
    pub num_offloads: u64,
    pub num_soft_resets: u64,
    /// Requests recomputed on the caller's demand (`recompute()`), not by preemption.
    pub num_recomputes: u64,
    pub num_evictions: u64,
    pub num_swap_free: usize,
    pub steps: u64,
    pub generated_tokens: u64,
    /// Last `schedule()`: rows that found the pool short of chunks (before preemption).
    pub stalled_requests: usize,
    /// Last `schedule()`: chunks those rows were missing in total.
    pub stalled_blocks: usize,
}

/// What one outstanding plan owes the pool, settled by its `update()`.
#[derive(Clone, Debug, Default)]
struct Flight {
    /// `step` of the plan.
    step: u64,
    /// Sampled rows of the plan.
    sampled: usize,
    /// Chunk references held for the plan: chunks of requests that finished or were
    /// cancelled while the plan (the last one referencing them) was outstanding, and pinned
    /// swap-out sources. Freed by the plan's update.
    chunks: Vec<ChunkId>,
    /// Swap slots the plan reads by swap-in or writes by swap-out whose owner was cancelled:
    /// released by the plan's update.
    slots: Vec<u32>,
    /// The plan may have rows of requests that finished or were cancelled (reported by an
    /// update made while it was outstanding): its update takes the general path, which
    /// skips them.
    dead_rows: bool,
    /// The plan has the rows (requests, order) of the plan built just before it, so its
    /// update's deltas repeat the previous update's requests (`output_repeats_requests`).
    repeats: bool,
}

#[derive(Clone, Copy)]
struct Budget {
    tokens: usize,
    rows: usize,
    cache: usize,
}

/// The scheduler. See the module docs.
#[derive(Clone, Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    layout: Layout,
    margin: f64,
    prefix: bool,
    /// Longest request lifetime (`prompt + max_new_tokens - 1`) that `check_fits` accepts.
    max_lifetime: usize,
    pool: ChunkPool,
    swap: SwapPool,
    hasher: BlockHasher,
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
    /// `plan` is a steady decode plan: full attention only, no swaps, one row per running
    /// request in running order, each one sampled token.
    steady_plan: bool,
    /// Set by an `update()` of a steady plan in which nothing finished or was cancelled:
    /// the next `schedule()` may advance the previous plan in place (`schedule_steady`).
    /// Cleared by every other update, by `cancel()` and by `schedule()`.
    steady_ready: bool,
    /// The last `schedule()` advanced the previous plan in place (same rows, same order).
    repeated_rows: bool,
    /// The last `update()` wrote one delta per plan row, in row order.
    bulk_update: bool,
    /// ... and so did the one before, for the same rows: same requests as its deltas.
    out_repeats: bool,
    out: StepOutput,
    pending_cancel: Vec<u32>,
    /// Finished requests already reported, with the step of the last plan that has a row of
    /// theirs: the slab slot is freed by the first update after that plan's update (the
    /// deltas name it until then, and that plan's update must still see it finished).
    to_remove: Vec<(u32, u64)>,
    order_buf: Vec<u32>,
    hits_buf: Vec<ChunkId>,
    stats: Stats,
}

/// A `Value` error naming `field` unless `value >= 1`.
fn at_least_one(field: &'static str, value: usize) -> Result<()> {
    if value < 1 {
        return Err(Error::invalid(
            field,
            format!("{field} must be >= 1 (got {value})"),
        ));
    }
    Ok(())
}

/// Longest lifetime (`prompt + max_new_tokens - 1` cached tokens) any request may have:
/// positions stay far inside int32.
const MAX_LIFETIME: usize = i32::MAX as usize / 2;

/// The value half of `check_fits`: a non-empty prompt and at least one new token.
fn check_lengths(prompt_len: usize, max_new_tokens: usize) -> Result<()> {
    if prompt_len == 0 {
        return Err(Error::invalid(
            "prompt",
            "prompt_token_ids must not be empty",
        ));
    }
    if max_new_tokens < 1 {
        return Err(Error::invalid(
            "max_new_tokens",
            format!("max_new_tokens must be >= 1 (got {max_new_tokens})"),
        ));
    }
    Ok(())
}

/// The longest lifetime whose chunks fit the pool and whose reads fit the cache-read budget.
fn max_lifetime(cfg: &SchedulerConfig, layout: &Layout) -> usize {
    let mut most = MAX_LIFETIME.min(cfg.max_batch_cache_tokens.unwrap_or(usize::MAX));
    if layout.max_chunks(most) > cfg.num_blocks {
        // `max_chunks` is monotone: the largest n with max_chunks(n) <= num_blocks.
        let (mut lo, mut hi) = (0usize, most); // fits(lo), !fits(hi)
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if layout.max_chunks(mid) <= cfg.num_blocks {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        most = lo;
    }
    most
}

impl Scheduler {
    /// Validate `cfg` (errors name the field) and build an empty scheduler.
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        at_least_one("num_blocks", cfg.num_blocks)?;
        at_least_one("page_size", cfg.page_size)?;
        if cfg.num_blocks > ((i32::MAX as usize) / cfg.page_size).saturating_sub(2) {
            return Err(Error::invalid(
                "num_blocks",
                "num_blocks: (num_blocks + 2) * page_size must fit in int32",
            ));
        }
        at_least_one("max_batch_tokens", cfg.max_batch_tokens)?;
        at_least_one("max_requests_per_batch", cfg.max_requests_per_batch)?;
        if let Some(c) = cfg.max_batch_cache_tokens {
            at_least_one("max_batch_cache_tokens", c)?;
        }
        let margin = match cfg.safety_margin {
            Some(m) if !(0.0..1.0).contains(&m) || m.is_nan() => {
                return Err(Error::invalid(
                    "safety_margin",
                    format!("safety_margin must be in [0, 1) (got {m})"),
                ));
            }
            Some(m) => m,
            None => match cfg.scheduler_type {
                SchedulerType::Fifo => 0.15,
                SchedulerType::PrefillFirst => 0.0,
            },
        };
        if cfg.layer_types.is_empty() {
            return Err(Error::invalid(
                "layer_types",
                "layer_types must not be empty",
            ));
        }
        let has_full = cfg.layer_types.contains(&AttentionType::Full);
        let has_sliding = cfg.layer_types.contains(&AttentionType::Sliding);
        let window = if has_sliding {
            match cfg.sliding_window {
                Some(w) if w >= 1 => Some(w),
                Some(w) => {
                    return Err(Error::invalid(
                        "sliding_window",
                        format!("sliding_window must be >= 1 (got {w})"),
                    ))
                }
                None => {
                    return Err(Error::invalid(
                        "sliding_window",
                        "sliding_window is required when layer_types has 'sliding_attention'",
                    ))
                }
            }
        } else {
            None
        };
        let layout = Layout::new(cfg.page_size, has_full, window);
        let prefix = cfg.allow_block_sharing && !has_sliding;
        let mut hasher = BlockHasher::new();
        hasher.mask = cfg.hash_mask;
        let stats = Stats {
            num_blocks: cfg.num_blocks,
            ..Default::default()
        };
        let plan = StepPlan {
            has_full,
            has_sliding,
            ..Default::default()
        };
        let prev_plan = plan.clone();
        let max_lifetime = max_lifetime(&cfg, &layout);
        Ok(Scheduler {
            max_lifetime,
            pool: ChunkPool::new(cfg.num_blocks, cfg.page_size, prefix),
            swap: SwapPool::new(cfg.cpu_offload_blocks),
            hasher,
            layout,
            margin,
            prefix,
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
            out: StepOutput::default(),
            pending_cancel: Vec::new(),
            to_remove: Vec::new(),
            order_buf: Vec::new(),
            hits_buf: Vec::new(),
            steady_plan: false,
            steady_ready: false,
            repeated_rows: false,
            bulk_update: false,
            out_repeats: false,
            stats,
        })
    }

    // ----- accessors -------------------------------------------------------------------

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Effective safety margin.
    pub fn safety_margin(&self) -> f64 {
        self.margin
    }
    /// Whether prefix caching is active.
    pub fn prefix_caching(&self) -> bool {
        self.prefix
    }
    pub fn pool(&self) -> &ChunkPool {
        &self.pool
    }
    pub fn swap_pool(&self) -> &SwapPool {
        &self.swap
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
            .flat_map(|f| f.slots.iter().copied())
            .collect()
    }
    /// Chunk references held for outstanding plans rather than by requests: chunks of
    /// requests that finished or were cancelled while a plan referencing them was
    /// outstanding, and pinned swap-out sources (freed by those plans' updates).
    pub fn deferred_chunks(&self) -> Vec<ChunkId> {
        self.flights()
            .flat_map(|f| f.chunks.iter().copied())
            .collect()
    }
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

    /// Chunks `allocate` can hand out now: uninitialized ones *and* cached ones (free chunks
    /// that still keep a hashed block, evicted LRU-first when needed). O(1).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }
    /// Free chunks that keep a hashed block (part of `num_free_blocks`). O(1).
    pub fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached()
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

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.num_free_blocks = self.pool.num_free();
        s.num_cached_blocks = self.pool.num_cached();
        s.num_used_blocks = self.pool.num_used();
        s.waiting = self.waiting.len();
        s.running = self.running.len();
        s.swapped = self.swapped.len();
        s.num_evictions = self.pool.num_evictions();
        s.num_swap_free = self.swap.num_free();
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

    // ----- requests --------------------------------------------------------------------

    /// Whether a request of `prompt_len` prompt tokens and `max_new_tokens` could ever fit
    /// the cache: exactly the length and capacity checks of `add_request`, adding nothing.
    /// Errors (`Value`) name the field: `"prompt"` (empty, or too long even with one new
    /// token) or `"max_new_tokens"` (below 1, or too many for what the prompt leaves).
    pub fn check_fits(&self, prompt_len: usize, max_new_tokens: usize) -> Result<()> {
        check_lengths(prompt_len, max_new_tokens)?;
        self.check_capacity("the request", prompt_len, max_new_tokens)
    }

    /// Chunks a request holding `cached_tokens` keys needs at most: its full-attention blocks
    /// plus its sliding ring. A request's whole lifetime holds `prompt + max_new_tokens - 1`.
    pub fn lifetime_chunks(&self, cached_tokens: usize) -> usize {
        self.layout.max_chunks(cached_tokens)
    }

    /// The largest `prompt_len + max_new_tokens` that [`Scheduler::check_fits`] accepts
    /// (0 when not even a one-token prompt with one new token fits). O(1).
    pub fn max_request_tokens(&self) -> usize {
        if self.max_lifetime == 0 {
            0
        } else {
            self.max_lifetime + 1
        }
    }

    /// The capacity half of `check_fits` (`who` starts the message).
    fn check_capacity(&self, who: &str, prompt_len: usize, max_new_tokens: usize) -> Result<()> {
        // Blame the prompt when it cannot fit even with a single new token.
        let field = if prompt_len > self.max_lifetime {
            "prompt"
        } else {
            "max_new_tokens"
        };
        let lifetime = prompt_len.saturating_add(max_new_tokens - 1);
        if lifetime > MAX_LIFETIME {
            return Err(Error::invalid(
                field,
                "prompt_token_ids + max_new_tokens is too long",
            ));
        }
        let need = self.layout.max_chunks(lifetime);
        if need > self.cfg.num_blocks {
            return Err(Error::invalid(
                field,
                format!(
                    "{who} can never fit: prompt_token_ids ({prompt_len}) + max_new_tokens \
                     ({max_new_tokens}) need {need} blocks of page_size {} but num_blocks is {}",
                    self.cfg.page_size, self.cfg.num_blocks
                ),
            ));
        }
        if let Some(c) = self.cfg.max_batch_cache_tokens {
            if lifetime > c {
                return Err(Error::invalid(
                    field,
                    format!(
                        "{who} can never fit: prompt_token_ids ({prompt_len}) + max_new_tokens \
                         ({max_new_tokens}) - 1 exceeds max_batch_cache_tokens ({c})"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Add a request. Errors (`Value`) name the field: duplicate `request_id`, empty
    /// `prompt_token_ids`, `max_new_tokens < 1`, an empty stop sequence, or a request that
    /// could never fit (`num_blocks`, `max_batch_cache_tokens`). Returns its slab index.
    pub fn add_request(
        &mut self,
        id: &str,
        prompt: Vec<Token>,
        stop: StopConditions,
        priority: i64,
    ) -> Result<u32> {
        self.add_request_opts(id, prompt, stop, priority, false)
    }

    /// `add_request` with `skip_prefix_lookup`: the request never takes prefix-cache hits
    /// (it computes every prompt position, e.g. because its caller wants the logits of each
    /// one); its computed blocks are still offered to the cache for others.
    pub fn add_request_opts(
        &mut self,
        id: &str,
        prompt: Vec<Token>,
        stop: StopConditions,
        priority: i64,
        skip_prefix_lookup: bool,
    ) -> Result<u32> {
        if self.ids.contains_key(id) {
            return Err(Error::invalid(
                "request_id",
                format!("request_id {id:?} is already in use"),
            ));
        }
        check_lengths(prompt.len(), stop.max_new_tokens)?;
        if stop.stop_sequences.iter().any(|s| s.is_empty()) {
            return Err(Error::invalid(
                "stop_sequences",
                "stop_sequences must not contain an empty sequence",
            ));
        }
        self.check_capacity(
            &format!("request {id:?}"),
            prompt.len(),
            stop.max_new_tokens,
        )?;
        let key = (priority, self.arrivals);
        self.arrivals += 1;
        let req = Request {
            id: id.to_owned(),
            key,
            prompt_len: prompt.len(),
            last_token: *prompt.last().expect("non-empty"),
            tokens: prompt,
            num_computed: 0,
            stop,
            state: RequestState::Waiting,
            finish: None,
            full: Vec::new(),
            ring: Vec::new(),
            swap_slots: Vec::new(),
            n_full_swapped: 0,
            block_hashes: Vec::new(),
            num_registered: 0,
            touched_step: 0,
            stop_inline: [0; 4],
            n_stop_inline: 0,
            max_new_tokens: 0,
            has_stop_sequences: false,
            skip_prefix_lookup,
        };
        let mut req = req;
        req.init_stop_inline();
        let idx = match self.free_idx.pop() {
            Some(i) => {
                self.reqs[i as usize] = Some(req);
                i
            }
            None => {
                self.reqs.push(Some(req));
                (self.reqs.len() - 1) as u32
            }
        };
        self.ids.insert(id.to_owned(), idx);
        self.waiting.insert(key, idx);
        Ok(idx)
    }

    /// Cancel a request in any state, freeing everything it holds. It is reported once by
    /// the next `update()` with reason `cancelled`. Returns false if unknown or finished.
    ///
    /// Chunk lifetime: when an outstanding plan references the request (a row of it, or its
    /// swap-out), its chunks (or swap slots) are not freed now but held for the last such
    /// plan and freed by that plan's update, so nothing reallocates them while a forward
    /// (or copy) may still use them.
    pub fn cancel(&mut self, id: &str) -> bool {
        let Some(&idx) = self.ids.get(id) else {
            return false;
        };
        let r = self.req(idx);
        let key = r.key;
        let flight = self.flight_of(r.touched_step);
        match r.state {
            RequestState::Finished => return false,
            RequestState::Waiting => {
                self.waiting.remove(&key);
            }
            RequestState::Swapped => {
                self.swapped.remove(&key);
                let r = self.reqs[idx as usize].as_mut().expect("live");
                let slots = std::mem::take(&mut r.swap_slots);
                match flight {
                    // Swapped out by an outstanding plan: its copy writes these slots.
                    Some(newest) => self.flight_mut(newest).slots.extend(slots),
                    None => {
                        for s in slots {
                            self.swap.release(s);
                        }
                    }
                }
            }
            RequestState::Prefilling | RequestState::Decoding => {
                self.remove_running(idx);
                match flight {
                    Some(newest) => self.defer_chunks(idx, newest),
                    None => self.free_chunks(idx),
                }
            }
        }
        self.steady_ready = false;
        let r = self.req_mut(idx);
        r.state = RequestState::Finished;
        r.finish = Some(FinishReason::Cancelled);
        self.pending_cancel.push(idx);
        true
    }

    /// Recompute a request from scratch: the soft reset of preemption (generated tokens
    /// appended to the prompt, chunks freed, hashed full blocks kept in the cached list,
    /// back to `Waiting` at its original queue position), asked for by the caller, e.g.
    /// when the model's forward would compute its cached keys differently from now on.
    /// A swapped request's swap slots are released. Returns false (nothing done) when the
    /// request is unknown, finished, or waiting with nothing computed. Errors while a plan
    /// is outstanding (its forward may still read the chunks).
    pub fn recompute(&mut self, id: &str) -> Result<bool> {
        if self.outstanding > 0 {
            return Err(Error::runtime(
                "recompute() called while a plan is outstanding: call update() first",
            ));
        }
        let Some(&idx) = self.ids.get(id) else {
            return Ok(false);
        };
        let r = self.req(idx);
        let key = r.key;
        match r.state {
            // a waiting request holds nothing and computes from scratch anyway
            RequestState::Finished | RequestState::Waiting => return Ok(false),
            RequestState::Swapped => {
                self.swapped.remove(&key);
                let r = self.reqs[idx as usize].as_mut().expect("live");
                for s in std::mem::take(&mut r.swap_slots) {
                    self.swap.release(s);
                }
                r.n_full_swapped = 0;
            }
            RequestState::Prefilling | RequestState::Decoding => {
                self.remove_running(idx);
                self.free_chunks(idx);
            }
        }
        self.steady_ready = false;
        let r = self.req_mut(idx);
        r.num_computed = 0;
        r.num_registered = 0;
        r.state = RequestState::Waiting;
        self.waiting.insert(key, idx);
        self.stats.num_recomputes += 1;
        Ok(true)
    }

    fn remove_running(&mut self, idx: u32) {
        if let Some(p) = self.running.iter().rposition(|&i| i == idx) {
            self.running.remove(p);
        }
    }

    fn insert_running(&mut self, idx: u32) {
        let key = self.req(idx).key;
        let reqs = &self.reqs;
        let pos = self
            .running
            .partition_point(|&i| reqs[i as usize].as_ref().expect("live").key <= key);
        self.running.insert(pos, idx);
    }

    /// The outstanding plan built in step `step`, if any: `Some(true)` for the newest,
    /// `Some(false)` for the oldest of two.
    #[inline]
    fn flight_of(&self, step: u64) -> Option<bool> {
        if self.outstanding >= 1 && step == self.cur.step {
            Some(true)
        } else if self.outstanding == 2 && step == self.old.step {
            Some(false)
        } else {
            None
        }
    }

    fn flight_mut(&mut self, newest: bool) -> &mut Flight {
        if newest {
            &mut self.cur
        } else {
            &mut self.old
        }
    }

    /// Hand a request's device chunks to an outstanding plan's flight (freed, in the order
    /// `free_chunks` would, by that plan's update).
    #[cold]
    #[inline(never)]
    fn defer_chunks(&mut self, idx: u32, newest: bool) {
        let r = self.reqs[idx as usize].as_mut().expect("live");
        let f = if newest { &mut self.cur } else { &mut self.old };
        f.chunks.extend(r.full.iter().rev());
        f.chunks.extend(r.ring.iter());
        r.full.clear();
        r.ring.clear();
    }

    /// Free all device chunks of a request (full blocks in reverse order, so the deepest
    /// blocks of a prefix are evicted first).
    fn free_chunks(&mut self, idx: u32) {
        let r = self.reqs[idx as usize].as_mut().expect("live");
        for &c in r.full.iter().rev() {
            self.pool.free(c);
        }
        for &c in &r.ring {
            self.pool.free(c);
        }
        r.full.clear();
        r.ring.clear();
    }

    fn running_state(r: &Request) -> RequestState {
        if r.num_generated() > 0 && r.num_computed + 1 == r.tokens.len() {
            RequestState::Decoding
        } else {
            RequestState::Prefilling
        }
    }

    // ----- schedule --------------------------------------------------------------------

    /// Start a new step: counters reset, full budgets returned.
    fn begin_step(&mut self) -> Budget {
        self.repeated_rows = false;
        self.step += 1;
        self.stats.stalled_requests = 0;
        self.stats.stalled_blocks = 0;
        Budget {
            tokens: self.cfg.max_batch_tokens,
            rows: self.cfg.max_requests_per_batch,
            cache: self.cfg.max_batch_cache_tokens.unwrap_or(usize::MAX),
        }
    }

    /// Plan the next step (None when nothing can run). Errors if a plan is outstanding.
    pub fn schedule(&mut self) -> Result<Option<&StepPlan>> {
        if self.outstanding > 0 {
            return Err(Error::runtime(
                "schedule() called while a plan is outstanding: call update() first",
            ));
        }
        let mut b = self.begin_step();
        let steady = std::mem::take(&mut self.steady_ready) && self.advance_steady::<false>(&mut b);
        if steady && self.plan.ahead {
            // Advanced from an ahead plan: every input id is known now.
            self.plan.ahead = false;
            self.plan.prev_token_index.clear();
        }
        // Rows `..from` were advanced in place (all their columns written).
        let from = if steady { self.plan.rows.len() } else { 0 };
        if !steady {
            self.plan.clear();
            self.place_running_rows(&mut b);
        }
        self.admit(&mut b);
        if self.plan.rows.is_empty() {
            debug_assert!(self.plan.swap_out.is_empty() && self.plan.swap_in.is_empty());
            debug_assert!(
                self.running.is_empty() && self.waiting.is_empty() && self.swapped.is_empty()
            );
            if self.plan.swap_out.is_empty() && self.plan.swap_in.is_empty() {
                return Ok(None);
            }
        }
        Self::fill_row_arrays(&mut self.plan, from);
        self.build_block_tables(from);
        self.outstanding = 1;
        self.cur.step = self.step;
        self.cur.sampled = self.plan.logits_indices.len();
        self.stats.steps += 1;
        let p = &self.plan;
        let n = p.rows.len();
        // Advanced in place with nothing appended: still the running rows in order.
        self.steady_plan = (steady && n == from)
            || self.layout.has_full
                && !self.layout.has_sliding
                && p.swap_out.is_empty()
                && p.swap_in.is_empty()
                && n == self.running.len()
                && p.input_ids.len() == n
                && p.logits_indices.len() == n
                && p.rows.iter().zip(&self.running).all(|(r, &i)| r.req == i);
        self.repeated_rows = steady && n == from;
        self.cur.repeats = self.repeated_rows;
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
        self.steady_ready = false;
        let mut b = self.begin_step();
        // Swap-out sources the outstanding plan freed at plan time (its copy runs before
        // its forward): pinned until its update.
        for i in 0..self.plan.swap_out.len() / 2 {
            let c = self.plan.swap_out[2 * i] as ChunkId;
            if self.pool.refcount(c) == 0 {
                self.pool.pin(c);
                self.cur.chunks.push(c);
            }
        }
        self.ahead_tokens.clear();
        // Steady decode: the outstanding plan is one sampled token for every running
        // request, in running order, and none of them is certain to finish: keep a copy of
        // it for its update and advance it in place, one token further (like `schedule()`).
        let n = self.plan.rows.len();
        let steady = self.steady_plan
            && self.running.len() == n
            && self.plan.rows.iter().zip(&self.running).all(|(row, &i)| {
                let r = self.reqs[i as usize].as_ref().expect("live");
                row.req == i && r.num_generated() + 1 < r.max_new_tokens
            })
            && {
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
        self.admit_ahead(&mut b);
        if self.plan.rows.is_empty() {
            std::mem::swap(&mut self.plan, &mut self.prev_plan);
            return Ok(None);
        }
        Self::fill_row_arrays(&mut self.plan, from);
        self.build_block_tables(from);
        let p = &mut self.plan;
        p.prev_token_index.resize(p.input_ids.len(), -1);
        for &(t, j) in &self.ahead_tokens {
            p.prev_token_index[t as usize] = j;
        }
        // `cur` (the outstanding plan's flight) becomes `old`; `old` was settled: empty.
        debug_assert!(self.old.chunks.is_empty() && self.old.slots.is_empty());
        std::mem::swap(&mut self.old, &mut self.cur);
        let rows = self.plan.rows.len();
        self.cur.step = self.step;
        self.cur.sampled = self.plan.logits_indices.len();
        self.outstanding = 2;
        // Advanced in place with nothing appended: still every running request, in order.
        self.steady_plan = steady && rows == from;
        self.repeated_rows = self.steady_plan;
        self.cur.repeats = self.repeated_rows;
        self.stats.steps += 1;
        Ok(Some(&self.plan))
    }

    /// General path of `schedule_ahead()` phase 1: the running requests, from where the
    /// outstanding plan leaves them, into a fresh plan (the outstanding one moves to
    /// `prev_plan`).
    fn place_ahead_rows(&mut self, b: &mut Budget) {
        self.row_of.clear();
        self.row_of.resize(self.reqs.len(), u32::MAX);
        for (ri, row) in self.plan.rows.iter().enumerate() {
            self.row_of[row.req as usize] = ri as u32;
        }
        // Build into the spare buffer; the outstanding plan moves to `prev_plan`.
        std::mem::swap(&mut self.plan, &mut self.prev_plan);
        self.plan.clear();
        self.plan.ahead = true;
        let mut order = std::mem::take(&mut self.order_buf);
        order.clear();
        order.extend_from_slice(&self.running);
        let phases = match self.cfg.scheduler_type {
            SchedulerType::Fifo => [true, false],
            SchedulerType::PrefillFirst => [false, true],
        };
        for decodes in phases {
            for &idx in &order {
                if b.rows == 0 || b.tokens == 0 {
                    break;
                }
                let r = self.req(idx);
                // Where the request stands once the outstanding plan is applied.
                let ri = self.row_of[idx as usize];
                let (start, pending) = if ri != u32::MAX {
                    let row = self.prev_plan.rows[ri as usize];
                    let pending = if row.sampled {
                        let j = self
                            .prev_plan
                            .logits_rows
                            .binary_search(&(ri as i32))
                            .expect("sampled row in logits_rows");
                        Some(j as i32)
                    } else {
                        None
                    };
                    ((row.start + row.q) as usize, pending)
                } else {
                    (r.num_computed, None)
                };
                let is_decode = match pending {
                    Some(_) => true,
                    None => ri == u32::MAX && r.state == RequestState::Decoding,
                };
                if is_decode != decodes {
                    continue;
                }
                if pending.is_some() && r.num_generated() + 1 >= r.max_new_tokens {
                    continue; // the pending token finishes it (length)
                }
                self.place_ahead(idx, start, pending, b);
            }
        }
        self.order_buf = order;
    }

    /// `schedule_ahead()` phase 2: new requests (no swap-in in ahead mode).
    fn admit_ahead(&mut self, b: &mut Budget) {
        loop {
            if b.rows == 0 || b.tokens == 0 {
                break;
            }
            let Some((&kw, &iw)) = self.waiting.first_key_value() else {
                break;
            };
            if matches!(self.swapped.first_key_value(), Some((ks, _)) if *ks < kw) {
                break;
            }
            if !self.running.is_empty()
                && (self.pool.num_free() as f64) < self.margin * self.cfg.num_blocks as f64
            {
                break;
            }
            if !self.admit_new(iw, b) {
                break;
            }
        }
    }

    /// Place a running request in an ahead plan from `start` (its progress once the
    /// outstanding plan is applied); `pending` = index of its not yet known token among the
    /// outstanding plan's sampled tokens. Prefills shrink to the chunks available; a row that
    /// cannot get even one token's chunks is left out (stalled), never preempting.
    fn place_ahead(&mut self, idx: u32, start: usize, pending: Option<i32>, b: &mut Budget) {
        let layout = self.layout;
        let r = self.req(idx);
        let known = r.tokens.len();
        let len = known + pending.is_some() as usize;
        debug_assert!(start < len);
        let mut q = (len - start)
            .min(b.tokens)
            .min(b.cache.saturating_sub(start));
        if q == 0 {
            return;
        }
        let free = self.pool.num_free();
        let (nf, nr) = (r.full.len(), r.ring.len());
        let need = layout.chunks_needed(nf, nr, start + q);
        if need > free {
            let fit = layout.fit(nf, nr, start, q, free);
            if fit == 0 {
                self.stats.stalled_requests += 1;
                self.stats.stalled_blocks += need - free;
                return;
            }
            q = fit;
        }
        let end = start + q;
        let step = self.step;
        let r = self.reqs[idx as usize].as_mut().expect("live");
        layout.grow(&mut self.pool, &mut r.full, &mut r.ring, end);
        r.touched_step = step;
        let p = &mut self.plan;
        p.full_width = p.full_width.max(r.full.len());
        p.rows.push(Row {
            req: idx,
            start: start as u32,
            q: q as u32,
            sampled: end == len,
        });
        for pos in start..end {
            if pos < known {
                p.input_ids.push(r.tokens[pos] as i32);
            } else {
                let j = pending.expect("only the pending token is unknown");
                self.ahead_tokens.push((p.input_ids.len() as u32, j));
                p.input_ids.push(0);
            }
        }
        if layout.has_sliding {
            for pos in start..end {
                p.slot_mapping_sliding
                    .push(layout.sliding_slot(&r.ring, pos, end));
            }
        }
        b.tokens -= q;
        b.rows -= 1;
        b.cache = b.cache.saturating_sub(end);
    }

    /// Phase 1 of the general path: place the running requests in queue order.
    fn place_running_rows(&mut self, b: &mut Budget) {
        let mut order = std::mem::take(&mut self.order_buf);
        order.clear();
        order.extend_from_slice(&self.running);
        let phases = match self.cfg.scheduler_type {
            SchedulerType::Fifo => [RequestState::Decoding, RequestState::Prefilling],
            SchedulerType::PrefillFirst => [RequestState::Prefilling, RequestState::Decoding],
        };
        let mut other_seen = true;
        for (k, want) in phases.into_iter().enumerate() {
            if k == 1 && !other_seen {
                break;
            }
            other_seen = false;
            for &idx in &order {
                if b.rows == 0 || b.tokens == 0 {
                    break;
                }
                let r = self.req(idx);
                if r.state != want {
                    other_seen = true;
                    continue;
                }
                if r.touched_step == self.step {
                    continue;
                }
                if want == RequestState::Decoding && self.decode_fast(idx, b) {
                    continue;
                }
                self.place_running(idx, b, true);
            }
        }
        self.order_buf = order;
    }

    /// Whether the deltas of the last `update()` name the same requests, in the same order,
    /// as the update before it (both one delta per row of the same rows).
    pub fn output_repeats_requests(&self) -> bool {
        self.out_repeats
    }

    /// Whether the last `schedule()` returned the same rows (requests, order) as the plan
    /// before it, advanced in place by one decode token each.
    pub fn plan_repeats_rows(&self) -> bool {
        self.repeated_rows
    }

    /// Phase 1 of a steady decode step, done in place on the previous plan: every running
    /// request was a sampled one-token row of it, none finished, was cancelled or preempted
    /// since (`steady_ready`), so the running rows are the same in the same order, one token
    /// further. Only the per-row columns that move are written (token, position, seqlen,
    /// slot); a row whose token starts a block gets a chunk (the pool is checked to have one
    /// for every row, so no preemption can be needed) and its block-table entry (a row that
    /// outgrows the table widens it: `build_block_tables` then rebuilds it).
    /// cu_seqlens_q / logits_* are unchanged. Returns false, having changed nothing, when
    /// the step is not that simple (the pool may run short, the cache-read budget binds).
    /// Admission then runs as usual and appends its rows.
    ///
    /// With `AHEAD` (from `schedule_ahead()`, the plan being the outstanding one): each row
    /// continues after its pending token, which is its input (a placeholder 0; the caller
    /// writes `prev_token_index`).
    fn advance_steady<const AHEAD: bool>(&mut self, b: &mut Budget) -> bool {
        let n = self.plan.rows.len();
        if !self.steady_plan || self.pool.num_free() < n || n > b.rows.min(b.tokens) {
            return false;
        }
        if self.cfg.max_batch_cache_tokens.is_some() {
            let reads: usize = self.plan.seqlens_k.iter().map(|&k| k as usize + 1).sum();
            if reads > b.cache {
                return false;
            }
            b.cache -= reads;
        }
        b.rows -= n;
        b.tokens -= n;
        let step = self.step;
        let page = self.cfg.page_size;
        let p = &mut self.plan;
        let width = p.full_width;
        let mut widen = false;
        debug_assert!(
            p.input_ids.len() == n
                && p.positions.len() == n
                && p.seqlens_k.len() == n
                && p.slot_mapping_full.len() == n
                && p.block_table_full.len() == n * width
        );
        for (i, row) in p.rows.iter_mut().enumerate() {
            let r = self.reqs[row.req as usize].as_mut().expect("live");
            let start = if AHEAD {
                row.start as usize + 1
            } else {
                r.num_computed
            };
            debug_assert!(if AHEAD {
                row.q == 1 && row.sampled && start == r.tokens.len()
            } else {
                r.state == RequestState::Decoding
                    && start == row.start as usize + 1
                    && start + 1 == r.tokens.len()
            });
            row.start = start as u32;
            r.touched_step = step;
            p.input_ids[i] = if AHEAD { 0 } else { r.last_token as i32 };
            p.positions[i] = start as i32;
            p.seqlens_k[i] = start as i32 + 1;
            // Blocks cover exactly the cached tokens, so the token starts a new block iff
            // the blocks are full; otherwise it follows the previous token in its block.
            if r.full.len() * page <= start {
                let c = self.pool.allocate().expect("checked: a free chunk per row");
                r.full.push(c);
                let len = r.full.len();
                if len > width {
                    widen = true;
                } else {
                    p.block_table_full[i * width + len - 1] = c as i32;
                }
                p.slot_mapping_full[i] = (c as usize * page) as i32;
            } else {
                p.slot_mapping_full[i] += 1;
            }
            debug_assert_eq!(
                p.slot_mapping_full[i],
                self.layout.full_slot(&r.full, start)
            );
        }
        if widen {
            // Each row grows by at most one block.
            p.full_width = width + 1;
        }
        true
    }

    /// Try to place a running request as a row (preempting if allowed and needed).
    fn place_running(&mut self, idx: u32, b: &mut Budget, allow_preempt: bool) -> bool {
        let page = self.cfg.page_size;
        loop {
            let r = self.req(idx);
            let start = r.num_computed;
            let remaining = r.tokens.len() - start;
            let mut q = remaining.min(b.tokens).min(b.cache.saturating_sub(start));
            if q == 0 {
                return false;
            }
            let free = self.pool.num_free();
            let (nf, nr) = (r.full.len(), r.ring.len());
            let need = if q == 1 {
                // Decode fast path (no divisions): a new chunk iff the token starts one.
                let l = &self.layout;
                (l.has_full && nf * page <= start) as usize
                    + (l.has_sliding && nr < l.ring && nr * page <= start) as usize
            } else {
                self.layout.chunks_needed(nf, nr, start + q)
            };
            if need > free {
                let fit = self.layout.fit(nf, nr, start, q, free);
                if fit > 0 {
                    q = fit;
                } else if allow_preempt {
                    self.stats.stalled_requests += 1;
                    self.stats.stalled_blocks += need - free;
                    match self.pick_victim(idx) {
                        Some(v) => {
                            self.preempt(v);
                            if v == idx {
                                return false;
                            }
                            continue;
                        }
                        None => return false,
                    }
                } else {
                    return false;
                }
            }
            self.emit_row(idx, start, q, need > 0 || q > 1);
            b.tokens -= q;
            b.rows -= 1;
            b.cache = b.cache.saturating_sub(start + q);
            return true;
        }
    }

    /// Place a decode row (one token) when it needs no new chunk and fits the budgets: the
    /// common case of a steady decode step, done with one request lookup. Returns false
    /// (nothing changed) otherwise; the general path handles it.
    #[inline]
    fn decode_fast(&mut self, idx: u32, b: &mut Budget) -> bool {
        let page = self.cfg.page_size;
        let l = self.layout;
        let step = self.step;
        let r = self.reqs[idx as usize].as_mut().expect("live");
        let start = r.num_computed;
        let end = start + 1;
        if end != r.tokens.len()
            || b.cache < end
            || (l.has_full && r.full.len() * page < end)
            || (l.has_sliding && r.ring.len() < l.ring && r.ring.len() * page < end)
        {
            return false;
        }
        r.touched_step = step;
        let p = &mut self.plan;
        p.full_width = p.full_width.max(r.full.len());
        p.rows.push(Row {
            req: idx,
            start: start as u32,
            q: 1,
            sampled: true,
        });
        p.input_ids.push(r.last_token as i32);
        if l.has_sliding {
            p.slot_mapping_sliding
                .push(l.sliding_slot(&r.ring, start, end));
        }
        b.tokens -= 1;
        b.rows -= 1;
        b.cache -= end;
        true
    }

    /// Allocate what the row needs and write its entries of every per-token / per-row array
    /// (block tables are written by `build_block_tables` once the width is known).
    fn emit_row(&mut self, idx: u32, start: usize, q: usize, grow: bool) {
        let layout = self.layout;
        let step = self.step;
        let r = self.reqs[idx as usize].as_mut().expect("live");
        let end = start + q;
        if grow {
            layout.grow(&mut self.pool, &mut r.full, &mut r.ring, end);
        }
        r.touched_step = step;
        let sampled = end == r.tokens.len();
        let p = &mut self.plan;
        p.full_width = p.full_width.max(r.full.len());
        p.rows.push(Row {
            req: idx,
            start: start as u32,
            q: q as u32,
            sampled,
        });
        if end == r.tokens.len() && q == 1 {
            p.input_ids.push(r.last_token as i32);
        } else {
            p.input_ids
                .extend(r.tokens[start..end].iter().map(|&t| t as i32));
        }
        // Full-attention slots are written with the block tables (one pass over `full`);
        // positions, cu_seqlens_q, seqlens_k and logits_* by `fill_row_arrays` (from `rows`).
        if layout.has_sliding {
            for pos in start..end {
                p.slot_mapping_sliding
                    .push(layout.sliding_slot(&r.ring, pos, end));
            }
        }
    }

    /// Write `positions`, `cu_seqlens_q`, `seqlens_k`, `logits_indices` and `logits_rows`
    /// from the placed rows, column by column (a steady decode step: every row one sampled
    /// token, so most columns are plain ranges).
    fn fill_row_arrays(p: &mut StepPlan, from: usize) {
        let rows = &p.rows;
        let b = rows.len();
        if from > 0 {
            // Rows `..from` are written (one token each); append the others'.
            let mut cum = from as i32;
            for (i, r) in rows.iter().enumerate().skip(from) {
                p.positions.extend(r.start as i32..(r.start + r.q) as i32);
                cum += r.q as i32;
                p.cu_seqlens_q.push(cum);
                p.seqlens_k.push((r.start + r.q) as i32);
                if r.sampled {
                    p.logits_indices.push(cum - 1);
                    p.logits_rows.push(i as i32);
                }
            }
            return;
        }
        p.seqlens_k
            .extend(rows.iter().map(|r| (r.start + r.q) as i32));
        if p.input_ids.len() == b {
            // One token per row (every row has q >= 1).
            p.positions.extend(rows.iter().map(|r| r.start as i32));
            p.cu_seqlens_q.extend(1..=b as i32);
            if rows.iter().all(|r| r.sampled) {
                p.logits_indices.extend(0..b as i32);
                p.logits_rows.extend(0..b as i32);
            } else {
                for (i, r) in rows.iter().enumerate() {
                    if r.sampled {
                        p.logits_indices.push(i as i32);
                        p.logits_rows.push(i as i32);
                    }
                }
            }
            return;
        }
        p.positions.reserve(p.input_ids.len());
        let mut cum = 0i32;
        for (i, r) in rows.iter().enumerate() {
            p.positions.extend(r.start as i32..(r.start + r.q) as i32);
            cum += r.q as i32;
            p.cu_seqlens_q.push(cum);
            if r.sampled {
                p.logits_indices.push(cum - 1);
                p.logits_rows.push(i as i32);
            }
        }
    }

    /// The running request with the largest key not placed in this step; the requester
    /// itself when that is it. Never the last active request.
    fn pick_victim(&self, requester: u32) -> Option<u32> {
        if self.running.len() <= 1 {
            return None;
        }
        self.running
            .iter()
            .rev()
            .copied()
            .find(|&v| v == requester || self.req(v).touched_step != self.step)
    }

    /// Preempt a running request: swap out when the swap pool has room for all its chunks,
    /// else soft reset.
    fn preempt(&mut self, v: u32) {
        self.remove_running(v);
        self.stats.num_preemptions += 1;
        let step = self.step;
        let n = {
            let r = self.req(v);
            r.full.len() + r.ring.len()
        };
        // Swap out when the pool has room, unless the victim shares a (prefix) chunk with a
        // victim already swapped out in this step: a plan copies each chunk at most once,
        // so that rare victim is soft-reset instead.
        let swap = self.cfg.cpu_offload_blocks > 0 && self.swap.num_free() >= n && {
            let r = self.req(v);
            let out = &self.plan.swap_out;
            !r.full
                .iter()
                .any(|&c| out.chunks_exact(2).any(|pr| pr[0] == c as i32))
        };
        let r = self.reqs[v as usize].as_mut().expect("live");
        r.touched_step = step;
        let key = r.key;
        if swap {
            r.n_full_swapped = r.full.len();
            for &c in r.full.iter().chain(r.ring.iter()) {
                let s = self.swap.allocate().expect("checked");
                self.plan.swap_out.push(c as i32);
                self.plan.swap_out.push(s as i32);
                r.swap_slots.push(s);
            }
            r.state = RequestState::Swapped;
            self.free_chunks(v);
            self.swapped.insert(key, v);
            self.stats.num_offloads += 1;
        } else {
            r.num_computed = 0;
            r.num_registered = 0;
            r.state = RequestState::Waiting;
            self.free_chunks(v);
            self.waiting.insert(key, v);
            self.stats.num_soft_resets += 1;
        }
    }

    /// Admit swapped and waiting requests in key order (head of line).
    fn admit(&mut self, b: &mut Budget) {
        loop {
            if b.rows == 0 || b.tokens == 0 {
                return;
            }
            let w = self.waiting.first_key_value().map(|(k, &i)| (*k, i));
            let s = self.swapped.first_key_value().map(|(k, &i)| (*k, i));
            let (idx, is_swapped) = match (w, s) {
                (None, None) => return,
                (Some((_, i)), None) => (i, false),
                (None, Some((_, i))) => (i, true),
                (Some((kw, iw)), Some((ks, is))) => {
                    if ks < kw {
                        (is, true)
                    } else {
                        (iw, false)
                    }
                }
            };
            if self.req(idx).touched_step == self.step {
                return; // preempted in this step
            }
            if !self.running.is_empty()
                && (self.pool.num_free() as f64) < self.margin * self.cfg.num_blocks as f64
            {
                return;
            }
            let ok = if is_swapped {
                self.resume(idx, b)
            } else {
                self.admit_new(idx, b)
            };
            if !ok {
                return;
            }
        }
    }

    fn resume(&mut self, idx: u32, b: &mut Budget) -> bool {
        let r = self.req(idx);
        let nf = r.n_full_swapped;
        let nr = r.swap_slots.len() - nf;
        let start = r.num_computed;
        let q = (r.tokens.len() - start)
            .min(b.tokens)
            .min(b.cache.saturating_sub(start));
        if q == 0 {
            return false;
        }
        let free = self.pool.num_free();
        if nf + nr > free || self.layout.fit(nf, nr, start, q, free - nf - nr) == 0 {
            return false;
        }
        let key = r.key;
        self.swapped.remove(&key);
        let r = self.reqs[idx as usize].as_mut().expect("live");
        for (i, &s) in r.swap_slots.iter().enumerate() {
            let c = self.pool.allocate().expect("checked");
            self.plan.swap_in.push(s as i32);
            self.plan.swap_in.push(c as i32);
            if i < nf {
                r.full.push(c);
            } else {
                r.ring.push(c);
            }
            self.cur.slots.push(s);
        }
        r.swap_slots.clear();
        r.n_full_swapped = 0;
        // Swapped-in chunks are unhashed copies: offer them to the prefix cache again.
        r.num_registered = 0;
        r.state = Self::running_state(r);
        self.insert_running(idx);
        let placed = self.place_running(idx, b, false);
        debug_assert!(placed);
        placed
    }

    fn admit_new(&mut self, idx: u32, b: &mut Budget) -> bool {
        let page = self.cfg.page_size;
        let mut hits = std::mem::take(&mut self.hits_buf);
        hits.clear();
        if self.prefix && !self.req(idx).skip_prefix_lookup {
            let r = self.reqs[idx as usize].as_mut().expect("live");
            let max_hit = (r.tokens.len() - 1) / page;
            self.hasher
                .extend(&mut r.block_hashes, &r.tokens, page, max_hit);
            let mut parent = None;
            for i in 0..max_hit {
                match self.pool.lookup(
                    r.block_hashes[i],
                    parent,
                    &r.tokens[i * page..(i + 1) * page],
                ) {
                    Some(c) => {
                        hits.push(c);
                        parent = Some(c);
                    }
                    None => break,
                }
            }
        }
        let r = self.req(idx);
        let start = hits.len() * page;
        let len = r.tokens.len();
        let q = (len - start)
            .min(b.tokens)
            .min(b.cache.saturating_sub(start));
        let hit_free = hits.iter().filter(|&&c| self.pool.refcount(c) == 0).count();
        let free = self.pool.num_free() - hit_free;
        let ok = q > 0 && self.layout.fit(hits.len(), 0, start, q, free) > 0;
        if ok {
            let key = r.key;
            self.waiting.remove(&key);
            for &c in &hits {
                self.pool.touch(c);
            }
            let r = self.reqs[idx as usize].as_mut().expect("live");
            r.full.extend_from_slice(&hits);
            r.num_computed = start;
            r.num_registered = hits.len();
            r.state = Self::running_state(r);
            self.stats.prefix_hit_tokens += start as u64;
            self.stats.prompt_tokens += len as u64;
            self.insert_running(idx);
            let placed = self.place_running(idx, b, false);
            debug_assert!(placed);
        }
        self.hits_buf = hits;
        ok
    }

    /// Block tables of every row, and full-attention slots of rows `from..` (rows `..from`
    /// were advanced in place: their table rows are valid unless the width changed).
    fn build_block_tables(&mut self, from: usize) {
        let layout = self.layout;
        let reqs = &self.reqs;
        let p = &mut self.plan;
        if p.has_full {
            // `full_width` was tracked by `emit_row` / `advance_steady`.
            let width = p.full_width;
            // Rows whose table row is already laid out at this width.
            let valid = if p.block_table_full.len() == from * width {
                from
            } else {
                0
            };
            if valid == p.rows.len() {
                // A steady step with nothing appended and no widening (full attention only).
                debug_assert!(!p.has_sliding);
                return;
            }
            // Zero-filled (the padding), then each row's blocks copied into its slice.
            p.block_table_full.truncate(valid * width);
            p.block_table_full.resize(width * p.rows.len(), 0);
            p.slot_mapping_full.reserve(p.input_ids.len());
            let page = layout.page;
            // Every row holds at least one block, so `width >= 1` here.
            for (i, (row, dst)) in p
                .rows
                .iter()
                .zip(p.block_table_full.chunks_exact_mut(width.max(1)))
                .enumerate()
                .skip(valid)
            {
                if let Some(next) = p.rows.get(i + 4) {
                    let f = &reqs[next.req as usize].as_ref().expect("live").full;
                    if !f.is_empty() {
                        crate::hint::prefetch(f.as_ptr());
                    }
                }
                let full = &reqs[row.req as usize].as_ref().expect("live").full;
                dst[..full.len()].copy_from_slice(crate::chunk_ids_as_i32(full));
                if i < from {
                    continue;
                }
                let start = row.start as usize;
                if row.q == 1 {
                    // The token lives in the last block (blocks are allocated as needed).
                    let bi = full.len() - 1;
                    p.slot_mapping_full
                        .push((full[bi] as usize * page + (start - bi * page)) as i32);
                } else {
                    for pos in start..start + row.q as usize {
                        p.slot_mapping_full.push(layout.full_slot(full, pos));
                    }
                }
            }
        }
        if p.has_sliding {
            p.sliding_width = layout.ring;
            for row in p.rows.iter().skip(from) {
                let ring = &reqs[row.req as usize].as_ref().expect("live").ring;
                p.block_table_sliding.extend(ring.iter().map(|&c| c as i32));
                p.block_table_sliding
                    .extend(std::iter::repeat_n(0, layout.ring - ring.len()));
            }
        }
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
        let two = self.outstanding == 2;
        if self.outstanding > 0 {
            let want = if two {
                self.old.sampled
            } else {
                self.cur.sampled
            };
            if sampled.len() != want {
                return Err(Error::invalid(
                    "sampled_token_ids",
                    format!(
                        "sampled_token_ids has {} entries but the plan samples {want} rows",
                        sampled.len(),
                    ),
                ));
            }
        } else if !sampled.is_empty() {
            return Err(Error::runtime(
                "update() called with tokens but no plan is outstanding (call schedule() first)",
            ));
        }
        if let Some(t) = sampled.iter().find(|&&t| t < 0) {
            return Err(Error::invalid(
                "sampled_token_ids",
                format!("sampled_token_ids must be non-negative (got {t})"),
            ));
        }
        // The forward (and copies) of this plan are done: settle what it held.
        let dead_rows = self.settle(!two);
        self.upd_step = if two { self.old.step } else { self.cur.step };
        if !self.to_remove.is_empty() {
            let limit = if self.outstanding > 0 {
                self.upd_step
            } else {
                u64::MAX
            };
            let (reqs, free_idx) = (&mut self.reqs, &mut self.free_idx);
            self.to_remove.retain(|&(idx, last)| {
                if last < limit {
                    reqs[idx as usize] = None;
                    free_idx.push(idx);
                    false
                } else {
                    true
                }
            });
        }
        self.out.clear();
        self.steady_ready = false;
        let prev_bulk = std::mem::take(&mut self.bulk_update);
        self.out_repeats = false;
        let page = self.cfg.page_size;
        let mut any_finished = false;
        if two {
            // The rows below are the oldest plan's: swapped back after the loop.
            std::mem::swap(&mut self.plan.rows, &mut self.prev_plan.rows);
        }
        if self.outstanding > 0
            && sampled.len() == self.plan.rows.len()
            && self.pending_cancel.is_empty()
            && !dead_rows
        {
            // Every row sampled, nothing cancelled since `schedule()` (a cancellation is
            // always queued in `pending_cancel`) and no row finished by an earlier update:
            // one delta per row, in row order, so the request / token / row columns are
            // written in bulk.
            let n = sampled.len();
            let out = &mut self.out;
            out.reqs.extend(self.plan.rows.iter().map(|r| r.req));
            out.token_ids.extend_from_slice(sampled);
            out.finished.resize(n, false);
            out.finish_reasons.resize(n, None);
            out.rows.extend(0..n as i32);
            self.stats.generated_tokens += n as u64;
            for (ri, &t) in sampled.iter().enumerate() {
                let row = self.plan.rows[ri];
                let r = self.reqs[row.req as usize].as_mut().expect("live");
                debug_assert!(r.state != RequestState::Finished);
                r.num_computed = (row.start + row.q) as usize;
                if self.prefix && r.num_computed >= (r.num_registered + 1) * page {
                    self.register_blocks(row.req);
                }
                let r = self.reqs[row.req as usize].as_mut().expect("live");
                r.state = RequestState::Decoding;
                if let Some(f) = r.append(t as Token) {
                    self.out.finished[ri] = true;
                    self.out.finish_reasons[ri] = Some(f);
                    any_finished = true;
                    self.finish(row.req, f);
                }
            }
            let two = self.outstanding == 2;
            self.steady_ready = self.steady_plan && !any_finished && !two;
            self.bulk_update = true;
            // Plans are updated in the order they were built: the previous update was the
            // plan built just before this one.
            let repeats = if two {
                self.old.repeats
            } else {
                self.cur.repeats
            };
            self.out_repeats = prev_bulk && repeats;
        } else if self.outstanding > 0 {
            any_finished = self.update_rows(sampled);
        }
        let two = self.outstanding == 2;
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
        for idx in std::mem::take(&mut self.pending_cancel) {
            self.out.push(idx, -1, Some(FinishReason::Cancelled), -1);
            let r = self.req(idx);
            let (id, last) = (r.id.clone(), r.touched_step);
            self.ids.remove(&id);
            self.to_remove.push((idx, last));
            self.stats.finished += 1;
        }
        // With two, the newer plan (`plan`, `cur`) is now the only one.
        self.outstanding = self.outstanding.saturating_sub(1);
        Ok(&self.out)
    }

    /// The general path of `update()`: rows in order, skipping those of finished requests
    /// (cancelled since the plan was built, or stopped in an earlier update), tokens only for
    /// sampled rows. Returns whether a request finished.
    #[inline(never)]
    fn update_rows(&mut self, sampled: &[i32]) -> bool {
        let page = self.cfg.page_size;
        let mut k = 0usize;
        let mut any_finished = false;
        self.out
            .reserve(self.plan.rows.len() + self.pending_cancel.len());
        for ri in 0..self.plan.rows.len() {
            let row = self.plan.rows[ri];
            let tok = if row.sampled {
                k += 1;
                Some(sampled[k - 1])
            } else {
                None
            };
            let r = self.reqs[row.req as usize].as_mut().expect("live");
            if r.state == RequestState::Finished {
                // Cancelled since the plan was built, or stopped in an earlier update.
                continue;
            }
            r.num_computed = (row.start + row.q) as usize;
            if self.prefix && r.num_computed >= (r.num_registered + 1) * page {
                self.register_blocks(row.req);
            }
            if let Some(t) = tok {
                let r = self.reqs[row.req as usize].as_mut().expect("live");
                r.state = RequestState::Decoding;
                let fin = r.append(t as Token);
                self.stats.generated_tokens += 1;
                self.out.push(row.req, t, fin, ri as i32);
                if let Some(f) = fin {
                    any_finished = true;
                    self.finish(row.req, f);
                }
            }
        }
        any_finished
    }

    /// Free what the oldest outstanding flight held (`newest`: it is `cur`, the only one);
    /// returns (and clears) its `dead_rows`.
    fn settle(&mut self, newest: bool) -> bool {
        let f = if newest { &mut self.cur } else { &mut self.old };
        let dead = std::mem::take(&mut f.dead_rows);
        for s in f.slots.drain(..) {
            self.swap.release(s);
        }
        for c in f.chunks.drain(..) {
            self.pool.free(c);
        }
        dead
    }

    /// Offer the request's newly full computed blocks to the prefix cache.
    #[cold]
    #[inline(never)]
    fn register_blocks(&mut self, idx: u32) {
        let page = self.cfg.page_size;
        let r = self.reqs[idx as usize].as_mut().expect("live");
        let n = r.num_computed / page;
        self.hasher.extend(&mut r.block_hashes, &r.tokens, page, n);
        for i in r.num_registered..n {
            let parent = if i == 0 { None } else { Some(r.full[i - 1]) };
            self.pool.cache(
                r.full[i],
                r.block_hashes[i],
                parent,
                &r.tokens[i * page..(i + 1) * page],
            );
        }
        r.num_registered = n;
    }

    /// A request finished in the update of the plan built in step `self.upd_step`: free its
    /// chunks, unless a newer outstanding plan has a row of it (then they are held for that
    /// plan and freed by its update); its slab slot goes at a later update (the deltas still
    /// name it, and the newer plan's update must still see it finished).
    #[cold]
    #[inline(never)]
    fn finish(&mut self, idx: u32, f: FinishReason) {
        let r = self.reqs[idx as usize].as_mut().expect("live");
        r.state = RequestState::Finished;
        r.finish = Some(f);
        let last = r.touched_step;
        if last > self.upd_step {
            debug_assert!(self.outstanding == 2 && last == self.cur.step);
            self.defer_chunks(idx, true);
        } else {
            self.free_chunks(idx);
        }
        let r = self.reqs[idx as usize].as_ref().expect("live");
        self.ids.remove(&r.id);
        self.to_remove.push((idx, last));
        self.stats.finished += 1;
    }

    // ----- invariants ------------------------------------------------------------------

    /// Check every invariant; the error names the broken one.
    pub fn check_invariants(&self) -> Result<()> {
        self.check()
            .map_err(|m| Error::runtime(format!("invariant violated: {m}")))
    }

    fn check(&self) -> std::result::Result<(), String> {
        let n = self.cfg.num_blocks + 2;
        let mut holders = vec![0u32; n];
        for c in self.deferred_chunks() {
            if (c as usize) < n {
                holders[c as usize] += 1;
            }
        }
        let mut held_slots: Vec<u32> = self.deferred_swap_slots();
        let (mut nw, mut nr, mut ns) = (0, 0, 0);
        let page = self.cfg.page_size;
        for (idx, r) in self.live_requests() {
            if self.ids.get(&r.id) != Some(&idx) {
                return Err(format!("id map does not point to request {:?}", r.id));
            }
            for &c in r.full.iter().chain(r.ring.iter()) {
                if c as usize >= n {
                    return Err(format!("request {:?} holds out-of-range chunk {c}", r.id));
                }
                holders[c as usize] += 1;
            }
            held_slots.extend_from_slice(&r.swap_slots);
            if r.num_computed >= r.tokens.len() {
                return Err(format!("request {:?}: nothing left to compute", r.id));
            }
            if r.ring.len() > self.layout.ring {
                return Err(format!("request {:?}: ring larger than R", r.id));
            }
            match r.state {
                RequestState::Waiting => {
                    nw += 1;
                    if self.waiting.get(&r.key) != Some(&idx) {
                        return Err(format!(
                            "waiting request {:?} not in the waiting queue",
                            r.id
                        ));
                    }
                    if !r.full.is_empty()
                        || !r.ring.is_empty()
                        || r.num_computed != 0
                        || !r.swap_slots.is_empty()
                    {
                        return Err(format!(
                            "waiting request {:?} holds chunks or progress",
                            r.id
                        ));
                    }
                }
                RequestState::Swapped => {
                    ns += 1;
                    if self.swapped.get(&r.key) != Some(&idx) {
                        return Err(format!(
                            "swapped request {:?} not in the swapped queue",
                            r.id
                        ));
                    }
                    let want = self.layout.full_blocks_for(r.num_computed);
                    if !r.full.is_empty() || !r.ring.is_empty() || r.n_full_swapped < want {
                        return Err(format!(
                            "swapped request {:?} holds device chunks or lost blocks",
                            r.id
                        ));
                    }
                }
                RequestState::Prefilling | RequestState::Decoding => {
                    nr += 1;
                    if !self.running.contains(&idx) {
                        return Err(format!(
                            "running request {:?} not in the running list",
                            r.id
                        ));
                    }
                    if !r.swap_slots.is_empty() {
                        return Err(format!("running request {:?} holds swap slots", r.id));
                    }
                    // Each outstanding plan may have grown it by its pending token.
                    let most = r.tokens.len() + self.outstanding as usize;
                    if r.full.len() < self.layout.full_blocks_for(r.num_computed)
                        || r.full.len() > self.layout.full_blocks_for(most)
                        || r.ring.len() < self.layout.ring_chunks_for(r.num_computed)
                    {
                        return Err(format!(
                            "running request {:?}: blocks do not cover its cached tokens",
                            r.id
                        ));
                    }
                    for (i, &c) in r.full.iter().enumerate() {
                        if let Some(h) = self.pool.hash_of(c) {
                            if r.block_hashes.get(i) != Some(&h) || (i + 1) * page > r.num_computed
                            {
                                return Err(format!(
                                    "request {:?} block {i}: hashed chunk {c} does not match its content",
                                    r.id
                                ));
                            }
                        }
                    }
                }
                RequestState::Finished => unreachable!(),
            }
        }
        if nw != self.waiting.len() || nr != self.running.len() || ns != self.swapped.len() {
            return Err(format!(
                "queues hold requests in other states (waiting {nw}/{}, running {nr}/{}, swapped {ns}/{})",
                self.waiting.len(),
                self.running.len(),
                self.swapped.len()
            ));
        }
        let reqs = &self.reqs;
        let key = |i: &u32| reqs[*i as usize].as_ref().map(|r| r.key);
        if !self.running.windows(2).all(|w| key(&w[0]) < key(&w[1])) {
            return Err("running list not sorted by (priority, arrival)".into());
        }
        self.pool.check(&holders)?;
        self.swap.check(&held_slots)?;
        self.check_outstanding()?;
        for &(idx, _) in &self.to_remove {
            match self.request(idx) {
                Some(r) if r.state == RequestState::Finished => {}
                _ => {
                    return Err(format!(
                        "slab slot {idx} queued for removal is not finished"
                    ))
                }
            }
        }
        Ok(())
    }

    /// Chunk lifetime: every chunk an outstanding plan references (block tables, slot
    /// mappings, swap pairs) is held (refcount > 0), and so is every swap slot it
    /// references. One exception: while a plan is the only one outstanding, its swap-out
    /// sources may be free (the plan released them itself; nothing can allocate before its
    /// update but `schedule_ahead()`, which pins them first).
    fn check_outstanding(&self) -> std::result::Result<(), String> {
        if self.outstanding > 2 {
            return Err("more than two plans outstanding".into());
        }
        let page = self.cfg.page_size;
        let n = (self.cfg.num_blocks + 2) as i32;
        for (k, p) in self.outstanding_plans().enumerate() {
            let held = |c: i32, what: &str| -> std::result::Result<(), String> {
                if c < 0 || c >= n {
                    return Err(format!(
                        "outstanding plan {k}: {what} chunk {c} out of range"
                    ));
                }
                if c as ChunkId >= crate::pool::FIRST_DATA_CHUNK
                    && self.pool.refcount(c as ChunkId) == 0
                {
                    return Err(format!(
                        "chunk lifetime: chunk {c} ({what}) of outstanding plan {k} is free"
                    ));
                }
                Ok(())
            };
            for &c in p.block_table_full.iter().chain(&p.block_table_sliding) {
                held(c, "block table")?;
            }
            for &s in p.slot_mapping_full.iter().chain(&p.slot_mapping_sliding) {
                held(s / page as i32, "slot mapping")?;
            }
            for pr in p.swap_out.chunks_exact(2) {
                if self.outstanding == 2 {
                    held(pr[0], "swap_out source")?;
                }
                if self.swap.refcount(pr[1] as u32) == 0 {
                    return Err(format!(
                        "chunk lifetime: swap slot {} of outstanding plan {k} is free",
                        pr[1]
                    ));
                }
            }
            for pr in p.swap_in.chunks_exact(2) {
                held(pr[1], "swap_in destination")?;
                if self.swap.refcount(pr[0] as u32) == 0 {
                    return Err(format!(
                        "chunk lifetime: swap slot {} of outstanding plan {k} is free",
                        pr[0]
                    ));
                }
            }
            if !p.prev_token_index.is_empty() && p.prev_token_index.len() != p.input_ids.len() {
                return Err(format!("outstanding plan {k}: prev_token_index length"));
            }
        }
        Ok(())
    }
}
