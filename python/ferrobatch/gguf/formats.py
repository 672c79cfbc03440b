"""GGUF tensor types: which ferrobatch keeps quantized, which it reads as floats, and the
`QuantWeight` a quantized matrix is handed to the kernels as.

A quantized GGUF matrix of `n` rows (output features) and `k` columns (input features) is
stored row after row, each row `k / block_size` blocks of `type_size` bytes; blocks run along
the input dimension, so a permutation of the rows is a permutation of whole byte rows (exact).
The value oracle is `gguf.quants.dequantize` (`dequantize_reference` here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

__all__ = ["FLOAT_TYPES", "QUANT_TYPES", "QuantWeight", "block_shape", "dequantize_reference",
           "qtype_name", "row_bytes"]

#: the block-quantized types ferrobatch keeps quantized (the kernels of
#: `ferrobatch.cpu.quant_ops` implement these; the reference path dequantizes any of them).
#: Q5_0, Q5_1 and IQ4_NL are llama.cpp's fallbacks for matrices whose input width is not whole
#: 256-weight blocks (Q4_K -> Q5_0, Q5_K -> Q5_1, the low-bit types -> IQ4_NL); MXFP4 is
#: gpt-oss's experts' type (its products: blocks whose exponent puts every weight under 4e-7
#: count as zero; an exponent above 143, weights of 2^16 and more, is refused when packed)
QUANT_TYPES: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1",
                                "IQ4_NL", "Q3_K", "Q2_K", "IQ4_XS", "MXFP4")
#: plain float types, read as float tensors
FLOAT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")


def qtype_name(ggml_type: int | GGMLQuantizationType) -> str:
    """The GGML type's name ("Q4_K"), or "type <n>" for a number gguf-py does not know."""
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {int(ggml_type)}"


def block_shape(qtype: str) -> tuple[int, int]:
    """(weights a block, bytes a block) of a type named in `QUANT_TYPES` or `FLOAT_TYPES`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of `k` weights; `ValueError` when `k` is not whole blocks."""
    block, size = block_shape(qtype)
    if k % block:
        raise ValueError(f"{qtype} rows hold whole blocks of {block} weights, not {k}")
    return k // block * size


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A block-quantized matrix `W` [n, k] as GGUF stores it, for `y = x @ W.T`.

    `data` is a C-contiguous CPU uint8 tensor [n, row_bytes(qtype, k)]: row `i` holds the
    blocks of output feature `i`, little-endian as in the file (the block layouts of
    ggml's `ggml-common.h`). It may be a view of the memory-mapped file (read, never written)
    or memory of its own; either way nothing else is kept (no dequantized copy).
    """

    qtype: str  # one of QUANT_TYPES
    n: int  # rows: output features (vocabulary rows for an embedding)
    k: int  # columns: input features, a multiple of the type's block size
    data: torch.Tensor  # uint8 [n, row_bytes]

    def __post_init__(self) -> None:
        if self.qtype not in QUANT_TYPES:
            raise ValueError(f"QuantWeight qtype must be one of {', '.join(QUANT_TYPES)}, "
                             f"not {self.qtype!r}")
        want = (self.n, row_bytes(self.qtype, self.k))
        d = self.data
        if d.dtype != torch.uint8 or tuple(d.shape) != want or d.device.type != "cpu" \
                or not d.is_contiguous():
            raise ValueError(f"QuantWeight data must be a contiguous CPU uint8 tensor of shape "
                             f"{want}, not {d.dtype} {tuple(d.shape)} on {d.device}")

    @property
    def ggml_type(self) -> int:
        """The GGML type number (gguf-py's `GGMLQuantizationType`)."""
        return int(GGMLQuantizationType[self.qtype])

    @property
    def block_size(self) -> int:
        return block_shape(self.qtype)[0]

    @property
    def type_size(self) -> int:
        return block_shape(self.qtype)[1]

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows `index` (int64, any shape flattened) as a weight of their own (a copy of
        just those rows' bytes)."""
        data = self.data.index_select(0, index.reshape(-1).to(torch.long))
        return QuantWeight(self.qtype, data.shape[0], self.k, data)

    def slice_rows(self, start: int, stop: int) -> QuantWeight:
        """Rows `start .. stop` (a view)."""
        data = self.data[start:stop]
        return QuantWeight(self.qtype, data.shape[0], self.k, data)


def dequantize_reference(weight: QuantWeight) -> torch.Tensor:
    """`weight` as fp32 [n, k] through `gguf.quants.dequantize` (the oracle)."""

    arr = weight.data.numpy()
    out = dequantize(arr, GGMLQuantizationType[weight.qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(weight.n,
                                                                                 weight.k))
