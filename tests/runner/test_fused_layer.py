"""The one-call decoder layer (`ferrobatch.runner.fused_layer`, `_core.LeanLayer`): bit-equal
to the lean layer it replaces, taken where it applies and only there, and a bad argument is
a `FieldError` naming it, with the caller's tensors left as they were."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, FieldError, SamplingParams
from ferrobatch.cpu import amx_ops, f32_ops
from ferrobatch.runner import fused_layer, linear_policy
from ferrobatch.runner.cpu_linear import packing_available
from ferrobatch.runner.direct_forward import DirectForward
from ferrobatch.runner.linear_policy import Backend
from ferrobatch.runner.model_runner import ModelRunner
from isa_helpers import needs_isa
from ref_planner import drive_runner

torch.set_num_threads(1)
pytestmark = [
    pytest.mark.skipif(not (packing_available() and fused_layer.available()),
                       reason="no oneDNN packed linears, or no LeanLayer products here"),
    needs_isa(amx_ops.available(), "avx512_bf16", "amx_bf16",
              what="bf16 products with fp32 outputs"),
]


def _count_taken(monkeypatch) -> list[bool]:
    """Whether each step's one-call decision ran the layer."""
    taken: list[bool] = []
    own = fused_layer.FusedLayer.forward

    def counted(self, *args, **kwargs):
        ran = own(self, *args, **kwargs)
        taken.append(ran is not None)
        return ran

    # (the stack run directly would bypass the layers' calls counted here)
    monkeypatch.setattr(DirectForward, "ENABLED", False)
    monkeypatch.setattr(fused_layer.FusedLayer, "forward", counted)
    return taken


def _fused_and_lean(model, prompts, new, **kw):
    got = {}
    for fused in (True, False):
        runner = ModelRunner(model, num_blocks=128, page_size=4, **kw)
        assert runner.activations.lean is not None
        runner.activations.lean.fused_enabled = fused
        got[fused] = drive_runner(runner, prompts, new, forced=True)
        runner.close()
    return got[True], got[False]


@pytest.mark.parametrize("name,cache_dtype", [
    ("llama", None), ("mistral", None), ("qwen2_sliding", None),
    ("llama", torch.float32), ("llama", torch.float16), ("gemma2", None), ("gemma3", None)])
def test_the_one_call_layer_is_the_lean_layer_bit_for_bit(monkeypatch, name, cache_dtype):
    """Same forced steps (a packed prefill, then decodes over full and sliding windows, with
    Qwen2's q/k/v biases) with the one call and without: equal logits, and it was taken."""
    taken = _count_taken(monkeypatch)
    model = tm.BUILDERS[name]().to(torch.bfloat16)
    kw = {} if cache_dtype is None else {"dtype": cache_dtype}
    fused, lean = _fused_and_lean(model, tm.random_prompts(3, 6, 2, 30), 8, **kw)
    assert sum(taken) >= len(taken) // 2 > 0
    for a, b in zip(fused, lean, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not f32_ops.available(), reason="no f32_ops here")
@pytest.mark.parametrize("rows,kind", [(2, Backend.AMX_OPS), (6, Backend.F32_OPS), (10, None)])
def test_each_policy_segment_decides_the_one_call_and_stays_bit_equal(monkeypatch, rows,
                                                                       kind):
    """With the policy's thresholds forced low (fp32 copies from 4 rows, `f32_ops` up to 8),
    decode steps of 2, 6 and 10 rows fall in its three segments for bf16 weights: the one
    call on `amx_ops`, on `f32_ops`, and none (oneDNN's fp32 products: the lean forward);
    each with logits bit-equal to the lean forward's."""
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda dtype: 4)
    monkeypatch.setattr(linear_policy, "RULES", linear_policy.limited(Backend.F32_OPS, 8))
    decided: list[tuple[int, Backend | None]] = []
    own = fused_layer.FusedLayer.forward

    def recorded(self, x, step, rope):
        ran = own(self, x, step, rope)
        decided.append((x.shape[0], ran))
        return ran

    # (the stack run directly would bypass the layers' calls counted here)
    monkeypatch.setattr(DirectForward, "ENABLED", False)
    monkeypatch.setattr(fused_layer.FusedLayer, "forward", recorded)
    model = tm.llama().to(torch.bfloat16)
    fused, lean = _fused_and_lean(model, tm.random_prompts(5, rows, 2, 12), 4)
    assert {ran for n, ran in decided if n == rows} == {kind}
    for a, b in zip(fused, lean, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cache_dtype", [None, torch.float32])
def test_layers_with_q_k_norms_take_the_one_call_bit_for_bit(monkeypatch, cache_dtype):
    """Qwen3's per-head q/k norms run inside the one call as in the lean forward: taken,
    and equal logits."""
    taken = _count_taken(monkeypatch)
    model = tm.qwen3().to(torch.bfloat16)
    kw = {} if cache_dtype is None else {"dtype": cache_dtype}
    fused, lean = _fused_and_lean(model, tm.random_prompts(4, 4, 2, 20), 6, **kw)
    assert any(taken)
    for a, b in zip(fused, lean, strict=True):
        assert torch.equal(a, b)


def test_steps_above_max_rows_keep_the_lean_forward(monkeypatch):
    """A step of more rows than `ONE_CALL_MAX_ROWS` runs the lean layer."""
    taken = _count_taken(monkeypatch)
    monkeypatch.setattr(linear_policy, "ONE_CALL_MAX_ROWS", 3)
    model = tm.llama().to(torch.bfloat16)
    runner = ModelRunner(model, num_blocks=128, page_size=4)
    drive_runner(runner, tm.random_prompts(5, 5, 2, 12), 2, forced=True)
    runner.close()
    assert taken and not any(taken)


@pytest.mark.parametrize("setup", ["chunked", "preempt", "prefix"])
def test_engine_outputs_are_the_same_with_and_without_the_one_call(setup):
    """Greedy outputs through the engine (chunked prefill, preemption, shared prefixes)
    equal with the one call and with the lean layers alone."""
    model, prompts, _ = tm.bf16_quality_case(setup)
    cfg = tm.SCHEDULING_SETUPS[setup]
    outs = {}
    for fused in (True, False):
        engine = Engine(model, config=ContinuousBatchingConfig(**cfg))
        assert engine.runner.activations.lean is not None
        engine.runner.activations.lean.fused_enabled = fused
        with engine:
            got = engine.generate(prompts, SamplingParams(max_new_tokens=12), progress=False)
        outs[fused] = [o.token_ids for o in got]
    assert outs[True] == outs[False]


# --- the binding's checks ---------------------------------------------------------------

H, HEADS, KV, D, INTER, PAGE = 64, 4, 2, 16, 96, 4


def _layer(**over):
    def packed(n, k):
        w = torch.randn(n, k).to(torch.bfloat16)
        return amx_ops.pack(w).packed.view(torch.uint16).numpy()

    nq, nk = HEADS * D, KV * D
    kw = dict(input_norm=np.ones(H, np.float32), post_norm=np.ones(H, np.float32),
              norm_dtype="float32", input_eps=1e-6, post_eps=1e-6,
              qkv=packed(nq + 2 * nk, H), o=packed(H, nq), gate_up=packed(2 * INTER, H),
              down=packed(H, INTER), hidden=H, heads=HEADS, kv_heads=KV, dim=D, inter=INTER)
    kw.update(over)
    from ferrobatch import _core

    return _core.LeanLayer(**kw)


def _step(rows=2, slots=16):
    x = np.random.default_rng(0).standard_normal((rows, H)).astype(np.float32)
    caches = [np.zeros((slots, KV, D), np.float32) for _ in range(2)]
    cos, sin = np.ones((rows, D), np.float32), np.zeros((rows, D), np.float32)
    return dict(x=x, k_cache=caches[0], v_cache=caches[1], cos=cos, sin=sin,
                slots=np.arange(rows, dtype=np.int64),
                block_tables=np.zeros((rows, 1), np.int32),
                seqlens=np.arange(1, rows + 1, dtype=np.int32))


def _forward(layer, step, **over):
    kw = dict(cache_dtype="float32", page=PAGE, window=0, scale=0.25, threads=1)
    kw.update(over)
    layer.forward(step["x"], step["k_cache"], step["v_cache"], step["cos"], step["sin"],
                  step["slots"], step["block_tables"], step["seqlens"], **kw)


def test_a_layer_runs_and_updates_x_and_the_cache():
    layer, step = _layer(), _step()
    x0 = step["x"].copy()
    _forward(layer, step)
    assert not np.array_equal(step["x"], x0) and np.isfinite(step["x"]).all()
    assert np.abs(step["k_cache"][:2]).sum() > 0 and not step["k_cache"][2:].any()


@pytest.mark.parametrize("field,over", [
    ("q_norm", dict(q_norm=np.ones(D + 1, np.float32), k_norm=np.ones(D, np.float32))),
    ("k_norm", dict(q_norm=np.ones(D, np.float32), k_norm=np.ones(3, np.float32))),
    ("q_norm", dict(k_norm=np.ones(D, np.float32))),
    ("qkv", dict(qkv=np.zeros(10, np.uint16))),
    ("input_norm", dict(input_norm=np.ones(H + 1, np.float32))),
    ("bias", dict(o_bias=np.zeros(H + 2, np.float32))),
    ("dim", dict(dim=15)),
    ("norm_dtype", dict(norm_dtype="int8")),
])
def test_a_bad_layer_names_the_field(field, over):
    with pytest.raises(FieldError) as e:
        _layer(**over)
    assert e.value.field == field


@pytest.mark.parametrize("field,change", [
    ("x", lambda s: s.update(x=np.zeros((2, H + 1), np.float32))),
    ("slots", lambda s: s.update(slots=np.array([0, 99], np.int64))),
    ("cos", lambda s: s.update(cos=np.ones((3, D), np.float32))),
    ("k_cache", lambda s: s.update(k_cache=np.zeros((15, KV, D), np.float32))),
    ("block_tables", lambda s: s.update(block_tables=np.zeros((3, 1), np.int32))),
    ("seqlens", lambda s: s.update(seqlens=np.ones(3, np.int32))),
])
def test_a_bad_step_names_the_field_and_changes_nothing(field, change):
    layer, step = _layer(), _step()
    change(step)
    before = {k: v.copy() for k, v in step.items()}
    with pytest.raises(FieldError) as e:
        _forward(layer, step)
    assert e.value.field == field
    for k, v in step.items():
        assert np.array_equal(v, before[k]), k


def test_a_cache_of_another_dtype_than_said_is_refused():
    layer, step = _layer(), _step()
    with pytest.raises(FieldError) as e:
        _forward(layer, step, cache_dtype="bfloat16")
    assert e.value.field == "k_cache"
