//! PyO3 wrappers of the greedy head's kernels (`ferrobatch-kernels`, `select`):
//! `greedy_select` (the candidates), `greedy_pick` (each row's best of them), `row_norms`.
//! numpy views in (bf16 scores as `uint16` bit patterns), arrays out, argument errors as
//! `FieldError` naming the argument. The GIL is released while a kernel runs.

use ferrobatch_kernels as kernels;
use kernels::{Scores, SelectArgs};
use numpy::{
    Element, PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::{invalid, kernel_error};
use crate::views::c_slice;

/// The screened scores, read-only, in the storage type their dtype names.
enum ScoreArray<'py> {
    Bf16(PyReadonlyArrayDyn<'py, u16>),
    F32(PyReadonlyArrayDyn<'py, f32>),
    I32(PyReadonlyArrayDyn<'py, i32>),
}

fn score_array<'py>(a: &Bound<'py, PyAny>) -> PyResult<ScoreArray<'py>> {
    if let Ok(x) = a.cast::<PyArrayDyn<u16>>() {
        Ok(ScoreArray::Bf16(x.readonly()))
    } else if let Ok(x) = a.cast::<PyArrayDyn<f32>>() {
        Ok(ScoreArray::F32(x.readonly()))
    } else if let Ok(x) = a.cast::<PyArrayDyn<i32>>() {
        Ok(ScoreArray::I32(x.readonly()))
    } else {
        Err(invalid(
            "scores",
            "scores must be a numpy array of uint16 (bf16 bit patterns), float32 or int32",
        ))
    }
}

impl ScoreArray<'_> {
    fn shape(&self) -> &[usize] {
        match self {
            ScoreArray::Bf16(x) => x.shape(),
            ScoreArray::F32(x) => x.shape(),
            ScoreArray::I32(x) => x.shape(),
        }
    }

    fn scores(&self) -> PyResult<Scores<'_>> {
        Ok(match self {
            ScoreArray::Bf16(x) => Scores::Bf16(c_slice(x, "scores")?),
            ScoreArray::F32(x) => Scores::F32(c_slice(x, "scores")?),
            ScoreArray::I32(x) => Scores::I32(c_slice(x, "scores")?),
        })
    }
}

/// A 1-D contiguous array of `T` (named `dtype` in the message).
fn vector<'py, T: Element>(
    a: &Bound<'py, PyAny>,
    dtype: &str,
    field: &'static str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let ro = a
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| invalid(field, format!("{field} must be a numpy array of {dtype}")))?
        .readonly();
    if ro.ndim() != 1 {
        return Err(invalid(
            field,
            format!("{field} must be 1-D, not of shape {:?}", ro.shape()),
        ));
    }
    Ok(ro)
}

/// `field` has `got` entries, not `want` (`what`: one per what).
fn length_error(field: &'static str, got: usize, want: usize, what: &str) -> PyErr {
    invalid(
        field,
        format!("{field} has {got} entries, not {want} (one per {what})"),
    )
}

/// `greedy_select`'s `(rows, cols, unique, inverse)`.
type Selected<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
);

/// The greedy head screen's candidates (`ferrobatch-kernels`, `select`): `scores` [rows,
/// vocab] (uint16 bf16 bit patterns, float32, or int32), `base` / `gain` float64 [rows],
/// `per_token` float64 [vocab]. `(rows, cols, unique, inverse)` int64: the selected pairs in
/// row-major order, the distinct tokens ascending and each pair's index among them; None
/// when the screen cannot decide cheaply.
#[pyfunction]
#[pyo3(signature = (scores, base, gain, per_token, *, max_stage1, max_candidates, threads))]
#[allow(clippy::too_many_arguments)]
pub fn greedy_select<'py>(
    py: Python<'py>,
    scores: &Bound<'py, PyAny>,
    base: &Bound<'py, PyAny>,
    gain: &Bound<'py, PyAny>,
    per_token: &Bound<'py, PyAny>,
    max_stage1: usize,
    max_candidates: usize,
    threads: usize,
) -> PyResult<Option<Selected<'py>>> {
    let scores = score_array(scores)?;
    let (base, gain, per_token) = (
        vector::<f64>(base, "float64", "base")?,
        vector::<f64>(gain, "float64", "gain")?,
        vector::<f64>(per_token, "float64", "per_token")?,
    );
    let &[rows, vocab] = scores.shape() else {
        return Err(invalid(
            "scores",
            format!(
                "scores must be [rows, vocab], not of shape {:?}",
                scores.shape()
            ),
        ));
    };
    if base.len() != rows {
        return Err(length_error("base", base.len(), rows, "row of scores"));
    }
    if gain.len() != rows {
        return Err(length_error("gain", gain.len(), rows, "row of scores"));
    }
    if per_token.len() != vocab {
        return Err(length_error(
            "per_token",
            per_token.len(),
            vocab,
            "column of scores",
        ));
    }
    let args = SelectArgs {
        scores: scores.scores()?,
        base: c_slice(&base, "base")?,
        gain: c_slice(&gain, "gain")?,
        per_token: c_slice(&per_token, "per_token")?,
        max_stage1,
        max_candidates,
        threads,
    };
    let found = py.detach(|| {
        kernels::select_candidates(&args).map(|c| {
            c.map(|c| {
                let (unique, inverse) = c.columns();
                [c.rows, c.cols, unique, inverse]
            })
        })
    });
    let found = found.map_err(kernel_error)?;
    let arr = |v: Vec<u32>| PyArray1::from_vec(py, v.into_iter().map(i64::from).collect());
    Ok(found.map(|[r, c, u, i]| (arr(r), arr(c), arr(u), arr(i))))
}

/// Each row's fp32 argmax among its candidates (ties: the lowest token): `logits` float32
/// [rows, width] holds them, pair `i` (row `rows[i]`, token `cols[i]`) at column
/// `inverse[i]` (int64, as `greedy_select` returns them). int64 [rows]; None when a
/// candidate's logit is not finite or a row has none.
#[pyfunction]
pub fn greedy_pick<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    rows: &Bound<'py, PyAny>,
    cols: &Bound<'py, PyAny>,
    inverse: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyArray1<i64>>>> {
    let logits = logits
        .cast::<PyArrayDyn<f32>>()
        .map_err(|_| invalid("logits", "logits must be a numpy array of float32"))?
        .readonly();
    let &[_, width] = logits.shape() else {
        return Err(invalid(
            "logits",
            format!(
                "logits must be [rows, width], not of shape {:?}",
                logits.shape()
            ),
        ));
    };
    let (rows, cols, inverse) = (
        vector::<i64>(rows, "int64", "rows")?,
        vector::<i64>(cols, "int64", "cols")?,
        vector::<i64>(inverse, "int64", "inverse")?,
    );
    if cols.len() != rows.len() {
        return Err(length_error(
            "cols",
            cols.len(),
            rows.len(),
            "entry of rows",
        ));
    }
    if inverse.len() != rows.len() {
        return Err(length_error(
            "inverse",
            inverse.len(),
            rows.len(),
            "entry of rows",
        ));
    }
    let (logits_s, rows_s, cols_s, inverse_s) = (
        c_slice(&logits, "logits")?,
        c_slice(&rows, "rows")?,
        c_slice(&cols, "cols")?,
        c_slice(&inverse, "inverse")?,
    );
    if width == 0 {
        // no candidate columns: every row lacks one (or there are no rows)
        let n = logits.shape()[0];
        return Ok((n == 0).then(|| PyArray1::from_vec(py, Vec::new())));
    }
    let picked = py
        .detach(|| kernels::pick_best(logits_s, width, rows_s, cols_s, inverse_s))
        .map_err(kernel_error)?;
    Ok(picked.map(|t| PyArray1::from_vec(py, t)))
}

/// `row_norms`' `(l2, l1, amax)`.
type Norms<'py> = (
    Bound<'py, PyArray1<f64>>,
    Bound<'py, PyArray1<f64>>,
    Bound<'py, PyArray1<f64>>,
);

/// `(l2, l1, amax)` float64 [rows]: each row's 2-norm, 1-norm and largest magnitude of `x`
/// float32 [rows, k], summed in f64 (`l1` is finite iff the row is; `amax` NaN with a NaN).
#[pyfunction]
pub fn row_norms<'py>(py: Python<'py>, x: &Bound<'py, PyAny>) -> PyResult<Norms<'py>> {
    let x = x
        .cast::<PyArrayDyn<f32>>()
        .map_err(|_| invalid("x", "x must be a numpy array of float32"))?
        .readonly();
    let &[rows, k] = x.shape() else {
        return Err(invalid(
            "x",
            format!("x must be [rows, k], not of shape {:?}", x.shape()),
        ));
    };
    let xs = c_slice(&x, "x")?;
    let [l2, l1, amax] = if k == 0 {
        [vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]]
    } else {
        py.detach(|| kernels::row_norms(xs, k))
            .map_err(kernel_error)?
    };
    Ok((
        PyArray1::from_vec(py, l2),
        PyArray1::from_vec(py, l1),
        PyArray1::from_vec(py, amax),
    ))
}
