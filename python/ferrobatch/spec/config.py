"""`SpeculativeConfig`: which proposer, how many tokens, and when speculation switches off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrobatch.errors import FieldError

__all__ = ["SpeculativeConfig", "DEFAULT_MAX_SPEC_TOKENS_PER_STEP"]

# Above this many verified query tokens per step (rows * (1 + k)) a CPU forward is no
# longer bound by reading the weights and speculation stops paying (benches/spec_decode.py:
# on the bundled SmolLM2, fp32, 1 thread, batch 16 at k=4 already costs more than it saves).
DEFAULT_MAX_SPEC_TOKENS_PER_STEP = 40


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings (`Engine(..., speculative_config=...)`).

    Attributes:
        method: "ngram" (prompt lookup in the request's own prompt and output; no extra
            model) or "draft" (a smaller model sharing the tokenizer proposes greedily).
        num_speculative_tokens: k, proposed tokens per step and request (>= 1).
        prompt_lookup_min / prompt_lookup_max: n-gram sizes tried, longest first ("ngram").
        draft_model: the draft ("draft"): a path / hub id or a loaded `PreTrainedModel`.
        draft_num_blocks: KV chunks of the draft's own paged cache (None: as many as the
            target's).
        max_spec_tokens_per_step: speculation is skipped for a step whose verified tokens
            (speculating rows * (1 + k)) would exceed this: at large batch the forward is
            compute-bound and verification stops being free. None: the measured default.
        min_acceptance_rate: a request whose running acceptance rate (proposed tokens
            accepted, exponentially averaged) falls below this stops speculating for a
            while (2, 4, 8, ... steps, up to `max_backoff_steps`), then tries again.
        max_backoff_steps: the longest pause of a request's speculation.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    draft_model: Any = None
    draft_num_blocks: int | None = None
    max_spec_tokens_per_step: int | None = DEFAULT_MAX_SPEC_TOKENS_PER_STEP
    min_acceptance_rate: float = 0.15
    max_backoff_steps: int = 64

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise FieldError(
                f"method must be 'ngram' or 'draft', got {self.method!r}", field="method"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "max_backoff_steps"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise FieldError(f"{name} must be an integer >= 1, got {v!r}", field=name)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise FieldError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                f"({self.prompt_lookup_min})", field="prompt_lookup_max",
            )  # fmt: skip
        for name in ("draft_num_blocks", "max_spec_tokens_per_step"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise FieldError(f"{name} must be None or an integer >= 1, got {v!r}", field=name)
        r = self.min_acceptance_rate
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 <= r <= 1.0:
            raise FieldError(
                f"min_acceptance_rate must be in [0, 1], got {r!r}", field="min_acceptance_rate"
            )
        if self.method == "draft" and self.draft_model is None:
            raise FieldError("method='draft' needs draft_model", field="draft_model")
        if self.method == "ngram" and self.draft_model is not None:
            raise FieldError("draft_model is only used with method='draft'", field="draft_model")

    @classmethod
    def coerce(cls, cfg: Any) -> SpeculativeConfig | None:
        """Accept None, a `SpeculativeConfig` or a dict of its fields."""
        if cfg is None or isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, dict):
            unknown = set(cfg) - set(cls.__dataclass_fields__)
            if unknown:
                name = sorted(unknown)[0]
                raise FieldError(f"unknown speculative_config field {name!r}", field=name)
            return cls(**cfg)
        raise TypeError(
            f"speculative_config must be a SpeculativeConfig, a dict or None, got "
            f"{type(cfg).__name__}"
        )
