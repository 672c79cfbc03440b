//! PyO3 wrappers of `ferrobatch-kernels`' products over packed weights (`f32_linear`:
//! AVX-512F over f32 weights, or bf16 / fp16 ones widened in registers; `i16_linear`: exact int16 products on AVX-512 VNNI): numpy
//! views in, shapes and overlaps checked with a `FieldError` naming the argument, then the
//! kernel with the GIL released.

use ferrobatch_kernels::f32_linear as kernel;
use ferrobatch_kernels::i16_linear as i16_kernel;
use ferrobatch_kernels::linear::LinearArgs;
use ferrobatch_kernels::KernelError;
use numpy::PyUntypedArrayMethods;
use pyo3::prelude::*;

use crate::errors::kernel_error;
use crate::views::{pack_with, product_out, product_rows, ro, rw, threads_of, two_d, ty, Span, Ty};

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
    let p = ro::<f32>(packed, "packed", "float32")?;
    let pe = p.as_slice()?;
    f32_product(py, (x, out, bias), (n, k, threads), |args, xe, be, oe| {
        kernel::linear(args, xe, pe, be, oe)
    })
}

/// Packs a half-precision `weight` [n, k] (`dtype` "bfloat16" or "float16", bits as uint16)
/// into `out` (`f32_packed_len(n, k)` uint16): `f32_pack`'s layout at half the bytes.
#[pyfunction]
#[pyo3(signature = (weight, out, *, dtype))]
pub fn f32_pack_half(
    py: Python<'_>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
) -> PyResult<()> {
    let half = half_of(dtype)?;
    let weight = (weight, "bfloat16 / float16 storage (uint16 bits)");
    pack_with(py, weight, (out, "uint16"), |w, n, k, o| {
        kernel::pack_half(half, w, n, k, o)
    })
}

/// Packs an f32 `weight` [n, k] whose every value is a bf16 one into `out`
/// (`f32_packed_len(n, k)` uint16) as `f32_pack_half` packs that bf16 weight, and returns
/// True; False, with `out` untouched, where a value is not a bf16 one.
#[pyfunction]
pub fn f32_pack_bf16_exact(
    py: Python<'_>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let w = ro::<f32>(weight, "weight", "float32")?;
    let (n, k) = two_d("weight", w.shape(), "[out_features, in_features]")?;
    let mut o = rw::<u16>(out, "out", "uint16")?;
    let (w, o) = (w.as_slice()?, o.as_slice_mut()?);
    py.detach(|| kernel::pack_bf16_exact(w, n, k, o))
        .map_err(kernel_error)
}

/// Unpacks `packed` (`f32_pack_half`ed uint16 bits of a `dtype` weight [n, k]) into
/// `weight` (uint16 [n, k]): the weight that was packed, bit for bit.
#[pyfunction]
#[pyo3(signature = (packed, weight, *, dtype))]
pub fn f32_unpack_half(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    dtype: &str,
) -> PyResult<()> {
    let half = half_of(dtype)?;
    let p = ro::<u16>(packed, "packed", "uint16")?;
    let mut w = rw::<u16>(weight, "weight", "uint16")?;
    let (n, k) = two_d("weight", w.shape(), "[out_features, in_features]")?;
    let (p, w) = (p.as_slice()?, w.as_slice_mut()?);
    py.detach(|| kernel::unpack_half(half, p, n, k, w))
        .map_err(kernel_error)
}

/// The half format a dtype string names (a `FieldError` on `dtype` for another).
fn half_of(dtype: &str) -> PyResult<kernel::Half> {
    match ty(dtype, "dtype")? {
        Ty::Bf16 => Ok(kernel::Half::Bf16),
        Ty::F16 => Ok(kernel::Half::F16),
        Ty::F32 => Err(crate::errors::invalid(
            "dtype",
            "dtype must be \"bfloat16\" or \"float16\" (float32 weights: f32_linear)",
        )),
    }
}

/// `f32_linear` over an `f32_pack_half`ed W [n, k] (uint16) of `dtype` (`"bfloat16"` or
/// `"float16"`, as packed): its weights widened exactly to f32 in registers, every output bit for bit
/// `f32_linear`'s over the widened weights.
#[pyfunction]
#[pyo3(signature = (x, packed, out, *, n, k, dtype, bias = None, threads = 1))]
#[allow(clippy::too_many_arguments)] // the Python signature's keywords
pub fn f32_linear_half(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    packed: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
    dtype: &str,
    bias: Option<&Bound<'_, PyAny>>,
    threads: i64,
) -> PyResult<()> {
    let half = half_of(dtype)?;
    let threads = threads_of(threads)?;
    let p = ro::<u16>(packed, "packed", "uint16")?;
    let pe = p.as_slice()?;
    f32_product(py, (x, out, bias), (n, k, threads), |args, xe, be, oe| {
        kernel::linear_half(half, args, xe, pe, be, oe)
    })
}

type Operands<'a, 'py> = (
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    Option<&'a Bound<'py, PyAny>>,
);

/// A product of float32 `x` [m, k], `bias` [n] and `out` [m, n] (checked here) over a packed
/// weight `run` holds, run with the GIL released.
fn f32_product(
    py: Python<'_>,
    (x, out, bias): Operands<'_, '_>,
    (n, k, threads): (usize, usize, usize),
    run: impl FnOnce(&LinearArgs, &[f32], Option<&[f32]>, &mut [f32]) -> Result<(), KernelError> + Send,
) -> PyResult<()> {
    let xa = ro::<f32>(x, "x", "float32")?;
    let b = bias.map(|b| ro::<f32>(b, "bias", "float32")).transpose()?;
    let mut o = rw::<f32>(out, "out", "float32")?;
    let m = product_rows(xa.shape(), k)?;
    product_out((o.shape(), o.span()), m, n, xa.span())?;
    let xe = xa.as_slice()?;
    let be = b.as_ref().map(|b| b.as_slice()).transpose()?;
    let oe = o.as_slice_mut()?;
    py.detach(|| run(&LinearArgs { m, n, k, threads }, xe, be, oe))
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
