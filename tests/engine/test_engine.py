"""Engine behaviour on tiny models: streaming, stop strings, seeds, cancellation, bad input,
loop failures, and leaving the caller's model untouched."""

from __future__ import annotations

import asyncio
import copy
import math
import random
import threading
import time

import pytest
import tiny_models
import torch
import transformers
from ferrobatch import ContinuousBatchingConfig, Engine, RequestOutput, SamplingParams
from transformers import GenerationConfig

torch.set_num_threads(1)

PIECES = ["a", "b", "c", " d", "e ", "fg", "h", ".", " ", "ij", "k\n", "lm"]


class CharTokenizer:
    """A tokenizer whose tokens are short strings, so stop strings can span tokens."""

    eos_token_id = 2
    all_special_ids = [0, 1, 2]

    def piece(self, t: int) -> str:
        return "" if t in self.all_special_ids else PIECES[t % len(PIECES)]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return "".join(self.piece(int(t)) for t in ids)

    def __call__(self, text: str) -> dict:
        return {"input_ids": [3 + (ord(c) % 500) for c in text]}


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    return tiny_models.llama()


@pytest.fixture(scope="module")
def engine(model):
    cfg = ContinuousBatchingConfig(num_blocks=256, page_size=8, max_batch_tokens=64)
    with Engine(model, config=cfg, tokenizer=CharTokenizer()) as eng:
        yield eng


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, tiny_models.VOCAB) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def reference(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def test_generate_in_input_order_with_text_and_timings(engine, model) -> None:
    ps = prompts(6, seed=1)
    outs = engine.generate(ps, GREEDY, progress=True)
    assert [o.prompt_token_ids for o in outs] == ps
    for p, o in zip(ps, outs, strict=True):
        assert isinstance(o, RequestOutput) and o.finished and o.finish_reason == "length"
        assert o.token_ids == reference(model, p, 12)
        assert o.text == CharTokenizer().decode(o.token_ids)
        assert o.ttft is not None and o.ttft > 0
        assert len(o.token_times) == 12 and o.token_times == sorted(o.token_times)
    st = engine.stats()
    assert st["generated_tokens"] >= 72 and st["throughput_tok_s"] > 0


def test_single_prompt_forms_and_max_new_tokens_override(engine) -> None:
    p = prompts(1, seed=2)[0]
    a = engine.generate(p, GREEDY, progress=False)
    b = engine.generate([p], max_new_tokens=5, progress=False)
    c = engine.generate(torch.tensor(p), GREEDY, progress=False)
    assert len(a) == len(b) == len(c) == 1
    assert len(b[0].token_ids) <= 5 and a[0].token_ids[: len(b[0].token_ids)] == b[0].token_ids
    assert a[0].token_ids == c[0].token_ids
    assert engine.generate([], progress=False) == []


def test_generation_config_as_sampling(engine) -> None:
    p = prompts(1, seed=3)[0]
    gc = GenerationConfig(max_new_tokens=7, do_sample=False)
    before = gc.to_dict()
    out = engine.generate([p], gc, progress=False)[0]
    assert gc.to_dict() == before
    ref = engine.generate([p], SamplingParams(max_new_tokens=7), progress=False)[0]
    assert out.token_ids == ref.token_ids


def test_stop_strings_cut_exactly_across_tokens(engine) -> None:
    p = prompts(1, seed=4, lo=10)[0]
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    full = engine.generate([p], long, progress=False)[0].text
    assert len(full) > 12
    # a stop string that starts inside one token and ends in a later one
    for k in (3, 7, len(full) // 2):
        stop = full[k : k + 3]
        if not stop.strip():
            continue
        cut = full[: full.find(stop)]
        out = engine.generate([p], SamplingParams(**{**long.__dict__, "stop": (stop,)}),
                              progress=False)[0]
        assert out.text == cut and out.finish_reason == "stop" and out.finished
        assert len(out.token_ids) < 40
        streamed = list(engine.stream(p, SamplingParams(**{**long.__dict__, "stop": (stop,)})))
        assert "".join(d.text for d in streamed) == cut
        assert streamed[-1].finish_reason == "stop"


def test_stop_token_ids_and_eos(engine, model) -> None:
    p = prompts(1, seed=5)[0]
    toks = engine.generate([p], GREEDY, progress=False)[0].token_ids
    stop_tok = toks[4]
    first = toks.index(stop_tok)
    out = engine.generate([p], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_tok]),
                          progress=False)[0]
    assert out.token_ids == toks[: first + 1] and out.finish_reason == "stop"
    assert engine.eos_token_ids == [model.generation_config.eos_token_id]


def test_stream_deltas_concatenate_to_final(engine) -> None:
    p = prompts(1, seed=6)[0]
    final = engine.generate([p], GREEDY, progress=False)[0]
    deltas = list(engine.stream(p, GREEDY))
    assert all(isinstance(d, RequestOutput) for d in deltas)
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length"


def test_astream_and_closing_cancels(engine) -> None:
    p = prompts(1, seed=7)[0]
    final = engine.generate([p], GREEDY, progress=False)[0]

    async def collect() -> list[RequestOutput]:
        return [d async for d in engine.astream(p, GREEDY)]

    deltas = asyncio.run(collect())
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text

    async def abandon() -> str:
        gen = engine.astream(p, SamplingParams(max_new_tokens=500, ignore_eos=True),
                             request_id="abandoned")
        first = await gen.__anext__()
        await gen.aclose()
        return first.request_id

    assert asyncio.run(abandon()) == "abandoned"
    deadline = time.time() + 10
    while engine.stats()["running_requests"] and time.time() < deadline:
        time.sleep(0.01)
    assert engine.stats()["running_requests"] == 0


def test_add_request_get_output_cancel(engine, model) -> None:
    ps = prompts(3, seed=8)
    long = SamplingParams(max_new_tokens=300, ignore_eos=True)
    ids = [engine.add_request(ps[0], GREEDY), engine.add_request(ps[1], long, request_id="x"),
           engine.add_request(ps[2], GREEDY)]
    assert ids[1] == "x"
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(ps[1], GREEDY, request_id="x")
    time.sleep(0.05)
    assert engine.cancel("x")
    assert not engine.cancel("x")  # already being cancelled
    cancelled = engine.get_output("x", timeout=30)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 300
    assert not engine.cancel("x") and not engine.cancel("nope")
    for i in (0, 2):
        assert engine.get_output(ids[i], timeout=30).token_ids == reference(model, ps[i], 12)


BAD_INPUTS = [
    ("prompt", [], None),
    ("prompt", "", None),
    ("prompt", [5, tiny_models.VOCAB], None),
    ("prompt", [5, -1], None),
    ("prompt", [5] * 1024, None),  # max_position_embeddings = 1024
    ("max_new_tokens", [5] * 1000, dict(max_new_tokens=100)),
    ("max_new_tokens", [5], dict(max_new_tokens=0)),
    ("temperature", [5], dict(temperature=math.nan)),
    ("temperature", [5], dict(temperature=-1.0)),
    ("top_p", [5], dict(top_p=0.0)),
    ("top_p", [5], dict(top_p=1.01)),
]


@pytest.mark.parametrize(("field", "prompt", "sampling"), BAD_INPUTS)
def test_bad_input_names_field_and_others_continue(engine, model, field, prompt, sampling):
    good = prompts(2, seed=9)
    rids = [engine.add_request(p, GREEDY) for p in good]
    with pytest.raises(ValueError, match=field):
        engine.generate([prompt], sampling, progress=False)
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, sampling)
    with pytest.raises(ValueError, match=field):
        engine.generate([good[0], prompt], sampling, progress=False)
    for p, rid in zip(good, rids, strict=True):
        assert engine.get_output(rid, timeout=30).token_ids == reference(model, p, 12)


def test_seeded_sampling_reproducible_across_runs_and_batch_mates(engine) -> None:
    p = prompts(1, seed=10)[0]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([p], sp, progress=False)[0].token_ids
    again = engine.generate([p], sp, progress=False)[0].token_ids
    mates = prompts(5, seed=11)
    mate_sp = SamplingParams(max_new_tokens=20, temperature=0.9, ignore_eos=True)
    crowd = engine.generate(mates[:2] + [p] + mates[2:], [mate_sp] * 2 + [sp] + [mate_sp] * 3,
                            progress=False)[2].token_ids
    other_seed = SamplingParams(**{**sp.__dict__, "seed": 99})
    different = engine.generate([p], other_seed, progress=False)[0].token_ids
    assert alone == again == crowd
    assert different != alone


def test_logprobs(engine) -> None:
    p = prompts(1, seed=12)[0]
    out = engine.generate([p], SamplingParams(max_new_tokens=5, logprobs=3, ignore_eos=True),
                          progress=False)[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and 3 <= len(lp) <= 4
        assert max(lp.values()) == lp[tok]  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())
    plain = engine.generate([p], SamplingParams(max_new_tokens=5), progress=False)[0]
    assert plain.logprobs is None


def test_sampling_penalties_run(engine) -> None:
    ps = prompts(3, seed=13)
    sps = [
        SamplingParams(max_new_tokens=8, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, min_p=0.05,
                       presence_penalty=0.5, frequency_penalty=0.5, seed=1),
        SamplingParams(max_new_tokens=8, temperature=1.3, top_k=5, seed=2),
    ]
    outs = engine.generate(ps, sps, progress=False)
    assert all(o.finished for o in outs)
    assert len(outs[0].token_ids) > 2 and len(set(outs[0].token_ids)) == len(outs[0].token_ids)


def test_caller_model_config_and_generation_config_untouched() -> None:
    model = tiny_models.gemma3()
    cfg_before = copy.deepcopy(model.config.to_dict())
    gen_before = copy.deepcopy(model.generation_config.to_dict())
    attn_before = model.config._attn_implementation
    params_before = {k: v.clone() for k, v in model.state_dict().items()}
    tcfg = tiny_models.transformers_cb_config(page_size=16, num_blocks=64)
    tcfg_before = copy.deepcopy(vars(tcfg))
    with Engine(model, config=tcfg) as eng:
        eng.generate(prompts(3, seed=14), GREEDY, progress=False)
        assert eng.config.page_size == 16
    assert model.config.to_dict() == cfg_before
    assert model.generation_config.to_dict() == gen_before
    assert model.config._attn_implementation == attn_before
    assert vars(tcfg) == tcfg_before
    for k, v in model.state_dict().items():
        assert torch.equal(v, params_before[k])


class Boom(RuntimeError):
    pass


def _failing_engine(model, after: int, gate: threading.Event | None = None) -> Engine:
    eng = Engine(model, config=ContinuousBatchingConfig(num_blocks=64, page_size=8))
    real = eng.runner.execute
    calls = {"n": 0}

    def execute(plan):
        calls["n"] += 1
        if calls["n"] > after:
            if gate is not None:
                gate.wait(30)
            raise Boom("forward failed")
        return real(plan)

    eng.runner.execute = execute
    return eng


def test_loop_death_reaches_every_caller(model) -> None:
    ps = prompts(3, seed=15)
    long = SamplingParams(max_new_tokens=50, ignore_eos=True)
    # synchronous generate
    eng = _failing_engine(model, after=2)
    with pytest.raises(Boom):
        eng.generate(ps, long, progress=False)
    with pytest.raises(RuntimeError):
        eng.generate(ps, long, progress=False)
    eng.close()
    # background loop: get_output, stream and astream waiters all get the exception
    gate = threading.Event()
    eng = _failing_engine(model, after=3, gate=gate)
    rid = eng.add_request(ps[0], long)
    stream = eng.stream(ps[1], long)
    results: dict[str, BaseException | None] = {}

    def consume() -> None:
        try:
            list(stream)
            results["stream"] = None
        except BaseException as exc:  # noqa: BLE001
            results["stream"] = exc

    async def aconsume() -> None:
        try:
            async for _ in eng.astream(ps[2], long):
                pass
            results["astream"] = None
        except BaseException as exc:  # noqa: BLE001
            results["astream"] = exc

    threading.Timer(0.5, gate.set).start()
    th = threading.Thread(target=consume)
    th.start()
    asyncio.run(aconsume())
    with pytest.raises(Boom):
        eng.get_output(rid, timeout=30)
    th.join(30)
    assert not th.is_alive()
    assert isinstance(results["stream"], Boom)
    assert isinstance(results["astream"], Boom)
    eng.close()


def test_close_finishes_waiters(model) -> None:
    eng = Engine(model, config=ContinuousBatchingConfig(num_blocks=64, page_size=8))
    real = eng.runner.execute  # (slowed down; called as the engine calls it, greedy or not)
    eng.runner.execute = lambda plan, *a, **k: (time.sleep(0.01), real(plan, *a, **k))[1]
    rid = eng.add_request(prompts(1)[0], SamplingParams(max_new_tokens=400, ignore_eos=True))
    time.sleep(0.05)
    eng.close()
    with pytest.raises(RuntimeError):
        eng.get_output(rid, timeout=5)
    with pytest.raises(RuntimeError):
        eng.add_request([5, 6], GREEDY)


def test_check_request_health_and_queue_bound(model) -> None:
    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=8, max_queue_size=2)
    with Engine(model, config=cfg) as eng:
        assert eng.healthy and eng.error is None
        assert eng.check_request([5, 6, 7], GREEDY) == [5, 6, 7]
        with pytest.raises(ValueError, match="top_p"):
            eng.check_request([5], dict(top_p=0.0))
        with pytest.raises(ValueError, match="prompt"):
            eng.astream([], GREEDY)  # validated at call time, before any iteration
        slow = SamplingParams(max_new_tokens=400, ignore_eos=True)
        a, b = eng.add_request([5, 6], slow), eng.add_request([7, 8], slow)
        from ferrobatch.errors import QueueFullError

        with pytest.raises(QueueFullError):
            eng.add_request([9], GREEDY)
        with pytest.raises(QueueFullError, match="1 more"):
            eng.check_room()  # what a server asks before it answers
        assert len(eng.generate(prompts(3), GREEDY, progress=False)) == 3  # not bounded
        eng.cancel(a), eng.cancel(b)
        assert eng.get_output(a, timeout=30).finish_reason == "cancelled"
        assert eng.get_output(b, timeout=30).finish_reason == "cancelled"
        eng.check_room(2)  # both ended: room for two again
    assert not eng.healthy
