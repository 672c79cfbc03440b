//! PyO3 layer of ferrobatch: type conversion only. All decisions live in `ferrobatch-core`.
//!
//! Performance notes (decode step at N=1024 through the bindings):
//! * each request id is kept as the caller's `str` object (one incref, created once);
//! * plan arrays are copied from the core's reused buffers into fresh numpy arrays
//!   (a memcpy each; the arrays the caller gets are its own);
//! * `StepOutput` deltas are built lazily in `__getitem__`; the engine reads the array views;
//! * the GIL is *not* released in `schedule()`/`update()`: they take microseconds, while
//!   re-acquiring a contended GIL can take a whole switch interval (5 ms).

use std::sync::{Arc, Mutex};

mod kernels;

use ferrobatch_core as core;
use ferrobatch_core::request::StopConditions;
use ferrobatch_core::{AttentionType, ErrorKind, FinishReason, SchedulerConfig, SchedulerType};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

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

macro_rules! lazy_get {
    ($self:ident, $py:ident, $cell:ident, $make:expr) => {
        $self.$cell.get_or_init($py, || $make).clone_ref($py)
    };
}

/// The request-id tuple as a list, built on first access and cached in `cell`.
fn names_list(
    py: Python<'_>,
    cell: &PyOnceLock<Py<PyList>>,
    names: &Py<PyTuple>,
) -> PyResult<Py<PyList>> {
    Ok(cell
        .get_or_try_init(py, || {
            PyList::new(py, names.bind(py).iter()).map(Bound::unbind)
        })?
        .clone_ref(py))
}

/// One step of work for the model runner (ARCHITECTURE.md §3). Attributes: `request_ids`
/// (list[str], B), int32 arrays `input_ids` [T], `positions` [T], `cu_seqlens_q` [B+1],
/// `seqlens_k` [B], `logits_indices` [N], `logits_rows` [N], `prev_token_index` [T], dicts
/// keyed by attention type `slot_mapping` ([T] each) and `block_tables` ([B, W] each),
/// `swap_out` [n, 2] (device chunk, swap slot), `swap_in` [n, 2] (swap slot, device chunk),
/// the ints `num_rows`, `num_tokens`, `num_sampled`, `page_size`, and `ahead` (bool: built by
/// `schedule_ahead()`; its `prev_token_index` >= 0 entries take their input id from the
/// previous plan's sampled tokens).
///
/// The plan owns its data (copied out of the scheduler's buffers, which a steady decode
/// step advances in place; the copy reuses recycled buffers); each attribute's Python
/// object is built on first access and cached, so repeated access returns the same object.
#[pyclass(module = "ferrobatch._core", frozen)]
pub struct StepPlan {
    d: core::StepPlan,
    recycle: Recycler,
    names: Py<PyTuple>,
    #[pyo3(get)]
    num_rows: usize,
    #[pyo3(get)]
    num_tokens: usize,
    #[pyo3(get)]
    num_sampled: usize,
    #[pyo3(get)]
    page_size: usize,
    request_ids_c: PyOnceLock<Py<PyList>>,
    input_ids_c: PyOnceLock<Py<PyArray1<i32>>>,
    positions_c: PyOnceLock<Py<PyArray1<i32>>>,
    cu_seqlens_q_c: PyOnceLock<Py<PyArray1<i32>>>,
    seqlens_k_c: PyOnceLock<Py<PyArray1<i32>>>,
    logits_indices_c: PyOnceLock<Py<PyArray1<i32>>>,
    logits_rows_c: PyOnceLock<Py<PyArray1<i32>>>,
    slot_mapping_c: PyOnceLock<Py<PyDict>>,
    block_tables_c: PyOnceLock<Py<PyDict>>,
    swap_out_c: PyOnceLock<Py<PyArray2<i32>>>,
    swap_in_c: PyOnceLock<Py<PyArray2<i32>>>,
    prev_token_index_c: PyOnceLock<Py<PyArray1<i32>>>,
}

#[pymethods]
impl StepPlan {
    /// int32 [T]: -1 where `input_ids` holds the token id; else the index, in the previous
    /// plan's `logits_indices` order, of the previous plan's sampled token that is this
    /// token's input id (`input_ids` holds 0 there). All -1 for plans from `schedule()`.
    #[getter]
    fn prev_token_index(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(self, py, prev_token_index_c, {
            if self.d.prev_token_index.is_empty() {
                let a = PyArray1::<i32>::zeros(py, self.num_tokens, false);
                if self.num_tokens > 0 {
                    a.readwrite()
                        .as_slice_mut()
                        .expect("fresh C-contiguous array")
                        .fill(-1);
                }
                a.unbind()
            } else {
                arr1(py, &self.d.prev_token_index).unbind()
            }
        })
    }
    /// True for plans from `schedule_ahead()`.
    #[getter]
    fn ahead(&self) -> bool {
        self.d.ahead
    }
    #[getter]
    fn request_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        names_list(py, &self.request_ids_c, &self.names)
    }
    #[getter]
    fn input_ids(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(self, py, input_ids_c, arr1(py, &self.d.input_ids).unbind())
    }
    #[getter]
    fn positions(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(self, py, positions_c, arr1(py, &self.d.positions).unbind())
    }
    #[getter]
    fn cu_seqlens_q(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(
            self,
            py,
            cu_seqlens_q_c,
            arr1(py, &self.d.cu_seqlens_q).unbind()
        )
    }
    #[getter]
    fn seqlens_k(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(self, py, seqlens_k_c, arr1(py, &self.d.seqlens_k).unbind())
    }
    #[getter]
    fn logits_indices(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(
            self,
            py,
            logits_indices_c,
            arr1(py, &self.d.logits_indices).unbind()
        )
    }
    #[getter]
    fn logits_rows(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(
            self,
            py,
            logits_rows_c,
            arr1(py, &self.d.logits_rows).unbind()
        )
    }
    #[getter]
    fn swap_out(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        let v = &self.d.swap_out;
        lazy_get!(self, py, swap_out_c, arr2(py, v, v.len() / 2, 2).unbind())
    }
    #[getter]
    fn swap_in(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        let v = &self.d.swap_in;
        lazy_get!(self, py, swap_in_c, arr2(py, v, v.len() / 2, 2).unbind())
    }
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        Ok(self
            .slot_mapping_c
            .get_or_try_init(py, || -> PyResult<Py<PyDict>> {
                let d = PyDict::new(py);
                if self.d.has_full {
                    d.set_item(
                        intern!(py, "full_attention"),
                        arr1(py, &self.d.slot_mapping_full),
                    )?;
                }
                if self.d.has_sliding {
                    d.set_item(
                        intern!(py, "sliding_attention"),
                        arr1(py, &self.d.slot_mapping_sliding),
                    )?;
                }
                Ok(d.unbind())
            })?
            .clone_ref(py))
    }
    #[getter]
    fn block_tables(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        Ok(self
            .block_tables_c
            .get_or_try_init(py, || -> PyResult<Py<PyDict>> {
                let d = PyDict::new(py);
                let b = self.num_rows;
                if self.d.has_full {
                    d.set_item(
                        intern!(py, "full_attention"),
                        arr2(py, &self.d.block_table_full, b, self.d.full_width),
                    )?;
                }
                if self.d.has_sliding {
                    d.set_item(
                        intern!(py, "sliding_attention"),
                        arr2(py, &self.d.block_table_sliding, b, self.d.sliding_width),
                    )?;
                }
                Ok(d.unbind())
            })?
            .clone_ref(py))
    }
    fn __repr__(&self) -> String {
        format!(
            "StepPlan(rows={}, tokens={}, sampled={}, swap_out={}, swap_in={}{})",
            self.num_rows,
            self.num_tokens,
            self.num_sampled,
            self.d.swap_out.len() / 2,
            self.d.swap_in.len() / 2,
            if self.d.ahead { ", ahead=True" } else { "" }
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

/// The result of `update()`: a sequence of [`Delta`] (len / indexing / iteration; each delta
/// is built on access) plus views for the engine, all of length n = len(output) and built
/// on first access: `request_ids` (list[str]), `token_ids` (int32 [n], -1 where the delta
/// has no token, i.e. a cancellation), `finished` (bool [n]), `rows` (int32 [n]: the plan
/// row the token came from, -1 for cancellations), `finish_reasons` (list[str | None]),
/// `finished_request_ids` (list[str]), `all_have_token` (bool: every delta has exactly one
/// token, so `token_ids` has no -1), `num_finished` (int).
#[pyclass(module = "ferrobatch._core", frozen)]
pub struct StepOutput {
    d: core::StepOutput,
    recycle: Recycler,
    names: Py<PyTuple>,
    len: usize,
    #[pyo3(get)]
    all_have_token: bool,
    #[pyo3(get)]
    num_finished: usize,
    request_ids_c: PyOnceLock<Py<PyList>>,
    token_ids_c: PyOnceLock<Py<PyArray1<i32>>>,
    finished_c: PyOnceLock<Py<PyArray1<bool>>>,
    rows_c: PyOnceLock<Py<PyArray1<i32>>>,
}

impl StepOutput {
    fn delta(&self, py: Python<'_>, i: usize) -> PyResult<Delta> {
        let t = self.d.token_ids[i];
        let toks = if t >= 0 {
            PyList::new(py, [t])?
        } else {
            PyList::empty(py)
        };
        Ok(Delta {
            request_id: self
                .names
                .bind(py)
                .get_item(i)?
                .cast_into::<PyString>()?
                .unbind(),
            new_token_ids: toks.unbind(),
            finished: self.d.finished[i],
            finish_reason: reason_str(self.d.finish_reasons[i]),
        })
    }
}

#[pymethods]
impl StepOutput {
    fn __len__(&self) -> usize {
        self.len
    }
    fn __getitem__(&self, py: Python<'_>, i: isize) -> PyResult<Delta> {
        let n = self.len as isize;
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
    fn request_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        names_list(py, &self.request_ids_c, &self.names)
    }
    #[getter]
    fn token_ids(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(self, py, token_ids_c, arr1(py, &self.d.token_ids).unbind())
    }
    #[getter]
    fn finished(&self, py: Python<'_>) -> Py<PyArray1<bool>> {
        lazy_get!(
            self,
            py,
            finished_c,
            PyArray1::from_slice(py, &self.d.finished).unbind()
        )
    }
    #[getter]
    fn rows(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        lazy_get!(self, py, rows_c, arr1(py, &self.d.rows).unbind())
    }
    #[getter]
    fn finish_reasons(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        Ok(PyList::new(py, self.d.finish_reasons.iter().map(|&r| reason_str(r)))?.unbind())
    }
    #[getter]
    fn finished_request_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let names = self.names.bind(py);
        let it = names
            .iter()
            .zip(&self.d.finished)
            .filter(|(_, &f)| f)
            .map(|(n, _)| n);
        Ok(PyList::new(py, it)?.unbind())
    }
    fn __repr__(&self) -> String {
        format!(
            "StepOutput(len={}, finished={})",
            self.len, self.num_finished
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
        if self.i >= out.len {
            return Ok(None);
        }
        let d = out.delta(py, self.i)?;
        self.i += 1;
        Ok(Some(d))
    }
}

/// Buffers of dropped plans / outputs, handed back to the scheduler for its next step so
/// steady-state steps allocate nothing (a few sets rotate while the caller holds old ones).
#[derive(Clone, Default)]
struct Recycler(Arc<Mutex<RecycleBins>>);

#[derive(Default)]
struct RecycleBins {
    plans: Vec<core::StepPlan>,
    outputs: Vec<core::StepOutput>,
}

const RECYCLE_KEEP: usize = 4;

impl Recycler {
    fn take_plan(&self) -> core::StepPlan {
        self.0
            .lock()
            .ok()
            .and_then(|mut b| b.plans.pop())
            .unwrap_or_default()
    }
    fn take_output(&self) -> core::StepOutput {
        self.0
            .lock()
            .ok()
            .and_then(|mut b| b.outputs.pop())
            .unwrap_or_default()
    }
}

impl Drop for StepPlan {
    fn drop(&mut self) {
        if let Ok(mut b) = self.recycle.0.lock() {
            if b.plans.len() < RECYCLE_KEEP {
                b.plans.push(std::mem::take(&mut self.d));
            }
        }
    }
}

impl Drop for StepOutput {
    fn drop(&mut self) {
        if let Ok(mut b) = self.recycle.0.lock() {
            if b.outputs.len() < RECYCLE_KEEP {
                b.outputs.push(std::mem::take(&mut self.d));
            }
        }
    }
}

/// A tuple of request-id strings and the (slot, generation) keys it was built from.
#[derive(Default)]
struct NameCache {
    keys: Vec<u64>,
    scratch: Vec<u64>,
    tuple: Option<Py<PyTuple>>,
}

impl NameCache {
    /// As `get`, but when the caller knows the slots are the ones of the last call
    /// (`same`), the cached tuple is returned without comparing keys.
    fn get_or_same(
        &mut self,
        py: Python<'_>,
        same: bool,
        slots: impl Iterator<Item = u32>,
        names: &[Option<Py<PyString>>],
        gens: &[u32],
    ) -> PyResult<Py<PyTuple>> {
        if same {
            if let Some(t) = &self.tuple {
                return Ok(t.clone_ref(py));
            }
        }
        self.get(py, slots, names, gens)
    }

    fn get(
        &mut self,
        py: Python<'_>,
        slots: impl Iterator<Item = u32>,
        names: &[Option<Py<PyString>>],
        gens: &[u32],
    ) -> PyResult<Py<PyTuple>> {
        self.scratch.clear();
        self.scratch
            .extend(slots.map(|i| ((i as u64) << 32) | gens[i as usize] as u64));
        if let Some(t) = &self.tuple {
            if self.scratch == self.keys {
                return Ok(t.clone_ref(py));
            }
        }
        let t = PyTuple::new(
            py,
            self.scratch
                .iter()
                .map(|&k| names[(k >> 32) as usize].as_ref().expect("named").bind(py)),
        )?
        .unbind();
        std::mem::swap(&mut self.keys, &mut self.scratch);
        self.tuple = Some(t.clone_ref(py));
        Ok(t)
    }
}

/// Continuous-batching scheduler and paged KV-cache allocator (see ARCHITECTURE.md §3).
///
/// `Scheduler(num_blocks, page_size, max_batch_tokens, max_requests_per_batch=256,
/// scheduler_type="fifo", safety_margin=None, allow_block_sharing=True,
/// layer_types=("full_attention",), sliding_window=None, cpu_offload_blocks=0,
/// max_batch_cache_tokens=None)`; bad values raise ValueError naming the field.
/// `safety_margin=None` means 0.15 for "fifo", 0.0 for "prefill_first".
/// `max_batch_cache_tokens` bounds the sum of `seqlens_k` of a step.
///
/// Methods: `add_request(request_id, prompt_token_ids, max_new_tokens, eos_token_ids=(),
/// stop_token_ids=(), priority=0, stop_sequences=(), skip_prefix_lookup=False)` (ValueError
/// naming the field for a duplicate id, an empty prompt, `max_new_tokens < 1`, an empty stop sequence, or a request
/// that could never fit the pool / the cache-read budget); `schedule() -> StepPlan | None`;
/// `schedule_ahead() -> StepPlan | None` (one step ahead of the outstanding plan, for async
/// batching); `update(sampled_token_ids) -> StepOutput` (applies to the oldest outstanding
/// plan); properties `num_outstanding` (int) and `has_outstanding_plan` (bool); `cancel(request_id) -> bool`;
/// `has_unfinished() -> bool` (also true while a cancellation is unreported: if schedule()
/// returns None then, call `update(())` to get the report); `stats() -> dict`;
/// `check_invariants()` (RuntimeError naming the broken invariant); `snapshot() -> dict`.
///
/// `snapshot()` returns a dict for outside checks:
/// * `"num_blocks"`, `"page_size"`, `"ring_size"` (R, 0 without sliding layers),
///   `"sliding_window"`, `"prefix_caching"` (bool), `"safety_margin"` (effective),
///   `"outstanding"` (bool: a plan awaits update()), `"num_outstanding"` (0, 1 or 2),
/// * `"refcounts"`: list[int] of length num_blocks + 2 (chunk id -> references held),
/// * `"free_chunks"`: list[int] of uninitialized free chunks,
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
///   "priority", "arrival", "blocks": {"full_attention": [...], "sliding_attention": [...]}
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
        Ok(StepPlan {
            d,
            recycle: self.recycle.clone(),
            names: row_names,
            num_rows,
            num_tokens,
            num_sampled,
            page_size: self.inner.config().page_size,
            request_ids_c: PyOnceLock::new(),
            input_ids_c: PyOnceLock::new(),
            positions_c: PyOnceLock::new(),
            cu_seqlens_q_c: PyOnceLock::new(),
            seqlens_k_c: PyOnceLock::new(),
            logits_indices_c: PyOnceLock::new(),
            logits_rows_c: PyOnceLock::new(),
            slot_mapping_c: PyOnceLock::new(),
            block_tables_c: PyOnceLock::new(),
            swap_out_c: PyOnceLock::new(),
            swap_in_c: PyOnceLock::new(),
            prev_token_index_c: PyOnceLock::new(),
        })
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
        max_batch_cache_tokens=None),
        text_signature = "(num_blocks, page_size, max_batch_tokens, max_requests_per_batch=256, \
scheduler_type='fifo', safety_margin=None, allow_block_sharing=True, \
layer_types=('full_attention',), sliding_window=None, cpu_offload_blocks=0, \
max_batch_cache_tokens=None)")]
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
            gens: Vec::new(),
            plan_names: NameCache::default(),
            out_names: NameCache::default(),
            recycle: Recycler::default(),
            has_full,
            has_sliding,
        })
    }

    /// Add a request; ValueError naming the field on bad input or if it could never fit.
    /// `skip_prefix_lookup=True`: the request takes no prefix-cache hits (every prompt
    /// position is computed; its blocks are still offered to the cache).
    #[pyo3(signature = (request_id, prompt_token_ids, max_new_tokens, eos_token_ids=None,
        stop_token_ids=None, priority=0, stop_sequences=None, skip_prefix_lookup=false),
        text_signature = "($self, request_id, prompt_token_ids, max_new_tokens, eos_token_ids=(), \
stop_token_ids=(), priority=0, stop_sequences=(), skip_prefix_lookup=False)")]
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
            .add_request_opts(id, prompt, stop, priority, skip_prefix_lookup)
            .map_err(to_py)? as usize;
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
        let out = if let Ok(a) = sampled_token_ids.cast::<PyArray1<i32>>() {
            let ro: PyReadonlyArray1<i32> = a.readonly();
            match ro.as_slice() {
                Ok(s) => self.inner.update(s),
                Err(_) => {
                    let v: Vec<i32> = ro.as_array().iter().copied().collect();
                    self.inner.update(&v)
                }
            }
        } else if let Ok(a) = sampled_token_ids.cast::<PyArray1<i64>>() {
            let ro = a.readonly();
            let mut v = Vec::with_capacity(ro.len()?);
            for &t in ro.as_array().iter() {
                if !(0..=i32::MAX as i64).contains(&t) {
                    return Err(PyValueError::new_err(format!(
                        "sampled_token_ids must be non-negative int32 (got {t})"
                    )));
                }
                v.push(t as i32);
            }
            self.inner.update(&v)
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
        let num_finished = out.finished.iter().filter(|&&f| f).count();
        let all_have_token = out.all_have_token;
        let len = out.len();
        let mut d = self.recycle.take_output();
        self.inner.export_output(&mut d);
        let row_names = self.out_names.get_or_same(
            py,
            self.inner.output_repeats_requests(),
            d.reqs.iter().copied(),
            &self.names,
            &self.gens,
        )?;
        Ok(StepOutput {
            d,
            recycle: self.recycle.clone(),
            names: row_names,
            len,
            all_have_token,
            num_finished,
            request_ids_c: PyOnceLock::new(),
            token_ids_c: PyOnceLock::new(),
            finished_c: PyOnceLock::new(),
            rows_c: PyOnceLock::new(),
        })
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

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    /// Counters and gauges (dict): `num_blocks`; `num_free_blocks` (allocatable:
    /// uninitialized + cached); `num_cached_blocks` (free but keeping a hashed block, reclaimed
    /// LRU-first); `num_used_blocks` (refcount > 0; used + free = num_blocks); `waiting`,
    /// `running`, `swapped` (request counts); `finished` (finished or cancelled, reported);
    /// `prefix_hit_tokens` and `prompt_tokens` (summed over admissions, re-admissions after a
    /// soft reset included); `num_preemptions`, `num_offloads`, `num_soft_resets`; `num_recomputes` (`recompute()`
    /// calls that reset a request);
    /// `num_evictions` (cached blocks reclaimed); `num_swap_free`, `cpu_offload_blocks`;
    /// `steps`, `generated_tokens`; `stalled_requests`, `stalled_blocks` (last schedule():
    /// rows that found the pool short and the chunks they missed, before preemption);
    /// `prefix_caching` (bool).
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
        d.set_item("num_recomputes", s.num_recomputes)?;
        d.set_item("num_evictions", s.num_evictions)?;
        d.set_item("num_swap_free", s.num_swap_free)?;
        d.set_item("cpu_offload_blocks", self.inner.config().cpu_offload_blocks)?;
        d.set_item("steps", s.steps)?;
        d.set_item("generated_tokens", s.generated_tokens)?;
        d.set_item("stalled_requests", s.stalled_requests)?;
        d.set_item("stalled_blocks", s.stalled_blocks)?;
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
    m.add_function(wrap_pyfunction!(kernels::paged_decode_attention, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
