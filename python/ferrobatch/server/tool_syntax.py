"""How a model writes tool calls, the grammar that keeps them valid, and their parsing.

A `ToolSyntax` is one of the call formats the server knows:

* ``json`` — the server's own format, for a chat template without tools support (the tools
  are then described in a system message, `ferrobatch.server.tools.fallback_system_text`):
  the answer is a JSON object ``{"name": ..., "arguments": {...}}`` (several, one after the
  other, when parallel calls are allowed) and nothing else;
* ``llama3_json`` — Llama 3.x templates: the same with ``"parameters"`` for the arguments;
* ``hermes`` — templates that write ``<tool_call>\\n{"name": ..., "arguments": ...}\\n
  </tool_call>`` (Hermes, Qwen 2.5 / 3 and others): free text may come before a call.

`call_grammar` turns a request's tools into a Lark grammar (llguidance's dialect) that the
output is decoded under. In ``auto`` mode the text is free until a call opens (the first
non-blank character ``{`` for the JSON formats, the text ``<tool_call>`` for Hermes); from
there the function's name must be one of the tools' and its arguments must match that
function's ``parameters`` schema, so a finished call always validates. ``required`` and a
named function force a call from the first token. With ``parallel_tool_calls: false`` at
most one call is allowed: once it closes the answer ends (a newline at most, then
end-of-sequence).

`parse_calls` reads the calls back out of a finished output (only what the grammar made can
be a call; anything else, or a call cut short by ``max_tokens``, is plain content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["SYNTAXES", "ToolSyntax", "call_grammar", "detect_syntax", "parse_calls"]

# the arguments as Python's json.dumps writes them, what models are trained on
_ARGS_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolSyntax:
    """One tool-call format: what opens a call (`trigger`), the text between it and the
    call object's ``"name"`` key (`body_open`), the key holding the arguments, what closes a
    call after the object (`end`), and whether a call can only open the answer (the JSON
    formats) or may come after text."""

    name: str
    trigger: str = "{"
    body_open: str = ""
    args_key: str = "arguments"
    end: str = ""
    leading_only: bool = True


SYNTAXES = {
    "json": ToolSyntax("json"),
    "llama3_json": ToolSyntax("llama3_json", args_key="parameters"),
    "hermes": ToolSyntax("hermes", trigger="<tool_call>", body_open="\n{",
                         end="\n</tool_call>", leading_only=False),
}  # fmt: skip

_LLAMA3 = re.compile(r'"parameters":\s*dictionary of argument')


def detect_syntax(template: str | None, native: bool) -> ToolSyntax | None:
    """The format of a chat template's tool calls: ``json`` (the server's own) when the
    template does not render tools (``native`` False), else the one its text names; None
    when it names none the server knows."""
    if not native:
        return SYNTAXES["json"]
    text = template or ""
    if "<tool_call>" in text:
        return SYNTAXES["hermes"]
    if _LLAMA3.search(text):
        return SYNTAXES["llama3_json"]
    return None


# ---------------------------------------------------------------------------------------
# grammar


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    """`text` as a literal inside a Lark ``/.../`` regex (Rust regex syntax)."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch in "\\.+*?()|[]{}^$#&-~/":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def _args(schema: dict[str, Any]) -> str:
    """An inline ``%json`` schema, compact JSON unless the schema sets its own options."""
    schema = dict(schema)
    options = schema.get("x-guidance")
    schema["x-guidance"] = {**_ARGS_OPTIONS, **(options if isinstance(options, dict) else {})}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _body_rules(syntax: ToolSyntax, tools: list[dict[str, Any]]) -> list[str]:
    """``call_body``: a call after its trigger, one branch per function."""
    fns = " | ".join(f"fn_{i}" for i in range(len(tools)))
    rules = [f"call_body: {_lit(syntax.body_open + chr(34) + 'name' + chr(34) + ': ')} "
             f"({fns}) {_lit('}' + syntax.end)}"]  # fmt: skip
    for i, tool in enumerate(tools):
        fn = tool["function"]
        head = f'{json.dumps(fn["name"], ensure_ascii=False)}, "{syntax.args_key}": '
        rules.append(f"fn_{i}: {_lit(head)} args_{i}")
        rules.append(f"args_{i}: {_args(fn['parameters'])}")
    return rules


def call_grammar(
    syntax: ToolSyntax, tools: list[dict[str, Any]], mode: str, parallel: bool = True
) -> str:
    """The Lark grammar of an answer in ``mode`` (``auto``, ``required``, ``named``; for
    ``named`` `tools` holds only the named function) under `syntax`."""
    trig = syntax.trigger
    # between calls and after the last one at most one newline: a model that goes on with
    # blanks is never trapped in a loop of them, nor forced into another call
    lines = ["%llguidance {}", r"TAIL: /\n/", f"next_open[lazy]: /\\n?{_regex(trig)}/",
             "more: next_open call_body"]  # fmt: skip
    rest = "more* TAIL?" if parallel and mode != "named" else "TAIL?"
    if mode != "auto":
        lines.append(f"start: {_lit(trig)} call_body {rest}")
    elif syntax.leading_only:
        # a call is the whole answer: it opens with the answer's first non-blank character
        lines += [f"start: TEXT | first_open call_body {rest}",
                  f"first_open[lazy]: /\\s*{_regex(trig)}/",
                  f"TEXT: /\\s*([^\\s{_regex(trig[0])}](.|\\n)*)?/"]  # fmt: skip
    else:
        # free text until the trigger; then the call is forced
        lines += ["TEXT: /(.|\\n)*/", f"first_open[lazy]: TEXT {_lit(trig)}"]
        lines.append("start: (first_open call_body)* TEXT" if parallel
                     else "start: TEXT | first_open call_body TAIL?")  # fmt: skip
    lines += _body_rules(syntax, tools)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# parsing


def _call(obj: Any, syntax: ToolSyntax, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or set(obj) != {"name", syntax.args_key}:
        return None
    name, args = obj["name"], obj[syntax.args_key]
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _objects(text: str, partial: bool) -> list[Any] | None:
    """The JSON values of `text`, one after the other (blank-separated), else None; with
    `partial`, those before a value cut short."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return out
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return out if partial else None
        out.append(value)


def parse_calls(
    text: str, syntax: ToolSyntax, names: set[str], partial: bool = False
) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content, calls) of an output written under `call_grammar`, None when it holds no
    whole call (plain content). ``content``: the text around the calls (Hermes), else None.
    `partial`: the output was cut (``max_tokens``); a call cut short is dropped."""
    if syntax.leading_only:
        if not text.lstrip().startswith(syntax.trigger):
            return None
        values = _objects(text, partial)
        calls = [_call(v, syntax, names) for v in values or ()]
        if not calls or any(c is None for c in calls):
            return None
        return None, calls  # type: ignore[return-value]
    calls, rest = _tagged_calls(text, syntax, names, partial)
    if calls is None or not calls:
        return None
    return (rest or None), calls


def _tagged_calls(text: str, syntax: ToolSyntax, names: set[str], partial: bool
                  ) -> tuple[list[dict[str, Any]] | None, str]:
    """The calls of a tagged output (each `trigger`, one JSON value, `end`) and the text
    around them; (None, ...) where a tag holds something else. Each value is read as JSON,
    so an argument string holding the end tag stays inside its call. With `partial`, a
    last call cut short is dropped."""
    end = syntax.end.strip()
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    rest: list[str] = []
    pos = 0
    while (start := text.find(syntax.trigger, pos)) >= 0:
        rest.append(text[pos:start])
        i = start + len(syntax.trigger)
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, j = decoder.raw_decode(text, i)
        except ValueError:
            if partial and text.find(end, i) < 0:  # cut inside the last call
                return calls, "".join(rest).strip()
            return None, ""
        while j < len(text) and text[j].isspace():
            j += 1
        if not text.startswith(end, j):
            if partial and j == len(text):
                return calls, "".join(rest).strip()
            return None, ""
        call = _call(value, syntax, names)
        if call is None:
            return None, ""
        calls.append(call)
        pos = j + len(end)
    rest.append(text[pos:])
    return calls, "".join(rest).strip()
