"""OpenAI-compatible HTTP server on top of :class:`ferrobatch.Engine`.

``create_app(engine, model_name=...)`` builds a FastAPI app that serves

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming with Server-Sent
  Events in the OpenAI chunk format, ``n``, sampling parameters, stop strings, seeds,
  logprobs, ``stream_options.include_usage``),
* ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text format).

Every connection feeds the same engine loop (``engine.astream``), so requests from all
clients join one continuous batch. A client that disconnects has its requests cancelled at
once, which frees their cache blocks. Errors use OpenAI's JSON shape
``{"error": {"message", "type", "param", "code"}}``.

Run it with ``ferrobatch serve`` (see :mod:`ferrobatch.cli`) or, embedded, with
:class:`BackgroundServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ferrobatch.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ferrobatch.metrics import ServerMetrics

__all__ = [
    "APIError",
    "BackgroundServer",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "create_app",
]

logger = logging.getLogger("ferrobatch.server")

#: Default cap on a request body (bytes); larger bodies get 413.
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
#: Default cap on requests (choices) waiting for their first token; more get 429.
DEFAULT_MAX_QUEUE = 1024
#: ``max_tokens`` of ``/v1/completions`` when the request leaves it out (OpenAI's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Bodies larger than this multiple of the cap are not drained before answering 413.
_DRAIN_FACTOR = 16


class EngineLike(Protocol):
    """The part of ``ferrobatch.Engine`` (ARCHITECTURE.md §6) the server uses."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def astream(
        self, prompt: str | list[int], sampling: Any = None, *, request_id: str | None = None
    ) -> AsyncIterator[Any]: ...

    def cancel(self, request_id: str) -> bool: ...

    def stats(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------
# errors


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code or "invalid_value")


# ---------------------------------------------------------------------------------------
# request schemas


class _Schema(BaseModel):
    # strict: no silent coercion ("5" is not an integer, 1 is not a boolean); unknown
    # fields are ignored, as OpenAI-compatible servers usually do.
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``"field": null`` means "not given" (many clients send nulls for unset fields)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Schema):
    """``stream_options``: ``include_usage`` adds a last chunk with token counts."""

    include_usage: bool = False


class _SamplingFields(_Schema):
    """Sampling fields shared by both endpoints (OpenAI names, plus a few extensions)."""

    model: str | None = Field(None, description="Served model name (default: the only one).")
    n: int = Field(1, ge=1, le=128, description="Choices per prompt.")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="Sampling temperature; 0 = greedy. Default 1.0."
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="Extension: -1 or 0 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Extension.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="Extension.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings.")
    stop_token_ids: list[int] | None = Field(None, description="Extension.")
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="Extension: keep going past EOS.")
    skip_special_tokens: bool = Field(True, description="Extension.")
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ContentPart(_Schema):
    """A text part of a message's content (images and audio are not supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Schema):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


# Friendly descriptions of union-typed fields for validation messages.
_FIELD_TYPES = {
    "prompt": (
        "a string, an array of strings, an array of token ids or an array of token-id arrays"
    ),
    "stop": "a string or an array of strings",
    "content": "a string or an array of text content parts",
}


def _validation_error(exc: ValidationError) -> APIError:
    """Turn pydantic's first error into a 400 naming the field."""
    err = exc.errors(include_url=False)[0]
    etype = err.get("type", "")
    if etype == "json_invalid":
        return APIError(
            400,
            f"Request body is not valid JSON: {err.get('msg', '')}. "
            "Send a JSON object with Content-Type: application/json.",
            code="invalid_json",
        )
    if etype == "model_type" and not err.get("loc"):
        return APIError(400, "Request body must be a JSON object.", code="invalid_json")
    path: list[str] = []
    union = False
    for part in err.get("loc", ()):
        if isinstance(part, int):
            path.append(f"[{part}]")
        elif (
            "[" in part
            or part in ("str", "int", "float", "bool", "dict", "list")
            or (part and part[0].isupper())
        ):
            union = True  # a union branch tag ("list[int]", "ContentPart"): stop here
            break
        else:
            path.append(("." if path else "") + part)
    param = "".join(path) or None
    leaf = err["loc"][-1] if err.get("loc") else None
    if etype == "missing":
        return APIError(400, f"Missing required field '{param}'.", param=param, code="missing")
    if union and param is not None:
        key = param.split(".")[-1].split("[")[0]
        expected = _FIELD_TYPES.get(key)
        if expected:
            return _bad_request(
                f"Invalid type for '{param}': expected {expected}.", param, "invalid_type"
            )
    msg = err.get("msg", "invalid value")
    code = "invalid_type" if etype.endswith("_type") else "invalid_value"
    given = err.get("input")
    shown = ""
    if given is not None and not isinstance(given, dict | list) and leaf is not None:
        shown = f" (got {json.dumps(given)[:80]})"
    return _bad_request(f"Invalid value for '{param}': {msg}{shown}.", param, code)


# ---------------------------------------------------------------------------------------
# server state


@dataclass
class _State:
    engine: Any
    model_name: str | None
    api_key: str | None
    max_queue: int | None
    max_body_bytes: int
    metrics: ServerMetrics
    owns_engine: bool = False
    closing: bool = False
    load_error: str | None = None
    waiting: int = 0  # choices accepted, no token yet
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="ferrobatch-tok")
    )
    token_text: dict[int, str] = field(default_factory=dict)

    def served_names(self) -> set[str]:
        names = set()
        if self.model_name:
            names.add(self.model_name)
        name = getattr(self.engine, "model_name", None) if self.engine is not None else None
        if name:
            names.add(str(name))
        return names

    def primary_name(self) -> str:
        if self.model_name:
            return self.model_name
        name = getattr(self.engine, "model_name", None) if self.engine is not None else None
        return str(name) if name else "ferrobatch"

    def token_str(self, token_id: int) -> str:
        """Text of one token (cached)."""
        text = self.token_text.get(token_id)
        if text is None:
            try:
                text = self.engine.tokenizer.decode([token_id])
            except Exception:  # pragma: no cover - a broken tokenizer entry
                text = ""
            if len(self.token_text) < 1_000_000:
                self.token_text[token_id] = text
        return text


def _require_auth(state: _State, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise APIError(
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), state.api_key.encode()
    ):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def _engine_error(engine: Any) -> BaseException | None:
    """The exception that killed the engine loop, if any."""
    for name in ("error", "_error"):
        value = getattr(engine, name, None)
        if isinstance(value, BaseException):
            return value
    return None


def _require_engine(state: _State) -> Any:
    if state.engine is not None and (err := _engine_error(state.engine)) is not None:
        raise APIError(
            503,
            f"The engine loop failed: {type(err).__name__}: {err}",
            type="service_unavailable",
            code="engine_failed",
        )
    if state.closing:
        raise APIError(
            503, "The server is shutting down.", type="service_unavailable", code="shutting_down"
        )
    if state.engine is None:
        if state.load_error:
            message = f"The engine failed to load: {state.load_error}"
        else:
            message = "The engine is loading; retry shortly."
        raise APIError(
            503,
            message,
            type="service_unavailable",
            code="engine_not_ready",
            headers={"Retry-After": "5"},
        )
    return state.engine


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = APIError(
        413,
        f"Request body too large: the limit is {limit} bytes.",
        code="request_too_large",
    )
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise _bad_request("Invalid Content-Length header.") from None
        if size > limit:
            if size <= limit * _DRAIN_FACTOR:
                async for _ in request.stream():  # drain so the client reads our answer
                    pass
            raise too_big
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            drained = size
            async for rest in request.stream():
                drained += len(rest)
                if drained > limit * _DRAIN_FACTOR:
                    break
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(schema: type[BaseModel], body: bytes) -> Any:
    if not body.strip():
        raise APIError(400, "Request body is empty: send a JSON object.", code="invalid_json")
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _check_model(state: _State, name: str | None) -> None:
    if name is None:
        return
    if name not in state.served_names():
        raise APIError(
            404,
            f"The model '{name}' does not exist. This server serves '{state.primary_name()}'.",
            param="model",
            code="model_not_found",
        )


# ---------------------------------------------------------------------------------------
# sampling


def _sampling_class() -> Any:
    from ferrobatch.sampling import SamplingParams

    return SamplingParams


_SAMPLING_TO_OPENAI = {"max_new_tokens": "max_tokens"}


def _make_sampling(kwargs: dict[str, Any]) -> Any:
    try:
        return _sampling_class()(**kwargs)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        first = text.split(" ", 1)[0]
        param = _SAMPLING_TO_OPENAI.get(first, first if first in kwargs else None)
        if param in _SAMPLING_TO_OPENAI:
            text = text.replace(param, _SAMPLING_TO_OPENAI[param], 1)
        raise _bad_request(f"Invalid sampling parameters: {text}", param) from None


def _base_sampling(req: _SamplingFields, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
    if req.logit_bias:
        raise _bad_request("logit_bias is not supported.", "logit_bias", "unsupported")
    stops: list[str] = []
    if isinstance(req.stop, str):
        stops = [req.stop] if req.stop else []
    elif req.stop:
        stops = [s for s in req.stop if s]
    if len(stops) > 16:
        raise _bad_request("At most 16 stop strings are allowed.", "stop")
    top_k = req.top_k if req.top_k is not None else 0
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": 1.0 if req.temperature is None else float(req.temperature),
        "top_k": max(top_k, 0),
        "top_p": 1.0 if req.top_p is None else float(req.top_p),
        "stop": tuple(stops),
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "logprobs": logprobs,
        "seed": req.seed,
    }
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = float(value)
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(req.stop_token_ids)
    return kwargs


def _choice_samplings(base: dict[str, Any], n: int) -> list[Any]:
    """One SamplingParams per choice; seeded choices get seed, seed+1, ... so they differ."""
    out = []
    for i in range(n):
        kw = dict(base)
        if kw.get("seed") is not None and i:
            kw["seed"] = int(kw["seed"]) + i
        out.append(_make_sampling(kw))
    return out


def _cache_tokens(engine: Any) -> int | None:
    """Tokens one request may hold in the cache (full-attention models), else None."""
    layer_types = getattr(engine, "layer_types", None)
    num_blocks = getattr(engine, "num_blocks", None)
    page_size = getattr(getattr(engine, "config", None), "page_size", None)
    if not layer_types or "full_attention" not in layer_types:
        return None
    if not isinstance(num_blocks, int) or not isinstance(page_size, int):
        return None
    return num_blocks * page_size


def _check_context(engine: Any, prompt_len: int, max_tokens: int | None, param: str) -> int:
    """Check the prompt fits; return the max_tokens to use (filling the context if None).

    Mirrors the engine's own checks so a stream never fails after its headers are sent.
    """
    limit = int(getattr(engine, "max_model_len", 0) or 0) or (1 << 30)
    cache = _cache_tokens(engine)
    if prompt_len == 0:
        raise _bad_request(f"'{param}' must not be empty.", param)
    if prompt_len >= limit:
        raise _bad_request(
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt_len} tokens; shorten '{param}'.",
            param,
            "context_length_exceeded",
        )
    if cache is not None and prompt_len >= cache:
        raise _bad_request(
            f"The prompt has {prompt_len} tokens but the KV cache holds at most {cache} tokens "
            f"per request; shorten '{param}'.",
            param,
            "context_length_exceeded",
        )
    if max_tokens is None:
        return min(limit, cache or limit) - prompt_len
    if prompt_len + max_tokens > limit:
        raise _bad_request(
            f"This model's maximum context length is {limit} tokens, but {prompt_len + max_tokens}"
            f" were requested ({prompt_len} in the prompt, {max_tokens} for the completion); "
            "reduce 'max_tokens' or the prompt.",
            "max_tokens",
            "context_length_exceeded",
        )
    if cache is not None and prompt_len + max_tokens > cache:
        raise _bad_request(
            f"The KV cache holds at most {cache} tokens per request, but {prompt_len + max_tokens}"
            f" were requested ({prompt_len} in the prompt, {max_tokens} for the completion); "
            "reduce 'max_tokens' or the prompt.",
            "max_tokens",
            "context_length_exceeded",
        )
    return max_tokens


# ---------------------------------------------------------------------------------------
# running choices


@dataclass
class _Job:
    index: int
    prompt_ids: list[int]
    sampling: Any
    request_id: str
    arrival: float
    started: bool = False
    finished: bool = False
    accounted: bool = False
    last: float | None = None


@dataclass
class _Event:
    index: int
    delta: Any = None
    error: BaseException | None = None
    done: bool = False


class _Run:
    """A set of engine requests (the choices of one HTTP request) merged into one stream."""

    def __init__(self, state: _State, engine: Any, endpoint: str, jobs: list[_Job]) -> None:
        self.state = state
        self.engine = engine
        self.endpoint = endpoint
        self.jobs = jobs
        self.queue: asyncio.Queue[_Event] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    def start(self) -> None:
        """Submit every choice (call with no await between admission and this)."""
        for job in self.jobs:
            self.state.waiting += 1
            self.state.metrics.on_admitted(len(job.prompt_ids))
            self.tasks.append(asyncio.create_task(self._pump(job)))

    async def _pump(self, job: _Job) -> None:
        stream = self.engine.astream(job.prompt_ids, job.sampling, request_id=job.request_id)
        reason = "cancelled"
        try:
            async for delta in stream:
                now = time.perf_counter()
                count = len(delta.token_ids or ())
                if count:
                    if not job.started:
                        job.started = True
                        self.state.waiting -= 1
                        self.state.metrics.on_first_token(now - job.arrival)
                        self.state.metrics.on_tokens(count, None)
                    else:
                        gap = now - (job.last if job.last is not None else now)
                        self.state.metrics.on_tokens(count, gap)
                    job.last = now
                if delta.finished:
                    job.finished = True
                    reason = delta.finish_reason or "stop"
                self.queue.put_nowait(_Event(job.index, delta=delta))
                if job.finished:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # delivered to the client as an error
            reason = "error"
            logger.warning("request %s failed: %s", job.request_id, exc)
            self.queue.put_nowait(_Event(job.index, error=exc))
        finally:
            self._finish(job, reason)
            with contextlib.suppress(Exception):
                closer = getattr(stream, "aclose", None)
                if closer is not None:
                    await closer()
        self.queue.put_nowait(_Event(job.index, done=True))

    def _finish(self, job: _Job, reason: str) -> None:
        if job.accounted:
            return
        job.accounted = True
        if not job.finished:
            with contextlib.suppress(Exception):
                self.engine.cancel(job.request_id)
        if not job.started:
            self.state.waiting -= 1
        duration = (job.last - job.arrival) if job.last is not None else None
        self.state.metrics.on_finished(self.endpoint, reason, job.started, duration)

    async def events(self) -> AsyncIterator[_Event]:
        """Deltas and errors of every choice until all are done."""
        remaining = len(self.jobs)
        while remaining:
            event = await self.queue.get()
            if event.done:
                remaining -= 1
                continue
            yield event

    async def close(self) -> None:
        """Cancel whatever still runs (idempotent); cancels engine requests first."""
        if self.closed:
            return
        self.closed = True
        for job in self.jobs:
            if not job.finished:
                with contextlib.suppress(Exception):
                    self.engine.cancel(job.request_id)
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for job in self.jobs:  # tasks cancelled before their first step never ran _pump
            self._finish(job, "cancelled")


def _admit(state: _State, count: int) -> None:
    if state.max_queue is not None and state.waiting + count > state.max_queue:
        raise APIError(
            429,
            f"The server's queue is full ({state.waiting} requests waiting, limit "
            f"{state.max_queue}); retry later.",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


class _EventStreamResponse(StreamingResponse):
    """SSE response that always cancels its engine requests when it ends, however it ends.

    It watches for the client's disconnect while streaming (whatever the ASGI spec version
    the server speaks), so a client that goes away mid-stream cancels its requests at once.
    """

    def __init__(self, content: AsyncIterator[str], run: _Run) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._run = run
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.create_task(self.stream_response(send))
        watcher = asyncio.create_task(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if streamer in done:
                exc = streamer.exception()
                if exc is not None and not isinstance(exc, OSError):
                    raise exc
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await self._run.close()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._content.aclose()  # type: ignore[attr-defined]


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _queue_full(exc: BaseException) -> APIError | None:
    """The engine's own queue bound (``max_queue_size``) answers like --max-queue: 429."""
    if type(exc).__name__ in ("QueueFullError", "QueueFull"):
        return APIError(
            429,
            f"The engine's queue is full ({exc}); retry later.",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    return None


def _error_payload(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, APIError):
        return exc.body()
    if (full := _queue_full(exc)) is not None:
        return full.body()
    status = 400 if isinstance(exc, ValueError) else 500
    kind = "invalid_request_error" if status == 400 else "server_error"
    return APIError(status, f"Generation failed: {exc}", type=kind).body()


def _raise_for(exc: BaseException) -> None:
    if isinstance(exc, APIError):
        raise exc
    if (full := _queue_full(exc)) is not None:
        raise full from exc
    if isinstance(exc, ValueError):
        raise _bad_request(f"The engine rejected the request: {exc}") from exc
    raise APIError(500, f"Generation failed: {exc}", type="server_error") from exc


async def _collect(run: _Run, request: Request) -> dict[int, _Acc]:
    """Run every choice to the end (non-streaming); cancel them if the client leaves."""
    accs = {job.index: _Acc() for job in run.jobs}

    async def consume() -> None:
        async for event in run.events():
            if event.error is not None:
                raise event.error
            accs[event.index].add(event.delta)

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            exc = consumer.exception()
            if exc is not None:
                _raise_for(exc)
        else:
            raise _ClientGone()
    finally:
        consumer.cancel()
        watcher.cancel()
        await run.close()
        await asyncio.gather(consumer, watcher, return_exceptions=True)
    return accs


class _ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


@dataclass
class _Acc:
    """A choice's tokens, text and logprobs accumulated from its deltas."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: Any) -> None:
        self.token_ids.extend(delta.token_ids or ())
        if delta.text:
            self.text.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason or "stop"


# ---------------------------------------------------------------------------------------
# logprob formatting


def _top(d: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def _chat_logprobs(
    state: _State, token_ids: Sequence[int], lps: Sequence[dict[int, float]], n: int
) -> dict[str, Any]:
    content = []
    for tid, d in zip(token_ids, lps, strict=False):
        text = state.token_str(tid)
        content.append({
            "token": text,
            "logprob": _finite(d.get(tid, -9999.0)),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := state.token_str(t)), "logprob": _finite(v),
                 "bytes": list(s.encode("utf-8"))}
                for t, v in _top(d, n)
            ],
        })  # fmt: skip
    return {"content": content}


def _completion_logprobs(
    state: _State,
    token_ids: Sequence[int],
    lps: Sequence[dict[int, float]],
    n: int,
    offset: int,
) -> tuple[dict[str, Any], int]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps, strict=False):
        text = state.token_str(tid)
        tokens.append(text)
        token_lps.append(_finite(d.get(tid, -9999.0)))
        tops.append({state.token_str(t): _finite(v) for t, v in _top(d, n)} if n else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }, offset


def _finite(value: float) -> float:
    return -9999.0 if math.isinf(value) or math.isnan(value) else float(value)


# ---------------------------------------------------------------------------------------
# app


def create_app(
    engine: Any = None,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int | None = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    engine_loader: Callable[[], Any] | None = None,
    close_engine: bool | None = None,
) -> FastAPI:
    """Build the OpenAI-compatible app around ``engine``.

    Args:
        engine: a started or startable ``ferrobatch.Engine`` (anything with the §6 surface).
            ``None`` with ``engine_loader``: the app answers 503 until the loader returns.
        model_name: the name clients pass as ``model`` (``engine.model_name`` also works).
        api_key: when set, every ``/v1`` call needs ``Authorization: Bearer <api_key>``.
        max_queue: requests (choices) allowed to wait for their first token; more get 429.
            ``None`` = unbounded.
        max_body_bytes: request body cap; larger bodies get 413.
        engine_loader: builds the engine in a background thread at startup.
        close_engine: close the engine at shutdown (default: only an engine the app loaded).
    """
    if engine is None and engine_loader is None:
        raise ValueError("create_app needs an engine or an engine_loader")
    if max_queue is not None and max_queue < 1:
        raise ValueError("max_queue must be >= 1 or None")
    if max_body_bytes < 1024:
        raise ValueError("max_body_bytes must be >= 1024")
    state = _State(
        engine=engine,
        model_name=model_name,
        api_key=api_key or None,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        metrics=ServerMetrics(),
        owns_engine=bool(close_engine) if close_engine is not None else engine is None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader_thread: threading.Thread | None = None
        if state.engine is None and engine_loader is not None:

            def load() -> None:
                try:
                    loaded = engine_loader()
                    if state.closing:
                        with contextlib.suppress(Exception):
                            loaded.close()
                        return
                    state.engine = loaded
                    logger.info("engine ready: %s", state.primary_name())
                except Exception as exc:
                    logger.exception("engine failed to load")
                    state.load_error = f"{type(exc).__name__}: {exc}"

            loader_thread = threading.Thread(target=load, name="ferrobatch-load", daemon=True)
            loader_thread.start()
        try:
            yield
        finally:
            state.closing = True
            if state.owns_engine and state.engine is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(state.engine.close)
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="ferrobatch",
        description="OpenAI-compatible API of the ferrobatch continuous-batching engine.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.ferrobatch = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        state.metrics.on_request_error(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        state.metrics.on_request_error(exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        state.metrics.on_request_error(500)
        err = APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    async def tokenize(fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(state.tokenize_pool, fn, *args)
        except APIError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise _bad_request(f"Could not tokenize the input: {exc}") from None

    @app.get("/health")
    async def health() -> Response:
        """200 when the engine is ready, 503 while it loads or when it failed."""
        err = _engine_error(state.engine) if state.engine is not None else None
        if err is not None:
            return JSONResponse(
                {"status": "failed", "error": f"{type(err).__name__}: {err}"}, status_code=503
            )
        if state.closing or state.engine is None:
            status = (
                "shutting_down" if state.closing else ("failed" if state.load_error else "loading")
            )
            body: dict[str, Any] = {"status": status}
            if state.load_error:
                body["error"] = state.load_error
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "model": state.primary_name()})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format."""
        stats = None
        if state.engine is not None:
            try:
                stats = state.engine.stats()
            except Exception as exc:  # pragma: no cover - scrape must not fail
                logger.warning("engine.stats() failed: %s", exc)
        text = state.metrics.render(stats, ready=state.engine is not None and not state.closing)
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    def model_entry(engine: Any) -> dict[str, Any]:
        return {
            "id": state.primary_name(),
            "object": "model",
            "created": int(time.time()),
            "owned_by": "ferrobatch",
            "max_model_len": int(getattr(engine, "max_model_len", 0) or 0),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The served model."""
        _require_auth(state, request)
        engine = _require_engine(state)
        return JSONResponse({"object": "list", "data": [model_entry(engine)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        """One model by name (404 unless it is the served one)."""
        _require_auth(state, request)
        engine = _require_engine(state)
        _check_model(state, model_id)
        return JSONResponse({**model_entry(engine), "id": model_id})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI text completions."""
        arrival = time.perf_counter()
        _require_auth(state, request)
        engine = _require_engine(state)
        body = await _read_body(request, state.max_body_bytes)
        req: CompletionRequest = _parse(CompletionRequest, body)
        _check_model(state, req.model)
        if req.suffix:
            raise _bad_request("suffix is not supported.", "suffix", "unsupported")
        if req.best_of is not None and req.best_of != req.n:
            raise _bad_request("best_of must equal n (or be left out).", "best_of", "unsupported")
        if req.echo and req.logprobs is not None:
            raise _bad_request(
                "echo together with logprobs is not supported.", "echo", "unsupported"
            )
        prompts = await tokenize(_completion_prompts, engine, req.prompt)
        vocab = _vocab_size(engine)
        max_tokens_each = []
        for ids in prompts:
            if vocab and any(not 0 <= t < vocab for t in ids):
                raise _bad_request(f"Token ids in 'prompt' must be in [0, {vocab}).", "prompt")
            max_tokens_each.append(_check_context(engine, len(ids), req.max_tokens, "prompt"))
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs: list[_Job] = []
        for p, ids in enumerate(prompts):
            base = _base_sampling(req, max_tokens_each[p], req.logprobs)
            for i, sp in enumerate(_choice_samplings(base, req.n)):
                index = p * req.n + i
                jobs.append(_Job(index, ids, sp, f"{rid}-{index}", arrival))
        _admit(state, len(jobs))
        run = _Run(state, engine, "completions", jobs)
        run.start()
        echo_texts: dict[int, str] = {}
        if req.echo:
            texts = _prompt_texts(engine, req.prompt, prompts)
            echo_texts = {job.index: texts[job.index // req.n] for job in jobs}
        meta = _Meta(rid, int(time.time()), req.model or state.primary_name(),
                     prompt_tokens=sum(len(p) for p in prompts))  # fmt: skip
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            gen = _completion_stream(state, run, meta, req.logprobs, include_usage, echo_texts)
            return _EventStreamResponse(gen, run)
        try:
            accs = await _collect(run, request)
        except _ClientGone:
            return Response(status_code=499)
        choices = []
        completion_tokens = 0
        for job in jobs:
            acc = accs[job.index]
            completion_tokens += len(acc.token_ids)
            text = echo_texts.get(job.index, "") + "".join(acc.text)
            lp = None
            if req.logprobs is not None:
                lp, _ = _completion_logprobs(state, acc.token_ids, acc.logprobs, req.logprobs, 0)
            choices.append({
                "index": job.index, "text": text, "logprobs": lp,
                "finish_reason": acc.finish_reason,
            })  # fmt: skip
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": meta.created,
            "model": meta.model, "choices": choices,
            "usage": _usage(meta.prompt_tokens, completion_tokens),
        })  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions (the model's chat template)."""
        arrival = time.perf_counter()
        _require_auth(state, request)
        engine = _require_engine(state)
        body = await _read_body(request, state.max_body_bytes)
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, body)
        _check_model(state, req.model)
        if req.tools or req.tool_choice not in (None, "none"):
            raise _bad_request("Tool calling is not supported.", "tools", "unsupported")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise _bad_request(
                "Only response_format {'type': 'text'} is supported.",
                "response_format",
                "unsupported",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise _bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
        messages = [_message_dict(m) for m in req.messages]
        prompt_ids = list(await tokenize(engine.encode_chat, messages))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens else req.max_tokens
        max_tokens = _check_context(engine, len(prompt_ids), max_tokens, "messages")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        base = _base_sampling(req, max_tokens, top_n)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [
            _Job(i, prompt_ids, sp, f"{rid}-{i}", arrival)
            for i, sp in enumerate(_choice_samplings(base, req.n))
        ]
        _admit(state, len(jobs))
        run = _Run(state, engine, "chat", jobs)
        run.start()
        meta = _Meta(rid, int(time.time()), req.model or state.primary_name(),
                     prompt_tokens=len(prompt_ids))  # fmt: skip
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            gen = _chat_stream(state, run, meta, top_n, include_usage)
            return _EventStreamResponse(gen, run)
        try:
            accs = await _collect(run, request)
        except _ClientGone:
            return Response(status_code=499)
        choices = []
        completion_tokens = 0
        for job in jobs:
            acc = accs[job.index]
            completion_tokens += len(acc.token_ids)
            lp = None
            if top_n is not None:
                lp = _chat_logprobs(state, acc.token_ids, acc.logprobs, top_n)
            choices.append({
                "index": job.index,
                "message": {"role": "assistant", "content": "".join(acc.text)},
                "logprobs": lp, "finish_reason": acc.finish_reason,
            })  # fmt: skip
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": meta.created,
            "model": meta.model, "choices": choices,
            "usage": _usage(meta.prompt_tokens, completion_tokens),
        })  # fmt: skip

    return app


@dataclass
class _Meta:
    id: str
    created: int
    model: str
    prompt_tokens: int
    completion_tokens: int = 0


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    if m.content is None:
        content = ""
    elif isinstance(m.content, str):
        content = m.content
    else:
        content = "".join(part.text for part in m.content)
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.name:
        out["name"] = m.name
    return out


def _encode_text(engine: Any, text: str) -> list[int]:
    encode = getattr(engine, "encode", None)
    if callable(encode):
        return list(encode(text))
    return list(engine.tokenizer(text)["input_ids"])


def _completion_prompts(
    engine: Any, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    if isinstance(prompt, str):
        return [_encode_text(engine, prompt)]
    if not prompt:
        raise _bad_request("'prompt' must not be empty.", "prompt")
    if isinstance(prompt[0], str):
        return [_encode_text(engine, p) for p in prompt]  # type: ignore[arg-type]
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[union-attr]


def _prompt_texts(
    engine: Any, prompt: str | list[str] | list[int] | list[list[int]], ids: list[list[int]]
) -> list[str]:
    """The text of each prompt (for ``echo``): as sent, or decoded from token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return [str(p) for p in prompt]
    return [engine.tokenizer.decode(p) for p in ids]


def _vocab_size(engine: Any) -> int:
    for getter in (
        lambda: engine.vocab_size,
        lambda: len(engine.tokenizer),
    ):
        try:
            value = int(getter())
            if value > 0:
                return value
        except Exception:
            continue
    return 0


def _chunk_base(meta: _Meta, obj: str, include_usage: bool) -> dict[str, Any]:
    base: dict[str, Any] = {"id": meta.id, "object": obj, "created": meta.created,
                            "model": meta.model}  # fmt: skip
    if include_usage:
        base["usage"] = None
    return base


async def _chat_stream(
    state: _State, run: _Run, meta: _Meta, top_n: int | None, include_usage: bool
) -> AsyncIterator[str]:
    obj = "chat.completion.chunk"

    def chunk(index: int, delta: dict[str, Any], finish: str | None, lp: Any = None) -> str:
        c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return _sse({**_chunk_base(meta, obj, include_usage), "choices": [c]})

    completion_tokens = 0
    for job in run.jobs:
        yield chunk(job.index, {"role": "assistant", "content": ""}, None)
    async for event in run.events():
        if event.error is not None:
            yield _sse(_error_payload(event.error))
            yield "data: [DONE]\n\n"
            return
        d = event.delta
        ids = list(d.token_ids or ())
        completion_tokens += len(ids)
        if d.text or (ids and top_n is not None):
            lp = None
            if top_n is not None and d.logprobs:
                lp = _chat_logprobs(state, ids, d.logprobs, top_n)
            yield chunk(event.index, {"content": d.text or ""}, None, lp)
        if d.finished:
            yield chunk(event.index, {}, d.finish_reason or "stop")
    if include_usage:
        yield _sse({**_chunk_base(meta, obj, False), "choices": [],
                    "usage": _usage(meta.prompt_tokens, completion_tokens)})  # fmt: skip
    yield "data: [DONE]\n\n"


async def _completion_stream(
    state: _State,
    run: _Run,
    meta: _Meta,
    logprobs: int | None,
    include_usage: bool,
    echo_texts: dict[int, str],
) -> AsyncIterator[str]:
    obj = "text_completion"

    def chunk(index: int, text: str, finish: str | None, lp: Any = None) -> str:
        c = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return _sse({**_chunk_base(meta, obj, include_usage), "choices": [c]})

    completion_tokens = 0
    offsets: dict[int, int] = {}
    for index, text in echo_texts.items():
        yield chunk(index, text, None)
    async for event in run.events():
        if event.error is not None:
            yield _sse(_error_payload(event.error))
            yield "data: [DONE]\n\n"
            return
        d = event.delta
        ids = list(d.token_ids or ())
        completion_tokens += len(ids)
        if d.text or (ids and logprobs is not None):
            lp = None
            if logprobs is not None and d.logprobs:
                lp, offsets[event.index] = _completion_logprobs(
                    state, ids, d.logprobs, logprobs, offsets.get(event.index, 0)
                )
            yield chunk(event.index, d.text or "", None, lp)
        if d.finished:
            yield chunk(event.index, "", d.finish_reason or "stop")
    if include_usage:
        yield _sse({**_chunk_base(meta, obj, False), "choices": [],
                    "usage": _usage(meta.prompt_tokens, completion_tokens)})  # fmt: skip
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------
# running uvicorn in a thread


class BackgroundServer:
    """Serve an app with uvicorn in a daemon thread (tests, notebooks, embedding).

    ``port=0`` binds a free port; ``url`` gives the address once started::

        with BackgroundServer(create_app(engine, model_name="m")) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_level: str = "warning",
        **uvicorn_kwargs: Any,
    ) -> None:
        import uvicorn

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            loop="asyncio",
            http="h11",
            lifespan="on",
            timeout_graceful_shutdown=5,
            **uvicorn_kwargs,
        )
        self.server = uvicorn.Server(config)
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        """Start serving; returns once the socket listens (raises on failure)."""
        self._thread = threading.Thread(target=self.server.run, name="ferrobatch-http",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited before it started")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.01)
        for srv in getattr(self.server, "servers", []) or []:
            for sock in getattr(srv, "sockets", []) or []:
                self.port = int(sock.getsockname()[1])
                break
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
