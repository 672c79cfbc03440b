"""Serving an app with uvicorn in a daemon thread."""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["BackgroundServer"]


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
