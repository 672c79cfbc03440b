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

Per layer and attention type the work is: gather the cached keys SDPA prefill rows need
(before any write: sliding rings may be overwritten by this step), write the step's new K/V
with the slot mapping, then the rows the CPU kernels take (single-token rows on the decode
kernel, multi-token rows on the tiled prefill kernel, both reading the cache in place), one
padded gather + one SDPA for the other single-token rows, and one SDPA per other
multi-token row. Never a mask across requests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ferrobatch.attention import context, kernels
from ferrobatch.attention.kernel_step import KernelStep
from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.attention.paged_step import PagedStep
from ferrobatch.attention.sdpa import attend
from ferrobatch.cpu import fused_ops
from ferrobatch.cpu.arrays import KERNEL_DTYPES


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
    step: PagedStep | KernelStep | None = kwargs.get(context.STEP_KWARG)
    if step is None:
        # A decoder layer that drops its **kwargs (Nemotron) loses the forward kwarg: the
        # step set for this thread's ferrobatch forward (never another thread's) stands in.
        step = getattr(context.STATE, "step", None)
        layer = getattr(module, "layer_idx", None)
        if step is None or not isinstance(layer, int) or not 0 <= layer < num_layers(step):
            return context.delegate(module, query, key, value, attention_mask, scaling=scaling,
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
        out = kernels.kernel_attention(step, layer, query, key, value, scaling, softcap or None)
        return out, None
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
    cache = step.cache
    dt = cache.dtype  # attention runs in the cache's compute dtype (an int8 cache's too)
    k_new, v_new = k_new.to(dt), v_new.to(dt)  # no-ops when equal

    cached_k = cached_v = None
    if group.prefill_cached_slots is not None:
        # (an int8 cache: only these slots are dequantized)
        cached_k, cached_v = cache.gather_buffers(1, group.prefill_cached_slots.shape[0])
        cache.read_slots(layer, group.prefill_cached_slots, cached_k, cached_v)
    write_layer(cache, layer, group.slot_mapping, k_new, v_new)

    out = None
    out_dtype = step.out_dtype or query.dtype
    for rows, run, path in ((group.kernel_decode, _kernel_rows, "decode"),
                            (group.kernel_prefill, _prefill_rows, "prefill")):
        if rows is None:
            continue
        if sinks is not None:
            raise NotImplementedError(f"attention sinks need the SDPA {path} path")
        o = run(step, layer, _kernel_queries(q_all, rows.tokens), scaling, softcap, out_dtype)
        if rows.tokens is None:
            return o.unsqueeze(0), None
        if out is None:
            out = query.new_empty(num_tokens, heads, dim, dtype=out_dtype)
        out.index_copy_(0, rows.tokens, o)
    for bucket in group.decode:
        bd = bucket.rows
        if bucket.tokens is None:
            q_dec = q_all.transpose(0, 1)  # [Bd, H, D]
        else:
            q_dec = q_all.index_select(1, bucket.tokens).transpose(0, 1)
        k, v = cache.gather_chunks(k_cache, v_cache, bucket.chunks, layer)
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
            o = attend(q_dec.unsqueeze(2), k, v, mask, scaling, softcap, False, sinks)
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
    wr = group.window_rows
    if wr is not None:
        o = _window_rows(step, wr, q_all, k_new, v_new, cached_k, cached_v, scaling,
                         softcap, out_dtype)
        out.index_copy_(0, wr.kernel.tokens, o)
    # attention runs in the cache's dtype (the keys of a chunked prompt are rounded alike
    # whether they come from the cache or from this forward): each operand converted once
    if group.prefill:
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
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
        mask = row.mask
        if mask is not None and mask.dtype != dt:
            mask = mask.to(dt)
        o = attend(q, k, v, mask, scaling, softcap, row.causal, sinks)
        out[s:e] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def kernel_only_group(step: Any, layer: int, prefill: bool = False) -> Any:
    """The step's metadata for `layer`'s attention type when every row of the layer goes to
    the CPU decode kernel (no SDPA rows, no gathered prompt keys), or with `prefill` to the
    CPU kernels (decode and prefill); None otherwise, or when `step` is not a
    `PagedStep`."""
    if not isinstance(step, PagedStep):
        return None
    group = step.groups[layer]
    if group.decode or group.prefill or group.prefill_cached_slots is not None \
            or group.window_rows is not None:
        return None
    kd, kp = group.kernel_decode, group.kernel_prefill
    if kp is None:
        return group if kd is not None and kd.tokens is None else None
    return group if prefill else None


def kernel_only_attention(step: Any, layer: int, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, scaling: float,
                          softcap: float | None = None) -> torch.Tensor | None:
    """`paged_attention_forward` of a layer whose every row this step goes to the CPU
    kernels (decode rows on the decode kernel, prompt rows on the prefill kernel), without
    the attention interface's reshaping: writes the keys `k` and values `v` [T, Hkv, D] at
    their slots, then attends (scores capped at `softcap`, where given); the output is
    [T, H, D] in the step's output dtype. None
    (nothing written) when the layer's rows need the general path, or `q` [T, H, D] is not
    a contiguous fp32 / bf16 / fp16 tensor."""
    group = kernel_only_group(step, layer, prefill=True)
    if group is None or q.dtype not in KERNEL_DTYPES or not q.is_contiguous():
        return None
    softcap = softcap or None
    step.calls += 1
    dt = step.cache.dtype
    write_layer(step.cache, layer, group.slot_mapping, k.to(dt), v.to(dt))
    out_dtype = step.out_dtype or q.dtype
    kd, kp = group.kernel_decode, group.kernel_prefill
    if kp is None:
        return _kernel_rows(step, layer, q, scaling, softcap, out_dtype)
    if kd is None and kp.tokens is None:
        return _prefill_rows(step, layer, q, scaling, softcap, out_dtype)
    out = q.new_empty(q.shape, dtype=out_dtype)
    for part, rows in ((kd, _kernel_rows), (kp, _prefill_rows)):
        if part is not None:
            out.index_copy_(0, part.tokens, rows(step, layer, q.index_select(0, part.tokens),
                                                 scaling, softcap, out_dtype))
    return out


def _kernel_rows(step: PagedStep, layer: int, q: torch.Tensor, scaling: float,
                 softcap: float | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The CPU kernel's attention for the kernel rows of `layer` (queries `q` [R, H, D],
    contiguous, in a kernel dtype), in `out_dtype`."""
    cache = step.cache
    scales = (cache.key_scales[layer], cache.value_scales[layer]) if cache.quantized \
        else None
    return _kernel_call(q, cache.keys[layer], cache.values[layer],
                        step.groups[layer].kernel_decode, cache.page_size, scaling, softcap,
                        out_dtype, scales)


def _kernel_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kd: Any, page: int,
                 scaling: float, softcap: float | None, out_dtype: torch.dtype,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The CPU kernel over the rows `kd` of the paged keys `k` and values `v`, in
    `out_dtype`."""
    o = torch.empty(q.shape, dtype=out_dtype if out_dtype in KERNEL_DTYPES
                    else torch.float32)
    kernels.decode_kernel(q, k, v, kd, o, page, scaling, softcap, scales)
    return o.to(out_dtype)


def _kernel_queries(q_all: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """The queries of the step tokens `tokens` (None: all) from `q_all` [H, T, D], as the CPU
    kernels take them: [N, H, D], contiguous, in a kernel dtype (else fp32)."""
    q = q_all.transpose(0, 1) if tokens is None else q_all.index_select(1, tokens).transpose(0, 1)
    return (q if q.dtype in KERNEL_DTYPES else q.float()).contiguous()


def _window_rows(step: PagedStep, wr: Any, q_all: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor, cached_k: torch.Tensor | None,
                 cached_v: torch.Tensor | None, scaling: float, softcap: float | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Batch-invariant mode's sliding multi-token rows (`paged_step._WindowRows`): their
    window keys copied to a scratch cache (cached ones gathered before this step's write,
    new ones from `k_new` / `v_new` [T, Hkv, D]), each token attended there by the CPU
    kernel (queries from `q_all` [H, T, D]); the output is [N, H, D] in `out_dtype`."""
    page = step.cache.page_size
    scratch_k = k_new.new_zeros(wr.chunks * page, *k_new.shape[1:])
    scratch_v = torch.zeros_like(scratch_k)
    if wr.cached_dest is not None:
        n = wr.cached_dest.shape[0]
        scratch_k.index_copy_(0, wr.cached_dest, cached_k[:n])
        scratch_v.index_copy_(0, wr.cached_dest, cached_v[:n])
    scratch_k.index_copy_(0, wr.new_dest, k_new.index_select(0, wr.new_tokens))
    scratch_v.index_copy_(0, wr.new_dest, v_new.index_select(0, wr.new_tokens))
    return _kernel_call(_kernel_queries(q_all, wr.kernel.tokens), scratch_k, scratch_v,
                        wr.kernel, page, scaling, softcap, out_dtype)


def _prefill_rows(step: PagedStep, layer: int, q: torch.Tensor, scaling: float,
                  softcap: float | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The CPU prefill kernel's attention for the prompt rows of `layer` (their tokens'
    queries `q` [Tp, H, D], contiguous, in a kernel dtype), in `out_dtype`."""
    cache = step.cache
    o = torch.empty(q.shape, dtype=out_dtype if out_dtype in KERNEL_DTYPES
                    else torch.float32)
    scales = (cache.key_scales[layer], cache.value_scales[layer]) if cache.quantized \
        else None
    kernels.prefill_kernel(q, cache.keys[layer], cache.values[layer],
                           step.groups[layer].kernel_prefill, o, cache.page_size, scaling,
                           softcap, scales)
    return o.to(out_dtype)


def write_layer(cache: PagedKVCache, layer: int, slots: torch.Tensor, k_new: torch.Tensor,
                v_new: torch.Tensor) -> None:
    """Write the step's keys and values [T, Hkv, D] (in the cache's compute dtype) at their
    slots of layer `layer` (an int8 cache quantizes them once, here)."""
    if cache.quantized:
        cache.write(layer, slots, k_new, v_new)
    else:
        write_kv(cache.keys[layer], cache.values[layer], slots, k_new, v_new)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    """Write the step's keys and values [T, Hkv, D] at their cache slots (one fused row copy
    each on CPU, else `index_copy_`)."""
    if fused_ops.available() and fused_ops.handles(k_cache, v_cache, k_new, v_new):
        tokens = k_new.shape[0]
        for new, cache in ((k_new, k_cache), (v_new, v_cache)):
            rows = new.reshape(tokens, -1)
            fused_ops.write_rows(rows if rows.is_contiguous() else rows.contiguous(),
                                 cache.view(cache.shape[0], -1), slots)
        return
    k_cache.index_copy_(0, slots, k_new)
    v_cache.index_copy_(0, slots, v_new)


def num_layers(step: PagedStep | KernelStep) -> int:
    return len(step.groups) if isinstance(step, PagedStep) else len(step.layer_types)
