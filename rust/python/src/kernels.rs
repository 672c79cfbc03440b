//! PyO3 wrappers of `ferrobatch-kernels`: numpy views in (of torch tensors: bf16 / fp16 as
//! `uint16` bit patterns), slices out to the kernel, its errors as `FieldError` (a
//! `ValueError`). The GIL is released while a kernel runs.

use ferrobatch_kernels as kernels;
use kernels::{DecodeArgs, Elems, PrefillArgs, Window};
use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use std::ops::Range;

use crate::errors::{field_error, invalid, kernel_error};
use crate::views::{c_slice, disjoint, ro, ty, In, Out, Span};

/// The K and V caches of a call: one of the float storages, or int8 with their scales.
enum Caches<'py> {
    Plain(In<'py>, In<'py>),
    Int8 {
        k: PyReadonlyArrayDyn<'py, i8>,
        v: PyReadonlyArrayDyn<'py, i8>,
        k_scales: PyReadonlyArrayDyn<'py, f32>,
        v_scales: PyReadonlyArrayDyn<'py, f32>,
    },
}

impl<'py> Caches<'py> {
    fn new(
        k: &Bound<'py, PyAny>,
        v: &Bound<'py, PyAny>,
        cache_dtype: &str,
        scales: (Option<&Bound<'py, PyAny>>, Option<&Bound<'py, PyAny>>),
    ) -> PyResult<Self> {
        if cache_dtype != "int8" {
            let t = ty(cache_dtype, "cache_dtype")?;
            return Ok(Caches::Plain(
                In::new(k, t, "k_cache")?,
                In::new(v, t, "v_cache")?,
            ));
        }
        let (Some(ks), Some(vs)) = scales else {
            return Err(invalid(
                "k_scales",
                "an int8 cache needs k_scales and v_scales (float32 [slots, kv_heads])",
            ));
        };
        let caches = Caches::Int8 {
            k: ro(k, "k_cache", "int8")?,
            v: ro(v, "v_cache", "int8")?,
            k_scales: ro(ks, "k_scales", "float32")?,
            v_scales: ro(vs, "v_scales", "float32")?,
        };
        if let Caches::Int8 {
            k,
            k_scales,
            v_scales,
            ..
        } = &caches
        {
            let want = &k.shape()[..k.shape().len().min(2)];
            for (name, s) in [("k_scales", k_scales), ("v_scales", v_scales)] {
                if s.shape() != want {
                    return Err(invalid(
                        name,
                        format!(
                            "{name} must be [slots, kv_heads] = {want:?}, not {:?}",
                            s.shape()
                        ),
                    ));
                }
            }
        }
        Ok(caches)
    }

    fn shape(&self) -> &[usize] {
        match self {
            Caches::Plain(k, _) => k.shape(),
            Caches::Int8 { k, .. } => k.shape(),
        }
    }

    fn spans(&self) -> Vec<(&'static str, Range<usize>)> {
        match self {
            Caches::Plain(k, v) => vec![("k_cache", k.span()), ("v_cache", v.span())],
            Caches::Int8 {
                k,
                v,
                k_scales,
                v_scales,
            } => vec![
                ("k_cache", k.span()),
                ("v_cache", v.span()),
                ("k_scales", k_scales.span()),
                ("v_scales", v_scales.span()),
            ],
        }
    }

    /// The K and V elements (`dim`: the head size, the int8 scales' group).
    fn elems(&self, dim: usize) -> PyResult<(Elems<'_>, Elems<'_>)> {
        Ok(match self {
            Caches::Plain(k, v) => (k.elems(), v.elems()),
            Caches::Int8 {
                k,
                v,
                k_scales,
                v_scales,
            } => (
                Elems::I8 {
                    data: c_slice(k, "k_cache")?,
                    scales: c_slice(k_scales, "k_scales")?,
                    group: dim,
                },
                Elems::I8 {
                    data: c_slice(v, "v_cache")?,
                    scales: c_slice(v_scales, "v_scales")?,
                    group: dim,
                },
            ),
        })
    }
}

/// The shapes both attention kernels take (`q` [`q_rows`, heads, dim], the caches [slots,
/// kv_heads, dim] of the same head size, a 2-D block table), and `out` apart from every
/// input.
fn check_attention_inputs(
    q: &In<'_>,
    caches: &Caches<'_>,
    out: &Out<'_>,
    q_rows: &str,
    t_shape: &[usize],
) -> PyResult<()> {
    let (q_shape, k_shape) = (q.shape(), caches.shape());
    if q_shape.len() != 3 || k_shape.len() != 3 || t_shape.len() != 2 {
        return Err(field_error(
            None,
            format!(
                "q must be [{q_rows}, heads, dim], the caches [slots, kv_heads, dim], \
                 block_tables [rows, width]"
            ),
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
    let mut inputs = caches.spans();
    inputs.push(("q", q.span()));
    disjoint("out", out.span(), &inputs)
}

/// The kernels' window of a binding's `window` (0 = full attention).
fn window_of(window: usize) -> Window {
    if window == 0 {
        Window::Full
    } else {
        Window::Sliding { window }
    }
}

/// Attention of decode rows over the paged cache, read in place (`ferrobatch-kernels`,
/// `decode`): `q` [rows, heads, dim], `k_cache` / `v_cache` [slots, kv_heads, dim],
/// `block_tables` int32 [rows, width], `seqlens` int32 [rows], writes `out` [rows, heads,
/// dim]. `window` 0 = full attention, else the sliding window through a ring of `width`
/// chunks. `softcap` 0 = none. `cache_dtype="int8"`: the caches are int8, `k_scales` /
/// `v_scales` float32 [slots, kv_heads] (one scale per slot and KV head), read dequantized.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seqlens, out, *, q_dtype, cache_dtype,
                    out_dtype, page, window, scale, softcap, threads, k_scales=None,
                    v_scales=None))]
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
    k_scales: Option<&Bound<'_, PyAny>>,
    v_scales: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let q = In::new(q, ty(q_dtype, "q_dtype")?, "q")?;
    let caches = Caches::new(k_cache, v_cache, cache_dtype, (k_scales, v_scales))?;
    let mut out = Out::new(out, ty(out_dtype, "out_dtype")?, "out")?;
    let (q_shape, k_shape, t_shape) = (q.shape(), caches.shape(), block_tables.shape().to_vec());
    check_attention_inputs(&q, &caches, &out, "rows", &t_shape)?;
    let (k, v) = caches.elems(q_shape[2])?;
    let args = DecodeArgs {
        q: q.elems(),
        k_cache: k,
        v_cache: v,
        block_tables: c_slice(&block_tables, "block_tables")?,
        seqlens: c_slice(&seqlens, "seqlens")?,
        heads: q_shape[1],
        kv_heads: k_shape[1],
        dim: q_shape[2],
        page,
        width: t_shape[1],
        window: window_of(window),
        scale,
        softcap: (softcap != 0.0).then_some(softcap),
        threads,
    };
    let out = out.elems();
    py.detach(|| kernels::paged_decode_attention(&args, out))
        .map_err(kernel_error)
}

/// Causal attention of multi-token (prefill) rows over the paged cache, read in place and
/// tiled (`ferrobatch-kernels`, `prefill`): `q` [tokens, heads, dim] (the rows' tokens one
/// after the other), `cu_seqlens_q` int32 [rows + 1] the rows' token offsets,
/// `seqlens` int32 [rows] the keys of each row after this step (its new keys are already in
/// the cache); the other arguments as `paged_decode_attention`'s. Writes `out` [tokens,
/// heads, dim].
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens, out, *,
                    q_dtype, cache_dtype, out_dtype, page, window, scale, softcap, threads,
                    k_scales=None, v_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArrayDyn<'_, i32>,
    cu_seqlens_q: PyReadonlyArrayDyn<'_, i32>,
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
    k_scales: Option<&Bound<'_, PyAny>>,
    v_scales: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let q = In::new(q, ty(q_dtype, "q_dtype")?, "q")?;
    let caches = Caches::new(k_cache, v_cache, cache_dtype, (k_scales, v_scales))?;
    let mut out = Out::new(out, ty(out_dtype, "out_dtype")?, "out")?;
    let (q_shape, k_shape, t_shape) = (q.shape(), caches.shape(), block_tables.shape().to_vec());
    check_attention_inputs(&q, &caches, &out, "tokens", &t_shape)?;
    let (k, v) = caches.elems(q_shape[2])?;
    let args = PrefillArgs {
        paged: DecodeArgs {
            q: q.elems(),
            k_cache: k,
            v_cache: v,
            block_tables: c_slice(&block_tables, "block_tables")?,
            seqlens: c_slice(&seqlens, "seqlens")?,
            heads: q_shape[1],
            kv_heads: k_shape[1],
            dim: q_shape[2],
            page,
            width: t_shape[1],
            window: window_of(window),
            scale,
            softcap: (softcap != 0.0).then_some(softcap),
            threads,
        },
        cu_seqlens_q: c_slice(&cu_seqlens_q, "cu_seqlens_q")?,
    };
    let out = out.elems();
    py.detach(|| kernels::paged_prefill_attention(&args, out))
        .map_err(kernel_error)
}
