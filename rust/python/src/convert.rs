//! Python arguments to core values and core buffers to numpy arrays. Every argument error
//! is a `FieldError` naming the argument.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::errors::invalid;

/// Token ids from any int sequence (list, tuple, numpy array), validated to int32 >= 0.
/// Messages name the argument `arg`; the error's field is `field` (the core's name for it).
pub fn tokens_from(obj: &Bound<'_, PyAny>, arg: &str, field: &'static str) -> PyResult<Vec<u32>> {
    let negative = |t: i64| invalid(field, format!("{arg} must be non-negative int32 (got {t})"));
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        let ro = a.readonly();
        let s = ro.as_array();
        let mut v = Vec::with_capacity(s.len());
        for &t in s.iter() {
            if t < 0 {
                return Err(negative(t.into()));
            }
            v.push(t as u32);
        }
        return Ok(v);
    }
    if obj.is_instance_of::<PyString>() {
        return Err(invalid(
            field,
            format!("{arg} must be a sequence of ints, not str"),
        ));
    }
    let raw: Vec<i64> = obj
        .extract()
        .map_err(|_| invalid(field, format!("{arg} must be a sequence of ints")))?;
    raw.into_iter()
        .map(|t| {
            if (0..=i32::MAX as i64).contains(&t) {
                Ok(t as u32)
            } else {
                Err(negative(t))
            }
        })
        .collect()
}

/// Stop sequences: an iterable of token-id sequences (errors name `field`).
pub fn sequences_from(obj: &Bound<'_, PyAny>, field: &'static str) -> PyResult<Vec<Vec<u32>>> {
    let it = obj.try_iter().map_err(|_| {
        invalid(
            field,
            format!("{field} must be a sequence of token-id sequences"),
        )
    })?;
    it.map(|item| tokens_from(&item?, field, field)).collect()
}

/// A non-negative count.
pub fn usize_arg(v: i64, field: &'static str) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| {
        invalid(
            field,
            format!("{field} must be a non-negative int (got {v})"),
        )
    })
}

/// Calls `f` with token ids as int32: a C-contiguous int32 array is read in place; other
/// int32 arrays, int64 arrays and int sequences are checked to be non-negative int32 and
/// copied.
pub fn with_tokens_i32<R>(
    obj: &Bound<'_, PyAny>,
    field: &'static str,
    f: impl FnOnce(&[i32]) -> R,
) -> PyResult<R> {
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        let ro = a.readonly();
        return Ok(match ro.as_slice() {
            Ok(s) => f(s),
            Err(_) => f(&ro.as_array().iter().copied().collect::<Vec<i32>>()),
        });
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        let ro = a.readonly();
        return Ok(f(&checked_i32(ro.as_array().iter().copied(), field)?));
    }
    if obj.is_instance_of::<PyString>() {
        return Err(invalid(
            field,
            format!("{field} must be a sequence of ints"),
        ));
    }
    let raw: Vec<i64> = obj.extract().map_err(|_| {
        invalid(
            field,
            format!("{field} must be an int32 array or a sequence of ints"),
        )
    })?;
    Ok(f(&checked_i32(raw.into_iter(), field)?))
}

/// `values` as int32, each checked to be in `0..=i32::MAX`.
fn checked_i32(
    values: impl ExactSizeIterator<Item = i64>,
    field: &'static str,
) -> PyResult<Vec<i32>> {
    let mut v = Vec::with_capacity(values.len());
    for t in values {
        if !(0..=i32::MAX as i64).contains(&t) {
            return Err(invalid(
                field,
                format!("{field} must be non-negative int32 (got {t})"),
            ));
        }
        v.push(t as i32);
    }
    Ok(v)
}

/// A fresh int32 array holding `v`.
pub fn arr1<'py>(py: Python<'py>, v: &[i32]) -> Bound<'py, PyArray1<i32>> {
    PyArray1::from_slice(py, v)
}

/// A fresh C-contiguous int32 array [rows, cols] holding `v` (row-major).
pub fn arr2<'py>(
    py: Python<'py>,
    v: &[i32],
    rows: usize,
    cols: usize,
) -> Bound<'py, PyArray2<i32>> {
    let a = PyArray2::<i32>::zeros(py, [rows, cols], false);
    if !v.is_empty() {
        let mut rw = a.readwrite();
        rw.as_slice_mut()
            .expect("fresh C-contiguous array")
            .copy_from_slice(v);
    }
    a
}
