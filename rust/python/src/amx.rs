//! PyO3 wrappers of `ferrobatch-kernels`' bf16 products with f32 outputs (`amx`: AMX tiles
//! or AVX-512 BF16): numpy views in (bf16 as `uint16` bits), shapes and overlaps checked
//! with a `FieldError` naming the argument, then the kernel with the GIL released.

use ferrobatch_kernels::amx;
use ferrobatch_kernels::linear::LinearArgs;
use numpy::PyUntypedArrayMethods;
use pyo3::prelude::*;

use crate::errors::{invalid, kernel_error};
use crate::views::{pack_with, product_out, product_rows, ro, rw, threads_of, ty, In, Span, Ty};

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
    let weight = (weight, "bfloat16 storage (uint16 bits)");
    pack_with(py, weight, (out, "uint16"), amx::pack)
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
    let m = product_rows(xa.shape(), k)?;
    let p = ro::<u16>(packed, "packed", "uint16")?;
    let b = bias.map(|b| ro::<f32>(b, "bias", "float32")).transpose()?;
    let mut o = rw::<f32>(out, "out", "float32")?;
    product_out((o.shape(), o.span()), m, n, xa.span())?;
    let args = LinearArgs { m, n, k, threads };
    let (xe, pe) = (xa.elems(), p.as_slice()?);
    let be = b.as_ref().map(|b| b.as_slice()).transpose()?;
    let oe = o.as_slice_mut()?;
    py.detach(|| amx::linear(&args, xe, pe, be, oe))
        .map_err(kernel_error)
}
