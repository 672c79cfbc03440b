"""Lean forwards for Llama-style decoder layers of a CPU model with fp32 activations.

With packed weights and an fp32 residual stream (`ferrobatch.runner.cpu_linear`: an fp32
model's, or half-precision weights widened), a decoder layer's matrix products are a third
of its cost at decode batch sizes in bf16 (most of it in fp32); the rest is transformers'
elementwise code (RMSNorm, rotary embeddings, SiLU * up, residual adds, and the dtype
conversions between fp32 and bf16 operands) and the Python around it. `LeanLayers` runs
such a layer as four packed products, the attention function the model's config selects
(ferrobatch's paged attention in a step), and four fused kernels of `ferrobatch.cpu.fused_ops`:

    h = rms_norm(x)                       (the products' input dtype: bf16, or fp32)
    qkv = [q | k | v] product of h        (one stacked product)
    q, k = rope(qkv)                      (q fp32, k in the KV cache's dtype)
    x += o_proj(attention(q, k, v))       (folded into the next norm)
    h = rms_norm(x)
    x += down_proj(silu_mul(gate_up product of h))

Which layers: those whose class is one of `LAYER_CLASSES` (transformers' Llama, Mistral,
Qwen2, Qwen3, Phi-3 layers (Phi-3's fused q/k/v and gate/up projections as they are;
Phi-4-mini's rotary embedding over part of each head, the rest of the head copied):
pre-norm, RMSNorm, rotate-half rope,
SiLU-gated MLP; Qwen3's per-head q/k RMSNorms run as `fused_ops.rms_norm` over each head's
row), whose q/k/v and gate/up products are stacked groups of the packed linears, and whose
attention has no extra state. Gemma, Gemma 2 and Gemma 3 layers run the same way with
their differences: every norm weight counts as `1 + w` (the kernels' `weight_offset`), the
MLP gates with GELU's tanh approximation, Gemma 2 / 3 normalize the attention's and the
MLP's outputs before each joins the residual (`post_attention_layernorm` and
`post_feedforward_layernorm`; `pre_feedforward_layernorm` is then the norm before the MLP),
and Gemma 2 caps attention scores (`attn_logit_softcapping`). Qwen2/3-MoE and Mixtral
layers run the same attention; their MoE block (router, experts, shared expert) runs as the
model's own module on the normed rows (a GGUF model's experts: one kernel call a layer,
`ferrobatch.gguf.experts`). Where a step allows it, the whole layer (not a MoE one) runs in
one call of `_core.LeanLayer` instead (`fused_layer.FusedLayer.forward`, asked first on
every step, decides; bit-equal to the forward here, which is the fallback for everything
the one call cannot run). The runner also
checks, on two short forwards through the model's own attention, that the lean layers'
logits are within twice the model's own layers' distance from the exact fp32 computation on
the same packed weights; if not, nothing changes. The caller's model is never modified: the
layers' `forward` is an instance attribute only inside `active()`, and calls from other
threads get the layer's own forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ferrobatch.attention import context
from ferrobatch.attention.forward import kernel_only_attention
from ferrobatch.cpu import fused_ops
from ferrobatch.runner.cpu_linear import PackedLinears
from ferrobatch.runner.fused_layer import FusedLayer, FusedStack
from ferrobatch.runner.fused_layer import available as fused_available

logger = logging.getLogger("ferrobatch")

__all__ = ["LAYER_CLASSES", "LeanLayers", "is_moe_block"]

#: decoder layer classes (by name) whose forward the lean one reproduces
LAYER_CLASSES = frozenset({
    "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
    "Qwen2MoeDecoderLayer", "Qwen3MoeDecoderLayer", "MixtralDecoderLayer", "Phi3DecoderLayer",
    "GemmaDecoderLayer", "Gemma2DecoderLayer", "Gemma3DecoderLayer",
})
#: RMSNorms `x * rsqrt(mean(x^2) + eps) * w` (epsilon `variance_epsilon`)
_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                           "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm", "MixtralRMSNorm",
                           "Phi3RMSNorm"})
#: Gemma's RMSNorms, `x * rsqrt(mean(x^2) + eps) * (1 + w)` in fp32 (epsilon `eps`)
_OFFSET_NORM_CLASSES = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})
#: attention classes that pass `attn_logit_softcapping` to their attention function (Gemma
#: 3 keeps the attribute but does not use it)
_SOFTCAP_ATTENTION = frozenset({"Gemma2Attention"})
#: MoE blocks run as their own module inside a lean layer (`forward(h [1, T, H])`)
_MOE_CLASSES = frozenset({"Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock",
                          "MixtralSparseMoeBlock"})


def is_moe_block(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` is a MoE block a lean layer runs as its own module."""
    return type(mlp).__name__ in _MOE_CLASSES


#: the gate activations the fused kernel has, by the activation module's class name
_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_pytorch_tanh",
                "PytorchGELUTanh": "gelu_pytorch_tanh",
                "NewGELUActivation": "gelu_pytorch_tanh"}


def _eps(norm: torch.nn.Module) -> float:
    """A supported RMSNorm's epsilon."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def _norm_kind(norm: Any) -> float | None:
    """The weight offset of a supported RMSNorm (0.0, or 1.0 for Gemma's `1 + w`), None for
    anything else."""
    name = type(norm).__name__
    if name in _NORM_CLASSES and hasattr(norm, "variance_epsilon"):
        return 0.0
    if name in _OFFSET_NORM_CLASSES and hasattr(norm, "eps"):
        return 1.0
    return None


def _activation(mlp: torch.nn.Module) -> str | None:
    """The MLP gate's activation as `fused_ops.silu_mul` names it, None where it has none."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    return _ACTIVATIONS.get(type(act).__name__)


def _sandwiched(layer: torch.nn.Module) -> bool:
    """Whether the layer normalizes its attention's and MLP's outputs (Gemma 2 / 3)."""
    return hasattr(layer, "pre_feedforward_layernorm") \
        and hasattr(layer, "post_feedforward_layernorm")


class _Layer:
    """The parts of one decoder layer the lean forward uses."""

    def __init__(self, layer: torch.nn.Module, linears: PackedLinears) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.attn = layer, attn
        self.qkv = linears.packed_of(_qkv_linears(attn))
        self.o = linears.packed_of([attn.o_proj])
        #: a MoE block, run as its own module (None: the SiLU-gated MLP's products below)
        self.moe = mlp if is_moe_block(mlp) else None
        dense = self.moe is None
        self.gate_up = linears.packed_of(_gate_up_linears(mlp)) if dense else None
        self.down = linears.packed_of([mlp.down_proj]) if dense else None
        self.dim = int(attn.head_dim)
        #: the rotated columns of each head
        self.rot = _rotary_dims(attn.config, self.dim)
        self.nq, self.nk = _qk_widths(attn)
        self.heads, self.kv_heads = self.nq // self.dim, self.nk // self.dim
        self.inter = sum(m.out_features for m in _gate_up_linears(mlp)) // 2 if dense else 0
        #: the norms before the attention and before the MLP
        self.norms = (layer.input_layernorm, layer.pre_feedforward_layernorm
                      if _sandwiched(layer) else layer.post_attention_layernorm)
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        #: the norms of the attention's and the MLP's outputs (Gemma 2 / 3), or None
        self.sandwich = (layer.post_attention_layernorm, layer.post_feedforward_layernorm) \
            if _sandwiched(layer) else None
        #: added to every norm weight: 1.0 for Gemma's `1 + w`
        self.norm_offset = _norm_kind(layer.input_layernorm) or 0.0
        self.activation = _activation(mlp) or "silu"
        self.softcap = getattr(attn, "attn_logit_softcapping", None) \
            if type(attn).__name__ in _SOFTCAP_ATTENTION else None
        #: per norm (input, pre-MLP, q, k, post-attention, post-MLP), (its weight, that weight
        #: detached): the kernels' view of a detached tensor is cheaper than of a parameter;
        #: again when the weight object is replaced
        self._norm_weights: list[tuple[Any, Any]] = [(None, None)] * 6
        #: the whole layer in one call, where the build has it (`fused_layer`; not a MoE
        #: layer's)
        self.fused = FusedLayer(self, linears) if fused_available() and dense else None

    def norm(self, i: int) -> torch.nn.Module:
        """Norm `i`: 0 input, 1 before the MLP, 2 q, 3 k, 4 the attention's output, 5 the
        MLP's output."""
        return (*self.norms, self.q_norm, self.k_norm, *(self.sandwich or (None, None)))[i]

    def eps(self, i: int) -> float:
        """The epsilon of norm `i` (see `norm`)."""
        return _eps(self.norm(i))

    def norm_weight(self, i: int) -> torch.Tensor:
        """The weight of norm `i` (see `norm`), detached."""
        w = self.norm(i).weight
        own, detached = self._norm_weights[i]
        if own is not w:
            detached = w.detach()
            self._norm_weights[i] = (w, detached)
        return detached

    @staticmethod
    def why_not(layer: torch.nn.Module, linears: PackedLinears) -> str | None:
        """Why `layer` can't run lean (None: it can)."""
        if type(layer).__name__ not in LAYER_CLASSES:
            return f"{type(layer).__name__} is not a known Llama-style layer"
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not hasattr(attn, "o_proj") or not (
                hasattr(attn, "qkv_proj") or all(hasattr(attn, n) for n in names)):
            return "no self_attn q/k/v/o projections or no mlp"
        moe = is_moe_block(mlp)
        if not moe and _activation(mlp) is None:
            return "the MLP activation is not SiLU or GELU's tanh approximation"
        if _rotary_dims(attn.config, int(attn.head_dim)) % 2:
            return "its rotary embedding covers an odd number of each head's columns"
        names = ["input_layernorm", "post_attention_layernorm"]
        if _sandwiched(layer):
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        kinds = {_norm_kind(getattr(layer, n, None)) for n in names}
        qk = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None for n in qk):
            kinds |= {_norm_kind(n) for n in qk}
        if None in kinds or len(kinds) > 1:
            return "its norms are not all Llama-style or all Gemma-style RMSNorms"
        if linears.packed_of(_qkv_linears(attn)) is None \
                or linears.packed_of([attn.o_proj]) is None or not moe and (
                    linears.packed_of(_gate_up_linears(mlp)) is None
                    or linears.packed_of([mlp.down_proj]) is None):
            return "its q/k/v or gate/up products are not stacked groups"
        nq, nk = _qk_widths(attn)
        if nq % attn.head_dim or nk % attn.head_dim or attn.head_dim % 2 or \
                sum(m.out_features for m in _qkv_linears(attn)) != nq + 2 * nk or \
                not moe and sum(m.out_features for m in _gate_up_linears(mlp)) % 2:
            return "its projection widths are not whole even-sized heads"
        if any(n is not None for n in qk) and not all(
                n is not None and tuple(n.weight.shape) == (attn.head_dim,) for n in qk):
            return "its q/k norms are not per-head RMSNorms of both q and k"
        return None


def _qkv_linears(attn: torch.nn.Module) -> list[torch.nn.Module]:
    """The q, k and v projections in that order (Phi-3's one `qkv_proj` holding all three)."""
    if hasattr(attn, "qkv_proj"):
        return [attn.qkv_proj]
    return [attn.q_proj, attn.k_proj, attn.v_proj]


def _gate_up_linears(mlp: torch.nn.Module) -> list[torch.nn.Module]:
    """The gate and up projections in that order (Phi-3's one `gate_up_proj`: gate rows,
    then up rows)."""
    if hasattr(mlp, "gate_up_proj"):
        return [mlp.gate_up_proj]
    return [mlp.gate_proj, mlp.up_proj]


def _qk_widths(attn: torch.nn.Module) -> tuple[int, int]:
    """The q and k columns of the q/k/v product."""
    if hasattr(attn, "qkv_proj"):
        config, dim = attn.config, int(attn.head_dim)
        return config.num_attention_heads * dim, config.num_key_value_heads * dim
    return attn.q_proj.out_features, attn.k_proj.out_features


def _decoder_of(model: torch.nn.Module) -> Any:
    """The module holding a causal LM's decoder layers (its `rotary_emb` too)."""
    try:
        return model.get_decoder()
    except (AttributeError, NotImplementedError):
        return getattr(model, "model", None)


def _one_rope(config: Any) -> bool:
    """Whether every decoder layer gets the same rotary embedding: not where the rope
    parameters differ by layer type (Gemma 3's local and global layers)."""
    params = getattr(config, "rope_parameters", None)
    types = set(getattr(config, "layer_types", None) or ())
    if not isinstance(params, dict) or not types or not types <= set(params):
        return True
    return all(params[t] == params[next(iter(types))] for t in types)


def _rotary_dims(config: Any, head_dim: int) -> int:
    """The columns of each head the rotary embedding rotates: all of them, or, where it
    covers part of each head (Phi-4-mini's 0.75), `int(head_dim * factor)` as transformers'
    rope initialization sizes cos / sin."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = getattr(config, "partial_rotary_factor", None) or params.get(
        "partial_rotary_factor", 1.0)
    return int(head_dim * float(factor or 1.0))


class LeanLayers:
    """The lean forwards of a model's Llama-style decoder layers (see the module docstring).
    Build with `LeanLayers.of(...)`, which returns None when they don't apply."""

    def __init__(self, layers: list[_Layer], linears: PackedLinears,
                 in_thread: Callable[[], bool], kv_dtype: torch.dtype,
                 whole_stack: bool = False, rotary: torch.nn.Module | None = None,
                 rope_types: list[str] | None = None) -> None:
        self._layers = layers
        self._kv_dtype = kv_dtype
        self._linears = linears
        self._in_thread = in_thread
        self._everywhere = False
        self._active = False
        #: (cos, sin) of the last forwards' position embeddings, their versions and their
        #: fp32 contiguous rows, the latest first: every layer of a forward gets the same
        #: two tensors, or one of two pairs (Gemma 3: local and global rope) (replaced as
        #: one tuple, so a reader never sees half of an update)
        self._rope: tuple[tuple[Any, ...], ...] = ()
        #: the gate/up products' fp32 outputs of the forward in progress, one buffer for all
        #: its layers (each layer's is read by its silu_mul before the next layer runs).
        #: One allocation a forward, not one a layer: a 512-token prefill's gate/up output
        #: of a 1.5B model is 37 MB, which glibc maps and unmaps at every allocation (past
        #: 32 MB), and the product's first writes then fault its pages in: ~5% of the
        #: prefill (docs/benchmarks.md). Dropped when the forward ends.
        self._gate_up_out: torch.Tensor | None = None
        #: whether layers may run in one `fused_layer` call (off: always the lean forward
        #: below; tests compare the two)
        self.fused_enabled = True
        #: where the layers' ropes differ by layer type (Gemma 3's local and global): the
        #: model's rotary embedding module, each layer's type, and the (cos, sin) the module
        #: gave each type in the forward in progress (recorded inside `active()`)
        self._rotary, self._rope_types = rotary, rope_types
        self._ropes: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        #: every layer in one call where a step allows it (`whole_stack`: `layers` are all
        #: of the model's decoder layers, in the order its forward runs them, none a MoE one)
        fused = [p.fused for p in layers]
        self._stack = FusedStack(
            fused, None if rope_types is None else self._layer_rope,
        ) if whole_stack and all(fused) else None
        self._forwards = [self._forward_of(p) for p in layers]

    @classmethod
    def of(cls, model: torch.nn.Module, linears: PackedLinears | None,
           in_thread: Callable[[], bool], kv_dtype: torch.dtype) -> LeanLayers | None:
        """The lean layers of `model` (new keys rounded to `kv_dtype`, the KV cache's), or
        None: no packed linears with fp32 activations (an fp32 model's, or widened ones over
        half-precision weights), no fused kernels, or a decoder layer that is not
        Llama-style (every layer must be: a model runs all lean or none)."""
        if (linears is None or linears.activation_dtype != torch.float32
                or not fused_ops.available()):
            return None
        decoder = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        if not decoder:
            return None
        for layer in decoder:
            why = _Layer.why_not(layer, linears)
            if why is not None:
                logger.info("ferrobatch: decoder layers run as the model's own (%s)", why)
                return None
        config = model.config.get_text_config()
        in_order = [getattr(m.self_attn, "layer_idx", None) for m in decoder] == \
            list(range(len(decoder))) == list(range(config.num_hidden_layers))
        rotary, types = None, None
        if not _one_rope(config):  # (one rope a layer type: the stack needs the module's)
            rotary = getattr(_decoder_of(model), "rotary_emb", None)
            types = list(config.layer_types)
        return cls([_Layer(m, linears) for m in decoder], linears, in_thread, kv_dtype,
                   whole_stack=in_order and (types is None or rotary is not None),
                   rotary=rotary, rope_types=types)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @contextmanager
    def active(self, everywhere: bool = False) -> Iterator[None]:
        """Inside the block the layers run lean in ferrobatch forwards (in any forward with
        `everywhere`: construction checks); on exit each layer's own `forward` is back.
        Must be entered inside the packed linears' `active()` (their packed weights are
        refreshed there)."""
        if self._active:
            yield
            return
        self._active, self._everywhere = True, everywhere
        try:
            for part, fwd in zip(self._layers, self._forwards, strict=True):
                part.layer.__dict__["forward"] = fwd  # `Module.__setattr__`, unchecked
            if self._rotary is not None:
                self._rotary.__dict__["forward"] = self._recording_rope()
            yield
        finally:
            for part in self._layers:
                part.layer.__dict__.pop("forward", None)
            if self._rotary is not None:
                self._rotary.__dict__.pop("forward", None)
            self._ropes = {}
            self._active = self._everywhere = False
            self._gate_up_out = None
            if self._stack is not None:
                self._stack.forget()

    def run_stack(self, hidden_states: torch.Tensor, step: Any,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Every decoder layer on the residual stream `hidden_states` [1, T, H] (fp32,
        updated in place) in one call of the whole stack, exactly as the first layer's lean
        forward would start it inside `active()`; False, with nothing done, where the stack
        can't run this step (the caller then runs the layers' forwards)."""
        stack = self._stack
        if stack is None or not self._active or not self.fused_enabled or step is None \
                or not self._takes(hidden_states):
            return False
        rope = self._rope_rows
        return stack.forward(hidden_states[0], step,
                             lambda: rope(*position_embeddings)) is not None

    def _takes(self, hidden_states: torch.Tensor) -> bool:
        """Whether this forward's residual stream `hidden_states` may run lean: an engine
        forward (any forward with `everywhere`), fp32 and contiguous."""
        return (self._in_thread() or self._everywhere) \
            and hidden_states.dtype == torch.float32 and hidden_states.is_contiguous()

    def _gate_up_buffer(self, product: Any, rows: int) -> torch.Tensor | None:
        """A contiguous fp32 [rows, width] view of the forward's gate/up buffer (grown as
        needed), or None where the products take no `out` (`width` None)."""
        width = self._linears.width(product)
        if width is None:
            return None
        need = rows * width
        buf = self._gate_up_out
        if buf is None or buf.numel() < need:
            buf = self._gate_up_out = torch.empty(need, dtype=torch.float32)
        return buf[:need].view(rows, width)

    def _forward_of(self, p: _Layer) -> Callable[..., torch.Tensor]:
        own = type(p.layer).forward
        layer = p.layer
        product = self._linears.wide_product
        input_dtype, kv_dtype = self._linears.input_dtype, self._kv_dtype
        rope_rows = self._rope_rows

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if args or not self._takes(hidden_states):
                return own(layer, hidden_states, *args, **kwargs)
            if p.fused is not None and self.fused_enabled and p.fused.forward(
                    hidden_states[0], kwargs.get(context.STEP_KWARG),
                    lambda: rope_rows(*kwargs["position_embeddings"])):
                return hidden_states
            return _lean_forward(p, hidden_states, product, input_dtype, kv_dtype, kwargs,
                                 rope_rows, self._gate_up_buffer)

        return forward

    def _recording_rope(self) -> Callable[..., Any]:
        """The rotary module's forward that also records what it gives each layer type
        (`rotary_emb(x, position_ids, layer_type)`, Gemma 3's call)."""
        rotary = self._rotary
        own = type(rotary).forward
        in_thread = self._in_thread

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = own(rotary, *args, **kwargs)
            kind = args[2] if len(args) > 2 else kwargs.get("layer_type")
            # (only the engine's own forwards: another thread's model call records nothing)
            if kind is not None and isinstance(out, tuple) and len(out) == 2 \
                    and (in_thread() or self._everywhere):
                self._ropes[kind] = out
            return out

        return forward

    def _layer_rope(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `i`'s rope rows in the forward in progress (`_rope_rows` of what the rotary
        module gave its layer type), None where none was recorded."""
        pair = self._ropes.get(self._rope_types[i]) if self._rope_types else None
        return None if pair is None else self._rope_rows(*pair)

    def _rope_rows(self, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos[0]`, `sin[0]` in fp32 and contiguous, made once per forward."""
        # an inference tensor has no version counter: its identity is the key
        version = None if cos.is_inference() or sin.is_inference() \
            else (cos._version, sin._version)
        for last in self._rope:
            if last[0] is cos and last[1] is sin and last[2] == version:
                return last[3], last[4]
        rows = cos[0].float().contiguous(), sin[0].float().contiguous()
        self._rope = ((cos, sin, version, *rows), *self._rope[:1])
        return rows


def _lean_forward(p: _Layer, hidden_states: torch.Tensor, product: Callable,
                  input_dtype: Callable[[int], torch.dtype], kv_dtype: torch.dtype,
                  kwargs: dict[str, Any],
                  rope_rows: Callable[[torch.Tensor, torch.Tensor],
                                      tuple[torch.Tensor, torch.Tensor]],
                  gate_up_buffer: Callable[[Any, int], torch.Tensor | None]) -> torch.Tensor:
    """One decoder layer on the fp32 residual stream `hidden_states` [1, T, H] (updated in
    place and returned); `input_dtype(tokens)` is the products' input dtype, `rope_rows(cos,
    sin)` gives the position embeddings' fp32 rows, `gate_up_buffer(product, tokens)` an
    `out` for the gate/up product (or None)."""
    x = hidden_states[0]
    tokens = x.shape[0]
    wdt = input_dtype(tokens)
    offset = p.norm_offset
    h = torch.empty(x.shape, dtype=wdt)
    fused_ops.rms_norm(x, p.norm_weight(0), h, p.eps(0), offset)
    qkv = product(p.qkv, h)
    q_src, q_off, k_src, k_off = qkv, 0, qkv, p.nq
    if p.q_norm is not None:  # (Qwen3: both, per head; the one-call layer does the same)
        q_src, k_src = _head_norm(p, qkv, 0, p.nq, 2), _head_norm(p, qkv, p.nq, p.nk, 3)
        k_off = 0
    cos, sin = rope_rows(*kwargs.pop("position_embeddings"))
    q = torch.empty(tokens, p.heads, p.dim, dtype=torch.float32)
    k = torch.empty(tokens, p.kv_heads, p.dim, dtype=kv_dtype)
    fused_ops.rope(q_src.contiguous(), cos, sin, q, q_off, p.heads, p.dim)
    fused_ops.rope(k_src.contiguous(), cos, sin, k, k_off, p.kv_heads, p.dim)
    attn = p.attn
    v = qkv[:, p.nq + p.nk:].view(tokens, p.kv_heads, p.dim)
    out = None
    step = kwargs.get(context.STEP_KWARG)
    if step is not None and attn.config._attn_implementation == context.ATTENTION_NAME:
        # every row on the CPU kernel: straight to it, past the attention interface
        out = kernel_only_attention(step, attn.layer_idx, q, k, v, attn.scaling, p.softcap)
    if out is None:
        out = _interface_attention(attn, q, k, v, kwargs, p.softcap)
    o = _sandwich_norm(p, product(p.o, out.reshape(tokens, p.nq)), 4)
    fused_ops.rms_norm(x, p.norm_weight(1), h, p.eps(1), offset, residual=o)
    if p.moe is not None:  # (the block's router and experts take the normed rows as they are)
        x.add_(p.moe(h.unsqueeze(0))[0])
        return hidden_states
    # (h's first use ended with the q/k/v product)
    gu = product(p.gate_up, h, gate_up_buffer(p.gate_up, tokens))
    a = torch.empty(tokens, p.inter, dtype=wdt)
    fused_ops.silu_mul(gu, a, p.activation)
    x.add_(_sandwich_norm(p, product(p.down, a), 5))
    return hidden_states


def _sandwich_norm(p: _Layer, out: torch.Tensor, norm: int) -> torch.Tensor:
    """`out` [T, H] as it joins the residual: normalized in fp32 by norm `norm` (4: the
    attention's output, 5: the MLP's) where the layer has them (Gemma 2 / 3), else as it
    is."""
    if p.sandwich is None:
        return out
    normed = torch.empty(out.shape, dtype=torch.float32)
    fused_ops.rms_norm(out, p.norm_weight(norm), normed, p.eps(norm), p.norm_offset)
    return normed


def _head_norm(p: _Layer, qkv: torch.Tensor, off: int, cols: int, norm: int) -> torch.Tensor:
    """Columns `off .. off + cols` of `qkv` [T, width] normalized per head (rows of
    `p.dim`) by q/k norm `norm` (2: q, 3: k): a contiguous copy of the slice through
    `fused_ops.rms_norm`, in `qkv`'s dtype; [T, cols]."""
    # (a copy where the slice is strided; one head of one row stays a view: copied here)
    rows = qkv[:, off:off + cols].reshape(-1, p.dim).contiguous()
    out = torch.empty(rows.shape, dtype=qkv.dtype)
    fused_ops.rms_norm(rows, p.norm_weight(norm), out, p.eps(norm), p.norm_offset)
    return out.view(qkv.shape[0], cols)


def _interface_attention(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, kwargs: dict[str, Any],
                         softcap: float | None = None) -> torch.Tensor:
    """The attention function the layer's config selects, as the layer's own attention
    calls it: q [T, H, D], k and v [T, Hkv, D]; output [1, T, H, D]."""
    if softcap is not None:
        kwargs = {**kwargs, "softcap": softcap}
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
    mask = kwargs.pop("attention_mask", None)  # None in a paged step (no dense mask)
    for name in ("position_ids", "past_key_values", "cache", "use_cache", "cache_position"):
        kwargs.pop(name, None)
    out, _ = interface(attn, q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                       v.transpose(0, 1).unsqueeze(0), mask, dropout=0.0,
                       scaling=attn.scaling, **_attention_kwargs(attn, kwargs))
    return out


def _attention_kwargs(attn: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The extra keyword arguments the layer's own attention passes its interface."""
    window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
    return {**kwargs, "sliding_window": window} if window is not None else kwargs
