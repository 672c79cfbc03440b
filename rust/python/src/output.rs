//! `StepOutput` (the result of `update()`), its `Delta`s and their iterator.

use ferrobatch_core as core;
use ferrobatch_core::FinishReason;
use numpy::PyArray1;
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::cache::{cached, names_list};
use crate::convert::arr1;
use crate::recycle::Recycler;

fn reason_str(r: Option<FinishReason>) -> Option<&'static str> {
    r.map(FinishReason::as_str)
}

/// One request's delta: `request_id`, `new_token_ids` (list[int]), `finished`,
/// `finish_reason` ("stop" | "length" | "cancelled" | None).
#[pyclass(module = "ferrobatch._core", frozen, get_all)]
pub struct Delta {
    /// The request this delta is about.
    request_id: Py<PyString>,
    /// Tokens generated since the last update (the stop or EOS token included).
    new_token_ids: Py<PyList>,
    /// Whether the request finished in this update.
    finished: bool,
    /// "stop", "length" or "cancelled" once finished, else None.
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
    /// Every delta has exactly one token (`token_ids` has no -1).
    #[pyo3(get)]
    all_have_token: bool,
    /// Deltas that finish their request.
    #[pyo3(get)]
    num_finished: usize,
    request_ids_c: PyOnceLock<Py<PyList>>,
    token_ids_c: PyOnceLock<Py<PyArray1<i32>>>,
    finished_c: PyOnceLock<Py<PyArray1<bool>>>,
    rows_c: PyOnceLock<Py<PyArray1<i32>>>,
}

impl StepOutput {
    /// The output in `d` (exported by the scheduler), its deltas named by `names`.
    pub fn new(d: core::StepOutput, recycle: Recycler, names: Py<PyTuple>) -> Self {
        StepOutput {
            len: d.len(),
            all_have_token: d.all_have_token,
            num_finished: d.finished.iter().filter(|&&f| f).count(),
            d,
            recycle,
            names,
            request_ids_c: PyOnceLock::new(),
            token_ids_c: PyOnceLock::new(),
            finished_c: PyOnceLock::new(),
            rows_c: PyOnceLock::new(),
        }
    }

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

impl Drop for StepOutput {
    fn drop(&mut self) {
        self.recycle.give_output(&mut self.d);
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
    /// list[str] [n]: the request of each delta.
    #[getter]
    fn request_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        names_list(py, &self.request_ids_c, &self.names)
    }
    /// int32 [n]: each delta's token, -1 for a delta without one (a cancellation).
    #[getter]
    fn token_ids(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.token_ids_c, || {
            arr1(py, &self.d.token_ids).unbind()
        })
    }
    /// bool [n]: whether each delta finishes its request.
    #[getter]
    fn finished(&self, py: Python<'_>) -> Py<PyArray1<bool>> {
        cached(py, &self.finished_c, || {
            PyArray1::from_slice(py, &self.d.finished).unbind()
        })
    }
    /// int32 [n]: the plan row each token came from, -1 for cancellations.
    #[getter]
    fn rows(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.rows_c, || arr1(py, &self.d.rows).unbind())
    }
    /// list[str | None] [n]: each delta's finish reason.
    #[getter]
    fn finish_reasons(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        Ok(PyList::new(py, self.d.finish_reasons.iter().map(|&r| reason_str(r)))?.unbind())
    }
    /// list[str]: the requests that finished, in delta order.
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

/// Iterator over a `StepOutput`'s deltas.
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
