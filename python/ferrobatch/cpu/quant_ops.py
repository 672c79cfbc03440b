"""Products with GGUF quantized weights (`ferrobatch-kernels`' `quant`): Q8_0, Q4_0, Q4_1,
Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, Q3_K, Q2_K, IQ4_XS and MXFP4, the types of the `Q4_K_M`,
`Q5_K_M`, `Q3_K_M`, `Q2_K`, `IQ4_XS` and gpt-oss `MXFP4_MOE` files (Q5_0 / Q5_1 / IQ4_NL where
a matrix's width is not whole 256-weight blocks) and of quantize-on-load Q8_0.

`pack` lays the GGUF rows of a weight [n, k] (as `gguf.GGUFReader` gives them: uint8,
`k / block` blocks a row) out once into panels of 16 rows; `linear` computes `x @ W.T` in
f32: each row of `x` is quantized to int8 blocks (a scale per 32 or 256 inputs), every
block's product is an exact integer sum (AVX-512 VNNI `vpdpbusd`, AVX2 `vpmaddubsw`, or
the portable path: all give the same bits), and block sums are added in k order. A row's
result depends on nothing but the row (not on the call's row count, the threads, nor the
backend).
`dequantize` is `gguf.quants.dequantize`'s f32, bit for bit (the reference, and embedding
lookups). `quantize` makes K-type GGUF rows from float weights (quantize-on-load; gguf-py
has no K-type quantizer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from ferrobatch import _core
from ferrobatch.cpu.pages import weight_empty

__all__ = ["QTYPES", "QUANTIZERS", "PackedWeight", "backend", "dequantize", "linear", "pack",
           "qtype_name", "quantize"]

#: the types the products take, by their lower-case `GGMLQuantizationType` names
QTYPES = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl", "q3_k",
          "q2_k", "iq4_xs", "mxfp4")

#: the types `quantize` makes
QUANTIZERS = tuple(_core.quant_quantize_types())

#: bytes a 256-weight block of the K-types
_K_BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}

#: products of at least this many multiply-adds split their output panels over torch's
#: threads (below it, waking a second thread costs more than it saves)
SPLIT_MACS = 1 << 18


def qtype_name(qtype: object) -> str:
    """`qtype` (a name such as "q4_k" / "Q4_K", or a `gguf.GGMLQuantizationType`) as the
    lower-case name the kernels take."""
    name = getattr(qtype, "name", qtype)
    if not isinstance(name, str) or name.lower() not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, not {qtype!r}")
    return name.lower()


@functools.cache
def backend() -> str:
    """The backend `linear` runs by default: "amx_int8" where the CPU has AMX-INT8 and
    AVX-512 VNNI, else "avx512vnni" where it has that, else "avx2" where it has that, else
    "portable" (the environment variable `FERROBATCH_QUANT_BACKEND` picks one that runs)."""

    return str(_core.quant_backend())


def backend_available(name: str) -> bool:
    """Whether this CPU runs the backend `name` ("portable" always does)."""

    return bool(_core.quant_backend_available(name))


@dataclass(frozen=True)
class PackedWeight:
    """A GGUF quantized weight [n, k] packed for `linear`."""

    qtype: str  # "q8_0", "q4_k", ...
    n: int
    k: int
    packed: torch.Tensor  # uint8, `_core.quant_packed_len(qtype, n, k)` bytes
    # (`packed` as numpy, made once: a decode step calls `linear` per weight)
    _array: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_array", self.packed.numpy())

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def _blocks(blocks: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(blocks, torch.Tensor):
        if blocks.dtype != torch.uint8:
            raise ValueError(f"blocks must be uint8, not {blocks.dtype}")
        blocks = blocks.detach().cpu().contiguous().numpy()
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8:
        raise ValueError("blocks must be a uint8 numpy array or tensor of GGUF blocks")
    return np.ascontiguousarray(blocks)


def dequantize(qtype: object, blocks: np.ndarray | torch.Tensor, n: int, k: int) -> np.ndarray:
    """The GGUF rows `blocks` (uint8, `n * k / block` blocks of `qtype`) as float32 [n, k],
    bit for bit `gguf.quants.dequantize`."""

    out = np.empty((n, k), dtype=np.float32)
    _core.quant_dequantize(qtype_name(qtype), _blocks(blocks), out, n=n, k=k)
    return out


def pack(qtype: object, blocks: np.ndarray | torch.Tensor, n: int, k: int) -> PackedWeight:
    """The GGUF rows `blocks` (uint8, `n * k / block` blocks of `qtype`) packed once for
    `linear`. The packed bytes are as many as the GGUF rows (Q4_K and Q5_K: 2.8% and 2.3%
    more), `n` padded to a multiple of 16. From a `gguf.GGUFReader` tensor `t` (whose
    `shape` is [k, n], GGUF's order): `pack(t.tensor_type, t.data, t.shape[1], t.shape[0])`."""

    name = qtype_name(qtype)
    packed = weight_empty(_core.quant_packed_len(name, n, k), torch.uint8)
    _core.quant_pack(name, _blocks(blocks), packed.numpy(), n=n, k=k,
                     threads=torch.get_num_threads())
    return PackedWeight(name, int(n), int(k), packed)


def linear(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None = None,
           backend: str | None = None) -> torch.Tensor:
    """`x @ W.T` in f32, `x` [m, k] (widened to f32 first if it is not), `weight` a
    `pack`ed W [n, k], into `out` ([m, n] f32, contiguous) when given; `backend`
    "portable", "avx2", "avx512vnni" or "amx_int8" (None: `backend()`)."""

    if not isinstance(weight, PackedWeight):
        raise ValueError(f"weight must be a PackedWeight (quant_ops.pack), not {type(weight)}")
    x = x.float().contiguous() if x.dtype != torch.float32 else x.contiguous()
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [m, k], not shape {tuple(x.shape)}")
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, weight.n, dtype=torch.float32)
    threads = torch.get_num_threads() if rows * weight.n * weight.k >= SPLIT_MACS else 1
    _core.quant_linear(weight.qtype, x.numpy(), weight._array, out.numpy(),
                       n=weight.n, k=weight.k, threads=threads, backend=backend)
    return out


def quantize(w: torch.Tensor, qtype: object) -> torch.Tensor:
    """The float matrix `w` [n, k] (`k` a multiple of 256; widened to float32) as the GGUF
    rows of the K-type `qtype` (uint8 [n, k / 256 * block bytes]), rows split over torch's
    threads. `FieldError` on "w" naming the row for a NaN, infinite or too large weight."""

    name = qtype_name(qtype)
    if name not in QUANTIZERS:
        raise ValueError(f"qtype must be one of {QUANTIZERS} to quantize, not {qtype!r}")
    w = w.detach().to("cpu", torch.float32).contiguous()
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [n, k], not shape {tuple(w.shape)}")
    n, k = w.shape
    out = torch.empty(n, k // 256 * _K_BLOCK_BYTES[name], dtype=torch.uint8)
    _core.quant_quantize(name, w.numpy(), out.numpy(), threads=torch.get_num_threads())
    return out
