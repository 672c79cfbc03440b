"""The base model's forward without transformers' per-step machinery, for plain decoders
whose whole layer stack runs in one call (`fused_layer.FusedStack`).

A plain decoder's base model (Llama, Mistral, Qwen2, Qwen3) embeds the tokens, makes the
attention masks, the rotary embedding, runs its layers in order and normalizes. Under
ferrobatch the masks are unused (the paged attention reads the step), and where the stack
runs, the first layer's call runs every layer and the others only return. A one-token
decode step of a 1.5B GGUF model spent ~1.5 ms a token in that machinery (the forward's
decorators, the mask, 28 layer calls through `nn.Module.__call__`). `DirectForward` runs
the same operations on the same tensors, in the same order: the embedding, the rotary
embedding, the stack in one call, the final norm. The hidden states are the same bits as
the model's own forward.

It applies only to the classes named in `CLASSES`, with their own (not overridden) forward,
and never while any forward hook or pre-hook is registered on the base model, its layers
or its parts, or globally (those would not run). Where the stack can't run a step (a prompt's
rows, more rows than one call takes, a policy or cache that asks for the layers' own
calls), the model's forward runs on the embeddings already made."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.nn.modules import module as torch_module

__all__ = ["CLASSES", "DirectForward"]

#: base models whose forward is exactly: embed, (masks), rotary embedding, the layers in
#: order with the same position embeddings, final norm (transformers 5.x)
CLASSES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})


class DirectForward:
    """The base model's last hidden states [1, T, H] for a step, the stack run in one call;
    `of(base, lean)` is None where the model is not a plain decoder (see the module
    docstring). `FERROBATCH_DIRECT_FORWARD=0` (or `ENABLED = False` before the engine is
    made) leaves every step to the model's own forward."""

    ENABLED = os.environ.get("FERROBATCH_DIRECT_FORWARD", "1") != "0"

    def __init__(self, base: torch.nn.Module, lean: Any) -> None:
        self.base = base
        self._lean = lean
        self._parts = [base, base.embed_tokens, base.rotary_emb, base.norm, *base.layers]

    @classmethod
    def of(cls, base: torch.nn.Module | None, lean: Any) -> DirectForward | None:
        """The direct forward of `base` over the lean layers `lean`, or None."""
        if base is None or lean is None:
            return None
        kind = type(base)
        # (transformers' own class, so its own forward; none replaced on the instance)
        if kind.__name__ not in CLASSES or not kind.__module__.startswith("transformers.") \
                or "forward" in base.__dict__ \
                or any(getattr(base, a, None) is None
                       for a in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return None
        if len(base.layers) != base.config.num_hidden_layers:
            return None
        return cls(base, lean)

    def _hooked(self) -> bool:
        """Whether a forward hook or pre-hook would run in the model's own forward."""
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self._parts)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: Any,
                 **kwargs: Any) -> torch.Tensor:
        """The last hidden states [1, T, H] of `input_ids` [1, T] at `positions` [1, T]
        over `step`; `kwargs` go to the model's own forward where it runs."""
        base = self.base
        if self._hooked():
            return base(input_ids=input_ids, position_ids=positions, **kwargs)[0]
        hidden = base.embed_tokens(input_ids)
        rope = base.rotary_emb(hidden, positions)
        if not self._lean.run_stack(hidden, step, rope):
            return base(inputs_embeds=hidden, position_ids=positions, **kwargs)[0]
        return base.norm(hidden)
