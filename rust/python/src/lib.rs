//! PyO3 layer of ferrobatch: every decision about memory and order lives in
//! `ferrobatch-core`; this crate converts arguments (validated, errors as
//! `ferrobatch.errors.FieldError` naming the argument), owns the Python objects that cross,
//! and keeps the crossing cheap:
//! * each request id is kept as the caller's `str` object (one incref, created once), and
//!   the tuple of a plan's / output's ids is reused while the rows repeat ([`cache`]);
//! * plan arrays are copied from the core's buffers into fresh numpy arrays (a memcpy each;
//!   the arrays the caller gets are its own), built on first access and cached;
//!   a dropped plan's or output's buffers go back to the scheduler ([`recycle`]);
//! * `StepOutput` deltas are built lazily in `__getitem__`; the engine reads the array views;
//! * the GIL is *not* released in `schedule()`/`update()`: they take microseconds, while
//!   re-acquiring a contended GIL can take a whole switch interval (5 ms). The CPU kernels
//!   ([`kernels`], [`fused`], [`select`]) release it.
//!
//! Module map: [`scheduler`] (`Scheduler`), [`plan`] (`StepPlan`), [`output`]
//! (`StepOutput`, `Delta`), [`config`] (the constructor's arguments), [`convert`]
//! (arguments in, arrays out), [`errors`] (core errors as exceptions), [`table`]
//! (`table_columns`, `slots`), [`kernels`] (`paged_decode_attention`,
//! `paged_prefill_attention`), [`fused`]
//! (`rms_norm`, `silu_mul`, `rope`, `write_rows`), [`amx`] / [`f32_linear`] (packed
//! products), [`select`] (`greedy_select`,
//! `greedy_pick`, `row_norms`), [`openmp`] (`share_openmp`: the kernels' threads on torch's
//! OpenMP runtime); the constants
//! `ZERO_CHUNK`, `SCRATCH_CHUNK`. The stub `python/ferrobatch/_core.pyi` describes the module.

mod amx;
mod cache;
mod config;
mod convert;
mod errors;
mod f32_linear;
mod fused;
mod kernels;
mod layer;
mod moe;
mod openmp;
mod output;
mod plan;
mod quant;
mod recycle;
mod scheduler;
mod select;
mod table;
mod views;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<scheduler::Scheduler>()?;
    m.add_class::<plan::StepPlan>()?;
    m.add_class::<output::StepOutput>()?;
    m.add_class::<output::Delta>()?;
    m.add_function(wrap_pyfunction!(table::table_columns, m)?)?;
    m.add_function(wrap_pyfunction!(table::slots, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::paged_prefill_attention, m)?)?;
    m.add_function(wrap_pyfunction!(fused::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(layer::lean_layers_forward, m)?)?;
    m.add_function(wrap_pyfunction!(fused::silu_mul, m)?)?;
    m.add_function(wrap_pyfunction!(fused::rope, m)?)?;
    m.add_function(wrap_pyfunction!(fused::write_rows, m)?)?;
    m.add_function(wrap_pyfunction!(fused::write_rows_int8, m)?)?;
    m.add_function(wrap_pyfunction!(amx::amx_available, m)?)?;
    m.add_function(wrap_pyfunction!(amx::amx_backend, m)?)?;
    m.add_function(wrap_pyfunction!(amx::amx_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(amx::amx_pack, m)?)?;
    m.add_function(wrap_pyfunction!(amx::amx_linear, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::f32_linear_available, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::f32_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::f32_pack, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::f32_linear, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::f32_pack_half, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::f32_pack_bf16_exact, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::f32_linear_half, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::f32_unpack_half, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::i16_linear_available, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::i16_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::i16_pack, m)?)?;
    m.add_function(wrap_pyfunction!(f32_linear::i16_linear, m)?)?;
    m.add_class::<layer::LeanLayer>()?;
    m.add_class::<moe::QuantExperts>()?;
    quant::register(m)?;
    m.add_function(wrap_pyfunction!(openmp::share_openmp, m)?)?;
    m.add_function(wrap_pyfunction!(select::greedy_select, m)?)?;
    m.add_function(wrap_pyfunction!(select::greedy_pick, m)?)?;
    m.add_function(wrap_pyfunction!(select::row_norms, m)?)?;
    m.add("ZERO_CHUNK", ferrobatch_core::ZERO_CHUNK)?;
    m.add("SCRATCH_CHUNK", ferrobatch_core::SCRATCH_CHUNK)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
