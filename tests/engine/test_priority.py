"""Priority scheduling that preempts (`scheduling_policy="priority"`): requests of higher
priority (lower value) take the places of running ones of lower priority, every output stays
exact, and bad priorities are refused naming the field."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, FieldError, SamplingParams

torch.set_num_threads(1)


@pytest.mark.parametrize("offload,async_batching", [(0.0, False), (0.01, False), (0.0, True)])
def test_high_priority_preempts_and_outputs_stay_exact(offload, async_batching):
    model = tiny_models.llama()
    cfg = ContinuousBatchingConfig(num_blocks=14, page_size=4, max_batch_tokens=64,
                                   scheduling_policy="priority", safety_margin=0.0,
                                   cpu_offload_space=offload,
                                   use_async_batching=async_batching)
    low = [list(range(3 + i, 23 + i)) for i in range(2)]
    high = list(range(100, 124))
    with Engine(model, config=cfg) as eng:
        # driven step by step in this thread (no background loop): deterministic
        def submit(prompt, sp):
            req = eng._make_request(prompt, sp, None)
            eng._submit(req)
            return req

        lows = [submit(p, SamplingParams(max_new_tokens=20, ignore_eos=True, priority=5))
                for p in low]
        while eng.stats()["generated_tokens"] < 4:  # the low ones are decoding
            eng._drive_once()
        hi = submit(high, SamplingParams(max_new_tokens=8, ignore_eos=True, priority=-1))
        while not hi.done.is_set():
            eng._drive_once()
        # it took a low one's place: not both low ones are done when it is
        assert not all(r.done.is_set() for r in lows)
        while not all(r.done.is_set() for r in lows):
            eng._drive_once()
        stats = eng.stats()
    outs = {id(r): r.output for r in [*lows, hi]}
    ids = [id(r) for r in lows]
    hi = id(hi)
    # a low one was preempted for it (by a priority preemption before admission, or, once
    # admitted, by its growth: lower priorities are preempted first)
    assert stats["num_preemptions"] >= 1
    for rid, p in zip(ids, low, strict=True):
        assert outs[rid].token_ids == tiny_models.generate_greedy(model, p, 20, ignore_eos=True)
    assert outs[hi].token_ids == tiny_models.generate_greedy(model, high, 8, ignore_eos=True)


def test_priority_is_checked():
    with pytest.raises(FieldError) as e:
        SamplingParams(priority=1.5)  # type: ignore[arg-type]
    assert e.value.field == "priority"
    with pytest.raises(FieldError) as e:
        SamplingParams(priority=2**31)
    assert e.value.field == "priority"
    with pytest.raises(FieldError) as e:
        ContinuousBatchingConfig(scheduling_policy="lifo")
    assert e.value.field == "scheduling_policy"
    with Engine(tiny_models.llama(), config=ContinuousBatchingConfig(num_blocks=16)) as eng:
        with pytest.raises(FieldError) as e:  # fcfs: no priorities
            eng.generate([[5, 6]], SamplingParams(max_new_tokens=2, priority=1))
        assert e.value.field == "priority"
