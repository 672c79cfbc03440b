"""An engine's lifetime, from an outside audit: one dropped without `close()` is collected
and its loop stops; a `stream()` closed before its first item never runs; prompts a
tokenizer can't take are `FieldError`s; `aembed` after `close()` raises the engine's own
error; `stats()` counts every reason the async pipeline drained."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, FieldError, SamplingParams
from ferrobatch.errors import EngineClosedError
from server_helpers import build_tokenizer

torch.set_num_threads(1)

CFG = ContinuousBatchingConfig(num_blocks=64, page_size=8)


def _loops() -> int:
    return sum(t.name == "ferrobatch-loop" and t.is_alive() for t in threading.enumerate())


def test_an_engine_dropped_with_its_loop_running_is_collected():
    before = _loops()
    eng = Engine(tiny_models.llama(), config=CFG)
    rid = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    assert len(eng.get_output(rid, timeout=60).token_ids) == 4
    assert _loops() == before + 1
    ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 10
    while _loops() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _loops() == before


def test_a_stream_closed_before_its_first_item_never_runs():
    with Engine(tiny_models.llama(), config=CFG) as eng:
        it = eng.stream([5, 6, 7], SamplingParams(max_new_tokens=40, ignore_eos=True))
        it.close()
        time.sleep(0.2)
        stats = eng.stats()
        assert stats["running"] == 0 and stats["num_used_blocks"] == 0
        # (validated at the call, as before)
        with pytest.raises(FieldError):
            eng.stream([], SamplingParams(max_new_tokens=4))


def test_prompts_a_tokenizer_cannot_take_name_the_prompt():
    tokenizer = build_tokenizer()
    model = tiny_models.llama(vocab_size=len(tokenizer))
    with Engine(model, tokenizer=tokenizer, config=CFG) as eng:
        for bad in ("abc\ud800def", b"hello"):
            with pytest.raises(FieldError) as err:
                eng.generate([bad], SamplingParams(max_new_tokens=2), progress=False)
            assert err.value.field == "prompt"
        assert len(eng.generate(["fine"], SamplingParams(max_new_tokens=2),
                                progress=False)[0].token_ids) == 2


def test_aembed_after_close_raises_engine_closed():
    eng = Engine(tiny_models.llama(), config=CFG)
    eng.close()
    with pytest.raises(EngineClosedError):
        asyncio.run(eng.aembed([[5, 6, 7]]))


def test_stats_count_every_pipeline_drain():
    with Engine(tiny_models.llama(), config=ContinuousBatchingConfig(
            num_blocks=64, page_size=8, use_async_batching=True)) as eng:
        stats = eng.stats()
    for reason in ("pipeline_drains", "stall_drains", "swap_drains", "priority_drains",
                   "rope_drains"):
        assert stats[reason] == 0, reason


def test_close_frees_a_model_the_engine_read_itself(tmp_path):
    tiny_models.llama().save_pretrained(tmp_path)
    eng = Engine(str(tmp_path), config=CFG)
    assert len(eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3),
                            progress=False)[0].token_ids) == 3
    model = weakref.ref(eng.model)
    size = eng.embedding_size
    eng.close()
    gc.collect()
    assert model() is None and eng.model is None
    assert eng.embedding_size == size and eng.stats()["running"] == 0
    for call in (lambda: eng.generate([[5, 6]], progress=False),
                 lambda: eng.add_request([5, 6]),
                 lambda: eng.check_request([5, 6]),
                 lambda: eng.embed([[5, 6]])):
        with pytest.raises(EngineClosedError):
            call()


def test_close_gives_a_passed_model_back_working():
    model = tiny_models.llama()
    want = tiny_models.generate_greedy(model, [5, 6, 7], 4)
    eng = Engine(model, config=CFG)
    assert eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4),
                        progress=False)[0].token_ids == want
    eng.close()
    assert eng.model is model
    assert tiny_models.generate_greedy(model, [5, 6, 7], 4) == want
