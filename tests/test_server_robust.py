"""Robustness of the OpenAI-compatible server (issue 10, items 4-9): requests larger than the
queue, huge bodies off the event loop, clients that leave mid-body, slow or short bodies,
graceful shutdown on SIGTERM, typed OpenAPI (schemathesis), backpressure on unread streams.

Every server listens on 127.0.0.1 (a free port); every loop is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from test_server import (
    MODEL,
    FakeEngine,
    build_tokenizer,
    client,
    serve,
    wait_until,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _error(r: httpx.Response, status: int, param: str | None, fragment: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert fragment in err["message"], err
    return err


# ---------------------------------------------------------------------------------------
# 4. a request larger than --max-queue is a 400, not a 429 that can never succeed


def test_request_larger_than_max_queue_is_400(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with serve(engine, max_queue=4) as srv:
        url = srv.url
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "n": 5})
        err = _error(r, 400, "n", "--max-queue")
        assert err["code"] == "too_many_choices" and "retry-after" not in r.headers
        r = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
        _error(r, 400, "prompt", "6 choices")
        r = httpx.post(url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "a"}], "n": 9})  # fmt: skip
        _error(r, 400, "n", "--max-queue")
        # the official client does not retry a 400 (it retries 429s), and says why
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=2, timeout=30)
        with pytest.raises(openai.BadRequestError, match="max-queue"):
            c.completions.create(model=MODEL, prompt=["a"] * 5, max_tokens=1)
        assert not engine.submitted  # refused before anything ran
        out = c.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=1)
        assert len(out.choices) == 4  # exactly at the limit still runs
        text = httpx.get(url + "/metrics").text
        assert 'ferrobatch_http_errors_total{code="400"} 4' in text


# ---------------------------------------------------------------------------------------
# 6. a client that leaves while sending its body is a client gone, not a 500


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _logs(*names: str) -> Iterator[list[logging.LogRecord]]:
    handler = _Records()
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


def _raw(url: str, data: bytes, *, timeout: float = 10.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(data)
    return sock


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_leaving_mid_body_is_not_a_server_error(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with serve(engine) as srv, _logs("uvicorn.error", "ferrobatch.server") as records:
        for path in ("/v1/completions", "/v1/chat/completions"):
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: 5000\r\n\r\n").encode()  # fmt: skip
            sock = _raw(srv.url, head + b'{"prompt": "abc' + b"x" * 500)
            time.sleep(0.2)
            sock.close()
        gone = 'ferrobatch_client_disconnects_total{stage="body"}'
        assert wait_until(lambda: _metric(srv.url, gone) == 2)
        assert _metric(srv.url, 'ferrobatch_http_errors_total{code="500"}') == 0
        out = client(srv.url).completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert out.usage.completion_tokens == 1
    bad = [r for r in records if r.levelno >= logging.WARNING]
    assert not bad, [r.getMessage() for r in bad]
    assert any("left while sending its body" in r.getMessage() for r in records)
    assert not engine.submitted[:-1]
