"""A model's whole stack of one-call layers in one call (`fused_layer.FusedStack`,
`_core.lean_layers_forward`): bit-equal to the layers' own one calls in order, taken on
decode steps of models whose layers share one rotary embedding (each layer over its own
attention group) and left to the layers elsewhere, and a bad argument is a `FieldError`
naming it."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch import FieldError, _core
from ferrobatch.cpu import f32_ops
from ferrobatch.cpu.arrays import numpy_view
from ferrobatch.runner import fused_layer
from ferrobatch.runner.cpu_linear import packing_available
from ferrobatch.runner.fused_layer import FusedStack
from ferrobatch.runner.model_runner import ModelRunner
from isa_helpers import needs_isa
from ref_planner import drive_runner

torch.set_num_threads(1)
pytestmark = [
    pytest.mark.skipif(not (packing_available(torch.float32) and fused_layer.available()),
                       reason="no oneDNN packed linears, or no LeanLayer products here"),
    needs_isa(f32_ops.available(), "avx512f", what="f32_linear"),
]


def _count_stack_calls(monkeypatch) -> list[int]:
    """The number of layers of every `_core.lean_layers_forward` call."""
    calls: list[int] = []
    own = _core.lean_layers_forward

    def counted(layers, *args, **kwargs):
        calls.append(len(layers))
        return own(layers, *args, **kwargs)

    monkeypatch.setattr(fused_layer._core, "lean_layers_forward", counted)
    return calls


def _with_and_without_the_stack(monkeypatch, model, prompts, new):
    got = {}
    for enabled in (True, False):
        monkeypatch.setattr(FusedStack, "ENABLED", enabled)
        runner = ModelRunner(model, num_blocks=128, page_size=4)
        assert runner.activations.lean is not None
        got[enabled] = drive_runner(runner, prompts, new, forced=True)
        runner.close()
    return got[True], got[False]


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "phi4_mini"])
def test_the_stack_is_the_layers_one_calls_bit_for_bit(monkeypatch, name):
    """Layers of one attention kind (full, or Mistral's window on every layer): the decode
    steps run every layer in one call, with logits equal to the layers' own calls."""
    calls = _count_stack_calls(monkeypatch)
    model = getattr(tm, name)()
    stacked, layered = _with_and_without_the_stack(
        monkeypatch, model, tm.random_prompts(3, 4, 2, 12), 5)
    layers = model.config.num_hidden_layers
    assert calls and set(calls) == {layers}
    for a, b in zip(stacked, layered, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["qwen2_sliding", "gemma2"])
def test_layers_of_two_attention_kinds_run_in_one_call(monkeypatch, name):
    """Sliding layers next to full ones (Qwen2's last layers sliding, Gemma 2 alternating):
    each layer over its own group in one call, prompts longer than the window; the logits
    are the layers' own calls'."""
    calls = _count_stack_calls(monkeypatch)
    model = tm.BUILDERS[name]()
    stacked, layered = _with_and_without_the_stack(
        monkeypatch, model, tm.random_prompts(4, 3, 10, 24), 6)
    assert calls and set(calls) == {model.config.num_hidden_layers}
    for a, b in zip(stacked, layered, strict=True):
        assert torch.equal(a, b)


def test_layers_of_two_ropes_run_in_one_call(monkeypatch):
    """Gemma 3's local (sliding) and global (full) layers get different rotary embeddings:
    the stack takes each type's rope as the model's rotary module gave it this forward, and
    equals the layers' own calls bit for bit."""
    calls = _count_stack_calls(monkeypatch)
    model = tm.gemma3()
    stacked, layered = _with_and_without_the_stack(
        monkeypatch, model, tm.random_prompts(4, 3, 10, 24), 6)
    assert calls and set(calls) == {model.config.num_hidden_layers}
    for a, b in zip(stacked, layered, strict=True):
        assert torch.equal(a, b)


def test_layers_over_two_ropes_equal_their_own_calls():
    """A second group with its own cos / sin: layer 1 rotates with those."""
    layers = [_layer(i) for i in range(2)]
    x0 = np.random.default_rng(3).standard_normal((2, H)).astype(np.float32)
    s, r = _step(), _step()
    r["cos"], r["sin"] = r["sin"].copy(), r["cos"].copy()
    x, ks, vs = x0.copy(), _caches(2), _caches(2)
    for layer, k, v, g in zip(layers, ks, vs, (s, r), strict=True):
        layer.forward(x, k, v, g["cos"], g["sin"], g["slots"], g["block_tables"],
                      g["seqlens"], **KW)
    y, ks2, vs2 = x0.copy(), _caches(2), _caches(2)
    _core.lean_layers_forward(
        layers, y, ks2, vs2, s["cos"], s["sin"], s["slots"], s["block_tables"], s["seqlens"],
        **KW, groups=[(r["slots"], r["block_tables"], r["seqlens"], 0, (r["cos"], r["sin"]))],
        group_of=[0, 1])
    assert np.array_equal(x, y)
    bad = (r["cos"][:, :4].copy(), r["sin"])
    with pytest.raises(FieldError) as e:
        _core.lean_layers_forward(
            layers, y, ks2, vs2, s["cos"], s["sin"], s["slots"], s["block_tables"],
            s["seqlens"], **KW, groups=[(r["slots"], r["block_tables"], r["seqlens"], 0, bad)],
            group_of=[0, 1])
    assert e.value.field == "cos"


# --- the binding ------------------------------------------------------------------------

H, HEADS, KV, D, INTER, SLOTS = 64, 4, 2, 16, 96, 16


def _layer(seed: int, **extra):
    def packed(n, k):
        gen = torch.Generator().manual_seed(seed * 7919 + n * 1000 + k)
        return numpy_view(f32_ops.pack(torch.randn(n, k, generator=gen)).packed)

    nq, nk = HEADS * D, KV * D
    return _core.LeanLayer(
        input_norm=np.ones(H, np.float32), post_norm=np.full(H, 0.5, np.float32),
        norm_dtype="float32", input_eps=1e-6, post_eps=1e-6, qkv=packed(nq + 2 * nk, H),
        o=packed(H, nq), gate_up=packed(2 * INTER, H), down=packed(H, INTER), hidden=H,
        heads=HEADS, kv_heads=KV, dim=D, inter=INTER, weight_dtype="float32", **extra)


@pytest.mark.parametrize(("field", "kw"), [
    ("activation", {"activation": "relu"}),
    ("softcap", {"softcap": 0.0}),
    ("softcap", {"softcap": float("nan")}),
    ("rot", {"rot": 3}),
    ("rot", {"rot": D + 2}),
    ("post_attn_norm", {"post_attn_norm": np.ones(H, np.float32)}),
    ("post_mlp_norm", {"post_attn_norm": np.ones(H, np.float32),
                       "post_mlp_norm": np.ones(H + 1, np.float32)}),
    ("norm_offset", {"norm_offset": float("inf")}),
])
def test_a_bad_gemma_or_rope_argument_names_its_field(field, kw):
    """Gemma's and Phi-4-mini's arguments of `LeanLayer` are checked when it is made."""
    with pytest.raises(FieldError) as e:
        _layer(0, **kw)
    assert e.value.field == field


def test_gemma_arguments_make_a_layer_that_runs():
    layer = _layer(1, post_attn_norm=np.ones(H, np.float32),
                   post_mlp_norm=np.full(H, 0.5, np.float32), norm_offset=1.0,
                   activation="gelu_pytorch_tanh", softcap=30.0, rot=D // 2)
    s = _step()
    x = np.random.default_rng(4).standard_normal((2, H)).astype(np.float32)
    before = x.copy()
    half = {k: np.ascontiguousarray(s[k][:, :D // 2]) for k in ("cos", "sin")}
    layer.forward(x, *_caches(2), half["cos"], half["sin"], s["slots"], s["block_tables"],
                  s["seqlens"], **KW)
    assert np.isfinite(x).all() and not np.array_equal(x, before)


def _step(rows: int = 2):
    rng = np.random.default_rng(1)
    return dict(
        cos=np.cos(rng.standard_normal((rows, D))).astype(np.float32),
        sin=np.sin(rng.standard_normal((rows, D))).astype(np.float32),
        slots=np.arange(rows, dtype=np.int64), block_tables=np.zeros((rows, 1), np.int32),
        seqlens=np.arange(1, rows + 1, dtype=np.int32))


KW = dict(cache_dtype="float32", page=4, window=0, scale=0.25, threads=2)


def _caches(n: int) -> list[np.ndarray]:
    return [np.zeros((SLOTS, KV, D), np.float32) for _ in range(n)]


def test_one_call_equals_the_layers_in_order():
    layers = [_layer(i) for i in range(3)]
    x0 = np.random.default_rng(0).standard_normal((2, H)).astype(np.float32)
    s = _step()
    x, ks, vs = x0.copy(), _caches(3), _caches(3)
    for layer, k, v in zip(layers, ks, vs, strict=True):
        layer.forward(x, k, v, s["cos"], s["sin"], s["slots"], s["block_tables"],
                      s["seqlens"], **KW)
    y, ks2, vs2 = x0.copy(), _caches(3), _caches(3)
    _core.lean_layers_forward(layers, y, ks2, vs2, s["cos"], s["sin"], s["slots"],
                              s["block_tables"], s["seqlens"], **KW)
    assert np.array_equal(x, y) and not np.array_equal(x, x0)
    for a, b in zip(ks + vs, ks2 + vs2, strict=True):
        assert np.array_equal(a, b) and a.any()


def test_layers_over_two_groups_equal_their_own_calls():
    """Layers 0 and 2 over the positional group, layer 1 over a second one (a window of 2,
    other slots and tables): the one call equals each layer's call with its group's."""
    layers = [_layer(i) for i in range(3)]
    x0 = np.random.default_rng(2).standard_normal((2, H)).astype(np.float32)
    s = _step()
    other = dict(slots=np.array([5, 9], np.int64), block_tables=np.array([[1], [2]], np.int32),
                 seqlens=np.array([2, 3], np.int32))
    own = [(s, 0), (other, 2), (s, 0)]
    x, ks, vs = x0.copy(), _caches(3), _caches(3)
    for layer, k, v, (g, window) in zip(layers, ks, vs, own, strict=True):
        layer.forward(x, k, v, s["cos"], s["sin"], g["slots"], g["block_tables"],
                      g["seqlens"], **{**KW, "window": window})
    y, ks2, vs2 = x0.copy(), _caches(3), _caches(3)
    _core.lean_layers_forward(
        layers, y, ks2, vs2, s["cos"], s["sin"], s["slots"], s["block_tables"], s["seqlens"],
        **KW, groups=[(other["slots"], other["block_tables"], other["seqlens"], 2, None)],
        group_of=[0, 1, 0])
    assert np.array_equal(x, y)
    for a, b in zip(ks + vs, ks2 + vs2, strict=True):
        assert np.array_equal(a, b) and a.any()
    for bad in ([0, 1], [0, 2, 0]):
        with pytest.raises(FieldError) as e:
            _core.lean_layers_forward(
                layers, y, ks2, vs2, s["cos"], s["sin"], s["slots"], s["block_tables"],
                s["seqlens"], **KW, groups=[(other["slots"], other["block_tables"],
                                             other["seqlens"], 2, None)], group_of=bad)
        assert e.value.field == "group_of"


@pytest.mark.parametrize(("field", "caches"), [
    ("k_caches", lambda c: (c[:1], c[1:])),  # one k_cache for two layers
    ("k_cache", lambda c: ([c[0], c[0]], c[2:])),  # two layers writing one cache
    ("v_cache", lambda c: (c[:2], [c[2], c[0]])),  # a v_cache that is a k_cache
])
def test_bad_caches_name_the_field_and_change_nothing(field, caches):
    layers = [_layer(0), _layer(1)]
    x = np.ones((2, H), np.float32)
    k, v = caches(_caches(4))
    s = _step()
    with pytest.raises(FieldError) as e:
        _core.lean_layers_forward(layers, x, k, v, s["cos"], s["sin"], s["slots"],
                                  s["block_tables"], s["seqlens"], **KW)
    assert e.value.field == field
    assert (x == 1).all() and not any(c.any() for c in k + v)
