//! PyO3 wrappers of `ferrobatch-kernels`' bf16 products with f32 outputs (`amx`: AMX tiles
//! or AVX-512 BF16): numpy views in (bf16 as `uint16` bits), shapes and overlaps checked
//! with a `FieldError` naming the argument, then the kernel with the GIL released.

use ferrobatch_kernels::amx::{self, LinearArgs};
use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid;
use crate::views::{disjoint, expect_shape, ro, rw, threads_of, two_d, ty, In, Ty};

/// Whether `amx_linear` runs on this CPU (AMX tiles, or AVX-512 BF16 without them).
#[pyfunction]
pub fn amx_available() -> bool {
    amx::available()
}

/// Which instructions run `amx_linear` here: "amx", "avx512_bf16" or "none".
#[pyfunction]
pub fn amx_backend() -> &'static str {
    amx::backend().name()
}

/// Elements (uint16) of the packed form of an `[n, k]` weight.
#[pyfunction]
pub fn amx_packed_len(n: usize, k: usize) -> usize {
    amx::packed_len(n, k)
}

/// Packs `weight` [n, k] (bf16 bits, uint16) into `out` (`amx_packed_len(n, k)` uint16).
#[pyfunction]
pub fn amx_pack(py: Python<'_>, weight: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
    let w = ro::<u16>(weight, "weight", "bfloat16 storage (uint16 bits)")?;
    let (n, k) = two_d("weight", w.shape(), "[out_features, in_features]")?;
    let mut o = rw::<u16>(out, "out", "uint16")?;
    let (w, o) = (w.as_slice()?, o.as_slice_mut()?);
    py.detach(|| amx::pack(w, n, k, o))
        .map_err(|e| invalid(e.field, e.message))
}

/// `out = bf16(x) @ W.T (+ bias)` in f32: `x` [m, k] (`x_dtype` "float32" or "bfloat16"),
/// `packed` the `amx_pack`ed W [n, k], `bias` float32 [n] or None, `out` float32 [m, n].
/// Column blocks of 16 are split over at most `threads` threads of the kernel pool.
#[pyfunction]
#[pyo3(signature = (x, packed, out, *, x_dtype, n, k, bias = None, threads = 1))]
#[allow(clippy::too_many_arguments)]
pub fn amx_linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    packed: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    x_dtype: &str,
    n: usize,
    k: usize,
    bias: Option<&Bound<'_, PyAny>>,
    threads: i64,
) -> PyResult<()> {
    let xt = ty(x_dtype, "x_dtype")?;
    if xt == Ty::F16 {
        return Err(invalid(
            "x_dtype",
            "x_dtype must be \"float32\" or \"bfloat16\"",
        ));
    }
    let threads = threads_of(threads)?;
    let xa = In::new(x, xt, "x")?;
    let (m, xk) = two_d("x", xa.shape(), "[rows, in_features]")?;
    if xk != k {
        return Err(invalid("x", format!("x has {xk} columns, not k = {k}")));
    }
    let p = ro::<u16>(packed, "packed", "uint16")?;
    let b = bias.map(|b| ro::<f32>(b, "bias", "float32")).transpose()?;
    let mut o = rw::<f32>(out, "out", "float32")?;
    expect_shape("out", o.shape(), &[m, n], "[rows, out_features]")?;
    let ospan = crate::views::bytes(o.data(), o.len());
    disjoint("out", ospan, &[("x", xa.span())])?;
    let args = LinearArgs { m, n, k, threads };
    let (xe, pe) = (xa.elems(), p.as_slice()?);
    let be = b.as_ref().map(|b| b.as_slice()).transpose()?;
    let oe = o.as_slice_mut()?;
    py.detach(|| amx::linear(&args, xe, pe, be, oe))
        .map_err(|e| invalid(e.field, e.message))
}
