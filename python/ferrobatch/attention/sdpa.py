"""Attention of packed rows through SDPA, with softcapping and attention sinks when a model
has them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
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
