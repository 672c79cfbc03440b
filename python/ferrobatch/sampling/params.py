"""`SamplingParams`: how one request is decoded, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferrobatch.errors import FieldError
from ferrobatch.sampling.grammar import check_grammar_fields

#: `priority` is in [-PRIORITY_LIMIT, PRIORITY_LIMIT)
PRIORITY_LIMIT = 2**31

@dataclass
class SamplingParams:
    """How one request is decoded. Validated on construction (`FieldError`, a `ValueError`,
    names the field).

    `temperature=0` is greedy (the `model.generate` default). `repetition_penalty` follows
    transformers (applies to prompt and generated tokens); `presence_penalty` and
    `frequency_penalty` follow OpenAI (generated tokens only). `seed` makes a request's
    sampling reproducible whatever else runs in the batch. `logprobs=n` returns, per
    generated token, the log-probabilities (of the model's raw distribution) of the top-n
    tokens plus the chosen one. `prompt_logprobs=n` returns, per prompt token (the first
    has none: None), its log-probability given the tokens before it plus the top-n
    alternatives (as vLLM; such a request takes no prefix-cache hits). `stop` strings end
    generation; the text excludes them.
    `json_schema` (a JSON schema dict or string; True: any JSON value), `regex` or
    `grammar` (a Lark grammar as llguidance reads it; at most one of the three) constrain
    the output with a token mask (`ferrobatch.sampling.guided`, needs llguidance): end-of-sequence
    only where the grammar accepts; not with `ignore_eos`.
    `lora` names a LoRA adapter the engine has loaded (`Engine(lora_modules=...)`,
    `Engine.load_lora`); None: the base model.
    `priority` (with the engine's `scheduling_policy="priority"`): lower runs first, and may
    preempt running requests of higher value; in [-2**31, 2**31).
    `max_new_tokens=None` takes `max_length - prompt length` when `max_length` is set
    (transformers' total-length cap, what a `GenerationConfig` without `max_new_tokens`
    means), else the engine's default (128 unless overridden). A `temperature` below
    `MIN_TEMPERATURE` (1e-5) is greedy (dividing the logits by it would overflow); `seed`
    is in [0, 2**64).
    """

    max_new_tokens: int | None = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    max_length: int | None = None
    json_schema: Any = None
    regex: str | None = None
    grammar: str | None = None
    lora: str | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop or ())
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        if self.max_new_tokens is not None:
            _int_field("max_new_tokens", self.max_new_tokens, minimum=1)
        if self.max_length is not None:
            _int_field("max_length", self.max_length, minimum=1)
        _float_field("temperature", self.temperature, low=0.0)
        _int_field("top_k", self.top_k, minimum=0)
        top_p = _float_field("top_p", self.top_p, low=0.0)
        if not 0.0 < top_p <= 1.0:
            raise FieldError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        min_p = _float_field("min_p", self.min_p, low=0.0)
        if min_p > 1.0:
            raise FieldError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if _float_field("repetition_penalty", self.repetition_penalty, low=0.0) == 0.0:
            raise FieldError("repetition_penalty must be > 0, got 0", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float_field(name, getattr(self, name), low=-math.inf)
            if abs(value) > 2.0:
                raise FieldError(f"{name} must be in [-2, 2], got {value}", name)
        if self.seed is not None:
            _int_field("seed", self.seed, minimum=0)
            if self.seed >= 2**64:
                raise FieldError(f"seed must be < 2**64, got {self.seed}", "seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise FieldError(f"stop must hold non-empty strings, got {s!r}", "stop")
        for t in self.stop_token_ids:
            _int_field("stop_token_ids", t, minimum=0)
        if self.logprobs is not None:
            _int_field("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _int_field("prompt_logprobs", self.prompt_logprobs, minimum=0)
        _int_field("priority", self.priority, minimum=-PRIORITY_LIMIT)
        if self.priority >= PRIORITY_LIMIT:
            raise FieldError(f"priority must be in [-2**31, 2**31), got {self.priority}",
                             "priority")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise FieldError(f"lora must be an adapter's name, got {self.lora!r}", "lora")
        if not isinstance(self.ignore_eos, bool):
            raise FieldError(f"ignore_eos must be a bool, got {self.ignore_eos!r}", "ignore_eos")
        if self.guided:
            name = check_grammar_fields(self)
            if self.ignore_eos:
                raise FieldError(
                    f"ignore_eos cannot be combined with {name}: the output ends where "
                    "the grammar accepts", "ignore_eos"
                )

    @property
    def guided(self) -> bool:
        """True when a grammar (json_schema, regex or grammar) constrains the output."""
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax: temperature 0, or below
        `MIN_TEMPERATURE` (dividing the logits by it would overflow; its distribution is the
        argmax anyway, as vLLM defines it)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when any penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def from_generation_config(
        cls, gc: Any, *, unsupported: str = "raise", lengths: bool = True, **overrides: Any
    ) -> SamplingParams:
        """Build from a `transformers.GenerationConfig` (read only, never mutated), with
        transformers' defaults for the fields it leaves unset (`do_sample=True` samples
        with `top_k=50`, temperature 1; no `max_new_tokens` means `max_length=20` in all).

        Settings ferrobatch cannot honour (beam search, n-gram bans, forced tokens, ...)
        raise `ValueError` naming the field (`unsupported="raise"`), or are named in a
        warning and left out (`"warn"`). `lengths=False` leaves `max_new_tokens` unset
        unless the config sets it (the engine's default then applies).
        """
        bad = []
        for name, neutral in _UNSUPPORTED_GENERATION_FIELDS.items():
            value = getattr(gc, name, None)
            if value is not None and value != neutral and not (neutral is None and not value):
                bad.append(f"{name}={value!r}")
        if bad and unsupported == "raise":
            raise FieldError(
                f"{bad[0]} in the GenerationConfig is not supported by ferrobatch",
                bad[0].split("=", 1)[0],
            )
        if bad:
            warnings.warn(
                f"ferrobatch: the generation config's {', '.join(bad)} not supported: left "
                "out, so outputs differ from model.generate", stacklevel=3,
            )
        defaults = _generation_defaults()
        kw: dict[str, Any] = {}
        do_sample = bool(getattr(gc, "do_sample", False))

        def field_or_default(name: str, fallback: Any) -> Any:
            value = getattr(gc, name, None)
            return defaults.get(name, fallback) if value is None else value

        if do_sample:
            kw["temperature"] = float(field_or_default("temperature", 1.0))
            top_k = field_or_default("top_k", 50)
            kw["top_k"] = int(top_k) if top_k else 0
            kw["top_p"] = float(field_or_default("top_p", 1.0))
            min_p = getattr(gc, "min_p", None)
            kw["min_p"] = 0.0 if min_p is None else float(min_p)
        rp = getattr(gc, "repetition_penalty", None)
        if rp is not None:
            kw["repetition_penalty"] = float(rp)
        if getattr(gc, "max_new_tokens", None) is not None:
            kw["max_new_tokens"] = int(gc.max_new_tokens)
        elif lengths and getattr(gc, "max_length", None) is not None:
            kw["max_new_tokens"] = None  # the rest of max_length, per prompt
            kw["max_length"] = int(gc.max_length)
        elif lengths:
            # neither set: transformers' default max_length (20) counts new tokens
            # ("by default let's always generate 20 new tokens", transformers 5.2x)
            kw["max_new_tokens"] = int(defaults.get("max_length", 20))
        else:
            kw["max_new_tokens"] = None
        stop = getattr(gc, "stop_strings", None)
        if stop:
            kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        eos = getattr(gc, "eos_token_id", None)
        if eos is not None:
            kw["stop_token_ids"] = tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        kw.update(overrides)
        return cls(**kw)


MIN_TEMPERATURE = 1e-5


def _generation_defaults() -> dict[str, Any]:
    """transformers' values for GenerationConfig fields left None (top_k 50, max_length 20,
    ...), read from transformers when it says them."""
    try:
        # local: transformers takes a second to import; `import ferrobatch` does without it
        from transformers import GenerationConfig

        return dict(GenerationConfig._get_default_generation_params())
    except Exception:  # noqa: BLE001 - another transformers release: the documented values
        return {"max_length": 20, "top_k": 50, "top_p": 1.0, "temperature": 1.0}


# GenerationConfig fields with no ferrobatch equivalent, and the value that means "off".
_UNSUPPORTED_GENERATION_FIELDS: dict[str, Any] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "diversity_penalty": None,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "min_new_tokens": 0,
    "min_length": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "encoder_repetition_penalty": 1.0,
    "exponential_decay_length_penalty": None,
    "guidance_scale": 1.0,
    "watermarking_config": None,
}


def _int_field(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"{name} must be an integer, got {value!r}", name)
    if value < minimum:
        raise FieldError(f"{name} must be >= {minimum}, got {value}", name)
    return value


def _float_field(name: str, value: Any, *, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{name} must be a number, got {value!r}", name)
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise FieldError(f"{name} must be finite, got {value}", name)
    if value < low:
        raise FieldError(f"{name} must be >= {low}, got {value}", name)
    return value


def coerce_sampling(
    value: Any,
    *,
    default_max_new_tokens: int | None = None,
    defaults: SamplingParams | None = None,
) -> SamplingParams:
    """Accept None (`defaults`: the model's generation config, else greedy), a
    `SamplingParams`, a `GenerationConfig` or a dict."""
    if value is None:
        # the engine's default length, fitted to the context, unless `defaults` says one
        sp = defaults if defaults is not None else SamplingParams(max_new_tokens=None)
    elif isinstance(value, SamplingParams):
        sp = value
    elif isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise FieldError(f"sampling: unknown SamplingParams field(s) {', '.join(unknown)}",
                             unknown[0])
        sp = SamplingParams(**value)
    elif type(value).__name__ == "GenerationConfig":
        sp = SamplingParams.from_generation_config(value)
    else:
        raise TypeError(
            "sampling must be SamplingParams, a transformers GenerationConfig, a dict or None, "
            f"got {type(value).__name__}"
        )
    if default_max_new_tokens is not None and sp.max_new_tokens is None:
        sp = SamplingParams(**{**sp.__dict__, "max_new_tokens": default_max_new_tokens})
    return sp
