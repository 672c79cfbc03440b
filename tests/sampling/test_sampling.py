"""SamplingParams validation and the batched sampler."""

from __future__ import annotations

import math

import pytest
import torch
from ferrobatch import SamplingParams
from ferrobatch.sampling.sampler import Sampler, SamplingState
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

torch.set_num_threads(1)
V = 50


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_new_tokens", dict(max_new_tokens=0)),
        ("max_new_tokens", dict(max_new_tokens=-3)),
        ("max_new_tokens", dict(max_new_tokens=2.5)),
        ("temperature", dict(temperature=math.nan)),
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=math.inf)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_p", dict(top_p=math.nan)),
        ("top_k", dict(top_k=-1)),
        ("min_p", dict(min_p=1.5)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("presence_penalty", dict(presence_penalty=3.0)),
        ("frequency_penalty", dict(frequency_penalty=math.nan)),
        ("logprobs", dict(logprobs=-1)),
        ("stop", dict(stop=[""])),
        ("stop_token_ids", dict(stop_token_ids=[-1])),
        ("seed", dict(seed="abc")),
    ],
)
def test_bad_params_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_from_generation_config() -> None:
    sp = SamplingParams()
    assert sp.greedy and sp.max_new_tokens == 128 and sp.stop == ()
    assert SamplingParams(stop="x").stop == ("x",)
    gc = GenerationConfig(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=7,
        repetition_penalty=1.3, stop_strings=["\n\n"],
    )
    before = gc.to_dict()
    sp = SamplingParams.from_generation_config(gc)
    assert gc.to_dict() == before
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_new_tokens) == (0.7, 20, 0.9, 7)
    assert sp.repetition_penalty == 1.3 and sp.stop == ("\n\n",)
    assert SamplingParams.from_generation_config(GenerationConfig()).greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_beams", 4), ("no_repeat_ngram_size", 3), ("bad_words_ids", [[5]]),
     ("min_new_tokens", 5), ("typical_p", 0.5), ("suppress_tokens", [1])],
)
def test_unsupported_generation_config_fields_are_not_dropped(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_generation_config(GenerationConfig(**{field: value}))
    neutral = GenerationConfig(num_beams=1, min_new_tokens=0, typical_p=1.0)
    assert SamplingParams.from_generation_config(neutral).greedy


def _states(params: list[SamplingParams], hist: list[list[int]] | None = None) -> list:
    hist = hist or [[1, 2, 3]] * len(params)
    return [SamplingState(p, list(h)) for p, h in zip(params, hist, strict=True)]


def test_greedy_is_argmax_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=g)
    params = [SamplingParams()] * 4 + [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    out = Sampler(seed=0)(logits, _states(params)).token_ids
    assert out[:4].tolist() == logits[:4].argmax(-1).tolist()
    assert Sampler()(logits, _states([SamplingParams()] * 8)).token_ids.tolist() == (
        logits.argmax(-1).tolist()
    )


def test_top_k1_top_p_tiny_min_p_one_are_argmax() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ] * 2
    for _ in range(5):
        out = Sampler()(logits, _states(params)).token_ids
        assert out.tolist() == logits.argmax(-1).tolist()


def test_seeded_rows_reproducible_regardless_of_batch_mates() -> None:
    torch.manual_seed(3)
    target = SamplingParams(temperature=1.0, seed=1234)

    def run(mates: int, mate_seed: int) -> list[int]:
        sampler = Sampler(seed=mate_seed)
        st = SamplingState(target, [1])
        others = [SamplingState(SamplingParams(temperature=0.8), [1]) for _ in range(mates)]
        toks = []
        for step in range(20):
            own = torch.randn(1, V, generator=torch.Generator().manual_seed(step))
            k = mates // 2
            mates_logits = torch.randn(mates, V) * 2
            logits = torch.cat([mates_logits[:k], own, mates_logits[k:]])
            out = sampler(logits, others[:k] + [st] + others[k:])
            toks.append(int(out.token_ids[k]))
        return toks

    a = run(0, 1)
    assert a == run(5, 2) == run(3, 99)
    assert len(set(a)) > 3  # actually sampling


def test_sampling_follows_the_distribution_and_support() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    sampler = Sampler(seed=0)
    counts = torch.zeros(V)
    n = 4000
    batch = logits.repeat(n, 1)
    out = sampler(batch, _states([SamplingParams(temperature=1.0)] * n)).token_ids
    counts.index_add_(0, out, torch.ones(n))
    expect = torch.softmax(logits[0], -1) * n
    assert torch.allclose(counts[:4], expect[:4], atol=4 * expect[:4].sqrt().max())
    out = sampler(batch, _states([SamplingParams(temperature=1.0, top_k=2)] * n)).token_ids
    assert set(out.tolist()) <= {0, 1}


def test_warpers_match_transformers() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=g) * 3
    sampler = Sampler(seed=0)
    for tk, tp, mp in [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (7, 0.8, 0.1)]:
        sp = SamplingParams(temperature=0.5, top_k=tk, top_p=tp, min_p=mp)
        ours = sampler._warp(logits.clone(), [sp] * 3)
        ref = logits / 0.5
        if tk:
            ref = TopKLogitsWarper(tk)(None, ref)
        if tp < 1:
            ref = TopPLogitsWarper(tp)(None, ref)
        if mp:
            ref = MinPLogitsWarper(mp)(None, ref)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (tk, tp, mp)


def test_repetition_penalty_matches_transformers() -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, V, generator=g)
    hist = [[3, 4, 5, 3], [10, 11]]
    outs = [[6], [12, 12]]
    sp = SamplingParams(repetition_penalty=1.7)
    states = _states([sp, sp], hist)
    for s, o in zip(states, outs, strict=True):
        s.output_ids.extend(o)
    scores = logits.clone()
    Sampler._apply_penalties(scores, states, scores.device, V)
    for i in range(2):
        ids = torch.tensor([hist[i] + outs[i]])
        ref = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[i : i + 1].clone())
        assert torch.allclose(scores[i], ref[0])
    # greedy with a penalty takes the argmax of penalized logits
    out = Sampler()(logits, states).token_ids
    assert out.tolist() == scores.argmax(-1).tolist()


def test_presence_frequency_penalties_use_generated_tokens_only() -> None:
    logits = torch.zeros(1, V)
    st = SamplingState(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [7, 7, 7])
    st.output_ids.extend([3, 3, 4])
    scores = logits.clone()
    Sampler._apply_penalties(scores, [st], scores.device, V)
    assert scores[0, 7] == 0.0
    assert scores[0, 3] == pytest.approx(-0.5 - 0.5)
    assert scores[0, 4] == pytest.approx(-0.5 - 0.25)


def test_logprobs_top_n_plus_chosen() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)]
    res = Sampler()(logits, _states(params))
    assert res.logprobs is not None and res.logprobs[1] is None
    lp = torch.log_softmax(logits, -1)
    top = lp[0].topk(3)
    d0 = res.logprobs[0]
    assert set(d0) == set(top.indices.tolist())  # greedy choice is in the top 3
    for t, v in d0.items():
        assert v == pytest.approx(lp[0, t].item(), abs=1e-6)
    chosen = int(res.token_ids[2])
    assert res.logprobs[2] == {chosen: pytest.approx(lp[2, chosen].item(), abs=1e-6)}
