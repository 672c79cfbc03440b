"""`QuantExperts`: a mixture-of-experts layer's experts whose matrices stay GGUF blocks.

llama.cpp stores a MoE layer's experts as three 3-D tensors, `ffn_gate_exps` and
`ffn_up_exps` [experts, intermediate, hidden] and `ffn_down_exps` [experts, hidden,
intermediate]: expert `e`'s matrix is rows `e * rows .. (e + 1) * rows` of the tensor seen as
a 2-D stack, so each expert is a row slice (a view) of the file's blocks. `QuantExperts`
takes the place of transformers' fused experts module (`Qwen3MoeExperts`, `Qwen2MoeExperts`:
`forward(hidden_states, top_k_index, top_k_weights)`) and computes what it computes, each
expert's products on `QuantLinear` layers (the kernels, or the reference path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ferrobatch.gguf.formats import QuantWeight
from ferrobatch.gguf.modules import QuantLinear

__all__ = ["QuantExperts"]


def _per_expert(weight: QuantWeight, experts: int) -> nn.ModuleList:
    """`weight` (the experts' matrices stacked by rows) as one `QuantLinear` an expert."""
    rows = weight.n // experts
    return nn.ModuleList(QuantLinear(weight.slice_rows(e * rows, (e + 1) * rows))
                         for e in range(experts))


class QuantExperts(nn.Module):
    """The experts of one MoE layer over GGUF blocks: `gate`, `up` [experts * intermediate,
    hidden] and `down` [experts * hidden, intermediate] stacked by rows; `act_fn` the
    activation of the gate (SiLU for Qwen2/3-MoE).

    `forward` is transformers' eager experts forward: for each expert some token picked, its
    tokens' `act_fn(gate(x)) * up(x)` through `down`, times the token's routing weight,
    added into the output in the experts' order."""

    def __init__(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight, num_experts: int,
                 act_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        if gate.n != up.n or gate.k != up.k or gate.n % num_experts or down.n % num_experts \
                or down.k * num_experts != gate.n:
            raise ValueError(f"experts' shapes disagree: gate [{gate.n}, {gate.k}], up "
                             f"[{up.n}, {up.k}], down [{down.n}, {down.k}] for {num_experts} "
                             "experts")
        self.num_experts = num_experts
        self.hidden_dim = gate.k
        self.intermediate_dim = down.k
        self.gate_proj = _per_expert(gate, num_experts)
        self.up_proj = _per_expert(up, num_experts)
        self.down_proj = _per_expert(down, num_experts)
        self.act_fn = act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
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
            x = hidden_states[token]
            h = self.act_fn(self.gate_proj[e](x)) * self.up_proj[e](x)
            h = self.down_proj[e](h) * top_k_weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, qtype={self.gate_proj[0].qtype}")
