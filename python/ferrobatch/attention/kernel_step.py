"""`KernelStep`: the per-step device metadata of the GPU kernels, built once per step by
`build_kernel_step`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.cuda import triton_attention as ta
from ferrobatch.cuda.staging import upload
from ferrobatch.model_config import SLIDING

if TYPE_CHECKING:
    from ferrobatch.core import StepPlan


@dataclass
class KernelStep:
    """Per-step device metadata for the GPU kernels of `ferrobatch.cuda.triton_attention`
    (built once per step by `build_kernel_step`; see `docs/cuda-wiring.md`)."""

    cache: PagedKVCache
    layer_types: list[str]
    backend: str  # "triton" | "flash_attn" | "torch"
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seqlens_k: torch.Tensor  # [B] int32
    slot_mapping: dict[str, torch.Tensor]  # [T] int64 per type
    block_tables: dict[str, torch.Tensor]  # [B, W] int32 per type
    max_seqlen_q: int
    max_seqlen_k: int
    num_splits: dict[str, int]
    sliding_window: int | None
    ring_size: int | None
    num_tokens: int
    calls: int = 0


def build_kernel_step(
    plan: StepPlan,
    cache: PagedKVCache,
    layer_types: list[str],
    sliding_window: int | None,
    backend: str,
    num_sms: int = 132,
) -> KernelStep:
    """The device tensors and host integers the kernels need for `plan`."""
    device = cache.device
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    seqlens = np.asarray(plan.seqlens_k, dtype=np.int64)
    qlen = np.diff(cu)
    if (qlen < 1).any() or (seqlens < qlen).any():
        raise ValueError("every row needs >= 1 query token and seqlens_k >= its query length")

    max_k = int(seqlens.max())
    types = sorted(set(layer_types))
    num_splits = {}
    for typ in types:
        keys = min(max_k, int(sliding_window)) if typ == SLIDING else max_k
        num_splits[typ] = ta.choose_num_splits(len(qlen), cache.num_kv_heads, keys,
                                               num_sms=num_sms)
    # One host->device copy per dtype (from pinned memory on CUDA: no stream sync).
    i32 = upload({"cu": cu, "seqlens": seqlens,
                  **{f"table/{t}": plan.block_tables[t] for t in types}}, torch.int32, device)
    i64 = upload({t: plan.slot_mapping[t] for t in types}, torch.int64, device)
    tables = {t: i32[f"table/{t}"] for t in types}
    return KernelStep(
        cache=cache,
        layer_types=layer_types,
        backend=backend,
        cu_seqlens_q=i32["cu"],
        seqlens_k=i32["seqlens"],
        slot_mapping=i64,
        block_tables=tables,
        max_seqlen_q=int(qlen.max()),
        max_seqlen_k=max_k,
        num_splits=num_splits,
        sliding_window=sliding_window,
        ring_size=int(tables[SLIDING].shape[1]) if SLIDING in tables else None,
        num_tokens=int(cu[-1]),
    )
