//! Core errors as Python exceptions: `ErrorKind::Value` → `ferrobatch.errors.FieldError`
//! (a `ValueError` subclass whose `.field` names the argument), `ErrorKind::Runtime` →
//! `RuntimeError`. The kernels' one error type (`KernelError`) and the bindings' own
//! argument checks raise `FieldError` the same way.

use ferrobatch_core::{Error, ErrorKind};
use ferrobatch_kernels::KernelError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// `ferrobatch.errors.FieldError`, imported on the first error and kept.
static FIELD_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `FieldError(message, field)` (the import's error if `ferrobatch.errors` cannot be loaded).
pub fn field_error(field: Option<&'static str>, message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(
        |py| match FIELD_ERROR.import(py, "ferrobatch.errors", "FieldError") {
            Ok(ty) => PyErr::from_type(ty.clone(), (message, field)),
            Err(e) => e,
        },
    )
}

/// A bad value of the argument `field`.
pub fn invalid(field: &'static str, message: impl Into<String>) -> PyErr {
    field_error(Some(field), message)
}

/// A core error as its Python exception.
pub fn to_py(e: Error) -> PyErr {
    match e.kind {
        ErrorKind::Value => field_error(e.field(), e.message),
        ErrorKind::Runtime => PyRuntimeError::new_err(e.message),
    }
}

/// A kernel's error as `FieldError(message, field)`: the argument it names (None where the
/// arguments do not fit together) and its message.
pub fn kernel_error(e: KernelError) -> PyErr {
    field_error(e.field(), e.to_string())
}
