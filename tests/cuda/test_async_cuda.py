"""CUDA-only checks of the async pipeline's pieces (skipped without a GPU): the sampler and
the token copy-back never synchronize the host with the device (torch's sync debug mode
turns any synchronizing call into an error), and give the same results as the blocking
path; a swap with nothing pending does not synchronize either."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.engine.pipeline import DeviceToHost
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.sampling.sampler import Sampler, SamplingState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def no_sync():
    """Any synchronizing CUDA call inside raises."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _states() -> list[SamplingState]:
    params = [
        SamplingParams(),  # greedy
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        SamplingParams(temperature=1.0, logprobs=3),
        SamplingParams(logprobs=0),
    ]
    return [SamplingState(p, [3, 4, 5, 4], output_ids=[7, 7, 9]) for p in params]


def test_sampler_and_copy_back_do_not_synchronize() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    logits = torch.randn(5, 300, device=dev)
    # warm-up: lazy CUDA init, pinned allocator, generators
    Sampler(dev, seed=0).sample(logits, _states()).to_host()
    to_host = DeviceToHost(dev)
    sampler = Sampler(dev, seed=0)
    states = _states()
    for st in states:
        st.generator_for(dev)  # created outside: only the sampling itself is checked
    with no_sync():
        sample = sampler.sample(logits, states)
        pending = to_host.start(sample.device_tensors())
    got = sample.finish(pending.wait())
    want = Sampler(dev, seed=0)(logits, _states())
    assert got.token_ids.tolist() == want.token_ids.tolist()
    assert got.logprobs is not None and want.logprobs is not None
    assert got.logprobs[3] == pytest.approx(want.logprobs[3])
    assert got.logprobs[4] == pytest.approx(want.logprobs[4])
    # greedy rows agree with the CPU sampler
    cpu = Sampler(seed=0)(logits.cpu(), _states())
    assert got.token_ids[0] == cpu.token_ids[0] and got.token_ids[4] == cpu.token_ids[4]


def test_plain_greedy_path_does_not_synchronize() -> None:
    dev = torch.device("cuda")
    logits = torch.randn(64, 1000, device=dev)
    states = [SamplingState(SamplingParams(), [1]) for _ in range(64)]
    to_host = DeviceToHost(dev)
    sampler = Sampler(dev)
    to_host.start(sampler.sample(logits, states).device_tensors()).wait()
    with no_sync():
        pending = [to_host.start(sampler.sample(logits, states).device_tensors())
                   for _ in range(3)]  # fmt: skip
    for p in pending:
        assert p.wait()[0].tolist() == logits.argmax(-1).tolist()


def test_swap_does_not_synchronize() -> None:
    cache = PagedKVCache(num_layers=2, num_blocks=8, page_size=4, num_kv_heads=2, head_dim=8,
                         device="cuda", cpu_offload_blocks=4)  # fmt: skip
    view = cache.storage.view(4, cache.num_chunks, -1)
    view[:, 3] = 3.0
    cache.swap(np.array([[3, 0]]), None)  # warm-up (stream, pinned allocator)
    cache.finish_swaps()
    view[:, 5] = 5.0
    with no_sync():
        cache.swap(np.array([[5, 1]]), np.array([[0, 6]]))
    cache.finish_swaps()
    assert bool((view[:, 6] == 3.0).all())
    assert bool((cache.swap_pool[:, 1] == 5.0).all())
