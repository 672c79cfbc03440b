"""Models that derive something from the whole forward: every request must still
get `model.generate`'s answer for its prompt alone, whatever shares its packed step.

* longrope (Phi-3, PhiMoE, a Llama config with `rope_type="longrope"`): short / long factors
  per request, and the recompute `generate` does when a sequence crosses
  `original_max_position_embeddings` (Phi-3 and PhiMoE; not the Llama);
* "dynamic" (NTK) rope: equal to default rope inside the context the engine allows;
* the construction probe runs a packed step (several lengths, a chunked prefill) against each
  request alone, so a model of this class without the fix is refused instead of answering
  wrongly.

Tiny random-init fp32 models; `initializer_range=0.2` makes attention depend on positions
(at 0.02 a random model's attention is nearly uniform and a wrong rope goes unnoticed).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
import transformers
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.attention.rope import LongRope
from tiny_models import COMMON, VOCAB, generate_greedy

torch.set_num_threads(1)

THR = 32  # original_max_position_embeddings of the longrope models
NEW = 10


def _build(prefix: str, **overrides):
    kwargs = {**COMMON, "initializer_range": 0.2, "max_position_embeddings": 256, **overrides}
    config = getattr(transformers, prefix + "Config")(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, prefix + "ForCausalLM")(config).eval().to(torch.float32)


def _longrope(**extra):
    return dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.1 * i for i in range(8)],
        long_factor=[2.0 + 0.5 * i for i in range(8)],
        original_max_position_embeddings=THR,
        **extra,
    )


MODELS = {
    "phi3_longrope": lambda: _build(
        "Phi3", rope_parameters=_longrope(), original_max_position_embeddings=THR
    ),
    "phimoe_longrope": lambda: _build(
        "Phimoe", num_local_experts=4, num_experts_per_tok=2,
        rope_parameters=_longrope(short_mscale=1.0, long_mscale=1.3),
        original_max_position_embeddings=THR,
    ),
    "llama_longrope": lambda: _build(
        "Llama", rope_parameters=_longrope(rope_theta=10000.0)
    ),
    "llama_dynamic": lambda: _build(
        "Llama", max_position_embeddings=64,
        rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
    ),
}
_CACHE: dict[str, torch.nn.Module] = {}


def model(name: str):
    if name not in _CACHE:
        _CACHE[name] = MODELS[name]()
    return _CACHE[name]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# lengths around the threshold: short ones next to long ones in one step, one that crosses
# the threshold while decoding (THR - 4 + NEW), one exactly at it, ones past it
LENGTHS = [4, 9, THR - 4, THR, THR + 13, 45]
SCENARIOS = {
    "default": dict(),
    "chunked": dict(max_batch_tokens=16, max_requests_per_batch=4),
    "preempt": dict(num_blocks=14, max_batch_tokens=32),
    "offload": dict(num_blocks=14, max_batch_tokens=32, cpu_offload_space=0.01),
    "async": dict(use_async_batching=True, max_batch_tokens=24),
}


def _run(m, prompts, **cfg):
    # no step-time budget: its chunks follow measured step times, and the scenarios' chunks
    # (and so their preemptions) must not depend on how busy the host is
    config = ContinuousBatchingConfig(page_size=8, max_step_ms=None,
                                      **{"num_blocks": 128, **cfg})
    with Engine(m, config=config) as eng:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=NEW), progress=False)
        stats = eng.stats()
        rope = eng.rope
    return [o.token_ids for o in outs], stats, rope


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_parity_around_the_rope_switch(name: str, scenario: str) -> None:
    m = model(name)
    rng = random.Random(zlib.crc32(f"{name}/{scenario}".encode()))  # (`hash` is per run)
    lengths = [n for n in LENGTHS if n + NEW <= m.config.max_position_embeddings]
    prompts = [_prompt(rng, n) for n in lengths]
    got, stats, rope = _run(m, prompts, **SCENARIOS[scenario])
    for p, toks in zip(prompts, got, strict=True):
        ref = generate_greedy(m, p, NEW)
        assert toks == ref, f"{name}/{scenario}: {len(p)}-token prompt"
    assert stats["num_used_blocks"] == 0
    if name.endswith("longrope"):
        assert rope is not None and rope.threshold == THR
        assert not rope.long, "finished requests are forgotten"
        # Phi-3 / PhiMoE recompute when crossing (the 28- and 32-token prompts cross)
        assert rope.recompute == (name != "llama_longrope")
        assert (stats.get("num_recomputes", 0) > 0) == rope.recompute
        assert stats["prefix_caching"] is False
    else:
        assert rope is None
    if scenario in ("preempt", "offload"):
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("name", ["phi3_longrope", "phimoe_longrope"])
def test_short_prompt_answer_does_not_depend_on_a_long_batch_mate(name: str) -> None:
    """A 4-token prompt alone and next to a 45-token one."""
    m = model(name)
    rng = random.Random(5)
    short, long = _prompt(rng, 4), _prompt(rng, 45)
    (alone,), _, _ = _run(m, [short])
    (together, _), _, _ = _run(m, [short, long])
    assert alone == together == generate_greedy(m, short, NEW)


def test_probe_refuses_longrope_without_per_request_factors(monkeypatch) -> None:
    """The construction probe's packed step catches the class: with the per-request rope
    switched off, the engine refuses Phi-3 instead of answering wrongly."""
    m = model("phi3_longrope")
    monkeypatch.setattr(LongRope, "of", classmethod(lambda cls, model, max_len: None))
    with pytest.raises(NotImplementedError, match="packed step"):
        Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=128))


def test_probe_measures_the_packed_step() -> None:
    with Engine(model("phi3_longrope"),
                config=ContinuousBatchingConfig(page_size=8, num_blocks=128)) as eng:
        assert eng.probe_packed_error is not None and eng.probe_packed_error < 1e-4
        # lengths on both sides of the switch are in the probe
        lengths = eng._probe_lengths()
        assert min(lengths) < THR - 1 and max(lengths) > THR


def test_the_callers_model_is_left_as_it_was() -> None:
    m = model("phi3_longrope")
    rotary = m.model.rotary_emb
    before = rotary.inv_freq.clone()
    _run(m, [_prompt(random.Random(1), 45), [5, 6, 7]])
    assert "forward" not in rotary.__dict__
    assert torch.equal(rotary.inv_freq, before)


def test_longrope_threshold_beyond_the_context_needs_nothing() -> None:
    """A longrope config whose switch point is the whole context never switches."""
    m = _build("Phi3", max_position_embeddings=THR,
               rope_parameters=_longrope(), original_max_position_embeddings=THR)
    assert LongRope.of(m, THR) is None
