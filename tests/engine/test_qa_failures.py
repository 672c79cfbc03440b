"""Workloads and failure sequences: many requests, context limits, duplicate prompts,
cancel storms from other threads, close() with open streams, errors injected into the
runner, sampling edge cases, text edge cases, dtype handling.

Greedy outputs are checked against `model.generate` on each prompt alone; every failure
must reach every waiting caller as an exception, never as a hang.
"""

from __future__ import annotations

import asyncio
import functools
import random
import threading
import time

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.errors import EngineClosedError, QueueFullError
from server_helpers import CORPUS, build_model, build_tokenizer
from transformers import GenerationConfig

torch.set_num_threads(1)

VOCAB = tiny_models.VOCAB


@functools.cache
def llama():
    return tiny_models.llama()


@functools.cache
def reference(prompt: tuple[int, ...], new: int) -> tuple[int, ...]:
    with torch.no_grad():
        out = llama().generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=0
        )
    return tuple(out[0, len(prompt) :].tolist())


def engine(**cfg) -> Engine:
    config = ContinuousBatchingConfig(page_size=8, **{"num_blocks": 256, **cfg})
    return Engine(llama(), config=config)


def random_prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def injected_runner_error(eng: Engine, at_call: int, exc: BaseException) -> None:
    """Make the runner raise `exc` once, at its `at_call`-th execute."""
    orig = eng.runner.execute
    calls = [0]

    def execute(plan):
        calls[0] += 1
        if calls[0] == at_call:
            raise exc
        return orig(plan)

    eng.runner.execute = execute


# ---------------------------------------------------------------- workloads


def test_300_short_requests_in_a_small_pool() -> None:
    prompts = random_prompts(0, 300, 1, 6)
    with engine(num_blocks=48) as eng:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=3), progress=False)
        stats = eng.stats()
    assert [o.request_id for o in outs] == list(dict.fromkeys(o.request_id for o in outs))
    for p, o in zip(prompts[::10], outs[::10], strict=True):
        assert tuple(o.token_ids) == reference(tuple(p), 3)
    assert stats["num_used_blocks"] == 0
    assert stats["finished_requests"] == 300


def test_prompt_at_exactly_the_context_limit() -> None:
    m = tiny_models.llama(max_position_embeddings=32)
    with Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=16)) as eng:
        p = list(range(3, 34))  # 31 tokens + 1 new = 32 positions
        out = eng.generate([p], SamplingParams(max_new_tokens=1), progress=False)[0]
        with torch.no_grad():
            want = m.generate(torch.tensor([p]), max_new_tokens=1, do_sample=False)
        assert out.token_ids == want[0, 31:].tolist()
        with pytest.raises(ValueError, match="context"):
            eng.generate([list(range(3, 35))], SamplingParams(max_new_tokens=1), progress=False)
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.generate([p], SamplingParams(max_new_tokens=2), progress=False)
        # the engine is still fine afterwards
        again = eng.generate([p], SamplingParams(max_new_tokens=1), progress=False)[0]
        assert again.token_ids == out.token_ids


def test_default_max_new_tokens_fits_a_short_context() -> None:
    """With no max_new_tokens given, the default (128) is capped to the context left;
    an explicit value past the context is still refused."""
    m = tiny_models.llama(max_position_embeddings=32)
    with Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=16)) as eng:
        p = list(range(3, 23))  # 20 tokens: 12 positions left
        out = eng.generate([p], progress=False)[0]
        assert len(out.token_ids) <= 12
        if out.finish_reason == "length":
            assert len(out.token_ids) == 12
        with torch.no_grad():
            want = m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)
        assert out.token_ids == want[0, 20 : 20 + len(out.token_ids)].tolist()
        auto = eng.generate([p], SamplingParams(max_new_tokens=None), progress=False)[0]
        assert auto.token_ids == out.token_ids
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.generate([p], SamplingParams(max_new_tokens=13), progress=False)


def test_duplicate_prompts_and_one_new_token() -> None:
    p = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # more than a page: shared full blocks
    with engine(num_blocks=32, allow_block_sharing=True) as eng:
        outs = eng.generate([p] * 10 + [[5]], SamplingParams(max_new_tokens=1), progress=False)
    for o in outs[:10]:
        assert tuple(o.token_ids) == reference(tuple(p), 1)
        assert o.finish_reason in ("length", "stop")
    assert tuple(outs[10].token_ids) == reference((5,), 1)


def test_concurrent_generate_calls_from_threads_without_a_loop() -> None:
    prompts = {i: random_prompts(10 + i, 6, 1, 20) for i in range(3)}
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    with engine(num_blocks=30, max_batch_tokens=32) as eng:

        def work(i: int) -> None:
            try:
                results[i] = eng.generate(
                    prompts[i], SamplingParams(max_new_tokens=8), progress=False
                )
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert not errors
    for i in range(3):
        for p, o in zip(prompts[i], results[i], strict=True):
            assert tuple(o.token_ids) == reference(tuple(p), 8)


# ---------------------------------------------------------------- cancellation


def test_cancel_storm_from_another_thread() -> None:
    rng = random.Random(1)
    prompts = random_prompts(1, 40, 1, 30)
    with engine(num_blocks=40, max_batch_tokens=64) as eng:
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=16)) for p in prompts]
        victims = set(rng.sample(ids, 20))

        def storm() -> None:
            for rid in victims:
                time.sleep(rng.random() * 0.005)
                eng.cancel(rid)

        t = threading.Thread(target=storm)
        t.start()
        outs = {rid: eng.get_output(rid, timeout=60) for rid in ids}
        t.join(10)
        deadline = time.time() + 5
        while eng.stats()["num_used_blocks"] and time.time() < deadline:
            time.sleep(0.01)
        assert eng.stats()["num_used_blocks"] == 0
    for rid, p in zip(ids, prompts, strict=True):
        o = outs[rid]
        if o.finish_reason == "cancelled":
            assert rid in victims
            assert tuple(o.token_ids) == reference(tuple(p), 16)[: len(o.token_ids)]
        else:
            assert tuple(o.token_ids) == reference(tuple(p), 16)


def test_cancel_storm_during_caller_thread_generate_with_preemption_and_offload() -> None:
    rng = random.Random(2)
    prompts = random_prompts(2, 24, 1, 40)
    outs: list = []
    with engine(num_blocks=20, max_batch_tokens=32, cpu_offload_space=0.001) as eng:
        t = threading.Thread(
            target=lambda: outs.extend(
                eng.generate(prompts, SamplingParams(max_new_tokens=12), progress=False)
            )
        )
        t.start()
        deadline = time.time() + 5
        while len(eng._requests) < len(prompts) and time.time() < deadline:
            time.sleep(0.001)
        ids = list(eng._requests)
        for rid in rng.sample(ids, len(ids) // 2):
            time.sleep(rng.random() * 0.003)
            eng.cancel(rid)
        t.join(60)
        assert not t.is_alive()
        stats = eng.stats()
    assert len(outs) == len(prompts)
    for p, o in zip(prompts, outs, strict=True):
        if o.finish_reason != "cancelled":
            assert tuple(o.token_ids) == reference(tuple(p), 12)
    assert stats["num_used_blocks"] == 0


# ---------------------------------------------------------------- close and errors


def test_close_with_open_streams_and_astreams_raises_in_every_waiter() -> None:
    eng = engine(num_blocks=512)
    results: list[str] = []

    def consume() -> None:
        try:
            for _ in eng.stream([5, 6, 7], SamplingParams(max_new_tokens=900)):
                time.sleep(0.005)
            results.append("finished")
        except EngineClosedError:
            results.append("closed")

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    rid = eng.add_request([9, 9], SamplingParams(max_new_tokens=900))

    async def aconsume() -> str:
        try:
            async for _ in eng.astream([7, 8], SamplingParams(max_new_tokens=900)):
                pass
            return "finished"
        except EngineClosedError:
            return "closed"

    async def main() -> str:
        task = asyncio.ensure_future(aconsume())
        await asyncio.sleep(0.2)
        await asyncio.get_running_loop().run_in_executor(None, eng.close)
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == "closed"
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert results == ["closed"] * 3
    with pytest.raises(EngineClosedError):
        eng.get_output(rid, timeout=5)
    with pytest.raises(EngineClosedError):
        eng.add_request([5])
    with pytest.raises(EngineClosedError):
        eng.generate([[5]], progress=False)


def test_close_during_generate_in_another_thread() -> None:
    eng = engine()
    got: list[str] = []

    def work() -> None:
        try:
            eng.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=900), progress=False)
            got.append("finished")
        except EngineClosedError:
            got.append("closed")

    t = threading.Thread(target=work)
    t.start()
    time.sleep(0.2)
    eng.close()
    t.join(10)
    assert not t.is_alive() and got == ["closed"]


def test_runner_error_reaches_every_background_waiter() -> None:
    eng = engine()
    injected_runner_error(eng, 4, RuntimeError("injected"))
    ids = [eng.add_request([5, 6, 7 + i], SamplingParams(max_new_tokens=40)) for i in range(4)]

    async def one(p: list[int]) -> str:
        try:
            async for _ in eng.astream(p, SamplingParams(max_new_tokens=40)):
                pass
            return "finished"
        except RuntimeError as exc:
            return str(exc)

    async def main() -> list[str]:
        return await asyncio.wait_for(asyncio.gather(*(one([20 + i]) for i in range(2))), 10)

    streamed = asyncio.run(main())
    waited = []
    for rid in ids:
        with pytest.raises(RuntimeError) as info:
            eng.get_output(rid, timeout=10)
        waited.append(str(info.value))
    assert waited == ["injected"] * 4
    assert streamed == ["injected"] * 2
    assert not eng.healthy and str(eng.error) == "injected"
    with pytest.raises(RuntimeError, match="died"):
        list(eng.stream([5], SamplingParams(max_new_tokens=2)))
    eng.close()


def test_runner_error_in_caller_thread_generate() -> None:
    eng = engine()
    injected_runner_error(eng, 3, ValueError("injected"))
    with pytest.raises(ValueError, match="injected"):
        eng.generate([[5, 6], [7, 8]], SamplingParams(max_new_tokens=40), progress=False)
    eng.close()


def test_queue_bound_and_recovery() -> None:
    with engine(max_queue_size=2) as eng:
        a = eng.add_request([5], SamplingParams(max_new_tokens=500))
        b = eng.add_request([6], SamplingParams(max_new_tokens=500))
        with pytest.raises(QueueFullError):
            eng.add_request([7])
        eng.cancel(a)
        eng.cancel(b)
        assert eng.get_output(a, 5).finish_reason in ("cancelled", "length")
        assert eng.get_output(b, 5).finish_reason in ("cancelled", "length")
        c = eng.add_request([7], SamplingParams(max_new_tokens=2))
        assert tuple(eng.get_output(c, 5).token_ids) == reference((7,), 2)


# ---------------------------------------------------------------- sampling


def test_sampling_edge_cases_reduce_to_greedy() -> None:
    p = [5, 6, 7, 8]
    greedy = reference(tuple(p), 8)
    cases = [
        dict(temperature=1.0, top_p=1e-9, seed=1),
        dict(temperature=1.0, min_p=1.0, seed=1),
        dict(temperature=1e-6, seed=1),
        dict(temperature=1.0, top_k=1),
        dict(logprobs=0),
        dict(logprobs=20),
    ]
    with engine() as eng:
        outs = eng.generate(
            [p] * len(cases), [SamplingParams(max_new_tokens=8, **c) for c in cases],
            progress=False,
        )  # fmt: skip
        for c, o in zip(cases, outs, strict=True):
            assert tuple(o.token_ids) == greedy, c
        assert all(len(d) == 1 for d in outs[4].logprobs)
        assert all(len(d) == 20 and max(d.values()) <= 0.0 for d in outs[5].logprobs)
        # top_k beyond the vocabulary is no filter at all
        a, b = eng.generate(
            [p, p],
            [SamplingParams(max_new_tokens=8, temperature=1.0, top_k=10**6, seed=3),
             SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)],
            progress=False,
        )  # fmt: skip
        assert a.token_ids == b.token_ids
        # a huge repetition penalty never repeats a prompt or generated token
        o = eng.generate([p], SamplingParams(max_new_tokens=8, repetition_penalty=1e9),
                         progress=False)[0]  # fmt: skip
        assert len(set(o.token_ids)) == 8 and not set(o.token_ids) & set(p)


def test_seed_reproducible_across_batch_mates_and_engines() -> None:
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    got = []
    for cfg, mates in [
        (dict(), []),
        (dict(), [[9, 9], [100] * 20]),
        (dict(max_batch_tokens=8, num_blocks=20), [[1] * 40]),
    ]:
        with engine(**cfg) as eng:
            params = [SamplingParams(max_new_tokens=5, temperature=1.0) for _ in mates] + [sp]
            got.append(eng.generate(mates + [[5, 6, 7]], params, progress=False)[-1].token_ids)
    assert got[0] == got[1] == got[2]


def test_generation_config_as_sampling() -> None:
    p = (5, 6, 7)
    with engine() as eng:
        o = eng.generate([list(p)], GenerationConfig(max_new_tokens=6, do_sample=False),
                         progress=False)[0]  # fmt: skip
        assert tuple(o.token_ids) == reference(p, 6)
        o = eng.generate([list(p)], llama().generation_config, max_new_tokens=6,
                         progress=False)[0]  # fmt: skip
        assert tuple(o.token_ids) == reference(p, 6)
        with pytest.raises(ValueError, match="num_beams"):
            eng.generate([list(p)], GenerationConfig(num_beams=2), progress=False)


# ---------------------------------------------------------------- text


@functools.cache
def text_setup():
    tok = build_tokenizer()
    return tok, build_model(tok)


def test_whitespace_and_unicode_prompts() -> None:
    tok, m = text_setup()
    prompts = [" ", "\n", "\t \n", "héllo wörld 日本語 🙂", "🙂", "\u200b"]
    with Engine(
        m, tokenizer=tok, config=ContinuousBatchingConfig(page_size=8, num_blocks=64)
    ) as eng:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True),
                            progress=False)  # fmt: skip
        with pytest.raises(ValueError, match="prompt"):
            eng.generate([""], progress=False)
    for p, o in zip(prompts, outs, strict=True):
        ids = tok(p)["input_ids"]
        assert o.prompt_token_ids == ids
        with torch.no_grad():
            want = m.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert o.token_ids == want[0, len(ids) :].tolist()
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens_cuts_exactly_in_generate_and_stream() -> None:
    tok, m = text_setup()
    ids = tok(CORPUS[0])["input_ids"][:6]
    sp = dict(max_new_tokens=30, ignore_eos=True)
    with Engine(
        m, tokenizer=tok, config=ContinuousBatchingConfig(page_size=8, num_blocks=64)
    ) as eng:
        full = eng.generate([ids], SamplingParams(**sp), progress=False)[0]
        pieces = [tok.decode([t]) for t in full.token_ids]
        i = next(i for i in range(1, len(pieces)) if pieces[i - 1].strip() and pieces[i].strip())
        stop = pieces[i - 1][-1] + pieces[i][0]  # straddles the boundary of tokens i-1, i
        cut = full.text.find(stop)
        assert cut >= 0
        out = eng.generate([ids], SamplingParams(stop=[stop], **sp), progress=False)[0]
        deltas = list(eng.stream(ids, SamplingParams(stop=[stop], **sp)))
    assert out.text == full.text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert "".join(d.text for d in deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"


def test_chat_without_a_template_is_a_clear_error() -> None:
    tok = build_tokenizer()
    tok.chat_template = None
    _, m = text_setup()
    with Engine(
        m, tokenizer=tok, config=ContinuousBatchingConfig(page_size=8, num_blocks=32)
    ) as eng:
        with pytest.raises(ValueError, match="tokenizer has no chat template"):
            eng.chat([{"role": "user", "content": "hi"}], progress=False)
        template = text_setup()[0].chat_template
        out = eng.chat(
            [{"role": "user", "content": "hi"}],
            SamplingParams(max_new_tokens=3),
            progress=False,
            chat_template_kwargs={"chat_template": template},
        )
        assert len(out) == 1 and out[0].finished


# ---------------------------------------------------------------- dtype


def test_bf16_model_with_dtype_none_runs_in_bf16() -> None:
    m = tiny_models.llama().to(torch.bfloat16)
    prompts = [[5, 6, 7], random_prompts(5, 1, 30, 30)[0]]
    with Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=64)) as eng:
        assert eng.dtype == torch.bfloat16
        assert eng.runner.cache.keys[0].dtype == torch.bfloat16
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=8), progress=False)
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = m.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)
        assert o.token_ids == want[0, len(p) :].tolist()


def test_loaded_model_keeps_its_dtype_and_the_cache_follows_it() -> None:
    """`dtype=` for an already loaded model is ignored (logged), cache included: a bf16
    cache under an fp32 model would silently round every key and value."""
    with Engine(llama(), config=ContinuousBatchingConfig(page_size=8, num_blocks=32),
                dtype=torch.bfloat16) as eng:  # fmt: skip
        assert eng.dtype == torch.float32
        assert eng.runner.cache.keys[0].dtype == torch.float32
        out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6), progress=False)[0]
    assert tuple(out.token_ids) == reference((5, 6, 7), 6)
    assert next(llama().parameters()).dtype == torch.float32


# ---------------------------------------------------------------- cache-fit validation


@pytest.mark.parametrize(("arch", "blocks"), [("gemma2", 12), ("mistral", 3)])
def test_request_that_can_never_fit_is_refused_up_front_on_sliding_models(
    arch: str, blocks: int
) -> None:
    """Hybrid and sliding-only models count the sliding ring too: `check_request` and
    `generate` refuse at once (ValueError naming max_new_tokens) instead of failing the
    whole `generate` call after running the other requests."""
    m = getattr(tiny_models, arch)()
    config = ContinuousBatchingConfig(page_size=5, num_blocks=blocks)
    with Engine(m, config=config) as eng:
        # 50 + 30 - 1 = 79 cached tokens: 16 full blocks (gemma2) + a ring of 3 (window 8)
        # or 4 (mistral, window 12) chunks
        long = list(range(3, 53))
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.check_request(long, SamplingParams(max_new_tokens=30))
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.generate([[5, 6], long], SamplingParams(max_new_tokens=30), progress=False)
        assert eng.stats()["num_used_blocks"] == 0
        out = eng.generate([[5, 6]], SamplingParams(max_new_tokens=4), progress=False)[0]
    with torch.no_grad():
        want = m.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False)
    assert out.token_ids == want[0, 2:].tolist()


def test_request_filling_the_pool_exactly_is_accepted() -> None:
    """prompt 8 + 1 new token caches 8 keys: one block of 8 is enough (the last token is
    never cached), as the scheduler itself counts."""
    with engine(num_blocks=1) as eng:
        p = list(range(3, 11))
        out = eng.generate([p], SamplingParams(max_new_tokens=1), progress=False)[0]
        assert tuple(out.token_ids) == reference(tuple(p), 1)
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.check_request(p, SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------- one model, two engines


def test_two_engines_on_one_model_step_concurrently() -> None:
    """Each forward switches the model's attention and restores it; two engines on the same
    model in two threads must not interleave those switches (a layer skipping the paged
    attention mid-forward, or the caller's config left switched for good)."""
    m = tiny_models.llama()
    impl = m.config.__dict__.get("_attn_implementation_internal")
    with torch.no_grad():
        want = m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=24, do_sample=False)
    want = want[0, 3:].tolist()
    engines = [
        Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=64)) for _ in range(2)
    ]
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                outs = engines[i].generate(
                    [[5, 6, 7]] * 3, SamplingParams(max_new_tokens=24), progress=False
                )
                results.setdefault(i, []).extend(o.token_ids for o in outs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for eng in engines:
        eng.close()
    assert not errors, errors
    assert all(tokens == want for i in range(2) for tokens in results[i])
    assert m.config.__dict__.get("_attn_implementation_internal") == impl


# ---------------------------------------------------------------- astream task cancellation


def test_astream_wait_does_not_swallow_a_cancellation_racing_an_item() -> None:
    """An item and the task's cancellation arriving in the same loop iteration: the task
    must end cancelled (asyncio.wait_for before 3.12 returns the item instead)."""
    from ferrobatch.engine.llm_engine import _get_or_none

    async def main() -> BaseException | object:
        q: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(_get_or_none(q, 5.0))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        q.put_nowait("item")
        task.cancel()
        (res,) = await asyncio.gather(task, return_exceptions=True)
        return res

    assert isinstance(asyncio.run(main()), asyncio.CancelledError)


def test_cancelled_astream_tasks_cancel_their_requests() -> None:
    with engine(num_blocks=512) as eng:

        async def main() -> list:
            async def consume() -> None:
                async for _ in eng.astream([5, 6, 7], SamplingParams(max_new_tokens=1000)):
                    pass

            tasks = [asyncio.ensure_future(consume()) for _ in range(6)]
            await asyncio.sleep(0.2)
            for t in tasks:
                t.cancel()
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)

        results = asyncio.run(main())
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        deadline = time.time() + 5
        while eng.stats()["num_used_blocks"] and time.time() < deadline:
            time.sleep(0.01)
        stats = eng.stats()
        assert stats["running_requests"] == 0 and stats["num_used_blocks"] == 0
