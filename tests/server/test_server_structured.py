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
