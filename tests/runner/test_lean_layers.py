"""Lean decoder layers (`ferrobatch.runner.lean_layers`): which models get them, that they
compute what the model's own layers compute on the same packed weights, and that the
caller's model is left as it was."""

from __future__ import annotations

import threading

import pytest
import tiny_models as tm
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.cpu import fused_ops
from ferrobatch.runner.cpu_linear import packing_available
from ferrobatch.runner.model_runner import ModelRunner
from ferrobatch.workloads import agreement
from ref_planner import drive_runner

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(
    not (packing_available() and fused_ops.available()),
    reason="no oneDNN packed linears or no fused kernels in this build",
)

LEAN = ["llama", "qwen3", "mistral", "qwen2_sliding", "gemma2", "gemma3"]



def _runner(model: torch.nn.Module, **kw) -> ModelRunner:
    return ModelRunner(model, num_blocks=128, page_size=4, **kw)


def _lean_and_own(model: torch.nn.Module, prompts, new: int, **kw) -> list[tuple]:
    """Pairs of (lean, own) logits of the same forced packed steps."""
    got = {}
    for lean in (True, False):
        runner = _runner(model, lean_layers=lean, **kw)
        assert (runner.activations.lean is not None) == lean
        if "dtype" in kw:
            assert runner.cache.dtype == kw["dtype"]
        got[lean] = drive_runner(runner, prompts, new, forced=True)
        runner.close()
    return list(zip(got[True], got[False], strict=True))


@pytest.mark.parametrize("name", LEAN)
def test_lean_layers_compute_what_the_own_layers_compute(name):
    """Same packed steps (prefill, then decodes over full and sliding windows) with and
    without lean layers: logits equal to bf16 rounding."""
    model = tm.BUILDERS[name]().to(torch.bfloat16)
    for a, b in _lean_and_own(model, tm.random_prompts(5, 6, 2, 30), 6):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("arch", [("Qwen3ForCausalLM", "Qwen3Config"),
                                  ("Gemma3ForCausalLM", "Gemma3TextConfig")])
def test_one_kv_head_with_q_k_norms_runs_lean(arch):
    """One key/value head (Gemma 3 1B): its k columns of one row are a view, not a copy,
    of the q/k/v product; the per-head k norm still gets contiguous rows (the lean layers
    used to fail there and the model ran its own layers)."""
    model = tm._build(*arch, 0, num_key_value_heads=1, head_dim=16)
    for a, b in _lean_and_own(model, tm.random_prompts(5, 4, 1, 12), 5):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_rope_over_part_of_each_head_runs_lean():
    """Phi-4-mini's rotary embedding over 3/4 of each head: the lean layers rotate those
    columns, copy the rest, and compute what the model's own layers compute (decode steps in
    one call)."""
    model = tm.phi4_mini()
    assert model.model.layers[0].self_attn.head_dim * 3 // 4 == \
        model.model.rotary_emb.inv_freq.numel() * 2
    for a, b in _lean_and_own(model, tm.random_prompts(6, 5, 2, 20), 6):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_lean_layers_with_a_cache_in_another_dtype(cache_dtype):
    """A bf16 model over an fp32 or fp16 KV cache: keys and values are rounded to the
    cache's dtype alike on both paths (prefill with cached keys included)."""
    model = tm.llama().to(torch.bfloat16)
    for a, b in _lean_and_own(model, tm.random_prompts(9, 5, 2, 20), 5, dtype=cache_dtype):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("name", ["gpt2"])
def test_other_layers_keep_their_own_forward(name):
    runner = _runner(tm.BUILDERS[name]().to(torch.bfloat16))
    assert runner.activations.lean is None


@pytest.mark.parametrize("broken", ["rope", "silu_mul"])
def test_a_lean_layer_that_computes_something_else_is_not_used(monkeypatch, broken):
    """The construction check compares with the model's own forward: a lean layer that
    skips the rotation, or the activation, is refused."""
    real = getattr(fused_ops, broken)

    def wrong(*args, **kwargs):
        real(*args, **kwargs)
        out = args[3] if broken == "rope" else args[1]
        if broken == "rope":  # no rotation: the source heads as they were
            src, off, heads, dim = args[0], args[4], args[5], args[6]
            out.copy_(src[:, off:off + heads * dim].reshape(out.shape))
        else:  # up alone, no activation
            out.copy_(args[0][:, out.shape[1]:])

    monkeypatch.setattr(fused_ops, broken, wrong)
    assert _runner(tm.llama().to(torch.bfloat16)).activations.lean is None


def test_model_dtype_activations_keep_their_own_forward():
    assert _runner(tm.llama().to(torch.bfloat16), activations="model").activations.lean is None


@pytest.mark.parametrize("name", [*LEAN, "gemma"])
def test_fp32_lean_layers_compute_what_the_own_layers_compute(name):
    """An fp32 model runs lean too (fp32 products, kernels and cache): the same packed steps
    give the own layers' logits to fp32 rounding, and the same greedy tokens."""
    for a, b in _lean_and_own(getattr(tm, name)(), tm.random_prompts(5, 6, 2, 30), 6):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_an_fp32_lean_layer_slightly_off_is_not_used(monkeypatch):
    """The fp32 check is tight: a norm with its epsilon 3x too large is refused for an fp32
    model, where a bf16 one's check (off by less than bf16 rounding) lets it pass."""
    real = fused_ops.rms_norm

    def loose(x, weight, out, eps, *args, **kwargs):
        real(x, weight, out, eps * 3, *args, **kwargs)

    monkeypatch.setattr(fused_ops, "rms_norm", loose)
    assert _runner(tm.llama()).activations.lean is None
    assert _runner(tm.llama().to(torch.bfloat16)).activations.lean is not None


def test_the_model_is_left_as_it_was_and_other_threads_get_its_own_forward():
    model = tm.llama().to(torch.bfloat16)
    ids = torch.tensor([[5, 9, 11, 3, 7]])
    with torch.inference_mode():
        before = model(ids).logits
    runner = _runner(model)
    assert runner.activations.lean is not None
    drive_runner(runner, tm.random_prompts(1, 3, 3, 9), 2)
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert not any("forward" in m.__dict__ for m in layers)
    seen = {}

    def other_thread() -> None:
        with torch.inference_mode():
            seen["logits"] = model(ids).logits

    with runner.activations.active():  # as during a step: another thread calls the model
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    torch.testing.assert_close(seen["logits"], before)
    runner.close()


def test_gemma3_ropes_are_recorded_for_the_engine_only():
    """Gemma 3's rotary module records each layer type's rope for the whole-stack call only
    in the engine's own forwards: another thread's call of the model inside a step records
    nothing (its positions are not the step's), and the module is left as it was."""
    model = tm.gemma3()
    ids = torch.tensor([[5, 9, 11, 3, 7]])
    rotary = model.model.rotary_emb
    runner = _runner(model)
    lean = runner.activations.lean
    assert lean is not None and lean._rotary is rotary
    drive_runner(runner, tm.random_prompts(1, 3, 3, 9), 2)
    assert "forward" not in rotary.__dict__ and not lean._ropes

    def other_thread() -> None:
        with torch.inference_mode():
            model(ids)

    with runner.activations.active():
        assert "forward" in rotary.__dict__
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert not lean._ropes
    runner.close()


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
def test_lean_engine_is_as_close_to_fp32_as_the_own_layers(name):
    """Engine outputs in bf16 with lean layers against the fp32 greedy reference: at least
    as close as the same engine running the model's own layers (chunked prefill on)."""
    prompts = tm.random_prompts(17, 40, 4, 24)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    fp32 = tm.BUILDERS[name](seed=4)
    bf16 = tm.BUILDERS[name](seed=4).to(torch.bfloat16)
    ref = [tm.generate_greedy(fp32, p, 12, ignore_eos=True) for p in prompts]
    cfg = ContinuousBatchingConfig(max_batch_tokens=32)
    scores = {}
    for lean in (True, False):
        with Engine(bf16, config=cfg) as engine:
            if not lean:
                engine.runner.activations.lean = None
            else:
                assert engine.runner.activations.lean is not None
            outs = engine.generate(prompts, sp, progress=False)
        scores[lean] = agreement([o.token_ids for o in outs], ref)["tokens"]
    assert scores[True] >= scores[False] - 0.05, scores


@pytest.mark.parametrize("name,cache_dtype", [("llama", None), ("qwen2_sliding", None),
                                              ("qwen3", None), ("llama", torch.float32),
                                              ("gemma2", None), ("gemma3", None)])
def test_kernel_only_attention_is_the_interface_path_bit_for_bit(monkeypatch, name,
                                                                 cache_dtype):
    """Layers whose rows all go to the CPU kernel skip the attention interface: the same
    keys, values and outputs as through it, to the bit (and it is taken)."""
    from ferrobatch.runner import lean_layers

    model = tm.BUILDERS[name]().to(torch.bfloat16)
    prompts = tm.random_prompts(3, 6, 2, 30)
    own = lean_layers.kernel_only_attention
    taken = []

    def counted(*args, **kwargs):
        out = own(*args, **kwargs)
        taken.append(out is not None)
        return out

    got = {}
    for fast in (True, False):
        monkeypatch.setattr(lean_layers, "kernel_only_attention",
                            counted if fast else (lambda *a, **k: None))
        kw = {} if cache_dtype is None else {"dtype": cache_dtype}
        runner = _runner(model, **kw)
        assert runner.activations.lean is not None
        runner.activations.lean.fused_enabled = False  # (the one-call layer would take these steps)
        got[fast] = drive_runner(runner, prompts, 6, forced=True)
        runner.close()
    assert any(taken) and sum(taken) >= len(taken) // 2
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a, b)
