//! PyO3 wrappers of `ferrobatch-kernels`: numpy views in (of torch tensors: bf16 / fp16 as
//! `uint16` bit patterns), slices out to the kernel, its errors as `FieldError` (a
//! `ValueError`). The GIL is released while a kernel runs.

use ferrobatch_kernels as kernels;
use kernels::{DecodeArgs, Elems, ElemsMut, Window};
use numpy::{
    PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::{field_error, invalid};

/// A read-only contiguous array of the named storage type.
enum Ro<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    U16(PyReadonlyArrayDyn<'py, u16>, bool), // bf16 when true, else fp16
}

enum Rw<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    U16(PyReadwriteArrayDyn<'py, u16>, bool),
}

fn half_kind(dtype: &str, field: &'static str) -> PyResult<Option<bool>> {
    match dtype {
        "float32" => Ok(None),
        "bfloat16" => Ok(Some(true)),
        "float16" => Ok(Some(false)),
        _ => Err(invalid(
            field,
            format!("{field}: dtype must be float32, bfloat16 or float16, not {dtype:?}"),
        )),
    }
}

fn readonly<'py>(a: &Bound<'py, PyAny>, dtype: &str, field: &'static str) -> PyResult<Ro<'py>> {
    let wrong = || {
        invalid(
            field,
            format!("{field} must be a numpy array of {dtype} storage (bf16/fp16 as uint16)"),
        )
    };
    Ok(match half_kind(dtype, field)? {
        None => Ro::F32(a.cast::<PyArrayDyn<f32>>().map_err(|_| wrong())?.readonly()),
        Some(bf) => Ro::U16(
            a.cast::<PyArrayDyn<u16>>().map_err(|_| wrong())?.readonly(),
            bf,
        ),
    })
}

fn readwrite<'py>(a: &Bound<'py, PyAny>, dtype: &str, field: &'static str) -> PyResult<Rw<'py>> {
    let wrong = || {
        invalid(
            field,
            format!(
                "{field} must be a writable numpy array of {dtype} storage (bf16/fp16 as uint16)"
            ),
        )
    };
    Ok(match half_kind(dtype, field)? {
        None => Rw::F32(
            a.cast::<PyArrayDyn<f32>>()
                .map_err(|_| wrong())?
                .readwrite(),
        ),
        Some(bf) => Rw::U16(
            a.cast::<PyArrayDyn<u16>>()
                .map_err(|_| wrong())?
                .readwrite(),
            bf,
        ),
    })
}

fn not_contiguous(field: &'static str) -> PyErr {
    invalid(field, format!("{field} must be C-contiguous"))
}

fn elems<'a>(a: &'a Ro<'_>, field: &'static str) -> PyResult<Elems<'a>> {
    Ok(match a {
        Ro::F32(x) => Elems::F32(x.as_slice().map_err(|_| not_contiguous(field))?),
        Ro::U16(x, true) => Elems::Bf16(x.as_slice().map_err(|_| not_contiguous(field))?),
        Ro::U16(x, false) => Elems::F16(x.as_slice().map_err(|_| not_contiguous(field))?),
    })
}

fn elems_mut<'a>(a: &'a mut Rw<'_>, field: &'static str) -> PyResult<ElemsMut<'a>> {
    Ok(match a {
        Rw::F32(x) => ElemsMut::F32(x.as_slice_mut().map_err(|_| not_contiguous(field))?),
        Rw::U16(x, true) => ElemsMut::Bf16(x.as_slice_mut().map_err(|_| not_contiguous(field))?),
        Rw::U16(x, false) => ElemsMut::F16(x.as_slice_mut().map_err(|_| not_contiguous(field))?),
    })
}

/// Attention of decode rows over the paged cache, read in place (`ferrobatch-kernels`,
/// `decode`): `q` [rows, heads, dim], `k_cache` / `v_cache` [slots, kv_heads, dim],
/// `block_tables` int32 [rows, width], `seqlens` int32 [rows], writes `out` [rows, heads,
/// dim]. `window` 0 = full attention, else the sliding window through a ring of `width`
/// chunks. `softcap` 0 = none.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seqlens, out, *, q_dtype, cache_dtype,
                    out_dtype, page, window, scale, softcap, threads))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArrayDyn<'_, i32>,
    seqlens: PyReadonlyArrayDyn<'_, i32>,
    out: &Bound<'_, PyAny>,
    q_dtype: &str,
    cache_dtype: &str,
    out_dtype: &str,
    page: usize,
    window: usize,
    scale: f32,
    softcap: f32,
    threads: usize,
) -> PyResult<()> {
    let (q, k, v) = (
        readonly(q, q_dtype, "q")?,
        readonly(k_cache, cache_dtype, "k_cache")?,
        readonly(v_cache, cache_dtype, "v_cache")?,
    );
    let mut out = readwrite(out, out_dtype, "out")?;
    let (q_shape, k_shape, t_shape) = (q.shape(), k.shape(), block_tables.shape().to_vec());
    if q_shape.len() != 3 || k_shape.len() != 3 || t_shape.len() != 2 {
        return Err(field_error(
            None,
            "q must be [rows, heads, dim], the caches [slots, kv_heads, dim], block_tables \
             [rows, width]",
        ));
    }
    if k_shape[2] != q_shape[2] {
        return Err(field_error(
            None,
            format!(
                "q's head size {} differs from the cache's {}",
                q_shape[2], k_shape[2]
            ),
        ));
    }
    let args = DecodeArgs {
        q: elems(&q, "q")?,
        k_cache: elems(&k, "k_cache")?,
        v_cache: elems(&v, "v_cache")?,
        block_tables: block_tables
            .as_slice()
            .map_err(|_| not_contiguous("block_tables"))?,
        seqlens: seqlens.as_slice().map_err(|_| not_contiguous("seqlens"))?,
        heads: q_shape[1],
        kv_heads: k_shape[1],
        dim: q_shape[2],
        page,
        width: t_shape[1],
        window: if window == 0 {
            Window::Full
        } else {
            Window::Sliding { window }
        },
        scale,
        softcap: (softcap != 0.0).then_some(softcap),
        threads,
    };
    let out = elems_mut(&mut out, "out")?;
    py.detach(|| kernels::paged_decode_attention(&args, out))
        .map_err(|e| field_error(None, e.0))
}

impl Ro<'_> {
    fn shape(&self) -> Vec<usize> {
        match self {
            Ro::F32(x) => x.shape().to_vec(),
            Ro::U16(x, _) => x.shape().to_vec(),
        }
    }
}
