"""Greedy parity: every request's tokens equal `model.generate` on that prompt alone.

Tiny random-init fp32 models (full, sliding, hybrid attention), random prompts of mixed
lengths, under the engine's default settings and under pressure: a pool far too small
(preemption by soft reset), CPU offload, prefix sharing on and off with shared prefixes,
both schedulers, chunked prefill, and cancellation of some requests mid-flight.
"""

from __future__ import annotations

import functools
import time

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams, defaults

torch.set_num_threads(1)

ARCHS = ["llama", "qwen3", "mistral", "gemma2", "gemma3"]
NEW = 16
PAGE = 8


@functools.cache
def model(arch: str):
    return getattr(tiny_models, arch)()



@functools.cache
def reference(arch: str, prompt: tuple[int, ...], new: int = NEW) -> tuple[int, ...]:
    with torch.no_grad():
        out = model(arch).generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=0
        )
    return tuple(out[0, len(prompt) :].tolist())


def run_engine(arch: str, prompts, *, online: bool = False, **cfg) -> list[list[int]]:
    """Greedy tokens of `prompts` on an engine of `cfg`: one `generate` call (an offline
    batch), or with `online` the same requests arriving together as a server's clients
    send them (requests someone may stream: the step-time budget serves them)."""
    config = ContinuousBatchingConfig(page_size=PAGE, **{"num_blocks": 512, **cfg})
    sp = SamplingParams(max_new_tokens=NEW)
    with Engine(model(arch), config=config) as eng:
        if online:
            reqs = [eng._make_request(list(p), sp, None) for p in prompts]
            outs = eng._run_batch(reqs, progress=False, desc="online", offline=False)
        else:
            outs = eng.generate([list(p) for p in prompts], sp, progress=False)
        stats = eng.stats()
    assert all(o.finished and o.finish_reason in ("stop", "length") for o in outs)
    run_engine.last_stats = stats  # type: ignore[attr-defined]
    return [o.token_ids for o in outs]


def check(arch: str, prompts, got: list[list[int]]) -> None:
    for p, g in zip(prompts, got, strict=True):
        assert tuple(g) == reference(arch, p), f"{arch}: prompt of {len(p)} tokens diverged"


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_default(arch: str) -> None:
    prompts = tiny_models.mixed_prompts(1)
    check(arch, prompts, run_engine(arch, prompts))


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_step_time_budget(arch: str) -> None:
    """A 1 ms step-time budget: prefill chunks of a few tokens, sized from measured step
    times (so boundaries vary run to run), prefills sharing steps (fair order): outputs
    equal `generate` all the same."""
    prompts = tiny_models.mixed_prompts(3)
    check(arch, prompts, run_engine(arch, prompts, online=True, max_step_ms=1.0))
    assert run_engine.last_stats["time_budget_steps"] > 0


def test_an_offline_batch_is_not_chunked_by_time() -> None:
    """`generate` is an offline batch (its caller waits for all of it): the step-time budget
    does not bind, its prompts prefill in `max_batch_tokens` chunks."""
    prompts = tiny_models.mixed_prompts(3)
    check("llama", prompts, run_engine("llama", prompts, max_step_ms=1.0))
    assert run_engine.last_stats["time_budget_steps"] == 0


def test_step_time_budget_reaches_the_scheduler_on_cpu() -> None:
    """CPU: the config's `max_step_ms` (default on) goes to the scheduler, which gets each
    step's measured time; the engine keeps a (seconds, prefill budget) record per step."""
    prompts = tiny_models.mixed_prompts(4, n=3)
    with Engine(model("llama"), config=ContinuousBatchingConfig(page_size=PAGE)) as eng:
        assert eng.scheduler.max_step_ms == defaults.MAX_STEP_MS
        eng.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=4),
                     progress=False)
        records = eng.take_step_records()
        assert len(records) == eng.stats()["steps"] and eng.take_step_records() == []
        assert all(sec > 0 and budget >= 1 for sec, budget in records)
        assert eng.stats()["cost_samples"] == len(records)
    off = ContinuousBatchingConfig(page_size=PAGE, max_step_ms=None)
    with Engine(model("llama"), config=off) as eng:
        assert eng.scheduler.max_step_ms is None


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_chunked_prefill_small_batches(arch: str) -> None:
    prompts = tiny_models.mixed_prompts(2)
    check(arch, prompts, run_engine(arch, prompts, max_batch_tokens=13, max_requests_per_batch=3))


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_prefill_first(arch: str) -> None:
    prompts = tiny_models.mixed_prompts(3)
    got = run_engine(arch, prompts, scheduler_type="prefill_first", max_batch_tokens=32)
    check(arch, prompts, got)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("offload", [0.0, 0.01], ids=["soft-reset", "cpu-offload"])
def test_parity_forced_preemption(arch: str, offload: float) -> None:
    prompts = tiny_models.mixed_prompts(4)
    # the longest request needs ceil((57 + 16) / 8) = 10 blocks: 12 is far too small for 7
    got = run_engine(arch, prompts, num_blocks=12, cpu_offload_space=offload,
                     max_batch_tokens=32)
    check(arch, prompts, got)
    stats = run_engine.last_stats
    assert stats["num_preemptions"] > 0
    if offload:
        assert stats["num_offloads"] > 0
    else:
        assert stats["num_soft_resets"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("sharing", [True, False], ids=["sharing", "no-sharing"])
def test_parity_shared_prefixes(arch: str, sharing: bool) -> None:
    prompts = tiny_models.mixed_prompts(5, n=8, shared_prefix=29)
    got = run_engine(arch, prompts, allow_block_sharing=sharing, max_batch_tokens=64)
    check(arch, prompts, got)
    hit_rate = run_engine.last_stats["prefix_hit_rate"]
    if sharing and arch != "gemma3":  # sharing is off for sliding-window (hybrid) models
        assert hit_rate > 0.2
    else:
        assert hit_rate == 0.0
    # a second wave with the same prefix after the first finished reuses cached blocks
    prompts2 = tiny_models.mixed_prompts(5, n=8, shared_prefix=29)[::-1]
    check(arch, prompts2, run_engine(arch, prompts2, allow_block_sharing=sharing))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("max_step_ms", [None, 0.5])
def test_parity_shared_prefix_arriving_together(arch: str, max_step_ms: float | None) -> None:
    """Prompts with a common prefix of several pages, all in one step's token budget: the
    followers are put off and take the leader's blocks as hits (in-batch prefix sharing),
    with outputs still equal to `generate`; hybrid sliding models share nothing and put
    nothing off. With a step-time budget that chunks the prompts once decodes run, the
    followers wait for the blocks the leader has yet to fill, not compute them too."""
    prompts = tiny_models.mixed_prompts(11, n=8, shared_prefix=4 * PAGE + 3)
    got = run_engine(arch, prompts, online=max_step_ms is not None, max_batch_tokens=512,
                     max_step_ms=max_step_ms)
    check(arch, prompts, got)
    stats = run_engine.last_stats
    if arch == "gemma3":
        assert stats["deferred_admissions"] == 0 and stats["prefix_hit_rate"] == 0.0
    else:
        if max_step_ms is None:  # (one step each; chunked, one per chunk filling them)
            assert stats["deferred_admissions"] == len(prompts) - 1
        else:
            assert stats["deferred_admissions"] >= len(prompts) - 1
        # every follower takes the four shared pages (at most its last token recomputed)
        assert stats["prefix_hit_tokens"] >= (len(prompts) - 1) * 4 * PAGE - PAGE


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_parity_with_cancellations(arch: str) -> None:
    prompts = tiny_models.mixed_prompts(6, n=8)
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=24)
    slow = SamplingParams(max_new_tokens=200, ignore_eos=True)
    with Engine(model(arch), config=config) as eng:
        rids = []
        for i, p in enumerate(prompts):
            rids.append(eng.add_request(list(p), slow if i % 3 == 0 else
                                        SamplingParams(max_new_tokens=NEW)))
        time.sleep(0.02)
        cancelled = [rids[i] for i in range(0, len(prompts), 3)]
        for rid in cancelled:
            assert eng.cancel(rid)
        for i, rid in enumerate(rids):
            out = eng.get_output(rid, timeout=60)
            if rid in cancelled:
                assert out.finish_reason == "cancelled" and out.finished
                # whatever it produced before the cancel is a prefix of the greedy answer
                ref = reference(arch, prompts[i])
                n = min(len(out.token_ids), len(ref))
                assert tuple(out.token_ids[:n]) == ref[:n]
            else:
                assert tuple(out.token_ids) == reference(arch, prompts[i])
