"""Batch-invariant mode (`ContinuousBatchingConfig.batch_invariant`): a target request's token
ids and logprob bits are the same alone and inside random mixes of other requests (random
prompts, arrival steps, cancellations), under random `max_batch_tokens` (prompt chunking),
prefix caching, preemption (recompute or CPU offload), async stepping, speculative decoding
(greedy) and 1 or 2 threads; in fp32 and bf16, on a tiny random-init Llama, and on
Gemma2 (sliding and full layers, softcaps) and Mistral (sliding only)."""

from __future__ import annotations

import functools
import os
import random

import pytest
import tiny_models
import torch
from ferrobatch import Engine, FieldError, SamplingParams, SpeculativeConfig
from ferrobatch.cpu import f32_ops
from ferrobatch.runner import linear_policy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariance_helpers import Other, run_target
from isa_helpers import needs_isa

pytestmark = needs_isa(f32_ops.available(), "avx512f", what="batch-invariant products")

PAGE = 8
BIG_CACHE = 256  # blocks: nothing is ever preempted
SMALL_CACHE = 40  # blocks of 8 tokens: the mixes below preempt


@functools.cache
def _model(dtype: str, name: str = "llama") -> torch.nn.Module:
    build = tiny_models.llama if name == "llama" else getattr(tiny_models, name)
    return build(3).to(getattr(torch, dtype))


def _engine(dtype: str, name: str = "llama", **config) -> Engine:
    cfg = dict(page_size=PAGE, num_blocks=BIG_CACHE, batch_invariant=True, **config)
    return Engine(_model(dtype, name), config=cfg, seed=0)


def _prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, tiny_models.VOCAB) for _ in range(n))


def _target_sampling(kind: str, seed: int) -> SamplingParams:
    """"plain": greedy without logprobs (a step whose rows are all such takes the greedy
    head's screened argmax, one with a sampled mate the full logits' argmax)."""
    if kind == "plain":
        return SamplingParams(max_new_tokens=10, ignore_eos=True)
    if kind == "greedy":
        return SamplingParams(max_new_tokens=10, logprobs=3, ignore_eos=True)
    return SamplingParams(max_new_tokens=10, logprobs=3, ignore_eos=True, temperature=0.9,
                          top_p=0.9, top_k=50, seed=seed)


@functools.cache
def _alone(dtype: str, target: tuple[int, ...], kind: str, seed: int, name: str = "llama"):
    """The target alone, one thread, the default budget."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _engine(dtype, name) as engine:
            return run_target(engine, target, _target_sampling(kind, seed))
    finally:
        torch.set_num_threads(threads)


others_st = st.lists(
    st.tuples(
        st.integers(1, 150),  # prompt length
        st.integers(1, 16),  # new tokens
        st.integers(0, 6),  # arrival step
        st.one_of(st.none(), st.integers(0, 12)),  # cancellation step
        st.booleans(),  # greedy (else sampled with logprobs)
        st.integers(0, 40),  # tokens of the target's prompt it starts with (prefix hits)
    ),
    max_size=6,
)


_EXAMPLES = int(os.environ.get("FB_INVARIANCE_EXAMPLES", "30"))
mixes = given(
    target_len=st.integers(1, 120),
    kind=st.sampled_from(["greedy", "seeded", "plain"]),
    others=others_st,
    max_batch_tokens=st.sampled_from([8, 13, 32, 64, 2048]),
    small_cache=st.booleans(),
    offload=st.booleans(),
    sharing=st.booleans(),
    async_batching=st.booleans(),
    spec=st.booleans(),
    threads=st.sampled_from([1, 2]),
    target_arrives=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_settings(_EXAMPLES)
@mixes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_target_alone_equals_target_in_any_mix(dtype, **case) -> None:
    _check_target_in_mix(dtype, "llama", **case)


@_settings(max(4, _EXAMPLES // 3))
@mixes
@pytest.mark.parametrize("name", ["gemma2", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliding_window_target_alone_equals_target_in_any_mix(dtype, name, **case) -> None:
    """Sliding-window layers (windows of 8 and 12 tokens, shorter than most prompts here):
    a prompt row's tokens are attended one by one over a copy of their window."""
    _check_target_in_mix(dtype, name, **case)


def _check_target_in_mix(dtype: str, name: str, **case) -> None:
    try:
        _target_in_mix(dtype, name, **case)
    except AssertionError as exc:  # (hypothesis cannot print a `**case` example)
        raise AssertionError(f"{exc}: {dtype} {name} {case}") from None


def _target_in_mix(
    dtype, name, target_len, kind, others, max_batch_tokens, small_cache, offload, sharing,
    async_batching, spec, threads, target_arrives, seed,
) -> None:
    rng = random.Random(seed)
    target = _prompt(rng, target_len)
    mates = [
        Other(prompt=target[:min(shared, target_len)] + _prompt(rng, n),
              sampling=SamplingParams(max_new_tokens=new, ignore_eos=True) if greedy else
              SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=1.0,
                             logprobs=1, seed=rng.randrange(1000)),
              arrive=arrive, cancel=cancel)
        for n, new, arrive, cancel, greedy, shared in others
    ]
    spec = spec and kind != "seeded"  # speculation keeps greedy tokens, not random draws
    config = dict(
        max_batch_tokens=max_batch_tokens,
        num_blocks=SMALL_CACHE if small_cache else BIG_CACHE,
        cpu_offload_space=0.01 if offload else 0.0,
        allow_block_sharing=sharing,
        use_async_batching=async_batching and not spec,
        adaptive_threads=False,
    )
    want = _alone(dtype, target, kind, seed, name)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Engine(_model(dtype, name), config=dict(page_size=PAGE, batch_invariant=True,
                                                     **config),
                    seed=1, speculative_config=SpeculativeConfig(num_speculative_tokens=3)
                    if spec else None) as engine:
            got = run_target(engine, target, _target_sampling(kind, seed), mates,
                             target_arrives)
    finally:
        torch.set_num_threads(before)
    assert got[0] == want[0], "token ids differ"
    assert got[1] == want[1], "logprob bits differ"


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_default_mode_is_not_invariant_here(dtype, monkeypatch) -> None:
    """The mode is what makes the property hold: without it a bf16 target's logprobs change
    with its batch and its prompt's chunking where the products' backend is chosen by the
    step's rows (here: a CPU whose probe puts fp32 products from `FP32_ROWS` rows, bf16 ones
    below; on AVX-512 with `f32_ops` the default takes its half panels from one row, and
    this scenario no longer tells. Nor in fp32: the prefill kernel sums a prompt token's
    keys in the same blocks from position 0 whatever the chunk, and fp32 products do not
    depend on their batch.) The step-time budget is off: its chunks follow measured step
    times, which would make the run alone chunk like the mixed one on a slow host."""
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda dtype: linear_policy.FP32_ROWS)
    rng = random.Random(5)
    target = _prompt(rng, 300)
    sp = _target_sampling("greedy", 0)
    # decode steps of 20 rows instead of 1
    mates = [Other(_prompt(rng, 5), SamplingParams(max_new_tokens=12, ignore_eos=True))
             for _ in range(20)]
    got = {}
    for invariant in (False, True):
        runs = []
        for others, budget in (((), 2048), (mates, 64)):
            with Engine(_model(dtype), config=dict(page_size=PAGE, num_blocks=BIG_CACHE,
                                                   max_batch_tokens=budget,
                                                   max_step_ms=None,
                                                   batch_invariant=invariant)) as engine:
                runs.append(run_target(engine, target, sp, others))
        got[invariant] = runs[0] == runs[1]
    assert got[True]
    assert not got[False]


def test_refused_where_it_cannot_hold() -> None:
    with pytest.raises(FieldError) as err:
        Engine(tiny_models.mistral(), config=dict(batch_invariant=True, num_blocks=64,
                                                  kv_cache_dtype="int8"))
    assert err.value.field == "batch_invariant"
    assert "sliding" in str(err.value)
    # GPT-2's Conv1D products are torch's (an order chosen by the batch)
    with pytest.raises(FieldError, match="Conv1D") as err:
        Engine(tiny_models.gpt2(), config=dict(batch_invariant=True, num_blocks=64))
    assert err.value.field == "batch_invariant"


def test_engine_argument_overrides_config_and_is_reported() -> None:
    with Engine(_model("float32"), config=dict(num_blocks=64), batch_invariant=True) as e:
        assert e.config.batch_invariant
        assert e.stats()["batch_invariant"] is True
    for dtype in ("float32", "bfloat16"):
        with Engine(_model(dtype), config=dict(num_blocks=64), batch_invariant=True) as e:
            greedy = e.runner.head.greedy
            assert e.runner.fast_greedy == (greedy is not None)
            # only the proven screens, rescored on the head's own product
            assert greedy is None or (greedy.invariant and not greedy.window8
                                      and greedy.full_rows is None)
            if dtype == "bfloat16":  # (a half head keeps its screen: "plain" rows use it)
                assert greedy is not None
    with Engine(_model("float32"), config=dict(num_blocks=64, batch_invariant=True),
                batch_invariant=False) as e:
        assert not e.config.batch_invariant
        assert e.stats()["batch_invariant"] is False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_logprobs_alone_equal_them_in_a_chunked_mix(dtype) -> None:
    """Prompt logprobs (computed during prefill, chunk by chunk) are the same bits whatever
    the chunking and the batch mates."""
    rng = random.Random(9)
    target = list(_prompt(rng, 70))
    sp = SamplingParams(max_new_tokens=3, prompt_logprobs=2, logprobs=1, ignore_eos=True)
    others = [list(_prompt(rng, n)) for n in (40, 90, 7)]
    outs = {}
    for budget, prompts in ((2048, [target]), (16, [*others[:2], target, others[2]])):
        with _engine(dtype, max_batch_tokens=budget) as engine:
            got = engine.generate(prompts, sp, progress=False)
        outs[budget] = next(o for o, p in zip(got, prompts, strict=True) if p is target)
    alone, mixed = outs[2048], outs[16]
    assert alone.prompt_logprobs is not None
    assert alone.prompt_logprobs == mixed.prompt_logprobs
    assert (alone.token_ids, alone.logprobs) == (mixed.token_ids, mixed.logprobs)
