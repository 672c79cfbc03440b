"""Giving memory back to the kernel after a GGUF model's matrices are packed (Linux, glibc).

* `release(tensors)`: the pages of tensors that are views of a file's memory map leave this
  process's resident set (`MADV_DONTNEED`: the mapping's page-table entries go, the page
  cache keeps the pages, and the next touch maps them again from the file). This works
  whoever else maps the file; `MADV_PAGEOUT`, which the anonymous parts of `tensors` still
  get, skips every page another process maps too, so a second process on the same file kept
  ~1.3 GB of its pages resident.
* `trim_heap()`: `malloc_trim(0)`, the freed parts of the C heap given back (construction's
  temporary buffers: ~0.1 GB for a 1.5B model).

Dropping the entries of a private file mapping would discard pages this process wrote to;
ferrobatch never writes a GGUF tensor (`gguf.reader`), and an anonymous range is never
given `MADV_DONTNEED` (it would read back as zeros).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import mmap
import sys
from collections.abc import Iterable

import torch

__all__ = ["release", "trim_heap"]

_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21


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


def _in_file_map(files: list[tuple[int, int]], start: int, stop: int) -> bool:
    i = bisect.bisect_right(files, (start, sys.maxsize)) - 1
    return i >= 0 and files[i][0] <= start and stop <= files[i][1]


def release(tensors: Iterable[torch.Tensor]) -> int:
    """Take the whole pages of `tensors` out of the resident set (best effort; see the module
    docstring). Returns the bytes advised `MADV_DONTNEED` (file views). No-op off Linux."""
    if not sys.platform.startswith("linux"):
        return 0
    files = _file_maps()
    dropped = 0
    for t in tensors:
        start, stop = _pages(t)
        if stop <= start:
            continue
        advice = _MADV_DONTNEED if _in_file_map(files, start, stop) else _MADV_PAGEOUT
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), advice)
        dropped += (stop - start) if advice == _MADV_DONTNEED else 0
    return dropped


def trim_heap() -> None:
    """Give the C heap's free memory back (`malloc_trim(0)`; glibc only, else nothing)."""
    if sys.platform.startswith("linux"):
        trim = getattr(_libc(), "malloc_trim", None)
        if trim is not None:
            trim(0)
