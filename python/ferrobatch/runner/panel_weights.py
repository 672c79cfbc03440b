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

The input embedding's fp32 weight, all bf16 values too, becomes a `NarrowWeight`: held as
bf16 (half the bytes), its lookups gather bf16 rows and widen them (exact), any other read
widens it whole. A head tied to it reads it only through its panels.

Only an engine that loaded the model itself does this (`Engine(path)`); a model the caller
passed in is never changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ferrobatch.cpu import f32_ops

__all__ = ["HeldWeight", "NarrowWeight", "PanelWeight", "WRITE_REFUSED", "narrow_embedding"]

#: the error of an in-place write to a `PanelWeight`
WRITE_REFUSED = (
    "this linear weight is held only as ferrobatch's packed bf16 panels (an fp32 run of a "
    "bf16 checkpoint loaded by the engine) and cannot be written in place; load the model "
    "yourself and pass it to Engine to keep writable fp32 weights")

_aten = torch.ops.aten
#: row gathers a `NarrowWeight` runs on its bf16 rows (the weight their first argument)
_GATHERS = (_aten.embedding.default, _aten.index_select.default, _aten.index.Tensor)


class HeldWeight(torch.Tensor):
    """An fp32 weight of bf16 values held in another form (subclasses: `PanelWeight`,
    `NarrowWeight`) as a tensor that holds no fp32 elements: an operation on it runs on the
    weight rebuilt (`dense`), or on its stored form where the subclass can (`direct`);
    in-place writes are refused."""

    @staticmethod
    def _wrap(cls: type, shape: tuple[int, ...]) -> Any:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape, dtype=torch.float32, device="cpu", requires_grad=False)

    # results are plain tensors, never wrapped again
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def dense(self) -> torch.Tensor:
        """The fp32 weight, rebuilt (a new tensor each call)."""
        raise NotImplementedError

    def direct(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func`'s result computed on the stored form, or None: rebuild the weight."""
        return None

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002 - torch's hook
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype=torch.float32)"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _writes_to(func, args, kwargs):
            raise RuntimeError(f"{func.__name__}: {WRITE_REFUSED}")
        if func is _aten.detach.default:
            return _detached(args[0].dense)
        if isinstance(args[0], HeldWeight):
            got = args[0].direct(func, args, kwargs)
            if got is not None:
                return got

        def dense(a: Any) -> Any:
            return a.dense() if isinstance(a, HeldWeight) else a

        return func(*tree_map(dense, args), **tree_map(dense, kwargs))


class PanelWeight(HeldWeight):
    """Rows `start:stop` of the fp32 weight packed in `panels` (an `f32_ops` bf16 pack,
    one layer's or a stacked group's), as a [stop - start, k] fp32 tensor: each operation
    on it runs on the weight rebuilt from the panels."""

    panels: f32_ops.F32Weight
    start: int
    stop: int

    @staticmethod
    def __new__(cls, panels: f32_ops.F32Weight, start: int, stop: int) -> PanelWeight:
        if panels.dtype != torch.bfloat16 or not 0 <= start < stop <= panels.n:
            raise ValueError(f"PanelWeight takes rows of a bf16 pack, not {panels.dtype} "
                             f"rows {start}:{stop} of {panels.n}")
        t = HeldWeight._wrap(cls, (stop - start, panels.k))
        t.panels, t.start, t.stop = panels, start, stop
        return t

    def dense(self) -> torch.Tensor:
        return f32_ops.unpack(self.panels)[self.start:self.stop].float()


class NarrowWeight(HeldWeight):
    """An fp32 weight whose every value is a bf16 one, held as that bf16 tensor (`half`): a
    row gather (an embedding lookup, `index_select`, indexing by a tensor) runs on the bf16
    rows and widens them; any other operation runs on the weight widened whole. Both exact.
    """

    half: torch.Tensor

    @staticmethod
    def __new__(cls, half: torch.Tensor) -> NarrowWeight:
        if half.dtype != torch.bfloat16 or half.device.type != "cpu":
            raise ValueError(f"NarrowWeight holds a CPU bfloat16 tensor, not {half.dtype} on "
                             f"{half.device}")
        t = HeldWeight._wrap(cls, tuple(half.shape))
        t.half = half
        return t

    def dense(self) -> torch.Tensor:
        return self.half.float()

    def direct(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _GATHERS and not any(isinstance(a, HeldWeight) for a in args[1:]):
            return func(self.half, *args[1:], **kwargs).float()
        return None


def _detached(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`detach`'s result: the weight rebuilt as a plain tensor (so `state_dict()` and
    `numpy()` see one), made outside inference mode: autograd gives it the input's version
    counter, which an inference tensor cannot take."""
    with torch.inference_mode(False):
        return make()


def _writes_to(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether `func` writes to one of its `HeldWeight` arguments (its schema marks the
    argument written: in-place ops, `out=`)."""
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if isinstance(value, HeldWeight) or (
                isinstance(value, list | tuple) and any(isinstance(v, HeldWeight) for v in value)):
            return True
    return False


def narrow_embedding(model: nn.Module, reads_panels: Callable[[nn.Module], bool]) -> int:
    """Hold `model`'s input embedding weight as a `NarrowWeight` where it is an fp32 CPU
    weight of bf16 values, the output head is a linear layer, and every other module that
    registers the weight is one whose products read only their panels (`reads_panels`: a
    head tied to it). Returns the bytes let go."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(emb, nn.Embedding) or not isinstance(head, nn.Linear):
        return 0  # (a head that is no linear layer may multiply by the embedding itself)
    w = emb.weight
    if type(w) is not nn.Parameter or w.dtype != torch.float32 or w.device.type != "cpu" \
            or w.numel() == 0 or bool((w.detach().view(torch.int32) & 0xFFFF).any()):
        return 0
    owners = [m for m in model.modules()
              if any(p is w for p in m._parameters.values())]
    if any(m is not emb and not reads_panels(m) for m in owners):
        return 0
    narrow = NarrowWeight(w.detach().bfloat16())
    for m in owners:
        for name, p in list(m._parameters.items()):
            if p is w:
                m._parameters[name] = narrow
    return w.numel() * w.element_size() - narrow.half.numel() * 2
