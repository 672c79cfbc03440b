"""The base model's forward run directly (`direct_forward.DirectForward`): on plain decoders
whose stack runs in one call, the logits are the model's own forward's bit for bit and the
model's forward is not called on those steps; any forward hook, a model outside its
classes, or a step the stack can't take leaves the step to the model's own forward."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from ferrobatch.cpu import f32_ops
from ferrobatch.runner import fused_layer
from ferrobatch.runner.cpu_linear import packing_available
from ferrobatch.runner.direct_forward import DirectForward
from ferrobatch.runner.model_runner import ModelRunner
from isa_helpers import needs_isa
from ref_planner import drive_runner

torch.set_num_threads(1)
pytestmark = [
    pytest.mark.skipif(not (packing_available(torch.float32) and fused_layer.available()),
                       reason="no oneDNN packed linears, or no LeanLayer products here"),
    needs_isa(f32_ops.available(), "avx512f", what="f32_linear"),
]


def _own_forward_calls(monkeypatch, model) -> list[int]:
    """The token count of every call of the base model's own forward."""
    base = model.base_model
    own = type(base).forward
    calls: list[int] = []

    def counted(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        embeds = kwargs.get("inputs_embeds")
        calls.append((ids if ids is not None else embeds).shape[1])
        return own(self, *args, **kwargs)

    monkeypatch.setattr(type(base), "forward", counted)
    return calls


def _run(monkeypatch, model, prompts, new, direct: bool, calls: list[int] | None = None):
    """The logits of `drive_runner`; `calls` (a list the model's calls append to) is
    emptied once the runner is made, so that it holds the steps' calls only (not the
    runner's construction checks)."""
    monkeypatch.setattr(DirectForward, "ENABLED", direct)
    runner = ModelRunner(model, num_blocks=128, page_size=4)
    assert (runner.direct_forward is not None) == direct
    if calls is not None:
        calls.clear()
    out = drive_runner(runner, prompts, new, forced=True)
    runner.close()
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "qwen2_sliding"])
def test_direct_forward_is_the_models_own_bit_for_bit(monkeypatch, name):
    """Prefill and decode steps: the logits equal the model's own forward's, and no decode
    step calls that forward."""
    model = tm.BUILDERS[name]()
    prompts = tm.random_prompts(5, 3, 10, 24)
    calls = _own_forward_calls(monkeypatch, model)
    direct = _run(monkeypatch, model, prompts, 6, direct=True, calls=calls)
    direct_calls = list(calls)
    own = _run(monkeypatch, model, prompts, 6, direct=False, calls=calls)
    for a, b in zip(direct, own, strict=True):
        assert torch.equal(a, b)
    # (the prefill step may take the model's forward: the layers take their own calls on
    # prompt rows where the one-call attention doesn't cover them)
    assert direct_calls in ([], [sum(map(len, prompts))]), "no decode step ran it"
    assert len(calls) == 6


def test_a_forward_hook_leaves_the_step_to_the_models_forward(monkeypatch):
    """A hook on one decoder layer runs at every step, with the same logits."""
    model = tm.llama()
    prompts = tm.random_prompts(6, 2, 4, 9)
    seen: list[int] = []
    handle = model.model.layers[1].register_forward_hook(
        lambda module, args, out: seen.append(1))
    try:
        hooked = _run(monkeypatch, model, prompts, 4, direct=True, calls=seen)
    finally:
        handle.remove()
    assert len(seen) == 4
    own = _run(monkeypatch, model, prompts, 4, direct=False)
    for a, b in zip(hooked, own, strict=True):
        assert torch.equal(a, b)


def test_a_step_too_large_for_one_call_runs_the_models_forward(monkeypatch):
    """A prefill past the one-call row limit: the model's forward runs on the embeddings
    already made (once), then decode steps run direct; logits unchanged."""
    model = tm.llama()
    prompts = [list(range(3, 3 + 300)), list(range(5, 25))]
    calls = _own_forward_calls(monkeypatch, model)
    direct = _run(monkeypatch, model, prompts, 3, direct=True, calls=calls)
    assert calls == [320]
    own = _run(monkeypatch, model, prompts, 3, direct=False)
    for a, b in zip(direct, own, strict=True):
        assert torch.equal(a, b)


def test_only_plain_decoders_take_it(monkeypatch):
    """Gemma's base models (embedding scale, softcaps, two ropes) are not in `CLASSES`; a
    base model with its forward replaced on the instance is refused too."""
    assert DirectForward.of(tm.gemma2().base_model, object()) is None
    model = tm.llama()
    lean = ModelRunner(model, num_blocks=16, page_size=4)
    try:
        assert lean.direct_forward is not None
        base = model.base_model
        base.forward = base.forward  # (an instance attribute, as a patch would leave)
        assert DirectForward.of(base, lean.activations.lean) is None
    finally:
        lean.close()
