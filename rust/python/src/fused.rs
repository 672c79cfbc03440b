//! PyO3 wrappers of `ferrobatch-kernels`' fused elementwise kernels (`fused`): numpy views
//! of torch tensors in (f32 as `float32`, bf16 / fp16 as `uint16` bit patterns), every
//! dtype, shape, borrow and overlap (an output sharing memory with an input) checked with a
//! `FieldError` naming the argument, then the kernel with the GIL released. Kept thin: the tensors are small and the calls many.

use ferrobatch_kernels::fused::{self, ArgError, NormInput, RmsNorm, Rope, WriteRows};
use ferrobatch_kernels::{Elems, ElemsMut};
use numpy::{
    Element, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use std::ops::Range;

use crate::errors::invalid;

/// Storage named by a dtype string.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ty {
    F32,
    Bf16,
    F16,
}

/// `dtype` (the value of the argument `field`) as a storage type.
fn ty(dtype: &str, field: &'static str) -> PyResult<Ty> {
    match dtype {
        "float32" => Ok(Ty::F32),
        "bfloat16" => Ok(Ty::Bf16),
        "float16" => Ok(Ty::F16),
        _ => Err(invalid(
            field,
            format!("{field} must be \"float32\", \"bfloat16\" or \"float16\", not {dtype:?}"),
        )),
    }
}

/// `a` as a C-contiguous numpy array of `T`, borrowed read-only.
fn ro<'py, T: Element>(
    a: &Bound<'py, PyAny>,
    field: &'static str,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let arr = a
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| invalid(field, format!("{field} must be a numpy array of {what}")))?;
    if !arr.is_c_contiguous() {
        return Err(invalid(field, format!("{field} must be C-contiguous")));
    }
    arr.try_readonly().map_err(|_| {
        invalid(
            field,
            format!("{field} is also passed as an output (it is borrowed mutably)"),
        )
    })
}

/// `a` as a writable C-contiguous numpy array of `T`, borrowed exclusively.
fn rw<'py, T: Element>(
    a: &Bound<'py, PyAny>,
    field: &'static str,
    what: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    let arr = a
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| invalid(field, format!("{field} must be a numpy array of {what}")))?;
    if !arr.is_c_contiguous() {
        return Err(invalid(field, format!("{field} must be C-contiguous")));
    }
    arr.try_readwrite().map_err(|_| {
        invalid(
            field,
            format!("{field} must be writable and not passed as another argument too"),
        )
    })
}

fn storage(t: Ty) -> &'static str {
    match t {
        Ty::F32 => "float32",
        Ty::Bf16 => "bfloat16 storage (uint16 bits)",
        Ty::F16 => "float16 storage (uint16 bits)",
    }
}

/// A read-only array of one of the storage types.
enum In<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    U16(PyReadonlyArrayDyn<'py, u16>, Ty),
}

impl<'py> In<'py> {
    fn new(a: &Bound<'py, PyAny>, t: Ty, field: &'static str) -> PyResult<Self> {
        Ok(match t {
            Ty::F32 => In::F32(ro(a, field, storage(t))?),
            _ => In::U16(ro(a, field, storage(t))?, t),
        })
    }
    fn shape(&self) -> &[usize] {
        match self {
            In::F32(a) => a.shape(),
            In::U16(a, _) => a.shape(),
        }
    }
    fn span(&self) -> Range<usize> {
        match self {
            In::F32(a) => bytes(a.data(), a.len()),
            In::U16(a, _) => bytes(a.data(), a.len()),
        }
    }
    fn elems(&self) -> Elems<'_> {
        // contiguity was checked in `ro`, so `as_slice` cannot fail
        match self {
            In::F32(a) => Elems::F32(a.as_slice().unwrap_or_default()),
            In::U16(a, Ty::Bf16) => Elems::Bf16(a.as_slice().unwrap_or_default()),
            In::U16(a, _) => Elems::F16(a.as_slice().unwrap_or_default()),
        }
    }
}

/// A writable array of one of the storage types.
enum Out<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    U16(PyReadwriteArrayDyn<'py, u16>, Ty),
}

impl<'py> Out<'py> {
    fn new(a: &Bound<'py, PyAny>, t: Ty, field: &'static str) -> PyResult<Self> {
        Ok(match t {
            Ty::F32 => Out::F32(rw(a, field, storage(t))?),
            _ => Out::U16(rw(a, field, storage(t))?, t),
        })
    }
    fn shape(&self) -> &[usize] {
        match self {
            Out::F32(a) => a.shape(),
            Out::U16(a, _) => a.shape(),
        }
    }
    fn span(&self) -> Range<usize> {
        match self {
            Out::F32(a) => bytes(a.data(), a.len()),
            Out::U16(a, _) => bytes(a.data(), a.len()),
        }
    }
    fn elems(&mut self) -> ElemsMut<'_> {
        // contiguity was checked in `rw`, so `as_slice_mut` cannot fail
        match self {
            Out::F32(a) => ElemsMut::F32(a.as_slice_mut().unwrap_or_default()),
            Out::U16(a, Ty::Bf16) => ElemsMut::Bf16(a.as_slice_mut().unwrap_or_default()),
            Out::U16(a, _) => ElemsMut::F16(a.as_slice_mut().unwrap_or_default()),
        }
    }
}

/// The bytes `n` elements from `p` occupy.
fn bytes<T>(p: *mut T, n: usize) -> Range<usize> {
    let start = p as usize;
    start..start + n * std::mem::size_of::<T>()
}

/// An error naming `out` when its memory overlaps one of `inputs` (numpy cannot see that two
/// views of one torch tensor alias, and the kernels do not work in place).
fn disjoint(
    out: &'static str,
    o: Range<usize>,
    inputs: &[(&'static str, Range<usize>)],
) -> PyResult<()> {
    match inputs
        .iter()
        .find(|(_, r)| o.start < r.end && r.start < o.end)
    {
        Some((name, _)) => Err(invalid(
            out,
            format!("{out} overlaps {name} in memory: the kernels do not work in place"),
        )),
        None => Ok(()),
    }
}

/// An error unless `shape == want`; `what` spells the expected shape.
fn expect_shape(field: &'static str, shape: &[usize], want: &[usize], what: &str) -> PyResult<()> {
    if shape == want {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{field} must be {what} = {want:?}, not shape {shape:?}"),
        ))
    }
}

/// `[rows, cols]` of a 2-D array.
fn two_d(field: &'static str, shape: &[usize], what: &str) -> PyResult<(usize, usize)> {
    match *shape {
        [r, c] => Ok((r, c)),
        _ => Err(invalid(
            field,
            format!("{field} must be 2-D {what}, not shape {shape:?}"),
        )),
    }
}

/// A non-negative integer argument.
fn count(v: i64, field: &'static str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(field, format!("{field} must be >= 0, not {v}")))
}

fn threads_of(v: i64) -> PyResult<usize> {
    match count(v, "threads")? {
        0 => Err(invalid("threads", "threads must be >= 1")),
        n => Ok(n),
    }
}

fn to_py(e: ArgError) -> PyErr {
    invalid(e.field, e.message)
}

/// RMSNorm of the rows of `x` [T, H] into `out` [T, H], after `x += residual` in place when
/// `residual` [T, H] is given (`x` must then be float32). `weight` [H]; `weight_offset` is
/// added to it (1.0 for Gemma's `1 + w`). All f32, rounded once into `out_dtype`:
/// `(x * (1 / sqrt(mean(x^2) + eps))) * (w + weight_offset)`, the mean a 64-lane sum.
/// `threads` > 1 splits the rows only in calls of 2^20 elements or more: at decode sizes,
/// splitting over 2 threads never paid (measured), so they run on the caller's thread.
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
        let xs = bytes(xa.data(), xa.len());
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
        py.detach(|| fused::rms_norm(&a, input, out)).map_err(to_py)
    } else {
        let xa = In::new(x, xt, "x")?;
        let (rows, hidden) = two_d("x", xa.shape(), "[tokens, hidden]")?;
        disjoint("out", o.span(), &[("x", xa.span()), ("weight", w.span())])?;
        let a = norm_args(&w, &o, rows, hidden, eps, weight_offset, threads)?;
        let input = NormInput::Plain(xa.elems());
        let out = o.elems();
        py.detach(|| fused::rms_norm(&a, input, out)).map_err(to_py)
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

/// `out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]`: `gate_up` [T, 2I], `out` [T, I];
/// `silu(g) = g / (1 + exp(-g))` in f32, exp Cephes' polynomial (within 2 ulp).
/// `threads` > 1 splits the rows only in calls of 2^20 elements or more: at decode sizes,
/// splitting over 2 threads never paid (measured), so they run on the caller's thread.
/// `round_act`: round `silu(g)` to `out_dtype` before the product, as a half-precision
/// model's own `act(gate) * up` does (no change for float32 output).
#[pyfunction]
#[pyo3(signature = (gate_up, out, *, dtype, out_dtype, round_act = false, threads = 1))]
#[allow(clippy::too_many_arguments)]
pub fn silu_mul(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    out_dtype: &str,
    round_act: bool,
    threads: i64,
) -> PyResult<()> {
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
    py.detach(|| fused::silu_mul(g, out, rows, inter, round_act, threads))
        .map_err(to_py)
}

/// Rotary embedding of `heads` heads of `dim` columns of `src` [T, W] from column
/// `col_offset` on, with `cos` / `sin` float32 [T, dim], into `out` [T, heads, dim]:
/// `x * cos + rotate_half(x) * sin` in f32 (bit-equal to transformers' fp32 formula).
/// `threads` > 1 splits the rows only in calls of 2^20 elements or more: at decode sizes,
/// splitting over 2 threads never paid (measured), so they run on the caller's thread.
#[pyfunction]
#[pyo3(signature = (src, cos, sin, out, *, src_dtype, out_dtype, col_offset, heads, dim,
                    threads = 1))]
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
) -> PyResult<()> {
    let (st, ot) = (ty(src_dtype, "src_dtype")?, ty(out_dtype, "out_dtype")?);
    let (col_offset, heads, dim) = (
        count(col_offset, "col_offset")?,
        count(heads, "heads")?,
        count(dim, "dim")?,
    );
    let threads = threads_of(threads)?;
    let s = In::new(src, st, "src")?;
    let c = ro::<f32>(cos, "cos", "float32")?;
    let n = ro::<f32>(sin, "sin", "float32")?;
    let mut o = Out::new(out, ot, "out")?;
    let (rows, src_width) = two_d("src", s.shape(), "[tokens, width]")?;
    expect_shape("cos", c.shape(), &[rows, dim], "[tokens, dim]")?;
    expect_shape("sin", n.shape(), &[rows, dim], "[tokens, dim]")?;
    expect_shape(
        "out",
        o.shape(),
        &[rows, heads, dim],
        "[tokens, heads, dim]",
    )?;
    let tables = [
        ("src", s.span()),
        ("cos", bytes(c.data(), c.len())),
        ("sin", bytes(n.data(), n.len())),
    ];
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
        threads,
    };
    let out = o.elems();
    py.detach(|| fused::rope(&a, out)).map_err(to_py)
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
    let row: usize = d.shape().iter().skip(1).product();
    if d.shape().len() < 2 || row != width {
        return Err(invalid(
            "dst",
            format!(
                "dst must be [slots, width = {width}] (or [slots, kv_heads, dim]), not shape {:?}",
                d.shape()
            ),
        ));
    }
    let ins = [("src", s.span()), ("slots", bytes(sl.data(), sl.len()))];
    disjoint("dst", d.span(), &ins)?;
    let a = WriteRows {
        src: s.elems(),
        src_width,
        col_offset,
        width,
        slots: sl.as_slice().unwrap_or_default(),
    };
    let dst = d.elems();
    py.detach(|| fused::write_rows(&a, dst)).map_err(to_py)
}
