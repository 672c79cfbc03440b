//! PyO3 layer of ferrobatch: type conversion only. All decisions live in `ferrobatch-core`.
//!
//! Performance notes (decode step at N=1024 through the bindings):
//! * each request id is kept as the caller's `str` object (one incref, created once);
//! * plan arrays are copied from the core's reused buffers into fresh numpy arrays
//!   (a memcpy each; the arrays the caller gets are its own);
//! * `StepOutput` deltas are built lazily in `__getitem__`; the engine reads the array views;
//! * the GIL is *not* released in `schedule()`/`update()`: they take microseconds, while
//!   re-acquiring a contended GIL can take a whole switch interval (5 ms).

use ferrobatch_core as core;
use ferrobatch_core::request::StopConditions;
use ferrobatch_core::{AttentionType, ErrorKind, FinishReason, SchedulerConfig, SchedulerType};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

fn to_py(e: core::Error) -> PyErr {
    match e.kind {
        ErrorKind::Value => PyValueError::new_err(e.message),
        ErrorKind::Runtime => PyRuntimeError::new_err(e.message),
    }
}

/// Token ids from any int sequence (list, tuple, numpy array), validated to int32 >= 0.
fn tokens_from(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<u32>> {
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        let ro = a.readonly();
        let s = ro.as_array();
        let mut v = Vec::with_capacity(s.len());
        for &t in s.iter() {
            if t < 0 {
                return Err(PyValueError::new_err(format!(
                    "{field} must be non-negative int32 (got {t})"
                )));
            }
            v.push(t as u32);
        }
        return Ok(v);
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyValueError::new_err(format!(
            "{field} must be a sequence of ints, not str"
        )));
    }
    let raw: Vec<i64> = obj
        .extract()
        .map_err(|_| PyValueError::new_err(format!("{field} must be a sequence of ints")))?;
    raw.into_iter()
        .map(|t| {
            if (0..=i32::MAX as i64).contains(&t) {
                Ok(t as u32)
            } else {
                Err(PyValueError::new_err(format!(
                    "{field} must be non-negative int32 (got {t})"
                )))
            }
        })
        .collect()
}

fn usize_arg(v: i64, field: &str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{field} must be >= 0 (got {v})")))
}

fn arr1<'py>(py: Python<'py>, v: &[i32]) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_slice(py, v)
}

fn arr2<'py>(py: Python<'py>, v: &[i32], rows: usize, cols: usize) -> Bound<'py, PyArray2<i32>> {
    let a = PyArray2::<i32>::zeros(py, [rows, cols], false);
    if !v.is_empty() {
        let mut rw = a.readwrite();
        rw.as_slice_mut()
            .expect("fresh C-contiguous array")
            .copy_from_slice(v);
    }
    a
}

fn reason_str(r: Option<FinishReason>) -> Option<&'static str> {
    r.map(FinishReason::as_str)
}

/// One step of work for the model runner (ARCHITECTURE.md §3). Attributes: `request_ids`
/// (list[str], B), int32 arrays `input_ids` [T], `positions` [T], `cu_seqlens_q` [B+1],
/// `seqlens_k` [B], `logits_indices` [N], `logits_rows` [N], dicts keyed by attention type
/// `slot_mapping` ([T] each) and `block_tables` ([B, W] each), `swap_out` [n, 2]
/// (device chunk, swap slot), `swap_in` [n, 2] (swap slot, device chunk), and the ints
/// `num_rows`, `num_tokens`, `num_sampled`, `page_size`.
#[pyclass(module = "ferrobatch._core", frozen, get_all)]
pub struct StepPlan {
    request_ids: Py<PyList>,
    input_ids: Py<PyArray1<i32>>,
    positions: Py<PyArray1<i32>>,
    cu_seqlens_q: Py<PyArray1<i32>>,
    seqlens_k: Py<PyArray1<i32>>,
    logits_indices: Py<PyArray1<i32>>,
    logits_rows: Py<PyArray1<i32>>,
    slot_mapping: Py<PyDict>,
    block_tables: Py<PyDict>,
    swap_out: Py<PyArray2<i32>>,
    swap_in: Py<PyArray2<i32>>,
    num_rows: usize,
    num_tokens: usize,
    num_sampled: usize,
    page_size: usize,
}

#[pymethods]
impl StepPlan {
    fn __repr__(&self) -> String {
        format!(
            "StepPlan(rows={}, tokens={}, sampled={})",
            self.num_rows, self.num_tokens, self.num_sampled
        )
    }
}

/// One request's delta: `request_id`, `new_token_ids` (list[int]), `finished`,
/// `finish_reason` ("stop" | "length" | "cancelled" | None).
#[pyclass(module = "ferrobatch._core", frozen, get_all)]
pub struct Delta {
    request_id: Py<PyString>,
    new_token_ids: Py<PyList>,
    finished: bool,
    finish_reason: Option<&'static str>,
}

#[pymethods]
impl Delta {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Delta(request_id={}, new_token_ids={}, finished={}, finish_reason={})",
            self.request_id.bind(py).repr()?,
            self.new_token_ids.bind(py),
            if self.finished { "True" } else { "False" },
            match self.finish_reason {
                Some(r) => format!("'{r}'"),
                None => "None".to_string(),
            }
        ))
    }
}

/// The result of `update()`: a sequence of [`Delta`] (len / indexing / iteration, built
/// lazily) plus array views for the engine, all of length n = len(output):
/// `request_ids` (list[str]), `token_ids` (int32 [n], -1 where the delta has no token, i.e.
/// a cancellation), `finished` (bool [n]), `rows` (int32 [n]: the plan's sampled row the
/// token came from, -1 for cancellations), `finish_reasons` (list[str | None]),
/// `all_have_token` (bool: every delta has exactly one token), `num_finished` (int).
#[pyclass(module = "ferrobatch._core", frozen)]
pub struct StepOutput {
    #[pyo3(get)]
    request_ids: Py<PyList>,
    #[pyo3(get)]
    token_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    finished: Py<PyArray1<bool>>,
    #[pyo3(get)]
    rows: Py<PyArray1<i32>>,
    #[pyo3(get)]
    all_have_token: bool,
    #[pyo3(get)]
    num_finished: usize,
    tokens: Vec<i32>,
    done: Vec<bool>,
    reasons: Vec<Option<&'static str>>,
}

impl StepOutput {
    fn delta(&self, py: Python<'_>, i: usize) -> PyResult<Delta> {
        let id = self
            .request_ids
            .bind(py)
            .get_item(i)?
            .cast_into::<PyString>()?
            .unbind();
        let t = self.tokens[i];
        let toks = if t >= 0 {
            PyList::new(py, [t])?
        } else {
            PyList::empty(py)
        };
        Ok(Delta {
            request_id: id,
            new_token_ids: toks.unbind(),
            finished: self.done[i],
            finish_reason: self.reasons[i],
        })
    }
}

#[pymethods]
impl StepOutput {
    fn __len__(&self) -> usize {
        self.tokens.len()
    }
    fn __getitem__(&self, py: Python<'_>, i: isize) -> PyResult<Delta> {
        let n = self.tokens.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if j < 0 || j >= n {
            return Err(PyIndexError::new_err("StepOutput index out of range"));
        }
        self.delta(py, j as usize)
    }
    fn __iter__(slf: Bound<'_, Self>) -> StepOutputIter {
        StepOutputIter {
            out: slf.unbind(),
            i: 0,
        }
    }
    #[getter]
    fn finish_reasons(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        Ok(PyList::new(py, self.reasons.iter().copied())?.unbind())
    }
    fn __repr__(&self) -> String {
        format!(
            "StepOutput(len={}, finished={})",
            self.tokens.len(),
            self.num_finished
        )
    }
}

#[pyclass(module = "ferrobatch._core")]
pub struct StepOutputIter {
    out: Py<StepOutput>,
    i: usize,
}

#[pymethods]
impl StepOutputIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }
    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Delta>> {
        let out = self.out.get();
        if self.i >= out.tokens.len() {
            return Ok(None);
        }
        let d = out.delta(py, self.i)?;
        self.i += 1;
        Ok(Some(d))
    }
}

/// Continuous-batching scheduler and paged KV-cache allocator (see ARCHITECTURE.md §3).
///
/// `snapshot()` returns a dict for outside checks:
/// * `"num_blocks"`, `"page_size"`, `"ring_size"` (R, 0 without sliding layers),
///   `"sliding_window"`, `"prefix_caching"` (bool), `"safety_margin"` (effective),
///   `"outstanding"` (bool: a plan awaits update()),
/// * `"refcounts"`: list[int] of length num_blocks + 2 (chunk id -> references held),
/// * `"free_chunks"`: list[int] of uninitialized free chunks,
/// * `"cached_chunks"`: list[int] of free chunks that keep a hashed block, eviction order
///   (first = reclaimed first),
/// * `"hashed_chunks"`: list[int] of every chunk registered in the prefix table,
/// * `"swap_free_slots"`: list[int]; `"swap_deferred_slots"`: slots read by the outstanding
///   plan's swap-in (released by the next update()),
/// * `"requests"`: {request_id: {"state": "waiting"|"prefilling"|"decoding"|"swapped",
///   "num_computed_tokens", "num_tokens", "num_prompt_tokens", "num_generated_tokens",
///   "priority", "arrival", "blocks": {"full_attention": [...], "sliding_attention": [...]}
///   (only the types the model has), "swap_slots": [...]}} for every unfinished request.
#[pyclass(module = "ferrobatch._core")]
pub struct Scheduler {
    inner: core::Scheduler,
    /// Request id objects by slab index (kept alive; one incref per use).
    names: Vec<Option<Py<PyString>>>,
    has_full: bool,
    has_sliding: bool,
}

impl Scheduler {
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
        max_batch_cache_tokens=None))]
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
    ) -> PyResult<Self> {
        let layer_types = match layer_types {
            None => vec![AttentionType::Full],
            Some(v) => v
                .iter()
                .map(|s| AttentionType::parse(s))
                .collect::<core::Result<Vec<_>>>()
                .map_err(to_py)?,
        };
        let cfg = SchedulerConfig {
            num_blocks: usize_arg(num_blocks, "num_blocks")?,
            page_size: usize_arg(page_size, "page_size")?,
            max_batch_tokens: usize_arg(max_batch_tokens, "max_batch_tokens")?,
            max_requests_per_batch: usize_arg(max_requests_per_batch, "max_requests_per_batch")?,
            max_batch_cache_tokens: max_batch_cache_tokens
                .map(|v| usize_arg(v, "max_batch_cache_tokens"))
                .transpose()?,
            scheduler_type: SchedulerType::parse(scheduler_type).map_err(to_py)?,
            safety_margin,
            allow_block_sharing,
            layer_types,
            sliding_window: sliding_window
                .map(|v| usize_arg(v, "sliding_window"))
                .transpose()?,
            cpu_offload_blocks: usize_arg(cpu_offload_blocks, "cpu_offload_blocks")?,
            hash_mask: u64::MAX,
        };
        let inner = core::Scheduler::new(cfg).map_err(to_py)?;
        let (has_full, has_sliding) = (inner.plan().has_full, inner.plan().has_sliding);
        Ok(Scheduler {
            inner,
            names: Vec::new(),
            has_full,
            has_sliding,
        })
    }

    /// Add a request; ValueError naming the field on bad input or if it could never fit.
    #[pyo3(signature = (request_id, prompt_token_ids, max_new_tokens, eos_token_ids=None,
        stop_token_ids=None, priority=0, stop_sequences=None))]
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
    ) -> PyResult<()> {
        let prompt = tokens_from(prompt_token_ids, "prompt_token_ids")?;
        if max_new_tokens < 1 {
            return Err(PyValueError::new_err(format!(
                "max_new_tokens must be >= 1 (got {max_new_tokens})"
            )));
        }
        let eos = match eos_token_ids {
            Some(o) => tokens_from(o, "eos_token_ids")?,
            None => Vec::new(),
        };
        let stops = match stop_token_ids {
            Some(o) => tokens_from(o, "stop_token_ids")?,
            None => Vec::new(),
        };
        let mut seqs = Vec::new();
        if let Some(o) = stop_sequences {
            for item in o.try_iter().map_err(|_| {
                PyValueError::new_err("stop_sequences must be a sequence of token-id sequences")
            })? {
                seqs.push(tokens_from(&item?, "stop_sequences")?);
            }
        }
        let stop = StopConditions {
            max_new_tokens: max_new_tokens as usize,
            eos_token_ids: eos,
            stop_token_ids: stops,
            stop_sequences: seqs,
        };
        let id = request_id.to_str()?;
        let idx = self
            .inner
            .add_request(id, prompt, stop, priority)
            .map_err(to_py)? as usize;
        if self.names.len() <= idx {
            self.names.resize_with(idx + 1, || None);
        }
        self.names[idx] = Some(request_id.clone().unbind());
        Ok(())
    }

    /// Plan the next step: a StepPlan, or None when nothing can run.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<Option<StepPlan>> {
        let plan = match self.inner.schedule().map_err(to_py)? {
            Some(p) => p,
            None => return Ok(None),
        };
        let names = &self.names;
        let ids = PyList::new(
            py,
            plan.rows
                .iter()
                .map(|r| names[r.req as usize].as_ref().expect("named").bind(py)),
        )?;
        let b = plan.num_rows();
        let slot_mapping = PyDict::new(py);
        let block_tables = PyDict::new(py);
        if self.has_full {
            slot_mapping.set_item(
                pyo3::intern!(py, "full_attention"),
                arr1(py, &plan.slot_mapping_full),
            )?;
            block_tables.set_item(
                pyo3::intern!(py, "full_attention"),
                arr2(py, &plan.block_table_full, b, plan.full_width),
            )?;
        }
        if self.has_sliding {
            slot_mapping.set_item(
                pyo3::intern!(py, "sliding_attention"),
                arr1(py, &plan.slot_mapping_sliding),
            )?;
            block_tables.set_item(
                pyo3::intern!(py, "sliding_attention"),
                arr2(py, &plan.block_table_sliding, b, plan.sliding_width),
            )?;
        }
        Ok(Some(StepPlan {
            request_ids: ids.unbind(),
            input_ids: arr1(py, &plan.input_ids).unbind(),
            positions: arr1(py, &plan.positions).unbind(),
            cu_seqlens_q: arr1(py, &plan.cu_seqlens_q).unbind(),
            seqlens_k: arr1(py, &plan.seqlens_k).unbind(),
            logits_indices: arr1(py, &plan.logits_indices).unbind(),
            logits_rows: arr1(py, &plan.logits_rows).unbind(),
            slot_mapping: slot_mapping.unbind(),
            block_tables: block_tables.unbind(),
            swap_out: arr2(py, &plan.swap_out, plan.swap_out.len() / 2, 2).unbind(),
            swap_in: arr2(py, &plan.swap_in, plan.swap_in.len() / 2, 2).unbind(),
            num_rows: b,
            num_tokens: plan.num_tokens(),
            num_sampled: plan.num_sampled(),
            page_size: self.inner.config().page_size,
        }))
    }

    /// Apply one sampled token per `logits_indices` entry (int32 numpy array or int
    /// sequence). Without an outstanding plan, `update(())` reports pending cancellations.
    fn update(
        &mut self,
        py: Python<'_>,
        sampled_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<StepOutput> {
        let out = if let Ok(a) = sampled_token_ids.cast::<PyArray1<i32>>() {
            let ro: PyReadonlyArray1<i32> = a.readonly();
            match ro.as_slice() {
                Ok(s) => self.inner.update(s),
                Err(_) => {
                    let v: Vec<i32> = ro.as_array().iter().copied().collect();
                    self.inner.update(&v)
                }
            }
        } else {
            if sampled_token_ids.is_instance_of::<PyString>() {
                return Err(PyValueError::new_err(
                    "sampled_token_ids must be a sequence of ints",
                ));
            }
            let raw: Vec<i64> = sampled_token_ids.extract().map_err(|_| {
                PyValueError::new_err(
                    "sampled_token_ids must be an int32 array or a sequence of ints",
                )
            })?;
            let mut v = Vec::with_capacity(raw.len());
            for t in raw {
                if !(0..=i32::MAX as i64).contains(&t) {
                    return Err(PyValueError::new_err(format!(
                        "sampled_token_ids must be non-negative int32 (got {t})"
                    )));
                }
                v.push(t as i32);
            }
            self.inner.update(&v)
        }
        .map_err(to_py)?;
        let names = &self.names;
        let ids = PyList::new(
            py,
            out.reqs
                .iter()
                .map(|&i| names[i as usize].as_ref().expect("named").bind(py)),
        )?;
        let num_finished = out.finished.iter().filter(|&&f| f).count();
        Ok(StepOutput {
            request_ids: ids.unbind(),
            token_ids: arr1(py, &out.token_ids).unbind(),
            finished: PyArray1::from_slice(py, &out.finished).unbind(),
            rows: arr1(py, &out.rows).unbind(),
            all_have_token: out.all_have_token,
            num_finished,
            tokens: out.token_ids.clone(),
            done: out.finished.clone(),
            reasons: out.finish_reasons.iter().map(|&r| reason_str(r)).collect(),
        })
    }

    /// Cancel a request in any state (frees everything). False if unknown or finished.
    fn cancel(&mut self, request_id: &str) -> bool {
        self.inner.cancel(request_id)
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    /// Counters and gauges.
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
        d.set_item("prompt_tokens", s.prompt_tokens)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("num_offloads", s.num_offloads)?;
        d.set_item("num_soft_resets", s.num_soft_resets)?;
        d.set_item("num_evictions", s.num_evictions)?;
        d.set_item("num_swap_free", s.num_swap_free)?;
        d.set_item("cpu_offload_blocks", self.inner.config().cpu_offload_blocks)?;
        d.set_item("steps", s.steps)?;
        d.set_item("generated_tokens", s.generated_tokens)?;
        d.set_item("prefix_caching", self.inner.prefix_caching())?;
        Ok(d)
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

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }
    #[getter]
    fn page_size(&self) -> usize {
        self.inner.config().page_size
    }
    #[getter]
    fn layer_types(&self) -> Vec<&'static str> {
        self.inner
            .config()
            .layer_types
            .iter()
            .map(|t| t.as_str())
            .collect()
    }
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
    #[getter]
    fn ring_size(&self) -> usize {
        self.inner.layout().ring
    }
    #[getter]
    fn prefix_caching(&self) -> bool {
        self.inner.prefix_caching()
    }
    #[getter]
    fn safety_margin(&self) -> f64 {
        self.inner.safety_margin()
    }
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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Scheduler>()?;
    m.add_class::<StepPlan>()?;
    m.add_class::<StepOutput>()?;
    m.add_class::<Delta>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
