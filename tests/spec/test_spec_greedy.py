"""Speculative decoding, greedy: outputs identical to non-speculative greedy and to
`model.generate` (fp32) on every architecture, with chunked prefill, preemption, prefix
sharing, stop conditions inside accepted runs, and the greedy head screen."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.errors import FieldError
from ferrobatch.runner.greedy_head import GreedyHead
from ferrobatch.spec import SpeculativeConfig
from isa_helpers import needs_greedy_screen

torch.set_num_threads(1)

# Repetitive prompts: prompt lookup finds matches (random-init models also loop).
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13, 11, 12, 13, 11, 12],
    list(range(20, 45)),
    [3, 4] * 9,
]
ALWAYS = dict(min_acceptance_rate=0.0)  # never back off: every step with a match speculates


def run(model, cfg, prompts, sp, spec=None):
    with Engine(model, config=cfg, speculative_config=spec) as eng:
        outs = eng.generate(prompts, sp, progress=False)
        return [o.token_ids for o in outs], [o.finish_reason for o in outs], eng.stats()


@pytest.mark.parametrize(
    "arch", ["llama", "qwen3", "mistral", "qwen2_sliding", "gemma2", "gemma3", "gpt2"]
)
def test_greedy_equals_generate_every_architecture(arch) -> None:
    model = tiny_models.BUILDERS[arch]()
    cfg = ContinuousBatchingConfig(num_blocks=96, page_size=4, max_batch_tokens=24)
    sp = SamplingParams(max_new_tokens=20)
    spec = SpeculativeConfig(num_speculative_tokens=3, **ALWAYS)
    got, _, st = run(model, cfg, PROMPTS, sp, spec)
    assert st["spec_rows"] > 0 and st["spec_proposed"] >= st["spec_accepted"]
    for p, g in zip(PROMPTS, got, strict=True):
        assert g == tiny_models.generate_greedy(model, p, 20), arch
    # and the same as the engine without speculation
    ref, _, _ = run(model, cfg, PROMPTS, sp)
    assert got == ref


def test_preemption_chunking_prefix_sharing_and_stops() -> None:
    model = tiny_models.llama()
    shared = [9, 8, 7, 6, 5, 4, 3, 9, 8, 7, 6, 5]
    prompts = [shared + p for p in PROMPTS] + [shared * 2]
    # a tiny pool: preemption (soft reset) while speculative rows run; chunked prefill
    cfg = ContinuousBatchingConfig(num_blocks=40, page_size=4, max_batch_tokens=16)
    ref, ref_fin, ref_st = run(model, cfg, prompts, SamplingParams(max_new_tokens=30))
    for k in (1, 2, 4):
        spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=4, **ALWAYS)
        got, fin, st = run(model, cfg, prompts, SamplingParams(max_new_tokens=30), spec)
        assert got == ref and fin == ref_fin, k
        assert st["spec_rows"] > 0 and st["spec_accepted"] > 0
        assert st["num_preemptions"] > 0 and st["prefix_hit_tokens"] > 0
        assert st["num_used_blocks"] == 0
    # stop token ids / max_new_tokens cut an accepted run exactly
    stop_tok = ref[0][7]
    sp = SamplingParams(max_new_tokens=13, stop_token_ids=[stop_tok])
    ref2, fin2, _ = run(model, cfg, prompts, sp)
    got2, gfin2, _ = run(
        model, cfg, prompts, sp, SpeculativeConfig(num_speculative_tokens=4, **ALWAYS)
    )
    assert got2 == ref2 and gfin2 == fin2
    assert ref2[0][-1] == stop_tok and len(ref2[0]) <= 8


@needs_greedy_screen
def test_greedy_head_screen_and_large_vocab(monkeypatch) -> None:
    # forced on: whether the screen wins is a timing of this CPU
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: True)
    model = tiny_models.bench_llama()
    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=8, max_batch_tokens=64)
    prompts = [[100 + i % 7 for i in range(30)], [5, 6, 7] * 6]
    spec = SpeculativeConfig(num_speculative_tokens=4, **ALWAYS)
    with Engine(model, config=cfg, speculative_config=spec) as eng:
        assert eng.runner.fast_greedy, "the greedy head screen is on for this model"
        got = [
            o.token_ids
            for o in eng.generate(prompts, SamplingParams(max_new_tokens=16), progress=False)
        ]
        assert eng.stats()["spec_rows"] > 0
    for p, g in zip(prompts, got, strict=True):
        assert g == tiny_models.generate_greedy(model, p, 16)


def test_switches_off_at_large_batch_and_low_acceptance() -> None:
    model = tiny_models.llama()
    cfg = ContinuousBatchingConfig(num_blocks=128, page_size=4, max_batch_tokens=128)
    prompts = [[5, 6] * 6 for _ in range(8)]
    # 8 rows * (1 + 4) > 20: no step speculates
    spec = SpeculativeConfig(num_speculative_tokens=4, max_spec_tokens_per_step=20)
    _, _, st = run(model, cfg, prompts, SamplingParams(max_new_tokens=8), spec)
    assert st["spec_rows"] == 0 and st["spec_skipped_batch_steps"] > 0
    # acceptance 0 < 0.99: requests back off, so far fewer rows speculate than steps
    spec = SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.99)
    _, _, st = run(model, cfg, PROMPTS, SamplingParams(max_new_tokens=40), spec)
    assert st["spec_backoffs"] > 0
    spec_all = SpeculativeConfig(num_speculative_tokens=4, **ALWAYS)
    _, _, st_all = run(model, cfg, PROMPTS, SamplingParams(max_new_tokens=40), spec_all)
    assert st["spec_rows"] < st_all["spec_rows"]


def test_config_validation() -> None:
    for kw, field in [
        (dict(method="eagle"), "method"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
        (dict(method="draft"), "draft_model"),
        (dict(draft_model="x"), "draft_model"),
        (dict(min_acceptance_rate=2.0), "min_acceptance_rate"),
        (dict(max_spec_tokens_per_step=0), "max_spec_tokens_per_step"),
    ]:
        with pytest.raises(FieldError) as e:
            SpeculativeConfig(**kw)
        assert e.value.field == field
    with pytest.raises(FieldError) as e:
        SpeculativeConfig.coerce({"bogus": 1})
    assert e.value.field == "bogus"
    assert SpeculativeConfig.coerce({"num_speculative_tokens": 2}).num_speculative_tokens == 2
