"""Tensors as the numpy arrays the compiled kernels take."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["KERNEL_DTYPES", "numpy_view"]

#: The tensor dtypes the kernels of `ferrobatch._core` take, by the name they are given.
KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing `t`'s memory (bf16 / fp16 as their uint16 bit patterns; fp32
    and int8 as they are)."""
    return t.numpy() if t.dtype in (torch.float32, torch.int8) else \
        t.view(torch.uint16).numpy()
