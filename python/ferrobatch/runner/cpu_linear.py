"""Half-precision linear layers on the CPU's matrix units, weights packed once.

On CPU, `F.linear` with a bf16 (or fp16) weight hands oneDNN the weight in its plain layout,
and oneDNN reorders it into its blocked layout for the AMX / AVX512-BF16 kernels on every
call: at decode batch sizes that reorder costs as much as the product. `PackedLinears`
reorders each `nn.Linear` weight of a model once (`ferrobatch.cpu.onednn.pack`) and, for
the duration of a ferrobatch forward, runs every such layer as one product on the packed
weight, or on the copies `ferrobatch.runner.linear_policy` chooses for that many rows
(`backend`): fp32 copies of half-precision weights, `f32_ops`' and `amx_ops`' layouts.

Layers seen (in one calibration forward) to take the same input one after the other, such as
q/k/v or gate/up projections, form a group: its first member runs one product with the
group's weights stacked, and the others take their slice of it when their input is the same
tensor (else they run alone, unpacked). The slices are views of the product (a second
calibration forward checks the model accepts that; else they are copies). No layer names
are assumed.

Two numerics (`activation_dtype`):

* the model's own dtype: each product is what the model computes (inputs and outputs in the
  weight dtype, fp32 accumulation), only faster;
* `torch.float32` ("half-precision weights, fp32 residual stream", close to how llama.cpp
  runs a BF16 model on CPU): inputs are rounded to the weight dtype for the product, the
  input embeddings are widened to fp32, and so are the outputs of the layers that write to
  the residual stream (those outside a group whose width is the model's hidden size: the
  attention output and MLP down projections), so the residual stream and the norms stay in
  fp32. Grouped outputs (q/k/v, gate/up) stay in the weight dtype: a product's output is
  already rounded to it, widening adds no information, and what follows them (rotary
  embeddings against fp32 tables, the attention, the next product) widens or rounds as it
  needs. Rounding the residual stream to bf16 after every layer is where a bf16 model loses
  much of its agreement with fp32.

The caller's model is never changed: the packed weights live here, each layer's `forward`
is replaced by an instance attribute only inside `active()` (and the replacement runs the
layer's own forward on any other thread), and weights changed in place are packed again.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
import torch.nn.functional as F

from ferrobatch.cpu import amx_ops, f32_ops, onednn, pages
from ferrobatch.cpu.onednn import packing_available
from ferrobatch.errors import FieldError
from ferrobatch.runner import linear_policy as policy
from ferrobatch.runner.linear_policy import Backend
from ferrobatch.runner.panel_weights import PanelWeight, bf16_exact

logger = logging.getLogger("ferrobatch")

__all__ = ["HALF_DTYPES", "PackedLinears", "packing_available"]

HALF_DTYPES = (torch.bfloat16, torch.float16)
# the packed copies may take at most this share of available memory
_MAX_AVAILABLE_SHARE = 0.5
# copies beyond one may take at most this (bf16 products for rows below the probe's fp32
# rows beside the half panels: ~10% faster at one row, on a copy of their own)
_SPEED_COPIES_BYTES = 1 << 30
# `PackedLinears._chosen`'s key of batch-invariant mode's product (no real call has 0 rows)
_INVARIANT_KEY = (0, True, 0)


def _invariant_copies(dtype: torch.dtype, activation_dtype: torch.dtype | None, amx: bool,
                      fp32_rows: int | None) -> tuple[bool, int | None]:
    """Batch-invariant mode's copies (`amx`, `fp32_rows`) of `dtype` weights: `amx_ops`'
    where the policy runs bf16 weights there (AMX tiles), else `f32_ops`' packing (half
    weights as stored, widened in the product) from one row (half weights with fp32
    activations)."""
    if dtype not in HALF_DTYPES or activation_dtype != torch.float32:
        return False, fp32_rows
    if policy.choose_invariant(dtype, policy.Isa.detect()) is Backend.AMX_OPS:
        return amx, None
    return False, 1


def _narrowed(dtype: torch.dtype, amx: bool, f32: bool) -> policy.Isa:
    """This CPU's products, less those without copies (`amx`: `amx_ops` ones; `f32`:
    `f32_ops` ones)."""
    isa = policy.Isa.detect()
    if not (amx and dtype == torch.bfloat16 and amx_ops.available()):
        isa = isa.without("amx", "avx512_bf16")
    if not f32:
        isa = isa.without("f32_ops")
    return isa


#: each backend's copy of the weights, in bytes per byte of the weights as stored
_COPY_SIZE = {Backend.ONEDNN: 1, Backend.AMX_OPS: 1, Backend.F32_OPS: 1, Backend.ONEDNN_FP32: 2}


def _copy_bytes(dtype: torch.dtype, weights: int, amx: bool, fp32_rows: int | None,
                f32: bool, invariant: bool, in_bf16: bool = False) -> int:
    """The bytes of the packed copies `PackedLinears` makes of `weights` bytes of `dtype`
    weights: one per backend the table can choose with these copies
    (`linear_policy.reachable`; batch-invariant mode: its one backend). `in_bf16`: fp32
    weights that are all bf16 values, which `f32_ops` (with `f32`) packs as bf16 (half
    their bytes)."""
    isa = _narrowed(dtype, amx, f32)
    in_bf16 = in_bf16 and f32
    fmt = policy.FP32_IN_BF16 if in_bf16 else policy.format_of(dtype)
    if invariant:
        found = policy.choose_invariant(fmt, isa)
        backends = frozenset() if found is None else frozenset({found})
    else:
        backends = policy.reachable(fmt, isa, policy.Probe(fp32_from_rows=fp32_rows))
    sizes = {**_COPY_SIZE, Backend.F32_OPS: 0.5} if in_bf16 else _COPY_SIZE
    return int(weights * sum(sizes.get(b, 0) for b in backends))


def _weights_key(layers: list[torch.nn.Linear]) -> tuple[tuple[int, int], ...]:
    return tuple((id(m.weight), m.weight._version) for m in layers)


def _weights_seen(params: list[dict[str, Any]]) -> list[tuple[Any, int]]:
    """A weak reference to each packed layer's registered weight (read from the module's
    `_parameters`; None when it is no longer registered there) and its version. (Weak: a
    weight replaced since, such as rows moved onto a group's panels, is not kept alive.)"""
    return [(None, -1) if w is None else (weakref.ref(w), w._version)
            for w in (d.get("weight") for d in params)]


def _same_weights(params: list[dict[str, Any]], seen: list[tuple[Any, int]] | None) -> bool:
    """Whether every layer still has the weight object of `seen`, at the same version (a
    freed weight's reference is dead, so an identity is never that of its successor)."""
    if seen is None or len(seen) != len(params):
        return False
    for d, (ref, version) in zip(params, seen, strict=True):
        now = d.get("weight")
        if now is None or ref is None or ref() is not now or now._version != version:
            return False
    return True


class _Packed:
    """Packed weight (the stacked weights of a group) and bias in the weight dtype, derived
    again when a weight object or its version changes."""

    __slots__ = ("layers", "key", "weight", "bias", "sizes", "amx", "wants_amx", "wide",
                 "wide_bias", "wants_wide", "f32", "wants_f32", "f32_in_bf16")

    def __init__(self, layers: list[torch.nn.Linear], amx: bool = False,
                 wide: bool = False, f32: bool = False, f32_in_bf16: bool = False) -> None:
        self.layers = layers
        self.key: tuple[tuple[int, int], ...] | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.sizes = [m.out_features for m in layers]
        self.wants_amx = amx
        #: the same weight packed for `amx_ops.linear` (fp32 outputs), when asked for
        self.amx: amx_ops.AmxWeight | None = None
        self.wants_wide = wide
        #: the weight widened to fp32 and packed for oneDNN's fp32 product (and the bias in
        #: fp32), when asked for (`linear_policy.probe`)
        self.wide: torch.Tensor | None = None
        self.wide_bias: torch.Tensor | None = None
        self.wants_f32 = f32
        #: the weight packed for `f32_ops.linear` (a half weight as stored: its fp32 product
        #: is that of the widened weight), when asked for
        self.f32: f32_ops.F32Weight | None = None
        #: an fp32 weight packed for `f32_ops` as bf16 when all its values are bf16 ones
        #: (the same outputs at half the bytes; else as fp32)
        self.f32_in_bf16 = f32_in_bf16

    def refresh(self) -> None:
        key = _weights_key(self.layers)
        if self.key == key:
            return
        with torch.no_grad():
            self.weight = None  # oneDNN's packing: on first use (`onednn_weight`)
            dtype = self.layers[0].weight.dtype
            if all(m.bias is None for m in self.layers):
                self.bias = None
            else:
                self.bias = torch.cat([
                    m.bias.detach().to(dtype) if m.bias is not None
                    else torch.zeros(m.out_features, dtype=dtype) for m in self.layers
                ])
            # packed again when next asked for
            self.amx = self.wide = self.wide_bias = self.f32 = None
        self.key = key

    def onednn_weight(self) -> torch.Tensor:
        """The weight packed for oneDNN's product in its own dtype (on first use after each
        `refresh`)."""
        if self.weight is None:
            with torch.no_grad():
                self.weight = onednn.pack(torch.cat([m.weight.detach() for m in self.layers]))
        return self.weight

    def amx_weight(self) -> amx_ops.AmxWeight | None:
        """The weight packed for `amx_ops` (on first use after each `refresh`), if wanted."""
        if self.amx is None and self.wants_amx:
            with torch.no_grad():
                w = torch.cat([m.weight.detach() for m in self.layers])
            self.amx = amx_ops.pack(w, self.bias)
        return self.amx

    def f32_weight(self) -> f32_ops.F32Weight | None:
        """The weight packed for `f32_ops` (on first use after each `refresh`), if
        wanted. A layer whose weight is already held as its panels (`PanelWeight`, a model
        the engine read narrow) lends them; a group of such layers is packed stacked and
        its members then read their rows of the stacked panels (theirs let go)."""
        if self.f32 is None and self.wants_f32:
            w0 = self.layers[0].weight
            if len(self.layers) == 1 and isinstance(w0, PanelWeight) and w0.start == 0 \
                    and w0.stop == w0.panels.n:
                bias = None if self.bias is None else self.bias.float().contiguous()
                self.f32 = f32_ops.F32Weight(w0.panels.packed, bias, w0.panels.n, w0.panels.k)
                return self.f32
            with torch.no_grad():
                w = torch.cat([m.weight.detach() for m in self.layers]) \
                    if len(self.layers) > 1 else w0.detach()
                if self.f32_in_bf16:
                    self.f32 = f32_ops.pack_bf16_exact(w, self.bias)
                if self.f32 is None:
                    self.f32 = f32_ops.pack(w, self.bias)
            if self.f32.dtype == torch.bfloat16 and all(
                    isinstance(m.weight, PanelWeight) for m in self.layers):
                self.hold_rows()
                self.key = _weights_key(self.layers)
        return self.f32

    def hold_rows(self) -> None:
        """Each layer's weight becomes a `PanelWeight` over its rows of the bf16 `f32_ops`
        panels (`f32`, made): the same values, no elements of its own."""
        assert self.f32 is not None and self.f32.dtype == torch.bfloat16
        start = 0
        for m in self.layers:
            m._parameters["weight"] = PanelWeight(self.f32, start, start + m.out_features)
            start += m.out_features

    def f32_product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T + b` in fp32 on `f32_ops` (`x` [..., k] widened to fp32); the copy must be
        wanted."""
        w = self.f32_weight()
        assert w is not None, "no f32_ops copy wanted"
        if x.dim() == 2:
            return f32_ops.linear(x, w)
        return f32_ops.linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.n)

    def amx_product(self, x: torch.Tensor) -> torch.Tensor:
        """`bf16(x) @ W.T + b` in fp32 on `amx_ops` (`x` [..., k]); the packing must be
        wanted."""
        w = self.amx_weight()
        assert w is not None, "no amx_ops packing wanted"
        if x.dim() == 2:
            return amx_ops.linear(x, w)
        return amx_ops.linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.n)

    def onednn_fp32_product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T + b` in fp32 on oneDNN's fp32 copy of the weight (packed on first use
        after each `refresh`; `x` widened to fp32); the copy must be wanted."""
        assert self.wants_wide, "no fp32 copy wanted"
        if self.wide is None:
            self._make_wide()
        return onednn.linear(x if x.dtype == torch.float32 else x.float(), self.wide,
                             self.wide_bias)

    def prepack(self, backends: frozenset[Backend]) -> None:
        """Make now the copy of each of `backends` (those the table may choose: others are
        made on first use, inside a step, which then pays the packing)."""
        if Backend.ONEDNN in backends:
            self.onednn_weight()
        if Backend.AMX_OPS in backends:
            self.amx_weight()
        if Backend.F32_OPS in backends:
            self.f32_weight()
        if Backend.ONEDNN_FP32 in backends and self.wants_wide and self.wide is None:
            self._make_wide()

    def _make_wide(self) -> None:
        with torch.no_grad():
            w = torch.cat([m.weight.detach() for m in self.layers]).float()
        self.wide = onednn.pack(w)
        self.wide_bias = None if self.bias is None else self.bias.float()

    @property
    def nbytes(self) -> int:
        own = 0 if self.weight is None else self.weight.numel() * self.weight.element_size()
        wide = 0 if self.wide is None else self.wide.numel() * 4
        f32 = 0 if self.f32 is None else self.f32.nbytes
        return own + wide + f32 + (self.amx.nbytes if self.amx is not None else 0)


class _Group:
    """The slices of a group's last product, held for its other members until they ask with
    the same input tensor object."""

    __slots__ = ("packed", "x", "parts")

    def __init__(self, packed: _Packed) -> None:
        self.packed = packed
        self.x: torch.Tensor | None = None
        self.parts: list[torch.Tensor | None] = []

    def take(self, x: torch.Tensor, index: int) -> torch.Tensor | None:
        # (inference tensors keep no version counter: the same object, taken at once by
        # the next layers of the same module, is what the calibration saw)
        if self.x is not x:
            return None
        part, self.parts[index] = self.parts[index], None
        return part

    def clear(self) -> None:
        self.x, self.parts = None, []


class PackedLinears:
    """The `nn.Linear` layers of a half-precision CPU model run on weights packed once for
    oneDNN, with outputs in `activation_dtype` (see the module docstring). Build with
    `PackedLinears.of(...)`, which returns None when nothing applies."""

    def __init__(
        self,
        model: torch.nn.Module,
        layers: list[torch.nn.Linear],
        activation_dtype: torch.dtype,
        in_thread: Callable[[], bool],
        hidden_size: int | None = None,
        amx: bool = False,
        fp32_rows: int | None = None,
        f32_kernel: bool = False,
        invariant: bool = False,
        in_bf16: bool = False,
    ) -> None:
        self.model = model
        #: batch-invariant mode: every call takes `linear_policy.choose_invariant`'s product
        self.invariant = invariant
        #: a layer whose outputs stay in `activation_dtype` though it is not a residual
        #: writer: the output head (logits rounded to bf16 tie and part from fp32's: 4x
        #: the log-probability error; in batch-invariant mode greedy tokens are their argmax)
        head = model.get_output_embeddings() if hasattr(
            model, "get_output_embeddings") else None
        self._wide_out = id(head) if head is not None else None
        self.hidden_size = hidden_size
        self.weight_dtype = layers[0].weight.dtype
        #: fp32 weights that were all bf16 values when found (`of`): `f32_ops` packs them
        #: as bf16 (`weight_format`)
        self._in_bf16 = in_bf16 and self.weight_dtype == torch.float32
        self.activation_dtype = activation_dtype
        #: (rows, fp32 outputs, threads) -> the policy's backend (`backend`)
        self._chosen: dict[tuple[int, bool, int], Backend] = {}
        #: every product also packed for `amx_ops` (`wide_product`: fp32 outputs)
        self._amx = (amx and self.weight_dtype == torch.bfloat16
                     and activation_dtype == torch.float32 and amx_ops.available())
        #: from this many rows, products run on fp32 copies of the half-precision weights
        #: (the policy's probe; fp32 activations only; None: never)
        self.fp32_rows = fp32_rows if (
            activation_dtype == torch.float32 and self.weight_dtype in HALF_DTYPES) else None
        #: fp32 products (an fp32 model's, or on the fp32 copies) run on `f32_ops` where the
        #: policy says (up to `linear_policy.F32_KERNEL_ROWS` rows)
        self._f32_kernel = f32_kernel and f32_ops.available() and (
            self.weight_dtype == torch.float32 or self.fp32_rows is not None)
        self._in_thread = in_thread
        self._active = False
        self._everywhere = False
        self._exact = False
        self._recording: list[tuple[int, torch.Tensor]] | None = None
        #: grouped layers return slices of their product (views) rather than copies
        self.slice_views = True
        self._layers = layers
        self._params = [m._parameters for m in layers]
        #: `_weights_seen` when the packs were last refreshed (None: not yet)
        self._seen: list[tuple[Any, int]] | None = None
        self._forwards: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self._packs: list[_Packed] = []
        self._groups: list[_Group] = []
        self._set_groups([[i] for i in range(len(layers))])
        emb = model.get_input_embeddings() if self.widens else None
        # a module whose forward is already an instance attribute (hooks) is left alone
        self._embeddings = emb if emb is not None and "forward" not in emb.__dict__ else None
        self._embedding_fwd = (
            self._embedding_forward(self._embeddings) if self._embeddings is not None else None
        )

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        *,
        activation_dtype: torch.dtype | None = None,
        in_thread: Callable[[], bool],
        hidden_size: int | None = None,
        amx: bool = False,
        fp32_rows: int | None = None,
        dtypes: tuple[torch.dtype, ...] = HALF_DTYPES,
        f32_kernel: bool = True,
        invariant: bool = False,
    ) -> PackedLinears | None:
        """The packed layers of `model`, or None: no plain `nn.Linear` with a weight of one
        of `dtypes` on CPU, no oneDNN product for that dtype here (`packing_available`), or
        the copies would take more than half of available memory.
        `activation_dtype` None = the weights' dtype. `in_thread()` tells whether the
        calling thread is inside a ferrobatch forward. `hidden_size`: the width of the
        residual stream (which outputs are widened; None = every output). `amx`: with fp32
        activations over bf16 weights where `amx_ops` runs, also pack every product for
        `wide_product` (fp32 outputs; the packed copies take twice the memory).
        `fp32_rows`: with fp32 activations over half-precision weights, products of that
        many rows or more run on fp32 copies of the weights (`linear_policy.probe`; the copies
        take twice the weights' memory). `dtypes`:
        the weight dtypes packed (fp32 too for an fp32 model: oneDNN's product on a packed
        fp32 weight is 1.3-1.6x faster than `F.linear` on Zen 4, and batch-invariant).
        `invariant`: batch-invariant mode (`linear_policy.choose_invariant` for every call;
        half-precision weights with fp32 activations get their `f32_ops` packing from one
        row, no oneDNN fp32 copies)."""
        layers = [
            m for m in model.modules()
            if type(m) is torch.nn.Linear and "forward" not in m.__dict__
            and m.weight.device.type == "cpu" and m.weight.dtype in dtypes
        ]
        if not layers or len({m.weight.dtype for m in layers}) > 1:
            return None
        if not packing_available(layers[0].weight.dtype):
            return None
        dtype = layers[0].weight.dtype
        # (weights already held as their panels lend them: no copy is made of those)
        weights = sum(m.weight.numel() * m.weight.element_size() for m in layers
                      if not isinstance(m.weight, PanelWeight))
        if invariant:
            amx, fp32_rows = _invariant_copies(dtype, activation_dtype, amx, fp32_rows)
        if activation_dtype != torch.float32 or dtype not in HALF_DTYPES:
            fp32_rows = None
        amx = amx and activation_dtype == torch.float32
        budget = _MAX_AVAILABLE_SHARE * psutil.virtual_memory().available
        wants_f32 = f32_kernel and f32_ops.available() and (
            fp32_rows is not None or dtype == torch.float32)
        # a bf16 checkpoint run in fp32: `f32_ops` holds its weights as bf16 where they
        # are all bf16 values (each pack checks its own; two tell the format)
        in_bf16 = wants_f32 and dtype == torch.float32 and all(
            bf16_exact(m.weight) for m in (layers[0], layers[-1]))

        def copies() -> int:
            return _copy_bytes(dtype, weights, amx, fp32_rows, wants_f32, invariant, in_bf16)

        if fp32_rows == 1 and not invariant and amx and dtype == torch.bfloat16 \
                and amx_ops.available():
            # a small model also keeps bf16 products for its fewest rows (`amx_ops`, faster
            # at one row), where their copies are cheap
            fp32_rows = policy.FP32_ROWS
            if copies() - weights > min(_SPEED_COPIES_BYTES, budget - weights):
                fp32_rows = 1

        if fp32_rows is not None and not invariant and copies() > budget:
            logger.info("ferrobatch: no fp32 products of the half weights (their copies: "
                        "%.0f MiB, beyond %.0f%% of the %.0f MiB available)", copies() / 2**20,
                        100 * _MAX_AVAILABLE_SHARE, budget / _MAX_AVAILABLE_SHARE / 2**20)
            fp32_rows = None
            wants_f32 = wants_f32 and dtype == torch.float32
        if wants_f32 and copies() > budget:
            logger.info("ferrobatch: no copies of the weights for f32_ops (%.0f MiB of copies)",
                        copies() / 2**20)
            wants_f32 = False
        if copies() > budget:
            logger.info("ferrobatch: linear weights not packed (%.0f MiB of copies, more than "
                        "%.0f%% of the %.0f MiB available)", copies() / 2**20,
                        100 * _MAX_AVAILABLE_SHARE, budget / _MAX_AVAILABLE_SHARE / 2**20)
            return None
        return cls(model, layers, activation_dtype or layers[0].weight.dtype, in_thread,
                   hidden_size, amx, fp32_rows, wants_f32, invariant, in_bf16)

    # --- which product (`linear_policy`) ---------------------------------------------------

    @property
    def amx(self) -> bool:
        """Whether every product is also packed for `amx_ops` (fp32 outputs)."""
        return self._amx

    @amx.setter
    def amx(self, on: bool) -> None:
        self._amx = on
        self._chosen.clear()

    @property
    def f32_kernel(self) -> bool:
        """Whether fp32 products may run on `f32_ops` (where the policy says)."""
        return self._f32_kernel

    @f32_kernel.setter
    def f32_kernel(self, on: bool) -> None:
        self._f32_kernel = on
        self._chosen.clear()

    @property
    def weight_format(self) -> str:
        """The weights' format in `linear_policy`'s table: their dtype's, or `FP32_IN_BF16`
        (fp32 weights that are all bf16 values, on `f32_ops`)."""
        if self._in_bf16 and self._f32_kernel:
            return policy.FP32_IN_BF16
        return policy.format_of(self.weight_dtype)

    @property
    def isa(self) -> policy.Isa:
        """This CPU's products (`linear_policy.Isa`) that these packed weights have copies
        for."""
        return _narrowed(self.weight_dtype, self._amx, self._f32_kernel)

    def backend(self, rows: int, fp32_outputs: bool = False) -> Backend:
        """The product a call of `rows` rows runs on (`linear_policy.choose`, at torch's
        current thread count: the thread governor may change it); `fp32_outputs`: the
        caller takes fp32 outputs (the lean layers)."""
        if self.invariant:
            return self.invariant_backend()
        threads = torch.get_num_threads()
        key = (rows, fp32_outputs, threads)
        chosen = self._chosen.get(key)
        if chosen is None:
            chosen = self._chosen[key] = policy.choose(
                self.weight_format, rows, self.isa, policy.Probe(fp32_from_rows=self.fp32_rows),
                fp32_outputs=fp32_outputs, threads=threads)
        return chosen

    def invariant_backend(self) -> Backend:
        """Batch-invariant mode's one product for these weights here
        (`linear_policy.choose_invariant`); `FieldError` on `batch_invariant` where none
        runs (no AVX-512F for `f32_ops`, or its copies did not fit in memory)."""
        chosen = self._chosen.get(_INVARIANT_KEY)
        if chosen is None:
            found = policy.choose_invariant(self.weight_format, self.isa)
            if found is None:
                raise FieldError(
                    f"batch_invariant: no batch-invariant product for {self.weight_dtype} "
                    f"weights here ({self.isa}): it needs AVX-512F (f32_ops) and memory for "
                    "a packed copy of the weights, or AMX tiles for bf16 weights",
                    "batch_invariant")
            chosen = self._chosen[_INVARIANT_KEY] = found
        return chosen

    def _run(self, packed: _Packed, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        """`x @ W.T + b` of a packed product on `backend`: fp32 outputs on the fp32 copies,
        `f32_ops` and `amx_ops`; else in the weight dtype (`x` rounded to it)."""
        if backend is Backend.F32_OPS:
            return packed.f32_product(x)
        if backend is Backend.ONEDNN_FP32:
            return packed.onednn_fp32_product(x)
        if backend is Backend.AMX_OPS:
            return packed.amx_product(x)
        # (`onednn`: packed layers exist only where oneDNN runs their dtype)
        wdt = self.weight_dtype
        return onednn.linear(x if x.dtype == wdt else x.to(wdt), packed.onednn_weight(),
                             packed.bias)

    def one_call(self, rows: int) -> Backend | None:
        """The products a lean layer's step of `rows` rows runs on in one call of
        `_core.LeanLayer` (`linear_policy.one_call`): `f32_ops` or `amx_ops`; None where it
        may not."""
        backend = self.backend(rows, fp32_outputs=True)
        return None if policy.one_call(backend, rows) is None else backend

    @property
    def widens(self) -> bool:
        """Whether activations are kept wider than the weights (fp32 between products)."""
        return self.activation_dtype != self.weight_dtype

    @property
    def layers(self) -> list[torch.nn.Linear]:
        """The packed layers."""
        return list(self._layers)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_groups(self) -> int:
        """Groups of two or more layers sharing one product."""
        return sum(len(p.layers) > 1 for p in self._packs)

    @property
    def packed_bytes(self) -> int:
        return sum(p.nbytes for p in self._packs)

    def packed_of(self, layers: list[torch.nn.Linear]) -> _Packed | None:
        """The packed product of exactly `layers`, stacked in that order (one layer: its own
        product when it runs alone), or None."""
        ids = [id(m) for m in layers]
        for packed in self._packs:
            if [id(m) for m in packed.layers] == ids:
                return packed
        return None

    def holds(self, module: torch.nn.Module | None) -> bool:
        """Whether `module` is one of the packed layers (inside a step its forward is a
        product the policy chooses by rows)."""
        return module is not None and any(m is module for p in self._packs for m in p.layers)

    def input_dtype(self, rows: int) -> torch.dtype:
        """The dtype `wide_product` computes a `rows`-row input in (one in another dtype is
        converted first): fp32 on fp32 products, else the weight dtype."""
        return torch.float32 if self.backend(rows, fp32_outputs=True).fp32_inputs \
            else self.weight_dtype

    def wide_product(self, packed: _Packed, x: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T + b` of a packed product (`x` [T, k]) for a caller that takes fp32
        outputs (the lean layers): in fp32 on the fp32 copies, `f32_ops` or `amx_ops` (`x`
        rounded to bf16, the output not rounded) where the policy says; else in the weight
        dtype. `out` is taken by `QuantLinears.wide_product` only: here the result is a new
        tensor (the return value, as there)."""
        del out
        return self._run(packed, x, self.backend(x.shape[0], fp32_outputs=True))

    @staticmethod
    def width(packed: _Packed) -> int | None:
        """None: this class's `wide_product` takes no `out` buffer."""
        del packed
        return None

    # --- groups ----------------------------------------------------------------------------

    def _set_groups(self, groups: list[list[int]]) -> None:
        self._forwards = [None] * len(self._layers)  # type: ignore[list-item]
        self._packs, self._groups = [], []
        for members in groups:
            packed = _Packed([self._layers[i] for i in members], self._amx,
                             wide=self.fp32_rows is not None and not self.invariant,
                             f32=self._f32_kernel, f32_in_bf16=self._in_bf16)
            packed.refresh()
            group = _Group(packed)
            self._packs.append(packed)
            self._groups.append(group)
            for pos, i in enumerate(members):
                self._forwards[i] = self._linear_forward(i, group, pos)

    def prepack(self) -> None:
        """Make every packed copy the products may use (`_Packed.prepack`) now, so that no
        step pays for packing one (a server's first batch would)."""
        backends = policy.reachable(self.weight_format, self.isa,
                                    policy.Probe(fp32_from_rows=self.fp32_rows))
        if self.invariant:
            backends = frozenset({self.invariant_backend()})
        for packed in self._packs:
            packed.prepack(backends)

    def release_sources(self) -> int:
        """Take the checkpoint's pages of the packed layers' own weights out of the resident
        set (`cpu.pages.release`, views of a file's memory map only): every product reads
        its packed copies. A later read of a weight (another thread's forward, a group
        member run unpacked, packing again after a change) maps its pages back from the
        file. Returns the bytes given back."""
        return pages.release((m.weight for m in self._layers), anonymous=False)

    def hold_in_panels(self) -> int:
        """Let the model's fp32 weights go where their bf16 `f32_ops` panels are the only
        copy every product reads (`FP32_IN_BF16`, nothing else reachable): each such layer's
        weight becomes a `PanelWeight` over its panels (same shape, dtype and values, read
        back from the panels when anything reads it). Not the output head's, nor a weight
        another module shares (a tied embedding reads its rows). This changes the model:
        only for an engine that loaded it. Returns the bytes of fp32 weights let go."""
        if self.weight_format != policy.FP32_IN_BF16 or self._only_backend() is not \
                Backend.F32_OPS:
            return 0
        uses: dict[int, int] = {}
        for module in self.model.modules():
            for p in module._parameters.values():
                if p is not None:
                    uses[id(p)] = uses.get(id(p), 0) + 1
        freed = 0
        for packed in self._packs:
            f32 = packed.f32
            if f32 is None or f32.dtype != torch.bfloat16 or packed.weight is not None \
                    or packed.wide is not None or packed.amx is not None \
                    or any(id(m) == self._wide_out or uses.get(id(m.weight)) != 1
                           or isinstance(m.weight, PanelWeight) for m in packed.layers):
                continue
            freed += sum(m.weight.numel() * m.weight.element_size() for m in packed.layers)
            packed.hold_rows()
        self.same_values_swapped()
        return freed

    def same_values_swapped(self) -> None:
        """Take the layers' weights as they are now for those the packs were made from, with
        no packing again: after weights were replaced by objects of the same values (a
        `PanelWeight`, a `NarrowWeight`)."""
        for packed in self._packs:
            packed.key = _weights_key(packed.layers)
        self._seen = _weights_seen(self._params)

    def only_on_bf16_panels(self, module: torch.nn.Module | None) -> bool:
        """Whether `module` is a packed layer whose every product runs on its bf16 `f32_ops`
        panels (`FP32_IN_BF16`, nothing else reachable)."""
        if module is None or self.weight_format != policy.FP32_IN_BF16 \
                or self._only_backend() is not Backend.F32_OPS:
            return False
        for packed in self._packs:
            if any(m is module for m in packed.layers):
                return packed.f32 is not None and packed.f32.dtype == torch.bfloat16
        return False

    def _only_backend(self) -> Backend | None:
        """The one product every call of these weights runs on, or None where the table
        may choose between several."""
        if self.invariant:
            return self.invariant_backend()
        found = policy.reachable(self.weight_format, self.isa,
                                 policy.Probe(fp32_from_rows=self.fp32_rows))
        return next(iter(found)) if len(found) == 1 else None

    def calibrate(self, forward: Callable[[], Any]) -> None:
        """Run `forward()` (a short forward of the model, its products the exact fp32 ones:
        nothing is packed for it) and group the layers that took the same input tensor one
        after the other; a second forward on the groups' packed products checks that the
        model takes their slices."""
        self._recording = []
        try:
            with self.active(everywhere=True):
                forward()
            calls = self._recording
        finally:
            self._recording = None
        runs: list[list[int]] = []
        for n, (i, x) in enumerate(calls):
            if n and calls[n - 1][1] is x and i not in runs[-1]:
                runs[-1].append(i)
            else:
                runs.append([i])
        group_of: dict[int, tuple[int, ...]] = {}
        conflict: set[int] = set()
        for run in runs:
            key = tuple(run)
            for i in run:
                if group_of.setdefault(i, key) != key:
                    conflict.add(i)
        seen: set[int] = set()
        groups: list[list[int]] = []
        for key in dict.fromkeys(group_of.values()):
            if len(key) > 1 and not any(i in conflict for i in key):
                groups.append(list(key))
                seen.update(key)
        groups += [[i] for i in range(len(self._layers)) if i not in seen]
        self._set_groups(groups)
        if not self.num_groups:
            return
        # the grouped layers hand out slices of one product (no copy); a model that needs
        # its projections contiguous gets copies, and one that still fails no groups
        for views in (True, False):
            self.slice_views = views
            try:
                with self.active(everywhere=True):
                    forward()
                return
            except Exception as exc:  # noqa: BLE001 - fall back, said in the log
                logger.info("ferrobatch: grouped linears with %s fail here (%s: %s)",
                            "slice views" if views else "copies", type(exc).__name__, exc)
        self.slice_views = True
        self._set_groups([[i] for i in range(len(self._layers))])

    # --- forwards --------------------------------------------------------------------------

    def _linear_forward(
        self, index: int, group: _Group, pos: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        module = self._layers[index]
        own = type(module).forward
        wdt = self.weight_dtype
        in_thread = self._in_thread
        packed = group.packed
        alone = len(packed.layers) == 1
        writes_residual = alone and (self.hidden_size in (None, module.out_features)
                                     or id(module) == self._wide_out)
        adt = self.activation_dtype if writes_residual else wdt

        def widen(y: torch.Tensor) -> torch.Tensor:
            return y if y.dtype == adt else y.to(adt)

        def run(x: torch.Tensor) -> torch.Tensor:
            # (on an fp32 copy the output is fp32: widened or rounded below as the half
            # product's would be)
            return self._run(packed, x, self.backend(math.prod(x.shape[:-1])))

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not (in_thread() or self._everywhere):
                return own(module, x)
            if self._exact or self._recording is not None:
                # (calibration only records who takes which input: no copy is packed for
                # it, the groups it finds are packed next)
                if self._recording is not None:
                    self._recording.append((index, x))
                b = module.bias
                y = F.linear(x.float(), module.weight.float(), None if b is None else b.float())
                return y if self._exact else widen(y)
            if alone:
                return widen(run(x))
            if pos:
                part = group.take(x, pos)
                if part is not None:
                    return part
                return widen(own(module, x if x.dtype == wdt else x.to(wdt)))  # unpacked
            y = run(x)
            parts = [widen(s) if s.dtype != adt else s if self.slice_views else s.contiguous()
                     for s in y.split(packed.sizes, dim=-1)]
            group.x, group.parts = x, parts
            return parts[0]

        return forward

    def _embedding_forward(self, module: torch.nn.Module) -> Callable[..., torch.Tensor]:
        own = type(module).forward
        adt, in_thread = self.activation_dtype, self._in_thread

        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = own(module, *args, **kwargs)
            if (in_thread() or self._everywhere) and out.is_floating_point():
                return out.to(torch.float32 if self._exact else adt)
            return out

        return forward

    @contextmanager
    def active(self, everywhere: bool = False, exact: bool = False) -> Iterator[None]:
        """Inside the block, the layers run on their packed weights in ferrobatch forwards
        (on every thread and in any forward with `everywhere`: for construction checks);
        weights changed in place since the last call are packed again first. `exact`
        (checks only): fp32 products of the widened weights instead, fp32 activations (the
        exact computation the half-precision forwards approximate). On exit each layer's
        own `forward` is back."""
        if self._active:  # nested: the outer block restores
            yield
            return
        self._active = True
        self._everywhere = everywhere or exact
        self._exact = exact
        patched: list[torch.nn.Module] = []
        try:
            self._refresh_changed()
            # what `Module.__setattr__` does for a function value, without its type checks
            for module, forward in zip(self._layers, self._forwards, strict=True):
                module.__dict__["forward"] = forward
            patched.extend(self._layers)
            if self._embeddings is not None:
                self._embeddings.forward = self._embedding_fwd
                patched.append(self._embeddings)
            yield
        finally:
            for m in patched:
                m.__dict__.pop("forward", None)
            for group in self._groups:
                group.clear()
            self._active = self._everywhere = self._exact = False

    def _refresh_changed(self) -> None:
        """Pack again the products whose weights were replaced or changed in place since the
        last forward (one pass over the weights when nothing changed)."""
        if _same_weights(self._params, self._seen):
            return
        for packed in self._packs:
            packed.refresh()
        self._seen = _weights_seen(self._params)

    def clear(self) -> None:
        """Drop the packed copies."""
        self._layers, self._forwards, self._packs, self._groups = [], [], [], []
        self._params, self._seen = [], None
        self._embeddings = None

