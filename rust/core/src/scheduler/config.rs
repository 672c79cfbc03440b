//! Scheduler configuration and its validation: each value is checked once, here, with one
//! minimum, and every error names the field as the Python `Scheduler(...)` spells it.

use crate::alloc::Layout;
use crate::{Error, Result};

/// Scheduling policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerType {
    /// Decodes, then in-flight prefills, then new requests.
    Fifo,
    /// In-flight prefills, then decodes, then new requests.
    PrefillFirst,
}

impl SchedulerType {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "fifo" => Ok(SchedulerType::Fifo),
            "prefill_first" => Ok(SchedulerType::PrefillFirst),
            _ => Err(Error::invalid(
                "scheduler_type",
                format!("scheduler_type must be 'fifo' or 'prefill_first' (got {s:?})"),
            )),
        }
    }
}

/// Attention type of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionType {
    Full,
    Sliding,
}

impl AttentionType {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "full_attention" => Ok(AttentionType::Full),
            "sliding_attention" => Ok(AttentionType::Sliding),
            _ => Err(Error::invalid(
                "layer_types",
                format!(
                    "layer_types entries must be 'full_attention' or 'sliding_attention' (got {s:?})"
                ),
            )),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            AttentionType::Full => "full_attention",
            AttentionType::Sliding => "sliding_attention",
        }
    }
}

/// Scheduler configuration (field names as in the Python `Scheduler(...)`).
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub page_size: usize,
    pub max_batch_tokens: usize,
    pub max_requests_per_batch: usize,
    /// Budget on the sum of `seqlens_k` of a step (None = unlimited).
    pub max_batch_cache_tokens: Option<usize>,
    pub scheduler_type: SchedulerType,
    /// None = default (0.15 fifo, 0.0 prefill_first).
    pub safety_margin: Option<f64>,
    pub allow_block_sharing: bool,
    /// Put a waiting request off one step when its next block is one a row of the step
    /// being planned fills, so it takes that block as a hit (in-batch prefix sharing; only
    /// with prefix caching).
    pub defer_shared_prefixes: bool,
    pub layer_types: Vec<AttentionType>,
    pub sliding_window: Option<usize>,
    pub cpu_offload_blocks: usize,
    /// Priority scheduling that preempts: a waiting or swapped request that does not fit
    /// preempts running requests of lower priority (`preemption::MAX_PRIORITY_PREEMPTIONS`
    /// bounds how often one request is preempted this way).
    pub priority_preemption: bool,
    /// Step-time budget (ms) for prefill chunks, from the cost model of measured steps
    /// (`report_step_time`); None = token budgets only. Binds only with `fifo` and when at
    /// least two requests are unfinished (see `scheduler::placement`).
    pub max_step_ms: Option<f64>,
    /// Testing only: mask applied to block hashes (shrink it to force twin hashes).
    pub hash_mask: u64,
}

impl SchedulerConfig {
    /// Defaults as in the Python signature.
    pub fn new(num_blocks: usize, page_size: usize, max_batch_tokens: usize) -> Self {
        SchedulerConfig {
            num_blocks,
            page_size,
            max_batch_tokens,
            max_requests_per_batch: 256,
            max_batch_cache_tokens: None,
            scheduler_type: SchedulerType::Fifo,
            safety_margin: None,
            allow_block_sharing: true,
            defer_shared_prefixes: true,
            layer_types: vec![AttentionType::Full],
            sliding_window: None,
            cpu_offload_blocks: 0,
            priority_preemption: false,
            max_step_ms: None,
            hash_mask: u64::MAX,
        }
    }
}

/// What a valid configuration implies.
pub(super) struct Derived {
    pub layout: Layout,
    /// Effective safety margin.
    pub margin: f64,
    /// Prefix caching is on.
    pub prefix: bool,
    /// Longest request lifetime (`prompt + max_new_tokens - 1` cached tokens) that fits.
    pub max_lifetime: usize,
}

/// Validate `cfg` (errors name the field) and derive the layout and limits.
pub(super) fn validate(cfg: &SchedulerConfig) -> Result<Derived> {
    at_least_one("num_blocks", cfg.num_blocks)?;
    at_least_one("page_size", cfg.page_size)?;
    if cfg.num_blocks > ((i32::MAX as usize) / cfg.page_size).saturating_sub(2) {
        return Err(Error::invalid(
            "num_blocks",
            "num_blocks: (num_blocks + 2) * page_size must fit in int32",
        ));
    }
    at_least_one("max_batch_tokens", cfg.max_batch_tokens)?;
    at_least_one("max_requests_per_batch", cfg.max_requests_per_batch)?;
    if let Some(c) = cfg.max_batch_cache_tokens {
        at_least_one("max_batch_cache_tokens", c)?;
    }
    if let Some(ms) = cfg.max_step_ms {
        if !ms.is_finite() || ms <= 0.0 {
            return Err(Error::invalid(
                "max_step_ms",
                format!("max_step_ms must be a finite number > 0 (got {ms})"),
            ));
        }
    }
    let margin = match cfg.safety_margin {
        Some(m) if !(0.0..1.0).contains(&m) || m.is_nan() => {
            return Err(Error::invalid(
                "safety_margin",
                format!("safety_margin must be in [0, 1) (got {m})"),
            ));
        }
        Some(m) => m,
        None => match cfg.scheduler_type {
            SchedulerType::Fifo => 0.15,
            SchedulerType::PrefillFirst => 0.0,
        },
    };
    if cfg.layer_types.is_empty() {
        return Err(Error::invalid(
            "layer_types",
            "layer_types must not be empty",
        ));
    }
    let has_full = cfg.layer_types.contains(&AttentionType::Full);
    let has_sliding = cfg.layer_types.contains(&AttentionType::Sliding);
    let window = if has_sliding {
        match cfg.sliding_window {
            Some(w) if w >= 1 => Some(w),
            Some(w) => {
                return Err(Error::invalid(
                    "sliding_window",
                    format!("sliding_window must be >= 1 (got {w})"),
                ))
            }
            None => {
                return Err(Error::invalid(
                    "sliding_window",
                    "sliding_window is required when layer_types has 'sliding_attention'",
                ))
            }
        }
    } else {
        None
    };
    let layout = Layout::new(cfg.page_size, has_full, window);
    Ok(Derived {
        layout,
        margin,
        prefix: cfg.allow_block_sharing && !has_sliding,
        max_lifetime: max_lifetime(cfg, &layout),
    })
}

/// A `Value` error naming `field` unless `value >= 1`.
fn at_least_one(field: &'static str, value: usize) -> Result<()> {
    if value < 1 {
        return Err(Error::invalid(
            field,
            format!("{field} must be >= 1 (got {value})"),
        ));
    }
    Ok(())
}

/// Longest lifetime (`prompt + max_new_tokens - 1` cached tokens) any request may have:
/// positions stay far inside int32.
pub(super) const MAX_LIFETIME: usize = i32::MAX as usize / 2;

/// The value half of `check_fits`: a non-empty prompt and at least one new token.
pub(super) fn check_lengths(prompt_len: usize, max_new_tokens: usize) -> Result<()> {
    if prompt_len == 0 {
        return Err(Error::invalid(
            "prompt",
            "prompt_token_ids must not be empty",
        ));
    }
    if max_new_tokens < 1 {
        return Err(Error::invalid(
            "max_new_tokens",
            format!("max_new_tokens must be >= 1 (got {max_new_tokens})"),
        ));
    }
    Ok(())
}

/// The longest lifetime whose chunks fit the pool and whose reads fit the cache-read budget.
fn max_lifetime(cfg: &SchedulerConfig, layout: &Layout) -> usize {
    let mut most = MAX_LIFETIME.min(cfg.max_batch_cache_tokens.unwrap_or(usize::MAX));
    if layout.max_chunks(most) > cfg.num_blocks {
        // `max_chunks` is monotone: the largest n with max_chunks(n) <= num_blocks.
        let (mut lo, mut hi) = (0usize, most); // fits(lo), !fits(hi)
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if layout.max_chunks(mid) <= cfg.num_blocks {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        most = lo;
    }
    most
}
