"""Tool calls that always validate: the grammar of `ferrobatch.server.tool_syntax` run by
llguidance on the bundled SmolLM2's tokenizer (what it accepts and refuses), and the server
on the bundled model in ``auto``, ``required`` and named modes, streamed and not, every call
checked with ``jsonschema`` against its function's ``parameters``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from bundled_server import bundled_server, openai_client
from ferrobatch.server.tool_syntax import SYNTAXES, call_grammar

llguidance = pytest.importorskip("llguidance")

ADD = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"q": {"type": "string", "minLength": 1, "maxLength": 40}},
    "required": ["q"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "enum": ["pizza", "salad", "soup"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 10},
                  "maxItems": 2},
    },
    "required": ["item", "count"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                      "parameters": ADD}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
                                      "parameters": SEARCH}},
    {"type": "function", "function": {"name": "order_food", "description": "Order a meal",
                                      "parameters": ORDER}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "Add 2 and 3.",
    "Search the web for the tallest mountain.",
    "I'd like two pizzas, please.",
    "Hello, how are you?",
]


def _validate(call: dict[str, Any], name: str | None = None) -> None:
    fn = call["function"]
    assert fn["name"] in SCHEMAS and (name is None or fn["name"] == name), fn
    jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


# ---------------------------------------------------------------------------------------
# the grammar alone


@pytest.fixture(scope="module")
def ll_tokenizer() -> tuple[Any, Any]:
    import llguidance.hf  # local: the optional structured extra, skipped above without it
    from ferrobatch.models import bundled_model_dir  # local: prepares the model on first use
    from transformers import AutoTokenizer  # local: heavy, only this fixture needs it

    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[2])


def _accepts(ll_tokenizer: tuple[Any, Any], grammar: str, text: str) -> bool:
    tok, llt = ll_tokenizer
    m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar))
    ids = tok.encode(text, add_special_tokens=False)
    return (not ids or m.consume_tokens(ids)) and not m.is_error() and m.is_accepting()


CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
CALL2 = '{"name": "search", "arguments": {"q": "x"}}'


@pytest.mark.parametrize("syntax,mode,parallel,text,ok", [
    ("json", "auto", True, "Hello there, {x} [y]", True),
    ("json", "auto", True, "", True),
    ("json", "auto", True, CALL, True),
    ("json", "auto", True, f"\n{CALL}\n{CALL2}\n", True),
    ("json", "auto", True, f"{CALL}\n\n", False),
    ("json", "auto", True, f"{CALL}  {CALL2}", False),
    ("json", "auto", False, f"{CALL}\n{CALL2}", False),
    ("json", "auto", False, CALL + "\n", True),
    ("json", "auto", False, CALL + " ", False),
    ("json", "auto", True, '{"name": "search", "arguments": {"type": "object"}}', False),
    ("json", "auto", True, '{"name": "search", "arguments": {}}', False),
    ("json", "auto", True, '{"name": "mul", "arguments": {}}', False),
    ("json", "auto", True, '{"a": 1}', False),
    ("json", "required", True, "Hello", False),
    ("json", "required", True, CALL2, True),
    ("llama3_json", "auto", True, CALL, False),
    ("llama3_json", "auto", True, CALL.replace("arguments", "parameters"), True),
    ("hermes", "auto", True, f"Sure. <tool_call>\n{CALL}\n</tool_call>\nAnd <tool_call>\n"
                             f"{CALL2}\n</tool_call>", True),
    ("hermes", "auto", False, f"Sure. <tool_call>\n{CALL}\n</tool_call>\nDone", False),
    ("hermes", "auto", False, f"Sure. <tool_call>\n{CALL}\n</tool_call>\n", True),
    ("hermes", "auto", True, "Sure. <tool_call> {}", False),
    ("hermes", "auto", True, "text with { and < and </tool_call>", True),
    ("hermes", "required", False, f"<tool_call>\n{CALL}\n</tool_call>", True),
    ("hermes", "required", False, CALL, False),
])  # fmt: skip
def test_grammar(ll_tokenizer: Any, syntax: str, mode: str, parallel: bool, text: str,
                 ok: bool) -> None:  # fmt: skip
    grammar = call_grammar(SYNTAXES[syntax], TOOLS, mode, parallel)
    assert _accepts(ll_tokenizer, grammar, text) is ok


def test_named_grammar_is_that_function(ll_tokenizer: Any) -> None:
    grammar = call_grammar(SYNTAXES["json"], TOOLS[1:2], "named")
    assert _accepts(ll_tokenizer, grammar, CALL2)
    assert not _accepts(ll_tokenizer, grammar, CALL)
    assert not _accepts(ll_tokenizer, grammar, CALL2 + "\n" + CALL2)


# ---------------------------------------------------------------------------------------
# the server


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with bundled_server() as base:
        yield openai_client(base)


def _calls(c: Any, prompt: str, stream: bool, **kw: Any) -> list[list[dict[str, Any]]]:
    """The tool calls of each choice (as dicts), streamed or not."""
    msgs = [{"role": "user", "content": prompt}]
    if not stream:
        r = c.chat.completions.create(model="smol", messages=msgs, tools=TOOLS, **kw)
        return [[t.model_dump() for t in (ch.message.tool_calls or [])] for ch in r.choices]
    calls: list[dict[str, Any]] = []
    for chunk in c.chat.completions.create(model="smol", messages=msgs, tools=TOOLS,
                                           stream=True, **kw):  # fmt: skip
        for ch in chunk.choices:
            calls += [t.model_dump() for t in (ch.delta.tool_calls or [])]
    return [calls]


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_every_call_validates(client: Any, mode: str) -> None:
    choice: Any = mode
    if mode == "named":
        choice = {"type": "function", "function": {"name": "order_food"}}
    seen = 0
    for k, prompt in enumerate(PROMPTS):
        for stream in (False, True):
            # streamed: greedy; not: two sampled choices
            kw = dict(tool_choice=choice, temperature=0.0 if stream else 1.0, seed=k,
                      max_tokens=48, n=1 if stream else 2)  # fmt: skip
            for calls in _calls(client, prompt, stream, **kw):
                for call in calls:
                    _validate(call, "order_food" if mode == "named" else None)
                seen += len(calls)
                if mode != "auto":
                    assert calls, (prompt, stream)
    assert seen >= (1 if mode == "auto" else 12)


def test_auto_greedy_call_and_text(client: Any) -> None:
    """The issue's probe: "Add 2 and 3." gives a valid call; a text answer is the text
    ``tool_choice: none`` gives (the same prompt, nothing constrained before a call)."""
    for stream in (False, True):
        calls = _calls(client, "Add 2 and 3.", stream, temperature=0, max_tokens=60)[0]
        assert calls
        for call in calls:
            _validate(call)
    msgs = [{"role": "user", "content": "Hello, how are you?"}]
    texts = []
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="smol", messages=msgs, tools=TOOLS,
                                           tool_choice=choice, temperature=0, max_tokens=40)
        assert r.choices[0].message.tool_calls is None
        texts.append(r.choices[0].message.content)
    assert texts[0] == texts[1] and texts[0]
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(model="smol", messages=msgs, tools=TOOLS,
                                                 temperature=0, max_tokens=40, stream=True)
        if ch.choices
    )  # fmt: skip
    assert streamed == texts[0]


def test_parallel_tool_calls_false(client: Any) -> None:
    for seed in range(4):
        for mode in ("auto", "required"):
            for calls in _calls(client, "Add 2 and 3, then search for dogs.", False,
                                tool_choice=mode, parallel_tool_calls=False, temperature=1.0,
                                seed=seed, max_tokens=60, n=2):  # fmt: skip
                assert len(calls) <= 1
                for call in calls:
                    _validate(call)
