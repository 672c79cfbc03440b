//! `Scheduler(...)`'s arguments to the core's `SchedulerConfig` (the bindings check only
//! what the Rust types cannot hold, negative counts; the core checks the values).

use ferrobatch_core::{AttentionType, SchedulerConfig, SchedulerType};
use pyo3::prelude::*;

use crate::convert::usize_arg;
use crate::errors::to_py;

/// The constructor's arguments as Python passed them.
pub struct ConfigArgs<'a> {
    pub num_blocks: i64,
    pub page_size: i64,
    pub max_batch_tokens: i64,
    pub max_requests_per_batch: i64,
    pub scheduler_type: &'a str,
    pub safety_margin: Option<f64>,
    pub allow_block_sharing: bool,
    pub defer_shared_prefixes: bool,
    pub layer_types: Option<Vec<String>>,
    pub sliding_window: Option<i64>,
    pub cpu_offload_blocks: i64,
    pub max_batch_cache_tokens: Option<i64>,
    pub priority_preemption: bool,
    pub max_step_ms: Option<f64>,
}

impl ConfigArgs<'_> {
    /// The core's config (`layer_types=None` means one full-attention group); a negative
    /// count or an unknown name is a `FieldError` naming the argument.
    pub fn to_config(&self) -> PyResult<SchedulerConfig> {
        let layer_types = match &self.layer_types {
            None => vec![AttentionType::Full],
            Some(v) => v
                .iter()
                .map(|s| AttentionType::parse(s))
                .collect::<ferrobatch_core::Result<Vec<_>>>()
                .map_err(to_py)?,
        };
        Ok(SchedulerConfig {
            num_blocks: usize_arg(self.num_blocks, "num_blocks")?,
            page_size: usize_arg(self.page_size, "page_size")?,
            max_batch_tokens: usize_arg(self.max_batch_tokens, "max_batch_tokens")?,
            max_requests_per_batch: usize_arg(
                self.max_requests_per_batch,
                "max_requests_per_batch",
            )?,
            max_batch_cache_tokens: self
                .max_batch_cache_tokens
                .map(|v| usize_arg(v, "max_batch_cache_tokens"))
                .transpose()?,
            scheduler_type: SchedulerType::parse(self.scheduler_type).map_err(to_py)?,
            safety_margin: self.safety_margin,
            allow_block_sharing: self.allow_block_sharing,
            defer_shared_prefixes: self.defer_shared_prefixes,
            layer_types,
            sliding_window: self
                .sliding_window
                .map(|v| usize_arg(v, "sliding_window"))
                .transpose()?,
            cpu_offload_blocks: usize_arg(self.cpu_offload_blocks, "cpu_offload_blocks")?,
            priority_preemption: self.priority_preemption,
            max_step_ms: self.max_step_ms,
            hash_mask: u64::MAX,
        })
    }
}
