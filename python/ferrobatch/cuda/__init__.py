"""GPU pieces of ferrobatch: paged attention kernels (Triton / flash-attn / torch reference)
and CUDA-graph shape bucketing with a bounded graph cache.

Nothing here imports triton or touches CUDA at import time: `triton_attention` defines its
kernels only when triton is importable, and `graphs` only captures when CUDA is available.
See `docs/cuda-wiring.md` for how the runner calls these.
"""

from __future__ import annotations

from .graphs import GraphBuckets, GraphCache, GraphKey, PaddedPlan, pad_plan
from .triton_attention import (
    HAS_TRITON,
    choose_num_splits,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    reference_paged_attention,
    select_backend,
    write_kv,
)

__all__ = [
    "HAS_TRITON",
    "GraphBuckets",
    "GraphCache",
    "GraphKey",
    "PaddedPlan",
    "choose_num_splits",
    "pad_plan",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference_paged_attention",
    "select_backend",
    "write_kv",
]
