"""What ferrobatch changes in transformers while it runs a model: dropout off for a forward,
and a host-side mask check skipped inside ferrobatch forwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import masking_utils

from ferrobatch.attention import context

_BYPASS_INSTALLED = False


def install_packed_check_bypass() -> None:
    """transformers' mask preparation calls `find_packed_sequence_indices(position_ids)`
    whenever a forward has position ids and no mask or cache, and decides on its result on
    the host (`.all()`): a device sync on every eager CUDA step, which would stall the async
    pipeline (transformers 5.17+ skip it while a CUDA graph is being captured). Inside a
    ferrobatch forward the mask function returns None whatever that finds, so on a thread
    that is inside a ferrobatch forward it returns None (no packing) without touching the
    device; everywhere else the original runs. Installed once, process-wide."""
    global _BYPASS_INSTALLED
    if _BYPASS_INSTALLED:
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if context.in_ferrobatch_forward():
            return None
        return original(position_ids)

    find_packed_sequence_indices.__wrapped__ = original  # type: ignore[attr-defined]
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    _BYPASS_INSTALLED = True


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off for the block; every module's own training flag restored afterwards."""
    if not model.training:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
