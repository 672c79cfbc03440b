"""Building the speculative-decoding controller of an engine."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ferrobatch.errors import FieldError
from ferrobatch.spec.config import SpeculativeConfig
from ferrobatch.spec.controller import NgramProposer, Proposer, SpecController
from ferrobatch.spec.draft import DraftProposer

if TYPE_CHECKING:
    import torch

    from ferrobatch.config import ContinuousBatchingConfig

__all__ = ["build_controller"]

logger = logging.getLogger("ferrobatch")


def build_controller(
    cfg: Any,
    *,
    config: ContinuousBatchingConfig,
    device: torch.device,
    dtype: torch.dtype,
    vocab_size: int,
    num_blocks: int,
    spec_cap: int,
    tensor_parallel: bool = False,
) -> SpecController | None:
    """The controller for `cfg` (a `SpeculativeConfig`, a dict of its fields or None) of a
    target model: its engine `config`, `device`, `dtype`, `vocab_size` (a draft model must
    share it) and cache size `num_blocks` (the draft's default); `spec_cap` is the target
    scheduler's per-row cap (logged). Refused with `tensor_parallel`."""
    spec = SpeculativeConfig.coerce(cfg)
    if spec is None:
        return None
    if tensor_parallel:
        raise FieldError(
            "speculative decoding with tensor_parallel_size > 1 is not supported yet",
            field="speculative_config",
        )
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec)
    else:
        proposer = DraftProposer(spec, config=config, device=device, dtype=dtype,
                                 vocab_size=vocab_size, num_blocks=num_blocks)  # fmt: skip
    logger.info(
        "ferrobatch: speculative decoding %s, k=%d (per-row cap %d)",
        spec.method, spec.num_speculative_tokens, spec_cap,
    )  # fmt: skip
    return SpecController(spec, proposer)
