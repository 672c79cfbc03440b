"""KV cache sizing from free memory, counting activations, logits and bookkeeping too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil
import torch
from transformers import PretrainedConfig, PreTrainedModel

from ferrobatch.attention.kv_cache import RESERVED_CHUNKS
from ferrobatch.defaults import (
    CPU_MEMORY_CAP,
    CPU_MEMORY_PERCENT,
    CUDA_MEMORY_PERCENT,
    DEFAULT_MAX_GRAPHS,
    DEFAULT_Q_INTERVAL,
    GiB,
)
from ferrobatch.model_config import text_config
from ferrobatch.models import layer_types_of

MiB = 2**20
BOOKKEEPING = 64 * MiB


def _fmt(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


@dataclass(frozen=True)
class _Shape:
    """The sizes of a text config that memory estimates use."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: PretrainedConfig) -> _Shape:
        """Per-layer sizes (lists, as Gemma3n's `intermediate_size`) count at their largest:
        the estimates are per step and per chunk, bounded by the widest layer."""
        cfg = text_config(config)
        hidden = _largest(cfg.hidden_size)
        heads = _largest(cfg.num_attention_heads)
        return cls(
            hidden=hidden,
            intermediate=_largest(getattr(cfg, "intermediate_size", None) or 4 * hidden),
            heads=heads,
            kv_heads=_largest(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=_largest(getattr(cfg, "head_dim", None) or hidden // heads),
        )

    @property
    def activation_elems_per_token(self) -> int:
        """A few live [T, hidden] residual/norm tensors, the MLP's [T, intermediate] triple
        and the attention projections."""
        h = self
        return 6 * h.hidden + 3 * h.intermediate + 2 * (h.heads + 2 * h.kv_heads) * h.head_dim


def _largest(value: Any) -> int:
    """An int config field, or the largest entry of a per-layer list / tuple of them."""
    if isinstance(value, list | tuple):
        ints = [int(v) for v in value if v is not None]
        if not ints:
            raise ValueError(f"empty per-layer size {value!r}")
        return max(ints)
    return int(value)


def kv_bytes_per_chunk(
    config: PretrainedConfig, page_size: int, dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes of one chunk: all layers, K and V, `page_size` slots (`kv_cache_dtype="int8"`:
    one byte an element plus a 4-byte scale per slot and KV head)."""
    shape = _Shape.of(config)
    if kv_cache_dtype == "int8":
        per_slot_head = shape.head_dim + 4
    else:
        per_slot_head = shape.head_dim * torch.empty((), dtype=dtype).element_size()
    return len(layer_types_of(config)) * 2 * page_size * shape.kv_heads * per_slot_head


def graph_pool_bytes(
    config: PretrainedConfig,
    *,
    max_requests_per_batch: int,
    dtype: torch.dtype = torch.bfloat16,
    q_interval: int = 0,
    max_graphs: int | None = None,
) -> tuple[int, str]:
    """Device memory the CUDA graphs of decode-only steps hold, and a phrase saying so.

    All graphs share one pool, so it holds about the activations of the largest captured
    step: `max_requests_per_batch` rows padded to the graph buckets (one query token each),
    the same per-token estimate as eager activations, plus the split-K decode workspace
    (rows x heads x up to 16 splits x head_dim, fp32). Each graph also keeps its output, the
    hidden states `[rows, hidden]` (the LM head runs outside the graph), and its static
    inputs (a few int32 arrays, counted as 8 per row)."""
    # local: ferrobatch.cuda.graphs defines the Triton kernels (~40 ms); CPU engines never get here
    from ferrobatch.cuda.graphs import GraphBuckets

    shape = _Shape.of(config)
    elem = torch.empty((), dtype=dtype).element_size()
    graphs = int(max_graphs or DEFAULT_MAX_GRAPHS)
    rows = GraphBuckets(q_interval=q_interval or DEFAULT_Q_INTERVAL).pad_tokens(
        max(1, max_requests_per_batch)
    )
    activations = 2 * rows * shape.activation_elems_per_token * elem
    workspace = rows * shape.heads * 16 * (shape.head_dim + 2) * 4
    outputs = graphs * rows * (shape.hidden * elem + 8 * 4)
    total = activations + workspace + outputs
    note = (f"CUDA graph pool {_fmt(total)} (decode step of {rows} rows: activations "
            f"{_fmt(activations)}, split-K workspace {_fmt(workspace)}; up to {graphs} graphs' "
            f"outputs and inputs {_fmt(outputs)})")
    return total, note


def choose_num_blocks(
    model_config: PretrainedConfig | PreTrainedModel,
    *,
    config: Any = None,
    page_size: int | None = None,
    max_batch_tokens: int | None = None,
    max_requests_per_batch: int | None = None,
    max_memory_percent: float | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_model_len: int | None = None,
    free_bytes: int | None = None,
    use_cuda_graph: bool | None = None,
    max_graphs: int | None = None,
    kv_cache_dtype: str | None = None,
) -> tuple[int, str]:
    """Number of data chunks the cache can take, and a sentence saying why.

    Budget = free memory (psutil on CPU, `torch.cuda.mem_get_info` on CUDA; `free_bytes`
    overrides) × `max_memory_percent`, minus activations at `max_batch_tokens`, logits at
    `max_requests_per_batch` × vocab (the head's output in the model dtype, fp32 logits and
    sampling temporaries), on CUDA with graphs (`use_cuda_graph` not False) the graph pool
    (activations of the largest captured decode step, `max_requests_per_batch` rows padded,
    the split-K decode workspace, and every graph's hidden-state output), and bookkeeping;
    each chunk costs its KV bytes plus its share of the attention gather workspace. Without
    `max_memory_percent`: 0.9 on CUDA; on CPU 0.25 of available memory capped at 4 GiB.
    Never more chunks than `max_requests_per_batch` sequences of `max_model_len` tokens need.
    Raises ValueError when not even a few chunks fit.

    `model_config` is the model's config (or the model). `config`, a
    `ContinuousBatchingConfig`, supplies `page_size`, `max_batch_tokens`,
    `max_requests_per_batch`, `max_memory_percent`, `use_cuda_graph`, `kv_cache_dtype` and
    the graph padding interval where they are not passed. An int8 cache's chunk costs its
    int8 elements and fp32 scales (the gathers still dequantize into `dtype` workspaces).
    """
    if isinstance(model_config, PreTrainedModel):
        model_config = model_config.config
    if config is not None:
        page_size = page_size if page_size is not None else config.page_size
        if max_batch_tokens is None:
            max_batch_tokens = config.max_batch_tokens
        if max_requests_per_batch is None:
            max_requests_per_batch = config.max_requests_per_batch
        if max_memory_percent is None:
            max_memory_percent = getattr(config, "max_memory_percent", None)
        if use_cuda_graph is None:
            use_cuda_graph = getattr(config, "use_cuda_graph", None)
        if kv_cache_dtype is None:
            kv_cache_dtype = getattr(config, "kv_cache_dtype", None)
    q_interval = int(getattr(config, "q_padding_interval_size", 0) or 0) if config else 0
    if page_size is None or max_batch_tokens is None or max_requests_per_batch is None:
        raise ValueError("page_size, max_batch_tokens and max_requests_per_batch are needed")
    config = model_config
    dev = torch.device(device)
    cfg = text_config(config)
    if free_bytes is None:
        if dev.type == "cuda":
            free_bytes = int(torch.cuda.mem_get_info(dev)[0])
        else:
            free_bytes = int(psutil.virtual_memory().available)
    if max_memory_percent is None:
        if dev.type == "cuda":
            budget = free_bytes * CUDA_MEMORY_PERCENT
            rule = f"{CUDA_MEMORY_PERCENT:.0%} of free {_fmt(free_bytes)}"
        else:
            budget = min(free_bytes * CPU_MEMORY_PERCENT, CPU_MEMORY_CAP)
            rule = (f"min({CPU_MEMORY_PERCENT:.0%} of available {_fmt(free_bytes)}, "
                    f"{_fmt(CPU_MEMORY_CAP)})")
    else:
        if not 0.0 < max_memory_percent <= 1.0:
            raise ValueError("max_memory_percent must be in (0, 1]")
        budget = free_bytes * max_memory_percent
        rule = f"{max_memory_percent:.0%} of {'free' if dev.type == 'cuda' else 'available'} " \
               f"{_fmt(free_bytes)}"

    elem = torch.empty((), dtype=dtype).element_size()
    vocab = int(cfg.vocab_size)
    # Activations at the largest step; x2 for allocator slack.
    activations = 2 * max_batch_tokens * _Shape.of(cfg).activation_elems_per_token * elem
    # The head's output in the model dtype (a separate tensor unless fp32), its fp32 copy and
    # two fp32 sampler temporaries.
    logits = max_requests_per_batch * vocab * (4 * 3 + (elem if elem != 4 else 0))
    graph_pool = 0
    graph_note = ""
    if dev.type == "cuda" and use_cuda_graph is not False:
        graph_pool, graph_note = graph_pool_bytes(
            cfg, max_requests_per_batch=max_requests_per_batch, dtype=dtype,
            q_interval=q_interval, max_graphs=max_graphs,
        )
    overhead = activations + logits + graph_pool + BOOKKEEPING
    kv_dtype = kv_cache_dtype or "auto"
    kv_chunk = kv_bytes_per_chunk(config, page_size, dtype, kv_dtype)
    # Attention gathers one layer's K and V of the rows it reads into reusable workspaces
    # (in `dtype`, an int8 cache's too): at most about one layer's share of the cache (+50%
    # for bucket padding and prefill).
    gather_chunk = int(1.5 * kv_bytes_per_chunk(config, page_size, dtype)
                       / max(len(layer_types_of(config)), 1))
    per_chunk = kv_chunk + gather_chunk
    kv_budget = budget - overhead
    num = int(kv_budget // per_chunk) - RESERVED_CHUNKS
    cap_note = ""
    if max_model_len is None:
        max_model_len = getattr(cfg, "max_position_embeddings", None)
    if max_model_len:
        useful = max_requests_per_batch * -(-max_model_len // page_size) + 1
        if num > useful:
            num, cap_note = useful, (f"; capped at {useful} chunks ({max_requests_per_batch} "
                                     f"requests x {max_model_len} tokens)")
    why = (
        f"num_blocks={max(num, 0)}: budget {_fmt(budget)} = {rule}; minus activations "
        f"{_fmt(activations)} (max_batch_tokens={max_batch_tokens}), logits {_fmt(logits)} "
        f"(max_requests_per_batch={max_requests_per_batch} x vocab {vocab}), "
        f"{graph_note + ', ' if graph_note else ''}bookkeeping "
        f"{_fmt(BOOKKEEPING)}; leaves {_fmt(max(kv_budget, 0))} for the cache at "
        f"{_fmt(per_chunk)} per chunk (KV {_fmt(kv_chunk)}: {page_size} tokens, all layers, "
        f"K and V, {dtype if kv_dtype == 'auto' else kv_dtype}; attention gather workspace "
        f"{_fmt(gather_chunk)}; "
        f"+{RESERVED_CHUNKS} reserved chunks){cap_note}"
    )
    if num < 4:
        raise ValueError(f"not enough memory for the KV cache: {why}")
    return num, why
