"""f32 matrix products on AVX-512F over weights packed once (`ferrobatch-kernels`'
`f32_linear`): `x @ W.T + b`, each output a plain f32 sum in input order. Unlike oneDNN's
and MKL's products, a row's result never depends on how many rows share the call or on the
thread count (columns, not sums, are split between threads), and at a lean layer's sizes it
is level with oneDNN's packed fp32 product on one thread and splits better over two
(`benches/f32_linear.py`).

`pack` lays a weight out once; `linear` runs the product; `torch_linear` is the reference
it is tested against. A bf16 or fp16 weight is packed as it is stored (half the bytes of an
fp32 copy) and widened exactly to fp32 in registers inside the product, which then runs the
same fp32 multiply-adds in the same order: its outputs are bit for bit those of the weight
widened to fp32 and packed, at any rows or threads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ferrobatch import _core
from ferrobatch.cpu.arrays import numpy_view as _np
from ferrobatch.cpu.pages import weight_empty

__all__ = ["F32Weight", "available", "linear", "pack", "pack_bf16_exact", "torch_linear",
           "unpack"]

#: products of at least this many multiply-adds split their columns over torch's threads
#: (at a few rows they are bound by the weights' bytes, which two cores read faster than
#: one; the one-call layer's `SPLIT_MACS_F32` is the same)
SPLIT_MACS = 1 << 18


@functools.cache
def available() -> bool:
    """Whether `linear` runs here (AVX-512F, and a build of `ferrobatch._core` that has it)."""
    return bool(getattr(_core, "f32_linear_available", lambda: False)())


#: weight dtypes packed as they are stored (`_core.f32_pack_half`), by their kernel name
HALF_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class F32Weight:
    """An `nn.Linear` weight [n, k] packed for `linear` (fp32, or bf16 / fp16 as stored:
    `packed.dtype`), with its fp32 bias."""

    packed: torch.Tensor  # `_core.f32_packed_len(n, k)` elements: float32, bfloat16 or float16
    bias: torch.Tensor | None  # float32 [n]
    n: int
    k: int

    @property
    def dtype(self) -> torch.dtype:
        """The stored weights' dtype (the product is fp32 whatever it is)."""
        return self.packed.dtype

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> F32Weight:
    """`weight` ([n, k], CPU) packed once for `linear`: bf16 / fp16 as stored (widened in the
    product; `pack(weight.float())` gives the same outputs at twice the bytes), other
    floating dtypes as fp32; `bias` kept as fp32."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D floating-point tensor, not {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach()
    b = None if bias is None else bias.detach().float().contiguous()
    if w.dtype in HALF_DTYPES:
        packed = weight_empty(_core.f32_packed_len(n, k), w.dtype)
        _core.f32_pack_half(_np(w.contiguous()), _np(packed), dtype=HALF_DTYPES[w.dtype])
        return F32Weight(packed, b, int(n), int(k))
    packed = weight_empty(_core.f32_packed_len(n, k), torch.float32)
    _core.f32_pack(w.float().contiguous().numpy(), packed.numpy())
    return F32Weight(packed, b, int(n), int(k))


def pack_bf16_exact(weight: torch.Tensor, bias: torch.Tensor | None = None) -> F32Weight | None:
    """An fp32 `weight` ([n, k], CPU) whose every value is a bf16 one (a bf16 checkpoint
    read in fp32) packed for `linear` as bf16: the outputs of `pack(weight)` at half the
    bytes. None where a value is not a bf16 one."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"weight must be a 2-D float32 tensor, not {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    packed = weight_empty(_core.f32_packed_len(n, k), torch.bfloat16)
    if not _core.f32_pack_bf16_exact(weight.detach().contiguous().numpy(), _np(packed)):
        return None
    b = None if bias is None else bias.detach().float().contiguous()
    return F32Weight(packed, b, int(n), int(k))


def unpack(w: F32Weight) -> torch.Tensor:
    """The weight [n, k] a half-precision `w` was packed from, in its stored dtype, bit for
    bit (for `pack_bf16_exact`: the fp32 weight's bf16 values). `ValueError` for an fp32
    pack."""
    half = HALF_DTYPES.get(w.packed.dtype)
    if half is None:
        raise ValueError(f"unpack takes a bfloat16 or float16 pack, not {w.packed.dtype}")
    weight = torch.empty(w.n, w.k, dtype=w.packed.dtype)
    _core.f32_unpack_half(_np(w.packed), _np(weight), dtype=half)
    return weight


def linear(x: torch.Tensor, w: F32Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + b` in fp32, `x` [T, k] (widened to fp32 first if it is not), into `out`
    ([T, n] fp32, contiguous) when given."""
    x = x.float().contiguous() if x.dtype != torch.float32 else x.contiguous()
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, w.n, dtype=torch.float32)
    threads = torch.get_num_threads() if rows * w.n * w.k >= SPLIT_MACS else 1
    bias = None if w.bias is None else w.bias.numpy()
    half = HALF_DTYPES.get(w.packed.dtype)
    if half is None:
        _core.f32_linear(_np(x), _np(w.packed), _np(out), n=w.n, k=w.k, bias=bias,
                         threads=threads)
    else:
        _core.f32_linear_half(_np(x), _np(w.packed), _np(out), n=w.n, k=w.k, dtype=half,
                              bias=bias, threads=threads)
    return out


def torch_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of `linear`: the fp32 product of the widened weight."""
    y = x.float() @ weight.float().t()
    return y + bias.float() if bias is not None else y
