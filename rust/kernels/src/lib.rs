//! CPU kernels of ferrobatch. They work on plain slices (the PyO3 layer hands them numpy
//! views of torch tensors), check every index they read before reading it, and keep no
//! state: the scheduling core (`ferrobatch-core`) stays tensor-free.
//!
//! * [`linear`]: what every product over a packed weight shares (its shapes
//!   [`LinearArgs`], packed layouts, argument checks, the output its threads share, the
//!   panel pass); the product modules below depend on it and on no other product module;
//! * [`amx`]: bf16 matrix products with f32 outputs (weights packed once) on the AMX tiles,
//!   or with AVX-512 BF16 (its `dpbf16` backend) where the CPU has no AMX;
//! * [`f32_linear`]: f32 matrix products on AVX-512F over weights packed once (rows never
//!   depend on their batch);
//! * [`i16_linear`]: exact i16 products into i32 on AVX-512 VNNI over the same packing
//!   (the greedy head's int16 screen);
//! * [`decode`]: attention of single-token (decode) rows over the paged KV cache, read in
//!   place through the block tables (no gather), fp32 scores, softmax and accumulation;
//! * [`prefill`]: causal attention of multi-token (prefill) rows over the same paged cache,
//!   in place, tiled flash-style (a block of keys reused by a tile of query rows, online
//!   softmax in fp32);
//! * [`fused`]: the elementwise work of a lean decoder layer in one pass each (RMSNorm with
//!   the residual add, SiLU * up, rotary embeddings, rows written at cache slots);
//! * [`layer`]: a whole Llama-style decoder layer of decode rows in one call (the parts
//!   above, in the Python lean layer's order and roundings);
//! * [`select`]: the greedy head's candidate selection over screened scores (exact bounds),
//!   the per-row best candidate and the rows' norms;
//! * [`parallel`]: where the pieces of a call run (scoped threads, or a pool the host
//!   registers, such as the OpenMP runtime torch runs);
//! * [`error`]: [`KernelError`], the one error type of every kernel;
//! * [`isa`]: the instruction sets the kernels use, detected at run time, and the gate of
//!   the tests that need one (`FERROBATCH_REQUIRE_ISA`).

pub mod amx;
mod asm;
pub mod decode;
pub mod error;
pub mod f32_linear;
pub mod fused;
pub mod i16_linear;
pub mod isa;
pub mod layer;
pub mod linear;
pub mod moe;
pub mod parallel;
pub mod prefill;
pub mod quant;
pub mod select;

pub use decode::{paged_decode_attention, DecodeArgs, Elems, ElemsMut, Window};
pub use error::{Expected, KernelError};
pub use linear::LinearArgs;
pub use parallel::{set_pool, Pool};
pub use prefill::{paged_prefill_attention, PrefillArgs};
pub use select::{pick_best, row_norms, select_candidates, Candidates, Scores, SelectArgs};
