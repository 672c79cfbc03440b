"""The KV cache's swap pool: batched swap-out / swap-in of whole chunks (all layers),
slots reused across steps, chunks freed by a swap-out refilled by a swap-in of the same
step. The CPU path runs everywhere; the CUDA path (copy stream, pinned staging, deferred
landing of swap-outs in the pool) runs when a GPU is present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrobatch.attention.kv_cache import PagedKVCache

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]  # fmt: skip


def _cache(device: str, slots: int = 6) -> PagedKVCache:
    return PagedKVCache(num_layers=3, num_blocks=10, page_size=4, num_kv_heads=2, head_dim=8,
                        device=device, cpu_offload_blocks=slots)  # fmt: skip


def _chunk(cache: PagedKVCache, c: int) -> torch.Tensor:
    """Chunk `c` of every layer, K and V: [2 * layers, chunk_elements] on the CPU."""
    return cache.storage.view(cache.num_layers * 2, cache.num_chunks, -1)[:, c].cpu().clone()


def _fill(cache: PagedKVCache, c: int, value: float) -> None:
    view = cache.storage.view(cache.num_layers * 2, cache.num_chunks, -1)
    view[:, c] = value + torch.arange(view.shape[2], device=view.device, dtype=view.dtype)


def _pairs(*pairs: tuple[int, int]) -> np.ndarray:
    return np.array(pairs, dtype=np.int32).reshape(-1, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_swap_round_trips_with_slot_reuse(device: str) -> None:
    cache = _cache(device)
    for c in range(2, 12):
        _fill(cache, c, 100.0 * c)
    want = {c: _chunk(cache, c) for c in range(2, 12)}
    # step 1: three chunks out
    cache.swap(_pairs((3, 0), (7, 4), (11, 5)), None)
    for c in (3, 7, 11):  # the chunks are reused by other requests
        _fill(cache, c, -1.0)
    # step 2: chunk 8 goes out and, in the same step, receives slot 4 (chunk 7's data): the
    # swap-out's gather runs before the swap-in's scatter
    cache.swap(_pairs((8, 1)), _pairs((0, 2), (4, 8)))
    assert torch.equal(_chunk(cache, 2), want[3])
    assert torch.equal(_chunk(cache, 8), want[7])
    # step 3: slot 0 (read in step 2) is reused at once; slot 1 comes back
    _fill(cache, 5, 555.0)
    want5 = _chunk(cache, 5)
    cache.swap(_pairs((5, 0)), _pairs((1, 9), (5, 10)))
    assert torch.equal(_chunk(cache, 9), want[8])
    assert torch.equal(_chunk(cache, 10), want[11])
    cache.swap(None, _pairs((0, 4)))
    assert torch.equal(_chunk(cache, 4), want5)
    cache.finish_swaps()
    assert torch.equal(cache.swap_pool[:, 0].cpu(), want5)


@pytest.mark.parametrize("device", DEVICES)
def test_swap_refuses_reserved_chunks_and_unknown_slots(device: str) -> None:
    cache = _cache(device)
    with pytest.raises(ValueError, match="swap_out device chunk"):
        cache.swap(_pairs((1, 0)), None)
    with pytest.raises(ValueError, match="swap_in swap slot"):
        cache.swap(None, _pairs((6, 3)))
    with pytest.raises(RuntimeError, match="no CPU swap pool"):
        _cache(device, slots=0).swap(_pairs((3, 0)), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_swap_is_ordered_against_the_compute_stream() -> None:
    cache = _cache("cuda")
    assert cache.swap_pool is not None and cache.swap_pool.is_pinned()
    view = cache.storage.view(cache.num_layers * 2, cache.num_chunks, -1)
    # a slow kernel then a write on the compute stream: the swap-out must see the write
    torch.cuda._sleep(50_000_000)
    view[:, 4] = 42.0
    cache.swap(_pairs((4, 2)), None)
    # the forward after the swap (compute stream) may overwrite the swapped-out chunk
    view[:, 4] = -5.0
    cache.finish_swaps()
    assert bool((cache.swap_pool[:, 2] == 42.0).all())
    # a swap-in is visible to the compute stream's next kernel without a host sync
    cache.swap(None, _pairs((2, 6)))
    total = view[:, 6].sum()  # queued on the compute stream right after swap() returned
    assert float(total) == 42.0 * view[:, 6].numel()
