"""Reading a transformers config: layer-type names, the decoder's text config, and every
config object a model holds. Depends on transformers only."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

__all__ = ["FULL", "SLIDING", "model_configs", "text_config"]

#: `config.layer_types` names of the two attention kinds the engine runs.
FULL = "full_attention"
SLIDING = "sliding_attention"


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (the text sub-config for multimodal configs, else `config`)."""
    getter = getattr(config, "get_text_config", None)
    if getter is not None:
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return config


def model_configs(model: torch.nn.Module) -> list[PretrainedConfig]:
    """Every distinct config object reachable from `model` (its modules' and sub-configs)."""
    found: dict[int, PretrainedConfig] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        cfg = todo.pop()
        if not isinstance(cfg, PretrainedConfig) or id(cfg) in found:
            continue
        found[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            todo.append(getattr(cfg, key, None))
    return list(found.values())
