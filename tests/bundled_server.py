"""A live loopback server over the bundled SmolLM2 and an official `openai` client for it:
shared by the server tests that need a real model (structured outputs, tools)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import openai
from ferrobatch import Engine
from ferrobatch.server import BackgroundServer, create_app


@contextmanager
def bundled_server(model_name: str = "smol") -> Iterator[str]:
    """`ferrobatch`'s app over the bundled model on 127.0.0.1 (a free port); yields its URL
    and closes the server and the engine after."""
    engine = Engine()
    srv = BackgroundServer(create_app(engine, model_name=model_name), "127.0.0.1", 0)
    srv.start()
    try:
        yield srv.url
    finally:
        srv.stop()
        engine.close()


def openai_client(url: str) -> openai.OpenAI:
    """An `openai` client for the server at `url` (no retries: every error is the test's)."""
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
