"""Loading a checkpoint sharded by transformers' own tensor-parallel plan.

`check` refuses what cannot be sharded (`FieldError`, field ``tensor_parallel_size``): a
model whose config has no ``base_model_tp_plan``, query heads not divisible by N, KV heads
that neither divide by N nor divide N. `load` runs ``from_pretrained`` with a
``DistributedConfig(tp_size=N)`` and the model's plan, with two overrides:

* ``lm_head`` is replicated (``"replicate"``): every rank holds the whole head, so the
  logits are complete on every rank without a gather and the runner's own head products
  (packed weight, greedy screen) see a plain tensor;
* with ``num_kv_heads < N`` the K / V projections are replicated too, and each rank then
  keeps only the KV head its query heads read (``rank * num_kv_heads // N``), as vLLM does;
  the attention modules' ``num_key_value_groups`` follow.

Each rank's `ShardInfo` (``model.ferrobatch_tp``) gives the runner the per-rank head counts
its KV cache is sized with.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ferrobatch.errors import FieldError

FIELD = "tensor_parallel_size"


@dataclass(frozen=True)
class ShardInfo:
    """One rank's share of the attention heads."""

    rank: int
    size: int
    heads: int  # query heads on this rank
    kv_heads: int  # KV heads on this rank (cache width)
    head_dim: int
    replicated_kv: bool  # num_kv_heads < size: each rank keeps one KV head


def _text(cfg: Any) -> Any:
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _heads(tcfg: Any) -> tuple[int, int, int]:
    heads = int(tcfg.num_attention_heads)
    kv = int(getattr(tcfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads)
    return heads, kv, head_dim


def check(config: Any, size: int) -> ShardInfo:
    """Rank 0's `ShardInfo`, or `FieldError` when `config` cannot be split `size` ways."""
    tcfg = _text(config)
    name = getattr(config, "model_type", type(config).__name__)
    plan = getattr(tcfg, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise FieldError(
            f"{name} has no tensor-parallel plan (config.base_model_tp_plan) in transformers; "
            f"tensor_parallel_size={size} cannot shard it (use tensor_parallel_size=1)",
            field=FIELD)
    heads, kv, head_dim = _heads(tcfg)
    if heads % size:
        raise FieldError(
            f"{name} has {heads} attention heads, not divisible by tensor_parallel_size={size}",
            field=FIELD)
    if kv % size and size % kv:
        raise FieldError(
            f"{name} has {kv} KV heads: tensor_parallel_size={size} must divide them or be a "
            "multiple of them", field=FIELD)
    if kv < size and not any(k.endswith(("k_proj", "v_proj")) for k in plan):
        raise FieldError(
            f"{name}: {kv} KV heads < tensor_parallel_size={size} needs separate k_proj / "
            "v_proj projections to replicate (this plan has none)", field=FIELD)
    return ShardInfo(0, size, heads // size, max(1, kv // size), head_dim, kv < size)


def per_rank_config(config: Any, size: int) -> Any:
    """A copy of the text config with one rank's heads and MLP width (cache sizing)."""
    tcfg = copy.deepcopy(_text(config))
    heads, kv, head_dim = _heads(tcfg)
    tcfg.head_dim = head_dim
    tcfg.num_attention_heads = heads // size
    tcfg.num_key_value_heads = max(1, kv // size)
    inter = getattr(tcfg, "intermediate_size", None)
    if isinstance(inter, int):
        tcfg.intermediate_size = -(-inter // size)
    return tcfg


def _prefix(config: Any) -> str:
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return str(getattr(cls, "base_model_prefix", "model"))


def load(path: str | Path, rank: int, size: int, dtype: torch.dtype) -> Any:
    """This rank's shard of the checkpoint at `path` (eval mode, fp32 unless `dtype`)."""
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    info = check(config, size)
    base_plan = dict(getattr(_text(config), "base_model_tp_plan", None) or {})
    prefix = _prefix(config)
    override: dict[str, str] = {"lm_head": "replicate"}
    for key in base_plan:
        if info.replicated_kv and key.endswith(("k_proj", "v_proj")):
            override[f"{prefix}.{key}"] = "replicate"
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype=dtype,
        distributed_config=DistributedConfig(tp_size=size, tp_plan=override),
    ).eval()
    _materialize(model, ("lm_head",))
    if info.replicated_kv:
        _keep_kv_head(model, rank, size, info)
    model.ferrobatch_tp = ShardInfo(rank, size, info.heads, info.kv_heads, info.head_dim,
                                    info.replicated_kv)
    return model


def _plain(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.data


def _materialize(model: Any, names: tuple[str, ...]) -> None:
    """Replicated parameters of `names` as plain tensors (a DTensor Replicate otherwise)."""
    for mname, module in model.named_modules():
        if not mname.endswith(names):
            continue
        for pname, p in list(module.named_parameters(recurse=False)):
            setattr(module, pname, torch.nn.Parameter(_plain(p).contiguous(),
                                                      requires_grad=False))


def _keep_kv_head(model: Any, rank: int, size: int, info: ShardInfo) -> None:
    """num_kv_heads < size: slice each replicated K / V projection to this rank's KV head."""
    kv_total = _heads(_text(model.config))[1]
    head = rank * kv_total // size
    hd = info.head_dim
    rows = slice(head * hd, (head + 1) * hd)
    for mname, module in model.named_modules():
        if not mname.endswith(("k_proj", "v_proj")) or not isinstance(module, torch.nn.Linear):
            continue
        module.weight = torch.nn.Parameter(_plain(module.weight)[rows].contiguous(),
                                           requires_grad=False)
        if module.bias is not None:
            module.bias = torch.nn.Parameter(_plain(module.bias)[rows].contiguous(),
                                             requires_grad=False)
        module.out_features = hd
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") and hasattr(module, "k_proj"):
            module.num_key_value_groups = info.heads  # one KV head for this rank's heads
