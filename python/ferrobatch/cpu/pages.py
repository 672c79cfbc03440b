"""Giving memory back to the kernel once a model's weights have been packed (Linux, glibc).

* `release(tensors)`: the pages of tensors that are views of a file's memory map (a GGUF
  file's rows, a safetensors checkpoint's weights) leave this process's resident set
  (`MADV_DONTNEED`: the mapping's page-table entries go, the page cache keeps the pages, and
  the next touch maps them again from the file). This works whoever else maps the file;
  `MADV_PAGEOUT` skips every page another process maps too (a second process on the same
  GGUF file kept ~1.3 GB of its pages resident).
* A private file mapping's page that this process wrote to (or whose copy went to swap) is
  no longer the file's: dropping it would read back the file's old bytes. Such ranges are
  found in `/proc/self/pagemap` and get `MADV_PAGEOUT` instead, which never loses data, as
  do anonymous tensors when `anonymous=True` (the callers' own tensors are left alone with
  `anonymous=False`).
* `trim_heap()`: `malloc_trim(0)`, the freed parts of the C heap given back (construction's
  temporary buffers: ~0.1 GB for a 1.5B model).

And taking memory for packed weights: `weight_empty(numel, dtype)` is an uninitialized
tensor in anonymous memory advised to use transparent huge pages (2 MiB), which every
decode step reads from end to end. With 4 KiB pages a one-row product of a weight streamed
from memory runs 6-23% slower on AMD Zen 4 (`quant_speed`, `COLD=1`, one core: Q4_K
8960 x 1536 18.2 against 21.0 GB/s, Q6_K 18.0 against 22.2): a TLB miss every 4 KiB, and
the hardware prefetchers stop at each 4 KiB boundary. Small weights share 64 MiB chunks
(each 2 MiB-aligned) so that they too lie on huge pages; a chunk lives while any weight in
it does. The price is paid once, at packing: in a virtual machine a 2 MiB page's first
touch can cost the hypervisor's backing of it (a 1.5B GGUF model's construction took 6.7-8.3
s against 5.2 on the same Zen 4 VM; its single stream decoded 1.057x faster).
`FERROBATCH_HUGE_WEIGHTS=0` turns it off (plain `torch.empty`); where the kernel has no
transparent huge pages the advice is refused and the memory is 4 KiB pages.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["release", "trim_heap", "weight_empty"]

_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21
_PRESENT, _SWAPPED, _FILE = np.uint64(1 << 63), np.uint64(1 << 62), np.uint64(1 << 61)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _file_maps() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of regular files (inode not 0), sorted."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((lo, hi))
    return sorted(ranges)


def _pages(t: torch.Tensor) -> tuple[int, int]:
    """The whole pages inside `t`'s bytes: [start, stop) (empty when start >= stop)."""
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    stop = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    return start, stop


def _has_storage(t: torch.Tensor) -> bool:
    """Whether `t` lies in memory of its own (a wrapper tensor's pointer is null)."""
    try:
        return t.data_ptr() != 0
    except RuntimeError:
        return False


def _in_file_map(files: list[tuple[int, int]], start: int, stop: int) -> bool:
    i = bisect.bisect_right(files, (start, sys.maxsize)) - 1
    return i >= 0 and files[i][0] <= start and stop <= files[i][1]


def _only_file_pages(pagemap: int, start: int, stop: int) -> bool:
    """Whether every page of [start, stop) is absent or still the file's (present pages
    file-backed, none swapped): the range may be dropped without losing a write."""
    page = mmap.PAGESIZE
    want = (stop - start) // page * 8
    raw = os.pread(pagemap, want, start // page * 8)
    if len(raw) != want:
        return False
    entries = np.frombuffer(raw, dtype=np.uint64)
    present = (entries & _PRESENT) != 0
    anonymous = present & ((entries & _FILE) == 0)
    return not bool(anonymous.any() or ((entries & _SWAPPED) != 0).any())


def release(tensors: Iterable[torch.Tensor], anonymous: bool = True) -> int:
    """Take the whole pages of `tensors` out of the resident set (best effort; see the module
    docstring): file views' clean pages dropped, written or (with `anonymous`) anonymous
    ones paged out. Returns the bytes dropped (`MADV_DONTNEED`). No-op off Linux."""
    if not sys.platform.startswith("linux"):
        return 0
    files = _file_maps()
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        pagemap = -1
    dropped = 0
    try:
        for t in tensors:
            if not _has_storage(t):  # (a weight held in another form: nothing mapped)
                continue
            start, stop = _pages(t)
            if stop <= start:
                continue
            mapped = _in_file_map(files, start, stop)
            clean = mapped and pagemap >= 0 and _only_file_pages(pagemap, start, stop)
            if not (mapped or anonymous):
                continue
            advice = _MADV_DONTNEED if clean else _MADV_PAGEOUT
            _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), advice)
            dropped += (stop - start) if clean else 0
    finally:
        if pagemap >= 0:
            os.close(pagemap)
    return dropped


def trim_heap() -> None:
    """Give the C heap's free memory back (`malloc_trim(0)`; glibc only, else nothing)."""
    if sys.platform.startswith("linux"):
        trim = getattr(_libc(), "malloc_trim", None)
        if trim is not None:
            trim(0)


#: transparent huge pages' size, and the chunks small weights share
_HUGE = 2 << 20
_CHUNK = 64 << 20
#: the chunk small weights are taken from now, weakly (it goes when no weight in it is left),
#: and the offset of its first free byte
_chunk: tuple[weakref.ref | None, int] = (None, 0)
_chunk_lock = threading.Lock()


def huge_weights() -> bool:
    """Whether `weight_empty` takes huge-page memory (Linux, not `FERROBATCH_HUGE_WEIGHTS=0`)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") \
        and os.environ.get("FERROBATCH_HUGE_WEIGHTS", "1") != "0"


def weight_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor of `numel` `dtype` elements for a packed weight, on
    transparent huge pages where the kernel has them (see the module docstring); 64-byte
    aligned, as `torch.empty`'s."""
    if numel == 0 or not huge_weights():
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    need = -(-nbytes // 64) * 64
    if need > _CHUNK // 2:  # (a large weight: a mapping of its own)
        region, at = _huge_region(need)
    else:
        global _chunk
        with _chunk_lock:
            ref, at = _chunk
            region = ref() if ref is not None else None
            if region is None or at + need > len(region):
                region, at = _huge_region(_CHUNK)
            _chunk = (weakref.ref(region), at + need)
    return torch.frombuffer(region, dtype=torch.uint8, offset=at, count=nbytes).view(dtype)


def _huge_region(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping advised to use huge pages, and the offset in it of the first
    2 MiB boundary, with `nbytes` from there (the bytes before it are never touched)."""
    region = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages
        pass
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    return region, -base % _HUGE
