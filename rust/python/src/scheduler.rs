//! `Scheduler`: the core scheduler behind Python's calls, with the request-id strings of
//! its requests (one Python object each, reused in every plan and output).

use ferrobatch_core as core;
use ferrobatch_core::request::StopConditions;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict, PyString};

use crate::cache::NameCache;
use crate::config::ConfigArgs;
use crate::convert::{sequences_from, tokens_from, usize_arg, with_tokens_i32};
use crate::errors::to_py;
use crate::output::StepOutput;
use crate::plan::StepPlan;
use crate::recycle::Recycler;

/// `stats()` keys of the cost model's coefficients, in `Stats::cost_coef` order.
const COST_KEYS: [&str; 5] = [
    "cost_ms_per_step",
    "cost_ms_per_token",
    "cost_ms_per_row",
    "cost_ms_per_kkey_full",
    "cost_ms_per_kkey_sliding",
];

/// Continuous-batching scheduler and paged KV-cache allocator (see ARCHITECTURE.md §3).
///
/// `Scheduler(num_blocks, page_size, max_batch_tokens, max_requests_per_batch=256,
/// scheduler_type="fifo", safety_margin=None, allow_block_sharing=True,
/// layer_types=("full_attention",), sliding_window=None, cpu_offload_blocks=0,
/// max_batch_cache_tokens=None, defer_shared_prefixes=True, max_step_ms=None)`; bad values
/// raise `FieldError` (a ValueError) whose `.field` names the argument.
/// `safety_margin=None` means 0.15 for "fifo", 0.0 for "prefill_first".
/// `max_batch_cache_tokens` bounds the sum of `seqlens_k` of a step. `max_step_ms` (> 0)
/// is a step-time budget for prefill chunks, from a cost model fed by `report_step_time`
/// (ARCHITECTURE.md §4, "Step-time budget"); None = token budgets only.
///
/// Methods: `add_request(request_id, prompt_token_ids, max_new_tokens, eos_token_ids=(),
/// stop_token_ids=(), priority=0, stop_sequences=(), skip_prefix_lookup=False, cache_salt=0,
/// offline=False)` (FieldError
/// naming the field for a duplicate id, an empty prompt, `max_new_tokens < 1`, an empty stop sequence, or a request
/// that could never fit the pool / the cache-read budget); `schedule() -> StepPlan | None`;
/// `schedule_ahead() -> StepPlan | None` (one step ahead of the outstanding plan, for async
/// batching); `update(sampled_token_ids) -> StepOutput` (applies to the oldest outstanding
/// plan); properties `num_outstanding` (int) and `has_outstanding_plan` (bool); `cancel(request_id) -> bool`;
/// `has_unfinished() -> bool` (also true while a cancellation is unreported: if schedule()
/// returns None then, call `update(())` to get the report); `stats() -> dict`;
/// `check_invariants()` (RuntimeError naming the broken invariant); `snapshot() -> dict`;
/// `check_fits(prompt_len, max_new_tokens)`, `lifetime_chunks(cached_tokens) -> int`,
/// `max_request_tokens() -> int` (the core's fit rules, for callers that validate before
/// adding); O(1) properties `num_free_blocks`, `num_cached_blocks`, `num_waiting`,
/// `num_running`, `num_swapped`, `num_stalled` (cheaper than `stats()`);
/// `report_step_time(seconds) -> bool` (the last updated step's measured time, for the
/// cost model), properties `max_step_ms`, `prefill_budget_ms`, `prefill_budget_tokens`.
///
/// `snapshot()` returns a dict for outside checks:
/// * `"num_blocks"`, `"page_size"`, `"ring_size"` (R, 0 without sliding layers),
///   `"sliding_window"`, `"prefix_caching"` (bool), `"safety_margin"` (effective),
///   `"outstanding"` (bool: a plan awaits update()), `"num_outstanding"` (0, 1 or 2),
/// * `"refcounts"`: list[int] of length num_blocks + 2 (chunk id -> references held),
/// * `"free_chunks"`: list[int] of uninitialized free chunks (`num_free_blocks` also counts
///   the cached ones: it is `len(free_chunks) + len(cached_chunks)`),
/// * `"cached_chunks"`: list[int] of free chunks that keep a hashed block, eviction order
///   (first = reclaimed first),
/// * `"hashed_chunks"`: list[int] of every chunk registered in the prefix table,
/// * `"swap_free_slots"`: list[int]; `"swap_deferred_slots"`: slots held for outstanding
///   plans (read by their swap-in, or written by their swap-out for a request cancelled
///   since; released by those plans' update()),
/// * `"deferred_chunks"`: list[int], one entry per chunk reference held for an outstanding
///   plan rather than by a request (chunks of requests that finished or were cancelled
///   while a plan using them was outstanding, and pinned swap-out sources; freed by that
///   plan's update()). Chunk lifetime: every chunk an outstanding plan references has
///   refcount > 0, except the swap-out sources of a plan that is the only one outstanding
///   (it released them itself; `schedule_ahead()` pins them),
/// * `"requests"`: {request_id: {"state": "waiting"|"prefilling"|"decoding"|"swapped",
///   "num_computed_tokens", "num_tokens", "num_prompt_tokens", "num_generated_tokens",
///   "priority", "arrival", "admission_deferrals" (steps its admission was put off to
///   share a block another prefill fills), "blocks": {"full_attention": [...], "sliding_attention": [...]}
///   (only the types the model has), "swap_slots": [...]}} for every unfinished request.
#[pyclass(module = "ferrobatch._core")]
pub struct Scheduler {
    inner: core::Scheduler,
    /// Request id objects by slab index (kept alive; one incref per use).
    names: Vec<Option<Py<PyString>>>,
    /// Per slab slot: bumped when a new request takes the slot.
    gens: Vec<u32>,
    /// Name tuples of the last plan / output and the (slot, generation) keys they were built
    /// from: a steady decode step reuses them instead of touching every string.
    plan_names: NameCache,
    out_names: NameCache,
    recycle: Recycler,
    has_full: bool,
    has_sliding: bool,
}

impl Scheduler {
    /// The plan just built, copied out as a Python `StepPlan`.
    fn export(
        &mut self,
        py: Python<'_>,
        num_rows: usize,
        num_tokens: usize,
        num_sampled: usize,
    ) -> PyResult<StepPlan> {
        let row_names = self.plan_names.get_or_same(
            py,
            self.inner.plan_repeats_rows(),
            self.inner.plan().rows.iter().map(|r| r.req),
            &self.names,
            &self.gens,
        )?;
        let mut d = self.recycle.take_plan();
        self.inner.export_plan(&mut d);
        Ok(StepPlan::new(
            d,
            self.recycle.clone(),
            row_names,
            (num_rows, num_tokens, num_sampled),
            self.inner.config().page_size,
        ))
    }

    fn name<'py>(&self, py: Python<'py>, idx: u32) -> &Bound<'py, PyString> {
        self.names[idx as usize]
            .as_ref()
            .expect("named request")
            .bind(py)
    }
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (num_blocks, page_size, max_batch_tokens, max_requests_per_batch=256,
        scheduler_type="fifo", safety_margin=None, allow_block_sharing=true,
        layer_types=None, sliding_window=None, cpu_offload_blocks=0,
        max_batch_cache_tokens=None, defer_shared_prefixes=true, priority_preemption=false,
        max_step_ms=None),
        text_signature = "(num_blocks, page_size, max_batch_tokens, max_requests_per_batch=256, \
scheduler_type='fifo', safety_margin=None, allow_block_sharing=True, \
layer_types=('full_attention',), sliding_window=None, cpu_offload_blocks=0, \
max_batch_cache_tokens=None, defer_shared_prefixes=True, priority_preemption=False, \
max_step_ms=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        page_size: i64,
        max_batch_tokens: i64,
        max_requests_per_batch: i64,
        scheduler_type: &str,
        safety_margin: Option<f64>,
        allow_block_sharing: bool,
        layer_types: Option<Vec<String>>,
        sliding_window: Option<i64>,
        cpu_offload_blocks: i64,
        max_batch_cache_tokens: Option<i64>,
        defer_shared_prefixes: bool,
        priority_preemption: bool,
        max_step_ms: Option<f64>,
    ) -> PyResult<Self> {
        let cfg = ConfigArgs {
            num_blocks,
            page_size,
            max_batch_tokens,
            max_requests_per_batch,
            scheduler_type,
            safety_margin,
            allow_block_sharing,
            layer_types,
            sliding_window,
            cpu_offload_blocks,
            max_batch_cache_tokens,
            defer_shared_prefixes,
            priority_preemption,
            max_step_ms,
        }
        .to_config()?;
        let inner = core::Scheduler::new(cfg).map_err(to_py)?;
        let (has_full, has_sliding) = (inner.plan().has_full, inner.plan().has_sliding);
        Ok(Scheduler {
            inner,
            names: Vec::new(),
            gens: Vec::new(),
            plan_names: NameCache::default(),
            out_names: NameCache::default(),
            recycle: Recycler::default(),
            has_full,
            has_sliding,
        })
    }

    /// Add a request; `FieldError` naming the field on bad input or if it could never fit.
    /// `skip_prefix_lookup=True`: the request takes no prefix-cache hits (every prompt
    /// position is computed; its blocks are still offered to the cache). `cache_salt`
    /// (non-zero): the request's prefix-cache namespace (a LoRA adapter's): it shares blocks
    /// only with requests of the same salt. `offline=True`: part of an offline batch, whose
    /// caller waits for all of it: the step-time budget binds only while an unfinished
    /// request is not offline.
    #[pyo3(signature = (request_id, prompt_token_ids, max_new_tokens, eos_token_ids=None,
        stop_token_ids=None, priority=0, stop_sequences=None, skip_prefix_lookup=false,
        cache_salt=0, offline=false),
        text_signature = "($self, request_id, prompt_token_ids, max_new_tokens, eos_token_ids=(), \
stop_token_ids=(), priority=0, stop_sequences=(), skip_prefix_lookup=False, cache_salt=0, \
offline=False)")]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: &Bound<'_, PyString>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_new_tokens: i64,
        eos_token_ids: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        priority: i64,
        stop_sequences: Option<&Bound<'_, PyAny>>,
        skip_prefix_lookup: bool,
        cache_salt: u64,
        offline: bool,
    ) -> PyResult<()> {
        let prompt = tokens_from(prompt_token_ids, "prompt_token_ids", "prompt")?;
        let max_new_tokens = usize_arg(max_new_tokens, "max_new_tokens")?;
        let eos = match eos_token_ids {
            Some(o) => tokens_from(o, "eos_token_ids", "eos_token_ids")?,
            None => Vec::new(),
        };
        let stops = match stop_token_ids {
            Some(o) => tokens_from(o, "stop_token_ids", "stop_token_ids")?,
            None => Vec::new(),
        };
        let seqs = match stop_sequences {
            Some(o) => sequences_from(o, "stop_sequences")?,
            None => Vec::new(),
        };
        let stop = StopConditions {
            max_new_tokens,
            eos_token_ids: eos,
            stop_token_ids: stops,
            stop_sequences: seqs,
        };
        let id = request_id.to_str()?;
        let idx = self
            .inner
            .add_request_opts(id, prompt, stop, priority, skip_prefix_lookup)
            .map_err(to_py)? as usize;
        if cache_salt != 0 {
            // a request just added is waiting with nothing computed: this can't fail
            self.inner.set_cache_salt(id, cache_salt).map_err(to_py)?;
        }
        if offline {
            self.inner.set_offline(id, true).map_err(to_py)?;
        }
        if self.names.len() <= idx {
            self.names.resize_with(idx + 1, || None);
            self.gens.resize(idx + 1, 0);
        }
        self.names[idx] = Some(request_id.clone().unbind());
        self.gens[idx] = self.gens[idx].wrapping_add(1);
        Ok(())
    }

    /// Plan the next step: a StepPlan, or None when nothing can run. RuntimeError while a
    /// plan is outstanding.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<Option<StepPlan>> {
        let (num_rows, num_tokens, num_sampled) = match self.inner.schedule().map_err(to_py)? {
            Some(p) => (p.num_rows(), p.num_tokens(), p.num_sampled()),
            None => return Ok(None),
        };
        self.export(py, num_rows, num_tokens, num_sampled).map(Some)
    }

    /// Plan the step after the outstanding one before its sampled tokens are known (async
    /// batching): a StepPlan with `ahead=True`, or None when no row fits (then `update()`
    /// the outstanding plan and go back to `schedule()`). Needs exactly one outstanding plan
    /// (RuntimeError otherwise). Requests sampled by the outstanding plan get one-token rows
    /// whose input id is their pending token (`prev_token_index`); those whose finish is
    /// certain (`max_new_tokens` reached by it) are left out. Never preempts or swaps; may
    /// admit new requests. `update()` always applies to the oldest outstanding plan.
    fn schedule_ahead(&mut self, py: Python<'_>) -> PyResult<Option<StepPlan>> {
        let (num_rows, num_tokens, num_sampled) =
            match self.inner.schedule_ahead().map_err(to_py)? {
                Some(p) => (p.num_rows(), p.num_tokens(), p.num_sampled()),
                None => return Ok(None),
            };
        self.export(py, num_rows, num_tokens, num_sampled).map(Some)
    }

    /// Outstanding plans (0, 1 or 2): scheduled, not yet updated.
    #[getter]
    fn num_outstanding(&self) -> usize {
        self.inner.num_outstanding()
    }

    /// Whether a plan awaits `update()`.
    #[getter]
    fn has_outstanding_plan(&self) -> bool {
        self.inner.has_outstanding_plan()
    }
    /// Apply one sampled token per `logits_indices` entry (int32 numpy array or int
    /// sequence). Without an outstanding plan, `update(())` reports pending cancellations.
    fn update(
        &mut self,
        py: Python<'_>,
        sampled_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<StepOutput> {
        let inner = &mut self.inner;
        with_tokens_i32(sampled_token_ids, "sampled_token_ids", |s| {
            inner.update(s).map(|_| ())
        })?
        .map_err(to_py)?;
        let mut d = self.recycle.take_output();
        self.inner.export_output(&mut d);
        let row_names = self.out_names.get_or_same(
            py,
            self.inner.output_repeats_requests(),
            d.reqs.iter().copied(),
            &self.names,
            &self.gens,
        )?;
        Ok(StepOutput::new(d, self.recycle.clone(), row_names))
    }

    /// Propose `tokens` (int32 numpy array or int sequence) as the next tokens of request
    /// `request_id`, for the next `schedule()` only (it consumes every proposal): a decoding
    /// request then gets a speculative row of `1 + k` query tokens and `1 + k`
    /// `logits_indices` entries; `update()` accepts the longest prefix its sampled tokens
    /// match, plus the token sampled after it. False for an unknown or finished request or
    /// an empty proposal; ValueError (field `tokens`) for a negative token.
    fn propose(&mut self, request_id: &str, tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        let inner = &mut self.inner;
        with_tokens_i32(tokens, "tokens", |t| inner.propose(request_id, t))?.map_err(to_py)
    }

    /// Prompt-lookup proposals of up to `num_tokens` tokens (the tokens that followed the
    /// most recent earlier occurrence of the last `n` tokens of the request's prompt and
    /// output, `n` from `max_n` down to `min_n`) for the decoding requests in `request_ids`
    /// (all running requests when None). Returns how many got one.
    #[pyo3(signature = (num_tokens, min_n, max_n, request_ids=None))]
    fn propose_ngram(
        &mut self,
        num_tokens: usize,
        min_n: usize,
        max_n: usize,
        request_ids: Option<Vec<String>>,
    ) -> PyResult<usize> {
        if min_n < 1 || max_n < min_n {
            return Err(to_py(ferrobatch_core::Error::invalid(
                "min_n",
                "propose_ngram needs 1 <= min_n <= max_n",
            )));
        }
        let ids: Option<Vec<&str>> = request_ids
            .as_ref()
            .map(|v| v.iter().map(String::as_str).collect());
        Ok(self
            .inner
            .propose_ngram(num_tokens, min_n, max_n, ids.as_deref()))
    }

    /// Cut a decoding request back to its first `length` tokens (prompt + generated): the
    /// rest is forgotten as if never generated (a draft model's rejected proposals); its
    /// cached keys and blocks are cut back with them. False (nothing changed) for an
    /// unknown or not decoding request, `length` below the prompt, or a sliding ring that
    /// moved on too far; RuntimeError while a plan is outstanding.
    fn rewind(&mut self, request_id: &str, length: usize) -> PyResult<bool> {
        self.inner.rewind(request_id, length).map_err(to_py)
    }

    /// Most proposed tokens one speculative row carries (`page_size`; `sliding_window - 1`
    /// with sliding layers); longer proposals are cut.
    #[getter]
    fn spec_cap(&self) -> usize {
        self.inner.spec_cap()
    }

    /// Cancel a request in any state (frees everything). False if unknown or finished.
    fn cancel(&mut self, request_id: &str) -> bool {
        self.inner.cancel(request_id)
    }

    /// Recompute a request from scratch (soft reset: generated tokens join the prompt, its
    /// chunks or swap slots are freed, it waits at its queue position). False if unknown,
    /// finished or waiting; RuntimeError while a plan is outstanding.
    fn recompute(&mut self, request_id: &str) -> PyResult<bool> {
        self.inner.recompute(request_id).map_err(to_py)
    }

    /// Whether a request is waiting, running or swapped, or a cancellation is unreported.
    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    /// Counters and gauges (a fresh dict; the O(1) properties are cheaper for one value):
    /// `num_blocks`; `num_free_blocks` (allocatable: uninitialized + cached, as the property);
    /// `num_cached_blocks` (free but keeping a hashed block, reclaimed LRU-first);
    /// `num_used_blocks` (refcount > 0; used + free = num_blocks); `waiting`, `running`,
    /// `swapped` (request counts); `finished` (finished or cancelled, reported);
    /// `prefix_hit_tokens` and `prompt_tokens` (summed over admissions, re-admissions after a
    /// soft reset included); `deferred_admissions` (admissions put off a step to share a
    /// block another row of that step fills); `num_preemptions` (`priority_preemptions` of
    /// them for a waiting request of higher priority), `num_offloads`, `num_soft_resets`;
    /// `num_recomputes` (`recompute()` calls that reset a request); `num_evictions` (cached
    /// blocks reclaimed); `num_swap_free`, `cpu_offload_blocks`; `steps`,
    /// `generated_tokens`; `stalled_requests`, `stalled_blocks` (last plan: rows that found
    /// the pool short and the chunks they missed, before preemption); `spec_rows`,
    /// `spec_proposed`, `spec_accepted` (speculative rows planned, the proposed tokens they
    /// carried, those accepted); `prefix_caching`; the step-time budget: `time_budget_steps`
    /// (steps it bound), `prefill_budget_ms` / `prefill_budget_tokens` (last step's prefill
    /// allowance), `step_predicted_ms` (last step), `cost_samples` (times reported) and the
    /// cost model's `cost_ms_per_step`, `cost_ms_per_token`, `cost_ms_per_row`,
    /// `cost_ms_per_kkey_full`, `cost_ms_per_kkey_sliding` (per thousand keys attended).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("num_free_blocks", s.num_free_blocks)?;
        d.set_item("num_cached_blocks", s.num_cached_blocks)?;
        d.set_item("num_used_blocks", s.num_used_blocks)?;
        d.set_item("waiting", s.waiting)?;
        d.set_item("running", s.running)?;
        d.set_item("swapped", s.swapped)?;
        d.set_item("finished", s.finished)?;
        d.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
        d.set_item("deferred_admissions", s.deferred_admissions)?;
        d.set_item("prompt_tokens", s.prompt_tokens)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("priority_preemptions", s.priority_preemptions)?;
        d.set_item("num_offloads", s.num_offloads)?;
        d.set_item("num_soft_resets", s.num_soft_resets)?;
        d.set_item("num_recomputes", s.num_recomputes)?;
        d.set_item("num_evictions", s.num_evictions)?;
        d.set_item("num_swap_free", s.num_swap_free)?;
        d.set_item("cpu_offload_blocks", self.inner.config().cpu_offload_blocks)?;
        d.set_item("steps", s.steps)?;
        d.set_item("generated_tokens", s.generated_tokens)?;
        d.set_item("stalled_requests", s.stalled_requests)?;
        d.set_item("stalled_blocks", s.stalled_blocks)?;
        d.set_item("spec_rows", s.spec_rows)?;
        d.set_item("spec_proposed", s.spec_proposed)?;
        d.set_item("spec_accepted", s.spec_accepted)?;
        d.set_item("prefix_caching", self.inner.prefix_caching())?;
        d.set_item("time_budget_steps", s.time_budget_steps)?;
        d.set_item("prefill_budget_ms", s.prefill_budget_ms)?;
        d.set_item("prefill_budget_tokens", s.prefill_budget_tokens)?;
        d.set_item("step_predicted_ms", s.step_predicted_ms)?;
        d.set_item("cost_samples", s.cost_samples)?;
        for (k, v) in COST_KEYS.iter().zip(s.cost_coef) {
            d.set_item(*k, v)?;
        }
        Ok(d)
    }

    /// The measured time (seconds > 0) of the step whose plan the last `update()` applied,
    /// for the step-time cost model. Returns whether it was taken: False without
    /// `max_step_ms`, for an ahead plan, or when that step's time was reported already.
    /// FieldError (field `seconds`) for a value that is not a finite number > 0.
    fn report_step_time(&mut self, seconds: f64) -> PyResult<bool> {
        self.inner.report_step_time(seconds).map_err(to_py)
    }

    /// The step-time budget (ms), or None.
    #[getter]
    fn max_step_ms(&self) -> Option<f64> {
        self.inner.config().max_step_ms
    }

    /// The last `schedule()`'s prefill allowance in predicted milliseconds (0.0 when the
    /// step-time budget did not bind). O(1).
    #[getter]
    fn prefill_budget_ms(&self) -> f64 {
        self.inner.prefill_budget().0
    }

    /// The prefill tokens the last `schedule()`'s allowance buys at its first prefill row's
    /// context (`max_batch_tokens` when the step-time budget did not bind). O(1).
    #[getter]
    fn prefill_budget_tokens(&self) -> usize {
        self.inner.prefill_budget().1
    }

    /// Raise RuntimeError naming the broken invariant, if any.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(to_py)
    }

    /// A dict describing the whole state (keys documented on the class).
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner;
        let pool = s.pool();
        let d = PyDict::new(py);
        d.set_item("num_blocks", s.config().num_blocks)?;
        d.set_item("page_size", s.config().page_size)?;
        d.set_item("ring_size", s.layout().ring)?;
        d.set_item("sliding_window", s.config().sliding_window)?;
        d.set_item("prefix_caching", s.prefix_caching())?;
        d.set_item("safety_margin", s.safety_margin())?;
        d.set_item("outstanding", s.has_outstanding_plan())?;
        d.set_item("num_outstanding", s.num_outstanding())?;
        d.set_item("deferred_chunks", s.deferred_chunks())?;
        d.set_item("refcounts", pool.refcounts())?;
        d.set_item("free_chunks", pool.uninit_chunks())?;
        d.set_item("cached_chunks", pool.cached_chunks())?;
        let hashed: Vec<u32> = (0..(s.config().num_blocks + 2) as u32)
            .filter(|&c| pool.is_hashed(c))
            .collect();
        d.set_item("hashed_chunks", hashed)?;
        d.set_item("swap_free_slots", s.swap_pool().free_slots())?;
        d.set_item("swap_deferred_slots", s.deferred_swap_slots())?;
        let reqs = PyDict::new(py);
        for (idx, r) in s.live_requests() {
            let e = PyDict::new(py);
            e.set_item("state", r.state.as_str())?;
            e.set_item("num_computed_tokens", r.num_computed)?;
            e.set_item("num_tokens", r.tokens.len())?;
            e.set_item("num_prompt_tokens", r.prompt_len)?;
            e.set_item("num_generated_tokens", r.num_generated())?;
            e.set_item("priority", r.key.0)?;
            e.set_item("arrival", r.key.1)?;
            e.set_item("admission_deferrals", r.admission_deferrals)?;
            let blocks = PyDict::new(py);
            if self.has_full {
                blocks.set_item("full_attention", &r.full)?;
            }
            if self.has_sliding {
                blocks.set_item("sliding_attention", &r.ring)?;
            }
            e.set_item("blocks", blocks)?;
            e.set_item("swap_slots", &r.swap_slots)?;
            reqs.set_item(self.name(py, idx), e)?;
        }
        d.set_item("requests", reqs)?;
        Ok(d)
    }

    /// Whether a request of `prompt_len` prompt tokens and `max_new_tokens` could ever fit
    /// the cache: exactly the length and capacity checks of `add_request`, adding nothing.
    /// `FieldError` with field "prompt" (empty, or too long even with one new token) or
    /// "max_new_tokens" (below 1, or more than the prompt leaves room for).
    fn check_fits(&self, prompt_len: i64, max_new_tokens: i64) -> PyResult<()> {
        self.inner
            .check_fits(
                usize_arg(prompt_len, "prompt")?,
                usize_arg(max_new_tokens, "max_new_tokens")?,
            )
            .map_err(to_py)
    }

    /// Chunks a request holding `cached_tokens` keys needs at most (its full-attention
    /// blocks plus its sliding ring); a request's lifetime holds `prompt + max_new_tokens - 1`.
    fn lifetime_chunks(&self, cached_tokens: i64) -> PyResult<usize> {
        Ok(self
            .inner
            .lifetime_chunks(usize_arg(cached_tokens, "cached_tokens")?))
    }

    /// The largest `prompt_len + max_new_tokens` that `check_fits` accepts (0 when nothing
    /// fits).
    fn max_request_tokens(&self) -> usize {
        self.inner.max_request_tokens()
    }

    /// Chunks allocatable now: uninitialized *and* cached ones (free chunks that keep a
    /// hashed block, evicted LRU-first), as `stats()["num_free_blocks"]`; `snapshot()` lists
    /// the two kinds apart (`"free_chunks"`: uninitialized, `"cached_chunks"`).
    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.inner.num_free_blocks()
    }
    /// Free chunks that keep a hashed block (counted in `num_free_blocks` too).
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.inner.num_cached_blocks()
    }
    /// Requests waiting for admission (never run, or soft-reset).
    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }
    /// Requests holding device chunks (prefilling or decoding).
    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }
    /// Requests offloaded to the CPU swap pool.
    #[getter]
    fn num_swapped(&self) -> usize {
        self.inner.num_swapped()
    }
    /// Rows the last plan found short of chunks (`stats()["stalled_requests"]`): counted
    /// before preemption by `schedule()`; left out by `schedule_ahead()`, which never preempts.
    #[getter]
    fn num_stalled(&self) -> usize {
        self.inner.num_stalled()
    }
    /// A waiting request of higher priority would preempt running ones: only `schedule()`
    /// does (`schedule_ahead()` never preempts).
    #[getter]
    fn wants_priority_preemption(&self) -> bool {
        self.inner.wants_priority_preemption()
    }
    /// Data chunks in the device pool (chunk ids `2 .. num_blocks + 2`).
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }
    /// Tokens per chunk.
    #[getter]
    fn page_size(&self) -> usize {
        self.inner.config().page_size
    }
    /// The attention type of each layer, as configured.
    #[getter]
    fn layer_types(&self) -> Vec<&'static str> {
        self.inner
            .config()
            .layer_types
            .iter()
            .map(|t| t.as_str())
            .collect()
    }
    /// The attention types present ("full_attention" first): the keys of a plan's dicts.
    #[getter]
    fn attention_types(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.has_full {
            v.push("full_attention");
        }
        if self.has_sliding {
            v.push("sliding_attention");
        }
        v
    }
    /// Chunks in a sliding request's ring (the sliding block table's width); 0 without
    /// sliding layers.
    #[getter]
    fn ring_size(&self) -> usize {
        self.inner.layout().ring
    }
    /// Whether full blocks are shared through the prefix cache.
    #[getter]
    fn prefix_caching(&self) -> bool {
        self.inner.prefix_caching()
    }
    /// The effective admission margin (free fraction kept while something runs).
    #[getter]
    fn safety_margin(&self) -> f64 {
        self.inner.safety_margin()
    }
    /// Chunk slots in the CPU swap pool.
    #[getter]
    fn cpu_offload_blocks(&self) -> usize {
        self.inner.config().cpu_offload_blocks
    }
    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Scheduler(num_blocks={}, page_size={}, max_batch_tokens={}, scheduler_type={:?})",
            c.num_blocks, c.page_size, c.max_batch_tokens, c.scheduler_type
        )
    }
}
