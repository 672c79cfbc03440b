"""From a request body to what the engine runs: prompt token ids, ``SamplingParams`` per
choice, and the context-length checks the engine would make (before any header is sent)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ferrobatch.errors import FieldError
from ferrobatch.sampling.grammar import check_grammar_fields
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.server.protocol import SamplingFields, bad_request

if TYPE_CHECKING:
    from ferrobatch.engine.llm_engine import Engine

__all__ = [
    "base_sampling",
    "check_context",
    "check_vocab",
    "choice_samplings",
    "completion_prompts",
    "prompt_texts",
    "response_format_sampling",
]

Prompt = str | list[str] | list[int] | list[list[int]]

_SAMPLING_TO_OPENAI = {"max_new_tokens": "max_tokens"}
#: the request field a guided decoding field came from (the server fills `json_schema` from
#: `response_format` and `grammar` from `tools`), for errors raised while generating
_GUIDED_TO_OPENAI = {"json_schema": "response_format", "grammar": "tools"}


# ---------------------------------------------------------------------------------------
# sampling


def base_sampling(req: SamplingFields, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments of a request (before per-choice seeds)."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported.", "logit_bias", "unsupported")
    stops: list[str] = []
    if isinstance(req.stop, str):
        stops = [req.stop] if req.stop else []
    elif req.stop:
        stops = [s for s in req.stop if s]
    if len(stops) > 16:
        raise bad_request("At most 16 stop strings are allowed.", "stop")
    top_k = req.top_k if req.top_k is not None else 0
    # /v1/completions echo + logprobs: the prompt tokens' logprobs too (the engine's
    # prompt_logprobs). A scoring request (max_tokens 0 or 1, lm-eval's loglikelihood)
    # ignores EOS, so its one generated token is always returned (0: generated, not sent).
    echo_lp = bool(getattr(req, "echo", False)) and logprobs is not None
    scoring = echo_lp and max_tokens <= 1
    kwargs: dict[str, Any] = {
        "max_new_tokens": max(max_tokens, 1),
        "temperature": 1.0 if req.temperature is None else float(req.temperature),
        "top_k": max(top_k, 0),
        "top_p": 1.0 if req.top_p is None else float(req.top_p),
        "stop": tuple(stops),
        "ignore_eos": req.ignore_eos or scoring,
        "skip_special_tokens": req.skip_special_tokens,
        "logprobs": logprobs,
        "seed": req.seed,
        "prompt_logprobs": logprobs if echo_lp else None,
    }
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = float(value)
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.priority:
        kwargs["priority"] = req.priority
    return kwargs


def response_format_sampling(fmt: Any) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments of an OpenAI ``response_format`` (guided
    decoding, `ferrobatch.sampling.guided`): ``text`` → none; ``json_object`` → any JSON object;
    ``json_schema`` → its ``schema`` (``strict`` or not: the output always matches it).
    A 400 naming ``response_format`` when it is malformed or its schema invalid."""
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object.", "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format json_schema needs a 'json_schema' object "
                "({'name': ..., 'schema': {...}, 'strict': ...}).",
                "response_format",
            )
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request("response_format.json_schema.name must be a string.",
                              "response_format")  # fmt: skip
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict must be a boolean.",
                              "response_format")  # fmt: skip
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object.",
                              "response_format")  # fmt: skip
    else:
        raise bad_request(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
            "response_format",
        )
    class _Fields:
        json_schema, regex, grammar = schema, None, None

    try:
        check_grammar_fields(_Fields)
    except ValueError as exc:
        raise bad_request(
            f"Invalid response_format: {str(exc).replace('json_schema is', 'the schema is')}",
            "response_format",
        ) from None
    return {"json_schema": schema}


def choice_samplings(base: dict[str, Any], n: int) -> list[Any]:
    """One SamplingParams per choice; seeded choices get seed, seed+1, ... so they differ."""
    out = []
    for i in range(n):
        kw = dict(base)
        if kw.get("seed") is not None and i:
            kw["seed"] = int(kw["seed"]) + i
        out.append(_make_sampling(kw))
    return out


def _make_sampling(kwargs: dict[str, Any]) -> Any:
    try:
        return SamplingParams(**kwargs)
    except FieldError as exc:
        param = openai_param(exc.field)
        text = str(exc)
        if exc.field in _SAMPLING_TO_OPENAI:
            text = text.replace(exc.field, param, 1)
        raise bad_request(f"Invalid sampling parameters: {text}", param) from None
    except TypeError as exc:
        raise bad_request(f"Invalid sampling parameters: {exc}") from None


def openai_param(field: str | None, prompt_param: str | None = None) -> str | None:
    """OpenAI's name for the `SamplingParams` / engine argument `field` (`FieldError.field`);
    the engine's `"prompt"` is the request's `prompt_param` ("prompt" or "messages")."""
    if field == "prompt" and prompt_param is not None:
        return prompt_param
    if field in _GUIDED_TO_OPENAI:
        return _GUIDED_TO_OPENAI[field]
    return _SAMPLING_TO_OPENAI.get(field, field) if field is not None else None


# ---------------------------------------------------------------------------------------
# prompts


def completion_prompts(engine: Engine, prompt: Prompt) -> list[list[int]]:
    """Token ids of each prompt of a ``/v1/completions`` body."""
    if isinstance(prompt, str):
        return [_encode_text(engine, prompt)]
    if not prompt:
        raise bad_request("'prompt' must not be empty.", "prompt")
    if isinstance(prompt[0], str):
        return [_encode_text(engine, p) for p in prompt]  # type: ignore[arg-type]
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[union-attr]


def prompt_texts(engine: Engine, prompt: Prompt, ids: list[list[int]]) -> list[str]:
    """The text of each prompt (for ``echo``): as sent, or decoded from token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return [str(p) for p in prompt]
    return [engine.tokenizer.decode(p) for p in ids]


def _encode_text(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer(text)["input_ids"])


# ---------------------------------------------------------------------------------------
# limits


def check_vocab(engine: Engine, ids: list[int]) -> None:
    """Token ids given directly must be in the model's vocabulary."""
    vocab = engine.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"Token ids in 'prompt' must be in [0, {vocab}).", "prompt")


def check_context(engine: Engine, prompt_len: int, max_tokens: int | None, param: str) -> int:
    """Check the prompt fits the model's context and the cache; return the max_tokens to use
    (filling both if None). The cache's limit is the scheduler's own
    (`Engine.max_request_tokens`), so a stream never fails after its headers are sent.
    """
    limit = engine.max_model_len
    cache = engine.max_request_tokens
    blocks = f"num_blocks={engine.num_blocks}"
    if prompt_len == 0:
        raise bad_request(f"'{param}' must not be empty.", param)
    if prompt_len >= limit:
        room = (f"at most {limit - 1} prompt tokens fit (the engine computes the position "
                "after the prompt, even to score it)") if prompt_len == limit else \
            f"the prompt has {prompt_len} tokens"
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, and {room}; shorten "
            f"'{param}'.",
            param,
            "context_length_exceeded",
        )
    if prompt_len >= cache:
        raise bad_request(
            f"The prompt has {prompt_len} tokens but the KV cache holds at most {cache} tokens "
            f"per request ({blocks}); shorten '{param}'.",
            param,
            "context_length_exceeded",
        )
    if max_tokens is None:
        return min(limit, cache) - prompt_len
    if prompt_len + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but {prompt_len + max_tokens}"
            f" were requested ({prompt_len} in the prompt, {max_tokens} for the completion); "
            "reduce 'max_tokens' or the prompt.",
            "max_tokens",
            "context_length_exceeded",
        )
    if prompt_len + max_tokens > cache:
        raise bad_request(
            f"The KV cache holds at most {cache} tokens per request ({blocks}), but "
            f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion); reduce 'max_tokens' or the prompt.",
            "max_tokens",
            "context_length_exceeded",
        )
    return max_tokens


def check_with_engine(engine: Engine, jobs: Sequence[Any], param: str) -> None:
    """The engine's own admission checks (`Engine.check_request`) on every choice before
    any response starts, so what `check_context` cannot see (sliding-window rings, the
    exact cache arithmetic) is a 400 here, never an error after a stream's headers."""
    for job in jobs:
        try:
            engine.check_request(job.prompt_ids, job.sampling)
        except ValueError as exc:  # FieldError names the argument; others: the prompt
            field = exc.field if isinstance(exc, FieldError) else None
            field = openai_param(field or "prompt", param)
            raise bad_request(f"The engine rejected the request: {exc}", field) from None
