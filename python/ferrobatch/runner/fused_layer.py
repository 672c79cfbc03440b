"""A lean decoder layer in one call of `ferrobatch._core.LeanLayer` where a step allows it.

At decode batch sizes a lean layer's four products and five fused kernels take a few
hundred microseconds of compute each step, and the Python between them (tensor
allocations, numpy views, argument parsing of ten calls) as much again. `FusedLayer` runs
the same kernels in the same order with the same roundings inside one Rust call, so its
results are bit-equal to `lean_layers._lean_forward`'s (tested). The lean layer asks
`FusedLayer.forward` first on every step; it is the one place that decides, and it runs
the call when:

* the policy puts every product of the step's rows on `amx_ops` (bf16 weights) or every
  one on `f32_ops` (an fp32 model's weights, or half-precision ones in its half panels,
  widened in the product; the norms and SiLU then write fp32 inputs, as the lean forward
  does for them), or the model's GGUF quantized products all run on `quant_ops`' kernels
  (fp32 inputs, as on `f32_ops`; `quant_linears.QuantLinears.one_call`), and the step
  has at most `linear_policy.ONE_CALL_MAX_ROWS` rows (`linear_policy.one_call`);
* the layer's attention is ferrobatch's paged attention and every row of the step goes to
  the CPU decode kernel (`kernel_only_group`'s case: decode rows, or every row in the
  batch-invariant mode; no prompt rows on the prefill kernel, no SDPA rows), over a
  cache of a kernel dtype;
* the weights and norms make a `LeanLayer` (norms of one kernel dtype; Qwen3's per-head
  q/k norms with one epsilon run inside the call, as the lean forward's `_head_norm`).

Where every decoder layer of the model may take its one call on a step with the same
backend, scale and cache dtype, `FusedStack` runs them all in one
`_core.lean_layers_forward` from the first layer's call (each layer over its own attention
group and rope: sliding and full layers side by side, Gemma 3's local and global ropes),
and the other layers' calls only report it: the same kernels in the same order, without
the Python around each layer's call.

Everything else is the lean forward's, the fallback: oneDNN's products (bf16 outputs, or
fp32 copies beyond `f32_ops`' rows), steps with SDPA rows, longer steps (the scratch the
Rust side keeps per thread stays a few MiB; above it the Python between the kernels costs
under 5%), other attention functions (the construction checks' own attention).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ferrobatch import _core
from ferrobatch.attention import context
from ferrobatch.attention.forward import kernel_only_group
from ferrobatch.cpu.arrays import KERNEL_DTYPES, numpy_view
from ferrobatch.runner.cpu_linear import PackedLinears
from ferrobatch.runner.linear_policy import Backend

__all__ = ["FusedLayer", "FusedStack", "available"]


def available() -> bool:
    """Whether this build of `ferrobatch._core` has `LeanLayer` (which products it may run
    on, the linears' `one_call` says: only those that run here)."""
    return hasattr(_core, "LeanLayer")


class FusedLayer:
    """The one-call forward of one lean layer's parts (`lean_layers._Layer`), made on first
    use and again whenever a packed weight or norm weight object changes."""

    def __init__(self, part: Any, linears: PackedLinears) -> None:
        self._part = part
        self._linears = linears
        #: per products' backend (`amx_ops`: bf16, `f32_ops`: fp32, `quant_ops`: GGUF
        #: parts), the weights and norms a `_core.LeanLayer` was made of, and that layer
        self._made: dict[Backend, tuple[Any, ...]] = {}
        self._layers: dict[Backend, Any] = {}
        #: the model's whole stack of layers, where it may run in one call (`FusedStack`)
        self.stack: FusedStack | None = None

    def _lean_layer(self, kind: Backend) -> Any:
        """The `_core.LeanLayer` of the current weights packed for `kind`'s products, or None
        (a product not packed so, or norm weights in a dtype the kernels lack)."""
        p = self._part
        parts = (p.qkv, p.o, p.gate_up, p.down)
        packed = tuple(_packed(x, kind) for x in parts)
        which = (0, 1) + ((2, 3) if p.q_norm is not None else ()) \
            + ((4, 5) if p.sandwich is not None else ())
        norms = tuple(p.norm_weight(i) for i in which)
        made = (*_flat(packed), *norms)
        last = self._made.get(kind, ())
        if len(made) == len(last) and all(a is b for a, b in zip(made, last, strict=True)):
            return self._layers[kind]
        self._made[kind], self._layers[kind] = made, None
        if any(w is None for w in packed) or any(n.dtype != norms[0].dtype for n in norms) \
                or norms[0].dtype not in KERNEL_DTYPES \
                or kind is Backend.F32_OPS and len({w.dtype for w in packed}) > 1:
            return None
        extra: dict[str, Any] = {}
        if p.q_norm is not None:
            if p.eps(2) != p.eps(3):
                return None
            extra.update(q_norm=numpy_view(norms[2]), k_norm=numpy_view(norms[3]),
                         qk_norm_eps=p.eps(2))
        if p.sandwich is not None:
            if p.eps(4) != p.eps(5):
                return None
            extra.update(post_attn_norm=numpy_view(norms[-2]),
                         post_mlp_norm=numpy_view(norms[-1]), sandwich_eps=p.eps(4))
        qkv, o, gate_up, down = (_arrays(w, kind) for w in packed)
        self._layers[kind] = _core.LeanLayer(
            input_norm=numpy_view(norms[0]), post_norm=numpy_view(norms[1]),
            norm_dtype=KERNEL_DTYPES[norms[0].dtype],
            input_eps=p.eps(0), post_eps=p.eps(1),
            qkv=qkv, o=o, gate_up=gate_up, down=down,
            hidden=norms[0].numel(), heads=p.heads, kv_heads=p.kv_heads, dim=p.dim,
            inter=p.inter,
            qkv_bias=_bias(p.qkv, packed[0]), o_bias=_bias(p.o, packed[1]),
            gate_up_bias=_bias(p.gate_up, packed[2]), down_bias=_bias(p.down, packed[3]),
            weight_dtype=_weight_dtype(packed[0], kind), rot=p.rot, norm_offset=p.norm_offset,
            activation=p.activation, softcap=p.softcap, **extra)
        return self._layers[kind]

    def _call(self, rows: int, step: Any) -> _Call | None:
        """What one call of this layer over a step of `rows` rows takes, or None where the
        policy, the step or the weights do not allow it (see the module docstring)."""
        kind = self._linears.one_call(rows)
        if kind is None:
            return None
        p = self._part
        if step is None or p.attn.config._attn_implementation != context.ATTENTION_NAME:
            return None
        layer_idx = p.attn.layer_idx
        group = kernel_only_group(step, layer_idx)
        if group is None:
            return None
        k_cache, v_cache = step.cache.keys[layer_idx], step.cache.values[layer_idx]
        # an int8 cache (quantized on write) takes the lean forward: its write and kernel
        # attention are `kernel_only_attention`'s
        if step.cache.quantized or k_cache.dtype not in KERNEL_DTYPES \
                or k_cache.device.type != "cpu":
            return None
        layer = self._lean_layer(kind)
        if layer is None:
            return None
        return _Call(kind, layer, group, k_cache, v_cache, float(p.attn.scaling))

    def forward(self, x: torch.Tensor, step: Any,
                rope: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Backend | None:
        """The layer on the fp32 residual rows `x` [T, H] (updated in place) in one call
        where the policy, the step and the weights allow it (see the module docstring):
        returns the backend its products ran on (`f32_ops`, `amx_ops` or `quant_ops`); None,
        with nothing done, where not (the caller runs the lean forward). `rope()` gives the
        position embeddings' fp32 rows (cos, sin). The first layer's call runs every
        layer where the stack may run in one call; the others' calls then only say so."""
        stack = self.stack
        if stack is not None:
            ran = stack.forward(x, step, rope) if stack.first is self else stack.ran(x, step)
            if ran is not None:
                return ran
        call = self._call(x.shape[0], step)
        if call is None:
            return None
        cos, sin = rope()
        if cos.shape[-1] != self._part.rot:  # (a rope the layer was not built for)
            return None
        step.calls += 1
        kd = call.group.kernel_decode
        call.layer.forward(
            x.numpy(), numpy_view(call.k_cache), numpy_view(call.v_cache), cos.numpy(),
            sin.numpy(), call.group.slot_mapping.numpy(), kd.block_tables, kd.seqlens,
            cache_dtype=KERNEL_DTYPES[call.k_cache.dtype], page=step.cache.page_size,
            window=kd.window, scale=call.scale, threads=torch.get_num_threads())
        return call.kind


class FusedStack:
    """A model's decoder layers, every one of them in order, in one call of
    `_core.lean_layers_forward` where each could run alone in one call (`FusedLayer`) on the
    same products' backend and scale, with one cache dtype, each layer over its own
    attention group (sliding or full) and rope: bit for bit the layers' one calls in order,
    without the Python between them (about 5% of a 1.5B single stream's decode step). Where
    the ropes differ by layer type (Gemma 3's local and global layers), `rope_of(i)` gives
    layer `i`'s, as the model's rotary module gave it in this forward (`LeanLayers`
    records it); elsewhere every layer gets the first layer's.
    `FERROBATCH_LAYER_STACK=0` (or `ENABLED = False`) leaves each layer to its own call."""

    ENABLED = os.environ.get("FERROBATCH_LAYER_STACK", "1") != "0"

    def __init__(self, layers: list[FusedLayer],
                 rope_of: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None] | None
                 = None) -> None:
        self._layers = layers
        self.first = layers[0]
        #: layer `i`'s rope rows in the forward in progress, where the layers' ropes differ
        #: by layer type (None: every layer gets the first layer's)
        self._rope_of = rope_of
        #: (step, address of its residual rows, backend) of the last stack call
        self._ran: tuple[Any, int, Backend] | None = None
        for layer in layers:
            layer.stack = self

    def ran(self, x: torch.Tensor, step: Any) -> Backend | None:
        """The backend every layer ran on where the stack ran this step over `x`, else
        None."""
        ran = self._ran
        if ran is not None and ran[0] is step and ran[1] == x.data_ptr():
            return ran[2]
        return None

    def forget(self) -> None:
        """Drop the last call's step (at the end of a forward)."""
        self._ran = None

    def forward(self, x: torch.Tensor, step: Any,
                rope: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Backend | None:
        """Every layer on the fp32 residual rows `x` [T, H] (updated in place) in one call;
        returns the products' backend, or None with nothing done (each layer then decides
        for itself, `FusedLayer.forward`)."""
        self._ran = None
        if not self.ENABLED or step is None:
            return None
        calls = [f._call(x.shape[0], step) for f in self._layers]
        first = calls[0]
        if first is None or any(
                c is None or c.kind is not first.kind or c.scale != first.scale
                or c.k_cache.dtype != first.k_cache.dtype for c in calls):
            return None
        cos, sin = rope()
        if cos.shape[-1] != self.first._part.rot:
            return None
        ropes = [(cos, sin)] * len(calls)
        if self._rope_of is not None:
            ropes = [self._rope_of(i) for i in range(len(calls))]
            # (the first layer's own rope must be the one recorded for its type this forward)
            if any(r is None for r in ropes) or ropes[0][0] is not cos:
                return None
        groups, group_of = _groups(list(zip((c.group for c in calls), ropes, strict=True)))
        more = {} if len(groups) == 1 else {
            "groups": [(g.slot_mapping.numpy(), g.kernel_decode.block_tables,
                        g.kernel_decode.seqlens, g.kernel_decode.window,
                        None if r[0] is cos else (r[0].numpy(), r[1].numpy()))
                       for g, r in groups[1:]],
            "group_of": group_of}
        step.calls += len(calls)
        kd = first.group.kernel_decode
        _core.lean_layers_forward(
            [c.layer for c in calls], x.numpy(), [numpy_view(c.k_cache) for c in calls],
            [numpy_view(c.v_cache) for c in calls], cos.numpy(), sin.numpy(),
            first.group.slot_mapping.numpy(), kd.block_tables, kd.seqlens,
            cache_dtype=KERNEL_DTYPES[first.k_cache.dtype], page=step.cache.page_size,
            window=kd.window, scale=first.scale, threads=torch.get_num_threads(), **more)
        self._ran = (step, x.data_ptr(), first.kind)
        return first.kind


def _groups(per_layer: list[tuple[Any, Any]]) -> tuple[list[tuple[Any, Any]], list[int]]:
    """The distinct (attention group, (cos, sin)) pairs of `per_layer` (by the group's and
    the cos rows' identity, in order of first use) and each layer's index among them."""
    groups: list[tuple[Any, Any]] = []
    index: list[int] = []
    for g in per_layer:
        at = next((i for i, seen in enumerate(groups)
                   if seen[0] is g[0] and seen[1][0] is g[1][0]), None)
        if at is None:
            at = len(groups)
            groups.append(g)
        index.append(at)
    return groups, index


@dataclass(frozen=True)
class _Call:
    """One layer's one call over a step: its products' backend, the `_core.LeanLayer`, its
    attention group and caches, its attention scale."""

    kind: Backend
    layer: Any
    group: Any
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float


#: `_core.LeanLayer`'s `weight_dtype` of `f32_ops`' packing, by its stored dtype (half
#: weights as stored, widened in the product)
_PANELS = {torch.float32: "float32", torch.bfloat16: "bfloat16_panels",
           torch.float16: "float16_panels"}

#: a product's weights packed for one kind of products: `amx_ops` / `f32_ops`' weight, or
#: a quantized product's parts
_Packed = Any


def _packed(product: Any, kind: Backend) -> _Packed | None:
    """`product`'s weights packed for `kind`'s products, or None where they are not."""
    if kind is Backend.QUANT_OPS:
        return product.packed_parts() if hasattr(product, "packed_parts") else None
    if kind is Backend.F32_OPS:
        return product.f32_weight()
    return product.amx_weight()


def _flat(packed: tuple[_Packed | None, ...]) -> list[Any]:
    """The objects `packed` holds, quantized parts one by one (what identity compares)."""
    return [w for x in packed for w in (x if isinstance(x, tuple) else (x,))]


def _arrays(packed: _Packed, kind: Backend) -> Any:
    """What `_core.LeanLayer` takes of a packed product: its array, or the quantized parts
    as (qtype, packed rows, rows) each."""
    if kind is Backend.QUANT_OPS:
        return [(w.qtype, w.packed.numpy(), w.n) for w in packed]
    return numpy_view(packed.packed)


def _weight_dtype(packed: _Packed, kind: Backend) -> str:
    if kind is Backend.QUANT_OPS:
        return "quantized"
    return _PANELS[packed.dtype] if kind is Backend.F32_OPS else "bfloat16"


def _bias(product: Any, packed: _Packed) -> Any:
    """The product's float32 bias as numpy (None without one)."""
    bias = product.bias if isinstance(packed, tuple) else packed.bias
    return None if bias is None else bias.numpy()
