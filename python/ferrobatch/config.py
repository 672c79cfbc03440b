"""Engine configuration: `ContinuousBatchingConfig`.

Field names follow transformers' `ContinuousBatchingConfig` so either can be passed to
`Engine`; a transformers config is read, never mutated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from ferrobatch.defaults import MAX_STEP_MS, SAFETY_MARGIN
from ferrobatch.errors import FieldError

SCHEDULER_TYPES = tuple(SAFETY_MARGIN)
#: `scheduling_policy` values: arrival order, or `SamplingParams.priority` first, preempting
SCHEDULING_POLICIES = ("fcfs", "priority")

#: the KV cache storages `kv_cache_dtype` accepts ("auto": the model's dtype)
KV_CACHE_DTYPES = ("auto", "int8")

#: storages asked for by name that are refused, and why
_REFUSED_KV_DTYPES = {
    "fp8_e4m3": (
        "fp8_e4m3 is not supported: CPUs have no fp8 arithmetic (torch converts "
        "float8_e4m3fn in software, slower than int8) and e4m3's 3 mantissa bits round "
        "every element more coarsely than int8 with a per-head scale at the same size; "
        'use "int8"'
    ),
}


@dataclass
class ContinuousBatchingConfig:
    """Validated settings of the continuous-batching engine.

    Attributes:
        page_size: tokens per page (one layer's KV for `page_size` tokens; a block is one page
            per layer of an attention type). Must be >= 4. Default 32, by measurement: on the
            tiny-llama CPU workload (`benches/e2e_cpu.py`, tokens per CPU-second, shared cores)
            16 / 32 / 128 gave 1025 / 1063 / 1000, i.e. flat within noise; 32 keeps block
            tables short and the decode gathers' padding (a partly filled last page) small,
            and makes prefix sharing finer-grained than the reference's 256.
        num_blocks: capacity in full-attention blocks; None sizes the cache from free memory.
        max_batch_tokens: query tokens per forward (chunked prefill splits longer prompts).
            Default 2048: 512 / 2048 / 4096 / 8192 measured 1022 / 1063 / 1069 / 1103 tokens
            per CPU-second on the same workload (flat); 2048 bounds activation memory.
        max_memory_percent: share of free memory the cache may take when `num_blocks` is None;
            None = 0.9 on CUDA; on CPU 0.25 of available memory capped at 4 GiB (bounded:
            never the reference's 60% of RAM; `ferrobatch.defaults`,
            `ferrobatch.engine.memory.choose_num_blocks`).
        max_requests_per_batch: rows per forward; caps logits memory for large vocabularies.
        scheduler_type: "fifo" (decodes first, then in-flight prefills, then new requests) or
            "prefill_first" (finish chunked prefills before resuming decodes).
        scheduling_policy: "fcfs" (arrival order; requests may not set a priority) or
            "priority" (lower `SamplingParams.priority` first; a waiting request that doesn't
            fit preempts running ones of lower priority, each request at most 3 times:
            ARCHITECTURE.md section 3).
        safety_margin: share of the cache held in reserve for decodes; once free capacity is
            below it no new prefill is admitted. None = 0.15 for fifo, 0.0 for prefill_first.
        allow_block_sharing: prefix caching (only active on full-attention-only models).
        defer_shared_prefixes: with prefix caching, a waiting request whose next block
            another request of the same step computes (a shared system prompt arriving
            together) is admitted one step later, taking that block as a hit instead of
            computing it again (in-batch prefix sharing; at most once per request).
        max_step_ms: step-time budget (milliseconds) for chunked prefill on CPU. While other
            requests are unfinished (streams decoding, requests waiting), each step's prefill
            chunks are sized from the core's cost model of measured steps so the step takes
            about this long, and a newly arrived short request is prefilled beside a long
            one instead of queueing behind it (ARCHITECTURE.md, "Step-time budget");
            `max_batch_tokens` stays the hard cap, and a request alone still prefills in
            `max_batch_tokens` chunks. Default 500 (`ferrobatch.defaults.MAX_STEP_MS`): each
            step pays a fixed cost (one read of the weights, the chunk's context gather), so
            chunking costs the long prompt about fixed / max_step_ms; at 500 a 6,000-token
            prompt beside a stream (SmolLM2, 1 thread) reached its first token as fast as
            without the budget, stream gaps <= 0.6 s; at 250 it took 2.4x (docs/benchmarks.md,
            "Long prompts beside running streams"). None or 0 = off (token budgets only). Not
            applied on CUDA, with async batching, with "prefill_first", or to offline
            batches alone (`generate()`, `embed()`: their caller waits for the whole batch,
            so the budget would only cost throughput); where the decodes alone outlast it,
            prefill chunks get as much predicted time as the rest of the step.
        cpu_offload_space: GiB of (pinned on CUDA) CPU swap pool; 0 = off, preempted requests
            are soft-reset (recomputed) instead.
        q_padding_interval_size / kv_padding_interval_size: CUDA-graph shape padding (tokens);
            0 = preset.
        use_cuda_graph / use_async_batching: None = decide automatically (off on CPU).
        max_queue_size: most unfinished requests `add_request`/`stream`/`astream` accept
            (beyond it they raise `QueueFullError`); `generate` is not bounded. 0 = unlimited.
        adaptive_threads: on CPU, while other processes keep some of this process's cores
            busy, run torch on fewer threads (never more than it had when the engine was
            built; `ferrobatch.cpu.threads.ThreadGovernor`): waiting threads spin, and
            spinning beside another process makes every step many times slower.
        kv_cache_dtype: storage of the KV cache: "auto" (the model's dtype) or "int8"
            (symmetric int8 with one fp32 scale per slot and KV head, quantized once when a
            key or value is written: about half the bytes of a bf16 cache, a quarter of an
            fp32 one, so ~2x / ~4x the blocks for the same memory; CPU only). "fp8_e4m3" is
            refused (see `KV_CACHE_DTYPES`).
        batch_invariant: a request's tokens and logprobs are bit-identical whatever else
            shares its steps (batch mates, prompt chunking, prefix hits, preemption,
            threads): every product on one kernel per weight format and ISA, every row
            attended in key order by the CPU kernel, no greedy screen. CPU, full-attention
            models; `FieldError` where that cannot hold. Default False.
    """

    page_size: int = 32
    num_blocks: int | None = None
    max_batch_tokens: int = 2048
    max_memory_percent: float | None = None
    max_requests_per_batch: int = 256
    scheduler_type: str = "fifo"
    scheduling_policy: str = "fcfs"
    safety_margin: float | None = None
    allow_block_sharing: bool = True
    defer_shared_prefixes: bool = True
    max_step_ms: float | None = MAX_STEP_MS
    cpu_offload_space: float = 0.0
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    use_cuda_graph: bool | None = None
    use_async_batching: bool | None = None
    max_queue_size: int = 0
    adaptive_threads: bool = True
    kv_cache_dtype: str = "auto"
    batch_invariant: bool = False
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # ferrobatch's one check of page_size (the runner and the cache take it from here)
        _check_int(self, "page_size", minimum=4)
        if self.num_blocks is not None:
            _check_int(self, "num_blocks", minimum=1)
        if self.max_batch_tokens is None:
            self.max_batch_tokens = 2048
        _check_int(self, "max_batch_tokens", minimum=1)
        if self.max_memory_percent is not None:
            _check_float(self, "max_memory_percent", low=0.0, high=1.0, low_open=True)
        if self.max_requests_per_batch is None:
            self.max_requests_per_batch = 256
        _check_int(self, "max_requests_per_batch", minimum=1)
        if self.scheduler_type not in SCHEDULER_TYPES:
            raise FieldError(
                f"scheduler_type must be one of {SCHEDULER_TYPES}, got {self.scheduler_type!r}",
                "scheduler_type",
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise FieldError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                f"{self.scheduling_policy!r}", "scheduling_policy")
        if self.safety_margin is not None:
            _check_float(self, "safety_margin", low=0.0, high=1.0, high_open=True)
        if not isinstance(self.allow_block_sharing, bool):
            raise FieldError(
                f"allow_block_sharing must be a bool, got {self.allow_block_sharing!r}",
                "allow_block_sharing",
            )
        if not isinstance(self.defer_shared_prefixes, bool):
            raise FieldError(
                f"defer_shared_prefixes must be a bool, got {self.defer_shared_prefixes!r}",
                "defer_shared_prefixes",
            )
        if self.max_step_ms is not None:
            _check_float(self, "max_step_ms", low=0.0, high=math.inf, high_open=True)
            # 0 turns it off (the CLI's spelling of None)
            self.max_step_ms = float(self.max_step_ms) or None
        if self.cpu_offload_space is None:
            self.cpu_offload_space = 0.0
        _check_float(self, "cpu_offload_space", low=0.0, high=math.inf, high_open=True)
        _check_int(self, "q_padding_interval_size", minimum=0)
        _check_int(self, "kv_padding_interval_size", minimum=0)
        _check_int(self, "max_queue_size", minimum=0)
        if not isinstance(self.adaptive_threads, bool):
            raise FieldError(f"adaptive_threads must be a bool, got {self.adaptive_threads!r}",
                             "adaptive_threads")
        if not isinstance(self.batch_invariant, bool):
            raise FieldError(f"batch_invariant must be a bool, got {self.batch_invariant!r}",
                             "batch_invariant")
        for name in ("use_cuda_graph", "use_async_batching"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise FieldError(f"{name} must be a bool or None, got {value!r}", name)
        if self.kv_cache_dtype is None:
            self.kv_cache_dtype = "auto"
        _check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def resolved_safety_margin(self) -> float:
        """The safety margin in effect (the scheduler type's default when unset)."""
        if self.safety_margin is not None:
            return float(self.safety_margin)
        return SAFETY_MARGIN[self.scheduler_type]

    def replace(self, **changes: Any) -> ContinuousBatchingConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_transformers(cls, cfg: Any) -> ContinuousBatchingConfig:
        """Convert a `transformers.ContinuousBatchingConfig` (read only, never mutated).

        Fields the transformers config leaves as None take ferrobatch's defaults; fields
        ferrobatch has no use for are kept in `extra`.
        """
        ours = {f.name for f in fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        source = (
            {f.name: getattr(cfg, f.name) for f in fields(cfg)}
            if dataclasses.is_dataclass(cfg)
            else dict(vars(cfg))
        )
        for name, value in source.items():
            if name in ours:
                if value is None and name in ("max_batch_tokens", "max_requests_per_batch"):
                    continue
                if name == "use_cuda_graph" and isinstance(value, tuple):
                    value = any(value)
                kwargs[name] = value
            else:
                extra[name] = value
        block_size = source.get("block_size")
        if block_size is not None and "page_size" not in kwargs:
            kwargs["page_size"] = block_size
        return cls(**kwargs, extra=extra)

    @classmethod
    def coerce(cls, cfg: Any) -> ContinuousBatchingConfig:
        """Accept None, a ferrobatch config, a transformers config or a dict of fields."""
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, dict):
            return cls(**cfg)
        if type(cfg).__name__ == "ContinuousBatchingConfig":
            return cls.from_transformers(cfg)
        raise TypeError(
            "config must be a ferrobatch or transformers ContinuousBatchingConfig, a dict or None, "
            f"got {type(cfg).__name__}"
        )


def _check_kv_cache_dtype(value: Any) -> None:
    if not isinstance(value, str):
        raise FieldError(f"kv_cache_dtype must be a string, got {value!r}", "kv_cache_dtype")
    key = value.lower()
    if key in ("fp8", "float8_e4m3fn", "fp8_e4m3fn"):
        key = "fp8_e4m3"
    if key in _REFUSED_KV_DTYPES:
        raise FieldError(f"kv_cache_dtype={value!r}: {_REFUSED_KV_DTYPES[key]}",
                         "kv_cache_dtype")
    if value not in KV_CACHE_DTYPES:
        raise FieldError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}",
                         "kv_cache_dtype")


def _check_int(obj: Any, name: str, *, minimum: int) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"{name} must be an integer, got {value!r}", name)
    if value < minimum:
        raise FieldError(f"{name} must be >= {minimum}, got {value}", name)


def _check_float(
    obj: Any,
    name: str,
    *,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{name} must be a number, got {value!r}", name)
    value = float(value)
    bad = (
        math.isnan(value)
        or (value <= low if low_open else value < low)
        or (value >= high if high_open else value > high)
    )
    if bad:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise FieldError(f"{name} must be in {lo}{low}, {high}{hi}, got {value}", name)
