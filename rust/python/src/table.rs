//! Block-table arithmetic for Python, the core's rule vectorised: `table_columns` (the column
//! that holds each key position) and `slots` (the cache slot of each (row, position)).
//! numpy in, int64 numpy out, every index bounds-checked. The GIL is kept: a call costs about
//! a nanosecond per entry, far less than re-acquiring a contended GIL.

use ferrobatch_core::table_column;
use numpy::ndarray::ArrayView1;
use numpy::{PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid;

/// A 1-D int32 or int64 array, read as i64.
enum Ints<'py> {
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
}

impl<'py> Ints<'py> {
    fn from(obj: &Bound<'py, PyAny>, field: &'static str) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, i64>>() {
            return Ok(Ints::I64(a));
        }
        obj.extract::<PyReadonlyArray1<'py, i32>>()
            .map(Ints::I32)
            .map_err(|_| invalid(field, format!("{field} must be a 1-D int32 or int64 array")))
    }
    fn len(&self) -> usize {
        match self {
            Ints::I32(a) => a.len(),
            Ints::I64(a) => a.len(),
        }
    }
    /// Each entry as a non-negative index (a `FieldError` naming `field` otherwise).
    fn indices(&self, field: &'static str) -> PyResult<Vec<usize>> {
        fn collect<T: Copy + Into<i64>>(
            v: ArrayView1<'_, T>,
            field: &'static str,
        ) -> PyResult<Vec<usize>> {
            v.iter()
                .map(|&x| {
                    let x: i64 = x.into();
                    usize::try_from(x)
                        .map_err(|_| invalid(field, format!("{field} must be >= 0 (got {x})")))
                })
                .collect()
        }
        match self {
            Ints::I32(a) => collect(a.as_array(), field),
            Ints::I64(a) => collect(a.as_array(), field),
        }
    }
}

/// A 2-D int32 or int64 block table.
enum Table<'py> {
    I32(PyReadonlyArray2<'py, i32>),
    I64(PyReadonlyArray2<'py, i64>),
}

impl<'py> Table<'py> {
    fn from(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray2<'py, i32>>() {
            return Ok(Table::I32(a));
        }
        obj.extract::<PyReadonlyArray2<'py, i64>>()
            .map(Table::I64)
            .map_err(|_| {
                invalid(
                    "table",
                    "table must be a 2-D int32 or int64 array [rows, width]",
                )
            })
    }
    fn shape(&self) -> (usize, usize) {
        let s = match self {
            Table::I32(a) => a.shape(),
            Table::I64(a) => a.shape(),
        };
        (s[0], s[1])
    }
    fn get(&self, row: usize, col: usize) -> i64 {
        match self {
            Table::I32(a) => a.as_array()[[row, col]].into(),
            Table::I64(a) => a.as_array()[[row, col]],
        }
    }
}

/// `page_size` >= 1 and `ring` None or >= 1, as the core's types.
fn geometry(page_size: i64, ring: Option<i64>) -> PyResult<(usize, Option<usize>)> {
    let page = usize::try_from(page_size)
        .ok()
        .filter(|&p| p >= 1)
        .ok_or_else(|| {
            invalid(
                "page_size",
                format!("page_size must be >= 1 (got {page_size})"),
            )
        })?;
    let ring = ring
        .map(|r| {
            usize::try_from(r)
                .ok()
                .filter(|&r| r >= 1)
                .ok_or_else(|| invalid("ring", format!("ring must be None or >= 1 (got {r})")))
        })
        .transpose()?;
    Ok((page, ring))
}

/// int64 [n]: the block-table column that holds each key position: `p // page_size`, or
/// `(p // page_size) % ring` in a sliding ring of `ring` chunks (`ring=None`: full attention).
#[pyfunction]
#[pyo3(signature = (positions, page_size, ring))]
pub fn table_columns<'py>(
    py: Python<'py>,
    positions: &Bound<'py, PyAny>,
    page_size: i64,
    ring: Option<i64>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let (page, ring) = geometry(page_size, ring)?;
    let pos = Ints::from(positions, "positions")?.indices("positions")?;
    let cols: Vec<i64> = pos
        .into_iter()
        .map(|p| table_column(p, page, ring) as i64)
        .collect();
    Ok(PyArray1::from_vec(py, cols))
}

/// int64 [n]: the cache slot of key `positions[i]` of table row `rows[i]`:
/// `table[rows, table_columns(positions, page_size, ring)] * page_size + positions % page_size`.
#[pyfunction]
#[pyo3(signature = (table, rows, positions, page_size, ring))]
pub fn slots<'py>(
    py: Python<'py>,
    table: &Bound<'py, PyAny>,
    rows: &Bound<'py, PyAny>,
    positions: &Bound<'py, PyAny>,
    page_size: i64,
    ring: Option<i64>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let (page, ring) = geometry(page_size, ring)?;
    let table = Table::from(table)?;
    let (num_rows, width) = table.shape();
    let rows = Ints::from(rows, "rows")?;
    let positions = Ints::from(positions, "positions")?;
    if rows.len() != positions.len() {
        return Err(invalid(
            "positions",
            format!(
                "positions has {} entries but rows has {}",
                positions.len(),
                rows.len()
            ),
        ));
    }
    let rows = rows.indices("rows")?;
    let positions = positions.indices("positions")?;
    let mut out = Vec::with_capacity(rows.len());
    for (&r, &p) in rows.iter().zip(&positions) {
        if r >= num_rows {
            return Err(invalid(
                "rows",
                format!("row {r} is out of range for a table of {num_rows} rows"),
            ));
        }
        let c = table_column(p, page, ring);
        if c >= width {
            return Err(invalid(
                "positions",
                format!("position {p} is in column {c} but the table has {width} columns"),
            ));
        }
        out.push(table.get(r, c) * page as i64 + (p % page) as i64);
    }
    Ok(PyArray1::from_vec(py, out))
}
