"""Structured outputs on the server (``response_format`` json_object / json_schema) with the
official ``openai`` client on the bundled SmolLM2 (loopback only)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
from bundled_server import openai_client
from pydantic import BaseModel, Field


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int
    kind: Literal["cat", "dog"]


_client = openai_client


MESSAGES = [{"role": "user", "content": "Describe a pet as JSON: name, age, kind."}]


def test_parse_with_pydantic_model(url: str) -> None:
    c = _client(url)
    for temperature in (0.0, 1.0):
        done = c.chat.completions.parse(
            model="smol", messages=MESSAGES, response_format=Pet, max_tokens=60, n=2,
            temperature=temperature, seed=7,
        )  # fmt: skip
        for choice in done.choices:
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(choice.message.parsed, Pet)


def test_json_object_chat_stream_and_completions(url: str) -> None:
    c = _client(url)
    r = c.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=60,
                                  response_format={"type": "json_object"})  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert r.choices[0].message.content.startswith("{")
    n_schema = {"type": "integer", "minimum": 0, "maximum": 999}
    schema = {"type": "object", "properties": {"n": n_schema}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    text = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=30,
                                            response_format=fmt, stream=True)  # fmt: skip
        if ch.choices
    )
    assert set(json.loads(text)) == {"n"}
    done = httpx.post(url + "/v1/completions", json={
        "model": "smol", "prompt": "A number:", "max_tokens": 30, "response_format": fmt,
    }, timeout=60).json()  # fmt: skip
    assert set(json.loads(done["choices"][0]["text"])) == {"n"}


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    {"type": "json_schema"},
    {"type": "yaml"},
])  # fmt: skip
def test_invalid_response_format_is_400(url: str, fmt: dict) -> None:
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                       ("/v1/completions", {"prompt": "hi"})):  # fmt: skip
        r = httpx.post(url + path, json={"model": "smol", "max_tokens": 5, **body,
                                         "response_format": fmt}, timeout=30)  # fmt: skip
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "response_format", r.text


#: a schema with no finite instance: every object needs a "c" holding another such object
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                           "required": ["c"]}}, "$ref": "#/$defs/n"}


def test_a_grammar_that_fails_while_generating_is_an_error_not_a_stop(url: str) -> None:
    # llguidance accepts the schema and gives up while generating: the answer must not be a
    # 200 "stop" with output that does not match (nor a stream that ends as if it did)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}
    body = {"model": "smol", "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            "response_format": fmt}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"
    assert "no output can satisfy it" in r.json()["error"]["message"]
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as s:
        text = "".join(s.iter_text())
    assert '"error"' in text and "no output can satisfy it" in text
    assert '"finish_reason":"stop"' not in text.replace(" ", "")
    tools = [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"root": {"$ref": "#/$defs/n"}},
                                    "required": ["root"], "$defs": ENDLESS["$defs"]}}}]
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "smol", "messages": [{"role": "user", "content": "call f"}], "max_tokens": 40,
        "temperature": 0, "tools": tools, "tool_choice": "required"}, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"
    # the server goes on serving
    ok = httpx.post(url + "/v1/chat/completions", json={**body, "response_format": None},
                    timeout=120)
    assert ok.status_code == 200


def test_scoring_ignores_response_format(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={
        "model": "smol", "prompt": "Hello there", "max_tokens": 0, "echo": True, "logprobs": 1,
        "response_format": {"type": "json_object"}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hello there"


def test_json_schema_strict_must_be_a_boolean(url: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                  "strict": "yes"}}
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "smol", "messages": MESSAGES, "max_tokens": 5, "response_format": fmt},
        timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
