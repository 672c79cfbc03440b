"""The CPU kernels on torch's OpenMP team (`ferrobatch.cpu.threads.share_torch_openmp`) and
the thread governor that lowers torch's thread count while other processes keep the cores
busy (`ThreadGovernor`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ferrobatch import ContinuousBatchingConfig
from ferrobatch.cpu import threads as cpu_threads
from ferrobatch.errors import FieldError

_core = pytest.importorskip("ferrobatch._core")
needs_linux = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")


def u16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint16).numpy()


def kernel_outputs(threads: int) -> list[torch.Tensor]:
    """rms_norm (with a residual), silu_mul, rope and decode attention, each large enough to
    split between threads."""
    g = torch.Generator().manual_seed(3)
    rows, hidden, inter, heads, dim = 256, 576, 1536, 9, 64
    x = torch.randn(rows, hidden, generator=g)
    res = torch.randn(rows, hidden, generator=g).bfloat16()
    w = torch.randn(hidden, generator=g).bfloat16()
    normed = torch.empty(rows, hidden, dtype=torch.bfloat16)
    _core.rms_norm(x.numpy(), u16(w), u16(normed), x_dtype="float32", weight_dtype="bfloat16",
                   out_dtype="bfloat16", eps=1e-5, weight_offset=0.0, threads=threads,
                   residual=u16(res), residual_dtype="bfloat16")
    gu = torch.randn(rows, 2 * inter, generator=g).bfloat16()
    act = torch.empty(rows, inter, dtype=torch.bfloat16)
    _core.silu_mul(u16(gu), u16(act), dtype="bfloat16", out_dtype="bfloat16", threads=threads)
    src = torch.randn(rows, heads * dim, generator=g).bfloat16()
    cos, sin = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
    rot = torch.empty(rows, heads, dim)
    _core.rope(u16(src), cos.numpy(), sin.numpy(), rot.numpy(), src_dtype="bfloat16",
               out_dtype="float32", col_offset=0, heads=heads, dim=dim, threads=threads)
    page, pages, kv_heads = 16, 64, 3
    kc = torch.randn(pages * page, kv_heads, dim, generator=g).bfloat16()
    vc = torch.randn(pages * page, kv_heads, dim, generator=g).bfloat16()
    q = torch.randn(32, heads, dim, generator=g)
    table = torch.randint(0, pages, (32, 4), generator=g, dtype=torch.int32)
    seqlens = torch.randint(1, 4 * page + 1, (32,), generator=g, dtype=torch.int32)
    att = torch.empty(32, heads, dim)
    _core.paged_decode_attention(q.numpy(), u16(kc), u16(vc), table.numpy(), seqlens.numpy(),
                                 att.numpy(), q_dtype="float32", cache_dtype="bfloat16",
                                 out_dtype="float32", page=page, window=0, scale=0.125,
                                 softcap=0.0, threads=threads)
    return [x, normed, act, rot, att]


@pytest.fixture
def shared_pool():
    """torch's OpenMP team shared (as every CPU engine leaves it), then restored."""
    if not cpu_threads.share_torch_openmp():
        pytest.skip("no OpenMP runtime to share here")
    yield cpu_threads.torch_cpu_library()
    _core.share_openmp(cpu_threads.torch_cpu_library())


@needs_linux
def test_shared_and_own_threads_give_the_same_bits(shared_pool):
    torch.set_num_threads(2)
    shared = [kernel_outputs(t) for t in (1, 2, 3)]
    _core.share_openmp(None)  # threads started per call
    own = kernel_outputs(2)
    for got in shared[1:] + [own]:
        for a, b in zip(shared[0], got, strict=True):
            assert torch.equal(a, b)


@needs_linux
def test_shared_kernels_start_no_threads_of_their_own(shared_pool):
    """On torch's team a split reuses the worker torch's products run on: no thread stays
    behind (a second OpenMP runtime, such as sentencepiece's libgomp, would keep one)."""
    torch.set_num_threads(2)
    torch.ones(1 << 22).add_(1.0)  # torch's team: its worker exists from here on
    before = len(os.listdir("/proc/self/task"))
    kernel_outputs(2)
    assert len(os.listdir("/proc/self/task")) == before


@needs_linux
def test_share_openmp_takes_only_loaded_libraries(tmp_path: Path):
    """A fresh process (the runtime, once shared, stays): a library that is not loaded, or
    one with no OpenMP under it, is refused; torch's is taken, and no other after it."""
    script = f"""
import ctypes.util, torch
from ferrobatch import _core
from ferrobatch.cpu import threads as cpu_threads
for path, words in (({str(tmp_path / "libnothing.so")!r}, "not a library loaded"),
                    (ctypes.util.find_library("c") and "libc.so.6", "no OpenMP runtime")):
    try:
        _core.share_openmp(path)
        raise SystemExit(path + " was taken")
    except OSError as e:
        assert words in str(e), e
torch.ones(1)
_core.share_openmp(cpu_threads.torch_cpu_library())
try:
    _core.share_openmp("libc.so.6")
    raise SystemExit("a second library was taken")
except OSError as e:
    assert "already share" in str(e), e
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_torch_cpu_library_reads_the_maps(tmp_path: Path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 11 /opt/x/sentencepiece.libs/libgomp-6a29.so.1.0.0\n"
        "7f02-7f03 r-xp 00000000 08:01 12 /opt/my dir/torch/lib/libtorch_cpu.so\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert cpu_threads.torch_cpu_library(str(maps)) == "/opt/my dir/torch/lib/libtorch_cpu.so"
    maps.write_text("7f04-7f05 rw-p 00000000 00:00 0 [heap]\n")
    assert cpu_threads.torch_cpu_library(str(maps)) is None
    assert cpu_threads.torch_cpu_library(str(tmp_path / "missing")) is None


# -- the governor -----------------------------------------------------------------------------

class FakeHost:
    """A /proc/stat of two cores, this process's CPU time and the clock, moved by hand."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = tmp_path / "stat"
        self.now, self.ours, self.busy = 100.0, 0.0, [0, 0]
        self.hz = os.sysconf("SC_CLK_TCK")
        self.write()
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_threads.os, "times",
                            lambda: os.times_result((self.ours, 0.0, 0.0, 0.0, self.now)))
        monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1})

    def write(self) -> None:
        cores = "".join(f"cpu{i} {b} 0 0 1000 0 0 0 0 0 0\n" for i, b in enumerate(self.busy))
        self.path.write_text(f"cpu {sum(self.busy)} 0 0 2000 0 0 0 0 0 0\n{cores}intr 5\n")

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass; this process uses `ours` cores, other processes `others`."""
        self.now += seconds
        self.ours += ours * seconds
        per_core = (ours + others) * seconds * self.hz / 2
        self.busy = [b + round(per_core) for b in self.busy]
        self.write()


@pytest.fixture
def host(tmp_path, monkeypatch):
    return FakeHost(tmp_path, monkeypatch)


@pytest.fixture
def threads_back():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_governor_follows_other_load(host, threads_back):
    torch.set_num_threads(2)
    gov = cpu_threads.ThreadGovernor(2, stat=str(host.path))
    gov.tick()  # the first look
    host.run(0.6, ours=1.9, others=0.0)
    gov.tick()
    assert gov.threads == 2 and torch.get_num_threads() == 2
    host.run(0.6, ours=1.0, others=1.0)  # another process keeps a core busy
    gov.tick()
    assert gov.threads == 1 and torch.get_num_threads() == 1
    host.run(0.6, ours=1.0, others=0.5)  # half a core taken: still not a free core
    gov.tick()
    assert gov.threads == 1
    host.run(0.6, ours=1.0, others=0.05)  # free again
    gov.tick()
    assert gov.threads == 2 and torch.get_num_threads() == 2
    assert gov.changes == 2
    host.run(0.6, ours=0.0, others=2.0)
    gov.tick()
    assert gov.threads == 1
    gov.close()
    assert torch.get_num_threads() == 2


def test_governor_looks_once_per_interval(host, threads_back):
    gov = cpu_threads.ThreadGovernor(2, interval=0.5, stat=str(host.path))
    gov.tick()
    host.run(0.2, ours=0.0, others=2.0)
    gov.tick()  # too early: nothing read, nothing changed
    assert gov.threads == 2
    host.run(0.4, ours=0.0, others=2.0)
    gov.tick()  # the 0.6 s since the first look, both cores taken by others
    assert gov.threads == 1


def test_governor_never_exceeds_the_engine_count(host, threads_back):
    torch.set_num_threads(1)
    gov = cpu_threads.ThreadGovernor(1, stat=str(host.path))
    gov.tick()
    host.run(1.0, ours=0.0, others=0.0)
    gov.tick()
    assert gov.threads == 1
    gov.set_threads(8)
    assert gov.threads == 1 and torch.get_num_threads() == 1


def test_governor_is_only_for_multithreaded_cpu_engines(threads_back):
    torch.set_num_threads(1)
    assert cpu_threads.ThreadGovernor.of("cpu", True) is None
    torch.set_num_threads(2)
    assert cpu_threads.ThreadGovernor.of("cpu", False) is None
    assert cpu_threads.ThreadGovernor.of("cuda", True) is None
    if os.path.exists("/proc/stat"):
        gov = cpu_threads.ThreadGovernor.of("cpu", True)
        assert gov is not None and gov.max_threads == 2


def test_adaptive_threads_must_be_a_bool():
    with pytest.raises(FieldError) as info:
        ContinuousBatchingConfig(adaptive_threads="yes")
    assert info.value.field == "adaptive_threads"
    assert ContinuousBatchingConfig(adaptive_threads=False).adaptive_threads is False
