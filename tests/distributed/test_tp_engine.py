"""Tensor parallelism on CPU (gloo, 2 ranks): greedy parity with `model.generate` on each
prompt alone (fp32) for Llama (GQA 4/2), Qwen3 and a Llama with one KV head (replicated on
both ranks), under chunked prefill, preemption (CPU offload, and soft reset) and prefix
sharing; the refusals; a worker killed mid-generation."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.errors import FieldError

torch.set_num_threads(1)

NEW = 12
PAGE = 8
BUILDERS = {
    "llama": lambda: tiny_models.llama(),
    "qwen3": lambda: tiny_models.qwen3(),
    "llama_kv1": lambda: tiny_models.llama(3, num_key_value_heads=1),
}


@functools.cache
def model(arch: str):
    return BUILDERS[arch]()


@functools.cache
def reference(arch: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(tiny_models.generate_greedy(model(arch), list(prompt), NEW))



@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    def save(arch: str) -> Path:
        path = tmp_path_factory.getbasetemp() / f"tp-{arch}"
        if not path.exists():
            model(arch).save_pretrained(path)
        return path

    return save


def _check(arch: str, prompts, outs) -> None:
    for p, o in zip(prompts, outs, strict=True):
        assert o.finished
        assert tuple(o.token_ids) == reference(arch, p), f"{arch}: prompt of {len(p)} diverged"


@pytest.mark.parametrize(("arch", "use_async"), [
    ("llama", False), ("qwen3", False), ("llama_kv1", False), ("llama", True)])
def test_tp2_parity_chunked_preempted_and_prefix_shared(arch: str, use_async: bool,
                                                        saved) -> None:
    """One 2-rank engine per model: a pool far too small (12 chunks: preemption, by swap-out
    to the CPU pool or, for llama_kv1, by soft reset), chunked prefill (13 tokens a step);
    then prompts sharing a 16-token prefix (prefix-cache hits). With `use_async`, the async
    pipeline (plans ahead: the previous step's samples go to the worker too)."""
    offload = 0.0 if arch == "llama_kv1" else 0.01
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=12, max_batch_tokens=13,
                                      cpu_offload_space=offload,
                                      use_async_batching=True if use_async else None)
    sp = SamplingParams(max_new_tokens=NEW)
    with Engine(str(saved(arch)), config=config, tensor_parallel_size=2) as eng:
        assert eng.tensor_parallel_size == 2 and eng.async_batching is use_async
        assert eng.runner.cache.num_kv_heads == 1  # this rank's share (2/2 and 1 replicated)
        prompts = tiny_models.mixed_prompts(4)
        _check(arch, prompts, eng.generate([list(p) for p in prompts], sp, progress=False))
        stats = eng.stats()
        assert stats["tensor_parallel_size"] == 2
        assert stats["num_preemptions"] > 0
        assert stats["num_offloads" if offload else "num_soft_resets"] > 0
        hits = stats["prefix_hit_tokens"]
        shared = tiny_models.mixed_prompts(5, shared_prefix=16)
        _check(arch, shared, eng.generate([list(p) for p in shared], sp, progress=False))
        assert eng.stats()["prefix_hit_tokens"] > hits
        if use_async:
            assert eng.stats()["ahead_steps"] > 0
        procs = eng.tp.procs
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_refusals(saved, tmp_path: Path) -> None:
    gpt2 = tmp_path / "gpt2"
    tiny_models.gpt2().save_pretrained(gpt2)
    with pytest.raises(FieldError, match="no tensor-parallel plan") as e:
        Engine(str(gpt2), tensor_parallel_size=2)
    assert e.value.field == "tensor_parallel_size"
    with pytest.raises(FieldError, match="4 attention heads, not divisible") as e:
        Engine(str(saved("llama")), tensor_parallel_size=3)
    assert e.value.field == "tensor_parallel_size"
    with pytest.raises(FieldError, match="needs a checkpoint path") as e:
        Engine(model("llama"), tensor_parallel_size=2)
    assert e.value.field == "tensor_parallel_size"
    for bad in (0, -1, 1.5):
        with pytest.raises(FieldError) as e:
            Engine(str(saved("llama")), tensor_parallel_size=bad)
        assert e.value.field == "tensor_parallel_size"


def test_killed_worker_fails_the_waiting_caller(saved) -> None:
    """SIGKILL a worker while a request streams: the caller gets a clear error within a
    bounded time, the engine reports itself dead, the worker is reaped."""
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=256)
    eng = Engine(str(saved("llama")), config=config, tensor_parallel_size=2)
    try:
        (worker,) = eng.tp.procs
        stream = eng.stream([5, 6, 7], SamplingParams(max_new_tokens=900, ignore_eos=True))
        next(stream)
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            for _ in stream:
                pass
        took = time.monotonic() - t0
        assert took < 60, took
        assert "tensor-parallel" in str(e.value)
        assert not eng.healthy
        deadline = time.monotonic() + 10
        while worker.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.exitcode == -signal.SIGKILL
        with pytest.raises(Exception, match="tensor-parallel|died"):
            eng.generate([[5, 6]], SamplingParams(max_new_tokens=2), progress=False)
    finally:
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 30


def test_hung_worker_times_out(saved, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP a worker (alive, never answering): the collective timeout (here 2 s,
    FERROBATCH_TP_TIMEOUT) fails the waiting caller; the stopped worker is killed.

    Start-up is not held to it: a spawned worker takes longer than 2 s to import torch and
    load its shard, and the engine is still built (the start-up timeout covers that)."""
    monkeypatch.setenv("FERROBATCH_TP_TIMEOUT", "2")
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=256)
    eng = Engine(str(saved("llama")), config=config, tensor_parallel_size=2)
    try:
        (worker,) = eng.tp.procs
        stream = eng.stream([5, 6, 7], SamplingParams(max_new_tokens=900, ignore_eos=True))
        next(stream)
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="tensor-parallel"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 10
        while worker.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.exitcode is not None and worker.exitcode < 0
    finally:
        eng.close()
