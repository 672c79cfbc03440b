//! ferrobatch-core: every decision about KV memory and request order.
//!
//! Pure Rust (no pyo3, no tensors). The bindings (`rust/python`) convert types, reuse the
//! plan and output buffers between steps and cache request-name objects; they decide
//! nothing. See `ARCHITECTURE.md` §2–§4 for the memory model and the per-step contract.
//!
//! Module map:
//! * [`pool`]: chunk pool (free lists, refcounts, reserved chunks, cached-LRU list, prefix
//!   hash table and [`pool::ChunkPool::lookup`], the token-verified lookup of one block).
//! * [`prefix`]: chained block hashing (hashes only find candidates; `lookup` verifies).
//! * [`alloc`]: block arithmetic of the full-attention allocator and the sliding ring,
//!   [`alloc::table_column`].
//! * [`kv`]: [`kv::KvManager`], the one owner of KV memory: the only caller of the pool's
//!   and the swap pool's mutating methods.
//! * [`request`]: request state, token ids, stop conditions.
//! * [`swap`]: CPU swap-slot allocator.
//! * [`plan`]: the step plan buffers (reused between steps) and the step output.
//! * [`scheduler`]: budgets, admission, chunked prefill, preemption, plan building, update
//!   (a module tree by concern, see its docs).

pub mod alloc;
pub mod kv;
pub mod plan;
pub mod pool;
pub mod prefix;
pub mod request;
pub mod scheduler;
pub mod swap;

pub(crate) mod hint {
    /// Prefetch hint for the cache line at `p` (no-op off x86_64).
    #[inline(always)]
    pub fn prefetch<T>(p: *const T) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `prefetcht0` is only a hint: it never faults, has no architectural effect
        // and does not access memory in the Rust-semantics sense, so any address (even a
        // dangling or one-past-the-end pointer, as created here with `wrapping_add`) is fine.
        // SSE is part of the x86_64 baseline, so the target feature is always available.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

/// Chunk ids viewed as the plan's `int32` entries, without a copy. Ids are below
/// `i32::MAX` (the scheduler rejects pools whose slots would not fit in int32), so each value
/// reads the same as either type.
#[inline]
pub(crate) fn chunk_ids_as_i32(ids: &[ChunkId]) -> &[i32] {
    // SAFETY: `u32` and `i32` have the same size and alignment and every bit pattern is a
    // valid `i32`, so the pointer is valid and aligned for `ids.len()` `i32`s; the returned
    // slice borrows `ids` (same lifetime, shared), so the memory is neither freed nor
    // mutated while it is alive.
    unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<i32>(), ids.len()) }
}

pub use alloc::table_column;
pub use plan::{StepOutput, StepPlan};
pub use pool::{SCRATCH_CHUNK, ZERO_CHUNK};
pub use request::{FinishReason, RequestState};
pub use scheduler::{AttentionType, Scheduler, SchedulerConfig, SchedulerType, Stats};

/// Token id as stored by the core (validated non-negative `int32` at the boundary).
pub type Token = u32;
/// Chunk id (index into the device KV pool, `0 .. num_blocks + 2`).
pub type ChunkId = u32;

/// Kind of error, mapped by the bindings to `ValueError` / `RuntimeError`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A bad argument (maps to `ValueError`).
    Value,
    /// A call at the wrong time or a broken invariant (maps to `RuntimeError`).
    Runtime,
}

/// Error with a message that names the offending field or invariant.
///
/// `field` is the argument a `Value` error is about (`"max_new_tokens"`, `"page_size"`, ...),
/// as the caller spelled it; the bindings raise it as `ferrobatch.errors.FieldError` with
/// `.field` set, and the server reports it as OpenAI's `param`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub field: Option<&'static str>,
    pub message: String,
}

impl Error {
    /// A bad value of the argument `field`; the message should say what was wrong with it.
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::Value,
            field: Some(field),
            message: message.into(),
        }
    }
    /// A call at the wrong time or a broken invariant.
    pub fn runtime(message: impl Into<String>) -> Self {
        Error {
            kind: ErrorKind::Runtime,
            field: None,
            message: message.into(),
        }
    }
    /// The argument this error is about, if any.
    pub fn field(&self) -> Option<&'static str> {
        self.field
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
