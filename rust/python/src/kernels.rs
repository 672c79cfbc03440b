//! PyO3 wrappers of `ferrobatch-kernels`: numpy views in (of torch tensors: bf16 / fp16 as
//! `uint16` bit patterns), slices out to the kernel, its errors as `FieldError` (a
//! `ValueError`). The GIL is released while a kernel runs.

use ferrobatch_kernels as kernels;
use kernels::{DecodeArgs, Window};
use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::{field_error, kernel_error};
use crate::views::{c_slice, disjoint, ty, In, Out};

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
        In::new(q, ty(q_dtype, "q_dtype")?, "q")?,
        In::new(k_cache, ty(cache_dtype, "cache_dtype")?, "k_cache")?,
        In::new(v_cache, ty(cache_dtype, "cache_dtype")?, "v_cache")?,
    );
    let mut out = Out::new(out, ty(out_dtype, "out_dtype")?, "out")?;
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
    disjoint(
        "out",
        out.span(),
        &[
            ("q", q.span()),
            ("k_cache", k.span()),
            ("v_cache", v.span()),
        ],
    )?;
    let args = DecodeArgs {
        q: q.elems(),
        k_cache: k.elems(),
        v_cache: v.elems(),
        block_tables: c_slice(&block_tables, "block_tables")?,
        seqlens: c_slice(&seqlens, "seqlens")?,
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
    let out = out.elems();
    py.detach(|| kernels::paged_decode_attention(&args, out))
        .map_err(kernel_error)
}
