"""`cpu.pages.release`: a file view's pages leave the resident set and read back the file's
bytes; a page this process wrote in a private file mapping keeps what was written; an
anonymous tensor keeps its values."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from ferrobatch.cpu import pages

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
