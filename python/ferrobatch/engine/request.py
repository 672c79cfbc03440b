"""One request inside the engine: its state, how a prompt and `SamplingParams` become one
(validated, `FieldError` naming the field), and the outputs it hands its caller."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ferrobatch.engine.detok import IncrementalDetokenizer
from ferrobatch.engine.outputs import RequestOutput
from ferrobatch.errors import FieldError
from ferrobatch.sampling.params import SamplingParams, coerce_sampling
from ferrobatch.sampling.pooling import Pooled
from ferrobatch.sampling.sampler import SamplingState

if TYPE_CHECKING:
    from ferrobatch.engine.llm_engine import Engine

__all__ = [
    "Listener",
    "Prompt",
    "Request",
    "as_prompt_list",
    "make_request",
    "sampling_list",
]

Prompt = str | Sequence[int]
Listener = Callable[[RequestOutput | BaseException], None]


@dataclass
class Request:
    """Engine-side state of one request."""

    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    sstate: SamplingState
    detok: IncrementalDetokenizer
    eos_token_ids: list[int]
    arrival: float
    output: RequestOutput
    listener: Listener | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    in_scheduler: bool = False
    keep: bool = False  # stays in the table after finishing until get_output claims it
    prompt_lp_sent: bool = False  # the prompt logprobs went out in a delta
    pool: Pooled | None = None  # an embedding request's pooling (`sampling.pooling`)
    lora_salt: int = 0  # its LoRA adapter's prefix-cache salt (0: the base model)
    lora_admitted: bool = False  # counted among its adapter's requests in the scheduler
    offline: bool = False  # part of a blocking batch (`generate`, `embed`): no step budget
    cancelling: bool = False  # `Engine.cancel` asked; the next step ends it

    @property
    def plain(self) -> bool:
        """No listener, no streaming text, no logprobs: tokens only go to `output`."""
        return self.listener is None and not self.detok.incremental and self.output.logprobs is None

    def add_token(self, token: int, now: float) -> None:
        """Record one generated token of a plain request (text is built at the end)."""
        self.sstate.output_ids.append(token)
        self.output.token_ids.append(token)
        self.output.token_times.append(self._elapsed(now))
        self.detok.add((token,))

    def add_tokens(self, new: list[int], lp: dict[int, float] | None, now: float) -> None:
        """Record generated tokens (one logprob dict for all of them)."""
        self.sstate.output_ids.extend(new)
        out = self.output
        out.token_ids.extend(new)
        out.token_times.extend([self._elapsed(now)] * len(new))
        if out.logprobs is not None:
            out.logprobs.extend([lp or {}] * len(new))

    def _elapsed(self, now: float) -> float:
        """Seconds since arrival; the first call also sets `ttft`."""
        dt = now - self.arrival
        if self.output.ttft is None:
            self.output.ttft = dt
        return dt

    def delta(self, new: list[int], text: str, reason: str | None) -> RequestOutput:
        """The output holding only `new` (already recorded) and `text`."""
        n = len(new)
        out = self.output
        prompt_lp = None
        if out.prompt_logprobs is not None and not self.prompt_lp_sent:
            prompt_lp, self.prompt_lp_sent = list(out.prompt_logprobs), True
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(new),
            text=text,
            finish_reason=reason,
            finished=reason is not None,
            logprobs=(list(out.logprobs[-n:]) if n else []) if out.logprobs is not None else None,
            ttft=out.ttft,
            token_times=list(out.token_times[-n:]) if n else [],
            prompt=self.prompt_text,
            prompt_logprobs=prompt_lp,
        )


def sampling_list(
    sampling: Any, n: int, max_new_tokens: int | None, defaults: SamplingParams | None = None
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt from one value or a list (`max_new_tokens` wins;
    `defaults` stand for None: the model's generation config)."""
    if isinstance(sampling, list | tuple):
        if len(sampling) != n:
            raise FieldError(
                f"sampling: got {len(sampling)} SamplingParams for {n} prompts", "sampling"
            )
        items = list(sampling)
    else:
        items = [sampling] * n
    out = []
    for s in items:
        # max_new_tokens=None is resolved per prompt in make_request
        sp = coerce_sampling(s, defaults=defaults)
        if max_new_tokens is not None:
            sp = SamplingParams(**{**sp.__dict__, "max_new_tokens": max_new_tokens})
        out.append(sp)
    return out


def make_request(
    engine: Engine,
    prompt: Prompt,
    sp: SamplingParams,
    request_id: str | None,
    new_id: Callable[[], str],
    *,
    listener: Listener | None = None,
    incremental: bool = False,
) -> Request:
    """A validated request for `engine` (its tokenizer, vocabulary, context and cache);
    `new_id()` names it when `request_id` is None."""
    ids, prompt_text = _prompt_ids(engine, prompt)
    if sp.max_new_tokens is None:  # not given: max_length's rest, else the engine's default,
        room = engine.max_model_len - len(ids)  # capped to the context left
        want = engine.default_max_new_tokens if sp.max_length is None else sp.max_length - len(ids)
        sp = dataclasses.replace(sp, max_new_tokens=max(1, min(want, room)))
    _check_fits(engine, ids, sp)
    if sp.stop and engine.tokenizer is None:
        raise FieldError("stop: stop strings need a tokenizer", "stop")
    for t in sp.stop_token_ids:
        if t >= engine.vocab_size:
            raise FieldError(f"stop_token_ids: {t} is outside the vocabulary", "stop_token_ids")
    if sp.priority and getattr(engine.config, "scheduling_policy", "fcfs") != "priority":
        raise FieldError("priority: this engine schedules in arrival order; start it with "
                         "scheduling_policy='priority' to use request priorities", "priority")
    lora_salt = 0
    if sp.lora is not None:
        manager = getattr(engine, "lora", None)
        if manager is None:
            raise FieldError("lora: this engine was started without LoRA support (pass "
                             "lora_modules= or enable_lora=True)", "lora")
        lora_salt = manager.salt(sp.lora)
    guide = None
    if sp.guided:  # compiled here, in the caller's thread, not in a step
        factory = getattr(engine, "guides", None)
        if factory is None:
            raise FieldError("structured outputs are not supported by this engine")
        guide = factory.guide(sp)
    if request_id is None:
        request_id = new_id()
    elif not isinstance(request_id, str) or not request_id:
        raise FieldError("request_id must be a non-empty string", "request_id")
    detok = IncrementalDetokenizer(
        engine.tokenizer,
        ids,
        skip_special_tokens=sp.skip_special_tokens,
        stop=sp.stop,
        incremental=incremental,
    )
    out = RequestOutput(
        request_id=request_id,
        prompt_token_ids=ids,
        prompt=prompt_text,
        logprobs=[] if sp.logprobs is not None else None,
        prompt_logprobs=[None] if sp.prompt_logprobs is not None else None,
    )
    return Request(
        request_id=request_id,
        prompt_ids=ids,
        prompt_text=prompt_text,
        params=sp,
        sstate=SamplingState(sp, ids, guide=guide),
        detok=detok,
        eos_token_ids=[] if sp.ignore_eos else list(engine.eos_token_ids),
        arrival=time.perf_counter(),
        output=out,
        listener=listener,
        lora_salt=lora_salt,
    )


def _prompt_ids(engine: Engine, prompt: Prompt) -> tuple[list[int], str | None]:
    """(token ids in the vocabulary, the prompt text when it was a string)."""
    prompt_text = None
    if isinstance(prompt, str):
        if not prompt:
            raise FieldError("prompt must not be empty", "prompt")
        if engine.tokenizer is None:
            raise FieldError("prompt: a string prompt needs a tokenizer; pass token ids", "prompt")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no text a tokenizer takes
            raise FieldError(f"prompt is not valid Unicode text ({exc.reason} at "
                             f"{exc.start})", "prompt") from None
        prompt_text = prompt
        ids = list(engine.tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, bytes | bytearray):
        raise FieldError("prompt must be a string or token ids, not bytes (decode it first)",
                         "prompt")
    else:
        ids = _as_id_list(prompt)
    if not ids:
        raise FieldError("prompt must not be empty", "prompt")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= engine.vocab_size:
        bad = lo if lo < 0 else hi
        raise FieldError(
            f"prompt: token id {bad} is outside the vocabulary [0, {engine.vocab_size})", "prompt"
        )
    return ids, prompt_text


def _check_fits(engine: Engine, ids: list[int], sp: SamplingParams) -> None:
    """The prompt and its `max_new_tokens` fit the model's context, and the cache (the
    scheduler's own rule, `Scheduler.check_fits`: a `FieldError` naming "prompt" or
    "max_new_tokens")."""
    assert sp.max_new_tokens is not None
    if len(ids) >= engine.max_model_len:
        raise FieldError(
            f"prompt is {len(ids)} tokens, longer than the model's context "
            f"(max_position_embeddings={engine.max_model_len})",
            "prompt",
        )
    if len(ids) + sp.max_new_tokens > engine.max_model_len:
        raise FieldError(
            f"max_new_tokens={sp.max_new_tokens} with a {len(ids)}-token prompt exceeds the "
            f"model's context (max_position_embeddings={engine.max_model_len})",
            "max_new_tokens",
        )
    engine.scheduler.check_fits(len(ids), sp.max_new_tokens)


def as_prompt_list(prompts: Any) -> list[Prompt]:
    """One prompt or a list of them as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor | np.ndarray):
        prompts = prompts.tolist()
    prompts = list(prompts)
    if prompts and all(isinstance(p, int | np.integer) for p in prompts):
        return [prompts]
    return prompts


def _as_id_list(prompt: Any) -> list[int]:
    if isinstance(prompt, torch.Tensor | np.ndarray):
        prompt = prompt.tolist()
    try:
        ids = list(prompt)
    except TypeError:
        raise FieldError(
            f"prompt must be a string or a list of token ids, got {prompt!r}", "prompt"
        ) from None
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise FieldError(f"prompt: token ids must be integers, got {t!r}", "prompt")
    return [int(t) for t in ids]
