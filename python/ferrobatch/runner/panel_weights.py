"""fp32 linear weights held only as the bf16 panels their products read.

A bf16 checkpoint run in fp32 (the CPU default, the exact mode) has fp32 weights that are
all bf16 values, and `PackedLinears` packs each for `f32_ops` as bf16 (`FP32_IN_BF16`):
its products never read the fp32 weight again, yet the model kept it, twice the panels'
bytes. A `PanelWeight` takes its place in the module: a tensor of the weight's shape and
dtype (fp32) with no elements of its own, which rebuilds the fp32 weight from the panels
for any operation that reads it (exact: the panels hold the weight's bf16 values, and
widening is exact). The packed products never do; what still may (a forward of the model
on a thread outside ferrobatch's steps, `state_dict()`, a user's own code) gets the same
values, more slowly. Writing to one in place (directly or through `.data`), converting it
(`model.to(torch.bfloat16)`) or moving it to shared memory is refused with an error that
says why, before the model is changed; `detach()` and `copy.deepcopy` give plain fp32
tensors.

The input embedding's fp32 weight, all bf16 values too, becomes a `NarrowWeight`: held as
bf16 (half the bytes), its lookups gather bf16 rows and widen them (exact), any other read
widens it whole. A head tied to it reads it only through its panels.

Only an engine that loaded the model itself does this (`Engine(path)`); a model the caller
passed in is never changed. Where it can, the engine reads such a checkpoint in bf16 and
holds its matrices so from the start (`hold_narrow_read`): no fp32 copy of them is ever
made.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from ferrobatch.cpu import f32_ops, pages

__all__ = ["HeldWeight", "NarrowWeight", "PanelWeight", "WRITE_REFUSED", "bf16_exact",
           "guard_conversions", "hold_narrow_read", "narrow_embedding"]

#: the error of a write to a `HeldWeight`
WRITE_REFUSED = (
    "this weight is held in bf16 by ferrobatch (an fp32 run of a bf16 checkpoint loaded by "
    "the engine) and cannot be written or converted in place; load the model yourself and "
    "pass it to Engine to keep writable fp32 weights")

_aten = torch.ops.aten
#: row gathers a `NarrowWeight` runs on its bf16 rows (the weight their first argument)
_GATHERS = (_aten.embedding.default, _aten.index_select.default, _aten.index.Tensor)


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of the fp32 tensor `w` is a bf16 value (its low 16 bits zero),
    so that widening `w.bfloat16()` gives `w` back bit for bit (a weight held in bf16 by
    construction, `HeldWeight`, is)."""
    if w.dtype != torch.float32 or w.numel() == 0:
        return False
    if isinstance(w, HeldWeight):
        return True
    return not bool((w.detach().contiguous().view(torch.int32) & 0xFFFF).any())


class HeldWeight(torch.Tensor):
    """An fp32 weight of bf16 values held in another form (subclasses: `PanelWeight`,
    `NarrowWeight`) as a tensor that holds no fp32 elements: an operation on it runs on the
    weight rebuilt (`dense`), or on its stored form where the subclass can (`direct`);
    in-place writes are refused."""

    @staticmethod
    def _wrap(cls: type, shape: tuple[int, ...]) -> Any:
        with torch.inference_mode(False):  # (a weight keeps a version counter)
            t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
                cls, shape, dtype=torch.float32, device="cpu", requires_grad=False)
        t._is_param = True  # `isinstance(t, nn.Parameter)`, as the weight it replaces
        return t

    def _alias(self) -> HeldWeight:
        """Another wrapper of the same stored form (`.data`)."""
        raise NotImplementedError

    @property  # type: ignore[override]
    def data(self) -> HeldWeight:
        """A wrapper of the same stored form: writes through it are refused too."""
        return self._alias()

    @data.setter
    def data(self, value: Any) -> None:  # (`Module._apply`'s conversions, weight loading)
        if value is not self:  # (`_apply` sets a weight its function returned unchanged)
            raise RuntimeError(f"set data: {WRITE_REFUSED}")

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """A plain fp32 parameter of the same values (a copy is the caller's to change)."""
        got = memo.get(id(self))
        if got is None:
            got = memo[id(self)] = nn.Parameter(_detached(self.dense), requires_grad=False)
        return got

    def share_memory_(self) -> HeldWeight:
        """Refused: the kernels read the stored form where it lies (moving it would free
        the memory they read)."""
        raise RuntimeError(f"share_memory_: {WRITE_REFUSED}")

    def numpy(self, *, force: bool = False) -> Any:  # noqa: ARG002 - torch's signature
        """The rebuilt weight as a numpy array (a copy: writes to it are not the weight's)."""
        return self.dense().numpy()

    def tolist(self) -> Any:
        return self.dense().tolist()

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

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        """`F.linear(x, weight, bias)` runs on the panels (`f32_ops`: the product the
        engine's steps run, not the weight rebuilt for torch's); anything else as any
        held weight (results plain tensors)."""
        kwargs = kwargs or {}
        if func is F.linear:
            named = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            got = _panel_linear(named.get("input"), named.get("weight"), named.get("bias"))
            if got is not None:
                return got
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _alias(self) -> PanelWeight:
        return PanelWeight(self.panels, self.start, self.stop)


class NarrowWeight(HeldWeight):
    """An fp32 weight whose every value is a bf16 one, held as that bf16 tensor (`bf16`): a
    row gather (an embedding lookup, `index_select`, indexing by a tensor) runs on the bf16
    rows and widens them; any other operation runs on the weight widened whole. Both exact.
    """

    bf16: torch.Tensor

    @staticmethod
    def __new__(cls, bf16: torch.Tensor) -> NarrowWeight:
        if bf16.dtype != torch.bfloat16 or bf16.device.type != "cpu":
            raise ValueError(f"NarrowWeight holds a CPU bfloat16 tensor, not {bf16.dtype} on "
                             f"{bf16.device}")
        t = HeldWeight._wrap(cls, tuple(bf16.shape))
        t.bf16 = bf16
        return t

    def dense(self) -> torch.Tensor:
        return self.bf16.float()

    def _alias(self) -> NarrowWeight:
        return NarrowWeight(self.bf16)

    def direct(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _GATHERS and not any(isinstance(a, HeldWeight) for a in args[1:]):
            return func(self.bf16, *args[1:], **kwargs).float()
        return None


def _panel_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x @ weight.T + bias` on `weight`'s panels, or None where they don't serve: not a
    `PanelWeight`, another input dtype or device, autograd wanted."""
    if not isinstance(weight, PanelWeight) or not isinstance(x, torch.Tensor) \
            or isinstance(x, HeldWeight) \
            or isinstance(bias, HeldWeight) or x.dtype != torch.float32 \
            or x.device.type != "cpu" or (torch.is_grad_enabled() and (
                x.requires_grad or (bias is not None and bias.requires_grad))):
        return None
    rows = x.reshape(-1, x.shape[-1])
    panels = weight.panels  # (a stacked pack holds its group's biases: not these rows')
    y = f32_ops.linear(rows, f32_ops.F32Weight(panels.packed, None, panels.n, panels.k))
    if weight.start or weight.stop != weight.panels.n:
        y = y[:, weight.start:weight.stop]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


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


def narrow_embedding(model: nn.Module, reads_panels: Callable[[nn.Module], bool],
                     kept: Callable[[torch.Tensor], bool] = lambda w: False) -> int:
    """Hold `model`'s input embedding weight as a `NarrowWeight` where it is an fp32 CPU
    weight of bf16 values, the output head is a linear layer, every other module that
    registers the weight is one whose products read only their panels (`reads_panels`: a
    head tied to it), and nothing else holds it (`kept`: the greedy head's screen of a
    tied head). Returns the bytes let go."""
    emb = _narrowable_embedding(model)
    if emb is None:
        return 0
    w = emb.weight
    if type(w) is not nn.Parameter or w.device.type != "cpu" or not bf16_exact(w):
        return 0
    if kept(w):
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
    return w.numel() * w.element_size() - narrow.bf16.numel() * 2


def _narrowable_embedding(model: nn.Module) -> nn.Embedding | None:
    """`model`'s input embedding where it is an `nn.Embedding` and the output head a linear
    layer (a head that is no linear layer may multiply by the embedding itself), else
    None."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return emb if isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear) else None


def guard_conversions(model: nn.Module) -> None:
    """Make a conversion of `model` (`model.to(torch.bfloat16)`, `.half()`, `.cuda()`) that
    would change a held weight fail before it changes anything (torch converts parameter
    by parameter: a refusal midway would leave a model of mixed dtypes behind). Those that
    leave the held weights as they are (`.float()`, `.cpu()`) run."""
    model._apply = types.MethodType(_apply, model)  # type: ignore[method-assign]


def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
           recurse: bool = True) -> nn.Module:
    """`Module._apply` after checking that `fn` leaves every held weight as it is."""
    for p in self.parameters():
        if isinstance(p, HeldWeight) and fn(p) is not p:
            raise RuntimeError(f"converting the model: {WRITE_REFUSED}")
    return type(self)._apply(self, fn, recurse)


def hold_narrow_read(model: nn.Module, wide: dict[str, torch.dtype]) -> None:
    """`model`, read in bf16 from a bf16 checkpoint, made the model an fp32 read gives
    (`wide`: each tensor's dtype there, by name; fp32 for names it lacks) with its matrices
    kept at their bf16 bytes: each `nn.Linear` weight a `PanelWeight` over its own `f32_ops`
    panels, the input embedding (and a head tied to it) a `NarrowWeight` where the head is
    a linear layer, every other tensor converted as `wide` says; all of them copies, none a
    view of the checkpoint's files."""
    emb = _narrowable_embedding(model)
    emb_w = None if emb is None else emb.weight
    done: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            new = done.get(id(p))
            if new is None:
                to = wide.get(f"{prefix}.{name}" if prefix else name, torch.float32)
                # (copies throughout: nothing may stay a view of the checkpoint's files,
                # which someone may overwrite while the engine serves)
                if p.dtype != torch.bfloat16 or to != torch.float32:
                    new = nn.Parameter(p.detach().to(to, copy=True), False)
                elif p is emb_w:
                    new = NarrowWeight(p.detach().clone())
                elif type(module) is nn.Linear and name == "weight" and p.dim() == 2:
                    new = PanelWeight(f32_ops.pack(p.detach()), 0, p.shape[0])
                    pages.release([p], anonymous=False)  # (its file pages, read once)
                else:
                    new = nn.Parameter(p.detach().float(), requires_grad=False)
                done[id(p)] = new
            module._parameters[name] = new
        for name, b in list(module._buffers.items()):
            if b is not None:
                to = wide.get(f"{prefix}.{name}" if prefix else name,
                              torch.float32 if b.is_floating_point() else b.dtype)
                module._buffers[name] = b.to(to, copy=True)
    model.config.dtype = torch.float32
