"""One PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`), read and checked
against the base model it is applied to."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ferrobatch.errors import FieldError

__all__ = ["LoraAdapter", "LoraWeights"]

# PEFT saves a LoRA tensor as `base_model.model.<module path>.lora_A.weight` (or `lora_B`)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class LoraWeights:
    """The low-rank update of one linear layer: `y += scale * (x @ a.T) @ b.T`; `a` [r, in],
    `b` [out, r], fp32."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: its name, where it came from, and the update of each target module
    (by its path in the base model, as `named_modules` names it)."""

    name: str
    path: str
    modules: dict[str, LoraWeights]

    @classmethod
    def load(cls, name: str, path: str | Path, model: torch.nn.Module) -> LoraAdapter:
        """Read the PEFT adapter at `path` for `model`; a `FieldError` (field "lora_modules")
        naming what doesn't fit: a missing file, options ferrobatch doesn't apply (DoRA,
        biases, extra trained modules), a module that isn't a linear layer of the model or
        shapes that don't match it."""
        if not isinstance(path, str | Path) or not str(path):
            raise FieldError(f"lora_modules: adapter {name!r}: its path must be a directory "
                             f"name, not {path!r}", "lora_modules")
        root = Path(path)
        cfg = _read_config(root)
        tensors = _read_tensors(root)
        targets = dict(model.named_modules())
        device = next(model.parameters()).device
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            m = _KEY.match(key)
            if m is None:
                raise _error(root, f"tensor {key!r} is not a LoRA A/B weight of a linear layer")
            pairs.setdefault(m["module"], {})[m["ab"]] = value
        modules = {}
        for module_name, ab in sorted(pairs.items()):
            w = _weights(root, cfg, module_name, ab, targets.get(module_name))
            modules[module_name] = LoraWeights(w.a.to(device), w.b.to(device), w.scale)
        if not modules:
            raise _error(root, "it holds no LoRA weights")
        return cls(name=name, path=str(root), modules=modules)


def _read_config(root: Path) -> dict[str, Any]:
    file = root / "adapter_config.json"
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise _error(root, f"can't read adapter_config.json: {exc}") from None
    if not isinstance(cfg, dict):
        raise _error(root, f"adapter_config.json holds a {type(cfg).__name__}, not an object")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise _error(root, f"lora_alpha must be a number, not {alpha!r}")
    patterns = cfg.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise _error(root, f"alpha_pattern must be an object, not {patterns!r}")
    for key, value in patterns.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _error(root, f"alpha_pattern[{key!r}] must be a number, not {value!r}")
        try:
            re.compile(key)
        except re.error as exc:
            raise _error(root, f"alpha_pattern key {key!r} is not a regular expression: "
                         f"{exc}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise _error(root, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": cfg.get("use_dora"),
        "modules_to_save": cfg.get("modules_to_save"),
        "bias": cfg.get("bias") not in (None, "none") and cfg.get("bias"),
        "fan_in_fan_out": cfg.get("fan_in_fan_out"),
    }
    for option, value in unsupported.items():
        if value:
            raise _error(root, f"{option}={value!r} is not supported")
    return cfg


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    file = root / "adapter_model.safetensors"
    if not file.is_file():
        raise _error(root, "adapter_model.safetensors is missing")
    try:
        return load_file(str(file), device="cpu")
    except Exception as exc:  # noqa: BLE001 - a corrupt file: say so, naming it
        raise _error(root, f"can't read adapter_model.safetensors: {exc}") from None


def _weights(root: Path, cfg: dict[str, Any], name: str, ab: dict[str, torch.Tensor],
             module: torch.nn.Module | None) -> LoraWeights:
    """One module's checked update, scaled as PEFT scales it."""
    if not isinstance(module, torch.nn.Linear):
        what = "absent from" if module is None else f"a {type(module).__name__} in"
        raise _error(root, f"its target {name!r} is {what} the model (only linear layers "
                     "of the decoder take adapters)")
    if "A" not in ab or "B" not in ab:
        raise _error(root, f"{name!r} lacks its lora_{'A' if 'A' not in ab else 'B'} weight")
    a, b = ab["A"].float(), ab["B"].float()
    r = a.shape[0]
    if a.shape != (r, module.in_features) or b.shape != (module.out_features, r):
        raise _error(root, f"{name!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} don't "
                     f"fit a {module.in_features} -> {module.out_features} layer")
    alpha = _pattern(cfg.get("alpha_pattern") or {}, name, cfg.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return LoraWeights(a.contiguous(), b.contiguous(), float(scale))


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> float:
    """A per-module value of PEFT's `alpha_pattern`, as PEFT picks it: the key equal to the
    module path, else the first key whose regular expression matches the path's end (the
    whole key one group: `q_proj|v_proj` matches either)."""
    if module in patterns:
        return float(patterns[module])
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return float(default)


def _error(root: Path, why: str) -> FieldError:
    return FieldError(f"lora_modules: the adapter at {str(root)!r}: {why}", "lora_modules")
