"""Attention through kernels instead of SDPA: the GPU kernels of
`ferrobatch.cuda.triton_attention` (a `KernelStep`'s layers) and the in-place CPU kernels
of `ferrobatch._core` (a `PagedStep`'s single-token rows on the decode kernel, its
multi-token rows on the tiled prefill kernel)."""

from __future__ import annotations

import torch

from ferrobatch import _core
from ferrobatch.attention.kernel_step import KernelStep
from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.attention.paged_step import _KernelDecode, _KernelPrefill
from ferrobatch.cpu.arrays import KERNEL_DTYPES, numpy_view
from ferrobatch.cuda import triton_attention as ta
from ferrobatch.model_config import SLIDING


def kernel_attention(
    step: KernelStep,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    typ = step.layer_types[layer]
    sliding = typ == SLIDING
    k_cache, v_cache = step.cache.keys[layer], step.cache.values[layer]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if k_new.dtype != k_cache.dtype:
        k_new, v_new = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype)
    out = ta.paged_attention(
        query[0].transpose(0, 1), k_new, v_new, k_cache, v_cache,
        step.slot_mapping[typ], step.block_tables[typ], step.cu_seqlens_q, step.seqlens_k,
        max_seqlen_q=step.max_seqlen_q, max_seqlen_k=step.max_seqlen_k,
        page_size=step.cache.page_size, scale=scaling, softcap=softcap,
        sliding_window=step.sliding_window if sliding else None,
        ring_size=step.ring_size if sliding else None,
        num_splits=step.num_splits[typ], backend=step.backend,
    )
    return out.unsqueeze(0)


def decode_kernel_available(cache: PagedKVCache) -> bool:
    """Whether decode rows can use the in-place CPU kernel of `ferrobatch._core` with
    `cache` (a CPU cache in fp32, bf16 or fp16)."""
    return (
        hasattr(_core, "paged_decode_attention")
        and cache.device.type == "cpu"
        and cache.dtype in KERNEL_DTYPES
    )


def decode_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kd: _KernelDecode, out: torch.Tensor, page: int, scale: float,
                   softcap: float | None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The CPU kernel over the rows `kd`; `scales` (key, value) [slots, kv_heads] fp32 with
    an int8 cache (read in place, each slot dequantized as the kernel reads it)."""
    extra, cache_dtype = _cache_args(k_cache, scales)
    _core.paged_decode_attention(
        numpy_view(q), numpy_view(k_cache), numpy_view(v_cache), kd.block_tables,
        kd.seqlens, numpy_view(out), q_dtype=KERNEL_DTYPES[q.dtype],
        cache_dtype=cache_dtype, out_dtype=KERNEL_DTYPES[out.dtype],
        page=page, window=kd.window, scale=float(scale), softcap=float(softcap or 0.0),
        threads=torch.get_num_threads(), **extra,
    )


def prefill_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kp: _KernelPrefill, out: torch.Tensor, page: int, scale: float,
                   softcap: float | None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The tiled CPU prefill kernel over the multi-token rows `kp` (`q` [Tp, H, D] their
    tokens, row after row; `scales` as `decode_kernel`'s)."""
    extra, cache_dtype = _cache_args(k_cache, scales)
    _core.paged_prefill_attention(
        numpy_view(q), numpy_view(k_cache), numpy_view(v_cache), kp.block_tables,
        kp.cu_seqlens_q, kp.seqlens, numpy_view(out), q_dtype=KERNEL_DTYPES[q.dtype],
        cache_dtype=cache_dtype, out_dtype=KERNEL_DTYPES[out.dtype],
        page=page, window=kp.window, scale=float(scale), softcap=float(softcap or 0.0),
        threads=torch.get_num_threads(), **extra,
    )


def _cache_args(k_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[dict, str]:
    """The kernels' scale arguments and cache dtype name for cache `k_cache`."""
    extra = {} if scales is None else {"k_scales": scales[0].numpy(),
                                       "v_scales": scales[1].numpy()}
    return extra, "int8" if k_cache.dtype == torch.int8 else KERNEL_DTYPES[k_cache.dtype]


# --- registration, switching, delegation -------------------------------------------------
