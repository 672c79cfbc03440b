//! PyO3 wrappers of `ferrobatch-kernels`' GGUF quantized products and K-type weight
//! quantizers (`quant`): numpy views in (GGUF blocks and packed weights as uint8), shapes
//! checked with a `FieldError` naming the argument, then the kernel with the GIL released.

use ferrobatch_kernels::linear::LinearArgs;
use ferrobatch_kernels::quant::{self as kernel, Backend, QType};
use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid;
use crate::views::{bytes, disjoint, expect_shape, ro, rw, threads_of, two_d};

pub(crate) fn qtype_of(name: &str) -> PyResult<QType> {
    QType::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = QType::ALL.iter().map(|t| t.name()).collect();
        invalid(
            "qtype",
            format!("qtype must be one of {names:?}, not {name:?}"),
        )
    })
}

pub(crate) fn backend_of(name: Option<&str>) -> PyResult<Backend> {
    match name {
        None => Ok(Backend::auto()),
        Some(n) => Backend::from_name(n).ok_or_else(|| {
            invalid(
                "backend",
                format!(
                    "backend must be \"portable\", \"avx2\", \"avx512vnni\", \"amx_int8\" \
                     or None, not {n:?}"
                ),
            )
        }),
    }
}

fn to_py(e: ferrobatch_kernels::error::KernelError) -> PyErr {
    crate::errors::kernel_error(e)
}

/// The quantization types the products take ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k",
/// "q6_k", "q5_0", "q5_1", "iq4_nl", "q3_k", "q2_k", "iq4_xs", "mxfp4").
#[pyfunction]
pub fn quant_types() -> Vec<&'static str> {
    QType::ALL.iter().map(|t| t.name()).collect()
}

/// The backend `quant_linear` runs when given none: "amx_int8" where the CPU has AMX-INT8
/// and AVX-512 VNNI, else "avx512vnni" where it has that, else "avx2" where it has that,
/// else "portable" (`FERROBATCH_QUANT_BACKEND` picks one of those that run here).
#[pyfunction]
pub fn quant_backend() -> &'static str {
    Backend::auto().name()
}

/// Whether this CPU runs `backend` ("portable" always does).
#[pyfunction]
pub fn quant_backend_available(backend: &str) -> PyResult<bool> {
    Ok(backend_of(Some(backend))?.available())
}

/// Bytes (uint8) of the packed form of an `[n, k]` weight of `qtype` (`k` whole blocks).
#[pyfunction]
pub fn quant_packed_len(qtype: &str, n: usize, k: usize) -> PyResult<usize> {
    kernel::packed_len(qtype_of(qtype)?, n, k).map_err(to_py)
}

/// `out` (float32 [n, k]) = the GGUF rows `blocks` (uint8, `n * k / block` blocks of
/// `qtype`) dequantized, as `gguf.quants.dequantize`.
#[pyfunction]
#[pyo3(signature = (qtype, blocks, out, *, n, k))]
pub fn quant_dequantize(
    py: Python<'_>,
    qtype: &str,
    blocks: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
) -> PyResult<()> {
    let qt = qtype_of(qtype)?;
    let b = ro::<u8>(blocks, "blocks", "uint8")?;
    let mut o = rw::<f32>(out, "out", "float32")?;
    expect_shape("out", o.shape(), &[n, k], "[n, k]")?;
    let (be, oe) = (b.as_slice()?, o.as_slice_mut()?);
    py.detach(|| kernel::dequantize(qt, be, n, k, oe))
        .map_err(to_py)
}

/// Packs the GGUF rows `blocks` (uint8, `n * k / block` blocks of `qtype`) into `out`
/// (uint8, `quant_packed_len(qtype, n, k)` bytes), panels split over at most `threads`
/// threads.
#[pyfunction]
#[pyo3(signature = (qtype, blocks, out, *, n, k, threads = 1))]
#[allow(clippy::too_many_arguments)] // the Python signature's keywords
pub fn quant_pack(
    py: Python<'_>,
    qtype: &str,
    blocks: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
    threads: i64,
) -> PyResult<()> {
    let qt = qtype_of(qtype)?;
    let threads = threads_of(threads)?;
    let b = ro::<u8>(blocks, "blocks", "uint8")?;
    let mut o = rw::<u8>(out, "out", "uint8")?;
    let (be, oe) = (b.as_slice()?, o.as_slice_mut()?);
    py.detach(|| kernel::pack(qt, be, n, k, oe, threads))
        .map_err(to_py)
}

/// `out = x @ W.T` in f32 through int8 activations: `x` float32 [m, k], `weight` the
/// `quant_pack`ed W [n, k] of `qtype` (uint8), `out` float32 [m, n]. Output panels of 16
/// are split over at most `threads` threads of the kernel pool; a row's result depends on
/// neither `m`, `threads` nor `backend` ("portable", "avx2", "avx512vnni", "amx_int8", or None for
/// `quant_backend()`).
#[pyfunction]
#[pyo3(signature = (qtype, x, weight, out, *, n, k, threads = 1, backend = None))]
#[allow(clippy::too_many_arguments)] // the Python signature's keywords
pub fn quant_linear(
    py: Python<'_>,
    qtype: &str,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
    threads: i64,
    backend: Option<&str>,
) -> PyResult<()> {
    let qt = qtype_of(qtype)?;
    let backend = backend_of(backend)?;
    let threads = threads_of(threads)?;
    let xa = ro::<f32>(x, "x", "float32")?;
    let w = ro::<u8>(weight, "weight", "uint8")?;
    let mut o = rw::<f32>(out, "out", "float32")?;
    let (m, xk) = two_d("x", xa.shape(), "[rows, k]")?;
    if xk != k {
        return Err(invalid("x", format!("x has {xk} columns, not k = {k}")));
    }
    expect_shape("out", o.shape(), &[m, n], "[rows, n]")?;
    let ospan = bytes(o.data(), o.len());
    disjoint("out", ospan, &[("x", bytes(xa.data(), xa.len()))])?;
    let (xe, we, oe) = (xa.as_slice()?, w.as_slice()?, o.as_slice_mut()?);
    py.detach(|| kernel::linear(qt, &LinearArgs { m, n, k, threads }, xe, we, oe, backend))
        .map_err(to_py)
}

/// The types `quant_quantize` takes ("q4_k", "q5_k", "q6_k"; the others are
/// `gguf.quants`').
#[pyfunction]
pub fn quant_quantize_types() -> Vec<&'static str> {
    QType::ALL
        .into_iter()
        .filter(|&t| kernel::quantizes(t))
        .map(|t| t.name())
        .collect()
}

/// `out` (uint8 [n, k / 256 * block bytes]) = the float32 weight `w` [n, k] quantized to
/// the GGUF rows of `qtype` (a K-type), rows split over at most `threads` threads; a NaN,
/// infinite or too large weight raises a `FieldError` on "w" naming its row.
#[pyfunction]
#[pyo3(signature = (qtype, w, out, *, threads = 1))]
pub fn quant_quantize(
    py: Python<'_>,
    qtype: &str,
    w: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    threads: i64,
) -> PyResult<()> {
    let qt = qtype_of(qtype)?;
    let threads = threads_of(threads)?;
    let wa = ro::<f32>(w, "w", "float32")?;
    let mut o = rw::<u8>(out, "out", "uint8")?;
    let (n, k) = two_d("w", wa.shape(), "[n, k]")?;
    let (we, oe) = (wa.as_slice()?, o.as_slice_mut()?);
    py.detach(|| kernel::quantize(qt, we, n, k, oe, threads))
        .map_err(to_py)
}

/// Adds this module's functions to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_types, m)?)?;
    m.add_function(wrap_pyfunction!(quant_backend, m)?)?;
    m.add_function(wrap_pyfunction!(quant_backend_available, m)?)?;
    m.add_function(wrap_pyfunction!(quant_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(quant_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant_pack, m)?)?;
    m.add_function(wrap_pyfunction!(quant_linear, m)?)?;
    m.add_function(wrap_pyfunction!(quant_quantize_types, m)?)?;
    m.add_function(wrap_pyfunction!(quant_quantize, m)?)?;
    Ok(())
}
