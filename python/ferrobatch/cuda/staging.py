"""Host arrays to the device through one pinned staging buffer (the eager steps' inputs).

A non-blocking copy from ordinary (pageable) host memory may be synchronous (CUDA stages it
through a driver buffer), which would stall the async pipeline on every eager step. So the
step's arrays of one dtype are packed into one pinned host tensor and copied up at once, as
the sampler's and the swaps' uploads are: the tensor comes from torch's caching host
allocator, which keeps it from reuse until the copy that reads it has run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["ALIGN_BYTES", "upload"]

ALIGN_BYTES = 16  # every view starts on a 16-byte boundary: Triton specialises pointers on it


def upload(
    arrays: Mapping[str, Any],
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    pack: bool | None = None,
) -> dict[str, torch.Tensor]:
    """`arrays` (name -> array-like; None values are skipped) as `dtype` tensors on `device`,
    by the same names and shapes.

    `pack` (default: on CUDA only): the arrays go into one host buffer (pinned on CUDA),
    each starting on an `ALIGN_BYTES` boundary, which is copied to the device in one
    non-blocking copy; the results are contiguous views of that one device buffer. Without
    packing (CPU) each array becomes a tensor of its own, sharing the array's memory where
    it already has the dtype (what the CPU path always did)."""
    dev = torch.device(device)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    host = {name: np.ascontiguousarray(a, dtype=np_dtype) for name, a in arrays.items()
            if a is not None}
    if pack is None:
        pack = dev.type == "cuda"
    if not pack:
        return {name: torch.from_numpy(a).to(dev, non_blocking=True) for name, a in host.items()}
    align = max(1, ALIGN_BYTES // np_dtype.itemsize)
    offsets: dict[str, int] = {}
    total = 0
    for name, a in host.items():
        offsets[name] = total
        total += -(-a.size // align) * align
    staging = torch.empty(max(total, align), dtype=dtype, pin_memory=dev.type == "cuda")
    flat = staging.numpy()
    for name, a in host.items():
        flat[offsets[name] : offsets[name] + a.size] = a.reshape(-1)
    on_dev = staging.to(dev, non_blocking=True)
    return {name: on_dev[offsets[name] : offsets[name] + a.size].view(a.shape)
            for name, a in host.items()}
