"""Serving an app with uvicorn: the server ``ferrobatch serve`` runs (read deadlines,
graceful shutdown) and :class:`BackgroundServer`, the same in a daemon thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

__all__ = [
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "BackgroundServer",
    "make_server",
]

logger = logging.getLogger("ferrobatch.server")

#: Seconds a connection may take to send a request's headers (from connecting, or from the
#: previous response on a kept-alive connection); the body has as long again (``create_app``'s
#: ``body_timeout``).
DEFAULT_READ_TIMEOUT = 30.0
#: Seconds in-flight requests get to finish after SIGTERM / SIGINT before they are ended.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# Extra seconds uvicorn waits, after the requests were ended, before it cancels what is left.
_SHUTDOWN_GRACE = 5.0


def _deadline_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline on the request head.

    uvicorn arms its keep-alive timer only after a response and cancels it on the first
    byte, so a connection that never completes its headers (slowloris) stays forever. This
    one is closed when no complete request head arrived ``header_timeout`` seconds after
    the connection opened or after its previous response.
    """
    # local: uvicorn (~0.1 s) loads only when a server runs, not for create_app alone
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _armed_for: Any = None

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._armed_for = self.cycle
            self._head_timer = self.loop.call_later(header_timeout, self._head_expired)

        def _disarm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.cycle is not self._armed_for or self.transport.is_closing():
                return  # a request head arrived in time
            logger.debug("closing %s: no request head within %.0f s", self.client, header_timeout)
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is not None:
                if self.cycle.response_complete:
                    self._arm_head_deadline()

    return DeadlineH11Protocol


def _server_class() -> type[Any]:
    import uvicorn  # local: uvicorn (~0.1 s) loads only when a server runs

    class Server(uvicorn.Server):
        """uvicorn.Server that drains the app's requests on shutdown and exits 0 on SIGTERM."""

        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                # uvicorn re-raises the signal after its shutdown, which would end the
                # process with 143; a SIGTERM that was handled gracefully exits 0.
                with contextlib.suppress(ValueError):
                    self._captured_signals.remove(sig)

        async def shutdown(self, sockets: Any = None) -> None:
            state = getattr(getattr(self.config.app, "state", None), "ferrobatch", None)
            drain = None
            if state is not None:
                drain = asyncio.create_task(state.drain(self.shutdown_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                if drain is not None:
                    drain.cancel()
                    await asyncio.gather(drain, return_exceptions=True)

    return Server


def make_server(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    read_timeout: float | None = DEFAULT_READ_TIMEOUT,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    **uvicorn_kwargs: Any,
) -> Any:
    """The uvicorn server for ``app``.

    ``read_timeout``: seconds for a request head (``None``: no deadline). On SIGTERM /
    SIGINT (or ``should_exit``) it stops accepting, lets in-flight requests run up to
    ``shutdown_timeout`` seconds, then ends the rest with OpenAI-shaped errors (an error
    event and ``[DONE]`` on streams) and exits (status 0 on SIGTERM).
    """
    import uvicorn  # local: uvicorn (~0.1 s) loads only when a server runs

    if read_timeout is not None and read_timeout <= 0:
        raise ValueError("read_timeout must be > 0 or None")
    if shutdown_timeout < 0:
        raise ValueError("shutdown_timeout must be >= 0")
    uvicorn_kwargs.setdefault("loop", "asyncio")
    if read_timeout is not None:
        uvicorn_kwargs.setdefault("http", _deadline_protocol(read_timeout))
    else:
        uvicorn_kwargs.setdefault("http", "h11")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=int(shutdown_timeout + _SHUTDOWN_GRACE),
        **uvicorn_kwargs,
    )
    server = _server_class()(config)
    server.shutdown_timeout = shutdown_timeout
    return server


class BackgroundServer:
    """Serve an app with uvicorn in a daemon thread (tests, notebooks, embedding).

    ``port=0`` binds a free port; ``url`` gives the address once started::

        with BackgroundServer(create_app(engine, model_name="m")) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")

    ``stop()`` shuts down as ``ferrobatch serve`` does on SIGTERM (``shutdown_timeout``).
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_level: str = "warning",
        read_timeout: float | None = DEFAULT_READ_TIMEOUT,
        shutdown_timeout: float = 5.0,
        **uvicorn_kwargs: Any,
    ) -> None:
        self.server = make_server(
            app,
            host,
            port,
            log_level=log_level,
            read_timeout=read_timeout,
            shutdown_timeout=shutdown_timeout,
            **uvicorn_kwargs,
        )
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
        """Ask uvicorn to exit (graceful shutdown) and wait for the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
