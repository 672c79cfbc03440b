//! PyO3 wrappers of `ferrobatch-kernels`' fused elementwise kernels (`fused`): numpy views
//! of torch tensors in (f32 as `float32`, bf16 / fp16 as `uint16` bit patterns), every
//! dtype, shape, borrow and overlap (an output sharing memory with an input) checked with a
//! `FieldError` naming the argument, then the kernel with the GIL released. Kept thin: the tensors are small and the calls many.

use ferrobatch_kernels::fused::{self, NormInput, RmsNorm, Rope, WriteRows};
use numpy::PyUntypedArrayMethods;
use pyo3::prelude::*;

use crate::errors::{invalid, kernel_error};
use crate::views::{
    count, disjoint, expect_shape, ro, rw, threads_of, two_d, ty, In, Out, Span, Ty,
};

/// RMSNorm of the rows of `x` [T, H] into `out` [T, H], after `x += residual` in place when
/// `residual` [T, H] is given (`x` must then be float32). `weight` [H]; `weight_offset` is
/// added to it (1.0 for Gemma's `1 + w`). All f32, rounded once into `out_dtype`:
/// `(x * (1 / sqrt(mean(x^2) + eps))) * (w + weight_offset)`, the mean a 64-lane sum.
/// `threads` > 1 splits the rows in calls of the kernel pool's `min_split` elements or more
/// (2^15 on torch's OpenMP team after `share_openmp`, else 2^20: a fresh thread per call
/// never paid at decode sizes); smaller calls run on the caller's thread.
#[pyfunction]
#[pyo3(signature = (x, weight, out, *, x_dtype, weight_dtype, out_dtype, eps,
                    weight_offset = 0.0, residual = None, residual_dtype = "float32",
                    threads = 1))]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    x_dtype: &str,
    weight_dtype: &str,
    out_dtype: &str,
    eps: f32,
    weight_offset: f32,
    residual: Option<&Bound<'_, PyAny>>,
    residual_dtype: &str,
    threads: i64,
) -> PyResult<()> {
    let (xt, wt, ot) = (
        ty(x_dtype, "x_dtype")?,
        ty(weight_dtype, "weight_dtype")?,
        ty(out_dtype, "out_dtype")?,
    );
    let threads = threads_of(threads)?;
    let w = In::new(weight, wt, "weight")?;
    let mut o = Out::new(out, ot, "out")?;
    if let Some(r) = residual {
        if xt != Ty::F32 {
            return Err(invalid(
                "x_dtype",
                format!(
                    "with a residual, x is updated in place and must be float32, not {x_dtype}"
                ),
            ));
        }
        let mut xa = rw::<f32>(x, "x", "float32")?;
        let (rows, hidden) = two_d("x", xa.shape(), "[tokens, hidden]")?;
        let r = In::new(r, ty(residual_dtype, "residual_dtype")?, "residual")?;
        expect_shape("residual", r.shape(), &[rows, hidden], "[tokens, hidden]")?;
        let xs = xa.span();
        disjoint(
            "x",
            xs.clone(),
            &[("residual", r.span()), ("weight", w.span())],
        )?;
        let ins = [("x", xs), ("residual", r.span()), ("weight", w.span())];
        disjoint("out", o.span(), &ins)?;
        let a = norm_args(&w, &o, rows, hidden, eps, weight_offset, threads)?;
        let input = NormInput::AddResidual {
            x: xa.as_slice_mut().unwrap_or_default(),
            residual: r.elems(),
        };
        let out = o.elems();
        py.detach(|| fused::rms_norm(&a, input, out))
            .map_err(kernel_error)
    } else {
        let xa = In::new(x, xt, "x")?;
        let (rows, hidden) = two_d("x", xa.shape(), "[tokens, hidden]")?;
        disjoint("out", o.span(), &[("x", xa.span()), ("weight", w.span())])?;
        let a = norm_args(&w, &o, rows, hidden, eps, weight_offset, threads)?;
        let input = NormInput::Plain(xa.elems());
        let out = o.elems();
        py.detach(|| fused::rms_norm(&a, input, out))
            .map_err(kernel_error)
    }
}

/// The norm's arguments after the weight's and the output's shapes are checked.
fn norm_args<'a>(
    w: &'a In<'_>,
    o: &Out<'_>,
    rows: usize,
    hidden: usize,
    eps: f32,
    weight_offset: f32,
    threads: usize,
) -> PyResult<RmsNorm<'a>> {
    expect_shape("weight", w.shape(), &[hidden], "[hidden]")?;
    expect_shape("out", o.shape(), &[rows, hidden], "[tokens, hidden]")?;
    Ok(RmsNorm {
        weight: w.elems(),
        rows,
        hidden,
        eps,
        weight_offset,
        threads,
    })
}

/// `out[t, i] = act(gate_up[t, i]) * gate_up[t, I + i]`: `gate_up` [T, 2I], `out` [T, I];
/// `activation` "silu", `silu(g) = g / (1 + exp(-g))` in f32, exp Cephes' polynomial (within
/// 2 ulp), or "gelu_pytorch_tanh", GELU's tanh approximation as `g / (1 + exp(-2u))`, `u =
/// sqrt(2 / pi) (g + 0.044715 g^3)`.
/// `threads` > 1 splits the rows in calls of the kernel pool's `min_split` elements or more
/// (2^15 on torch's OpenMP team after `share_openmp`, else 2^20: a fresh thread per call
/// never paid at decode sizes); smaller calls run on the caller's thread.
#[pyfunction]
#[pyo3(signature = (gate_up, out, *, dtype, out_dtype, threads = 1, activation = "silu"))]
pub fn silu_mul(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    out_dtype: &str,
    threads: i64,
    activation: &str,
) -> PyResult<()> {
    let gate = fused::Gate::from_name(activation).ok_or_else(|| {
        invalid(
            "activation",
            format!("activation must be \"silu\" or \"gelu_pytorch_tanh\", not {activation:?}"),
        )
    })?;
    let (it, ot) = (ty(dtype, "dtype")?, ty(out_dtype, "out_dtype")?);
    let threads = threads_of(threads)?;
    let g = In::new(gate_up, it, "gate_up")?;
    let mut o = Out::new(out, ot, "out")?;
    let (rows, cols) = two_d("gate_up", g.shape(), "[tokens, 2 * intermediate]")?;
    if cols % 2 != 0 {
        return Err(invalid(
            "gate_up",
            format!("gate_up must have an even number of columns, not {cols}"),
        ));
    }
    let inter = cols / 2;
    expect_shape("out", o.shape(), &[rows, inter], "[tokens, intermediate]")?;
    disjoint("out", o.span(), &[("gate_up", g.span())])?;
    let (g, out) = (g.elems(), o.elems());
    py.detach(|| fused::gated_mul(g, out, rows, inter, gate, threads))
        .map_err(kernel_error)
}

/// Rotary embedding of `heads` heads of `dim` columns of `src` [T, W] from column
/// `col_offset` on, with `cos` / `sin` float32 [T, rot], into `out` [T, heads, dim]:
/// `x * cos + rotate_half(x) * sin` in f32 over each head's first `rot` columns (all `dim`
/// by default), the rest copied (bit-equal to transformers' fp32 formula).
/// `threads` > 1 splits the rows in calls of the kernel pool's `min_split` elements or more
/// (2^15 on torch's OpenMP team after `share_openmp`, else 2^20: a fresh thread per call
/// never paid at decode sizes); smaller calls run on the caller's thread.
#[pyfunction]
#[pyo3(signature = (src, cos, sin, out, *, src_dtype, out_dtype, col_offset, heads, dim,
                    threads = 1, rot = None))]
#[allow(clippy::too_many_arguments)]
pub fn rope(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    src_dtype: &str,
    out_dtype: &str,
    col_offset: i64,
    heads: i64,
    dim: i64,
    threads: i64,
    rot: Option<i64>,
) -> PyResult<()> {
    let (st, ot) = (ty(src_dtype, "src_dtype")?, ty(out_dtype, "out_dtype")?);
    let (col_offset, heads, dim) = (
        count(col_offset, "col_offset")?,
        count(heads, "heads")?,
        count(dim, "dim")?,
    );
    let rot = count(rot.unwrap_or(dim as i64), "rot")?;
    let threads = threads_of(threads)?;
    let s = In::new(src, st, "src")?;
    let c = ro::<f32>(cos, "cos", "float32")?;
    let n = ro::<f32>(sin, "sin", "float32")?;
    let mut o = Out::new(out, ot, "out")?;
    let (rows, src_width) = two_d("src", s.shape(), "[tokens, width]")?;
    expect_shape("cos", c.shape(), &[rows, rot], "[tokens, rot]")?;
    expect_shape("sin", n.shape(), &[rows, rot], "[tokens, rot]")?;
    expect_shape(
        "out",
        o.shape(),
        &[rows, heads, dim],
        "[tokens, heads, dim]",
    )?;
    let tables = [("src", s.span()), ("cos", c.span()), ("sin", n.span())];
    disjoint("out", o.span(), &tables)?;
    let a = Rope {
        src: s.elems(),
        cos: c.as_slice().unwrap_or_default(),
        sin: n.as_slice().unwrap_or_default(),
        rows,
        src_width,
        col_offset,
        heads,
        dim,
        rot,
        threads,
    };
    let out = o.elems();
    py.detach(|| fused::rope(&a, out)).map_err(kernel_error)
}

/// `dst[slots[t], :] = src[t, col_offset : col_offset + width]` converted to `dst`'s type:
/// `src` [T, W], `dst` [S, width] (or [S, kv_heads, dim] with kv_heads * dim = width),
/// `slots` int64 [T], all checked in `0 .. S` before any write; a repeated slot gets the
/// last of its rows. Single-threaded.
#[pyfunction]
#[pyo3(signature = (src, dst, slots, *, src_dtype, dst_dtype, col_offset, width))]
#[allow(clippy::too_many_arguments)]
pub fn write_rows(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    src_dtype: &str,
    dst_dtype: &str,
    col_offset: i64,
    width: i64,
) -> PyResult<()> {
    let (st, dt) = (ty(src_dtype, "src_dtype")?, ty(dst_dtype, "dst_dtype")?);
    let (col_offset, width) = (count(col_offset, "col_offset")?, count(width, "width")?);
    let s = In::new(src, st, "src")?;
    let sl = ro::<i64>(slots, "slots", "int64")?;
    let mut d = Out::new(dst, dt, "dst")?;
    let (rows, src_width) = two_d("src", s.shape(), "[tokens, width]")?;
    expect_shape("slots", sl.shape(), &[rows], "[tokens]")?;
    check_cache_rows(d.shape(), width)?;
    let ins = [("src", s.span()), ("slots", sl.span())];
    disjoint("dst", d.span(), &ins)?;
    let a = WriteRows {
        src: s.elems(),
        src_width,
        col_offset,
        width,
        slots: sl.as_slice().unwrap_or_default(),
    };
    let dst = d.elems();
    py.detach(|| fused::write_rows(&a, dst))
        .map_err(kernel_error)
}

/// Rows into an int8 KV cache: `src` [T, width] (float32 / bfloat16 / float16 named by
/// `src_dtype`) quantized per `group` columns (one KV head; symmetric absmax, one fp32
/// scale each) into `dst` int8 [S, width] (or [S, kv_heads, dim]) at `slots` (int64 [T],
/// checked in `0 .. S` first), the scales into `scales` float32 [S, width / group].
/// Single-threaded.
#[pyfunction]
#[pyo3(signature = (src, dst, scales, slots, *, src_dtype, group))]
pub fn write_rows_int8(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    src_dtype: &str,
    group: i64,
) -> PyResult<()> {
    let group = count(group, "group")?;
    let s = In::new(src, ty(src_dtype, "src_dtype")?, "src")?;
    let sl = ro::<i64>(slots, "slots", "int64")?;
    let mut d = rw::<i8>(dst, "dst", "int8")?;
    let mut sc = rw::<f32>(scales, "scales", "float32")?;
    let (rows, width) = two_d("src", s.shape(), "[tokens, width]")?;
    expect_shape("slots", sl.shape(), &[rows], "[tokens]")?;
    check_cache_rows(d.shape(), width)?;
    let ins = [("src", s.span()), ("slots", sl.span())];
    disjoint("dst", d.span(), &ins)?;
    disjoint("scales", sc.span(), &ins)?;
    disjoint("scales", sc.span(), &[("dst", d.span())])?;
    let slots = sl.as_slice().unwrap_or_default();
    let (dst, scales) = (
        d.as_slice_mut().unwrap_or_default(),
        sc.as_slice_mut().unwrap_or_default(),
    );
    let src = s.elems();
    py.detach(|| fused::write_rows_int8(src, width, slots, group, dst, scales))
        .map_err(kernel_error)
}

/// `dst` of a row write is a cache of `width`-wide slots: [slots, width] or
/// [slots, kv_heads, dim] with `kv_heads * dim == width`.
fn check_cache_rows(shape: &[usize], width: usize) -> PyResult<()> {
    let row: usize = shape.iter().skip(1).product();
    if shape.len() < 2 || row != width {
        return Err(invalid(
            "dst",
            format!(
                "dst must be [slots, width = {width}] (or [slots, kv_heads, dim]), not shape {shape:?}"
            ),
        ));
    }
    Ok(())
}
