"""Server-Sent Events: the chunk stream of a run and the response that carries it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ferrobatch.server.protocol import usage
from ferrobatch.server.responses import ChatFormat, CompletionFormat, ResponseMeta
from ferrobatch.server.run import Run, error_payload, wait_disconnect

__all__ = ["EventStreamResponse", "sse_chunks"]

logger = logging.getLogger("ferrobatch.server")

_DONE = "data: [DONE]\n\n"


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _chunk_base(meta: ResponseMeta, obj: str, include_usage: bool) -> dict[str, Any]:
    base: dict[str, Any] = {"id": meta.id, "object": obj, "created": meta.created,
                            "model": meta.model}  # fmt: skip
    if include_usage:
        base["usage"] = None
    return base


async def sse_chunks(
    run: Run, meta: ResponseMeta, fmt: ChatFormat | CompletionFormat, include_usage: bool
) -> AsyncIterator[str]:
    """The run's deltas as OpenAI chunks, then ``[DONE]`` (an error ends the stream)."""
    base = _chunk_base(meta, fmt.chunk_object, include_usage)

    def chunk(choice: dict[str, Any]) -> str:
        return _sse({**base, "choices": [choice]})

    completion_tokens = 0
    for choice in fmt.opening([job.index for job in run.jobs]):
        yield chunk(choice)
    async for event in run.events():
        if event.error is not None:
            yield _sse(error_payload(event.error))
            yield _DONE
            return
        d = event.delta
        ids = list(d.token_ids or ())
        completion_tokens += len(ids)
        if (choice := fmt.piece(event.index, d, ids)) is not None:
            yield chunk(choice)
        if d.finished:
            yield chunk(fmt.finish(event.index, d.finish_reason or "stop"))
    if include_usage:
        yield _sse({**_chunk_base(meta, fmt.chunk_object, False), "choices": [],
                    "usage": usage(meta.prompt_tokens, completion_tokens)})  # fmt: skip
    yield _DONE


class EventStreamResponse(StreamingResponse):
    """SSE response that always cancels its engine requests when it ends, however it ends.

    It watches for the client's disconnect while streaming (whatever the ASGI spec version
    the server speaks), so a client that goes away mid-stream cancels its requests at once.
    """

    def __init__(
        self, content: AsyncIterator[str], run: Run, on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._run = run
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deadline = self._run.state.stream_stall_timeout

        async def send_or_give_up(message: Any) -> None:
            # A send waits while the socket's buffers are full; a client that reads nothing
            # for the stall timeout is given up on (uvicorn then closes the connection).
            try:
                async with asyncio.timeout(deadline):
                    await send(message)
            except TimeoutError:
                logger.info("giving up on a stream: the client read nothing for %g s", deadline)
                raise OSError("the client stopped reading") from None

        streamer = asyncio.create_task(self.stream_response(send_or_give_up))
        watcher = asyncio.create_task(wait_disconnect(receive))
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
            if self._on_close is not None:
                self._on_close()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._content.aclose()  # type: ignore[attr-defined]
