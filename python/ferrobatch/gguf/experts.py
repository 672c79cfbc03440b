"""`QuantExperts`: a mixture-of-experts layer's experts whose matrices stay GGUF blocks.

llama.cpp stores a MoE layer's experts as three 3-D tensors, `ffn_gate_exps` and
`ffn_up_exps` [experts, intermediate, hidden] and `ffn_down_exps` [experts, hidden,
intermediate]: expert `e`'s matrix is rows `e * rows .. (e + 1) * rows` of the tensor seen as
a 2-D stack, so each expert is a row slice (a view) of the file's blocks. `QuantExperts`
takes the place of transformers' fused experts module (`Qwen3MoeExperts`, `Qwen2MoeExperts`,
`MixtralExperts`:
`forward(hidden_states, top_k_index, top_k_weights)`) and computes what it computes.

Where the kernels run the products, one call a layer runs every expert the step's tokens
picked (`_core.QuantExperts`, `ferrobatch-kernels`' `moe`: each expert's gate and up rows
packed as one product, then `silu(gate) * up`, then down), made at the first such forward
or by `pack_own_products` (`modules.prepare_for_serving`). Otherwise (the reference path,
and the engine's construction probes, whose stand-in weights replace single `QuantLinear`
products) each expert's products run on its `QuantLinear` layers, the same loop in Python.
The two agree to the rounding of `silu` (the kernels' `exp` is within 2 ulp of torch's).

`OssQuantExperts` is gpt-oss's: each product with its bias, and the clamped SwiGLU of
`GptOssExperts` (`(clamp(up) + 1) * g * sigmoid(alpha * g)`, `g` the gate clamped above),
on the same one call a layer (biases and the clamped SwiGLU passed to it) or loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from ferrobatch import _core
from ferrobatch.cpu import quant_ops
from ferrobatch.gguf import modules
from ferrobatch.gguf.formats import QuantWeight
from ferrobatch.gguf.modules import QuantLinear

__all__ = ["ONE_CALL", "OssQuantExperts", "QuantExperts"]

#: whether the experts run as one kernel call a layer where the kernels run them (the
#: default); `FERROBATCH_MOE_ONE_CALL=0` (or setting this False) keeps the per-expert loop,
#: for A/B measures (`benches/gguf_moe.py`)
ONE_CALL = os.environ.get("FERROBATCH_MOE_ONE_CALL", "1") != "0"


def _per_expert(weight: QuantWeight, experts: int,
                bias: torch.Tensor | None = None) -> nn.ModuleList:
    """`weight` (the experts' matrices stacked by rows) as one `QuantLinear` an expert, each
    with its row of `bias` [experts, rows] where given."""
    rows = weight.n // experts
    return nn.ModuleList(
        QuantLinear(weight.slice_rows(e * rows, (e + 1) * rows),
                    None if bias is None else bias[e].clone())
        for e in range(experts))


class QuantExperts(nn.Module):
    """The experts of one MoE layer over GGUF blocks: `gate`, `up` [experts * intermediate,
    hidden] and `down` [experts * hidden, intermediate] stacked by rows; `act_fn` the
    activation of the gate (SiLU for Qwen2/3-MoE); `biases` (gate [experts, intermediate],
    up the same, down [experts, hidden]) added to each expert's products where given.

    `forward` is transformers' eager experts forward: for each expert some token picked, its
    tokens' `act_fn(gate(x)) * up(x)` through `down`, times the token's routing weight,
    added into the output in the experts' order."""

    def __init__(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight, num_experts: int,
                 act_fn: Callable[[torch.Tensor], torch.Tensor],
                 biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        if gate.n != up.n or gate.k != up.k or gate.n % num_experts \
                or down.k * num_experts != gate.n or down.n != gate.k * num_experts:
            raise ValueError(f"experts' shapes disagree: gate [{gate.n}, {gate.k}], up "
                             f"[{up.n}, {up.k}], down [{down.n}, {down.k}] for {num_experts} "
                             "experts")
        self.num_experts = num_experts
        self.hidden_dim = gate.k
        self.intermediate_dim = down.k
        rows = (self.intermediate_dim, self.intermediate_dim, self.hidden_dim)
        for name, b, n in zip(("gate", "up", "down"), biases or (), rows, strict=False):
            if tuple(b.shape) != (num_experts, n):
                raise ValueError(f"{name} bias has shape {list(b.shape)}, not "
                                 f"[{num_experts}, {n}]")
        gate_b, up_b, down_b = biases or (None, None, None)
        self.gate_proj = _per_expert(gate, num_experts, gate_b)
        self.up_proj = _per_expert(up, num_experts, up_b)
        self.down_proj = _per_expert(down, num_experts, down_b)
        self.act_fn = act_fn
        self._op: _core.QuantExperts | None = None
        self._silu = isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"
        self._qtypes = frozenset((gate.qtype, up.qtype, down.qtype))

    def _kernels_run(self) -> bool:
        """Whether this layer's products run on the kernels now (and on one fused call)."""
        return ONE_CALL and self._one_call_glu() and not modules.probing() and all(
            modules.kernels_run(q) for q in self._qtypes)

    def _one_call_glu(self) -> bool:
        """Whether the one call computes this layer's activation (SiLU here)."""
        return self._silu

    def _fused_extras(self) -> dict[str, object]:
        """`_core.QuantExperts` arguments beyond the matrices (none here)."""
        return {}

    def pack_own_products(self) -> list[QuantLinear]:
        """Pack the experts for the one-call products (where the kernels run them); returns
        the `QuantLinear` layers whose products that call makes instead (the gate and up
        ones: `prepare_for_serving` does not pack them, and drops copies made for them)."""
        if not self._kernels_run():
            return []
        self._fused_op()
        return [*self.gate_proj, *self.up_proj]

    def _fused_op(self) -> _core.QuantExperts:
        if self._op is None:
            gate_up, down = [], []
            # the gate's rows, then the up rows, side by side in one buffer reused for every
            # expert (a fresh one each time stays in the C heap after it is freed: ~200 MB a
            # layer of Qwen3-30B-A3B's shape until the heap is trimmed)
            rows = None
            for g, u, d in zip(self.gate_proj, self.up_proj, self.down_proj, strict=True):
                gw, uw = g.weight_q, u.weight_q
                if gw.qtype == uw.qtype:  # one product of both
                    if rows is None:
                        rows = torch.empty(gw.n + uw.n, gw.row_bytes, dtype=torch.uint8)
                    torch.cat([gw.data, uw.data], out=rows)
                    packed = quant_ops.pack(gw.qtype, rows, gw.n + uw.n, gw.k)
                    gate_up.append([(packed.qtype, packed.packed.numpy(), packed.n)])
                else:
                    gate_up.append([(p.qtype, p.packed.numpy(), p.n) for p in
                                    (modules.packed_weight(gw), modules.packed_weight(uw))])
                pd = modules.packed_weight(d.weight_q)
                down.append([(pd.qtype, pd.packed.numpy(), pd.n)])
            self._op = _core.QuantExperts(gate_up=gate_up, down=down, hidden=self.hidden_dim,
                                          inter=self.intermediate_dim,
                                          backend=quant_ops.backend(), **self._fused_extras())
        return self._op

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self._kernels_run():
            x = hidden_states.to(torch.float32).contiguous()
            out = torch.empty_like(x)
            self._fused_op().forward(x.numpy(), top_k_index.to(torch.int64).contiguous().numpy(),
                                     top_k_weights.to(torch.float32).contiguous().numpy(),
                                     out.numpy(), threads=torch.get_num_threads())
            return out.to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [experts + 1, top_k, tokens]: where each expert was picked (index `num_experts`:
            # no expert, as transformers' modules allow)
            picked = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            picked = picked.permute(2, 1, 0)
            hit = torch.greater(picked.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            slot, token = torch.where(picked[e])
            h = self._expert(e, hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s output for the rows `x` (before the routing weight)."""
        return self.down_proj[e](self.act_fn(self.gate_proj[e](x)) * self.up_proj[e](x))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, qtype={self.gate_proj[0].qtype}")


class OssQuantExperts(QuantExperts):
    """gpt-oss's experts over GGUF blocks (`GptOssExperts`' computation): `gate`, `up` and
    `down` stacked by rows as in `QuantExperts`, `biases` (gate [experts, intermediate], up
    the same, down [experts, hidden]) added to each product, and between them
    `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`."""

    def __init__(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight, num_experts: int,
                 biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor], limit: float,
                 alpha: float) -> None:
        super().__init__(gate, up, down, num_experts, nn.Identity(), biases)
        self.limit, self.alpha = float(limit), float(alpha)

    def _one_call_glu(self) -> bool:
        return True

    def _fused_extras(self) -> dict[str, object]:
        def f32(b: torch.Tensor) -> object:
            return b.detach().to(torch.float32).contiguous().numpy()

        return {"gate_up_bias": [f32(torch.cat([g.bias, u.bias])) for g, u in
                                 zip(self.gate_proj, self.up_proj, strict=True)],
                "down_bias": [f32(d.bias) for d in self.down_proj],
                "swiglu": (self.limit, self.alpha)}

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj[e](x).clamp(max=self.limit)
        up = self.up_proj[e](x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj[e]((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, limit={self.limit}, alpha={self.alpha}"
