"""Paged attention over ferrobatch's KV cache, plugged into transformers' attention interface.

`paged_attention_forward` is registered under `ATTENTION_NAME` with
`transformers.AttentionInterface`; a mask function returning None is registered under the
same name with `AttentionMaskInterface`, so a packed forward builds no dense mask. The step's
metadata (`PagedStep`, built once per step by `build_step`) reaches every layer through the
forward kwarg `STEP_KWARG`, or, for decoder layers that drop their **kwargs, through the
thread-local step `paged_attention_enabled` sets for the forward. Calls with neither (another
thread using the caller's model while a ferrobatch forward has its config switched) are
delegated to the model's own implementation. Attention sinks (GPT-OSS `s_aux`) are applied
as one extra softmax column per head whose probability mass is dropped.

Per layer and attention type the work is: gather the cached keys prefill rows need (before
any write: sliding rings may be overwritten by this step), write the step's new K/V with the
slot mapping, then one padded gather + one SDPA for all single-token rows, and one SDPA per
multi-token row. Never a mask across requests.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    sdpa_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .kv_cache import PagedKVCache
from .models import SLIDING

ATTENTION_NAME = "ferrobatch_paged"
STEP_KWARG = "ferrobatch_step"

__all__ = [
    "ATTENTION_NAME",
    "STEP_KWARG",
    "KernelStep",
    "PagedStep",
    "build_kernel_step",
    "build_step",
    "decode_kernel_available",
    "in_ferrobatch_forward",
    "paged_attention_enabled",
    "paged_attention_forward",
    "register",
]


@dataclass
class _PrefillRow:
    """One multi-token row of one attention type."""

    tok_start: int
    tok_end: int
    cached_start: int  # offsets into the group's cached-key gather
    cached_end: int
    mask: torch.Tensor | None  # [q, cached + q] additive (0 / -inf); None with causal
    causal: bool


@dataclass
class _DecodeBucket:
    """Single-token rows of similar key length, attended together."""

    tokens: torch.Tensor | None  # [Bb] token indices; None when the bucket is all T tokens
    chunks: torch.Tensor  # [Bb * Wb] chunk ids to gather, row after row
    rows: int  # Bb
    keys: int  # Wb * page_size gathered keys per row
    mask: torch.Tensor | None  # [Bb, 1, 1, keys] additive; None when every key counts


@dataclass
class _KernelDecode:
    """All single-token rows of one attention type, for the in-place CPU kernel
    (`ferrobatch._core.paged_decode_attention`)."""

    tokens: torch.Tensor | None  # [Bd] token indices; None when the rows are all T tokens
    block_tables: np.ndarray  # [Bd, W] int32
    seqlens: np.ndarray  # [Bd] int32
    window: int  # 0 = full attention


@dataclass
class _Group:
    """Per-step metadata of one attention type, shared by all its layers."""

    slot_mapping: torch.Tensor  # [T] long
    decode: list[_DecodeBucket]
    prefill_cached_slots: torch.Tensor | None  # all prefill rows' cached keys, row after row
    prefill: list[_PrefillRow]
    kernel_decode: _KernelDecode | None = None


@dataclass
class PagedStep:
    """What the attention layers need for one step (built once by `build_step`)."""

    cache: PagedKVCache
    groups: list[_Group]  # per layer: the group of its attention type
    num_tokens: int
    calls: int = 0  # attention calls seen; the runner checks every layer came through here
    # dtype of the attention output (None: the query's); the runner asks for the cache's
    # when the next product rounds its input to it anyway (packed half-precision linears)
    out_dtype: torch.dtype | None = None


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
    plan: Any,
    cache: PagedKVCache,
    layer_types: list[str],
    sliding_window: int | None,
    backend: str,
    num_sms: int = 132,
) -> KernelStep:
    """The device tensors and host integers the kernels need for `plan`."""
    from .cuda import triton_attention as ta

    device = cache.device
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    seqlens = np.asarray(plan.seqlens_k, dtype=np.int64)
    qlen = np.diff(cu)
    if (qlen < 1).any() or (seqlens < qlen).any():
        raise ValueError("every row needs >= 1 query token and seqlens_k >= its query length")

    def i32(a: Any) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
        return host.to(device, non_blocking=True)  # no stream sync on CUDA

    max_k = int(seqlens.max())
    types = sorted(set(layer_types))
    num_splits = {}
    for typ in types:
        keys = min(max_k, int(sliding_window)) if typ == SLIDING else max_k
        num_splits[typ] = ta.choose_num_splits(len(qlen), cache.num_kv_heads, keys,
                                               num_sms=num_sms)
    tables = {t: i32(plan.block_tables[t]) for t in types}
    return KernelStep(
        cache=cache,
        layer_types=layer_types,
        backend=backend,
        cu_seqlens_q=i32(cu),
        seqlens_k=i32(seqlens),
        slot_mapping={
            t: torch.from_numpy(np.ascontiguousarray(plan.slot_mapping[t], dtype=np.int64))
            .to(device, non_blocking=True) for t in types
        },
        block_tables=tables,
        max_seqlen_q=int(qlen.max()),
        max_seqlen_k=max_k,
        num_splits=num_splits,
        sliding_window=sliding_window,
        ring_size=int(tables[SLIDING].shape[1]) if SLIDING in tables else None,
        num_tokens=int(cu[-1]),
    )


def _kernel_attention(
    step: KernelStep,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    from .cuda import triton_attention as ta

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
    from . import _core

    return (
        hasattr(_core, "paged_decode_attention")
        and cache.device.type == "cpu"
        and cache.dtype in _KERNEL_DTYPES
    )


def build_step(
    plan: Any,
    cache: PagedKVCache,
    layer_types: list[str],
    sliding_window: int | None,
    decode_kernel: bool = False,
) -> PagedStep:
    """Precompute gather indices and masks for every attention type of `plan`.

    Follows ARCHITECTURE.md §3: full attention reads positions `0 .. seqlens_k` through
    `block_tables["full_attention"]`; sliding attention reads a row's last `w` positions
    through its ring of `R` chunks. With `decode_kernel` (see `decode_kernel_available`),
    single-token rows are attended in place by the CPU kernel instead of gathered.
    """
    page = cache.page_size
    device = cache.device
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    seqlens = np.asarray(plan.seqlens_k, dtype=np.int64)
    qlen = np.diff(cu)
    num_tokens = int(cu[-1])
    if (qlen < 1).any():
        raise ValueError("every row of a plan must have at least one query token")
    start = seqlens - qlen
    if (start < 0).any():
        raise ValueError("seqlens_k smaller than the row's query length")
    decode_rows = np.flatnonzero(qlen == 1)
    prefill_rows = np.flatnonzero(qlen > 1)
    all_decode = len(decode_rows) == len(qlen)

    def to_long(a: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        return host.to(device, non_blocking=True)  # no stream sync on CUDA

    def additive(valid: np.ndarray) -> torch.Tensor:
        # Additive masks built once per step: SDPA would convert a bool mask in every layer.
        m = np.where(valid, np.float32(0.0), np.float32(-np.inf))
        return torch.from_numpy(m).to(device=device, dtype=cache.dtype, non_blocking=True)

    groups: dict[str, _Group] = {}
    for typ in set(layer_types):
        sliding = typ == SLIDING
        if sliding and not sliding_window:
            raise ValueError("sliding layers need a sliding window")
        w = int(sliding_window) if sliding else 0
        table = np.asarray(plan.block_tables[typ], dtype=np.int64)
        if table.ndim != 2 or table.shape[0] != len(qlen):
            raise ValueError(f"block_tables[{typ!r}] must be [B, W]")
        ring = table.shape[1]
        slot_mapping = np.asarray(plan.slot_mapping[typ], dtype=np.int64)
        if slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping[{typ!r}] must have T={num_tokens} entries")

        def slots_of(rows: np.ndarray, pos: np.ndarray, *, _table=table, _ring=ring,
                     _sliding=sliding) -> np.ndarray:
            col = pos // page
            if _sliding:
                col = col % _ring
            return _table[rows, col] * page + pos % page

        # Single-token rows: whole chunks gathered after this step's write (their one new
        # key is then in the cache), keys outside the row's range masked; rows bucketed by
        # length so short rows do not pay for the longest.
        decode: list[_DecodeBucket] = []
        kernel_decode = None
        if len(decode_rows) and decode_kernel:
            if not sliding and int(-(-seqlens[decode_rows].max() // page)) > table.shape[1]:
                raise ValueError(f"block_tables[{typ!r}] too narrow for seqlens_k")
            kernel_decode = _KernelDecode(
                tokens=None if all_decode else to_long(cu[decode_rows]),
                block_tables=np.ascontiguousarray(table[decode_rows], dtype=np.int32),
                seqlens=np.ascontiguousarray(seqlens[decode_rows], dtype=np.int32),
                window=w,
            )
        elif len(decode_rows):
            total = seqlens[decode_rows]
            if sliding:
                width = np.full(len(decode_rows), ring)
            else:
                width = -(-total // page)
                if width.max() > table.shape[1]:
                    raise ValueError(f"block_tables[{typ!r}] too narrow for seqlens_k")
            for idx in _buckets(width, page):
                rows = decode_rows[idx]
                wb = int(width[idx].max())
                chunk_ids = table[rows, :wb]
                last = total[idx][:, None, None] - 1
                col = np.arange(wb)[None, :, None]
                off = np.arange(page)[None, None, :]
                if sliding:
                    # The position a ring slot holds now: the latest p <= last in that slot.
                    lb = last // page
                    blk = lb - (lb - col) % wb
                    blk = np.where(blk * page + off > last, blk - wb, blk)
                    pos = blk * page + off
                    valid = (pos >= 0) & (pos > last - w)
                else:
                    valid = np.broadcast_to(col * page + off <= last, (len(rows), wb, page))
                valid = valid.reshape(len(rows), wb * page)
                decode.append(_DecodeBucket(
                    tokens=None if all_decode and len(idx) == len(qlen) else to_long(cu[rows]),
                    chunks=to_long(chunk_ids.reshape(-1)),
                    rows=len(rows),
                    keys=wb * page,
                    mask=None if valid.all() else additive(valid[:, None, None, :]),
                ))

        # Multi-token rows: cached keys gathered before the write, new keys from the forward.
        prefill: list[_PrefillRow] = []
        cached_parts: list[np.ndarray] = []
        offset = 0
        for r in prefill_rows:
            s, q = int(start[r]), int(qlen[r])
            c0 = max(0, s - w + 1) if sliding else 0
            c = s - c0
            if c:
                cached_parts.append(slots_of(np.full(c, r), np.arange(c0, s)))
            causal = c == 0 and (not sliding or q <= w)
            mask = None
            if not causal:
                q_pos = np.arange(s, s + q)[:, None]
                k_pos = np.arange(c0, s + q)[None, :]
                m = k_pos <= q_pos
                if sliding:
                    m &= k_pos > q_pos - w
                mask = additive(m)
            prefill.append(
                _PrefillRow(int(cu[r]), int(cu[r + 1]), offset, offset + c, mask, causal)
            )
            offset += c
        cached = to_long(np.concatenate(cached_parts)) if cached_parts else None
        groups[typ] = _Group(
            slot_mapping=to_long(slot_mapping),
            decode=decode,
            prefill_cached_slots=cached,
            prefill=prefill,
            kernel_decode=kernel_decode,
        )
    return PagedStep(cache=cache, groups=[groups[t] for t in layer_types], num_tokens=num_tokens)


_BUCKET_PENALTY_KEYS = 256  # one more gather + SDPA call costs about this many padded keys


def _buckets(width: np.ndarray, page: int) -> list[np.ndarray]:
    """Split rows (by gathered chunks `width`) into up to 4 equal-count length buckets when
    that saves more padded keys than the extra calls cost."""
    order = np.argsort(width, kind="stable")
    n = len(order)
    best_cost, best = n * int(width.max()) * page, [order]
    for k in (2, 3, 4):
        if n < 4 * k:
            break
        parts = np.array_split(order, k)
        cost = sum(len(p) * int(width[p].max()) for p in parts) * page
        cost += (k - 1) * _BUCKET_PENALTY_KEYS
        if cost < best_cost:
            best_cost, best = cost, parts
    if len(best) == 1:
        return [np.arange(n)]  # keep plan order: a single bucket needs no scatter
    return best


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    causal: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, Lq, D] over k/v [B, Hkv, Lk, D] with an additive mask.

    `sinks` [H] (GPT-OSS `s_aux`): one extra logit per head in every query's softmax whose
    probability mass is dropped, as transformers' `eager_attention_forward` of GPT-OSS."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=heads != kv_heads,
        )
    b, _, lq, d = q.shape
    lk = k.shape[2]
    g = heads // kv_heads
    qg = q.reshape(b, kv_heads, g * lq, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kv_heads, g, lq, lk)
    if causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores + (mask if mask.dim() == 2 else mask.view(b, 1, 1, mask.shape[-2], lk))
    if sinks is not None:
        # query head h = kv * g + i shares KV head kv (repeat_kv's order)
        sink = sinks.to(scores.dtype).view(1, kv_heads, g, 1, 1).expand(b, -1, -1, lq, 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :lk]
        probs = probs.reshape(b, kv_heads, g * lq, lk)
        return torch.matmul(probs.to(v.dtype), v).view(b, heads, lq, d)
    probs = torch.softmax(scores.view(b, kv_heads, g * lq, lk), dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(v.dtype), v).view(b, heads, lq, d)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [1, H, T, D], key/value [1, Hkv, T, D] of a
    packed step → output [1, T, H, D], reading and writing the paged cache."""
    step: PagedStep | KernelStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        # A decoder layer that drops its **kwargs (Nemotron) loses the forward kwarg: the
        # step set for this thread's ferrobatch forward (never another thread's) stands in.
        step = getattr(_STATE, "step", None)
        layer = getattr(module, "layer_idx", None)
        if step is None or not isinstance(layer, int) or not 0 <= layer < _num_layers(step):
            return _delegate(module, query, key, value, attention_mask, scaling=scaling,
                             dropout=dropout, softcap=softcap, **kwargs)
    layer = module.layer_idx
    step.calls += 1
    sinks = kwargs.get("s_aux")
    if not isinstance(sinks, torch.Tensor):
        sinks = None
    if isinstance(step, KernelStep):
        if sinks is not None:
            raise NotImplementedError(
                "attention sinks (s_aux) are not implemented by ferrobatch's GPU kernels; "
                "use attention_backend='sdpa'"
            )
        if scaling is None:
            scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        return _kernel_attention(step, layer, query, key, value, scaling, softcap or None), None
    group = step.groups[layer]
    k_cache = step.cache.keys[layer]
    v_cache = step.cache.values[layer]
    _, heads, num_tokens, dim = query.shape
    kv_heads = key.shape[1]
    if scaling is None:
        scaling = getattr(module, "scaling", None) or dim**-0.5
    softcap = softcap or None
    q_all = query[0]  # [H, T, D]
    k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1)
    if k_new.dtype != k_cache.dtype:
        k_new, v_new = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype)

    cached_k = cached_v = None
    cache = step.cache
    if group.prefill_cached_slots is not None:
        cached_k, cached_v = cache.gather_buffers(1, group.prefill_cached_slots.shape[0])
        torch.index_select(k_cache, 0, group.prefill_cached_slots, out=cached_k)
        torch.index_select(v_cache, 0, group.prefill_cached_slots, out=cached_v)
    k_cache.index_copy_(0, group.slot_mapping, k_new)
    v_cache.index_copy_(0, group.slot_mapping, v_new)

    out = None
    out_dtype = step.out_dtype or query.dtype
    kd = group.kernel_decode
    if kd is not None:
        if sinks is not None:
            raise NotImplementedError("attention sinks need the SDPA decode path")
        q_dec = q_all.transpose(0, 1) if kd.tokens is None else q_all.index_select(
            1, kd.tokens).transpose(0, 1)
        if q_dec.dtype not in _KERNEL_DTYPES:
            q_dec = q_dec.float()
        q_dec = q_dec.contiguous()  # [Bd, H, D]
        o = torch.empty(q_dec.shape, dtype=out_dtype if out_dtype in _KERNEL_DTYPES
                        else torch.float32)
        _decode_kernel(q_dec, k_cache, v_cache, kd, o, cache.page_size, scaling, softcap)
        if kd.tokens is None:
            return o.to(out_dtype).unsqueeze(0), None
        out = query.new_empty(num_tokens, heads, dim, dtype=out_dtype)
        out.index_copy_(0, kd.tokens, o.to(out_dtype))
    for bucket in group.decode:
        bd = bucket.rows
        if bucket.tokens is None:
            q_dec = q_all.transpose(0, 1)  # [Bd, H, D]
        else:
            q_dec = q_all.index_select(1, bucket.tokens).transpose(0, 1)
        k, v = cache.gather_chunks(k_cache, v_cache, bucket.chunks)
        k = k.view(bd, bucket.keys, kv_heads, dim).transpose(1, 2)
        v = v.view(bd, bucket.keys, kv_heads, dim).transpose(1, 2)
        mask = bucket.mask
        if q_dec.dtype != k.dtype:  # attention runs in the cache's dtype
            q_dec = q_dec.to(k.dtype)
        if softcap is None and sinks is None:
            # The query heads sharing a KV head become that head's query rows: no GQA expansion.
            qg = q_dec.reshape(bd, kv_heads, heads // kv_heads, dim)
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling)
        else:
            o = _attend(q_dec.unsqueeze(2), k, v, mask, scaling, softcap, False, sinks)
        o = o.reshape(bd, heads, dim)
        if o.dtype != out_dtype:
            o = o.to(out_dtype)
        if bucket.tokens is None:
            return o.unsqueeze(0), None
        if out is None:
            out = query.new_empty(num_tokens, heads, dim, dtype=out_dtype)
        out.index_copy_(0, bucket.tokens, o)
    if out is None:
        out = query.new_empty(num_tokens, heads, dim, dtype=out_dtype)
    for row in group.prefill:
        s, e = row.tok_start, row.tok_end
        q = query[:, :, s:e]
        if row.cached_end > row.cached_start:
            a, b = row.cached_start, row.cached_end
            k = torch.cat([cached_k[a:b], k_new[s:e]]).transpose(0, 1).unsqueeze(0)
            v = torch.cat([cached_v[a:b], v_new[s:e]]).transpose(0, 1).unsqueeze(0)
        else:
            k = key[:, :, s:e]
            v = value[:, :, s:e]
        # attention runs in the cache's dtype (the keys of a chunked prompt are rounded
        # alike whether they come from the cache or from this forward)
        dt = k_cache.dtype
        mask = row.mask
        if mask is not None and mask.dtype != dt:
            mask = mask.to(dt)
        o = _attend(q.to(dt), k.to(dt), v.to(dt), mask, scaling, softcap, row.causal, sinks)
        out[s:e] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                  torch.float16: "float16"}


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing `t`'s memory (bf16 / fp16 as their uint16 bit patterns)."""
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.uint16).numpy()


def _decode_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kd: _KernelDecode, out: torch.Tensor, page: int, scale: float,
                   softcap: float | None) -> None:
    from . import _core

    _core.paged_decode_attention(
        _numpy_view(q), _numpy_view(k_cache), _numpy_view(v_cache), kd.block_tables,
        kd.seqlens, _numpy_view(out), q_dtype=_KERNEL_DTYPES[q.dtype],
        cache_dtype=_KERNEL_DTYPES[k_cache.dtype], out_dtype=_KERNEL_DTYPES[out.dtype],
        page=page, window=kd.window, scale=float(scale), softcap=float(softcap or 0.0),
        threads=torch.get_num_threads(),
    )


# --- registration, switching, delegation -------------------------------------------------

_ORIGINAL: dict[int, str | None] = {}
_STATE = threading.local()


def _num_layers(step: PagedStep | KernelStep) -> int:
    return len(step.groups) if isinstance(step, PagedStep) else len(step.layer_types)


def _delegate(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    impl = _ORIGINAL.get(id(getattr(module, "config", None)), "sdpa")
    if impl in (None, "eager", ATTENTION_NAME):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        fn = fn or sdpa_attention_forward
    else:
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, sdpa_attention_forward)
    return fn(module, *args, **kwargs)


def paged_mask(*args: Any, config: PretrainedConfig | None = None, **kwargs: Any) -> Any:
    """Mask function: None inside a ferrobatch forward, else the model's own mask."""
    if getattr(_STATE, "depth", 0):
        return None
    impl = _ORIGINAL.get(id(config), "sdpa")
    fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl or "sdpa", sdpa_mask)
    if fn is paged_mask:
        fn = sdpa_mask
    return fn(*args, config=config, **kwargs)


CAST_NAME = "ferrobatch_cast"
_CAST_ORIGINAL: dict[int, str | None] = {}


def _own_attention(impl: str | None, module: torch.nn.Module) -> Any:
    if impl in (None, "eager", ATTENTION_NAME, CAST_NAME):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        return fn or sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, sdpa_attention_forward)


def cast_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The model's own attention with key and value cast to the query's dtype: for
    construction checks of forwards whose q / k / v dtypes differ (packed half-precision
    linears with an fp32 residual stream, `cpu_linear`)."""
    fn = _own_attention(_CAST_ORIGINAL.get(id(getattr(module, "config", None))), module)
    return fn(module, query, key.to(query.dtype), value.to(query.dtype), *args, **kwargs)


def cast_mask(*args: Any, config: PretrainedConfig | None = None, **kwargs: Any) -> Any:
    """The model's own mask function under `cast_attention_enabled`."""
    impl = _CAST_ORIGINAL.get(id(config)) or "sdpa"
    fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl, sdpa_mask)
    return fn(*args, config=config, **kwargs)


def register() -> None:
    """Register the paged attention and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
    AttentionInterface.register(CAST_NAME, cast_attention_forward)
    AttentionMaskInterface.register(CAST_NAME, cast_mask)


@contextmanager
def cast_attention_enabled(configs: Iterable[PretrainedConfig]) -> Iterator[None]:
    """Switch `configs` to `cast_attention_forward` for the block, then restore them."""
    saved = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
    for cfg, impl in saved:
        _CAST_ORIGINAL[id(cfg)] = impl
        cfg._attn_implementation_internal = CAST_NAME
    try:
        yield
    finally:
        for cfg, impl in saved:
            cfg._attn_implementation_internal = impl
            _CAST_ORIGINAL.pop(id(cfg), None)


def in_ferrobatch_forward() -> bool:
    """Whether the calling thread is inside a ferrobatch forward (`paged_attention_enabled`)."""
    return getattr(_STATE, "depth", 0) > 0


def model_configs(model: torch.nn.Module) -> list[PretrainedConfig]:
    """Every distinct config object reachable from `model` (its modules' and sub-configs)."""
    found: dict[int, PretrainedConfig] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        cfg = todo.pop()
        if not isinstance(cfg, PretrainedConfig) or id(cfg) in found:
            continue
        found[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            todo.append(getattr(cfg, key, None))
    return list(found.values())


@contextmanager
def paged_attention_enabled(
    configs: Iterable[PretrainedConfig], step: PagedStep | KernelStep | None = None
) -> Iterator[None]:
    """Switch `configs` to the paged attention for the duration of the block, then restore
    exactly what was there. `step`, when given, is also this thread's step for the block:
    attention calls that lost the `STEP_KWARG` forward kwarg (decoder layers that drop
    their **kwargs) use it."""
    saved = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
    for cfg, impl in saved:
        if impl != ATTENTION_NAME:
            _ORIGINAL[id(cfg)] = impl
        cfg._attn_implementation_internal = ATTENTION_NAME
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    prev_step = getattr(_STATE, "step", None)
    if step is not None:
        _STATE.step = step
    try:
        yield
    finally:
        _STATE.step = prev_step
        _STATE.depth -= 1
        for cfg, impl in saved:
            cfg._attn_implementation_internal = impl


def forget(configs: Iterable[PretrainedConfig]) -> None:
    """Drop the remembered implementations of `configs` (when a runner closes)."""
    for cfg in configs:
        _ORIGINAL.pop(id(cfg), None)


register()
