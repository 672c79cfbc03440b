"""ferrobatch.cuda.triton_attention: the Triton paged kernels against the torch reference,
and the reference against a naive per-query loop.

Without CUDA the Triton kernels run under triton's interpreter (`TRITON_INTERPRET=1`, set
here before the kernels are defined) on CPU tensors; with CUDA they run compiled on the GPU.
Tests that need triton are skipped when it is not installed. Shapes are tiny: the
interpreter executes every program in Python.
"""

from __future__ import annotations

import os
import random
import sys
import types

import numpy as np
import pytest
import torch


def _reimport_triton_for_interpreter() -> None:
    """triton's interpreter only works when TRITON_INTERPRET=1 was set before `triton` was
    imported: triton.language's own @jit helpers (tl.zeros, tl.sum, ...) are decorated at
    import. When another module imported it first (transformers does, in a full test run),
    drop triton's Python modules (never its native `triton._C`) and ferrobatch.cuda, so the
    imports below happen again in interpreter mode. Earlier importers keep their copies."""
    lang = sys.modules.get("triton.language")
    if lang is None or type(getattr(lang, "zeros", None)).__name__ == "InterpretedFunction":
        return
    for name in list(sys.modules):
        if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C"):
            del sys.modules[name]
        elif name == "ferrobatch.cuda" or name.startswith("ferrobatch.cuda."):
            del sys.modules[name]


if not torch.cuda.is_available():
    # Before ferrobatch.cuda defines its kernels: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        _reimport_triton_for_interpreter()

from ferrobatch.cuda import triton_attention as ta  # noqa: E402
from ref_planner import FULL, SLIDING, RefPlanner  # noqa: E402

torch.set_num_threads(1)


def _kernel_device() -> torch.device | None:
    """Where the kernels can run: CPU when they are interpreted, CUDA when compiled."""
    if not ta.HAS_TRITON:
        return None
    if type(ta._decode_kernel).__name__ == "InterpretedFunction":
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else None


KERNEL_DEV = _kernel_device()
DEV = KERNEL_DEV or torch.device("cpu")
needs_triton = pytest.mark.skipif(not ta.HAS_TRITON, reason="triton is not installed")
needs_kernels = pytest.mark.skipif(
    KERNEL_DEV is None,
    reason="kernels compiled (TRITON_INTERPRET was not set before ferrobatch.cuda was "
    "imported) and no CUDA device to run them on",
)


def _randn(*shape: int) -> torch.Tensor:
    """Seeded on the CPU (same values everywhere), then on the test device."""
    return torch.randn(*shape).to(DEV)


def _naive(q, hist_k, hist_v, positions, window, scale, softcap):
    """q [n, H, D] at `positions` over history K/V [P, Hkv, D] -> [n, H, D] (float64)."""
    heads, kv_heads = q.shape[1], hist_k.shape[1]
    g = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1) if window else 0
        for h in range(heads):
            k = hist_k[lo : p + 1, h // g].double()
            s = (k @ q[i, h].double()) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, 0) @ hist_v[lo : p + 1, h // g].double()
    return out


def _cache(page: int, kv_heads: int, dim: int, num_blocks: int = 60, seed: int = 0,
           device: torch.device | str | None = None):
    """Random slot tensors (garbage everywhere a wrong read could land) with chunk 0 zero."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((num_blocks + 2) * page, kv_heads, dim, generator=g)
    v = torch.randn((num_blocks + 2) * page, kv_heads, dim, generator=g)
    k[:page] = 0
    v[:page] = 0
    return k.to(device or DEV), v.to(device or DEV)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


def _scenario(planner: RefPlanner, rng: random.Random, prompt_lens, steps: int):
    """Yield plans: chunked prefills of mixed sizes, then mixed and decode-only steps."""
    rids = [f"r{i}" for i in range(len(prompt_lens))]
    for rid, n in zip(rids, prompt_lens, strict=True):
        planner.add(rid, [7] * n)
    for step in range(steps):
        rows = []
        for i, rid in enumerate(rids):
            rem = planner.remaining(rid)
            if rem == 0:
                planner.append(rid, 7)
                rem = 1
            if step >= steps - 2:
                rows.append((rid, 1))  # decode-only steps at the end
            elif (i + step) % 4 != 3:
                rows.append((rid, min(rem, rng.choice([1, 3, 6, 13, 40]))))
        yield planner.plan(rows)


def _max_q(plan) -> int:
    return int(np.diff(plan.cu_seqlens_q).max())


CASES = [
    # window, softcap, heads, kv_heads, page, dim, splits
    pytest.param(None, None, 4, 2, 4, 16, 1, id="full-gqa"),
    pytest.param(None, None, 4, 2, 4, 16, 3, id="full-gqa-3splits"),
    pytest.param(5, None, 4, 2, 4, 16, 2, id="sliding5-page4"),
    pytest.param(6, 2.0, 6, 2, 4, 16, 1, id="sliding6-softcap"),
    pytest.param(None, 3.0, 4, 4, 8, 24, 2, id="full-mha-softcap-dim24"),
    pytest.param(3, None, 2, 1, 4, 16, 4, id="sliding3-mqa-4splits"),
]


@pytest.mark.parametrize("window,softcap,heads,kv_heads,page,dim,splits", CASES)
def test_reference_matches_naive(window, softcap, heads, kv_heads, page, dim, splits):
    """The oracle itself: reference (before the write) vs a per-query loop over history."""
    rng = random.Random(3)
    torch.manual_seed(1)
    typ = SLIDING if window else FULL
    planner = RefPlanner(page_size=page, num_blocks=60, layer_types=[typ], sliding_window=window)
    k_cache, v_cache = _cache(page, kv_heads, dim)
    hist: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for plan in _scenario(planner, rng, [1, 4, 5, 9, 17], steps=4):
        t = len(plan.input_ids)
        q = _randn(t, heads, dim)
        kn, vn = _randn(t, kv_heads, dim), _randn(t, kv_heads, dim)
        out = ta.reference_paged_attention(
            q, kn, vn, k_cache, v_cache, _t(plan.block_tables[typ]), _t(plan.cu_seqlens_q),
            _t(plan.seqlens_k), page_size=page, scale=0.3, softcap=softcap,
            sliding_window=window,
        )
        ta.write_kv(k_cache, v_cache, kn, vn, _t(plan.slot_mapping[typ]))
        for b, rid in enumerate(plan.request_ids):
            s, e = int(plan.cu_seqlens_q[b]), int(plan.cu_seqlens_q[b + 1])
            hk, hv = hist.get(rid, (kn[:0], vn[:0]))
            hk, hv = torch.cat([hk, kn[s:e]]), torch.cat([hv, vn[s:e]])
            hist[rid] = (hk, hv)
            ref = _naive(q[s:e], hk, hv, plan.positions[s:e].tolist(), window, 0.3, softcap)
            torch.testing.assert_close(out[s:e].double(), ref, atol=1e-5, rtol=1e-5)


@needs_triton
@needs_kernels
@pytest.mark.parametrize("window,softcap,heads,kv_heads,page,dim,splits", CASES)
def test_triton_matches_reference(window, softcap, heads, kv_heads, page, dim, splits):
    """Chunked prefill (chunks longer than the sliding ring), mixed and decode-only steps,
    rows of 1..17+ keys across page boundaries: Triton path vs reference, outputs and the
    cache contents after the step's write."""
    rng = random.Random(5)
    torch.manual_seed(2)
    typ = SLIDING if window else FULL
    planner = RefPlanner(page_size=page, num_blocks=60, layer_types=[typ], sliding_window=window)
    k_ref, v_ref = _cache(page, kv_heads, dim)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    for plan in _scenario(planner, rng, [1, 4, 5, 9, 17], steps=4):
        t = len(plan.input_ids)
        q = _randn(t, heads, dim)
        kn, vn = _randn(t, kv_heads, dim), _randn(t, kv_heads, dim)
        meta = (_t(plan.block_tables[typ]), _t(plan.cu_seqlens_q), _t(plan.seqlens_k))
        ref = ta.reference_paged_attention(
            q, kn, vn, k_ref, v_ref, *meta, page_size=page, scale=0.3, softcap=softcap,
            sliding_window=window,
        )
        ta.write_kv(k_ref, v_ref, kn, vn, _t(plan.slot_mapping[typ]))
        got = ta.paged_attention(
            q, kn, vn, k_tri, v_tri, _t(plan.slot_mapping[typ]), *meta,
            max_seqlen_q=_max_q(plan), page_size=page, scale=0.3, softcap=softcap,
            sliding_window=window, num_splits=splits, block_m=16, block_n=16,
        )
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    assert not k_tri[:page].any(), "the zero chunk was written"


@needs_triton
@needs_kernels
@pytest.mark.parametrize("window", [None, 7])
def test_split_decode_long_context_every_split_count(window):
    """One long row and two short ones: 1, 2, 4 and 8 splits (more splits than key tiles:
    empty splits must merge to nothing) all agree with the reference."""
    page, heads, kv_heads, dim = 4, 4, 2, 16
    typ = SLIDING if window else FULL
    planner = RefPlanner(page_size=page, num_blocks=60, layer_types=[typ], sliding_window=window)
    k_cache, v_cache = _cache(page, kv_heads, dim, seed=4)
    planner.add("long", [7] * 69)
    planner.add("one", [7])
    planner.add("two", [7] * 2)
    torch.manual_seed(3)
    plan = planner.plan([("long", 69), ("one", 1), ("two", 2)])
    t = len(plan.input_ids)
    kn, vn = _randn(t, kv_heads, dim), _randn(t, kv_heads, dim)
    ta.write_kv(k_cache, v_cache, kn, vn, _t(plan.slot_mapping[typ]))
    for rid in ("long", "one", "two"):
        planner.append(rid, 7)
    plan = planner.plan([("long", 1), ("one", 1), ("two", 1)])
    q = _randn(3, heads, dim)
    kn, vn = _randn(3, kv_heads, dim), _randn(3, kv_heads, dim)
    meta = (_t(plan.block_tables[typ]), _t(plan.cu_seqlens_q), _t(plan.seqlens_k))
    ref = ta.reference_paged_attention(
        q, kn, vn, k_cache, v_cache, *meta, page_size=page, scale=0.25, sliding_window=window
    )
    ta.write_kv(k_cache, v_cache, kn, vn, _t(plan.slot_mapping[typ]))
    for splits in (1, 2, 4, 8):
        got = ta.paged_decode_attention(
            q, k_cache, v_cache, *meta, page_size=page, scale=0.25, sliding_window=window,
            num_splits=splits, block_n=16,
        )
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@needs_triton
@needs_kernels
def test_kernels_leave_other_rows_and_padding_alone():
    """Decode skips multi-token rows, prefill skips single-token rows, neither writes tokens
    beyond cu_seqlens_q[-1]; an empty row (no query token) and a row whose only key sits in
    the zero chunk give no NaN."""
    page, heads, kv_heads, dim = 4, 2, 1, 16
    k_cache, v_cache = _cache(page, kv_heads, dim, seed=6)
    i32 = dict(dtype=torch.int32, device=DEV)
    tables = torch.tensor([[2, 3], [4, 0], [0, 0], [0, 0]], **i32)
    cu = torch.tensor([0, 3, 4, 5, 5], **i32)  # rows: prefill 3, decode, pad, empty
    lens = torch.tensor([5, 6, 1, 0], **i32)
    q = _randn(7, heads, dim)  # tokens 5, 6: beyond the rows
    kn, vn = _randn(7, kv_heads, dim), _randn(7, kv_heads, dim)
    sentinel = torch.full((7, heads, dim), 123.0, device=DEV)
    dec = ta.paged_decode_attention(
        q, k_cache, v_cache, tables, cu, lens, page_size=page, scale=0.5, num_splits=2,
        block_n=16, out=sentinel.clone(),
    )
    assert torch.equal(dec[:3], sentinel[:3]) and torch.equal(dec[5:], sentinel[5:])
    assert not dec[4].any(), "a zero-chunk key must give zeros"
    pre = ta.paged_prefill_attention(
        q, kn, vn, k_cache, v_cache, tables, cu, lens, max_seqlen_q=3, page_size=page,
        scale=0.5, block_m=16, block_n=16, out=sentinel.clone(),
    )
    assert torch.equal(pre[3:], sentinel[3:])
    ref = ta.reference_paged_attention(
        q, kn, vn, k_cache, v_cache, tables, cu, lens, page_size=page, scale=0.5
    )
    torch.testing.assert_close(pre[:3], ref[:3], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(dec).all() and torch.isfinite(pre).all()


@pytest.mark.parametrize("window,softcap", [(None, None), (5, 2.0)])
def test_static_decode_matches_reference(window, softcap):
    """The graph-capturable torch decode (fixed gather of max_seqlen_k keys) vs the
    reference; and with max_seqlen_k below the true length it reads too few keys (why the
    graph key must hold it)."""
    page, heads, kv_heads, dim = 4, 4, 2, 8
    typ = SLIDING if window else FULL
    planner = RefPlanner(page_size=page, num_blocks=60, layer_types=[typ], sliding_window=window)
    k_cache, v_cache = _cache(page, kv_heads, dim, seed=8)
    torch.manual_seed(4)
    for i, n in enumerate([1, 6, 11, 30]):
        planner.add(f"r{i}", [7] * n)
    plan = planner.plan([(f"r{i}", n) for i, n in enumerate([1, 6, 11, 30])])
    t = len(plan.input_ids)
    ta.write_kv(k_cache, v_cache, _randn(t, kv_heads, dim), _randn(t, kv_heads, dim),
                _t(plan.slot_mapping[typ]))
    for i in range(4):
        planner.append(f"r{i}", 7)
    plan = planner.plan([(f"r{i}", 1) for i in range(4)])
    q = _randn(4, heads, dim)
    kn, vn = _randn(4, kv_heads, dim), _randn(4, kv_heads, dim)
    meta = (_t(plan.block_tables[typ]), _t(plan.cu_seqlens_q), _t(plan.seqlens_k))
    ref = ta.reference_paged_attention(q, kn, vn, k_cache, v_cache, *meta, page_size=page,
                                       scale=0.3, softcap=softcap, sliding_window=window)
    ta.write_kv(k_cache, v_cache, kn, vn, _t(plan.slot_mapping[typ]))
    got = ta.static_decode_attention(q, k_cache, v_cache, *meta, max_seqlen_k=32,
                                     page_size=page, scale=0.3, softcap=softcap,
                                     sliding_window=window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if not window:
        short = ta.static_decode_attention(q, k_cache, v_cache, *meta, max_seqlen_k=16,
                                           page_size=page, scale=0.3)
        assert not torch.allclose(short[3], ref[3], atol=1e-3)  # the 31-key row truncated
        torch.testing.assert_close(short[:3], ref[:3], atol=1e-5, rtol=1e-5)


def test_select_backend(monkeypatch):
    assert ta.select_backend("cpu") == "torch"
    monkeypatch.setattr(ta, "flash_attn_available", lambda: True)
    monkeypatch.setattr(ta, "HAS_TRITON", True)
    assert ta.select_backend("cuda") == "flash_attn"
    assert ta.select_backend("cuda", page_size=512) == "flash_attn"
    assert ta.select_backend("cuda", page_size=32) == "triton"  # flash-attn 2 needs % 256
    assert ta.select_backend("cuda", dtype=torch.bfloat16) == "flash_attn"
    assert ta.select_backend("cuda", dtype=torch.float32) == "triton"  # no fp32 flash-attn
    monkeypatch.setattr(ta, "flash_attn_available", lambda: False)
    assert ta.select_backend(torch.device("cuda", 0)) == "triton"
    monkeypatch.setattr(ta, "HAS_TRITON", False)
    assert ta.select_backend("cuda") == "torch"
    assert ta.select_backend("cpu") == "torch"


def test_choose_num_splits():
    assert ta.choose_num_splits(256, 8, 4096) == 1  # plenty of programs already
    assert ta.choose_num_splits(1, 1, 10_000, block_n=64) == 16  # capped
    assert ta.choose_num_splits(1, 2, 100, block_n=64) == 2  # no more splits than tiles
    for rows in range(1, 70, 7):
        for keys in (1, 63, 64, 1000, 33_000):
            n = ta.choose_num_splits(rows, 2, keys)
            assert n >= 1 and n & (n - 1) == 0


def test_flash_attn_wrapper_plumbing(monkeypatch):
    """The flash-attn wrapper's arguments (paged views, int32 cumulative key lengths, causal,
    scale, softcap) checked against a fake flash_attn module computing the documented
    semantics in torch; the real kernel is only exercised by benches/gpu_check.py."""
    page, heads, kv_heads, dim = 256, 2, 1, 8
    calls = {}

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
                    causal=False, softcap=0.0, block_table=None, **kw):
        calls.update(cu_k=cu_k.clone(), max_k=max_k, causal=causal, softcap=softcap)
        assert k.shape[1:] == (page, kv_heads, dim) and block_table.dtype == torch.int32
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        slots_k = k.reshape(-1, kv_heads, dim)
        slots_v = v.reshape(-1, kv_heads, dim)
        out = torch.zeros_like(q)
        for r in range(len(cu_q) - 1):
            qs, qe = int(cu_q[r]), int(cu_q[r + 1])
            nk = int(cu_k[r + 1] - cu_k[r])
            pos = torch.arange(nk)
            slots = block_table[r].long()[pos // page] * page + pos % page
            kk = slots_k[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
            vv = slots_v[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
            s = q[qs:qe].transpose(0, 1) @ kk.transpose(1, 2) * softmax_scale
            qpos = torch.arange(nk - (qe - qs), nk)[:, None]
            s = s.masked_fill(pos[None, :] > qpos, float("-inf"))
            out[qs:qe] = (torch.softmax(s, -1) @ vv).transpose(0, 1)
        return out

    def fake_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                     softmax_scale=None, causal=False, softcap=0.0, num_splits=0, **kw):
        calls["kvcache"] = True
        assert q.dim() == 4 and q.shape[1] == 1 and cache_seqlens.dtype == torch.int32
        rows = q.shape[0]
        cu_q = torch.arange(rows + 1, dtype=torch.int32)
        cu_k = torch.zeros(rows + 1, dtype=torch.int32)
        cu_k[1:] = torch.cumsum(cache_seqlens, 0)
        return fake_varlen(q[:, 0], k_cache, v_cache, cu_q, cu_k, 1, int(cache_seqlens.max()),
                           softmax_scale=softmax_scale, causal=causal, softcap=softcap,
                           block_table=block_table)[:, None]

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_varlen_func=fake_varlen, flash_attn_with_kvcache=fake_kvcache))
    k_cache, v_cache = _cache(page, kv_heads, dim, num_blocks=3, seed=9, device="cpu")
    tables = torch.tensor([[2, 3], [4, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    lens = torch.tensor([300, 5], dtype=torch.int32)
    q = torch.randn(4, heads, dim)
    got = ta.paged_attention(
        q, torch.zeros(4, kv_heads, dim), torch.zeros(4, kv_heads, dim), k_cache, v_cache,
        torch.tensor([page, page + 1, page + 2, page + 3]),  # writes to scratch
        tables, cu, lens, max_seqlen_q=3, max_seqlen_k=300, page_size=page, scale=0.4,
        backend="flash_attn",
    )
    assert calls["cu_k"].tolist() == [0, 300, 305] and calls["max_k"] == 300
    assert calls["causal"] is True and calls["softcap"] == 0.0
    # The same rows through the reference: new keys are the cache's own (written) slots.
    new_slots = [3 * page + 41, 3 * page + 42, 3 * page + 43, 4 * page + 4]  # positions 297..299, 4
    kn, vn = k_cache[new_slots], v_cache[new_slots]
    ref = ta.reference_paged_attention(q, kn, vn, k_cache, v_cache, tables, cu, lens,
                                       page_size=page, scale=0.4)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # A decode-only step goes through flash_attn_with_kvcache.
    dec_cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    got = ta.paged_attention(
        q[2:], torch.zeros(2, kv_heads, dim), torch.zeros(2, kv_heads, dim), k_cache, v_cache,
        torch.tensor([page, page + 1]), tables, dec_cu, lens, max_seqlen_q=1, page_size=page,
        scale=0.4, backend="flash_attn",
    )
    assert calls.get("kvcache")
    kn, vn = k_cache[[3 * page + 43, 4 * page + 4]], v_cache[[3 * page + 43, 4 * page + 4]]
    ref = ta.reference_paged_attention(q[2:], kn, vn, k_cache, v_cache, tables, dec_cu, lens,
                                       page_size=page, scale=0.4)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_triton
@needs_kernels
def test_sliding_chunk_longer_than_ring_reads_cached_keys_before_the_write():
    """w=5, page 4 (ring of 3 chunks): a 13-token chunk after 7 cached tokens overwrites
    ring slots its first queries still need. Prefill before the write (as `paged_attention`
    does) matches the reference; prefill after the write would not."""
    page, heads, kv_heads, dim, w = 4, 4, 2, 16, 5
    typ = SLIDING
    planner = RefPlanner(page_size=page, num_blocks=60, layer_types=[typ], sliding_window=w)
    k_cache, v_cache = _cache(page, kv_heads, dim, seed=10)
    planner.add("a", [7] * 20)
    torch.manual_seed(5)
    for n in (7, 13):
        plan = planner.plan([("a", n)])
        q = _randn(n, heads, dim)
        kn, vn = _randn(n, kv_heads, dim), _randn(n, kv_heads, dim)
        meta = (_t(plan.block_tables[typ]), _t(plan.cu_seqlens_q), _t(plan.seqlens_k))
        kw = dict(page_size=page, scale=0.3, sliding_window=w)
        ref = ta.reference_paged_attention(q, kn, vn, k_cache, v_cache, *meta, **kw)
        before = ta.paged_prefill_attention(q, kn, vn, k_cache, v_cache, *meta, max_seqlen_q=n,
                                            block_m=16, block_n=16, **kw)
        ta.write_kv(k_cache, v_cache, kn, vn, _t(plan.slot_mapping[typ]))
        after = ta.paged_prefill_attention(q, kn, vn, k_cache, v_cache, *meta, max_seqlen_q=n,
                                           block_m=16, block_n=16, **kw)
        torch.testing.assert_close(before, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(after, ref, atol=1e-2)  # the ring lost keys 3..6


@needs_triton
@needs_kernels
@pytest.mark.parametrize("window", [None, 5])
def test_half_precision_matches_reference(window):
    """fp16 caches and queries (the non-IEEE tl.dot path, probabilities cast to the value
    dtype) vs the fp32-accumulating reference. bf16 cannot be checked here: the interpreter's
    tl.dot mishandles bf16 (numpy has no bf16); benches/gpu_check.py checks it on a GPU."""
    page, heads, kv_heads, dim = 4, 4, 2, 16
    typ = SLIDING if window else FULL
    planner = RefPlanner(page_size=page, num_blocks=60, layer_types=[typ], sliding_window=window)
    k_ref, v_ref = (t.half() for t in _cache(page, kv_heads, dim, seed=12))
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    torch.manual_seed(6)
    for plan in _scenario(planner, random.Random(8), [2, 9, 17], steps=3):
        t = len(plan.input_ids)
        q = _randn(t, heads, dim).half()
        kn, vn = _randn(t, kv_heads, dim).half(), _randn(t, kv_heads, dim).half()
        meta = (_t(plan.block_tables[typ]), _t(plan.cu_seqlens_q), _t(plan.seqlens_k))
        kw = dict(page_size=page, scale=0.3, sliding_window=window)
        ref = ta.reference_paged_attention(q, kn, vn, k_ref, v_ref, *meta, **kw)
        ta.write_kv(k_ref, v_ref, kn, vn, _t(plan.slot_mapping[typ]))
        got = ta.paged_attention(q, kn, vn, k_tri, v_tri, _t(plan.slot_mapping[typ]), *meta,
                                 max_seqlen_q=_max_q(plan), num_splits=2, block_m=16,
                                 block_n=16, **kw)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.float(), ref.float(), atol=5e-3, rtol=5e-3)


@needs_triton
def test_step_varying_integers_are_not_specialised():
    """The table width changes from step to step; triton must not compile a kernel variant
    per its value (== 1, % 16). Checked on the compiled (non-interpreted) JIT functions, in a
    subprocess: this module runs them interpreted."""
    import subprocess

    code = (
        "from ferrobatch.cuda import triton_attention as ta\n"
        "print(sorted(p.name for p in ta._decode_kernel.params if p.do_not_specialize),"
        " sorted(p.name for p in ta._prefill_kernel.params if p.do_not_specialize))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip().splitlines()[-1]
    assert out == "['stride_tb'] ['min_q_len', 'stride_tb']"
