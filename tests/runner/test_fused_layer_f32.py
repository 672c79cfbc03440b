"""The one-call decoder layer over fp32 products (`_core.LeanLayer(weight_dtype="float32")`
on `f32_ops`, or "bfloat16_panels" / "float16_panels" over half weights as stored): an fp32
model's layers and a half-precision model's, bit-equal to the lean layer it replaces and
taken where it applies; half panels bit-equal to the widened weights' fp32 layout; the
binding's checks of the layouts."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, FieldError, SamplingParams
from ferrobatch.cpu import f32_ops
from ferrobatch.cpu.arrays import numpy_view
from ferrobatch.runner import fused_layer, linear_policy
from ferrobatch.runner.cpu_linear import packing_available
from ferrobatch.runner.direct_forward import DirectForward
from ferrobatch.runner.linear_policy import Backend
from ferrobatch.runner.model_runner import ModelRunner
from isa_helpers import needs_isa
from ref_planner import drive_runner

torch.set_num_threads(1)
pytestmark = [
    pytest.mark.skipif(not (packing_available(torch.float32) and fused_layer.available()),
                       reason="no oneDNN packed linears, or no LeanLayer products here"),
    needs_isa(f32_ops.available(), "avx512f", what="f32_linear"),
]


def _record(monkeypatch) -> list[tuple[bool, bool]]:
    """(taken, on f32 products) of every one-call attempt."""
    seen: list[tuple[bool, bool]] = []
    own = fused_layer.FusedLayer.forward

    def recorded(self, x, step, rope):
        ran = own(self, x, step, rope)
        seen.append((ran is not None, ran is Backend.F32_OPS))
        return ran

    # (the stack run directly would bypass the layers' calls counted here)
    monkeypatch.setattr(DirectForward, "ENABLED", False)
    monkeypatch.setattr(fused_layer.FusedLayer, "forward", recorded)
    return seen


def _fused_and_lean(model, prompts, new, **kw):
    got = {}
    for fused in (True, False):
        runner = ModelRunner(model, num_blocks=128, page_size=4, **kw)
        assert runner.activations.lean is not None and runner.activations.linears.f32_kernel
        runner.activations.lean.fused_enabled = fused
        got[fused] = drive_runner(runner, prompts, new, forced=True)
        runner.close()
    return got[True], got[False]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2_sliding", "qwen3", "gemma2",
                                  "gemma3", "phi4_mini"])
def test_an_fp32_models_one_call_layer_is_its_lean_layer_bit_for_bit(monkeypatch, name):
    """fp32 model, fp32 cache: equal logits with and without the one call, taken on f32
    products."""
    seen = _record(monkeypatch)
    model = getattr(tm, name)()
    fused, lean = _fused_and_lean(model, tm.random_prompts(3, 6, 2, 30), 8)
    assert any(ran and wide for ran, wide in seen)
    for a, b in zip(fused, lean, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weights,cache_dtype", [(torch.bfloat16, None),
                                                  (torch.bfloat16, torch.float16),
                                                  (torch.float16, None)])
def test_half_weights_on_f32_products_take_the_one_call(monkeypatch, weights, cache_dtype):
    """A half-precision model whose products of >= 2 rows run on fp32 products (forced; the
    weights in `f32_ops`' half panels): those steps take the one call on f32 products (the
    attention output widened from the cache's type), bit-equal to the lean layer."""
    if not packing_available(weights):  # (fp16 on AMD Zen 4: no packed linears at all)
        pytest.skip(f"oneDNN does not pack {weights} weights on this CPU")
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda dtype: 2)
    seen = _record(monkeypatch)
    model = tm.llama().to(weights)
    kw = {} if cache_dtype is None else {"dtype": cache_dtype}
    fused, lean = _fused_and_lean(model, tm.random_prompts(4, 6, 2, 30), 8, **kw)
    assert any(ran and wide for ran, wide in seen)
    for a, b in zip(fused, lean, strict=True):
        assert torch.equal(a, b)


def test_steps_above_the_kernels_rows_keep_the_lean_forward(monkeypatch):
    """Beyond `f32_ops`' rows (the policy's `F32_KERNEL_ROWS`) fp32 products go to oneDNN:
    no one call on them."""
    monkeypatch.setattr(linear_policy, "RULES", linear_policy.limited(Backend.F32_OPS, 2))
    seen = _record(monkeypatch)
    runner = ModelRunner(tm.llama(), num_blocks=128, page_size=4)
    drive_runner(runner, tm.random_prompts(5, 5, 2, 12), 3, forced=True)
    runner.close()
    assert not any(wide for _, wide in seen)


def test_fp32_engine_outputs_equal_generate_with_the_one_call():
    """Greedy outputs of an fp32 model through the engine (decode steps on the one call)
    equal the model's own `generate`, prompt by prompt."""
    model = tm.llama()
    prompts = tm.random_prompts(6, 5, 3, 40)
    with Engine(model, config=ContinuousBatchingConfig(page_size=4, num_blocks=256)) as engine:
        assert engine.runner.activations.linears.f32_kernel
        got = engine.generate(prompts, SamplingParams(max_new_tokens=10), progress=False)
    for p, o in zip(prompts, got, strict=True):
        ids = torch.tensor([p])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == want


# --- the binding's checks of the fp32 layout --------------------------------------------

H, HEADS, KV, D, INTER = 64, 4, 2, 16, 96


def _layer(dtype=torch.float32, **over):
    from ferrobatch import _core

    def packed(n, k):
        gen = torch.Generator().manual_seed(n * 1000 + k)
        w = torch.randn(n, k, generator=gen).to(dtype)
        return numpy_view(f32_ops.pack(w).packed)

    nq, nk = HEADS * D, KV * D
    kw = dict(input_norm=np.ones(H, np.float32), post_norm=np.ones(H, np.float32),
              norm_dtype="float32", input_eps=1e-6, post_eps=1e-6,
              qkv=packed(nq + 2 * nk, H), o=packed(H, nq), gate_up=packed(2 * INTER, H),
              down=packed(H, INTER), hidden=H, heads=HEADS, kv_heads=KV, dim=D, inter=INTER,
              weight_dtype={torch.float32: "float32", torch.bfloat16: "bfloat16_panels",
                            torch.float16: "float16_panels"}[dtype])
    kw.update(over)
    return _core.LeanLayer(**kw)


def _run_layer(layer, rows: int = 2, slots: int = 16):
    x = np.random.default_rng(0).standard_normal((rows, H)).astype(np.float32)
    kc, vc = np.zeros((slots, KV, D), np.float32), np.zeros((slots, KV, D), np.float32)
    layer.forward(x, kc, vc, np.ones((rows, D), np.float32), np.zeros((rows, D), np.float32),
                  np.arange(rows, dtype=np.int64), np.zeros((rows, 1), np.int32),
                  np.arange(1, rows + 1, dtype=np.int32), cache_dtype="float32", page=4,
                  window=0, scale=0.25, threads=2)
    return x, kc, vc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_panels_are_the_widened_weights_fp32_layer_bit_for_bit(monkeypatch, dtype):
    """A layer over half weights in `f32_ops`' half panels computes the bits of the same
    layer over those weights widened to fp32 (half the bytes)."""
    half = _run_layer(_layer(dtype))
    widen = f32_ops.pack
    monkeypatch.setattr(f32_ops, "pack", lambda w, b=None: widen(w.float(), b))
    wide = _run_layer(_layer(dtype, weight_dtype="float32"))
    for a, b in zip(half, wide, strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_an_fp32_layer_runs_and_updates_x_and_the_cache():
    layer = _layer()
    rows, slots = 2, 16
    x = np.random.default_rng(0).standard_normal((rows, H)).astype(np.float32)
    x0 = x.copy()
    kc, vc = np.zeros((slots, KV, D), np.float32), np.zeros((slots, KV, D), np.float32)
    layer.forward(x, kc, vc, np.ones((rows, D), np.float32), np.zeros((rows, D), np.float32),
                  np.arange(rows, dtype=np.int64), np.zeros((rows, 1), np.int32),
                  np.arange(1, rows + 1, dtype=np.int32), cache_dtype="float32", page=4,
                  window=0, scale=0.25, threads=1)
    assert not np.array_equal(x, x0) and np.isfinite(x).all()
    assert np.abs(kc[:2]).sum() > 0 and not kc[2:].any()


@pytest.mark.parametrize("field,over", [
    ("weight_dtype", dict(weight_dtype="int8")),
    ("qkv", dict(qkv=np.zeros(10, np.float32))),
    ("o", dict(o=np.zeros(10, np.uint16))),
    ("qkv", dict(weight_dtype="bfloat16_panels")),  # float32 arrays for half panels
])
def test_a_bad_fp32_layer_names_the_field(field, over):
    with pytest.raises(FieldError) as e:
        _layer(**over)
    assert e.value.field == field
