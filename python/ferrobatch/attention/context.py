"""The calling thread's ferrobatch forward: the names ferrobatch registers with
transformers, the thread-local state of a forward (depth, step), and the model's own
attention implementation that calls from outside a ferrobatch forward are delegated to."""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION_NAME = "ferrobatch_paged"
STEP_KWARG = "ferrobatch_step"
CAST_NAME = "ferrobatch_cast"

# config id -> the attention implementation it had before ferrobatch switched it
ORIGINAL: dict[int, str | None] = {}
CAST_ORIGINAL: dict[int, str | None] = {}
STATE = threading.local()  # depth (nested ferrobatch forwards) and step of this thread


def in_ferrobatch_forward() -> bool:
    """Whether the calling thread is inside a ferrobatch forward (`paged_attention_enabled`)."""
    return getattr(STATE, "depth", 0) > 0


def delegate(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    impl = ORIGINAL.get(id(getattr(module, "config", None)), "sdpa")
    if impl in (None, "eager", ATTENTION_NAME):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        fn = fn or sdpa_attention_forward
    else:
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, sdpa_attention_forward)
    return fn(module, *args, **kwargs)


def own_attention(impl: str | None, module: torch.nn.Module) -> Any:
    if impl in (None, "eager", ATTENTION_NAME, CAST_NAME):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        return fn or sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, sdpa_attention_forward)
