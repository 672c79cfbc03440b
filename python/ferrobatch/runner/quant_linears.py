"""The products of a GGUF model's decoder layers for the lean layers: `QuantLinear` weights
(`ferrobatch.gguf.modules`) stacked the way `lean_layers` asks for them.

A fully quantized CPU model has no plain `nn.Linear` for `cpu_linear.PackedLinears`;
`QuantLinears` stands in for it under `lean_layers.LeanLayers`, so a GGUF model's decoder
layers run the same per-step path as a bf16 or fp32 model's (fused norms, rope and SiLU,
the paged attention kernel called directly, no transformers layer code), with the products
on the quantized kernels (`ferrobatch.cpu.quant_ops`):

* a stacked product (q/k/v, gate/up) packs the members' GGUF rows one after the other into
  one weight (members of one type; a member of another type, such as Q4_K_M's Q6_K value
  projections, is a part of its own whose outputs are written beside the others'), so one
  call reads them all; each output is bit for bit the member's own `QuantLinear` product
  (the kernels quantize each activation row on its own and sum each output over its own
  weight row: stacking changes nothing of either);
* a single product (o_proj, down_proj) runs on the module's own packed copy;
* under the reference backend (`modules.backend("reference")`: tests, checks) or the
  construction probes' stand-ins (`modules.probe_weights`) every member runs its own
  `QuantLinear.product`, as its own forward does.

A decode step's layer runs in one call of `_core.LeanLayer` (`fused_layer`, weight_dtype
"quantized") where every product of the model runs on the kernels and none is reduced over
tensor-parallel ranks (`one_call`, `QuantProduct.packed_parts`): the same kernels on the same
packed parts, bit for bit the lean forward.

Activations stay fp32 (the model's), so nothing is widened and the lean layers' products
take and give fp32 rows. `FERROBATCH_QUANT_LEAN=0` turns the path off (the model's own
layers, each `QuantLinear` on its own).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ferrobatch.cpu import quant_ops
from ferrobatch.gguf import modules
from ferrobatch.gguf.modules import QuantLinear
from ferrobatch.runner.lean_layers import is_moe_block
from ferrobatch.runner.linear_policy import ONE_CALL_MAX_ROWS, Backend

logger = logging.getLogger("ferrobatch")

__all__ = ["QuantLinears", "QuantProduct", "enabled"]


def enabled() -> bool:
    """Whether GGUF models may run their decoder layers lean (`FERROBATCH_QUANT_LEAN`, on
    unless "0")."""
    return os.environ.get("FERROBATCH_QUANT_LEAN", "1") != "0"


class _Part:
    """Consecutive members of one quantized type, stacked: their rows packed as one weight
    (on first use under the kernels; the stacked GGUF rows are not kept)."""

    def __init__(self, members: list[QuantLinear]) -> None:
        self.members = members
        self.qtype = members[0].qtype
        self.n = sum(m.out_features for m in members)
        self.k = members[0].in_features
        self._packed: quant_ops.PackedWeight | None = None

    def packed(self) -> quant_ops.PackedWeight:
        """The members' rows packed for `quant_ops.linear` (one member: its own packed
        copy, shared with its module's forward)."""
        if self._packed is None:
            if len(self.members) == 1:
                return modules.packed_weight(self.members[0].weight_q)
            rows = torch.cat([m.weight_q.data for m in self.members])
            self._packed = quant_ops.pack(self.qtype, rows, self.n, self.k)
        return self._packed

    @property
    def nbytes(self) -> int:
        return 0 if self._packed is None else self._packed.nbytes

    def product(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """fp32 `x` [T, k] @ the members' weights.T (no bias), into `out` when given."""
        if modules.kernels_run(self.qtype) and not modules.probing():
            return quant_ops.linear(x, self.packed(), out=out)
        y = torch.cat([m.product(x) for m in self.members], dim=1)
        if out is None:
            return y
        out.copy_(y)
        return out


class QuantProduct:
    """The product of `layers` (`QuantLinear`s of one input width) stacked in that order:
    fp32 [T, sum of widths], each layer's bias added; a single layer's `reduce` (a
    tensor-parallel row-parallel layer's sum over the ranks) applied before its bias."""

    def __init__(self, layers: list[QuantLinear]) -> None:
        self.layers = layers
        self.sizes = [m.out_features for m in layers]
        self.n = sum(self.sizes)
        self.k = layers[0].in_features
        self.reduce = layers[0].reduce if len(layers) == 1 else None
        self.parts: list[_Part] = []
        for m in layers:
            if self.parts and self.parts[-1].qtype == m.qtype:
                self.parts[-1].members.append(m)
                self.parts[-1].n += m.out_features
            else:
                self.parts.append(_Part([m]))
        if all(m.bias is None for m in layers):
            self.bias: torch.Tensor | None = None
        else:
            self.bias = torch.cat([
                m.bias.detach().float() if m.bias is not None
                else torch.zeros(m.out_features) for m in layers])

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked copies made for this product (a single member's copy is its
        module's)."""
        return sum(p.nbytes for p in self.parts)

    def packed_parts(self) -> tuple[quant_ops.PackedWeight, ...] | None:
        """The parts' packed weights in order, for the one-call layer (whose caller checked
        that the kernels run them now: `QuantLinears.one_call`); None for a product reduced
        over tensor-parallel ranks (the one call has no reduction)."""
        if self.reduce is not None:
            return None
        return tuple(part.packed() for part in self.parts)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 `x` [T, k] @ the stacked weights.T + bias, [T, n]; written into `out` (fp32,
        contiguous [T, n]) when given and no tensor-parallel sum follows (the result is the
        return value either way)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        if len(self.parts) == 1:
            y = self.parts[0].product(x, out)
        elif x.shape[0] == 1:  # one row: each part writes its columns in place
            y = torch.empty(1, self.n) if out is None else out
            start = 0
            for part in self.parts:
                part.product(x, y[:, start:start + part.n])
                start += part.n
        else:
            ys = [part.product(x, None) for part in self.parts]
            y = torch.cat(ys, dim=1) if out is None else torch.cat(ys, dim=1, out=out)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.bias is not None:
            y += self.bias
        return y


class QuantLinears:
    """The `cpu_linear.PackedLinears` interface `lean_layers` uses, over a GGUF model's
    `QuantLinear` layers (see the module docstring). Build with `QuantLinears.of(model)`."""

    #: the lean layers' residual stream and products' inputs (the model's dtype)
    activation_dtype = torch.float32
    weight_dtype = torch.float32
    widens = False

    def __init__(self, model: torch.nn.Module, layers: list[QuantLinear]) -> None:
        self.model = model
        self._layers = layers
        self._products: dict[tuple[int, ...], QuantProduct] = {}
        self._qtypes = frozenset(m.qtype for m in layers)

    @classmethod
    def of(cls, model: torch.nn.Module) -> QuantLinears | None:
        """The quantized products of `model` when it is an fp32 CPU model with `QuantLinear`
        layers and no plain `nn.Linear` outside its mixture-of-experts blocks (a mixed file's
        plain layers take the packed linears; a MoE block runs as its own module in a lean
        layer, so a float linear inside it, as Qwen2-MoE's shared-expert gate, runs there),
        and `enabled()`; else None."""
        if not enabled() or model.dtype != torch.float32:
            return None
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        blocks = tuple(f"{name}." for name, m in model.named_modules() if is_moe_block(m))
        if not layers or any(type(m) is torch.nn.Linear and not name.startswith(blocks)
                             for name, m in model.named_modules()):
            return None
        return cls(model, layers)

    @property
    def layers(self) -> list[QuantLinear]:
        return list(self._layers)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_groups(self) -> int:
        """Products of two or more layers."""
        return sum(len(p.layers) > 1 for p in self._products.values())

    @property
    def packed_bytes(self) -> int:
        """Bytes of the stacked copies (packed on first use under the kernels)."""
        return sum(p.nbytes for p in self._products.values())

    def stacked_layers(self) -> list[QuantLinear]:
        """The layers whose product runs stacked with others' (their own packed copies are
        not needed by a lean forward)."""
        return [m for p in self._products.values() if len(p.layers) > 1 for m in p.layers]

    def packed_of(self, layers: list[Any]) -> QuantProduct | None:
        """The product of exactly `layers` stacked in that order, or None when one is not a
        `QuantLinear` of this model or their input widths differ."""
        held = {id(m) for m in self._layers}
        if not layers or any(id(m) not in held for m in layers) \
                or len({m.in_features for m in layers}) > 1 \
                or (len(layers) > 1 and any(m.reduce is not None for m in layers)):
            return None
        key = tuple(id(m) for m in layers)
        found = self._products.get(key)
        if found is None:
            found = self._products[key] = QuantProduct(list(layers))
        return found

    def prepack(self) -> None:
        """Pack every product for the kernels now (where they run its types), so that no
        step pays for packing."""
        for product in self._products.values():
            for part in product.parts:
                if modules.kernels_run(part.qtype):
                    part.packed()

    def input_dtype(self, rows: int) -> torch.dtype:
        """fp32: the quantized kernels take fp32 rows (quantized to int8 per row inside)."""
        return torch.float32

    def wide_product(self, product: QuantProduct, x: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T + b` of a stacked product (`x` [T, k]), fp32, in `out` (fp32 [T, n]) when
        given (a buffer the caller reuses; the return value is the result)."""
        return product(x, out)

    @staticmethod
    def width(product: QuantProduct) -> int:
        """Output columns of a stacked product (its `wide_product`'s `out` width)."""
        return product.n

    def one_call(self, rows: int) -> Backend | None:
        """`quant_ops` where a lean layer's step of `rows` rows may run in one call of
        `_core.LeanLayer`: at most `ONE_CALL_MAX_ROWS` rows, every type of the model on the
        kernels now (not the reference backend, no probe stand-ins); else None."""
        if rows > ONE_CALL_MAX_ROWS or modules.probing() \
                or not all(modules.kernels_run(t) for t in self._qtypes):
            return None
        return Backend.QUANT_OPS

    @contextmanager
    def active(self, everywhere: bool = False, exact: bool = False) -> Iterator[None]:
        """Nothing to put in place (the lean layers call the products themselves); `exact`
        (checks only): the reference products (fp32 products of the dequantized weights)."""
        if exact:
            with modules.backend("reference"):
                yield
        else:
            yield

    def clear(self) -> None:
        self._layers, self._products = [], {}
