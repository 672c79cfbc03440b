"""Building the speculative-decoding controller of an engine."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ferrobatch.spec.config import SpeculativeConfig
from ferrobatch.spec.controller import NgramProposer, Proposer, SpecController

if TYPE_CHECKING:
    from ferrobatch.engine.llm_engine import Engine

__all__ = ["build_controller"]

logger = logging.getLogger("ferrobatch")


def build_controller(engine: Engine, cfg: Any) -> SpecController | None:
    """The controller for `cfg` (a `SpeculativeConfig`, a dict of its fields or None)."""
    spec = SpeculativeConfig.coerce(cfg)
    if spec is None:
        return None
    if getattr(engine, "tp", None) is not None:
        from ferrobatch.errors import FieldError

        raise FieldError(
            "speculative decoding with tensor_parallel_size > 1 is not supported yet",
            field="speculative_config",
        )
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec)
    else:
        from ferrobatch.spec.draft import DraftProposer

        proposer = DraftProposer(engine, spec)
    logger.info(
        "ferrobatch: speculative decoding %s, k=%d (per-row cap %d)",
        spec.method, spec.num_speculative_tokens, engine.scheduler.spec_cap,
    )  # fmt: skip
    return SpecController(spec, proposer)
