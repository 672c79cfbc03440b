"""Load a GGUF file as a transformers model whose matrices stay quantized.

1. **Read and refuse** (`plan`): the header (`reader.GGUFFile`, a memory map), the
   architecture (`arch.check_architecture`), every tensor's type (`QUANT_TYPES` stay
   quantized, F32 / F16 / BF16 are read as floats, anything else is refused naming the
   tensor), the config (transformers' GGUF mapping + `arch.fix_config`), the model skeleton
   on the meta device (`accelerate.init_empty_weights`: no weight memory), the tensor names
   (transformers' `get_gguf_hf_weights_map`), each tensor's shape against the skeleton's,
   and that every parameter gets a tensor. Every refusal is a `FieldError` (field "model";
   "device" for a device other than the CPU) raised before any weight memory is committed.
2. **Fill**: small tensors (norms, biases) and float matrices as parameters in the model's
   dtype; each `nn.Linear` / `nn.Embedding` whose tensor is quantized replaced by a
   `QuantLinear` / `QuantEmbedding` over a `QuantWeight` that is a view of the file's map
   (llama's q/k rows, reordered by transformers' processor, are a copy in the new row order);
   a tied output head shares the embedding's `QuantWeight`. Llama 3's `rope_freqs` divide the
   rotary frequencies, as llama.cpp does; Phi-3's LongRoPE factors go into the config
   (`arch.fix_config`).

Config and tokenizer come from transformers' GGUF support (`load_gguf_checkpoint`,
`AutoTokenizer.from_pretrained(dir, gguf_file=name)`); both parse the whole vocabulary
(tens of seconds for a 150k-token vocabulary on a busy machine), so they are saved once per
file (path, size, mtime) under `cache_root()/gguf/` and read from there afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from accelerate import init_empty_weights
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)
from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map, load_gguf_checkpoint
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.pytorch_utils import Conv1D

from ferrobatch.errors import FieldError
from ferrobatch.gguf import arch as archs
from ferrobatch.gguf.experts import OssQuantExperts, QuantExperts
from ferrobatch.gguf.formats import FLOAT_TYPES, QUANT_TYPES, QuantWeight
from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear
from ferrobatch.gguf.reader import GGUFFile, TensorEntry
from ferrobatch.model_dtype import cache_root, cpu_has_native_bf16, resolve_dtype

__all__ = ["GGUFModelInfo", "LoadPlan", "fill", "load_gguf", "plan", "tokenizer_of"]

logger = logging.getLogger("ferrobatch")

#: bump when what is cached per file (config, tokenizer) changes meaning
_CACHE_VERSION = "1"
#: the output head's tensor (absent: the head is tied to the token embedding)
_OUTPUT = "output.weight"
_ROPE_FREQS = "rope_freqs.weight"
#: Phi-3 LongRoPE's factors (short, long): config values, not parameters (`arch.fix_config`)
_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
#: a MoE layer's experts: 3-D tensors [experts, rows, columns] (`ferrobatch.gguf.experts`)
_EXPERTS = re.compile(r"blk\.(?P<block>\d+)\.ffn_(?P<part>gate|up|down)_exps\."
                      r"(?P<kind>weight|bias)")


@dataclass
class _Item:
    """One GGUF tensor's way into the model."""

    entry: TensorEntry
    targets: list[str]  # the model's parameter names it fills (a tie group)
    quantized: bool  # stays a QuantWeight (else read as floats)
    shape: tuple[int, ...]  # the parameters' shape (the stored one may differ by unit dims)
    perm: np.ndarray | None = None  # row order of a quantized tensor (None: the file's)


@dataclass
class _Experts:
    """One MoE layer's three expert tensors, and the fused experts module they make."""

    module: str  # the model's experts module (`model.layers.N.mlp.experts`)
    parts: dict[str, TensorEntry]  # "gate", "up", "down" (+ "gate.bias", ... for gpt-oss)
    quantized: bool  # QuantExperts (else the module's float parameters)
    oss: bool = False  # gpt-oss's layout (`GptOssExperts`: [E, H, 2 I] interleaved, biases)


@dataclass
class GGUFModelInfo:
    """What `load_gguf` made of a file (`model.ferrobatch_gguf`)."""

    path: Path
    architecture: str
    file_bytes: int
    types: dict[str, int]  # tensor type -> count in the file
    quantized_modules: int  # QuantLinear + QuantEmbedding
    quantized_bytes: int  # bytes of quantized blocks the model holds (shared once)
    float_bytes: int  # bytes of the float parameters
    mapped_bytes: int  # of quantized_bytes, those that are views of the file's map
    load_seconds: float = 0.0


@dataclass
class LoadPlan:
    """Everything decided before any weight memory is committed (`plan`)."""

    file: GGUFFile
    architecture: str
    config: Any
    base_config: Any  # transformers' config, before `fix_config` (what is cached)
    model: Any  # the skeleton, parameters on the meta device
    processor: Any
    items: list[_Item]
    rope_freqs: TensorEntry | None
    dtype: torch.dtype
    cache_dir: Path | None
    config_cached: bool
    experts: list[_Experts]


# ---------------------------------------------------------------------------- plan


def _check_types(f: GGUFFile) -> None:
    for t in f.tensors.values():
        if t.qtype not in QUANT_TYPES and t.qtype not in FLOAT_TYPES:
            raise FieldError(
                f"{f.path}: tensor {t.name} has type {t.qtype}, which ferrobatch does not "
                f"load (quantized: {', '.join(QUANT_TYPES)}; float: {', '.join(FLOAT_TYPES)})",
                "model")


def _cache_dir(path: Path) -> Path:

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|" \
          f"{_CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{path.stem[:60]}-{digest}"


def _config_dict(f: GGUFFile) -> dict[str, Any]:
    embed = f.tensors.get("token_embd.weight")
    own = archs.own_config_dict(f.metadata, f.architecture,
                                int(embed.shape[0]) if embed is not None else 0,
                                _OUTPUT not in f.tensors)
    if own is not None:
        return own
    return dict(load_gguf_checkpoint(str(f.path), return_tensors=False)["config"])


def _base_config(f: GGUFFile, cache_dir: Path | None) -> tuple[Any, bool]:
    """transformers' config of the file (before `fix_config`), from the cache when there;
    and whether it came from there."""

    if cache_dir is not None and (cache_dir / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(str(cache_dir), local_files_only=True), True
        except Exception as exc:  # noqa: BLE001 - a damaged cache entry: read the file again
            logger.info("ferrobatch: GGUF config cache %s unreadable (%s)", cache_dir, exc)
    path = f.path
    d = _config_dict(f)
    model_type = d.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise FieldError(f"{path}: transformers has no config for model type {model_type!r}",
                         "model")
    cls: type[PretrainedConfig] = CONFIG_MAPPING[model_type]
    return cls.from_dict(d), False


def _resolve_dtype(dtype: Any, f: GGUFFile) -> torch.dtype:
    if dtype is None or dtype == "auto":
        if dtype == "auto":
            mats = [t.qtype for t in f.tensors.values() if len(t.shape) == 2]
            if mats and all(q in ("F16", "BF16") for q in mats) and cpu_has_native_bf16():
                return torch.bfloat16
        return torch.float32
    return resolve_dtype(dtype, torch.device("cpu"))


def _param_groups(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter name -> every name of the same parameter object (ties)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _module_kind(model: nn.Module, param: str) -> str:
    """"linear", "conv1d" (transformers' `Conv1D`: GPT-2's linears, weight [in, out]),
    "embedding" or "other" for the module holding parameter `param`."""

    mod_name, _, attr = param.rpartition(".")
    module = model.get_submodule(mod_name)
    if attr != "weight":
        return "other"
    if type(module) is nn.Linear:
        return "linear"
    if type(module) is Conv1D:
        return "conv1d"
    if type(module) is nn.Embedding or (isinstance(module, nn.Embedding)
                                        and type(module).__name__.endswith("ScaledWordEmbedding")):
        return "embedding"
    return "other"


@contextmanager
def _name_maps_cached() -> Iterator[None]:
    """`gguf.get_tensor_name_map` memoized while inside: transformers'
    `get_gguf_hf_weights_map` builds the same map again for every submodule it recurses
    into (about 400 times, 19 s, for SmolLM2); the map is only read."""

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _weights_map(skeleton: nn.Module, processor: Any, arch: str) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name (transformers' mapping, by the file's
    architecture: a Mistral written as `llama` is a `mistral` model to transformers, which
    gguf-py's name tables do not know)."""

    return get_gguf_hf_weights_map(skeleton, processor, model_type=arch)


def plan(path: str | os.PathLike, *, device: Any = None, dtype: Any = None,
         cache: bool = True) -> LoadPlan:
    """Read, check and map a GGUF file without committing weight memory (see the module
    docstring); `FieldError` for anything that would not load."""

    path = Path(path).expanduser()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cpu":
        raise FieldError(f"quantized GGUF weights run on the CPU only, not {dev}", "device")
    f = GGUFFile(path)
    arch = f.architecture
    archs.check_architecture(arch, path)
    archs.refuse_metadata(f.metadata, arch, path)
    _check_types(f)
    dt = _resolve_dtype(dtype, f)
    cache_dir = _cache_dir(path) if cache else None
    config, cached = _base_config(f, cache_dir)
    config._name_or_path = str(path)
    if len(f.paths) > 1:
        # (transformers reads a split file's first shard alone, and ties the head where
        # that shard has no `output.weight`: whether the whole file has one decides)
        config.tie_word_embeddings = _OUTPUT not in f.tensors
    config_dict = config.to_dict()
    base_config = copy.deepcopy(config)
    config = archs.moe_config(config, f.metadata, arch)
    archs.fix_config(config, f.metadata, arch, path, rope_factors=_rope_factors(f, arch))
    try:
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(config, dtype=dt)
    except Exception as exc:  # noqa: BLE001 - metadata transformers cannot build a model of
        raise FieldError(f"{path}: transformers cannot build a {config.model_type} model from "
                         f"this file's metadata ({type(exc).__name__}: {exc})", "model") from exc
    skeleton.tie_weights()  # (`from_config` leaves meta parameters untied)
    processor = archs.tensor_processor(arch, config_dict)
    with _name_maps_cached():
        names = _weights_map(skeleton, processor, archs.model_type(arch))
    groups = _param_groups(skeleton)
    shapes = dict(skeleton.named_parameters(remove_duplicate=False))
    items: list[_Item] = []
    filled: set[str] = set()
    rope_freqs = None
    experts: dict[str, dict[str, TensorEntry]] = {}
    for t in f.tensors.values():
        if (m := _EXPERTS.fullmatch(t.name)) is not None:
            target = _experts_target(names, m)
            if target is None or target not in groups:
                raise FieldError(f"{path}: tensor {t.name} ({t.qtype}) has no place in "
                                 f"{type(skeleton).__name__} (not supported)", "model")
            part = m["part"] if m["kind"] == "weight" else f"{m['part']}.bias"
            experts.setdefault(target.rpartition(".")[0], {})[part] = t
            continue
        target = names.get(t.name)
        if target is None and t.name.endswith(".weight"):
            target = names.get(t.name.removesuffix(".weight"))  # (gpt-oss's `attn_sinks`)
        if target is None:
            if t.name in _ROPE_FACTORS and arch == "phi3":
                continue  # (in the config: `_rope_factors`)
            if t.name == _ROPE_FREQS and arch == "llama":
                rope_freqs = t
                continue
            raise FieldError(f"{path}: tensor {t.name} ({t.qtype}) has no place in "
                             f"{type(skeleton).__name__} (not supported)", "model")
        if target not in groups:
            raise FieldError(f"{path}: tensor {t.name} maps to {target}, which "
                             f"{type(skeleton).__name__} does not have", "model")
        want = tuple(shapes[target].shape)
        kinds = {_module_kind(skeleton, n) for n in groups[target]}
        stored = tuple(reversed(t.shape)) if kinds == {"conv1d"} else tuple(t.shape)
        if t.name.endswith(".ffn_gate_inp_shexp.weight") and len(stored) == 1:
            # (Qwen2-MoE's shared expert gate: a vector in older files, [1, hidden] in newer)
            stored = (1, *stored)
        if stored != want:
            raise FieldError(f"{path}: tensor {t.name} has shape {list(t.shape)}, the model's "
                             f"{target} {list(want)} (the metadata and the tensors disagree)",
                             "model")
        group = groups[target]
        if filled.intersection(group):
            raise FieldError(f"{path}: tensor {t.name} fills {target} a second time", "model")
        filled.update(group)
        quantized = t.qtype in QUANT_TYPES and "other" not in kinds and (
            len(kinds) == 1 or "conv1d" not in kinds)
        item = _Item(t, group, quantized, want)
        if quantized:
            try:
                item.perm = archs.row_permutation(processor, t.name, t.shape[0],
                                                  transposed=kinds == {"conv1d"})
            except ValueError as exc:
                raise FieldError(f"{path}: tensor {t.name} ({t.qtype}) cannot stay quantized: "
                                 f"{exc}", "model") from exc
        items.append(item)
    planned = [_plan_experts(path, skeleton, module, parts, shapes)
                for module, parts in experts.items()]
    for e in planned:
        params = ("gate_up_proj", "down_proj")
        if e.oss:
            params = (*params, "gate_up_proj_bias", "down_proj_bias")
        for param in params:
            filled.update(groups[f"{e.module}.{param}"])
    missing = sorted(n for n in groups if n not in filled)
    if missing:
        raise FieldError(f"{path}: no tensor for {', '.join(missing[:6])}"
                         f"{' ...' if len(missing) > 6 else ''} of {type(skeleton).__name__}",
                         "model")
    if rope_freqs is not None:
        inv = [m for m in skeleton.modules() if isinstance(getattr(m, "inv_freq", None),
                                                           torch.Tensor)]
        if not inv or any(tuple(m.inv_freq.shape) != tuple(rope_freqs.shape) for m in inv):
            raise FieldError(f"{path}: tensor {_ROPE_FREQS} {list(rope_freqs.shape)} does not "
                             "match the rotary embedding's frequencies", "model")
        if rope_freqs.qtype != "F32":
            raise FieldError(f"{path}: tensor {_ROPE_FREQS} must be F32, not {rope_freqs.qtype}",
                             "model")
    return LoadPlan(f, arch, config, base_config, skeleton, processor, items, rope_freqs, dt,
                    cache_dir, cached, planned)


def _experts_target(names: dict[str, str], m: re.Match[str]) -> str | None:
    """The fused experts parameter (`...experts.gate_up_proj` or `.down_proj`) an experts
    tensor fills, or None. transformers maps the names without their `.weight`, and for a
    `llama` file (Mixtral) only `ffn_down_exps`: the others' module is the down one's."""
    block, part = m["block"], m["part"]
    param = "down_proj" if part == "down" else "gate_up_proj"
    for name in (f"blk.{block}.ffn_{part}_exps", f"blk.{block}.ffn_down_exps"):
        target = names.get(f"{name}.weight") or names.get(name)
        if target is not None:
            module, _, _ = target.rpartition(".")
            return f"{module}.{param}"
    return None


def _rope_factors(f: GGUFFile, arch: str) -> tuple[list[float], list[float]] | None:
    """A Phi-3 file's LongRoPE factors (short, long) as the config takes them, or None
    without them; `FieldError` for one without the other or factors not F32 vectors."""
    present = [name for name in _ROPE_FACTORS if name in f.tensors]
    if arch != "phi3" or not present:
        return None
    if len(present) == 1:
        missing = next(n for n in _ROPE_FACTORS if n not in present)
        raise FieldError(f"{f.path}: tensor {present[0]} without {missing}", "model")
    values = []
    for name in _ROPE_FACTORS:
        t = f.tensors[name]
        if t.qtype != "F32" or len(t.shape) != 1:
            raise FieldError(f"{f.path}: tensor {name} must be an F32 vector, not {t.qtype} "
                             f"{list(t.shape)}", "model")
        values.append([float(x) for x in np.asarray(f.array(name), dtype=np.float32)])
    return values[0], values[1]


def _plan_experts(path: Path, skeleton: nn.Module, module: str, parts: dict[str, TensorEntry],
                  shapes: dict[str, Any]) -> _Experts:
    """One MoE layer's expert tensors checked against its fused experts module
    (`gate_up_proj` [E, 2 I, H], `down_proj` [E, H, I]; gpt-oss's [E, H, 2 I] and [E, I, H]
    with biases [E, 2 I] and [E, H]); `FieldError` naming what is wrong."""
    mod = skeleton.get_submodule(module)
    oss = f"{module}.gate_up_proj_bias" in shapes
    wanted = ("gate", "up", "down", *(("gate.bias", "up.bias", "down.bias") if oss else ()))
    absent = [p for p in wanted if p not in parts]
    if absent:
        part, _, kind = absent[0].partition(".")
        raise FieldError(f"{path}: no ffn_{part}_exps.{kind or 'weight'} tensor for {module}",
                         "model")
    extra = [t.name for p, t in parts.items() if p not in wanted]
    if extra:
        raise FieldError(f"{path}: tensor {extra[0]} has no place in {module} "
                         f"({type(mod).__name__})", "model")
    if not all(f"{module}.{p}" in shapes for p in ("gate_up_proj", "down_proj")) or \
            not (oss or hasattr(mod, "act_fn")):
        raise FieldError(f"{path}: {module} ({type(mod).__name__}) "
                         "is not an experts module ferrobatch runs quantized", "model")
    gate_up = tuple(shapes[f"{module}.gate_up_proj"].shape)
    down = tuple(shapes[f"{module}.down_proj"].shape)
    if oss:  # (the file's gate / up are [E, I, H], down [E, H, I]: transposed)
        experts, hidden, inter = gate_up[0], gate_up[1], gate_up[2] // 2
        want = {"gate": (experts, inter, hidden), "up": (experts, inter, hidden),
                "down": (experts, hidden, inter), "gate.bias": (experts, inter),
                "up.bias": (experts, inter), "down.bias": (experts, hidden)}
    else:
        want = {"gate": (gate_up[0], gate_up[1] // 2, gate_up[2]),
                "up": (gate_up[0], gate_up[1] // 2, gate_up[2]), "down": down}
    for part, t in parts.items():
        if tuple(t.shape) != want[part]:
            raise FieldError(f"{path}: tensor {t.name} has shape {list(t.shape)}, the model's "
                             f"{module} experts {list(want[part])} (the metadata and the "
                             "tensors disagree)", "model")
    mats = [t for p, t in parts.items() if "." not in p]
    kinds = {t.qtype in QUANT_TYPES for t in mats}
    if len(kinds) > 1:
        raise FieldError(f"{path}: the experts of {module} mix quantized and float tensors "
                         f"({', '.join(f'{t.name} {t.qtype}' for t in mats)})",
                         "model")
    return _Experts(module, dict(parts), kinds == {True}, oss)


# ---------------------------------------------------------------------------- fill


def _float_tensor(p: LoadPlan, t: TensorEntry) -> torch.Tensor:
    """A tensor read as floats (dequantized if stored quantized), through the processor, in
    the model's dtype."""

    if t.qtype == "F32":
        arr = np.array(p.file.array(t.name), dtype=np.float32)
    elif t.qtype == "F16":
        arr = p.file.array(t.name).astype(np.float32)
    else:  # BF16 bits, or a quantized tensor read as floats
        raw = p.file.raw(t.name)
        arr = dequantize(np.asarray(raw), GGMLQuantizationType[t.qtype]).reshape(t.shape)
    arr = archs.process(p.processor, arr, t.name)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(p.dtype)


def _unit_dims_as(value: torch.Tensor, shape: tuple[int, ...], p: LoadPlan,
                  t: TensorEntry) -> torch.Tensor:
    """`value` in the parameter's `shape` where the two differ only by dims of size 1 (a
    processor may add one: transformers' Qwen2-MoE processor does to the shared expert gate,
    whether the file holds it as a vector or, as llama.cpp now writes, [1, hidden]);
    `FieldError` where they differ otherwise."""
    if tuple(value.shape) == shape:
        return value
    if [d for d in value.shape if d != 1] != [d for d in shape if d != 1]:
        raise FieldError(f"{p.file.path}: tensor {t.name} reads as shape {list(value.shape)}, "
                         f"its parameter's is {list(shape)}", "model")
    return value.reshape(shape)


def _quant_weight(p: LoadPlan, item: _Item) -> tuple[QuantWeight, bool]:
    """The tensor's `QuantWeight` and whether it is a view of the map."""
    t = item.entry
    data = torch.from_numpy(p.file.raw(t.name))
    mapped = item.perm is None
    if not mapped:
        data = data.index_select(0, torch.from_numpy(item.perm))
    return QuantWeight(t.qtype, t.shape[0], t.shape[1], data), mapped


def _fill_experts(p: LoadPlan, model: nn.Module, e: _Experts, qbytes: int,
                  mbytes: int) -> tuple[int, int]:
    """Fill one MoE layer's experts: a `QuantExperts` (gpt-oss: `OssQuantExperts`) over the
    file's blocks, or the fused module's float parameters (gate and up side by side per
    expert; gpt-oss: transposed, gate and up interleaved). Returns the quantized and mapped
    byte counts with these added."""
    old = model.get_submodule(e.module)
    biases = [_float_tensor(p, e.parts[f"{part}.bias"]) for part in ("gate", "up", "down")] \
        if e.oss else []
    if e.quantized:
        stacked = {}
        for part in ("gate", "up", "down"):
            t = e.parts[part]
            experts, rows, cols = t.shape
            data = torch.from_numpy(p.file.raw(t.name)).reshape(experts * rows, -1)
            stacked[part] = QuantWeight(t.qtype, experts * rows, cols, data)
            qbytes, mbytes = qbytes + data.numel(), mbytes + data.numel()
        gate, up, down = stacked["gate"], stacked["up"], stacked["down"]
        new: nn.Module = OssQuantExperts(gate, up, down, experts, (biases[0], biases[1],
                                                                    biases[2]),
                                         old.limit, old.alpha) if e.oss else \
            QuantExperts(gate, up, down, experts, old.act_fn)
        model.set_submodule(e.module, new)
        return qbytes, mbytes
    gate, up, down = (_float_tensor(p, e.parts[part]) for part in ("gate", "up", "down"))
    if e.oss:
        gate_up = torch.stack([gate.transpose(1, 2), up.transpose(1, 2)], dim=-1).flatten(2)
        gate_up_bias = torch.stack([biases[0], biases[1]], dim=-1).flatten(1)
        _set_param(model, f"{e.module}.gate_up_proj", nn.Parameter(
            gate_up.contiguous(), requires_grad=False))
        _set_param(model, f"{e.module}.gate_up_proj_bias", nn.Parameter(
            gate_up_bias.contiguous(), requires_grad=False))
        _set_param(model, f"{e.module}.down_proj", nn.Parameter(
            down.transpose(1, 2).contiguous(), requires_grad=False))
        _set_param(model, f"{e.module}.down_proj_bias", nn.Parameter(biases[2],
                                                                     requires_grad=False))
        return qbytes, mbytes
    _set_param(model, f"{e.module}.gate_up_proj",
               nn.Parameter(torch.cat([gate, up], dim=1), requires_grad=False))
    _set_param(model, f"{e.module}.down_proj", nn.Parameter(down, requires_grad=False))
    return qbytes, mbytes


def _set_param(model: nn.Module, name: str, param: nn.Parameter) -> None:
    mod_name, _, attr = name.rpartition(".")
    model.get_submodule(mod_name)._parameters[attr] = param


def fill(p: LoadPlan) -> tuple[nn.Module, GGUFModelInfo]:
    """The model of a plan, weights in place (see the module docstring)."""
    model = p.model
    replace: dict[str, tuple[str, QuantWeight]] = {}
    qbytes = mbytes = 0
    for item in p.items:
        if item.quantized:
            qw, mapped = _quant_weight(p, item)
            qbytes += qw.nbytes
            mbytes += qw.nbytes if mapped else 0
            for name in item.targets:
                replace[name.rpartition(".")[0]] = (_module_kind(model, name), qw)
        else:
            value = _unit_dims_as(_float_tensor(p, item.entry), item.shape, p, item.entry)
            param = nn.Parameter(value, requires_grad=False)
            for name in item.targets:
                _set_param(model, name, param)
    for mod_name, (kind, qw) in replace.items():
        old = model.get_submodule(mod_name)
        if kind in ("linear", "conv1d"):  # (a Conv1D computes x @ W + b: the file's rows)
            bias = old.bias.detach() if old.bias is not None else None
            new: nn.Module = QuantLinear(qw, bias)
        else:
            new = QuantEmbedding(qw, p.dtype, embed_scale=getattr(old, "embed_scale", None),
                                 padding_idx=old.padding_idx)
        model.set_submodule(mod_name, new)
    for e in p.experts:
        qbytes, mbytes = _fill_experts(p, model, e, qbytes, mbytes)
    if p.rope_freqs is not None:
        freqs = torch.from_numpy(np.array(p.file.array(p.rope_freqs.name), dtype=np.float32))
        for m in model.modules():
            if isinstance(getattr(m, "inv_freq", None), torch.Tensor):
                m.inv_freq = m.inv_freq / freqs.to(m.inv_freq.dtype)
                if isinstance(getattr(m, "original_inv_freq", None), torch.Tensor):
                    m.original_inv_freq = m.original_inv_freq / freqs.to(m.inv_freq.dtype)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers())
            if t.device.type == "meta"]
    if left:  # a plan that let this through is a bug, not bad input
        raise RuntimeError(f"GGUF load left {left[:4]} unfilled")
    model.eval()
    fbytes = sum(t.numel() * t.element_size() for t in model.parameters())
    info = GGUFModelInfo(
        path=p.file.path, architecture=p.architecture, file_bytes=p.file.file_size,
        types=dict(Counter(t.qtype for t in p.file.tensors.values())),
        quantized_modules=len(replace) + sum(e.quantized for e in p.experts),
        quantized_bytes=qbytes, float_bytes=fbytes,
        mapped_bytes=mbytes)
    model.ferrobatch_gguf = info
    return model, info


# ---------------------------------------------------------------------------- tokenizer


def _tokenizer(path: Path, cache_dir: Path | None, arch: str = "") -> Any:
    """The file's tokenizer (transformers' GGUF conversion; cached like the config), or
    None when the file has none. (gpt-oss: through the fast tokenizer class, whose GGUF
    conversion does not read the config, which transformers' reader fails on.)"""

    if cache_dir is not None:
        if (cache_dir / "no-tokenizer").is_file():
            return None
        if (cache_dir / "tokenizer_config.json").is_file() \
                and not (cache_dir / _CONVERT_TOKENIZER).is_file():
            try:
                return AutoTokenizer.from_pretrained(str(cache_dir), local_files_only=True)
            except Exception as exc:  # noqa: BLE001 - a damaged cache entry: convert again
                logger.info("ferrobatch: GGUF tokenizer cache %s unreadable (%s)", cache_dir,
                            exc)
    cls = PreTrainedTokenizerFast if arch in archs.OWN_CONFIG else AutoTokenizer
    try:
        return cls.from_pretrained(str(path.parent), gguf_file=path.name,
                                   local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a model without a tokenizer is still usable
        logger.warning("ferrobatch: no tokenizer from %s (%s: %s)", path.name,
                       type(exc).__name__, exc)
        return None


def _save_cache(cache_dir: Path, config: Any, tokenizer: Any) -> None:
    """Write the config (transformers', before `fix_config`) and the tokenizer atomically."""
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=cache_dir.parent))
    try:
        config.save_pretrained(tmp)
        if tokenizer is None:
            (tmp / "no-tokenizer").touch()
        else:
            tokenizer.save_pretrained(tmp)
        if cache_dir.exists():
            shutil.rmtree(cache_dir, ignore_errors=True)
        os.replace(tmp, cache_dir)
    except OSError as exc:  # a read-only cache: nothing saved, nothing lost
        logger.info("ferrobatch: GGUF metadata not cached in %s (%s)", cache_dir, exc)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


#: a cache entry's marker: its saved tokenizer does not tokenize as the one converted from
#: the file did (transformers' save and load changed it), so each load converts again
_CONVERT_TOKENIZER = "convert-tokenizer"
#: text the cached tokenizer must split as the converted one does
_PROBE_TEXT = "Hello, world! 12 345\n\tünïcødé 你好 <s></s><unk> ok"


def _same_tokenizer(a: Any, b: Any) -> bool:
    """Whether `b` tokenizes and decodes `_PROBE_TEXT` as `a` does, with the same
    vocabulary size and special tokens."""
    try:
        ids = a(_PROBE_TEXT).input_ids
        return (ids == b(_PROBE_TEXT).input_ids and len(a) == len(b)
                and a.decode(ids) == b.decode(ids)
                and a.all_special_tokens == b.all_special_tokens)
    except Exception:  # noqa: BLE001 - either failing: not the same
        return False


def tokenizer_of(p: LoadPlan) -> Any:
    """The plan's file's tokenizer (None when it has none); the config and tokenizer saved
    under `cache_root()` when they did not come from there. A saved tokenizer that reads
    back different from the converted one is marked so that later loads convert again."""
    tokenizer = _tokenizer(p.file.path, p.cache_dir if p.config_cached else None,
                           p.architecture)
    if p.cache_dir is not None and not p.config_cached:
        _save_cache(p.cache_dir, p.base_config, tokenizer)
        p.config_cached = True
        if tokenizer is not None and (p.cache_dir / "tokenizer_config.json").is_file():
            try:
                saved = AutoTokenizer.from_pretrained(str(p.cache_dir), local_files_only=True)
            except Exception:  # noqa: BLE001 - unreadable: as different
                saved = None
            if saved is None or not _same_tokenizer(tokenizer, saved):
                logger.info("ferrobatch: %s's tokenizer does not survive a save; it is "
                            "converted on every load", p.file.path.name)
                with contextlib.suppress(OSError):
                    (p.cache_dir / _CONVERT_TOKENIZER).touch()
    return tokenizer


# ---------------------------------------------------------------------------- entry


def load_gguf(path: str | os.PathLike, *, device: Any = None, dtype: Any = None,
              cache: bool = True,
              adjust: Callable[[nn.Module, GGUFFile], None] | None = None
              ) -> tuple[nn.Module, Any]:
    """`(model, tokenizer)` of a GGUF file, matrices quantized (see the module docstring).
    `dtype` (None / "auto" / a name / a torch dtype): the float parameters' and the
    activations' dtype (None: fp32; "auto": bf16 for an F16 / BF16 file on a CPU with native
    bf16, else fp32). `cache`: keep / read the config and tokenizer under `cache_root()`.
    `adjust(model, file)`: called on the filled model before anything else reads its
    weights (a tensor-parallel rank cuts its share there, `distributed.quant_shard`)."""
    start = time.perf_counter()
    p = plan(path, device=device, dtype=dtype, cache=cache)
    tokenizer = tokenizer_of(p)
    model, info = fill(p)
    if adjust is not None:
        adjust(model, p.file)
    info.load_seconds = time.perf_counter() - start
    logger.info(
        "ferrobatch: %s (%s, %.0f MiB): %d quantized modules, %.0f MiB quantized (%.0f MiB "
        "mapped from the file), %.0f MiB float, %.1f s", p.file.path.name, p.architecture,
        info.file_bytes / 2**20, info.quantized_modules, info.quantized_bytes / 2**20,
        info.mapped_bytes / 2**20, info.float_bytes / 2**20, info.load_seconds)
    return model, tokenizer
