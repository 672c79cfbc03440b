"""Fixtures of the server tests: the tokenizer, the real engine and its server (skipped where
it cannot be built), the fake engine, and `any_server` (each test against both)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bundled_server import bundled_server
from ferrobatch.server import BackgroundServer
from server_helpers import FakeEngine, build_tokenizer, real_engine_or_skip, serve


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def real_engine(tokenizer: Any) -> Iterator[Any]:
    engine = real_engine_or_skip(tokenizer)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def real_server(real_engine: Any) -> Iterator[BackgroundServer]:
    with serve(real_engine) as srv:
        yield srv


@pytest.fixture
def fake_engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture(params=["fake", "real"])
def any_server(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[tuple[Any, str]]:
    """(engine, url) for the fake engine and, where it can be built, the real one."""
    if request.param == "real":
        engine = request.getfixturevalue("real_engine")
        srv = request.getfixturevalue("real_server")
        yield engine, srv.url
    else:
        engine = FakeEngine(tokenizer)
        with serve(engine) as srv:
            yield engine, srv.url


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The base URL of `ferrobatch serve` on the bundled SmolLM2 (structured outputs, tools)."""
    with bundled_server() as base:
        yield base
