"""fp32 linear weights held only as the bf16 panels their products read.

A bf16 checkpoint run in fp32 (the CPU default, the exact mode) has fp32 weights that are
all bf16 values, and `PackedLinears` packs each for `f32_ops` as bf16 (`FP32_IN_BF16`):
its products never read the fp32 weight again, yet the model kept it, twice the panels'
bytes. A `PanelWeight` takes its place in the module: a tensor of the weight's shape and
dtype (fp32) with no elements of its own, which rebuilds the fp32 weight from the panels
for any operation that reads it (exact: the panels hold the weight's bf16 values, and
widening is exact). The packed products never do; what still may (a forward of the model
on a thread outside ferrobatch's steps, `state_dict()`, a user's own code) gets the same
values, more slowly. Writing to one in place is refused with an error that says why.

Only an engine that loaded the model itself does this (`Engine(path)`); a model the caller
passed in is never changed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from ferrobatch.cpu import f32_ops

__all__ = ["PanelWeight", "WRITE_REFUSED"]

#: the error of an in-place write to a `PanelWeight`
WRITE_REFUSED = (
    "this linear weight is held only as ferrobatch's packed bf16 panels (an fp32 run of a "
    "bf16 checkpoint loaded by the engine) and cannot be written in place; load the model "
    "yourself and pass it to Engine to keep writable fp32 weights")


class PanelWeight(torch.Tensor):
    """Rows `start:stop` of the fp32 weight packed in `panels` (an `f32_ops` bf16 pack,
    one layer's or a stacked group's), as a [stop - start, k] fp32 tensor that holds no
    elements: each operation on it runs on the weight rebuilt from the panels."""

    panels: f32_ops.F32Weight
    start: int
    stop: int

    @staticmethod
    def __new__(cls, panels: f32_ops.F32Weight, start: int, stop: int) -> PanelWeight:
        if panels.dtype != torch.bfloat16 or not 0 <= start < stop <= panels.n:
            raise ValueError(f"PanelWeight takes rows of a bf16 pack, not {panels.dtype} "
                             f"rows {start}:{stop} of {panels.n}")
        t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, (stop - start, panels.k), dtype=torch.float32, device="cpu",
            requires_grad=False)
        t.panels, t.start, t.stop = panels, start, stop
        return t

    # results are plain tensors, never wrapped again
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def dense(self) -> torch.Tensor:
        """The fp32 weight, rebuilt (a new tensor each call)."""
        return f32_ops.unpack(self.panels)[self.start:self.stop].float()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002 - torch's hook
        return f"PanelWeight(shape={tuple(self.shape)}, dtype=torch.float32, bf16 panels)"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _writes_to_panels(func, args, kwargs):
            raise RuntimeError(f"{func.__name__}: {WRITE_REFUSED}")

        def dense(a: Any) -> Any:
            return a.dense() if isinstance(a, PanelWeight) else a

        return func(*tree_map(dense, args), **tree_map(dense, kwargs))


def _writes_to_panels(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether `func` writes to one of its `PanelWeight` arguments (its schema marks the
    argument written: in-place ops, `out=`)."""
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if isinstance(value, PanelWeight) or (
                isinstance(value, list | tuple) and any(isinstance(v, PanelWeight) for v in value)):
            return True
    return False
