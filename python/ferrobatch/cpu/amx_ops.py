"""bf16 matrix products with fp32 outputs on the CPU's AMX tiles, or with AVX-512 BF16
where it has no AMX (`ferrobatch-kernels`' `amx` and `dpbf16` modules): `bf16(x) @ W.T + b`,
the bf16 products summed in fp32 and not rounded afterwards. oneDNN's packed linears, as
torch exposes them, round every output to bf16; inside a lean decoder layer that rounding
(of q/k/v, gate/up and the residual writers) is most of a bf16 model's distance from its
fp32 computation.

`pack` lays a weight out once (the same layout for both backends); `linear` runs the
product; `torch_linear` is the reference it is tested against. Which calls are worth
sending here (row counts per backend and thread count) is decided by
`ferrobatch.runner.linear_policy`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ferrobatch import _core
from ferrobatch.cpu.arrays import numpy_view as _np
from ferrobatch.cpu.pages import weight_empty

__all__ = ["AmxWeight", "available", "backend", "linear", "pack", "torch_linear"]


@functools.cache
def backend() -> str:
    """Which instructions run `linear` here: "amx", "avx512_bf16", or "none" (the CPU has
    neither, or this build of `ferrobatch._core` lacks the products); detected once."""
    return str(_core.amx_backend()) if hasattr(_core, "amx_backend") else "none"


def available() -> bool:
    """Whether `linear` runs here (on either backend)."""
    return backend() != "none"


@dataclass(frozen=True)
class AmxWeight:
    """A bf16 `nn.Linear` weight [n, k] packed for the tiles, with its bias in fp32."""

    packed: torch.Tensor  # int16 storage of the packed bf16 bits
    bias: torch.Tensor | None  # fp32 [n]
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * 2


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> AmxWeight:
    """`weight` (bf16 [n, k], CPU) packed once for `linear`; `bias` kept as fp32."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D bfloat16 tensor, not {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    packed = weight_empty(_core.amx_packed_len(n, k), torch.int16)
    _core.amx_pack(_np(weight.detach().contiguous()), _np(packed))
    b = None if bias is None else bias.detach().float().contiguous()
    return AmxWeight(packed, b, int(n), int(k))


def linear(x: torch.Tensor, w: AmxWeight) -> torch.Tensor:
    """`bf16(x) @ W.T + b` in fp32, `x` [T, k] (fp32 rounded to bf16 here; other dtypes
    converted to bf16 first)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.to(torch.bfloat16)
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    threads = torch.get_num_threads() if x.shape[0] * w.n * w.k >= 1 << 20 else 1
    _core.amx_linear(_np(x), _np(w.packed), _np(out),
                     x_dtype="float32" if x.dtype == torch.float32 else "bfloat16",
                     n=w.n, k=w.k, bias=None if w.bias is None else w.bias.numpy(),
                     threads=threads)
    return out


def torch_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of `linear`: fp32 product of bf16-rounded `x` with the bf16 weight."""
    y = x.to(torch.bfloat16).float() @ weight.float().t()
    return y + bias.float() if bias is not None else y
