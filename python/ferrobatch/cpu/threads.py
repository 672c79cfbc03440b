"""The CPU kernels' threads: on the OpenMP runtime torch runs, not threads of their own.

ferrobatch's CPU kernels (`ferrobatch._core`: decode attention, the fused elementwise ops)
split a call's rows between threads. Started per call, those threads share the cores with
the OpenMP workers that torch's products run on, which keep waiting (spinning, then
asleep) between products: on 2 cores the two sets take turns and neither gains. Shared,
a kernel's split is one more parallel region of torch's own team.

The runtime is the one torch's own library (`libtorch_cpu`) binds to, looked up through
that library: a process may hold several OpenMP runtimes (sentencepiece's wheel ships a
libgomp of its own), and only torch's has torch's threads.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch

from ferrobatch import _core

logger = logging.getLogger("ferrobatch")

__all__ = ["ThreadGovernor", "share_torch_openmp", "torch_cpu_library"]

_TORCH_CPU = "libtorch_cpu"
_shared: bool | None = None  # None: not tried yet


def torch_cpu_library(maps: str = "/proc/self/maps") -> str | None:
    """Path of torch's CPU library as mapped into this process, or None (not mapped, or not
    Linux)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset device inode path
        path = fields[5].strip() if len(fields) == 6 else ""
        if os.path.basename(path).startswith(_TORCH_CPU + "."):
            return path
    return None


def share_torch_openmp() -> bool:
    """Make the CPU kernels run on torch's OpenMP threads (tried once per process); False
    when this build or platform can't (the kernels then start threads per call)."""
    global _shared
    if _shared is not None:
        return _shared
    _shared = False
    if not hasattr(_core, "share_openmp") or not sys.platform.startswith("linux"):
        return False
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False  # torch built on another thread pool: nothing to share
    path = torch_cpu_library()
    if path is None:
        return False
    try:
        _core.share_openmp(path)
    except OSError as e:
        logger.info("ferrobatch: CPU kernels keep their own threads (%s)", e)
        return False
    _shared = True
    return True


# --- how many threads the cores can give -------------------------------------------------

#: seconds between two looks at the cores
GOVERNOR_INTERVAL_S = 0.5
#: a core counts as free when other processes left at least this share of it
_FREE_SHARE = 0.7


def _cpu_busy_ticks(cpus: frozenset[int], stat: str = "/proc/stat") -> int | None:
    """Busy clock ticks so far (user, nice, system, irq, softirq, steal) of `cpus`, summed."""
    try:
        with open(stat) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *ticks = line.split()
        if int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, ticks[:8])
            total += user + nice + system + irq + softirq + steal
    return total


class ThreadGovernor:
    """Keeps torch's CPU thread count at what the allowed cores can give.

    Threads that wait by spinning make a step many times slower as soon as another process
    wants one of the cores (measured: SmolLM2 bf16 at 2 threads, 3.5 s idle, 13.4 s beside
    one busy process; 5.1 s at 1 thread, 5.2 s with the governor; `benches/threads_busy.py`).
    Every `interval` seconds of stepping, `tick()` counts the busy time of this process's
    allowed cores that other processes took and sets `torch.set_num_threads` to the cores
    they left free (at least 1, at most `max_threads`, the count when the engine was built);
    `close()` puts `max_threads` back.
    """

    def __init__(self, max_threads: int, *, interval: float = GOVERNOR_INTERVAL_S,
                 stat: str = "/proc/stat") -> None:
        self.max_threads = max_threads
        self.interval = interval
        self.threads = max_threads
        self._stat = stat
        self._cpus = frozenset(os.sched_getaffinity(0))
        self._hz = os.sysconf("SC_CLK_TCK")
        self._last: tuple[float, int, float] | None = None
        self.changes = 0  # how often the count moved

    @classmethod
    def of(cls, device_type: str, enabled: bool) -> ThreadGovernor | None:
        """A governor for a CPU engine built with more than one torch thread, on Linux."""
        if not enabled or device_type != "cpu" or not sys.platform.startswith("linux"):
            return None
        threads = torch.get_num_threads()
        if threads <= 1:
            return None
        governor = cls(threads)
        governor.tick()  # the first look: what later ones compare with
        return governor if governor._last is not None else None  # None: no /proc/stat

    def _sample(self) -> tuple[float, int, float] | None:
        busy = _cpu_busy_ticks(self._cpus, self._stat)
        if busy is None:
            return None
        t = os.times()
        return time.monotonic(), busy, t.user + t.system

    def tick(self) -> None:
        """Look at the cores if `interval` has passed since the last look; adjust threads."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return
        sample = self._sample()
        if sample is None:
            return
        last, self._last = self._last, sample
        if last is None:
            return
        wall = sample[0] - last[0]
        others = (sample[1] - last[1]) / self._hz - (sample[2] - last[2])  # core-seconds
        free = len(self._cpus) - max(others, 0.0) / wall
        self.set_threads(int(free + 1 - _FREE_SHARE))

    def set_threads(self, n: int) -> None:
        """Use `n` threads (clamped to 1 .. max_threads)."""
        n = max(1, min(self.max_threads, n))
        if n != self.threads:
            logger.info("ferrobatch: %d torch threads (other processes busy on this "
                        "process's cores)" if n < self.max_threads else
                        "ferrobatch: %d torch threads (the cores are free again)", n)
            self.threads = n
            self.changes += 1
            torch.set_num_threads(n)

    def close(self) -> None:
        """Put the thread count back to `max_threads`."""
        self.set_threads(self.max_threads)
