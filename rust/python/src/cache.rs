//! Python objects built once and handed out again: a plan's or output's attributes (built
//! on first access), and the tuple of request-id strings a steady step repeats.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString, PyTuple};

/// The object in `cell`, built by `make` on first access.
pub fn cached<T>(py: Python<'_>, cell: &PyOnceLock<Py<T>>, make: impl FnOnce() -> Py<T>) -> Py<T> {
    cell.get_or_init(py, make).clone_ref(py)
}

/// The request-id tuple as a list, built on first access and cached in `cell`.
pub fn names_list(
    py: Python<'_>,
    cell: &PyOnceLock<Py<PyList>>,
    names: &Py<PyTuple>,
) -> PyResult<Py<PyList>> {
    Ok(cell
        .get_or_try_init(py, || {
            PyList::new(py, names.bind(py).iter()).map(Bound::unbind)
        })?
        .clone_ref(py))
}

/// A tuple of request-id strings and the (slot, generation) keys it was built from.
#[derive(Default)]
pub struct NameCache {
    keys: Vec<u64>,
    scratch: Vec<u64>,
    tuple: Option<Py<PyTuple>>,
}

impl NameCache {
    /// As `get`, but when the caller knows the slots are the ones of the last call
    /// (`same`), the cached tuple is returned without comparing keys.
    pub fn get_or_same(
        &mut self,
        py: Python<'_>,
        same: bool,
        slots: impl Iterator<Item = u32>,
        names: &[Option<Py<PyString>>],
        gens: &[u32],
    ) -> PyResult<Py<PyTuple>> {
        if same {
            if let Some(t) = &self.tuple {
                return Ok(t.clone_ref(py));
            }
        }
        self.get(py, slots, names, gens)
    }

    /// The names of `slots` (slab indices; `gens` tells reused slots apart): the cached
    /// tuple when the keys equal the last call's, else a new one.
    pub fn get(
        &mut self,
        py: Python<'_>,
        slots: impl Iterator<Item = u32>,
        names: &[Option<Py<PyString>>],
        gens: &[u32],
    ) -> PyResult<Py<PyTuple>> {
        self.scratch.clear();
        self.scratch
            .extend(slots.map(|i| ((i as u64) << 32) | gens[i as usize] as u64));
        if let Some(t) = &self.tuple {
            if self.scratch == self.keys {
                return Ok(t.clone_ref(py));
            }
        }
        let t = PyTuple::new(
            py,
            self.scratch
                .iter()
                .map(|&k| names[(k >> 32) as usize].as_ref().expect("named").bind(py)),
        )?
        .unbind();
        std::mem::swap(&mut self.keys, &mut self.scratch);
        self.tuple = Some(t.clone_ref(py));
        Ok(t)
    }
}
