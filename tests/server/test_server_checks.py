"""Requests OpenAI rejects are rejected here too (`ferrobatch.server.checks`), with a 400
naming the field: a non-JSON Content-Type, a message without its role's required fields,
tool results that answer no call, ``stream_options`` without ``stream``, JSON nested past
the parser's limit, and tool options that cannot be honoured. On the fake engine (fast)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import MODEL, FakeEngine, _check_error, build_tokenizer, serve

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve(FakeEngine(build_tokenizer())) as srv:
        yield srv.url


def _chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + CHAT, json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)


@pytest.mark.parametrize("ctype,ok", [
    ("text/plain", False),
    ("application/x-www-form-urlencoded", False),
    ("multipart/form-data", False),
    ("application/json", True),
    ("application/json; charset=utf-8", True),
    ("Application/JSON", True),
    (None, True),
])  # fmt: skip
def test_content_type(url: str, ctype: str | None, ok: bool) -> None:
    body = json.dumps({"model": MODEL, "messages": [USER], "max_tokens": 2}).encode()
    headers = {"content-type": ctype} if ctype else {}
    for path in (CHAT, "/v1/completions"):
        payload = body if path == CHAT else json.dumps({"prompt": "a", "max_tokens": 2}).encode()
        r = httpx.post(url + path, content=payload, headers=headers, timeout=30)
        if ok:
            assert r.status_code == 200, r.text
        else:
            _check_error(r, 400, None, "Unsupported content type")
            assert r.json()["error"]["code"] == "unsupported_content_type"


def test_stream_options_need_stream(url: str) -> None:
    r = _chat(url, messages=[USER], stream_options={"include_usage": True})
    _check_error(r, 400, "stream_options", "only allowed when 'stream' is true")
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "stream": False,
                                                   "stream_options": {}})  # fmt: skip
    _check_error(r, 400, "stream_options", "stream")
    assert _chat(url, messages=[USER], stream_options=None).status_code == 200
    r = _chat(url, messages=[USER], stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and '"usage"' in r.text


@pytest.mark.parametrize("messages,param,fragment", [
    ([{"role": "user"}], "messages[0].content", "Missing required parameter"),
    ([{"role": "user", "content": None}], "messages[0].content", "Missing required"),
    ([{"role": "system"}, USER], "messages[0].content", "Missing required"),
    ([USER, {"role": "assistant"}], "messages[1].content", "'content' or 'tool_calls'"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "1"}],
     "messages[2].tool_call_id", "Missing required"),
    ([USER, {"role": "tool", "tool_call_id": "call_1", "content": "1"}],
     "messages[1].role", "must answer a call"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_9", "content": "1"}],
     "messages[2].tool_call_id", "'call_9'"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, USER], "messages", "call_1"),
    ([USER, {"role": "assistant", "tool_calls": [{**CALL, "id": None}]}],
     "messages[1].tool_calls[0].id", "Missing required"),
])  # fmt: skip
def test_messages_as_openai_checks_them(url: str, messages: list, param: str,
                                        fragment: str) -> None:  # fmt: skip
    _check_error(_chat(url, messages=messages), 400, param, fragment)


def test_good_tool_round_trip_passes(url: str) -> None:
    calls = [CALL, {**CALL, "id": "call_2"}]
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_2", "content": "2"},
                {"role": "tool", "tool_call_id": "call_1", "content": "1"},
                {"role": "assistant", "content": "done"}, USER]  # fmt: skip
    assert _chat(url, messages=messages).status_code == 200


def test_deep_json_names_the_limit(url: str) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(256):
        schema = {"type": "object", "properties": {"x": schema}}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    r = _chat(url, messages=[USER], response_format=fmt)
    _check_error(r, 400, "response_format", "at most 200 levels")
    assert r.json()["error"]["code"] == "nesting_too_deep"
    body = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 100_000
    r = httpx.post(url + CHAT, content=body + b"]" * 100_000,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    _check_error(r, 400, "x", "too deep")


def test_tool_options(url: str) -> None:
    r = _chat(url, messages=[USER], parallel_tool_calls=False)
    _check_error(r, 400, "parallel_tool_calls", "only allowed when 'tools'")
    r = _chat(url, messages=[USER], tools=TOOLS, response_format={"type": "json_object"})
    _check_error(r, 400, "response_format", "cannot be combined with tools")
    r = _chat(url, messages=[USER], tools=TOOLS, tool_choice="none",
              response_format={"type": "json_object"})  # fmt: skip
    assert r.status_code == 200
    assert _chat(url, messages=[USER], tools=TOOLS, parallel_tool_calls=False).status_code == 200


def test_unknown_tool_call_format_refuses_auto() -> None:
    """A template that renders tools in a call format the server does not know: ``auto``
    would have to guess what a call looks like, so it is a 400 naming ``tools``."""
    tok = build_tokenizer()
    tok.chat_template = (
        "{{ tools | tojson }}{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"
        "Answer [TOOL_CALLS][...] to call."
    )
    with serve(FakeEngine(tok)) as srv:
        r = _chat(srv.url, messages=[USER], tools=TOOLS)
        _check_error(r, 400, "tools", "format the server does not know")


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
])  # fmt: skip
def test_fields_that_change_the_answer_are_refused_not_ignored(url: str, field: str,
                                                                value: Any) -> None:
    r = _chat(url, messages=[USER], **{field: value})
    _check_error(r, 400, field, "not supported")
    assert _chat(url, messages=[USER], modalities=["text"]).status_code == 200


def test_tools_on_completions_are_refused(url: str) -> None:
    for field, value in (("tools", TOOLS), ("tool_choice", "required")):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 2, field: value}, timeout=30)
        _check_error(r, 400, field, "/v1/chat/completions")


def test_health_answers_head_and_models_keep_their_creation_time(url: str) -> None:
    assert httpx.head(url + "/health", timeout=10).status_code == 200
    first = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["created"]
    import time
    time.sleep(1.1)
    assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["created"] == first
