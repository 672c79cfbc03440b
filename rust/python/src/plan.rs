//! `StepPlan`: one step of work for the model runner, owned by Python.

use ferrobatch_core as core;
use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::cache::{cached, names_list};
use crate::convert::{arr1, arr2};
use crate::recycle::Recycler;

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
    /// Rows B.
    #[pyo3(get)]
    num_rows: usize,
    /// Query tokens T.
    #[pyo3(get)]
    num_tokens: usize,
    /// Sampled rows N (entries of `logits_indices`).
    #[pyo3(get)]
    num_sampled: usize,
    /// Tokens per chunk.
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

impl StepPlan {
    /// The plan in `d` (exported by the scheduler), its rows named by `names`.
    pub fn new(
        d: core::StepPlan,
        recycle: Recycler,
        names: Py<PyTuple>,
        (num_rows, num_tokens, num_sampled): (usize, usize, usize),
        page_size: usize,
    ) -> Self {
        StepPlan {
            d,
            recycle,
            names,
            num_rows,
            num_tokens,
            num_sampled,
            page_size,
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
        }
    }
}

impl Drop for StepPlan {
    fn drop(&mut self) {
        self.recycle.give_plan(&mut self.d);
    }
}

#[pymethods]
impl StepPlan {
    /// int32 [T]: -1 where `input_ids` holds the token id; else the index, in the previous
    /// plan's `logits_indices` order, of the previous plan's sampled token that is this
    /// token's input id (`input_ids` holds 0 there). All -1 for plans from `schedule()`.
    #[getter]
    fn prev_token_index(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.prev_token_index_c, || {
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
    /// list[str] [B]: the requests in batch order.
    #[getter]
    fn request_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        names_list(py, &self.request_ids_c, &self.names)
    }
    /// int32 [T]: token ids, rows concatenated in batch order.
    #[getter]
    fn input_ids(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.input_ids_c, || {
            arr1(py, &self.d.input_ids).unbind()
        })
    }
    /// int32 [T]: absolute position of each token in its request.
    #[getter]
    fn positions(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.positions_c, || {
            arr1(py, &self.d.positions).unbind()
        })
    }
    /// int32 [B+1]: row r owns tokens `cu_seqlens_q[r] .. cu_seqlens_q[r+1]`.
    #[getter]
    fn cu_seqlens_q(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.cu_seqlens_q_c, || {
            arr1(py, &self.d.cu_seqlens_q).unbind()
        })
    }
    /// int32 [B]: keys visible to the row's last token (cached before this step + new).
    #[getter]
    fn seqlens_k(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.seqlens_k_c, || {
            arr1(py, &self.d.seqlens_k).unbind()
        })
    }
    /// int32 [N]: token indices (into T) whose next token is sampled.
    #[getter]
    fn logits_indices(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.logits_indices_c, || {
            arr1(py, &self.d.logits_indices).unbind()
        })
    }
    /// int32 [N]: batch row of each sampled token (ascending).
    #[getter]
    fn logits_rows(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        cached(py, &self.logits_rows_c, || {
            arr1(py, &self.d.logits_rows).unbind()
        })
    }
    /// int32 [n, 2]: (device chunk, swap slot) pairs, copied before swap_in and the forward.
    #[getter]
    fn swap_out(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        let v = &self.d.swap_out;
        cached(py, &self.swap_out_c, || {
            arr2(py, v, v.len() / 2, 2).unbind()
        })
    }
    /// int32 [n, 2]: (swap slot, device chunk) pairs, copied after swap_out, before the forward.
    #[getter]
    fn swap_in(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        let v = &self.d.swap_in;
        cached(py, &self.swap_in_c, || arr2(py, v, v.len() / 2, 2).unbind())
    }
    /// {attention type: int32 [T]}: slot each new token's K/V is written to.
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
    /// {attention type: int32 [B, W]}: chunk ids per row, padded with 0.
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
