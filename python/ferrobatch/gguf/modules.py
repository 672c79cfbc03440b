"""`QuantLinear` and `QuantEmbedding`: layers whose weight stays GGUF blocks in memory.

Products run on `ferrobatch.cpu.quant_ops` (the Rust kernels) where that module exists and
its `available()` says so, else on the reference path: the weight dequantized with
`gguf.quants.dequantize` a slice of rows at a time, inside the call (nothing dequantized is
kept), and an fp32 `F.linear`. `set_backend` / `backend()` choose ("auto", "kernel",
"reference"; `FERROBATCH_QUANT_BACKEND` sets the process default) so tests can compare.

The kernel contract (what `QuantLinear` calls; `QuantWeight` is `ferrobatch.gguf.formats`'):

* `quant_ops.available() -> bool` (optional; absent = available);
* `quant_ops.supports(qtype: str) -> bool` (optional; absent = every type of `QUANT_TYPES`);
* `quant_ops.linear(x, weight) -> y`: `x` fp32 C-contiguous [m, k] CPU, `weight` a
  `QuantWeight`; returns fp32 [m, n] = `x @ dequantize(weight).T` (no bias: added here);
* `quant_ops.dequantize(weight) -> w`: fp32 [n, k] (the embedding's looked-up rows).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrobatch.gguf.formats import QuantWeight, dequantize_reference

__all__ = ["BACKENDS", "QuantEmbedding", "QuantLinear", "backend", "get_backend",
           "kernel_ops", "quant_dequantize", "quant_linear", "set_backend"]

logger = logging.getLogger("ferrobatch")

BACKENDS = ("auto", "kernel", "reference")
#: the reference path dequantizes at most this many fp32 weights at once (32 MiB)
REFERENCE_CHUNK = 8 << 20

_backend = os.environ.get("FERROBATCH_QUANT_BACKEND", "auto")
if _backend not in BACKENDS:
    logger.warning("ferrobatch: FERROBATCH_QUANT_BACKEND=%r is not one of %s; using 'auto'",
                   _backend, ", ".join(BACKENDS))
    _backend = "auto"


def get_backend() -> str:
    return _backend


def set_backend(name: str) -> str:
    """Set the process-wide backend of quantized products ("auto": the kernels where they
    run, else the reference; "kernel": the kernels or an error; "reference": always the
    reference path). Returns the previous one."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    previous, _backend = _backend, name
    return previous


@contextmanager
def backend(name: str) -> Iterator[None]:
    """`set_backend(name)` for the block, then the previous backend again."""
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


@functools.cache
def kernel_ops() -> ModuleType | None:
    """`ferrobatch.cpu.quant_ops` when it exists, has `linear` and `dequantize`, and says it
    is available; else None (checked once)."""
    try:
        from ferrobatch.cpu import quant_ops  # type: ignore[attr-defined]
    except ImportError:
        return None
    if not (callable(getattr(quant_ops, "linear", None))
            and callable(getattr(quant_ops, "dequantize", None))):
        return None
    available = getattr(quant_ops, "available", None)
    try:
        if callable(available) and not available():
            return None
    except Exception as exc:  # noqa: BLE001 - a kernel build that cannot say: not used
        logger.info("ferrobatch: quant_ops.available() failed (%s); reference path", exc)
        return None
    return quant_ops


def _kernel_for(qtype: str) -> ModuleType | None:
    """The kernels' module for a product of `qtype` under the current backend, or None for
    the reference path."""
    if _backend == "reference":
        return None
    ops = kernel_ops()
    supports = getattr(ops, "supports", None) if ops is not None else None
    if ops is not None and (supports is None or supports(qtype)):
        return ops
    if _backend == "kernel":
        raise RuntimeError(f"quantized backend 'kernel' asked for, but ferrobatch.cpu.quant_ops "
                           f"{'does not run ' + qtype if ops is not None else 'is not available'}")
    return None


def quant_linear(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """fp32 `x` [m, k] @ `weight`.T -> fp32 [m, n] (the kernels or the reference path)."""
    ops = _kernel_for(weight.qtype)
    if ops is not None:
        return ops.linear(x, weight)
    if weight.n * weight.k <= REFERENCE_CHUNK:
        return F.linear(x, dequantize_reference(weight))
    out = torch.empty(x.shape[0], weight.n, dtype=torch.float32)
    step = max(1, REFERENCE_CHUNK // weight.k)
    for start in range(0, weight.n, step):
        stop = min(weight.n, start + step)
        out[:, start:stop] = F.linear(x, dequantize_reference(weight.slice_rows(start, stop)))
    return out


def quant_dequantize(weight: QuantWeight) -> torch.Tensor:
    """`weight` as fp32 [n, k] (the kernels or the reference path)."""
    ops = _kernel_for(weight.qtype)
    return ops.dequantize(weight) if ops is not None else dequantize_reference(weight)


class QuantLinear(nn.Module):
    """`nn.Linear` over a `QuantWeight` (the weight's blocks held as a uint8 buffer `qdata`,
    never dequantized beyond one call). Computes in fp32; returns the input's dtype. `bias`
    is an ordinary parameter (fp32 or the model's dtype)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_q = weight
        self.in_features = weight.k
        self.out_features = weight.n
        self.qtype = weight.qtype
        # a buffer, so `model.to(...)`, `named_buffers()` and memory counts see it; not in
        # the state dict (it is no `nn.Linear` weight)
        self.register_buffer("qdata", weight.data, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qdata is not self.weight_q.data:  # moved or replaced: the weight follows
            self.weight_q = QuantWeight(self.qtype, self.out_features, self.in_features,
                                        self.qdata)
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()
        out = quant_linear(flat, self.weight_q)
        if self.bias is not None:
            out = out + self.bias.to(torch.float32)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype}, bias={self.bias is not None}")


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a `QuantWeight` [vocab, dim]: only the looked-up rows are
    dequantized, to `dtype`. `embed_scale` (Gemma3's scaled embedding) multiplies them as the
    replaced module did (`embed_scale` rounded to `dtype` first)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype = torch.float32,
                 embed_scale: torch.Tensor | float | None = None,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight_q = weight
        self.num_embeddings = weight.n
        self.embedding_dim = weight.k
        self.qtype = weight.qtype
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.register_buffer("qdata", weight.data, persistent=False)
        if embed_scale is not None:
            self.register_buffer("embed_scale", torch.as_tensor(embed_scale), persistent=False)
        else:
            self.embed_scale = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qdata is not self.weight_q.data:
            self.weight_q = QuantWeight(self.qtype, self.num_embeddings, self.embedding_dim,
                                        self.qdata)
        ids = input_ids.reshape(-1)
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = quant_dequantize(self.weight_q.rows(unique))
        out = rows.index_select(0, inverse).reshape(*input_ids.shape, self.embedding_dim)
        out = out.to(self.dtype)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


def quantized_modules(model: nn.Module) -> list[Any]:
    """The `QuantLinear` / `QuantEmbedding` modules of `model`."""
    return [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
