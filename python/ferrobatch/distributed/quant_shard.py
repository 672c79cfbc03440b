"""Tensor parallelism for quantized models: a GGUF file, or a float checkpoint quantized on
load, split over the ranks by the model's transformers tensor-parallel plan.

Each rank loads the whole model lazily (a GGUF file's matrices are views of its memory
map: nothing is read until touched, except llama's q/k, whose reordered rows are copies
until cut) and keeps only its share (`split`), as `shard.load` does for float checkpoints.
A checkpoint to quantize is loaded whole as floats on every rank (the peak), cut, and only
the share quantized.

* column-parallel projections (the plan's ``colwise``: q/k/v, gate/up) keep whole rows
  (output features): GGUF blocks run along the input features, so any row range is whole
  blocks. q takes this rank's query heads; k/v its KV heads, or with ``num_kv_heads < N``
  the one KV head its query heads read (``rank * num_kv_heads // N``, as `shard` does);
  gate/up a range of MLP features;
* row-parallel ones (``rowwise``: o_proj, down_proj) keep the matching input columns, cut
  on block boundaries (32 weights for Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL, 256 for
  the K-types). The MLP width is split in whole blocks of the widest block among the down
  projections' types, unevenly where it does not divide (Qwen2.5-1.5B's 8960 = 35 blocks
  of 256: 18 and 17 blocks on two ranks); a query-head share that is not whole blocks of
  o_proj's type is refused (`FieldError`, field ``tensor_parallel_size``, naming the
  tensor);
* everything else (embeddings, norms, the output head) is replicated.

A row-parallel layer's outputs are partial sums: `reduce` all-reduces them, and its bias
is added after the sum, on every rank. A `QuantLinear`'s `reduce` runs in its own forward
and in the lean layers' product (`runner.quant_linears`); a float layer left unquantized
(a float tensor of a GGUF file, or a width that is not whole blocks) gets a forward hook
that does the same. `ShardInfo` (``model.ferrobatch_tp``) gives the runner the per-rank
head counts, as for a float shard.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ferrobatch.cpu import pages
from ferrobatch.distributed.shard import FIELD, ShardInfo, _heads, _text, check
from ferrobatch.errors import FieldError
from ferrobatch.gguf import loader, quantize
from ferrobatch.gguf.formats import QuantWeight, block_shape, row_bytes
from ferrobatch.gguf.loader import LoadPlan
from ferrobatch.gguf.modules import QuantLinear, quantized_modules
from ferrobatch.gguf.reader import GGUFFile

__all__ = ["Split", "attach_reductions", "check_gguf", "load_gguf_shard", "load_quantized_shard",
           "plan_split", "split", "split_range"]


def split_range(units: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s [start, stop) of `units` whole units over `size` ranks: as even as
    possible, the first ``units % size`` ranks one unit more."""
    base, extra = divmod(units, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class Split:
    """One rank's share: each split module's name -> ("col" or "row", [start, stop) of
    its rows or input columns)."""

    info: ShardInfo
    ranges: dict[str, tuple[str, tuple[int, int]]]
    inter: int  # this rank's MLP width


def _roles(model: nn.Module, config: Any) -> dict[str, str]:
    """Module name -> "colwise" / "rowwise" for the modules of the plan; other styles
    refused."""
    tcfg = _text(config)
    plan = dict(getattr(tcfg, "base_model_tp_plan", None) or {})
    prefix = str(getattr(model, "base_model_prefix", "model"))
    roles: dict[str, str] = {}
    for name, _ in model.named_modules():
        inner = name[len(prefix) + 1:] if name.startswith(prefix + ".") else None
        if inner is None:
            continue
        for pattern, style in plan.items():
            if not fnmatch.fnmatchcase(inner, pattern):
                continue
            if style in ("colwise", "rowwise"):
                roles[name] = style
            elif not style.startswith("replicate"):
                raise FieldError(f"{type(model).__name__}: {name} is split as {style!r} in its "
                                 "tensor-parallel plan, which quantized models do not support "
                                 "(tensor_parallel_size must be 1)", field=FIELD)
    return roles


def _qtype(module: nn.Module) -> str | None:
    """The quantized type of a module's weight (None: float)."""
    return module.qtype if isinstance(module, QuantLinear) else None


def _block(qtype: str | None) -> int:
    """Weights per block along the input dimension (1 for float weights)."""
    return block_shape(qtype)[0] if qtype is not None else 1


def _kind(name: str) -> str:
    leaf = name.rpartition(".")[2]
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return leaf[0]
    if leaf in ("gate_proj", "up_proj", "down_proj"):
        return "mlp"
    return "?"


def plan_split(model: nn.Module, rank: int, size: int, *,
               qtype_of: Callable[[nn.Module], str | None] = _qtype, what: str = "") -> Split:
    """This rank's `Split` of `model` (a transformers model whose projections are
    `QuantLinear` or `nn.Linear`), or `FieldError` (field ``tensor_parallel_size``) where
    its heads or widths cannot be cut on block boundaries. `qtype_of(module)`: the type a
    row-parallel module's weight is (or will be) quantized to, whose blocks its input
    columns are cut on (None: float, cut anywhere)."""
    config = model.config
    info = check(config, size)
    heads, kv, hd = _heads(_text(config))
    roles = _roles(model, config)
    modules = dict(model.named_modules())
    kinds = {_kind(n) for n in roles}
    if "?" in kinds or not {"q", "k", "v", "o"} <= kinds:
        raise FieldError(f"{what or type(model).__name__}: quantized tensor parallelism "
                         "splits Llama-style q/k/v/o and gate/up/down projections; this "
                         f"plan splits {', '.join(sorted(roles))}", field=FIELD)
    per = heads // size
    q_rows = (rank * per * hd, (rank + 1) * per * hd)
    if info.replicated_kv:
        head = rank * kv // size
        kv_rows = (head * hd, (head + 1) * hd)
    else:
        kv_rows = (rank * (kv // size) * hd, (rank + 1) * (kv // size) * hd)
    downs = [n for n in roles if _kind(n) == "mlp" and roles[n] == "rowwise"]
    unit = max([_block(qtype_of(modules[n])) for n in downs] or [1])
    inter = int(getattr(_text(config), "intermediate_size", 0) or 0)
    if downs:
        inter = modules[downs[0]].in_features
    if inter % unit or inter // unit < size:
        raise FieldError(f"{what or type(model).__name__}: the MLP width {inter} is not "
                         f"{size} or more whole blocks of {unit} ({downs[0] if downs else ''}); "
                         f"tensor_parallel_size={size} cannot split it", field=FIELD)
    start, stop = split_range(inter // unit, rank, size)
    mlp_rows = (start * unit, stop * unit)
    ranges: dict[str, tuple[str, tuple[int, int]]] = {}
    for name, style in roles.items():
        kind = _kind(name)
        rows = {"q": q_rows, "k": kv_rows, "v": kv_rows, "o": q_rows, "mlp": mlp_rows}[kind]
        if style == "rowwise":
            qtype = qtype_of(modules[name])
            if kind == "o" and per * hd % _block(qtype):
                raise FieldError(
                    f"{what or type(model).__name__}: {name} ({qtype}) would be cut at input "
                    f"column {per * hd}, not a whole block of {_block(qtype)}: "
                    f"tensor_parallel_size={size} cannot split it", field=FIELD)
            ranges[name] = ("row", rows)
        else:
            ranges[name] = ("col", rows)
    return Split(ShardInfo(rank, size, info.heads, info.kv_heads, hd, info.replicated_kv),
                 ranges, mlp_rows[1] - mlp_rows[0])


def _owned(t: torch.Tensor, keep_view: Callable[[torch.Tensor], bool]) -> torch.Tensor:
    """`t` contiguous; a copy unless `keep_view(t)` (a view of a file's map: no memory)."""
    if t.is_contiguous() and keep_view(t):
        return t
    return t.contiguous().clone()


def _cut_quant(m: QuantLinear, side: str, lo: int, hi: int,
               keep_view: Callable[[torch.Tensor], bool]) -> QuantLinear:
    qw = m.weight_q
    bias = m.bias.detach() if m.bias is not None else None
    if side == "col":
        data = _owned(qw.data[lo:hi], keep_view)
        new = QuantWeight(qw.qtype, hi - lo, qw.k, data)
        bias = bias[lo:hi].clone() if bias is not None else None
    else:  # every row's range of blocks: a copy (the file's pages it read given back)
        b0, b1 = row_bytes(qw.qtype, lo), row_bytes(qw.qtype, hi)
        new = QuantWeight(qw.qtype, qw.n, hi - lo, qw.data[:, b0:b1].contiguous())
        if keep_view(qw.data):
            pages.release([qw.data])
    return QuantLinear(new, bias)


def _cut_float(m: nn.Linear, side: str, lo: int, hi: int) -> nn.Linear:
    w = m.weight.detach()
    bias = m.bias.detach() if m.bias is not None else None
    if side == "col":
        w, bias = w[lo:hi], (bias[lo:hi] if bias is not None else None)
    else:
        w = w[:, lo:hi]
    new = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    new.weight = nn.Parameter(w.contiguous().clone(), requires_grad=False)
    if bias is not None:
        new.bias = nn.Parameter(bias.contiguous().clone(), requires_grad=False)
    return new


def split(model: nn.Module, s: Split,
          keep_view: Callable[[torch.Tensor], bool] = lambda t: False) -> nn.Module:
    """`model` cut to rank `s`'s share in place (see the module docstring), returned.
    `keep_view(rows)`: whether a column-parallel slice of quantized rows may stay a view
    (of a file's memory map) rather than a copy of its own."""
    for name, (side, (lo, hi)) in s.ranges.items():
        m = model.get_submodule(name)
        if isinstance(m, QuantLinear):
            new: nn.Module = _cut_quant(m, side, lo, hi, keep_view)
        elif type(m) is nn.Linear:
            new = _cut_float(m, side, lo, hi)
        else:
            raise FieldError(f"{name} is a {type(m).__name__}: tensor_parallel_size > 1 splits "
                             "linear layers only", field=FIELD)
        model.set_submodule(name, new)
    if s.info.replicated_kv:
        for module in model.modules():
            if hasattr(module, "num_key_value_groups") and hasattr(module, "k_proj"):
                module.num_key_value_groups = s.info.heads  # one KV head for these heads
    model.ferrobatch_tp = s.info
    return model


def _all_reduce(bias: torch.Tensor | None,
                ordered: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reduction of a row-parallel layer's partial outputs, then its bias. `ordered`
    (batch-invariant mode): every rank's part gathered and added in rank order, so each
    element's sum is the same whatever the tensor's size (gloo's all-reduce splits a tensor
    by its size, so with three or more ranks its order follows the step's rows)."""
    def reduce(y: torch.Tensor) -> torch.Tensor:
        if not y.is_contiguous():
            y = y.contiguous()
        if ordered:
            parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, y)
            y = parts[0]
            for part in parts[1:]:
                y.add_(part)
        else:
            dist.all_reduce(y)
        return y if bias is None else y.add_(bias)

    return reduce


def _hook(bias: torch.Tensor | None, ordered: bool = False) -> Callable[..., torch.Tensor]:
    reduce = _all_reduce(bias, ordered)

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return reduce(out)

    return hook


def attach_reductions(model: nn.Module, s: Split, ordered: bool = False) -> None:
    """Every row-parallel layer of `s` sums its partial outputs over the ranks (in rank
    order with `ordered`: batch-invariant mode), then adds its bias (see the module
    docstring)."""
    for name, (side, _) in s.ranges.items():
        if side != "row":
            continue
        m = model.get_submodule(name)
        if isinstance(m, QuantLinear):
            bias = m.bias.detach().float() if m.bias is not None else None
            m.bias = None
            m.reduce = _all_reduce(bias, ordered)
        else:
            bias = m.bias.detach() if m.bias is not None else None
            m.bias = None
            m.register_forward_hook(_hook(bias, ordered))


# ---------------------------------------------------------------------------- loading


def _quant_types(p: LoadPlan) -> dict[int, str]:
    """id(skeleton module) -> the quantized type it will hold (a GGUF plan)."""
    return {id(p.model.get_submodule(name.rpartition(".")[0])): item.entry.qtype
            for item in p.items if item.quantized for name in item.targets}


def check_gguf(path: Path, size: int) -> None:
    """`FieldError` (field ``tensor_parallel_size``) when the GGUF file at `path` cannot be
    split `size` ways; its config and tokenizer are cached for the ranks on the way."""
    p = loader.plan(path)
    loader.tokenizer_of(p)
    types = _quant_types(p)
    for rank in range(size):
        plan_split(p.model, rank, size, qtype_of=lambda m: types.get(id(m)), what=path.name)


def load_gguf_shard(path: Path, rank: int, size: int, dtype: Any,
                    ordered: bool = False) -> tuple[Any, Any]:
    """(this rank's share of the GGUF file at `path`, its tokenizer); `ordered`: the
    reductions in rank order (batch-invariant mode)."""
    def adjust(model: nn.Module, file: GGUFFile) -> None:
        def mapped(t: torch.Tensor) -> bool:
            return file.maps(t.data_ptr(), t.numel())

        s = plan_split(model, rank, size, what=path.name)
        split(model, s, keep_view=mapped)
        attach_reductions(model, s, ordered)
        held = {m.qdata.data_ptr(): m.qdata for m in quantized_modules(model)}
        info = model.ferrobatch_gguf  # this rank's share, not the file's
        info.quantized_bytes = sum(t.numel() for t in held.values())
        info.mapped_bytes = sum(t.numel() for t in held.values() if mapped(t))

    return loader.load_gguf(path, dtype=dtype, adjust=adjust)


def load_quantized_shard(rank: int, size: int, quantization: str,
                         load_plain: Callable[[], tuple[Any, Any]],
                         ordered: bool = False,
                         dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(this rank's share of a float checkpoint quantized to `quantization`, its tokenizer):
    `load_plain()` loads the whole checkpoint as floats; each rank cuts its share, then
    quantizes it (`gguf.quantize`; a row-parallel share whose width is not whole blocks
    keeps float weights). `dtype`: the embedding's output dtype (default: the model's)."""
    qtype = quantize.check_name(quantization)
    loaded, tokenizer = load_plain()
    widths = {name: m.weight.shape[1] for name, m in loaded.named_modules()
              if isinstance(m, nn.Linear | nn.Embedding)}
    s = plan_split(loaded, rank, size,
                   qtype_of=lambda m: quantize.type_for_width(qtype, m.weight.shape[1]))
    split(loaded, s)
    quantize.quantize_model(loaded, qtype, widths=widths, dtype=dtype)
    attach_reductions(loaded, s, ordered)
    return loaded, tokenizer


def load_float_shard(rank: int, size: int,
                     load_plain: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """(this rank's share of a float checkpoint as plain `nn.Linear` slices, its tokenizer),
    for the batch-invariant mode: `load_plain()` loads the whole checkpoint; each rank cuts
    its share (anywhere: float weights have no blocks), and the row-parallel layers sum
    their parts in rank order. (The default loads float checkpoints through transformers'
    own plan, `distributed.shard`, whose products and all-reduce are torch's.)"""
    loaded, tokenizer = load_plain()
    s = plan_split(loaded, rank, size)
    split(loaded, s)
    attach_reductions(loaded, s, ordered=True)
    return loaded, tokenizer
