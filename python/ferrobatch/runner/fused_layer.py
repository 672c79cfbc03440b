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
  does for them), and the step
  has at most `linear_policy.ONE_CALL_MAX_ROWS` rows (`linear_policy.one_call`);
* the layer's attention is ferrobatch's paged attention and every row of the step goes to
  the CPU decode kernel (`kernel_only_group`'s case: decode rows, or every row in the
  batch-invariant mode; no prompt rows on the prefill kernel, no SDPA rows), over a
  cache of a kernel dtype;
* the weights and norms make a `LeanLayer` (norms of one kernel dtype; Qwen3's per-head
  q/k norms with one epsilon run inside the call, as the lean forward's `_head_norm`).

Everything else is the lean forward's, the fallback: oneDNN's products (bf16 outputs, or
fp32 copies beyond `f32_ops`' rows), steps with SDPA rows, longer steps (the scratch the
Rust side keeps per thread stays a few MiB; above it the Python between the kernels costs
under 5%), other attention functions (the construction checks' own attention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ferrobatch import _core
from ferrobatch.attention import context
from ferrobatch.attention.forward import kernel_only_group
from ferrobatch.cpu import amx_ops, f32_ops
from ferrobatch.cpu.arrays import KERNEL_DTYPES, numpy_view
from ferrobatch.runner.cpu_linear import PackedLinears
from ferrobatch.runner.linear_policy import Backend

__all__ = ["FusedLayer", "available"]


def available() -> bool:
    """Whether this build of `ferrobatch._core` has `LeanLayer` and its products (bf16 or
    f32) run here."""
    return hasattr(_core, "LeanLayer") and (amx_ops.available() or f32_ops.available())


class FusedLayer:
    """The one-call forward of one lean layer's parts (`lean_layers._Layer`), made on first
    use and again whenever a packed weight or norm weight object changes."""

    def __init__(self, part: Any, linears: PackedLinears) -> None:
        self._part = part
        self._linears = linears
        #: per weight kind (False: bf16 for `amx_ops`, True: fp32 for `f32_ops`), the
        #: weights and norms a `_core.LeanLayer` was made of, and that layer
        self._made: dict[bool, tuple[Any, ...]] = {}
        self._layers: dict[bool, Any] = {}

    def _lean_layer(self, wide: bool) -> Any:
        """The `_core.LeanLayer` of the current weights (packed for `f32_ops` if `wide`, else
        for `amx_ops`), or None (a product not packed so, or norm weights in a dtype the
        kernels lack)."""
        p = self._part
        parts = (p.qkv, p.o, p.gate_up, p.down)
        packed = tuple(x.f32_weight() if wide else x.amx_weight() for x in parts)
        norms = tuple(p.norm_weight(i) for i in ((0, 1, 2, 3) if p.q_norm is not None
                                                 else (0, 1)))
        made = (*packed, *norms)
        last = self._made.get(wide, ())
        if len(made) == len(last) and all(a is b for a, b in zip(made, last, strict=True)):
            return self._layers[wide]
        self._made[wide], self._layers[wide] = made, None
        if any(w is None for w in packed) or any(n.dtype != norms[0].dtype for n in norms) \
                or norms[0].dtype not in KERNEL_DTYPES \
                or wide and len({w.dtype for w in packed}) > 1:
            return None
        qk = {} if len(norms) == 2 else {
            "q_norm": numpy_view(norms[2]), "k_norm": numpy_view(norms[3]),
            "qk_norm_eps": float(p.q_norm.variance_epsilon)}
        if qk and p.q_norm.variance_epsilon != p.k_norm.variance_epsilon:
            return None
        qkv, o, gate_up, down = packed
        self._layers[wide] = _core.LeanLayer(
            input_norm=numpy_view(norms[0]), post_norm=numpy_view(norms[1]),
            norm_dtype=KERNEL_DTYPES[norms[0].dtype],
            input_eps=float(p.norms[0].variance_epsilon),
            post_eps=float(p.norms[1].variance_epsilon),
            qkv=numpy_view(qkv.packed), o=numpy_view(o.packed),
            gate_up=numpy_view(gate_up.packed), down=numpy_view(down.packed),
            hidden=qkv.k, heads=p.heads, kv_heads=p.kv_heads, dim=p.dim, inter=p.inter,
            qkv_bias=_bias(qkv), o_bias=_bias(o), gate_up_bias=_bias(gate_up),
            down_bias=_bias(down), weight_dtype=_PANELS[qkv.dtype] if wide else "bfloat16",
            **qk)
        return self._layers[wide]

    def forward(self, x: torch.Tensor, step: Any,
                rope: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Backend | None:
        """The layer on the fp32 residual rows `x` [T, H] (updated in place) in one call
        where the policy, the step and the weights allow it (see the module docstring):
        returns the backend its products ran on (`f32_ops` or `amx_ops`); None, with
        nothing done, where not (the caller runs the lean forward). `rope()` gives the
        position embeddings' fp32 rows (cos, sin)."""
        wide = self._linears.one_call(x.shape[0])
        if wide is None:
            return None
        p = self._part
        if step is None or p.attn.config._attn_implementation != context.ATTENTION_NAME:
            return None
        layer_idx = p.attn.layer_idx
        group = kernel_only_group(step, layer_idx)
        if group is None:
            return None
        kd = group.kernel_decode
        k_cache, v_cache = step.cache.keys[layer_idx], step.cache.values[layer_idx]
        # an int8 cache (quantized on write) takes the lean forward: its write and kernel
        # attention are `kernel_only_attention`'s
        if step.cache.quantized or k_cache.dtype not in KERNEL_DTYPES \
                or k_cache.device.type != "cpu":
            return None
        layer = self._lean_layer(wide)
        if layer is None:
            return None
        cos, sin = rope()
        step.calls += 1
        layer.forward(
            x.numpy(), numpy_view(k_cache), numpy_view(v_cache), cos.numpy(),
            sin.numpy(), group.slot_mapping.numpy(), kd.block_tables, kd.seqlens,
            cache_dtype=KERNEL_DTYPES[k_cache.dtype], page=step.cache.page_size,
            window=kd.window, scale=float(p.attn.scaling), threads=torch.get_num_threads())
        return Backend.F32_OPS if wide else Backend.AMX_OPS


#: `_core.LeanLayer`'s `weight_dtype` of `f32_ops`' packing, by its stored dtype (half
#: weights as stored, widened in the product)
_PANELS = {torch.float32: "float32", torch.bfloat16: "bfloat16_panels",
           torch.float16: "float16_panels"}


def _bias(w: amx_ops.AmxWeight | f32_ops.F32Weight) -> Any:
    return None if w.bias is None else w.bias.numpy()
