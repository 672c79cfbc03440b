"""Function calling (``tools`` / ``tool_choice``) on the server with the official ``openai``
client on the bundled SmolLM2 (loopback only), plus the parsing and validation helpers."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from bundled_server import openai_client
from ferrobatch.server.protocol import APIError, ChatMessage
from ferrobatch.server.tools import chat_messages, parse_tool_calls, prepare_tools

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


_client = openai_client


def _check_call(call: object, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    if name is not None:
        assert call.function.name == name
    args = json.loads(call.function.arguments)
    _validate(args, SCHEMAS[call.function.name])
    return args


def _validate(args: object, schema: dict) -> None:
    """The schemas here: an object of required string fields (maxLength, enum), no others."""
    assert isinstance(args, dict) and set(args) == set(schema["required"]), args
    for key, value in args.items():
        prop = schema["properties"][key]
        assert isinstance(value, str)
        assert len(value) <= prop.get("maxLength", 1 << 30)
        assert value in prop.get("enum", [value])


def test_named_tool_choice_forces_valid_call(url: str) -> None:
    c = _client(url)
    for temperature in (0.0, 1.0):
        r = c.chat.completions.create(
            model="smol", messages=MESSAGES, tools=TOOLS, max_tokens=60, n=2, seed=3,
            temperature=temperature,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice.message
            assert choice.message.content is None
            assert len(choice.message.tool_calls) == 1
            _check_call(choice.message.tool_calls[0], "get_weather")


def test_required_and_stream(url: str) -> None:
    c = _client(url)
    r = c.chat.completions.create(model="smol", messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                  tool_choice="required", temperature=0)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_call(choice.message.tool_calls[0])
    # streamed: one tool_calls delta with the whole call, then finish_reason tool_calls
    deltas, finish = [], None
    for ch in c.chat.completions.create(model="smol", messages=MESSAGES, tools=TOOLS,
                                        max_tokens=60, tool_choice="required", temperature=0,
                                        stream=True):  # fmt: skip
        if ch.choices:
            deltas.extend(ch.choices[0].delta.tool_calls or [])
            finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1
    assert deltas[0].function.name == choice.message.tool_calls[0].function.name
    assert deltas[0].function.arguments == choice.message.tool_calls[0].function.arguments


def test_round_trip_and_none(url: str) -> None:
    c = _client(url)
    first = c.chat.completions.create(
        model="smol", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 18, "unit": "celsius"})},
    ]  # fmt: skip
    second = c.chat.completions.create(model="smol", messages=history, tools=TOOLS,
                                       max_tokens=20, temperature=0)  # fmt: skip
    msg = second.choices[0].message
    assert msg.content or msg.tool_calls
    # tool_choice none: plain text, no tool call parsed
    third = c.chat.completions.create(model="smol", messages=history, tools=TOOLS,
                                      max_tokens=10, tool_choice="none")  # fmt: skip
    assert third.choices[0].message.tool_calls is None
    assert third.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body", [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tool_choice": "required"},
])  # fmt: skip
def test_bad_tool_choice_is_400(url: str, body: dict) -> None:
    c = _client(url)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=5, **body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("tools", [
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
    [{"type": "function", "function": {"name": "bad name!"}}],
    [{"type": "function"}],
    [{"type": "function", "function": {"name": "f"}}, {"type": "function",
                                                        "function": {"name": "f"}}],
    [{"type": "retrieval"}],
])  # fmt: skip
def test_bad_tools_is_400(url: str, tools: list) -> None:
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "smol", "messages": MESSAGES, "max_tokens": 5, "tools": tools,
    }, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"


def test_parse_tool_calls() -> None:
    names = {"get_weather"}
    for text in (
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        '```json\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n```',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
    ):
        calls = parse_tool_calls(text, names)
        assert calls is not None and len(calls) == 1, text
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    for text in ("hello", '{"name": "other", "arguments": {}}', '{"a": 1}', "[]"):
        assert parse_tool_calls(text, names) is None


def test_fallback_rendering() -> None:
    setup = prepare_tools(TOOLS, None)
    assert setup.mode == "auto" and setup.schema is None
    msgs = [
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="assistant", content=None, tool_calls=[{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]),
        ChatMessage(role="tool", tool_call_id="call_1", content="12:00"),
    ]  # fmt: skip
    out = chat_messages(msgs, setup, native=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "get_time", "arguments": {"zone": "UTC"}}
    assert out[3] == {"role": "user", "content": "Tool result (call_1): 12:00"}
    native = chat_messages(msgs, setup, native=True)
    assert len(native) == 3
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    assert native[2]["tool_call_id"] == "call_1"
    with pytest.raises(APIError):
        prepare_tools(TOOLS, {"type": "function", "function": {"name": "x"}})
