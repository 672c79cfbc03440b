"""The tiled CPU prefill kernel's route for prompt rows (`paged_step.build_step` with
`prefill_kernel`) against the routes it replaces, on random paged layouts: gather + SDPA,
and the decode kernel one token at a time (the batch-invariant mode's route, which reads
the same cache in place, int8 included); and its binding's errors."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ferrobatch import _core
from ferrobatch.attention import context, forward, paged_step
from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.errors import FieldError
from ref_planner import RefPlanner

torch.set_num_threads(1)

DIM, HEADS, KV_HEADS = 32, 6, 2


def _run_routes(routes: dict[str, dict], typ: str, window: int | None, page: int,
                dtype: torch.dtype, kv_dtype: str, seed: int) -> dict[str, list[torch.Tensor]]:
    """The same random chunked-prefill + decode steps through each route (its own cache):
    every step's attention output per route."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    caches = {name: PagedKVCache(num_layers=1, num_blocks=300, page_size=page,
                                 num_kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype,
                                 kv_dtype=kv_dtype) for name in routes}
    planner = RefPlanner(page_size=page, num_blocks=300, layer_types=[typ],
                         sliding_window=window)
    for i in range(6):
        planner.add(f"r{i}", [5] * rng.randint(20, 140))
    module = SimpleNamespace(layer_idx=0, scaling=DIM**-0.5)
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in routes}
    for _ in range(10):
        rows = []
        for i in range(6):
            rem = planner.remaining(f"r{i}")
            if rem == 0:
                planner.append(f"r{i}", 5)
                rem = 1
            rows.append((f"r{i}", min(rem, rng.choice([1, 3, 17, 40, 64]))))
        plan = planner.plan(rows)
        t = len(plan.input_ids)
        q = torch.randn(1, HEADS, t, DIM, generator=gen).to(dtype)
        k = torch.randn(1, KV_HEADS, t, DIM, generator=gen).to(dtype)
        v = torch.randn(1, KV_HEADS, t, DIM, generator=gen).to(dtype)
        for name, route in routes.items():
            step = paged_step.build_step(plan, caches[name], [typ], window, **route)
            out, _ = forward.paged_attention_forward(
                module, q, k, v, None, scaling=DIM**-0.5, **{context.STEP_KWARG: step})
            outs[name].append(out.float())
    return outs


KERNEL = {"decode_kernel": True}
SDPA = {"decode_kernel": False}
DECODE_ROWS = {"decode_kernel": True, "invariant": True}


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_attention_prompt_rows_match_sdpa_and_the_decode_kernel(page, dtype):
    outs = _run_routes({"kernel": KERNEL, "sdpa": SDPA, "decode": DECODE_ROWS},
                       "full_attention", None, page, dtype, "auto", seed=page)
    # decode kernel: the same fp32 math over the same stored keys, in another order
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # (bf16 outputs: one rounding apart)
    for a, b in zip(outs["kernel"], outs["decode"], strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    # SDPA: attention in the cache dtype, the step's new keys from the forward
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(outs["kernel"], outs["sdpa"], strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_int8_cache_prompt_rows_match_the_decode_kernel():
    """Both kernels read the int8 keys and values (this step's too) in place."""
    outs = _run_routes({"kernel": KERNEL, "decode": DECODE_ROWS}, "full_attention", None, 8,
                       torch.float32, "int8", seed=3)
    for a, b in zip(outs["kernel"], outs["decode"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,page", [(24, 8), (50, 16), (7, 4)])
def test_sliding_prompt_rows_match_sdpa(window, page):
    """Rows the ring holds go to the kernel, longer ones keep SDPA: either way the output is
    SDPA's."""
    outs = _run_routes({"kernel": KERNEL, "sdpa": SDPA}, "sliding_attention", window, page,
                       torch.float32, "auto", seed=window)
    for a, b in zip(outs["kernel"], outs["sdpa"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise_field_errors():
    q = np.zeros((5, 4, 16), dtype=np.float32)
    k = np.zeros((32, 2, 16), dtype=np.float32)
    out = np.zeros_like(q)
    table = np.array([[1, 2]], dtype=np.int32)
    args = dict(q_dtype="float32", cache_dtype="float32", out_dtype="float32", page=8,
                window=0, scale=0.25, softcap=0.0, threads=1)
    _core.paged_prefill_attention(q, k, k.copy(), table, np.array([0, 5], dtype=np.int32),
                                  np.array([9], dtype=np.int32), out, **args)
    with pytest.raises(FieldError, match="cu_seqlens_q"):
        _core.paged_prefill_attention(q, k, k.copy(), table, np.array([5], dtype=np.int32),
                                      np.array([9], dtype=np.int32), out, **args)
    with pytest.raises(FieldError, match="query tokens"):
        _core.paged_prefill_attention(q, k, k.copy(), table, np.array([0, 5], dtype=np.int32),
                                      np.array([3], dtype=np.int32), out, **args)
    with pytest.raises(FieldError, match="q_dtype"):
        _core.paged_prefill_attention(q, k, k.copy(), table, np.array([0, 5], dtype=np.int32),
                                      np.array([9], dtype=np.int32), out,
                                      **{**args, "q_dtype": "int4"})
