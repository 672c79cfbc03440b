"""`cpu.pages.release`: a file view's pages leave the resident set and read back the file's
bytes; a page this process wrote in a private file mapping keeps what was written; an
anonymous tensor keeps its values; an engine gives back its checkpoint's packed pages.
`cpu.pages.weight_empty`: packed weights' memory, on transparent huge pages where the
kernel has them, small weights sharing a chunk that goes with its last weight."""

from __future__ import annotations

import gc
import mmap
import os
import sys
import weakref

import numpy as np
import pytest
import tiny_models
import torch
from ferrobatch import Engine, SamplingParams
from ferrobatch.cpu import pages
from ferrobatch.runner.cpu_linear import packing_available

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")

SIZE = 8 << 20


def _resident_file_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_file_view_leaves_resident_set_and_reads_back(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    view = torch.from_numpy(np.memmap(path, mode="c"))  # as gguf.reader maps a file
    assert int(view.sum()) == int(data.sum())  # every page touched
    before = _resident_file_kib()
    dropped = pages.release([view])
    after = _resident_file_kib()
    assert dropped >= SIZE - 2 * 4096
    assert before - after >= (SIZE >> 10) * 3 // 4
    assert torch.equal(view, torch.from_numpy(data))


def test_anonymous_tensor_keeps_its_values():
    t = torch.arange(SIZE // 4, dtype=torch.int32)
    expected = t.clone()
    assert pages.release([t]) == 0
    assert torch.equal(t, expected)



def test_written_pages_of_a_private_file_view_keep_their_values(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    view = torch.from_numpy(np.memmap(path, mode="c"))  # copy-on-write, like a checkpoint's
    view[SIZE // 2:SIZE // 2 + 10_000] = 7  # a few pages now this process's own
    expected = view.clone()
    pages.release([view])
    assert torch.equal(view, expected)
    # the written range was never dropped: the file's own bytes did not come back
    assert bool((view[SIZE // 2:SIZE // 2 + 10_000] == 7).all())


def test_anonymous_tensors_are_left_alone_when_asked():
    t = torch.arange(SIZE // 4, dtype=torch.int32)
    assert pages.release([t], anonymous=False) == 0
    assert torch.equal(t, torch.arange(SIZE // 4, dtype=torch.int32))


def _present_pages(tensors) -> tuple[int, int]:
    """(pages present in this process, pages) of the whole pages inside `tensors`."""
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    present = total = 0
    try:
        for t in tensors:
            start, stop = pages._pages(t)
            if stop <= start:
                continue
            n = (stop - start) // mmap.PAGESIZE
            raw = os.pread(fd, n * 8, start // mmap.PAGESIZE * 8)
            entries = np.frombuffer(raw, dtype=np.uint64)
            present += int(((entries >> np.uint64(63)) & np.uint64(1)).sum())
            total += n
    finally:
        os.close(fd)
    return present, total


@pytest.mark.skipif(not packing_available(torch.bfloat16),
                    reason="no packed bf16 linears on this CPU (oneDNN needs AVX-512 for bf16)")
def test_an_engine_gives_back_its_checkpoints_packed_pages(tmp_path):
    """A bf16 checkpoint's packed linears: their file pages leave the resident set once the
    engine is built, and its greedy tokens are those of an engine on the same weights in
    memory (nothing to give back there)."""
    model = tiny_models.llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [100, 3, 9]]
    with Engine(str(tmp_path), dtype="bfloat16", config=dict(num_blocks=32)) as eng:
        layers = eng.runner.activations.linears.layers
        present, total = _present_pages(m.weight for m in layers)
        assert total > 0 and present == 0
        got = [o.token_ids for o in eng.generate(prompts, sp, progress=False)]
    with Engine(model, config=dict(num_blocks=32)) as eng:
        want = [o.token_ids for o in eng.generate(prompts, sp, progress=False)]
    assert got == want


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as smaps:
        for line in smaps:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_weight_memory_is_aligned_typed_and_shared_by_small_weights(monkeypatch):
    monkeypatch.delenv("FERROBATCH_HUGE_WEIGHTS", raising=False)
    monkeypatch.setattr(pages, "_chunk", (None, 0))  # (a fresh chunk: room for them all)
    assert pages.huge_weights()
    small = [pages.weight_empty(n, dt) for n, dt in
             ((1000, torch.float32), (3, torch.bfloat16), (0, torch.uint8), (77, torch.int16))]
    for t, (n, dt) in zip(small, ((1000, torch.float32), (3, torch.bfloat16), (0, torch.uint8),
                                  (77, torch.int16)), strict=True):
        assert t.shape == (n,) and t.dtype == dt and t.data_ptr() % 64 == 0
    # consecutive small weights: one chunk, no overlap
    assert small[1].data_ptr() == small[0].data_ptr() + 4032
    assert small[3].data_ptr() >= small[1].data_ptr() + 64
    small[0].fill_(1.5)
    small[1].fill_(2.0)
    assert bool((small[0] == 1.5).all()) and bool((small[1] == 2.0).all())
    big = pages.weight_empty(40 << 20, torch.uint8)  # a mapping of its own, 2 MiB-aligned
    assert big.data_ptr() % (2 << 20) == 0


def test_a_chunk_goes_with_its_last_weight(monkeypatch):
    monkeypatch.delenv("FERROBATCH_HUGE_WEIGHTS", raising=False)
    monkeypatch.setattr(pages, "_chunk", (None, 0))  # (the next weight opens a chunk)
    first = pages.weight_empty(1000, torch.float32)
    second = pages.weight_empty(1000, torch.float32)
    region = weakref.ref(pages._chunk[0]())
    del first
    gc.collect()
    assert region() is not None and bool((second.fill_(3.0) == 3.0).all())
    del second
    gc.collect()
    assert region() is None
    third = pages.weight_empty(10, torch.float32)  # a new chunk
    assert third.shape == (10,) and pages._chunk[0]() is not None


def test_weight_memory_off_is_plain_torch_memory(monkeypatch):
    monkeypatch.setenv("FERROBATCH_HUGE_WEIGHTS", "0")
    assert not pages.huge_weights()
    before = pages._chunk
    t = pages.weight_empty(100, torch.float32)
    assert t.shape == (100,) and pages._chunk == before


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off here")
def test_a_large_weight_lies_on_huge_pages(monkeypatch):
    monkeypatch.delenv("FERROBATCH_HUGE_WEIGHTS", raising=False)
    before = _anon_huge_kib()
    t = pages.weight_empty(16 << 20, torch.uint8)
    t.fill_(1)
    assert _anon_huge_kib() - before >= 8 << 10  # (most of its 16 MiB; the kernel may
    del t                                          # fall back for a page or two)
