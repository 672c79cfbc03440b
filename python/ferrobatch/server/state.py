"""What one app holds (engine, limits, metrics) and the checks every route makes first."""

from __future__ import annotations

import asyncio
import hmac
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ferrobatch.metrics import ServerMetrics
from ferrobatch.server.protocol import APIError, bad_request

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "BodyClientGone",
    "ServerState",
    "engine_error",
    "read_body",
]

logger = logging.getLogger("ferrobatch.server")

#: Default cap on a request body (bytes); larger bodies get 413.
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
#: Default cap on requests (choices) waiting for their first token; more get 429.
DEFAULT_MAX_QUEUE = 1024
# Bodies larger than this multiple of the cap are not drained before answering 413.
_DRAIN_FACTOR = 16


class BodyClientGone(Exception):
    """The client disconnected before its request body arrived in full."""


def engine_error(engine: Any) -> BaseException | None:
    """The exception that killed the engine loop, if any."""
    for name in ("error", "_error"):
        value = getattr(engine, name, None)
        if isinstance(value, BaseException):
            return value
    return None


@dataclass
class ServerState:
    """The engine (``None`` while it loads), the server's limits and its metrics."""

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
    unsubmitted: int = 0  # choices started whose engine request is not submitted yet
    body_timeout: float | None = None  # seconds to receive a body once its head arrived
    stream_buffer: int = 1024  # events a run may hold for a client that does not read
    stream_stall_timeout: float = 60.0  # then seconds before its requests are cancelled
    runs: set[Any] = field(default_factory=set)  # the Runs answering right now
    shutdown_expired: bool = False  # the drain's deadline has passed
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="ferrobatch-tok")
    )

    def _engine_name(self) -> str | None:
        name = getattr(self.engine, "model_name", None) if self.engine is not None else None
        return str(name) if name else None

    def served_names(self) -> set[str]:
        """Every name a client may pass as ``model`` (the model's, its LoRA adapters')."""
        return {name for name in (self.model_name, self._engine_name()) if name} | set(
            self.lora_names())

    def lora_names(self) -> list[str]:
        """The engine's loaded LoRA adapters (a client picks one as ``model``)."""
        return list(getattr(self.engine, "lora_adapters", None) or []) if self.engine else []

    def lora_of(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None (the base model)."""
        if name is None or name in (self.model_name, self._engine_name()):
            return None
        return name if name in self.lora_names() else None

    def primary_name(self) -> str:
        """The name the server reports."""
        return self.model_name or self._engine_name() or "ferrobatch"

    # -- checks (each raises APIError) ----------------------------------------------------

    def require_auth(self, request: Request) -> None:
        """401 unless the request carries the API key (when one is set)."""
        if self.api_key is None:
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
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def require_engine(self) -> Any:
        """The engine, or 503 while it loads, after it failed, or while shutting down."""
        if self.engine is not None and (err := engine_error(self.engine)) is not None:
            raise APIError(
                503,
                f"The engine loop failed: {type(err).__name__}: {err}",
                type="service_unavailable",
                code="engine_failed",
            )
        if self.closing:
            raise APIError(
                503, "The server is shutting down.", type="service_unavailable",
                code="shutting_down",
            )  # fmt: skip
        if self.engine is None:
            if self.load_error:
                message = f"The engine failed to load: {self.load_error}"
            else:
                message = "The engine is loading; retry shortly."
            raise APIError(
                503,
                message,
                type="service_unavailable",
                code="engine_not_ready",
                headers={"Retry-After": "5"},
            )
        return self.engine

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` (when given) is a served name."""
        if name is None or name in self.served_names():
            return
        raise APIError(
            404,
            f"The model '{name}' does not exist. This server serves '{self.primary_name()}'.",
            param="model",
            code="model_not_found",
        )

    def check_size(self, prompts: int, n: int, prompt_param: str) -> None:
        """400 when one request has more choices (``prompts`` x ``n``) than ``max_queue``
        admits at all: waiting would never help, so it is not a 429."""
        if self.max_queue is None or prompts * n <= self.max_queue:
            return
        param = "n" if n > self.max_queue or prompts == 1 else prompt_param
        raise bad_request(
            f"The request asks for {prompts * n} choices ({prompts} prompt(s) x n={n}), more "
            f"than this server ever queues at once ({self.max_queue}, --max-queue); split it "
            "into smaller requests.",
            param,
            "too_many_choices",
        )

    def shutdown_error(self) -> APIError:
        """What requests still running at the end of the shutdown timeout get."""
        return APIError(
            503,
            "The server is shutting down and the request did not finish in time; retry it "
            "against another instance.",
            type="service_unavailable",
            code="shutting_down",
        )

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown: refuse new requests (503), give the running ones ``timeout``
        seconds, then end every run still going with :meth:`shutdown_error` (streams get
        it as an error event and ``[DONE]``)."""
        self.closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.runs:
            logger.info("shutting down: waiting up to %.0f s for %d request(s)", timeout,
                        len(self.runs))  # fmt: skip
        while self.runs and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.shutdown_expired = True
        if self.runs:
            logger.warning("shutdown timeout (%.0f s): ending %d running request(s)", timeout,
                           len(self.runs))  # fmt: skip
        for run in list(self.runs):
            run.abort(self.shutdown_error())

    def admit(self, count: int) -> None:
        """429 when ``count`` more choices would overflow ``max_queue`` now."""
        if self.max_queue is not None and self.waiting + count > self.max_queue:
            raise APIError(
                429,
                f"The server's queue is full ({self.waiting} requests waiting, limit "
                f"{self.max_queue}); retry later.",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The request body; 413 when it exceeds ``limit`` bytes (declared or streamed), 408
    when it takes more than ``timeout`` seconds (say a body shorter than its
    Content-Length); :class:`BodyClientGone` when the client leaves while sending it."""
    try:
        async with asyncio.timeout(timeout):
            return await _read_body(request, limit)
    except ClientDisconnect:
        raise BodyClientGone() from None
    except TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout:g} s (is Content-Length "
            "larger than the body?).",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body; 413 when it exceeds ``limit`` bytes (declared or streamed)."""
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
            raise bad_request("Invalid Content-Length header.") from None
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
