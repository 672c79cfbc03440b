"""MXFP4 blocks (gpt-oss's experts) rewritten at load as Q5_0 blocks of the same values.

An MXFP4 block (`ggml-common.h`: 17 bytes) is one E8M0 exponent byte `e` and 32 four-bit
codes, weight `j` = `MXFP4_VALUES[code_j] * 2^(e - 128)` with `MXFP4_VALUES` the doubled E2M1 values
(0, ±1, ±2, ±3, ±4, ±6, ±8, ±12). A Q5_0 block (22 bytes) holds `d` (fp16) and 32 five-bit
`q`, weight `d * (q - 16)`. With `d = 2^(e - 128)` and `q = MXFP4_VALUES[code] + 16` (4 .. 28)
both say the same number, so the kernels' Q5_0 products compute MXFP4 products exactly, at
22/17 of the file's bytes.

`d` is exact in fp16 for `e` in 104 .. 143 (2^-24, fp16's least subnormal, to 2^15). A block
whose codes are all zero is zero whatever its `e` (llama.cpp writes `e = 0` for it); a block
with a smaller `e` and a nonzero code (every weight below 12 * 2^-25 in magnitude) becomes
zero, and is counted; a larger `e` (weights of 2^16 and more) is refused. The rewrite runs in
`ferrobatch-kernels` (`quant::mxfp4_to_q5_0`, on torch's threads: 0.3-1 GB/s a core on
the Zen 4 it was written on, the lower figure with the output's first-touch page faults).

The rewritten blocks live in a file-backed map (`file_backed`: an unlinked file under the
cache directory), as the file's own blocks do: the kernels' packed copies are the model's
resident weights, and the blocks they were packed from can leave memory under pressure
instead of doubling a gpt-oss model's footprint.
"""

from __future__ import annotations

import logging
import mmap
import tempfile
from pathlib import Path

import numpy as np
import torch

from ferrobatch import _core
from ferrobatch.errors import FieldError

__all__ = ["MXFP4_BLOCK_BYTES", "Q5_0_BLOCK_BYTES", "RepackError", "file_backed", "to_q5_0"]

logger = logging.getLogger("ferrobatch")

MXFP4_BLOCK_BYTES = 17
Q5_0_BLOCK_BYTES = 22


class RepackError(ValueError):
    """A block whose values Q5_0 cannot hold (an exponent above 143)."""


def file_backed(shape: tuple[int, ...], directory: Path | None) -> np.ndarray:
    """A uint8 array of `shape` in a shared map of an unlinked file in `directory` (the map
    keeps the file until the array goes): memory the kernel can write back and drop.
    Memory of its own (`np.empty`) where `directory` is None or cannot hold the file."""
    size = int(np.prod(shape))
    if directory is not None and size:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory) as f:
                f.truncate(size)
                buf = mmap.mmap(f.fileno(), size)
            return np.frombuffer(buf, dtype=np.uint8).reshape(shape)
        except OSError as exc:
            logger.info("ferrobatch: no file-backed map in %s (%s); rewritten blocks in "
                        "memory", directory, exc)
    return np.empty(shape, dtype=np.uint8)


def to_q5_0(blocks: np.ndarray, name: str = "tensor",
            directory: Path | None = None) -> tuple[np.ndarray, int]:
    """MXFP4 bytes (uint8, last dim a whole number of 17-byte blocks) as Q5_0 bytes of the
    same values (last dim 22 per block; in a `file_backed` map in `directory` where given),
    and how many blocks were below fp16's range and became zero (module docstring);
    `RepackError` naming `name` for an exponent above 143."""
    arr = np.ascontiguousarray(blocks, dtype=np.uint8)
    if arr.ndim == 0 or arr.shape[-1] % MXFP4_BLOCK_BYTES:
        raise ValueError(f"{name}: MXFP4 rows hold whole {MXFP4_BLOCK_BYTES}-byte blocks, not "
                         f"{arr.shape[-1] if arr.ndim else 0} bytes")
    out = file_backed((*arr.shape[:-1],
                       arr.shape[-1] // MXFP4_BLOCK_BYTES * Q5_0_BLOCK_BYTES), directory)
    try:
        flushed = _core.quant_mxfp4_to_q5_0(arr.reshape(-1), out.reshape(-1),
                                            threads=torch.get_num_threads())
    except FieldError as exc:
        raise RepackError(f"{name}: {exc}") from exc
    return out, int(flushed)
