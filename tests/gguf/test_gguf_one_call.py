"""A GGUF model's decode steps in one call a layer (`_core.LeanLayer(weight_dtype=
"quantized")`): bit for bit the lean forward it replaces (stacked parts of mixed types, q/k/v
biases, Qwen3's q/k norms), taken on the kernels and only there (not under the reference
products nor the construction probes), and the binding's checks of the parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, FieldError, SamplingParams, _core
from ferrobatch.cpu import quant_ops
from ferrobatch.gguf import modules
from ferrobatch.gguf.loader import load_gguf
from ferrobatch.runner import fused_layer
from ferrobatch.runner.direct_forward import DirectForward
from ferrobatch.runner.linear_policy import Backend
from ferrobatch.runner.model_runner import ModelRunner
from ref_planner import drive_runner

pytestmark = [
    pytest.mark.kernel_products,
    pytest.mark.skipif(not fused_layer.available(), reason="no LeanLayer in this build"),
]

#: q/k in the file's type, v in another (as Q4_K_M files have it), gate and up apart
MIXED = {"blk.0.attn_v.weight": "Q6_K", "blk.1.attn_v.weight": "Q6_K",
         "blk.0.ffn_up.weight": "Q8_0"}
PROMPTS = [[3, 17, 99, 5, 200], [7, 8, 9, 11, 400, 12, 13, 14, 15, 16, 17, 18], [21]]


def _record(monkeypatch) -> list[Backend | None]:
    """What every one-call attempt ran on (None: the lean forward ran instead)."""
    seen: list[Backend | None] = []
    own = fused_layer.FusedLayer.forward

    def recorded(self, x, step, rope):
        ran = own(self, x, step, rope)
        seen.append(ran)
        return ran

    # (the stack run directly would bypass the layers' calls counted here)
    monkeypatch.setattr(DirectForward, "ENABLED", False)
    monkeypatch.setattr(fused_layer.FusedLayer, "forward", recorded)
    return seen


def _one_call_and_lean(model, prompts, new):
    got = {}
    for fused in (True, False):
        runner = ModelRunner(model, num_blocks=128, page_size=4)
        assert runner.activations.lean is not None and runner.activations.quant is not None
        runner.activations.lean.fused_enabled = fused
        got[fused] = drive_runner(runner, prompts, new, forced=True)
        runner.close()
    return got[True], got[False]


@pytest.mark.parametrize(("arch", "qtype", "types"), [
    ("qwen2", "Q4_K", MIXED),  # biases; q/k/v and gate/up in two parts each
    ("llama", "Q6_K", None),
    ("qwen3", "Q8_0", None),  # per-head q/k norms
    ("mistral", "Q4_0", None),
    ("qwen2", "IQ4_XS", None),
    ("phi3", "Q4_K", None),  # one q/k/v and one gate/up matrix
])
def test_the_one_call_layer_is_the_lean_forward_bit_for_bit(gguf_file, monkeypatch, arch,
                                                             qtype, types):
    written, _ = gguf_file(arch, qtype, **({"types": types} if types else {}))
    model = load_gguf(written.path)[0]
    seen = _record(monkeypatch)
    prompts = [[5, 9, 14, 2, 7, 30], [11, 3], [8, 1, 4, 19, 23, 40, 2, 6, 9]]
    one_call, lean = _one_call_and_lean(model, prompts, 6)
    assert Backend.QUANT_OPS in seen  # the decode steps took it
    assert None in seen  # the prefill step did not (its rows are not all decode rows)
    for a, b in zip(one_call, lean, strict=True):
        assert torch.equal(a, b)


def test_the_whole_stack_in_one_call_is_the_layers_calls_bit_for_bit(gguf_file, monkeypatch):
    """Decode steps run every layer in one `_core.lean_layers_forward` call (mixed types,
    biases), with logits equal to the layers' own one calls in order."""
    written, _ = gguf_file("qwen2", "Q4_K", types=MIXED)
    model = load_gguf(written.path)[0]
    calls: list[int] = []
    own = _core.lean_layers_forward
    monkeypatch.setattr(fused_layer._core, "lean_layers_forward",
                        lambda layers, *a, **k: (calls.append(len(layers)), own(layers, *a,
                                                                               **k))[1])
    got = {}
    for enabled in (True, False):
        monkeypatch.setattr(fused_layer.FusedStack, "ENABLED", enabled)
        runner = ModelRunner(model, num_blocks=128, page_size=4)
        got[enabled] = drive_runner(runner, [[5, 9, 14, 2], [11, 3, 8]], 5, forced=True)
        runner.close()
    assert calls and set(calls) == {model.config.num_hidden_layers}
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a, b)


def test_an_int8_cache_keeps_the_lean_forward(gguf_file, monkeypatch):
    """An int8 cache (quantized on write) is the lean forward's: no one call."""
    written, _ = gguf_file("llama", "Q8_0")
    seen = _record(monkeypatch)
    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=4, kv_cache_dtype="int8")
    with Engine(str(written.path), config=cfg) as engine:
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4), progress=False)
    assert seen and Backend.QUANT_OPS not in seen


def test_engine_tokens_are_the_same_with_and_without_the_one_call(gguf_file, monkeypatch):
    """Greedy tokens through the engine, batched, with chunked prefill and a shared prefix."""
    written, _ = gguf_file("qwen2", "Q4_K", types=MIXED)
    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=8)
    prompts = PROMPTS + [PROMPTS[1] + [5, 6]]
    seen = _record(monkeypatch)
    outs = {}
    for fused in (True, False):
        with Engine(str(written.path), config=cfg) as engine:
            engine.runner.activations.lean.fused_enabled = fused
            got = engine.generate(prompts, SamplingParams(max_new_tokens=10), progress=False)
            outs[fused] = [o.token_ids for o in got]
    assert outs[True] == outs[False]
    assert Backend.QUANT_OPS in seen


def test_reference_products_and_probes_keep_the_lean_forward(gguf_file):
    written, _ = gguf_file("llama", "Q8_0")
    with Engine(str(written.path)) as engine:
        quant = engine.runner.activations.quant
        assert quant.one_call(1) is Backend.QUANT_OPS
        assert quant.one_call(10_000) is None  # above ONE_CALL_MAX_ROWS
        with modules.backend("reference"):
            assert quant.one_call(1) is None
        with modules.few_layers(engine.model, None):
            assert quant.one_call(1) is None


# --- the binding's checks ---------------------------------------------------------------

H, HEADS, KV, D, INTER, PAGE = 64, 4, 2, 16, 96, 4


def _parts(n, k, qtype="q8_0", seed=0):
    """One part of `n` random rows of `qtype`, packed."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if qtype == "q8_0":
        blocks = w.reshape(-1, 32)
        d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
        q = np.clip(np.round(blocks / np.maximum(d.astype(np.float32), 1e-8)[:, None]),
                    -127, 127).astype(np.int8)
        rows = np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    else:
        raise AssertionError(qtype)
    packed = quant_ops.pack(qtype, rows.reshape(n, -1), n, k)
    return [(qtype, packed.packed.numpy(), n)]


def _layer(**over):
    nq, nk = HEADS * D, KV * D
    kw = dict(input_norm=np.ones(H, np.float32), post_norm=np.ones(H, np.float32),
              norm_dtype="float32", input_eps=1e-6, post_eps=1e-6,
              qkv=_parts(nq, H, seed=1) + _parts(2 * nk, H, seed=2), o=_parts(H, nq),
              gate_up=_parts(2 * INTER, H), down=_parts(H, INTER), hidden=H, heads=HEADS,
              kv_heads=KV, dim=D, inter=INTER, weight_dtype="quantized")
    kw.update(over)
    return _core.LeanLayer(**kw)


def test_a_quantized_layer_runs_and_updates_x_and_the_cache():
    layer = _layer(qkv_bias=np.ones(HEADS * D + 2 * KV * D, np.float32))
    x = np.random.default_rng(0).standard_normal((2, H)).astype(np.float32)
    x0 = x.copy()
    k_cache, v_cache = (np.zeros((16, KV, D), np.float32) for _ in range(2))
    layer.forward(x, k_cache, v_cache, np.ones((2, D), np.float32), np.zeros((2, D), np.float32),
                  np.arange(2, dtype=np.int64), np.zeros((2, 1), np.int32),
                  np.arange(1, 3, dtype=np.int32), cache_dtype="float32", page=PAGE, window=0,
                  scale=0.25, threads=2)
    assert not np.array_equal(x, x0) and np.isfinite(x).all()
    assert np.abs(k_cache[:2]).sum() > 0 and not k_cache[2:].any()


@pytest.mark.parametrize("field,over", [
    ("qkv", dict(qkv=_parts(HEADS * D, H))),  # rows short of q + k + v
    ("o", dict(o=[("q8_0", np.zeros(10, np.uint8), H)])),  # bytes short
    ("gate_up", dict(gate_up=np.zeros(10, np.uint8))),  # not a sequence of parts
    ("down", dict(down=[("q8_0", np.zeros(10, np.uint8))])),  # a part without its rows
    ("qtype", dict(down=[("q9_9", np.zeros(10, np.uint8), H)])),
    ("down", dict(down=[])),
    ("weight_dtype", dict(weight_dtype="int4")),
])
def test_bad_quantized_parts_name_the_field(field, over):
    with pytest.raises(FieldError) as e:
        _layer(**over)
    assert e.value.field == field
