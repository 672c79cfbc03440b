"""Registration with transformers' attention and mask interfaces, and switching a model's
configs to ferrobatch's attention for the duration of a forward."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    sdpa_mask,
)

from ferrobatch.attention.context import (
    ATTENTION_NAME,
    CAST_NAME,
    CAST_ORIGINAL,
    ORIGINAL,
    STATE,
    own_attention,
)
from ferrobatch.attention.forward import paged_attention_forward
from ferrobatch.attention.kernel_step import KernelStep
from ferrobatch.attention.paged_step import PagedStep


def paged_mask(*args: Any, config: PretrainedConfig | None = None, **kwargs: Any) -> Any:
    """Mask function: None inside a ferrobatch forward, else the model's own mask."""
    if getattr(STATE, "depth", 0):
        return None
    impl = ORIGINAL.get(id(config), "sdpa")
    fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl or "sdpa", sdpa_mask)
    if fn is paged_mask:
        fn = sdpa_mask
    return fn(*args, config=config, **kwargs)


def cast_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The model's own attention with key and value cast to the query's dtype: for
    construction checks of forwards whose q / k / v dtypes differ (packed half-precision
    linears with an fp32 residual stream, `cpu_linear`)."""
    fn = own_attention(CAST_ORIGINAL.get(id(getattr(module, "config", None))), module)
    return fn(module, query, key.to(query.dtype), value.to(query.dtype), *args, **kwargs)


def cast_mask(*args: Any, config: PretrainedConfig | None = None, **kwargs: Any) -> Any:
    """The model's own mask function under `cast_attention_enabled`."""
    impl = CAST_ORIGINAL.get(id(config)) or "sdpa"
    fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl, sdpa_mask)
    return fn(*args, config=config, **kwargs)


def register() -> None:
    """Register the paged attention and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
    AttentionInterface.register(CAST_NAME, cast_attention_forward)
    AttentionMaskInterface.register(CAST_NAME, cast_mask)


@contextmanager
def cast_attention_enabled(configs: Iterable[PretrainedConfig]) -> Iterator[None]:
    """Switch `configs` to `cast_attention_forward` for the block, then restore them."""
    saved = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
    for cfg, impl in saved:
        CAST_ORIGINAL[id(cfg)] = impl
        cfg._attn_implementation_internal = CAST_NAME
    try:
        yield
    finally:
        for cfg, impl in saved:
            cfg._attn_implementation_internal = impl
            CAST_ORIGINAL.pop(id(cfg), None)


@contextmanager
def paged_attention_enabled(
    configs: Iterable[PretrainedConfig], step: PagedStep | KernelStep | None = None
) -> Iterator[None]:
    """Switch `configs` to the paged attention for the duration of the block, then restore
    exactly what was there. `step`, when given, is also this thread's step for the block:
    attention calls that lost the `STEP_KWARG` forward kwarg (decoder layers that drop
    their **kwargs) use it."""
    saved = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
    for cfg, impl in saved:
        if impl != ATTENTION_NAME:
            ORIGINAL[id(cfg)] = impl
        cfg._attn_implementation_internal = ATTENTION_NAME
    STATE.depth = getattr(STATE, "depth", 0) + 1
    prev_step = getattr(STATE, "step", None)
    if step is not None:
        STATE.step = step
    try:
        yield
    finally:
        STATE.step = prev_step
        STATE.depth -= 1
        for cfg, impl in saved:
            cfg._attn_implementation_internal = impl


def forget(configs: Iterable[PretrainedConfig]) -> None:
    """Drop the remembered implementations of `configs` (when a runner closes)."""
    for cfg in configs:
        ORIGINAL.pop(id(cfg), None)


register()
