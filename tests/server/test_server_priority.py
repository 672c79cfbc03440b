"""The request body's `priority` (an extension, as vLLM's): honoured with
`--scheduling-policy priority`, refused naming the field otherwise or when out of range."""

from __future__ import annotations

import httpx
import pytest
from ferrobatch import ContinuousBatchingConfig, Engine
from server_helpers import MODEL, build_model, serve


@pytest.fixture(scope="module")
def priority_server(tokenizer):
    cfg = ContinuousBatchingConfig(num_blocks=256, scheduling_policy="priority")
    engine = Engine(build_model(tokenizer), tokenizer=tokenizer, config=cfg)
    with serve(engine) as srv:
        yield srv
    engine.close()


def _post(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **body},
        timeout=60)


def test_priority_with_the_priority_policy(priority_server):
    for p in (-5, 0, 7):
        r = _post(priority_server.url, priority=p)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", [2**31, "high", 1.5])
def test_bad_priority_is_a_400(priority_server, value):
    r = _post(priority_server.url, priority=value)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_priority_needs_the_priority_policy(real_server):
    r = _post(real_server.url, priority=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert _post(real_server.url, priority=0).status_code == 200
