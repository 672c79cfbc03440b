//! PyO3 wrappers of `ferrobatch-kernels`' f32 products (`f32_linear`: AVX-512F over packed
//! f32 weights): numpy views in, shapes and overlaps checked with a `FieldError` naming the
//! argument, then the kernel with the GIL released.

use ferrobatch_kernels::amx::LinearArgs;
use ferrobatch_kernels::f32_linear as kernel;
use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid;
use crate::views::{disjoint, expect_shape, ro, rw, threads_of, two_d};

/// Whether `f32_linear` runs on this CPU (AVX-512F).
#[pyfunction]
pub fn f32_linear_available() -> bool {
    kernel::available()
}

/// Elements (float32) of the packed form of an `[n, k]` weight.
#[pyfunction]
pub fn f32_packed_len(n: usize, k: usize) -> usize {
    kernel::packed_len(n, k)
}

/// Packs `weight` [n, k] (float32) into `out` (`f32_packed_len(n, k)` float32).
#[pyfunction]
pub fn f32_pack(py: Python<'_>, weight: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
    let w = ro::<f32>(weight, "weight", "float32")?;
    let (n, k) = two_d("weight", w.shape(), "[out_features, in_features]")?;
    let mut o = rw::<f32>(out, "out", "float32")?;
    let (w, o) = (w.as_slice()?, o.as_slice_mut()?);
    py.detach(|| kernel::pack(w, n, k, o))
        .map_err(|e| invalid(e.field, e.message))
}

/// `out = x @ W.T (+ bias)` in f32: `x` [m, k] float32, `packed` the `f32_pack`ed W [n, k],
/// `bias` float32 [n] or None, `out` float32 [m, n]. Column blocks of 16 are split over at
/// most `threads` threads of the kernel pool; a row's result does not depend on `m` or
/// `threads`.
#[pyfunction]
#[pyo3(signature = (x, packed, out, *, n, k, bias = None, threads = 1))]
#[allow(clippy::too_many_arguments)] // the Python signature's keywords
pub fn f32_linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    packed: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
    bias: Option<&Bound<'_, PyAny>>,
    threads: i64,
) -> PyResult<()> {
    let threads = threads_of(threads)?;
    let xa = ro::<f32>(x, "x", "float32")?;
    let (m, xk) = two_d("x", xa.shape(), "[rows, in_features]")?;
    if xk != k {
        return Err(invalid("x", format!("x has {xk} columns, not k = {k}")));
    }
    let p = ro::<f32>(packed, "packed", "float32")?;
    let b = bias.map(|b| ro::<f32>(b, "bias", "float32")).transpose()?;
    let mut o = rw::<f32>(out, "out", "float32")?;
    expect_shape("out", o.shape(), &[m, n], "[rows, out_features]")?;
    let ospan = crate::views::bytes(o.data(), o.len());
    let xspan = crate::views::bytes(xa.data(), xa.len());
    disjoint("out", ospan, &[("x", xspan)])?;
    let (xe, pe) = (xa.as_slice()?, p.as_slice()?);
    let be = b.as_ref().map(|b| b.as_slice()).transpose()?;
    let oe = o.as_slice_mut()?;
    py.detach(|| kernel::linear(&LinearArgs { m, n, k, threads }, xe, pe, be, oe))
        .map_err(|e| invalid(e.field, e.message))
}
