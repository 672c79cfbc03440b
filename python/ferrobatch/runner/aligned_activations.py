"""Batch-invariant mode's guard for the activation functions of a model's own forward.

torch runs an elementwise function (SiLU, GELU, tanh, ...) over a contiguous tensor as one
flat array: a vectorized loop, then a scalar loop for the last elements, and the two compute
`exp` / `tanh` differently (within an ulp or two). Where a row's width is not a multiple of
the vector loop's, which of a row's elements fall in the scalar tail depends on how many
rows the step holds, so a row's activations, and everything after them, depend on its
batch. Inside ferrobatch forwards in batch-invariant mode, `aligned` runs each activation
module of such a width over its input padded with zeros to a multiple of `ALIGN` columns
and drops the padding: every element then takes the vector loop at the same column
whatever the rows (at 1 or 2 threads, where torch's halves of the array split at a whole
row count's multiple of `ALIGN`). Widths already aligned (those of real models) run as they
are. The lean decoder layers compute their activations in the kernel crate, row by row, and
need none of this; it is for the layers that run their own forward (a model the lean layers
do not take, a quantized model with float layers beside the quantized ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import activations as hf_activations

__all__ = ["ALIGN", "activation_modules", "aligned"]

#: the padded width's multiple (four AVX-512 vectors of fp32)
ALIGN = 64

#: torch's own activation modules (transformers' are `hf_activations.ACT2CLS`'s classes)
_TORCH_ACTIVATIONS = (torch.nn.SiLU, torch.nn.GELU, torch.nn.Tanh, torch.nn.Sigmoid,
                      torch.nn.Mish, torch.nn.Softplus, torch.nn.ELU, torch.nn.SELU,
                      torch.nn.CELU, torch.nn.Hardswish, torch.nn.LogSigmoid)


def _activation_classes() -> tuple[type, ...]:
    found = []
    for value in hf_activations.ACT2CLS.values():
        cls = value[0] if isinstance(value, tuple) else value
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            found.append(cls)
    return tuple(found) + _TORCH_ACTIVATIONS


def activation_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The activation modules of `model` (transformers' `ACT2CLS` classes and torch's),
    except those whose `forward` is already an instance attribute (hooks)."""
    classes = _activation_classes()
    return [m for m in model.modules()
            if isinstance(m, classes) and "forward" not in m.__dict__]


def _padded(module: torch.nn.Module, in_thread: Callable[[], bool]) -> Callable[..., Any]:
    own = type(module).forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        width = x.shape[-1] if x.dim() else 0
        if (args or kwargs or not in_thread() or not x.is_floating_point()
                or x.device.type != "cpu" or width % ALIGN == 0):
            return own(module, x, *args, **kwargs)
        y = own(module, F.pad(x, (0, (-width) % ALIGN)))
        return y[..., :width].contiguous()

    return forward


@contextmanager
def aligned(modules: list[torch.nn.Module], in_thread: Callable[[], bool]) -> Iterator[None]:
    """Inside the block, `modules` (`activation_modules`) run over padded rows in the
    threads where `in_thread()` (ferrobatch forwards); their own `forward` is back on
    exit."""
    patched = []
    try:
        for m in modules:
            m.__dict__["forward"] = _padded(m, in_thread)
            patched.append(m)
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
