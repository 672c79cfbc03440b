"""Function calling (``tools`` / ``tool_choice`` / ``parallel_tool_calls``) on the server with
the official ``openai`` client on the bundled SmolLM2 (loopback only), plus the grammar,
parsing and validation helpers. Every call is checked with ``jsonschema`` against its
function's ``parameters``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from bundled_server import openai_client
from ferrobatch.server.protocol import APIError, ChatMessage
from ferrobatch.server.tool_syntax import SYNTAXES, detect_syntax, parse_calls
from ferrobatch.server.tools import chat_messages, prepare_tools

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
    jsonschema.validate(args, schema)


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


def _tool_call_count(url: str) -> float:
    label = 'ferrobatch_requests_total{endpoint="chat",finish_reason="tool_calls"} '
    lines = [ln for ln in httpx.get(url + "/metrics", timeout=10).text.splitlines()
             if ln.startswith(label)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_required_and_stream(url: str) -> None:
    c = _client(url)
    before = _tool_call_count(url)
    r = c.chat.completions.create(model="smol", messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                  tool_choice="required", temperature=0)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _tool_call_count(url) == before + 1  # the metrics count what the answer says
    _check_call(choice.message.tool_calls[0])
    # streamed: the same calls in one tool_calls delta, then finish_reason tool_calls
    deltas, finish = [], None
    for ch in c.chat.completions.create(model="smol", messages=MESSAGES, tools=TOOLS,
                                        max_tokens=60, tool_choice="required", temperature=0,
                                        stream=True):  # fmt: skip
        if ch.choices:
            deltas.extend(ch.choices[0].delta.tool_calls or [])
            finish = ch.choices[0].finish_reason or finish
    calls = choice.message.tool_calls
    assert finish == "tool_calls" and len(deltas) == len(calls)
    for delta, call in zip(deltas, calls, strict=True):
        assert delta.function.name == call.function.name
        assert delta.function.arguments == call.function.arguments
        _check_call(call)


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
    [],  # an empty list (leave it out for none)
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}}}],
])  # fmt: skip
def test_bad_tools_is_400(url: str, tools: list) -> None:
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "smol", "messages": MESSAGES, "max_tokens": 5, "tools": tools,
    }, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"


def test_parse_calls() -> None:
    names = {"get_weather"}
    js, hermes = SYNTAXES["json"], SYNTAXES["hermes"]
    one = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for text, syntax, content, count in (
        (one, js, None, 1),
        ("\n" + one + "\n" + one, js, None, 2),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', SYNTAXES["llama3_json"],
         None, 1),
        (f"Let me look.<tool_call>\n{one}\n</tool_call>", hermes, "Let me look.", 1),
    ):  # fmt: skip
        content_, calls = parse_calls(text, syntax, names)
        assert content_ == content and len(calls) == count, text
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
        assert calls[0]["id"].startswith("call_")
    for text, syntax in (("hello", js), ('{"name": "other", "arguments": {}}', js),
                         ('{"a": 1}', js), ('{"name": "get_weather", "arguments": {"ci', js),
                         (" [" + one + "]", js), (one, hermes)):  # fmt: skip
        assert parse_calls(text, syntax, names) is None, text
    # cut by max_tokens: the whole calls before the cut
    cut = parse_calls(f"{one}\n{one[:20]}", js, names, partial=True)
    assert cut is not None and len(cut[1]) == 1
    cut = parse_calls(f"a<tool_call>\n{one}\n</tool_call>b<tool_call>\n{one[:9]}", hermes,
                      names, partial=True)  # fmt: skip
    assert cut is not None and cut[0] == "ab" and len(cut[1]) == 1
    # an argument string holding the end tag stays inside its call
    tagged = '{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}'
    got = parse_calls(f"<tool_call>\n{tagged}\n</tool_call>", hermes, names)
    assert got is not None and got[0] is None
    assert json.loads(got[1][0]["function"]["arguments"]) == {"city": "a</tool_call>b"}


def test_detect_syntax() -> None:
    assert detect_syntax(None, native=False) is SYNTAXES["json"]
    assert detect_syntax("{{ tools }} <tool_call>{...}</tool_call>", True) is SYNTAXES["hermes"]
    llama = 'Respond in the format {"name": function name, "parameters": dictionary of argument'
    assert detect_syntax("{{ tools }} " + llama, True) is SYNTAXES["llama3_json"]
    assert detect_syntax("{{ tools }} [TOOL_CALLS]", True) is None


def test_fallback_rendering() -> None:
    setup = prepare_tools(TOOLS, None)
    assert setup.mode == "auto" and setup.grammar is None and setup.parallel
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
