"""Per-request sampling parameters and the batched on-device sampler."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ferrobatch.guided import mask_rows


@dataclass
class SamplingParams:
    """How one request is decoded. Validated on construction (`ValueError` names the field).

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
    the output with a token mask (`ferrobatch.guided`, needs llguidance): end-of-sequence
    only where the grammar accepts; not with `ignore_eos`.
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
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        min_p = _float_field("min_p", self.min_p, low=0.0)
        if min_p > 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if _float_field("repetition_penalty", self.repetition_penalty, low=0.0) == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float_field(name, getattr(self, name), low=-math.inf)
            if abs(value) > 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _int_field("seed", self.seed, minimum=0)
            if self.seed >= 2**64:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _int_field("stop_token_ids", t, minimum=0)
        if self.logprobs is not None:
            _int_field("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _int_field("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.guided:
            from ferrobatch.guided import check_grammar_fields

            name = check_grammar_fields(self)
            if self.ignore_eos:
                raise ValueError(
                    f"ignore_eos cannot be combined with {name}: the output ends where "
                    "the grammar accepts"
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
            raise ValueError(
                f"{bad[0]} in the GenerationConfig is not supported by ferrobatch"
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
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _float_field(name: str, value: Any, *, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


@dataclass
class SamplingState:
    """What the sampler needs to remember about one request between steps."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    guide: Any = None  # a `ferrobatch.guided.Guide` for guided requests
    plain_greedy: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        # a guided row needs its full logits (masked): never the runner's greedy screen
        self.plain_greedy = (
            p.greedy and not p.has_penalties and p.logprobs is None and self.guide is None
        )

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """The request's own generator when it is seeded (created on first use)."""
        if self.params.seed is None:
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(int(self.params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return self.generator


@dataclass
class SampleResult:
    """Sampled token ids [N] (int64, CPU) and optional per-row logprob dicts."""

    token_ids: torch.Tensor
    logprobs: list[dict[int, float] | None] | None = None


@dataclass
class DeviceSample:
    """A step's samples still on the logits' device (nothing synchronized yet).

    `token_ids` [N] int64; with logprobs, `lp_rows` (the rows that asked), `lp_counts` (their
    top-n), `lp_chosen` [len(lp_rows)] the chosen tokens' logprobs and `lp_top_vals` /
    `lp_top_idx` [len(lp_rows), max n] (None when every n is 0). `device_tensors()` lists
    what has to reach the host; `finish(host)` builds the `SampleResult` from host copies of
    them (in that order), `to_host()` does both with plain blocking copies.
    """

    token_ids: torch.Tensor
    lp_rows: list[int] | None = None
    lp_counts: list[int] | None = None
    lp_chosen: torch.Tensor | None = None
    lp_top_vals: torch.Tensor | None = None
    lp_top_idx: torch.Tensor | None = None

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors whose host copies `finish` takes, in order."""
        out = [self.token_ids]
        if self.lp_rows is not None:
            assert self.lp_chosen is not None
            out.append(self.lp_chosen)
            if self.lp_top_vals is not None and self.lp_top_idx is not None:
                out += [self.lp_top_vals, self.lp_top_idx]
        return out

    def finish(self, host: Sequence[torch.Tensor]) -> SampleResult:
        """The `SampleResult` from CPU copies of `device_tensors()`."""
        token_ids = host[0]
        if self.lp_rows is None or self.lp_counts is None:
            return SampleResult(token_ids)
        ids = token_ids.tolist()
        chosen_lp = host[1].tolist()
        top_vals = host[2].tolist() if len(host) > 2 else None
        top_idx = host[3].tolist() if len(host) > 3 else None
        out: list[dict[int, float] | None] = [None] * len(ids)
        for j, i in enumerate(self.lp_rows):
            d: dict[int, float] = {}
            n = self.lp_counts[j]
            if n and top_vals is not None and top_idx is not None:
                for t, v in zip(top_idx[j][:n], top_vals[j][:n], strict=True):
                    d[int(t)] = float(v)
            d[int(ids[i])] = float(chosen_lp[j])
            out[i] = d
        return SampleResult(token_ids, out)

    def to_host(self) -> SampleResult:
        """Copy to the CPU (blocking) and finish."""
        return self.finish([t.cpu() for t in self.device_tensors()])


class Sampler:
    """Samples one token per logits row, every row with its own parameters, in one batch.

    `sample` never synchronizes with the device: every host-built tensor goes up with a
    non-blocking copy (from pinned memory on CUDA) and the result stays on the device, so a
    pipeline can queue the sampling of a step behind its forward and read it back later.
    """

    def __init__(self, device: torch.device | None = None, seed: int | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleResult:
        """Pick the next token of each row; `states[i]` describes row i of `logits` [N, V]."""
        return self.sample(logits, states).to_host()

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> DeviceSample:
        """Like `__call__`, but the result stays on the logits' device (no synchronization)."""
        n = logits.shape[0]
        if n != len(states):
            raise ValueError(f"logits has {n} rows but {len(states)} sampling states were given")
        if n == 0:
            return DeviceSample(torch.empty(0, dtype=torch.int64, device=logits.device))
        if all(s.plain_greedy for s in states):
            return DeviceSample(_argmax_rows(logits))
        params = [s.params for s in states]
        raw = logits
        scores = logits.float().clone()
        dev = scores.device
        vocab = scores.shape[1]
        self._apply_penalties(scores, states, dev, vocab)
        if any(s.guide is not None for s in states):
            mask_rows(scores, states)

        chosen = _argmax_rows(scores).to(dev)
        if not all(p.greedy for p in params):
            sample_rows = [i for i, p in enumerate(params) if not p.greedy]
            idx = _to_device(sample_rows, torch.int64, dev)
            sub = scores.index_select(0, idx)
            sub = self._warp(sub, [params[i] for i in sample_rows])
            probs = torch.softmax(sub, dim=-1)
            noise = self._exponential_noise([states[i] for i in sample_rows], vocab, dev)
            picked = (probs / noise).argmax(dim=-1)
            chosen = chosen.index_copy(0, idx, picked)
        if any(p.logprobs is not None for p in params):
            return self._logprobs(raw, params, chosen)
        return DeviceSample(chosen)

    # -- pieces ---------------------------------------------------------------------------

    @staticmethod
    def _apply_penalties(
        scores: torch.Tensor, states: Sequence[SamplingState], dev: torch.device, vocab: int
    ) -> None:
        rep_rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
        if rep_rows:
            hist = [states[i].prompt_ids + states[i].output_ids for i in rep_rows]
            ids = _pad_ids(hist, pad=vocab, dev=dev).clamp_(0, vocab)
            idx = _to_device(rep_rows, torch.int64, dev)
            sub = torch.nn.functional.pad(scores.index_select(0, idx), (0, 1))
            pen = _to_device(
                [states[i].params.repetition_penalty for i in rep_rows], torch.float32, dev
            ).unsqueeze(1)
            got = sub.gather(1, ids)
            got = torch.where(got < 0, got * pen, got / pen)
            sub = sub.scatter(1, ids, got)[:, :vocab]
            scores.index_copy_(0, idx, sub)
        pf_rows = [
            i
            for i, s in enumerate(states)
            if (s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0)
            and s.output_ids
        ]
        if pf_rows:
            hist = [states[i].output_ids for i in pf_rows]
            ids = _pad_ids(hist, pad=vocab, dev=dev).clamp_(0, vocab)
            counts = torch.zeros(len(pf_rows), vocab + 1, device=dev)
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
            counts = counts[:, :vocab]
            pres = _to_device(
                [states[i].params.presence_penalty for i in pf_rows], torch.float32, dev
            )
            freq = _to_device(
                [states[i].params.frequency_penalty for i in pf_rows], torch.float32, dev
            )
            idx = _to_device(pf_rows, torch.int64, dev)
            delta = pres.unsqueeze(1) * (counts > 0).float() + freq.unsqueeze(1) * counts
            scores.index_copy_(0, idx, scores.index_select(0, idx) - delta)

    @staticmethod
    def _warp(sub: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        dev = sub.device
        vocab = sub.shape[1]
        temp = _to_device([p.temperature for p in params], torch.float32, dev).unsqueeze(1)
        sub = sub / temp
        ks = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
        if any(ks):
            kmax = max(ks)
            top_vals = torch.topk(sub, kmax, dim=-1).values
            k_idx = _to_device([max(k, 1) - 1 for k in ks], torch.int64, dev).unsqueeze(1)
            thresh = top_vals.gather(1, k_idx)
            active = _to_device([k > 0 for k in ks], torch.bool, dev).unsqueeze(1)
            sub = sub.masked_fill(active & (sub < thresh), -math.inf)
        if any(p.top_p < 1.0 for p in params):
            top_p = _to_device([p.top_p for p in params], torch.float32, dev).unsqueeze(1)
            sorted_logits, sorted_idx = torch.sort(sub, descending=False, dim=-1)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = cum <= (1 - top_p)
            remove[:, -1] = False
            mask = remove.scatter(1, sorted_idx, remove)
            sub = sub.masked_fill(mask, -math.inf)
        if any(p.min_p > 0.0 for p in params):
            min_p = _to_device([p.min_p for p in params], torch.float32, dev).unsqueeze(1)
            probs = torch.softmax(sub, dim=-1)
            top = probs.amax(dim=-1, keepdim=True)
            remove = probs < min_p * top
            remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
            sub = sub.masked_fill(remove, -math.inf)
        return sub

    def _exponential_noise(
        self, states: Sequence[SamplingState], vocab: int, dev: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(len(states), vocab, device=dev)
        unseeded = [i for i, s in enumerate(states) if s.params.seed is None]
        if len(unseeded) == len(states):
            noise.exponential_(generator=self._generator)
        else:
            for i, s in enumerate(states):
                gen = s.generator_for(dev)
                noise[i].exponential_(generator=gen if gen is not None else self._generator)
        return noise.clamp_(min=1e-20)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, params: Sequence[SamplingParams], chosen: torch.Tensor
    ) -> DeviceSample:
        """`chosen` [N] (on the device) with the logprob tensors of the rows that ask."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        counts = [params[i].logprobs or 0 for i in rows]
        dev = raw.device
        idx = _to_device(rows, torch.int64, dev)
        lp = torch.log_softmax(raw.index_select(0, idx).float(), dim=-1)
        n_max = max(counts)
        top_vals = top_idx = None
        if n_max > 0:
            top_vals, top_idx = torch.topk(lp, min(n_max, lp.shape[1]), dim=-1)
        chosen_dev = chosen.to(dev)
        chosen_lp = lp.gather(1, chosen_dev.index_select(0, idx).unsqueeze(1)).squeeze(1)
        return DeviceSample(chosen, rows, counts, chosen_lp, top_vals, top_idx)


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax as int64 on `x`'s device; same result as `torch.argmax` (first
    maximum, NaN wins), through numpy on CPU where torch's reduction is many times slower."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1).astype(np.int64))
    return x.argmax(dim=-1)


def _to_device(values: Sequence[Any], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A small host-built tensor on `dev` without a device synchronization (a plain
    `torch.tensor(..., device=cuda)` waits for the stream; this goes up non-blocking from
    pinned memory, which the caching host allocator keeps until the copy ran)."""
    t = torch.tensor(values, dtype=dtype)
    if dev.type == "cpu":
        return t
    if dev.type == "cuda":
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


def _pad_ids(rows: Sequence[Sequence[int]], *, pad: int, dev: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    if dev.type == "cpu":
        return out
    if dev.type == "cuda":
        out = out.pin_memory()
    return out.to(dev, non_blocking=True)


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
