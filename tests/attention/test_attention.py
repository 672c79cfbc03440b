"""paged_attention_forward on random tensors vs a naive per-row attention."""

from __future__ import annotations

import inspect
import random
from types import SimpleNamespace

import pytest
import torch
from ferrobatch.attention import context, forward, paged_step, registry
from ferrobatch.attention.kv_cache import PagedKVCache
from ref_planner import RefPlanner

torch.set_num_threads(1)


def _naive(q, hist_k, hist_v, positions, window, scale, softcap):
    """q [H, n, D] at `positions`; hist_k/v [P, Hkv, D] of positions 0..P-1 -> [n, H, D]."""
    heads, kv_heads = q.shape[0], hist_k.shape[1]
    g = heads // kv_heads
    out = torch.empty(q.shape[1], heads, q.shape[2], dtype=torch.float64)
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1) if window else 0
        k = hist_k[lo:p + 1].double()
        v = hist_v[lo:p + 1].double()
        for h in range(heads):
            s = (k[:, h // g] @ q[h, i].double()) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, 0) @ v[:, h // g]
    return out


@pytest.mark.parametrize(
    "window,softcap,heads,kv_heads,page",
    [(None, None, 4, 2, 4), (5, None, 4, 2, 4), (None, 3.0, 4, 4, 8), (6, 2.0, 6, 2, 4),
     (3, None, 2, 1, 4)],
)
@pytest.mark.parametrize("kernel", ["sdpa", "decode", "prefill"])
def test_paged_attention_matches_naive(window, softcap, heads, kv_heads, page, kernel,
                                       monkeypatch):
    """Gather + SDPA, or the CPU kernels: decode rows on the decode kernel, and ("prefill")
    multi-token rows on the prefill kernel (on sliding attention those whose keys the ring
    still holds after the step's write; the others keep SDPA)."""
    monkeypatch.setattr(paged_step, "_BUCKET_PENALTY_KEYS", 0)  # split decode rows in buckets
    rng = random.Random(7)
    torch.manual_seed(0)
    dim, num_blocks, scale = 16, 400, 0.3
    typ = "sliding_attention" if window else "full_attention"
    cache = PagedKVCache(num_layers=1, num_blocks=num_blocks, page_size=page,
                         num_kv_heads=kv_heads, head_dim=dim)
    planner = RefPlanner(page_size=page, num_blocks=num_blocks, layer_types=[typ],
                         sliding_window=window)
    module = SimpleNamespace(layer_idx=0, scaling=scale)
    n_req = 14
    hist = {}
    for i in range(n_req):
        planner.add(f"r{i}", [5] * rng.randint(2, 30))
        hist[f"r{i}"] = (torch.empty(0, kv_heads, dim), torch.empty(0, kv_heads, dim))
    tiled_rows = sdpa_rows = 0
    for step in range(9):
        rows = []
        for i in range(n_req):
            rid = f"r{i}"
            rem = planner.remaining(rid)
            if rem == 0:
                planner.append(rid, 5)
                rem = 1
            if step >= 7:  # decode-only steps
                rows.append((rid, 1))
            elif (i + step) % 5 != 4:
                rows.append((rid, min(rem, rng.choice([1, 2, 7, 13]))))
        plan = planner.plan(rows)
        t = len(plan.input_ids)
        q = torch.randn(1, heads, t, dim)
        k = torch.randn(1, kv_heads, t, dim)
        v = torch.randn(1, kv_heads, t, dim)
        step_meta = paged_step.build_step(plan, cache, [typ], window,
                                          decode_kernel=kernel != "sdpa",
                                          prefill_kernel=kernel == "prefill")
        group = step_meta.groups[0]
        lens = torch.tensor(plan.cu_seqlens_q).diff()
        multi = int((lens > 1).sum())
        kp = group.kernel_prefill
        tiled = 0 if kp is None else len(kp.seqlens)
        assert tiled + len(group.prefill) == multi
        if kernel != "prefill":
            assert tiled == 0
        if kernel != "sdpa" and (lens == 1).any():
            assert group.kernel_decode is not None
            assert len(group.kernel_decode.seqlens) == int((lens == 1).sum())
        if kernel == "prefill" and not window:
            assert not group.prefill
        tiled_rows += tiled
        sdpa_rows += len(group.prefill)
        out, _ = forward.paged_attention_forward(
            module, q, k, v, None, scaling=scale, softcap=softcap,
            **{context.STEP_KWARG: step_meta},
        )
        assert out.shape == (1, t, heads, dim)
        for b, rid in enumerate(plan.request_ids):
            s, e = int(plan.cu_seqlens_q[b]), int(plan.cu_seqlens_q[b + 1])
            hk, hv = hist[rid]
            hk = torch.cat([hk, k[0, :, s:e].transpose(0, 1)])
            hv = torch.cat([hv, v[0, :, s:e].transpose(0, 1)])
            hist[rid] = (hk, hv)
            ref = _naive(q[0, :, s:e], hk, hv, plan.positions[s:e].tolist(), window, scale,
                         softcap)
            torch.testing.assert_close(out[0, s:e].double(), ref, atol=1e-5, rtol=1e-5)
    if kernel == "prefill":  # both routes of a prompt row ran (sliding: long rows on SDPA)
        assert tiled_rows and (sdpa_rows or not window)


def test_decode_buckets_cover_every_row_once():
    width = torch.randint(1, 40, (37,)).numpy()
    parts = paged_step._buckets(width, 16)
    assert sorted(int(i) for p in parts for i in p) == list(range(37))
    assert len(paged_step._buckets(width[:5], 16)) == 1


def test_mask_function_returns_none_only_inside_a_ferrobatch_forward():
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                      intermediate_size=32, vocab_size=50)
    cfg._attn_implementation = "sdpa"
    emb = torch.zeros(1, 5, 32)
    mask2d = torch.tensor([[0, 1, 1, 1, 1]])
    # the cache argument is `cache` in transformers 5.2x, `past_key_values` in 5.17
    params = inspect.signature(create_causal_mask).parameters
    no_cache = {"cache" if "cache" in params else "past_key_values": None}
    kwargs = dict(config=cfg, inputs_embeds=emb, attention_mask=mask2d,
                  position_ids=torch.arange(5)[None], **no_cache)
    ref = create_causal_mask(**kwargs)
    with registry.paged_attention_enabled([cfg]):
        assert create_causal_mask(**kwargs) is None
    assert cfg._attn_implementation == "sdpa"
    again = create_causal_mask(**kwargs)
    assert torch.equal(again, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_storage_starts_zero_and_takes_writes(dtype):
    """The CPU cache comes from lazily zeroed pages: it must read as zeros of its dtype and
    shape, be one contiguous writable tensor, and its views must alias it."""
    cache = PagedKVCache(num_layers=3, num_blocks=5, page_size=4, num_kv_heads=2, head_dim=8,
                         dtype=dtype)
    assert cache.storage.dtype == dtype and cache.storage.is_contiguous()
    assert cache.storage.shape == (3, 2, cache.num_slots, 2, 8)
    assert not cache.storage.any()
    cache.values[2][7].fill_(1.5)
    assert cache.storage[2, 1, 7].eq(1.5).all() and cache.storage.count_nonzero() == 16
    assert cache.nbytes == cache.storage.numel() * torch.empty((), dtype=dtype).element_size()
