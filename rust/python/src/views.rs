//! Numpy views of torch tensors for the kernels' bindings: a dtype string names the storage
//! (f32 as `float32`, bf16 / fp16 as `uint16` bit patterns); arrays are taken C-contiguous
//! and borrowed (read-only, or writable and exclusive), and an output that shares memory
//! with an input is refused (`disjoint`: numpy cannot see that two views of one torch tensor
//! alias). Every error is a `FieldError` naming the argument. The products' bindings
//! (`amx.rs`, `f32_linear.rs`) share their packing and their `x` / `out` checks here too.

use ferrobatch_kernels::{Elems, ElemsMut, KernelError};
use numpy::{
    Element, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use std::ops::Range;

use crate::errors::{invalid, kernel_error};

/// Storage named by a dtype string.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ty {
    F32,
    Bf16,
    F16,
}

/// `dtype` (the value of the argument `field`) as a storage type.
pub(crate) fn ty(dtype: &str, field: &'static str) -> PyResult<Ty> {
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
pub(crate) fn ro<'py, T: Element>(
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
pub(crate) fn rw<'py, T: Element>(
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
pub(crate) enum In<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    U16(PyReadonlyArrayDyn<'py, u16>, Ty),
}

impl<'py> In<'py> {
    pub(crate) fn new(a: &Bound<'py, PyAny>, t: Ty, field: &'static str) -> PyResult<Self> {
        Ok(match t {
            Ty::F32 => In::F32(ro(a, field, storage(t))?),
            _ => In::U16(ro(a, field, storage(t))?, t),
        })
    }
    pub(crate) fn shape(&self) -> &[usize] {
        match self {
            In::F32(a) => a.shape(),
            In::U16(a, _) => a.shape(),
        }
    }
    pub(crate) fn span(&self) -> Range<usize> {
        match self {
            In::F32(a) => bytes(a.data(), a.len()),
            In::U16(a, _) => bytes(a.data(), a.len()),
        }
    }
    pub(crate) fn elems(&self) -> Elems<'_> {
        // contiguity was checked in `ro`, so `as_slice` cannot fail
        match self {
            In::F32(a) => Elems::F32(a.as_slice().unwrap_or_default()),
            In::U16(a, Ty::Bf16) => Elems::Bf16(a.as_slice().unwrap_or_default()),
            In::U16(a, _) => Elems::F16(a.as_slice().unwrap_or_default()),
        }
    }
}

/// A writable array of one of the storage types.
pub(crate) enum Out<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    U16(PyReadwriteArrayDyn<'py, u16>, Ty),
}

impl<'py> Out<'py> {
    pub(crate) fn new(a: &Bound<'py, PyAny>, t: Ty, field: &'static str) -> PyResult<Self> {
        Ok(match t {
            Ty::F32 => Out::F32(rw(a, field, storage(t))?),
            _ => Out::U16(rw(a, field, storage(t))?, t),
        })
    }
    pub(crate) fn shape(&self) -> &[usize] {
        match self {
            Out::F32(a) => a.shape(),
            Out::U16(a, _) => a.shape(),
        }
    }
    pub(crate) fn span(&self) -> Range<usize> {
        match self {
            Out::F32(a) => bytes(a.data(), a.len()),
            Out::U16(a, _) => bytes(a.data(), a.len()),
        }
    }
    pub(crate) fn elems(&mut self) -> ElemsMut<'_> {
        // contiguity was checked in `rw`, so `as_slice_mut` cannot fail
        match self {
            Out::F32(a) => ElemsMut::F32(a.as_slice_mut().unwrap_or_default()),
            Out::U16(a, Ty::Bf16) => ElemsMut::Bf16(a.as_slice_mut().unwrap_or_default()),
            Out::U16(a, _) => ElemsMut::F16(a.as_slice_mut().unwrap_or_default()),
        }
    }
}

/// The bytes `n` elements from `p` occupy.
pub(crate) fn bytes<T>(p: *mut T, n: usize) -> Range<usize> {
    let start = p as usize;
    start..start + n * std::mem::size_of::<T>()
}

/// The bytes a borrowed numpy array occupies (for `disjoint`).
pub(crate) trait Span {
    fn span(&self) -> Range<usize>;
}

impl<T: Element> Span for PyReadonlyArrayDyn<'_, T> {
    fn span(&self) -> Range<usize> {
        bytes(self.data(), self.len())
    }
}

impl<T: Element> Span for PyReadwriteArrayDyn<'_, T> {
    fn span(&self) -> Range<usize> {
        bytes(self.data(), self.len())
    }
}

/// The elements of a C-contiguous array (an error naming `field` for any other layout,
/// Fortran order included: `as_slice` takes it, and the kernel would read it transposed).
pub(crate) fn c_slice<'a, T: Element>(
    a: &'a PyReadonlyArrayDyn<'_, T>,
    field: &'static str,
) -> PyResult<&'a [T]> {
    let contiguous = || invalid(field, format!("{field} must be C-contiguous"));
    if !a.is_c_contiguous() {
        return Err(contiguous());
    }
    a.as_slice().map_err(|_| contiguous())
}

/// An error naming `out` when its memory overlaps one of `inputs` (numpy cannot see that two
/// views of one torch tensor alias, and the kernels do not work in place).
pub(crate) fn disjoint(
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
pub(crate) fn expect_shape(
    field: &'static str,
    shape: &[usize],
    want: &[usize],
    what: &str,
) -> PyResult<()> {
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
pub(crate) fn two_d(field: &'static str, shape: &[usize], what: &str) -> PyResult<(usize, usize)> {
    match *shape {
        [r, c] => Ok((r, c)),
        _ => Err(invalid(
            field,
            format!("{field} must be 2-D {what}, not shape {shape:?}"),
        )),
    }
}

/// A non-negative integer argument.
pub(crate) fn count(v: i64, field: &'static str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(field, format!("{field} must be >= 0, not {v}")))
}

pub(crate) fn threads_of(v: i64) -> PyResult<usize> {
    match count(v, "threads")? {
        0 => Err(invalid("threads", "threads must be >= 1")),
        n => Ok(n),
    }
}

/// `weight` [n, k] of `T` (numpy `dtype` `weight_is`) packed by `pack` (a kernel's
/// `pack(weight, n, k, out)`) into `out` (numpy `dtype` `out_is`), the GIL released.
pub(crate) fn pack_with<T: Element + Send + Sync>(
    py: Python<'_>,
    (weight, weight_is): (&Bound<'_, PyAny>, &str),
    (out, out_is): (&Bound<'_, PyAny>, &str),
    pack: impl FnOnce(&[T], usize, usize, &mut [T]) -> Result<(), KernelError> + Send,
) -> PyResult<()> {
    let w = ro::<T>(weight, "weight", weight_is)?;
    let (n, k) = two_d("weight", w.shape(), "[out_features, in_features]")?;
    let mut o = rw::<T>(out, "out", out_is)?;
    let (w, o) = (w.as_slice()?, o.as_slice_mut()?);
    py.detach(|| pack(w, n, k, o)).map_err(kernel_error)
}

/// The rows `m` of a product's `x` [m, k] (a 2-D array of `k` columns).
pub(crate) fn product_rows(x: &[usize], k: usize) -> PyResult<usize> {
    let (m, xk) = two_d("x", x, "[rows, in_features]")?;
    if xk != k {
        return Err(invalid("x", format!("x has {xk} columns, not k = {k}")));
    }
    Ok(m)
}

/// Checks a product's `out` ([m, n]: `shape`, the bytes `span`) against its `x` (the bytes
/// `x`): the shape, and no overlap.
pub(crate) fn product_out(
    (shape, span): (&[usize], Range<usize>),
    m: usize,
    n: usize,
    x: Range<usize>,
) -> PyResult<()> {
    expect_shape("out", shape, &[m, n], "[rows, out_features]")?;
    disjoint("out", span, &[("x", x)])
}
