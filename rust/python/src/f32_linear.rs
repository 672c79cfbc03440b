//! PyO3 wrappers of `ferrobatch-kernels`' products over packed weights (`f32_linear`:
//! AVX-512F over f32 weights; `i16_linear`: exact int16 products on AVX-512 VNNI): numpy
//! views in, shapes and overlaps checked with a `FieldError` naming the argument, then the
//! kernel with the GIL released.

use ferrobatch_kernels::f32_linear as kernel;
use ferrobatch_kernels::i16_linear as i16_kernel;
use ferrobatch_kernels::linear::LinearArgs;
use numpy::PyUntypedArrayMethods;
use pyo3::prelude::*;

use crate::errors::kernel_error;
use crate::views::{pack_with, product_out, product_rows, ro, rw, threads_of, Span};

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
    pack_with(py, (weight, "float32"), (out, "float32"), kernel::pack)
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
    let p = ro::<f32>(packed, "packed", "float32")?;
    let b = bias.map(|b| ro::<f32>(b, "bias", "float32")).transpose()?;
    let mut o = rw::<f32>(out, "out", "float32")?;
    let m = product_rows(xa.shape(), k)?;
    product_out((o.shape(), o.span()), m, n, xa.span())?;
    let (xe, pe) = (xa.as_slice()?, p.as_slice()?);
    let be = b.as_ref().map(|b| b.as_slice()).transpose()?;
    let oe = o.as_slice_mut()?;
    py.detach(|| kernel::linear(&LinearArgs { m, n, k, threads }, xe, pe, be, oe))
        .map_err(kernel_error)
}

/// Whether `i16_linear` runs on this CPU (AVX-512 VNNI).
#[pyfunction]
pub fn i16_linear_available() -> bool {
    i16_kernel::available()
}

/// Elements (int16) of the packed form of an `[n, k]` weight (`k` even).
#[pyfunction]
pub fn i16_packed_len(n: usize, k: usize) -> usize {
    i16_kernel::packed_len(n, k)
}

/// Packs `weight` [n, k] (int16, `k` even) into `out` (`i16_packed_len(n, k)` int16).
#[pyfunction]
pub fn i16_pack(py: Python<'_>, weight: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
    pack_with(py, (weight, "int16"), (out, "int16"), i16_kernel::pack)
}

/// `out = x @ W.T` exactly in int32 (the caller keeps `k max|x| max|W| < 2^31`): `x` [m, k]
/// int16, `packed` the `i16_pack`ed W [n, k], `out` int32 [m, n]; column blocks split over at
/// most `threads` threads of the kernel pool.
#[pyfunction]
#[pyo3(signature = (x, packed, out, *, n, k, threads = 1))]
#[allow(clippy::too_many_arguments)] // the Python signature's keywords
pub fn i16_linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    packed: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
    threads: i64,
) -> PyResult<()> {
    let threads = threads_of(threads)?;
    let xa = ro::<i16>(x, "x", "int16")?;
    let p = ro::<i16>(packed, "packed", "int16")?;
    let mut o = rw::<i32>(out, "out", "int32")?;
    let m = product_rows(xa.shape(), k)?;
    product_out((o.shape(), o.span()), m, n, xa.span())?;
    let (xe, pe, oe) = (xa.as_slice()?, p.as_slice()?, o.as_slice_mut()?);
    py.detach(|| i16_kernel::linear(&LinearArgs { m, n, k, threads }, xe, pe, oe))
        .map_err(kernel_error)
}
