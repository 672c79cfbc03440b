"""The choices of one HTTP request run as engine requests and merged into one event stream,
with their metrics, cancellation when the client leaves, and engine errors as API errors."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive

from ferrobatch.errors import FieldError, QueueFullError
from ferrobatch.server.params import openai_param
from ferrobatch.server.protocol import APIError, bad_request
from ferrobatch.server.state import ServerState

__all__ = [
    "Accumulator",
    "ClientGone",
    "Event",
    "Job",
    "Run",
    "StreamStalled",
    "collect",
    "error_payload",
]

logger = logging.getLogger("ferrobatch.server")


@dataclass
class Job:
    """One choice: an engine request and its progress."""

    index: int
    prompt_ids: list[int]
    sampling: Any
    request_id: str
    arrival: float
    started: bool = False
    finished: bool = False
    accounted: bool = False
    last: float | None = None
    # max_tokens=0 (prompt scoring): the one token generated is not returned
    prompt_only: bool = False
    # the finish_reason the response will give, from the whole text and the engine's reason
    # (a chat answer holding tool calls says "tool_calls"), for the metrics; None: the
    # engine's reason as it is
    reason_of: Callable[[str, str], str] | None = None
    text: list[str] = field(default_factory=list)


@dataclass
class Event:
    """A delta, an error or the end of one choice."""

    index: int
    delta: Any = None
    error: BaseException | None = None
    done: bool = False


class Run:
    """A set of engine requests (the choices of one HTTP request) merged into one stream."""

    def __init__(self, state: ServerState, engine: Any, endpoint: str, jobs: list[Job]) -> None:
        self.state = state
        self.engine = engine
        self.endpoint = endpoint
        self.jobs = jobs
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._space = asyncio.Event()  # set when the consumer is below the buffer bound
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    def start(self) -> None:
        """Submit every choice (call with no await between admission and this)."""
        for job in self.jobs:
            self.state.waiting += 1
            self.state.unsubmitted += 1
            self.state.metrics.on_admitted(len(job.prompt_ids))
            self.tasks.append(asyncio.create_task(self._pump(job)))

    async def _pump(self, job: Job) -> None:
        # (the engine request is submitted in the stream's first step, with no await before
        # it: from here on the engine counts it, not `unsubmitted`)
        self.state.unsubmitted -= 1
        stream = self.engine.astream(job.prompt_ids, job.sampling, request_id=job.request_id)
        reason = "cancelled"
        try:
            async for delta in stream:
                if job.prompt_only:
                    delta = _without_tokens(delta)
                if job.reason_of is not None and delta.text:
                    job.text.append(delta.text)
                self._on_delta(job, delta)
                if delta.finished:
                    job.finished = True
                    reason = delta.finish_reason or "stop"
                await self._put(Event(job.index, delta=delta))
                if job.finished:
                    break
        except asyncio.CancelledError:
            raise
        except StreamStalled as exc:  # the client stopped reading: free the engine request
            logger.info("request %s cancelled: %s", job.request_id, exc.error.message)
            self.queue.put_nowait(Event(job.index, error=exc.error))
        except Exception as exc:  # delivered to the client as an error
            reason = "error"
            logger.warning("request %s failed: %s", job.request_id, exc)
            self.queue.put_nowait(Event(job.index, error=exc))
        finally:
            self._finish(job, reason)
            with contextlib.suppress(Exception):
                closer = getattr(stream, "aclose", None)
                if closer is not None:
                    await closer()
        self.queue.put_nowait(Event(job.index, done=True))

    async def _put(self, event: Event) -> None:
        """Queue a delta; while the consumer (the client's socket) is ``stream_buffer``
        events behind, wait for it, up to ``stream_stall_timeout`` seconds."""
        limit = self.state.stream_buffer
        while limit and self.queue.qsize() >= limit:
            self._space.clear()
            try:
                async with asyncio.timeout(self.state.stream_stall_timeout):
                    await self._space.wait()
            except TimeoutError:
                raise StreamStalled(self.state.stream_stall_timeout) from None
        self.queue.put_nowait(event)

    def _on_delta(self, job: Job, delta: Any) -> None:
        """Token metrics of one delta (first token, inter-token gaps)."""
        count = len(delta.token_ids or ())
        if not count:
            return
        now = time.perf_counter()
        if not job.started:
            job.started = True
            self.state.waiting -= 1
            self.state.metrics.on_first_token(now - job.arrival)
            self.state.metrics.on_tokens(count, None)
        else:
            gap = now - (job.last if job.last is not None else now)
            self.state.metrics.on_tokens(count, gap)
        job.last = now

    def _finish(self, job: Job, reason: str) -> None:
        if job.accounted:
            return
        job.accounted = True
        if not job.finished:
            with contextlib.suppress(Exception):
                self.engine.cancel(job.request_id)
        if not job.started:
            self.state.waiting -= 1
        duration = (job.last - job.arrival) if job.last is not None else None
        if job.reason_of is not None and reason in ("stop", "length"):
            with contextlib.suppress(Exception):  # (a label must not fail the request)
                reason = job.reason_of("".join(job.text), reason)
        self.state.metrics.on_finished(self.endpoint, reason, job.started, duration)

    async def events(self) -> AsyncIterator[Event]:
        """Deltas and errors of every choice until all are done."""
        remaining = len(self.jobs)
        while remaining:
            event = await self.queue.get()
            if self.queue.qsize() < self.state.stream_buffer:
                self._space.set()
            if event.done:
                remaining -= 1
                continue
            yield event

    def abort(self, exc: BaseException) -> None:
        """End the event stream with ``exc`` (server shutdown); ``close`` cancels the rest."""
        self.queue.put_nowait(Event(-1, error=exc))

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


@dataclass
class Accumulator:
    """A choice's tokens, text and logprobs accumulated from its deltas."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def add(self, delta: Any) -> None:
        """Append one delta."""
        if getattr(delta, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_token_ids = list(delta.prompt_token_ids)
        self.token_ids.extend(delta.token_ids or ())
        if delta.text:
            self.text.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason or "stop"


class StreamStalled(Exception):
    """The client read nothing of its stream for too long while the buffer was full."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the client read nothing for {seconds:g} s")
        self.error = APIError(
            408,
            f"The stream was cancelled: the client read nothing of it for {seconds:g} s.",
            code="stream_stalled",
        )


def _without_tokens(delta: Any) -> Any:
    """A delta of a prompt-only choice (max_tokens=0): no tokens, no text; a finish is
    "length" (the prompt was all that was asked for)."""
    return dataclasses.replace(
        delta, token_ids=[], text="", token_times=[],
        logprobs=[] if delta.logprobs is not None else None,
        finish_reason="length" if delta.finished else None,
    )  # fmt: skip


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def collect(run: Run, receive: Receive) -> dict[int, Accumulator]:
    """Run every choice to the end (non-streaming); cancel them if the client leaves."""
    accs = {job.index: Accumulator() for job in run.jobs}

    async def consume() -> None:
        async for event in run.events():
            if event.error is not None:
                raise event.error
            accs[event.index].add(event.delta)

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            exc = consumer.exception()
            if exc is not None:
                _raise_for(exc)
        else:
            raise ClientGone()
    finally:
        consumer.cancel()
        watcher.cancel()
        await run.close()
        await asyncio.gather(consumer, watcher, return_exceptions=True)
    return accs


# ---------------------------------------------------------------------------------------
# engine errors as API errors


def _queue_full(exc: BaseException) -> APIError | None:
    """The engine's own queue bound (``max_queue_size``) answers like --max-queue: 429."""
    if isinstance(exc, QueueFullError):
        return APIError(
            429,
            f"The engine's queue is full ({exc}); retry later.",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    return None


def check_engine_room(engine: Any, count: int, unsubmitted: int) -> None:
    """429 (as `_queue_full`) when `count` more requests, beside the `unsubmitted` ones this
    server started and has not handed to the engine yet, would pass the engine's
    ``max_queue_size``: answered before a stream's 200 goes out."""
    check = getattr(engine, "check_room", None)
    if check is None:
        return
    try:
        check(count + unsubmitted)
    except QueueFullError as exc:
        full = _queue_full(exc)
        assert full is not None
        raise full from exc


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The error body of a failure in the middle of a stream."""
    if isinstance(exc, APIError):
        return exc.body()
    if (full := _queue_full(exc)) is not None:
        return full.body()
    status = 400 if isinstance(exc, ValueError) else 500
    kind = "invalid_request_error" if status == 400 else "server_error"
    return APIError(status, f"Generation failed: {exc}", type=kind, param=_param(exc)).body()


def _param(exc: BaseException) -> str | None:
    """The OpenAI `param` of an engine error: the field a `FieldError` names."""
    return openai_param(exc.field) if isinstance(exc, FieldError) else None


def _raise_for(exc: BaseException) -> None:
    if isinstance(exc, APIError):
        raise exc
    if (full := _queue_full(exc)) is not None:
        raise full from exc
    if isinstance(exc, ValueError):
        raise bad_request(f"The engine rejected the request: {exc}", _param(exc)) from exc
    raise APIError(500, f"Generation failed: {exc}", type="server_error") from exc
