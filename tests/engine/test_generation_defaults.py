"""Generation semantics: transformers' GenerationConfig defaults, the model's own
generation config applied when no sampling is given, unsupported processors named, and
values that cannot be honoured (tiny temperatures, seeds beyond 64 bits) rejected with the
field named in the engine and the server alike."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.sampling.params import MIN_TEMPERATURE
from server_helpers import FakeEngine, _check_error, _post, build_tokenizer, serve
from tiny_models import VOCAB, llama

torch.set_num_threads(1)

CFG = ContinuousBatchingConfig(page_size=8, num_blocks=64)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 9))] for _ in range(n)]


def test_do_sample_follows_transformers_defaults() -> None:
    sp = SamplingParams.from_generation_config(transformers.GenerationConfig(do_sample=True))
    assert (sp.temperature, sp.top_k, sp.top_p) == (1.0, 50, 1.0)
    # an explicit top_k=0 still means no top-k
    assert SamplingParams.from_generation_config(
        transformers.GenerationConfig(do_sample=True, top_k=0)).top_k == 0


def test_do_sample_samples_only_from_the_top_50() -> None:
    m = llama()
    prompt = [5, 6, 7, 8]
    with torch.inference_mode():
        logits = m(torch.tensor([prompt])).logits[0, -1]
    top50 = set(logits.topk(50).indices.tolist())
    gc = transformers.GenerationConfig(do_sample=True, max_new_tokens=1)
    with Engine(m, config=CFG, seed=3) as eng:
        outs = eng.generate([prompt] * 200, gc, progress=False)
    firsts = [o.token_ids[0] for o in outs]
    assert set(firsts) <= top50
    assert len(set(firsts)) > 10  # it does sample


def test_generation_config_without_max_new_tokens_stops_at_max_length() -> None:
    m = llama()
    gc = transformers.GenerationConfig(do_sample=False)
    prompts = _prompts(3)
    with Engine(m, config=CFG) as eng:
        outs = eng.generate(prompts, gc, progress=False)
        longer = eng.generate(prompts, transformers.GenerationConfig(max_length=30),
                              progress=False)
    for p, o, o30 in zip(prompts, outs, longer, strict=True):
        for got, g in ((o, gc), (o30, transformers.GenerationConfig(max_length=30))):
            with torch.inference_mode():
                ref = m.generate(torch.tensor([p]), generation_config=copy.deepcopy(g))
            assert got.token_ids == ref[0, len(p):].tolist()
        assert len(o.token_ids) == 20 or o.finish_reason == "stop"
        assert len(o30.token_ids) == 30 - len(p) or o30.finish_reason == "stop"


def _model_with_generation_config(**fields):
    m = llama(seed=1)
    m.generation_config = copy.deepcopy(m.generation_config)
    for k, v in fields.items():
        setattr(m.generation_config, k, v)
    return m


def test_the_models_generation_config_applies_when_no_sampling_is_given() -> None:
    """sampling=None means the model's generation config, as for model.generate and vLLM:
    here its repetition_penalty=1.3 (greedy). An explicit SamplingParams is used as given."""
    m = _model_with_generation_config(repetition_penalty=1.3)
    prompts = _prompts(4, seed=2)
    with Engine(m, config=CFG) as eng:
        assert eng.generation_defaults.repetition_penalty == 1.3
        default = eng.generate(prompts, max_new_tokens=12, progress=False)
        plain = eng.generate(prompts, SamplingParams(max_new_tokens=12), progress=False)
    differ = 0
    for p, o, q in zip(prompts, default, plain, strict=True):
        with torch.inference_mode():
            ref = m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                             pad_token_id=0)
        assert o.token_ids == ref[0, len(p):].tolist()
        with torch.inference_mode():
            ref1 = m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                              pad_token_id=0, repetition_penalty=1.0)
        assert q.token_ids == ref1[0, len(p):].tolist()
        differ += o.token_ids != q.token_ids
    assert differ > 0  # the penalty changed something


def test_the_models_sampling_defaults_apply() -> None:
    m = _model_with_generation_config(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    with Engine(m, config=CFG) as eng:
        d = eng.generation_defaults
        assert (d.temperature, d.top_k, d.top_p) == (0.7, 20, 0.9)
        assert d.max_new_tokens is None  # the length stays the engine's default
        out = eng.generate([[5, 6, 7]], progress=False)[0]
        assert len(out.token_ids) == min(eng.default_max_new_tokens, 1024 - 3) or \
            out.finish_reason == "stop"


def test_unsupported_processors_are_named() -> None:
    m = _model_with_generation_config(no_repeat_ngram_size=2)
    with pytest.warns(UserWarning, match="no_repeat_ngram_size"):
        eng = Engine(m, config=CFG)
    eng.close()
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        SamplingParams.from_generation_config(
            transformers.GenerationConfig(no_repeat_ngram_size=2))


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, MIN_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    """Below MIN_TEMPERATURE the scaled logits would overflow (every sample token 0): such a
    temperature is defined as greedy, as in vLLM."""
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    m = llama()
    p = [5, 6, 7, 8]
    with Engine(m, config=CFG) as eng:
        out = eng.generate([p], SamplingParams(temperature=temperature, seed=1,
                                               max_new_tokens=8), progress=False)[0]
        ref = eng.generate([p], SamplingParams(max_new_tokens=8), progress=False)[0]
    assert out.token_ids == ref.token_ids
    assert set(out.token_ids) != {0}


@pytest.mark.parametrize("seed", [-1, 2**64, 2**80])
def test_seeds_outside_64_bits_are_rejected(seed: int) -> None:
    with pytest.raises(ValueError, match="^seed"):
        SamplingParams(temperature=1.0, seed=seed)


def test_largest_seeds_are_distinct() -> None:
    m = llama()
    prompts = [[5, 6, 7]] * 2
    with Engine(m, config=CFG) as eng:
        outs = eng.generate(prompts, [SamplingParams(temperature=1.0, seed=s, max_new_tokens=8)
                                      for s in (0, 2**64 - 1)], progress=False)
    assert outs[0].token_ids != outs[1].token_ids


@pytest.mark.parametrize(("field", "value"), [("seed", 2**80), ("seed", 2**64), ("seed", -5)])
def test_server_rejects_them_naming_the_field(field: str, value: float) -> None:
    with serve(FakeEngine(build_tokenizer())) as srv:
        body = {"prompt": "hello", "max_tokens": 2, "temperature": 1.0, field: value}
        r = _post(srv.url, "/v1/completions", body, {})
        _check_error(r, 400, field, field)
