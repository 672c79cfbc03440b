"""The CPU KV cache's memory (`attention/kv_cache._zeros`): zero, writable, of the asked
shape and dtype, below and above the size from which it is a mapping of its own (zeroed on
first touch, 4 KiB pages), and given back when the tensor and every view of it are gone."""

from __future__ import annotations

import gc

import pytest
import torch
from ferrobatch.attention import kv_cache
from ferrobatch.attention.kv_cache import PagedKVCache


@pytest.mark.parametrize("blocks", [2, 1000])  # tens of KiB / 12-25 MiB of slots
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_slots_start_zero_and_take_writes(blocks: int, dtype: torch.dtype) -> None:
    cache = PagedKVCache(num_layers=3, num_blocks=blocks, page_size=16, num_kv_heads=2,
                         head_dim=32, dtype=dtype)
    assert (cache.nbytes >= kv_cache._LAZY_FROM) == (blocks == 1000)
    assert cache.storage.dtype == dtype and cache.storage.is_contiguous()
    assert cache.storage.shape == (3, 2, cache.num_slots, 2, 32)
    assert not cache.storage.any()
    cache.keys[2][-1].fill_(1.5)
    cache.values[0][0, 1, 3] = -2.0
    assert cache.storage[2, 0, -1].eq(1.5).all() and cache.storage[0, 1, 0, 1, 3] == -2.0
    assert cache.storage.ne(0).sum() == 2 * 32 + 1


def _mapped_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize"))


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="/proc")
def test_a_large_cache_is_unmapped_with_its_last_view() -> None:
    gc.collect()
    before = _mapped_kib()
    storage = kv_cache._zeros((64, 2, 4096, 4, 64), torch.device("cpu"), torch.float32)
    views = [storage[i, 0] for i in range(4)]
    size_kib = storage.numel() * 4 // 1024  # 512 MiB
    del storage
    gc.collect()
    assert _mapped_kib() - before >= size_kib  # the views keep it
    views[3].fill_(1.0)
    del views
    gc.collect()
    assert _mapped_kib() - before < size_kib // 8


def _smaps_field(addr: int, field: str) -> int | None:
    """`field` of the /proc/self/smaps entry that maps `addr` (None: no such line)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and head and head[0] == field + ":":
                return int(head[1])
    return None


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="/proc")
def test_a_large_cache_takes_no_huge_pages() -> None:
    """First touches of a large cache fault 4 KiB pages (in a virtual machine cold 2 MiB
    pages cost the hypervisor seconds: `kv_cache._zeros`)."""
    storage = kv_cache._zeros((8, 2, 8192, 4, 64), torch.device("cpu"), torch.float32)
    storage[:, :, ::64].fill_(1.0)  # touch every 64 KiB
    eligible = _smaps_field(storage.data_ptr(), "THPeligible")
    assert eligible in (None, 0)
    assert _smaps_field(storage.data_ptr(), "AnonHugePages") in (None, 0)
