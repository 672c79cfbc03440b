"""The engine with `use_async_batching=True` on CPU (the pipeline of `ferrobatch.engine.pipeline`
with one step in flight, run step after step): greedy parity with `model.generate` on
tiny models under the same pressures as tests/engine/test_engine_parity.py, and the engine
behaviours that touch the step in flight (stop strings, EOS, cancellation, seeded
sampling identical to synchronous mode, streaming, errors, close). Every test checks that
the pipeline really planned steps ahead."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import test_engine_parity as par
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from test_engine import CharTokenizer, prompts

torch.set_num_threads(1)

ARCHS = par.ARCHS
PAGE = par.PAGE


def run_async(arch: str, ps, **cfg) -> list[list[int]]:
    got = par.run_engine(arch, ps, use_async_batching=True, **cfg)
    stats = par.run_engine.last_stats
    assert stats["async_batching"] is True
    assert stats["ahead_steps"] > 0, "the pipeline never planned a step ahead"
    assert stats["ahead_steps"] < stats["steps"]
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_async_parity_default(arch: str) -> None:
    ps = tiny_models.mixed_prompts(1)
    par.check(arch, ps, run_async(arch, ps))
    # most steps of a decode-heavy run are planned ahead
    stats = par.run_engine.last_stats
    assert stats["ahead_steps"] >= stats["steps"] // 2


@pytest.mark.parametrize("arch", ARCHS)
def test_async_parity_chunked_prefill_small_batches(arch: str) -> None:
    ps = tiny_models.mixed_prompts(2)
    par.check(arch, ps, run_async(arch, ps, max_batch_tokens=13, max_requests_per_batch=3))


@pytest.mark.parametrize("arch", ARCHS)
def test_async_parity_prefill_first(arch: str) -> None:
    ps = tiny_models.mixed_prompts(3)
    par.check(arch, ps, run_async(arch, ps, scheduler_type="prefill_first", max_batch_tokens=32))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("offload", [0.0, 0.01], ids=["soft-reset", "cpu-offload"])
def test_async_parity_forced_preemption(arch: str, offload: float) -> None:
    ps = tiny_models.mixed_prompts(4)
    got = run_async(arch, ps, num_blocks=12, cpu_offload_space=offload, max_batch_tokens=32)
    par.check(arch, ps, got)
    stats = par.run_engine.last_stats
    assert stats["num_preemptions"] > 0
    assert stats["num_offloads" if offload else "num_soft_resets"] > 0
    # preemption happens in schedule(), after a drain: ahead plans left rows out (stalled);
    # with offload, chunks freed while requests are swapped out drain to let them swap in
    assert stats["stall_drains"] > 0
    assert stats["pipeline_drains"] >= stats["stall_drains"] + stats["swap_drains"]
    if offload:
        assert stats["swap_drains"] > 0
    # and the pipeline does not cost steps: about as many as synchronous mode takes
    par.run_engine(arch, ps, num_blocks=12, cpu_offload_space=offload, max_batch_tokens=32)
    assert stats["steps"] <= 1.15 * par.run_engine.last_stats["steps"] + 1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("sharing", [True, False], ids=["sharing", "no-sharing"])
def test_async_parity_shared_prefixes(arch: str, sharing: bool) -> None:
    ps = tiny_models.mixed_prompts(5, n=8, shared_prefix=29)
    par.check(arch, ps, run_async(arch, ps, allow_block_sharing=sharing, max_batch_tokens=64))
    hit_rate = par.run_engine.last_stats["prefix_hit_rate"]
    if sharing and arch != "gemma3":
        assert hit_rate > 0.2
    else:
        assert hit_rate == 0.0


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_async_parity_with_cancellations_mid_flight(arch: str) -> None:
    ps = tiny_models.mixed_prompts(6, n=8)
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=24,
                                      use_async_batching=True)  # fmt: skip
    slow = SamplingParams(max_new_tokens=200, ignore_eos=True)
    with Engine(par.model(arch), config=config) as eng:
        rids = [eng.add_request(list(p), slow if i % 3 == 0 else
                                SamplingParams(max_new_tokens=par.NEW))
                for i, p in enumerate(ps)]  # fmt: skip
        time.sleep(0.02)
        cancelled = [rids[i] for i in range(0, len(ps), 3)]
        for rid in cancelled:
            assert eng.cancel(rid)
        for i, rid in enumerate(rids):
            out = eng.get_output(rid, timeout=60)
            ref = par.reference(arch, ps[i])
            if rid in cancelled:
                assert out.finish_reason == "cancelled" and out.finished
                assert len(out.token_ids) < 200
                n = min(len(out.token_ids), len(ref))
                assert tuple(out.token_ids[:n]) == ref[:n]
            else:
                assert tuple(out.token_ids) == ref
        assert eng.stats()["ahead_steps"] > 0


@pytest.fixture(scope="module")
def engines():
    """A synchronous and an async engine on the same tiny Llama, with a text tokenizer."""
    model = tiny_models.llama()
    base = dict(num_blocks=256, page_size=8, max_batch_tokens=64)
    sync = Engine(model, config=ContinuousBatchingConfig(**base, use_async_batching=False),
                  tokenizer=CharTokenizer())  # fmt: skip
    asy = Engine(model, config=ContinuousBatchingConfig(**base, use_async_batching=True),
                 tokenizer=CharTokenizer())  # fmt: skip
    assert sync.async_batching is False and asy.async_batching is True
    yield sync, asy
    sync.close()
    asy.close()


def _ahead(eng: Engine) -> int:
    return eng.stats()["ahead_steps"]


def test_stop_strings_on_a_request_in_flight(engines) -> None:
    sync, asy = engines
    p = prompts(1, seed=4, lo=10)[0]
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    full = asy.generate([p], long, progress=False)[0]
    assert full.text == sync.generate([p], long, progress=False)[0].text
    assert len(full.text) > 12
    before = _ahead(asy)
    for k in (3, 7, len(full.text) // 2):
        stop = full.text[k : k + 3]
        if not stop.strip():
            continue
        cut = full.text[: full.text.find(stop)]
        sp = SamplingParams(**{**long.__dict__, "stop": (stop,)})
        # with batch mates, so the stopped request's next row is already in the next plan
        mates = prompts(3, seed=40)
        outs = asy.generate([p, *mates], [sp] + [long] * 3, progress=False)
        ref = sync.generate([p, *mates], [sp] + [long] * 3, progress=False)
        out = outs[0]
        assert out.text == cut and out.finish_reason == "stop" and out.finished
        assert out.token_ids == ref[0].token_ids and len(out.token_ids) < 40
        assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in ref[1:]]
        streamed = list(asy.stream(p, sp))
        assert "".join(d.text for d in streamed) == cut
        assert streamed[-1].finish_reason == "stop"
    assert _ahead(asy) > before


def test_eos_mid_stream(engines) -> None:
    sync, asy = engines
    p = prompts(1, seed=5)[0]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    toks = asy.generate([p], greedy, progress=False)[0].token_ids
    stop_tok = toks[4]
    first = toks.index(stop_tok)
    sp = SamplingParams(max_new_tokens=12, stop_token_ids=[stop_tok])
    mates = prompts(2, seed=41)
    outs = asy.generate([p, *mates], [sp, greedy, greedy], progress=False)
    assert outs[0].token_ids == toks[: first + 1] and outs[0].finish_reason == "stop"
    ref = sync.generate([p, *mates], [sp, greedy, greedy], progress=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_seeded_sampling_identical_to_sync_mode(engines) -> None:
    sync, asy = engines
    ps = prompts(5, seed=10)
    sps = [
        SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, seed=1234, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, min_p=0.05, seed=7,
                       presence_penalty=0.5, frequency_penalty=0.4, ignore_eos=True),
        SamplingParams(max_new_tokens=10, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=14, temperature=1.2, seed=99, repetition_penalty=1.2,
                       logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=9, logprobs=0, ignore_eos=True),
    ]
    before = _ahead(asy)
    got = asy.generate(ps, sps, progress=False)
    want = sync.generate(ps, sps, progress=False)
    assert _ahead(asy) > before
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert (g.logprobs is None) == (w.logprobs is None)
        if g.logprobs is not None:
            assert len(g.logprobs) == len(g.token_ids)
            for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
                assert lg.keys() == lw.keys()
                assert all(abs(lg[k] - lw[k]) < 1e-4 for k in lg)
    # penalties saw the token of the step before: no repeats under a strong penalty
    assert len(set(got[2].token_ids)) == len(got[2].token_ids)


def test_stream_and_astream_deltas_concatenate_to_final(engines) -> None:
    _, asy = engines
    p = prompts(1, seed=6)[0]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    final = asy.generate([p], greedy, progress=False)[0]
    deltas = list(asy.stream(p, greedy))
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]

    async def collect():
        return [d async for d in asy.astream(p, greedy)]

    adeltas = asyncio.run(collect())
    assert sum((d.token_ids for d in adeltas), []) == final.token_ids
    assert adeltas[-1].finish_reason == "length"


class Boom(RuntimeError):
    pass


def _failing_async_engine(after: int, gate: threading.Event | None = None) -> Engine:
    eng = Engine(tiny_models.llama(), config=ContinuousBatchingConfig(
        num_blocks=64, page_size=8, use_async_batching=True))  # fmt: skip
    real = eng.runner.execute
    calls = {"n": 0}

    def execute(plan, prev_tokens=None):
        calls["n"] += 1
        if calls["n"] > after:
            if gate is not None:
                gate.wait(30)
            raise Boom("forward failed")
        return real(plan, prev_tokens=prev_tokens)

    eng.runner.execute = execute
    return eng


def test_errors_reach_every_caller() -> None:
    ps = prompts(3, seed=15)
    long = SamplingParams(max_new_tokens=50, ignore_eos=True)
    eng = _failing_async_engine(after=4)
    with pytest.raises(Boom):
        eng.generate(ps, long, progress=False)
    assert eng.stats()["ahead_steps"] > 0  # it failed with a step in flight
    with pytest.raises(RuntimeError):
        eng.generate(ps, long, progress=False)
    eng.close()

    gate = threading.Event()
    eng = _failing_async_engine(after=5, gate=gate)
    rid = eng.add_request(ps[0], long)
    stream = eng.stream(ps[1], long)
    threading.Timer(0.3, gate.set).start()
    with pytest.raises(Boom):
        list(stream)
    with pytest.raises(Boom):
        eng.get_output(rid, timeout=30)
    assert not eng.healthy and isinstance(eng.error, Boom)
    eng.close()


def test_close_with_a_step_in_flight() -> None:
    eng = Engine(tiny_models.llama(), config=ContinuousBatchingConfig(
        num_blocks=64, page_size=8, use_async_batching=True))  # fmt: skip
    real = eng.runner.execute
    eng.runner.execute = lambda plan, prev_tokens=None: (
        time.sleep(0.005), real(plan, prev_tokens=prev_tokens))[1]  # fmt: skip
    rid = eng.add_request(prompts(1)[0], SamplingParams(max_new_tokens=400, ignore_eos=True))
    deadline = time.time() + 30
    while eng.stats()["ahead_steps"] < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert eng.stats()["ahead_steps"] >= 3
    eng.close()
    assert not eng._stepper.in_flight
    with pytest.raises(RuntimeError):
        eng.get_output(rid, timeout=5)


def test_use_async_batching_resolution() -> None:
    model = tiny_models.llama()
    cfg = dict(num_blocks=32, page_size=8)
    with Engine(model, config=ContinuousBatchingConfig(**cfg)) as eng:
        assert eng.async_batching is False  # auto: off on CPU
        eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), progress=False)
        assert eng.stats()["ahead_steps"] == 0
    with Engine(model, config=ContinuousBatchingConfig(**cfg, use_async_batching=False)) as eng:
        assert eng.async_batching is False
    with Engine(model, config=ContinuousBatchingConfig(**cfg, use_async_batching=True)) as eng:
        assert eng.async_batching is True


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_many_short_requests_in_a_small_pool(arch: str) -> None:
    """Requests finishing at every step while others are admitted ahead: deferred frees of
    chunks still referenced by the plan in flight, nothing leaked at the end."""
    import random

    rng = random.Random(7)
    ps = [tuple(rng.randrange(3, tiny_models.VOCAB) for _ in range(rng.randint(1, 12)))
          for _ in range(60)]  # fmt: skip
    news = [rng.randint(1, 8) for _ in ps]
    config = ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=32,
                                      use_async_batching=True)  # fmt: skip
    with Engine(par.model(arch), config=config) as eng:
        outs = eng.generate([list(p) for p in ps],
                            [SamplingParams(max_new_tokens=n) for n in news], progress=False)
        stats = eng.stats()
    for p, n, o in zip(ps, news, outs, strict=True):
        assert tuple(o.token_ids) == par.reference(arch, p, n)
    assert stats["ahead_steps"] > 0 and stats["finished_requests"] == 60
    assert stats["num_used_blocks"] == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_runner_greedy_tokens_in_flight(arch: str) -> None:
    """With the runner's greedy head (`fast_greedy`, forced on here: on these tiny models
    it would lose its timing check), plain greedy steps take their tokens from
    `execute_greedy(plan, prev_tokens)`, ahead plans included, and mixed batches sample."""
    ps = tiny_models.mixed_prompts(1)
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=512, use_async_batching=True)
    with Engine(par.model(arch), config=config) as eng:
        eng.runner.fast_greedy = True
        real = eng.runner.execute_greedy
        calls = {"ahead": 0, "all": 0}

        def execute_greedy(plan, prev_tokens=None):
            calls["all"] += 1
            calls["ahead"] += bool(plan.ahead)
            return real(plan, prev_tokens)

        eng.runner.execute_greedy = execute_greedy
        outs = eng.generate([list(p) for p in ps], SamplingParams(max_new_tokens=par.NEW),
                            progress=False)  # fmt: skip
        par.check(arch, ps, [o.token_ids for o in outs])
        assert calls["ahead"] > 0 and calls["all"] == eng.stats()["steps"]
        # one seeded request in the batch: those steps go through the sampler
        sps = [SamplingParams(max_new_tokens=par.NEW)] * (len(ps) - 1) + [
            SamplingParams(max_new_tokens=par.NEW, temperature=1.0, seed=3)]
        greedy_before, steps_before = calls["all"], eng.stats()["steps"]
        mixed = eng.generate([list(p) for p in ps], sps, progress=False)
        par.check(arch, ps[:-1], [o.token_ids for o in mixed[:-1]])
        # while the seeded request runs, steps sample (not every step went the greedy way)
        assert calls["all"] - greedy_before < eng.stats()["steps"] - steps_before


@pytest.mark.parametrize("arch,seed", [("llama", 0), ("llama", 1), ("mistral", 2),
                                       ("gemma3", 3)])  # fmt: skip
def test_random_arrivals_cancels_and_stops_step_by_step(arch: str, seed: int) -> None:
    """The pipeline driven one iteration at a time in a small pool (preemption, offload),
    with requests arriving, being cancelled and hitting stop tokens at random iterations:
    the core's invariants hold after every iteration, finished requests match
    `model.generate`, cancelled ones are prefixes of it, and nothing leaks."""
    import random

    rng = random.Random(seed)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=12, max_batch_tokens=16,
                                      cpu_offload_space=0.001 * (seed % 2),
                                      use_async_batching=True)  # fmt: skip
    eng = Engine(par.model(arch), config=config)
    reqs = []
    try:
        pending = [tuple(rng.randrange(3, tiny_models.VOCAB) for _ in range(rng.randint(1, 14)))
                   for _ in range(24)]  # fmt: skip
        it = 0
        while pending or any(not r.done.is_set() for r, *_ in reqs):
            for _ in range(rng.choice((0, 0, 1, 3)) if pending else 0):  # bursts of arrivals
                if not pending:
                    break
                p = pending.pop()
                new = rng.randint(1, 10)
                stop = ()
                if rng.random() < 0.3:  # a stop token that the greedy answer contains
                    ref = par.reference(arch, p, new)
                    stop = (ref[rng.randrange(len(ref))],)
                req = eng._make_request(list(p), SamplingParams(max_new_tokens=new,
                                                                stop_token_ids=stop), None)
                eng._submit(req)
                reqs.append((req, p, new, stop))
            live = [r for r, *_ in reqs if not r.done.is_set()]
            if live and rng.random() < 0.08:
                assert eng.cancel(rng.choice(live).request_id)
            eng._step()
            eng.scheduler.check_invariants()
            it += 1
            assert it < 2000
        while eng._step():  # the last step in flight
            eng.scheduler.check_invariants()
        stats = eng.stats()
    finally:
        eng.close()
    assert stats["ahead_steps"] > 0 and stats["num_used_blocks"] == 0
    assert eng.scheduler.num_outstanding == 0
    reasons = [r.output.finish_reason for r, *_ in reqs]
    assert {"cancelled", "stop", "length"} <= set(reasons)  # the seeds cover every ending
    assert stats["num_preemptions"] > 0 and stats["stall_drains"] > 0
    if seed % 2:
        assert stats["num_offloads"] > 0
    for req, p, new, stop in reqs:
        out = req.output
        ref = list(par.reference(arch, p, new))
        if stop:
            ref = ref[: ref.index(stop[0]) + 1]
        if out.finish_reason == "cancelled":
            assert out.token_ids == ref[: len(out.token_ids)]
        else:
            assert out.token_ids == ref, (p, new, stop)
            ends = set(stop) | set(eng.eos_token_ids)
            assert out.finish_reason == ("stop" if ref[-1] in ends else "length")
