"""Phi-3 LongRoPE GGUF files (Phi-3 128k, Phi-3.5-mini, Phi-4-mini, as llama.cpp's converter
writes them: `rope_factors_short` / `rope_factors_long` tensors, the threshold as
`rope.scaling.original_context_length`, the cos/sin scale as `rope.scaling.attn_factor`):
the config transformers' "longrope" needs, logits equal to the dequantized oracle below and
past the threshold, engine greedy equal to the oracle's `generate` for prompts short, long
and crossing the threshold while decoding, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.errors import FieldError
from ferrobatch.gguf import loader
from ferrobatch.gguf.loader import load_gguf
from gguf_files import reference_model, tiny_model, write_gguf

THRESHOLD = 16  # original_max_position_embeddings (the tiny model's context: 512)
HALF = 32  # rotary dimensions / 2 (head size 64)
NEW = 10


def _long_rope_model(partial: float = 1.0) -> torch.nn.Module:
    half = int(64 * partial) // 2
    params = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=partial,
                  short_factor=[1.0 + 0.05 * i for i in range(half)],
                  long_factor=[1.5 + 0.4 * i for i in range(half)],
                  original_max_position_embeddings=THRESHOLD)
    return tiny_model("phi3", rope_parameters=params, initializer_range=0.2,
                      original_max_position_embeddings=THRESHOLD)


@pytest.fixture(scope="module")
def long_file(tmp_path_factory: pytest.TempPathFactory):
    source = _long_rope_model()
    written = write_gguf(tmp_path_factory.mktemp("phi3-long") / "phi3-long.gguf", source,
                         "phi3", "Q8_0")
    return written, reference_model(source, written)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, 500, n).tolist()


def test_config_is_transformers_longrope(long_file) -> None:
    written, reference = long_file
    params = loader.plan(written.path).config.rope_parameters
    want = reference.config.rope_parameters
    assert params["rope_type"] == "longrope"
    assert params["original_max_position_embeddings"] == THRESHOLD
    np.testing.assert_allclose(params["short_factor"], want["short_factor"], rtol=1e-6)
    np.testing.assert_allclose(params["long_factor"], want["long_factor"], rtol=1e-6)
    # the converter's scale: sqrt(1 + ln(512 / 16) / ln(16)), what transformers derives too
    assert params["attention_factor"] == pytest.approx(
        math.sqrt(1 + math.log(512 / THRESHOLD) / math.log(THRESHOLD)), rel=1e-6)


@pytest.mark.parametrize("length", [THRESHOLD - 4, THRESHOLD + 9])
def test_logits_equal_the_oracle_short_and_long(long_file, length: int) -> None:
    """Below the threshold the short factors, past it the long ones, as transformers."""
    written, reference = long_file
    model, _ = load_gguf(written.path)
    ids = _prompt(length, length)
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids),
                               rtol=1e-5, atol=1e-5)


def test_the_factors_matter(long_file) -> None:
    """The file's factors change the logits (a loader that dropped them would not pass the
    oracle test): the same weights with plain rope differ past the threshold."""
    written, reference = long_file
    ids = _prompt(THRESHOLD + 9, 1)
    plain = tiny_model("phi3", initializer_range=0.2)
    plain.load_state_dict(reference.state_dict())
    assert not torch.allclose(_logits(plain, ids), _logits(reference, ids), atol=1e-3)


def test_engine_greedy_equals_the_oracle(long_file) -> None:
    """Short, long, exactly-at and crossing-while-decoding prompts in one batch: each gets
    the oracle's own `generate` (the engine recomputes a request that crosses, as Phi-3's
    `generate` does)."""
    written, reference = long_file
    prompts = [_prompt(n, n) for n in (4, THRESHOLD - 4, THRESHOLD, THRESHOLD + 13)]
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16)
    with Engine(str(written.path), config=config) as engine:
        assert engine.runner.activations.lean is not None  # (Phi-3's layers run lean)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW), progress=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _greedy(reference, prompt, NEW), len(prompt)


def test_partial_rotary_factors(tmp_path) -> None:
    """Phi-4-mini's shape: LongRoPE over part of each head (factors for the rotary
    dimensions only)."""
    source = _long_rope_model(partial=0.75)
    written = write_gguf(tmp_path / "phi4.gguf", source, "phi3", "Q8_0",
                         extra_metadata={"phi3.rope.dimension_count": 48})
    model, _ = load_gguf(written.path)
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.75
    ids = _prompt(THRESHOLD + 5, 2)
    reference = reference_model(source, written)
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids),
                               rtol=1e-5, atol=1e-5)
    # the lean layers rotate each head's first 48 columns and copy the other 16
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16)
    prompts = [_prompt(n, n) for n in (5, THRESHOLD + 3)]
    with Engine(str(written.path), config=config) as engine:
        assert engine.runner.activations.lean is not None
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW), progress=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _greedy(reference, prompt, NEW), len(prompt)


def _refused(path, match: str) -> None:
    with pytest.raises(FieldError, match=match) as info:
        loader.plan(path)
    assert info.value.field == "model"


def test_refusals(tmp_path) -> None:
    source = tiny_model("phi3")
    one = write_gguf(tmp_path / "one.gguf", source, "phi3", "Q8_0",
                     extra_tensors={"rope_factors_long.weight": np.ones(HALF)})
    _refused(one.path, r"rope_factors_long\.weight without rope_factors_short\.weight")
    short = write_gguf(tmp_path / "short.gguf", source, "phi3", "Q8_0", extra_tensors={
        "rope_factors_long.weight": np.ones(HALF - 1),
        "rope_factors_short.weight": np.ones(HALF - 1)})
    _refused(short.path, "rotary dimensions 64 need 32")
    over = write_gguf(tmp_path / "over.gguf", source, "phi3", "Q8_0", extra_tensors={
        "rope_factors_long.weight": np.ones(HALF), "rope_factors_short.weight": np.ones(HALF)},
        extra_metadata={"phi3.rope.scaling.original_context_length": 4096})
    _refused(over.path, "original_context_length 4096 is not 1 .. context_length")
    scaled = write_gguf(tmp_path / "scaled.gguf", tiny_model("llama"), "llama", "Q8_0",
                        extra_metadata={"llama.rope.scaling.attn_factor": 1.25})
    _refused(scaled.path, "attn_factor without LongRoPE factors")
