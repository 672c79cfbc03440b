//! CPU kernels of ferrobatch. They work on plain slices (the PyO3 layer hands them numpy
//! views of torch tensors), check every index they read before reading it, and keep no
//! state: the scheduling core (`ferrobatch-core`) stays tensor-free.
//!
//! * [`decode`]: attention of single-token (decode) rows over the paged KV cache, read in
//!   place through the block tables (no gather), fp32 scores, softmax and accumulation.

pub mod decode;
pub mod fused;
pub mod select;

pub use decode::{paged_decode_attention, DecodeArgs, Elems, ElemsMut, KernelError, Window};
pub use select::{pick_best, row_norms, select_candidates, Candidates, Scores, SelectArgs};
