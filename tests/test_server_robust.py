"""Robustness of the OpenAI-compatible server (issue 10, items 4-9): requests larger than the
queue, huge bodies off the event loop, clients that leave mid-body, slow or short bodies,
graceful shutdown on SIGTERM, typed OpenAPI (schemathesis), backpressure on unread streams.

Every server listens on 127.0.0.1 (a free port); every loop is bounded in count and time.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from test_server import (
    MODEL,
    FakeEngine,
    build_tokenizer,
    serve,
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
