"""`SamplingParams.prompt_logprobs`: every prompt token's logprob (first None) and its top-n
alternatives, computed chunk by chunk during prefill, against the model's own full forward
(fp32), with chunked prefill, batch mates, async batching, preemption by soft reset and
offload, and the prefix cache (requests that want prompt logprobs take no hits)."""

from __future__ import annotations

import math

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams


def _reference(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 log-softmax of the model's own forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(model, out, n: int, *, atol: float = 1e-4) -> None:
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids)
    assert plp[0] is None
    ref = _reference(model, ids)
    for i in range(1, len(ids)):
        d = plp[i]
        assert ids[i] in d
        assert math.isclose(d[ids[i]], ref[i - 1, ids[i]].item(), abs_tol=atol), i
        assert len(d) in (n, n + 1)  # the top-n first, then the prompt token if not among them
        if n:
            want = torch.topk(ref[i - 1], n)
            got_vals = [d[t] for t in list(d)[:n]]
            assert torch.allclose(torch.tensor(got_vals), want.values, atol=atol)


@pytest.fixture(scope="module")
def tiny():
    return tiny_models.llama(seed=3)


def _prompts(k: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, tiny_models.VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),
                      generator=g).tolist()
        for _ in range(k)
    ]


@pytest.mark.parametrize("async_batching", [False, True])
def test_chunked_prefill_and_batch_mates(tiny, async_batching):
    # max_batch_tokens 16: every prompt is prefilled in chunks shared with other rows
    cfg = ContinuousBatchingConfig(num_blocks=128, page_size=8, max_batch_tokens=16,
                                   use_async_batching=async_batching)
    prompts = _prompts(6)
    sps = [SamplingParams(max_new_tokens=4, prompt_logprobs=[0, 3, None][i % 3])
           for i in range(len(prompts))]
    with Engine(tiny, config=cfg) as eng:
        outs = eng.generate(prompts, sps, progress=False)
        alone = eng.generate(prompts, SamplingParams(max_new_tokens=4), progress=False)
    for sp, out, ref in zip(sps, outs, alone, strict=True):
        assert out.token_ids == ref.token_ids  # generation unchanged
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            _check(tiny, out, sp.prompt_logprobs)


def test_prefix_cache_hits_are_not_taken(tiny):
    cfg = ContinuousBatchingConfig(num_blocks=128, page_size=8, max_batch_tokens=64)
    prompt = _prompts(1, 30, 31)[0]
    with Engine(tiny, config=cfg) as eng:
        eng.generate([prompt], SamplingParams(max_new_tokens=2), progress=False)
        hits0 = eng.scheduler.stats()["prefix_hit_tokens"]
        [out] = eng.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=1),
                             progress=False)
        assert eng.scheduler.stats()["prefix_hit_tokens"] == hits0  # computed, not reused
        _check(tiny, out, 1)
        # its blocks are still there for others: a plain request hits
        eng.generate([prompt], SamplingParams(max_new_tokens=2), progress=False)
        assert eng.scheduler.stats()["prefix_hit_tokens"] > hits0


@pytest.mark.parametrize("offload", [0.0, 0.01])
def test_preemption_recompute_and_offload(tiny, offload):
    # a cache far too small for the batch: soft resets (or swaps) while prompts and
    # generations are in flight; every prompt position is recorded exactly once
    cfg = ContinuousBatchingConfig(num_blocks=14, page_size=4, max_batch_tokens=24,
                                   cpu_offload_space=offload)
    prompts = _prompts(5, 12, 24)
    sp = SamplingParams(max_new_tokens=12, prompt_logprobs=2)
    with Engine(tiny, config=cfg) as eng:
        outs = eng.generate(prompts, sp, progress=False)
        st = eng.stats()
    assert st["num_soft_resets" if not offload else "num_offloads"] > 0, st
    for out in outs:
        _check(tiny, out, 2)


def test_stream_first_delta_carries_them_and_validation(tiny):
    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=8)
    prompt = _prompts(1)[0]
    with Engine(tiny, config=cfg) as eng:
        deltas = list(eng.stream(prompt, SamplingParams(max_new_tokens=3, prompt_logprobs=0)))
        assert deltas[0].prompt_logprobs is not None
        assert len(deltas[0].prompt_logprobs) == len(prompt)
        assert all(d.prompt_logprobs is None for d in deltas[1:])
        # a one-token prompt: just [None]
        [one] = eng.generate([[5]], SamplingParams(max_new_tokens=1, prompt_logprobs=3),
                             progress=False)
        assert one.prompt_logprobs == [None]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_bundled_model_matches_transformers():
    from ferrobatch.models import bundled_model_dir
    from transformers import AutoModelForCausalLM

    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=8, max_batch_tokens=16)
    prompts = ["The capital of France is Paris, and the capital of Germany is", "Hi there"]
    with Engine(config=cfg) as eng:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=2, prompt_logprobs=2),
                            progress=False)
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32)
    for out in outs:
        _check(model, out, 2, atol=2e-4)
