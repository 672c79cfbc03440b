"""The fused CPU elementwise ops of a lean decoder layer (`ferrobatch.runner.lean_layers`),
each one call of the `ferrobatch-kernels` crate: RMSNorm (with the residual add folded in),
SiLU- (or tanh-GELU-) and-multiply, rotary embeddings, and row writes into the paged KV cache.

Every op writes a caller-allocated output and has a torch reference (`torch_*`), used when
the extension lacks the kernel, and by the tests. The kernels compute in fp32 and round
once into the output dtype; where the reference rounds intermediate results to a half
dtype (transformers' bf16 ops do) the kernel is at least as exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrobatch import _core
from ferrobatch.cpu.arrays import KERNEL_DTYPES as _DTYPES
from ferrobatch.cpu.arrays import numpy_view as _np

__all__ = ["available", "handles", "rms_norm", "rope", "silu_mul", "write_rows"]

_KERNELS = ("rms_norm", "silu_mul", "rope", "write_rows")


def available() -> bool:
    """Whether this build of `ferrobatch._core` has the four kernels."""
    return all(hasattr(_core, name) for name in _KERNELS)


def handles(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors (CPU, fp32 / bf16 / fp16)."""
    return all(t.device.type == "cpu" and t.dtype in _DTYPES for t in tensors)


def _threads(work: int) -> int:
    return torch.get_num_threads() if work >= 1 << 16 else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
             weight_offset: float = 0.0, residual: torch.Tensor | None = None) -> None:
    """`out = round(x * rsqrt(mean(x^2) + eps) * (weight + weight_offset))` per row of `x`
    [T, H]; with `residual`, first `x += residual` in place (`x` fp32)."""
    if not hasattr(_core, "rms_norm"):
        return torch_rms_norm(x, weight, out, eps, weight_offset, residual)
    kw = {}
    if residual is not None:
        kw = {"residual": _np(residual), "residual_dtype": _DTYPES[residual.dtype]}
    _core.rms_norm(_np(x), _np(weight), _np(out), x_dtype=_DTYPES[x.dtype],
                   weight_dtype=_DTYPES[weight.dtype], out_dtype=_DTYPES[out.dtype],
                   eps=float(eps), weight_offset=float(weight_offset),
                   threads=_threads(x.numel()), **kw)


#: the gate activations `silu_mul` takes, as transformers' `hidden_act` names them
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor, activation: str = "silu") -> None:
    """`out[t, i] = act(g) * u`, `g, u = gate_up[t, i], gate_up[t, I + i]` ([T, 2I] -> [T, I]);
    `act` SiLU, or with `activation="gelu_pytorch_tanh"` GELU's tanh approximation."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
    if not hasattr(_core, "silu_mul"):
        return torch_silu_mul(gate_up, out, activation)
    _core.silu_mul(_np(gate_up), _np(out), dtype=_DTYPES[gate_up.dtype],
                   out_dtype=_DTYPES[out.dtype], threads=_threads(out.numel()),
                   activation=activation)


def rope(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
         col_offset: int, heads: int, dim: int) -> None:
    """Rotary embedding (rotate-half form) of the `heads` heads of `dim` starting at column
    `col_offset` of `src` [T, W]; cos / sin fp32 [T, rot]: each head's first `rot` columns
    rotated, the rest copied (a rotary embedding over part of each head); `out` [T, heads,
    dim]."""
    if not hasattr(_core, "rope"):
        return torch_rope(src, cos, sin, out, col_offset, heads, dim)
    _core.rope(_np(src), _np(cos), _np(sin), _np(out), src_dtype=_DTYPES[src.dtype],
               out_dtype=_DTYPES[out.dtype], col_offset=int(col_offset), heads=int(heads),
               dim=int(dim), threads=_threads(out.numel()), rot=int(cos.shape[-1]))


def write_rows(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor,
               col_offset: int = 0, width: int | None = None) -> None:
    """`dst[slots[t]] = src[t, col_offset : col_offset + width]` in `dst`'s dtype (`src`
    [T, W], `dst` [S, width], slots int64 [T])."""
    width = dst.shape[1] if width is None else width
    if not hasattr(_core, "write_rows"):
        return torch_write_rows(src, dst, slots, col_offset, width)
    _core.write_rows(_np(src), _np(dst), slots.numpy(), src_dtype=_DTYPES[src.dtype],
                     dst_dtype=_DTYPES[dst.dtype], col_offset=int(col_offset), width=int(width))


# --- torch references ----------------------------------------------------------------------


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                   weight_offset: float = 0.0, residual: torch.Tensor | None = None) -> None:
    if residual is not None:
        x.add_(residual)
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + weight_offset if weight_offset else weight.float()
    out.copy_(h * w)


def torch_silu_mul(gate_up: torch.Tensor, out: torch.Tensor, activation: str = "silu") -> None:
    g, u = gate_up.float().chunk(2, dim=-1)
    act = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")
    out.copy_(act * u)


def torch_rope(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor,
               col_offset: int, heads: int, dim: int) -> None:
    x = src[:, col_offset:col_offset + heads * dim].float().view(-1, heads, dim)
    r = cos.shape[-1]
    x, passed = x[..., :r], x[..., r:]
    half = r // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    out.copy_(torch.cat((x * cos.unsqueeze(1) + rot * sin.unsqueeze(1), passed), dim=-1))


def torch_write_rows(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor,
                     col_offset: int, width: int) -> None:
    dst.index_copy_(0, slots, src[:, col_offset:col_offset + width].to(dst.dtype))
