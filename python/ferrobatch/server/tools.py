"""Function calling on ``/v1/chat/completions``: ``tools``, ``tool_choice`` and
``parallel_tool_calls``.

* The tools are rendered through the chat template's own tools support
  (``apply_chat_template(messages, tools=[...])``) when the template mentions ``tools``;
  otherwise they are described in a system message (`fallback_system_text`), added to the
  first system message or put first.
* The output is decoded under a grammar built from the tools
  (`ferrobatch.server.tool_syntax`), in the call format of the template: ``"none"`` (plain
  text; the tools are still rendered), ``"auto"`` (the default with tools: free text, but
  once the model opens a call its name is one of the tools' and its arguments match that
  function's ``parameters``), ``"required"`` (a call from the first token) and
  ``{"type": "function", "function": {"name": ...}}`` (a call of that function).
  ``parallel_tool_calls: false`` allows at most one call. A template whose tool-call format
  the server does not know gets a 400 for ``auto`` instead of a guess.
* Input: assistant messages with ``tool_calls`` and ``tool`` messages are accepted. With a
  tools-aware template they go to it as Hugging Face expects (``arguments`` as an object);
  otherwise the calls are written into the assistant text as the same JSON the model is told
  to emit, and a tool result becomes a user message ``Tool result (<id>): ...``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ferrobatch.sampling.grammar import check_grammar_fields
from ferrobatch.server.protocol import bad_request
from ferrobatch.server.tool_syntax import ToolSyntax, call_grammar, detect_syntax

__all__ = [
    "ToolSetup",
    "chat_messages",
    "chat_template",
    "constrain",
    "fallback_system_text",
    "prepare_tools",
    "template_supports_tools",
]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolSetup:
    """A request's validated tools: the OpenAI tool objects, the mode (``none``, ``auto``,
    ``required``, ``named``), the forced function's name, whether several calls may come
    (``parallel_tool_calls``), and once `constrain` ran, the call format and the grammar
    the output is decoded under (None in mode ``none``)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "none"
    name: str | None = None
    parallel: bool = True
    syntax: ToolSyntax | None = None
    grammar: str | None = None

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def parses_output(self) -> bool:
        """Whether the output is checked for tool calls (buffered when streamed)."""
        return bool(self.tools) and self.mode != "none"


def _check_schema(schema: dict[str, Any], what: str, param: str) -> None:
    class _Fields:
        json_schema, regex, grammar = schema, None, None

    try:
        check_grammar_fields(_Fields)
    except ValueError as exc:
        msg = str(exc).replace("json_schema is", "the schema is")
        raise bad_request(f"Invalid {what}: {msg}", param) from None


def prepare_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> ToolSetup:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (a 400 naming the
    param) into a `ToolSetup`."""
    if parallel_tool_calls is not None:
        if not isinstance(parallel_tool_calls, bool):
            raise bad_request("parallel_tool_calls must be a boolean.", "parallel_tool_calls",
                              "invalid_type")  # fmt: skip
        if not tools:
            raise bad_request("parallel_tool_calls is only allowed when 'tools' are specified.",
                              "parallel_tool_calls")  # fmt: skip
    out: list[dict[str, Any]] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be an array of tool objects.", "tools")
        if not tools:
            raise bad_request("tools must hold at least one tool (leave it out for none).",
                              "tools")
        if len(tools) > 128:
            raise bad_request("At most 128 tools are allowed.", "tools")
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise bad_request(
                    f"{where} must be {{'type': 'function', 'function': {{...}}}}.", "tools"
                )
            fn = tool.get("function")
            if not isinstance(fn, dict):
                raise bad_request(f"{where}.function must be an object.", "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME.match(name):
                raise bad_request(
                    f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'.",
                    "tools",
                )
            if name in {t["function"]["name"] for t in out}:
                raise bad_request(f"{where}: duplicate function name {name!r}.", "tools")
            desc = fn.get("description")
            if desc is not None and not isinstance(desc, str):
                raise bad_request(f"{where}.function.description must be a string.", "tools")
            parameters = fn.get("parameters")
            if parameters is None:
                parameters = {"type": "object", "properties": {}}
            if not isinstance(parameters, dict):
                raise bad_request(
                    f"{where}.function.parameters must be a JSON schema object.", "tools"
                )
            if parameters.get("type", "object") != "object":
                raise bad_request(
                    f"{where}.function.parameters must describe an object (type 'object'), "
                    f"not {parameters.get('type')!r}: a call's arguments are an object.",
                    "tools")
            _check_schema(parameters, f"{where}.function.parameters", "tools")
            clean = {"name": name, "parameters": parameters}
            if desc is not None:
                clean["description"] = desc
            out.append({"type": "function", "function": clean})
    setup = ToolSetup(out, parallel=parallel_tool_calls is not False)
    choice = tool_choice
    if choice is None:
        setup.mode = "auto" if out else "none"
        return setup
    if choice in ("none", "auto", "required"):
        if choice != "none" and not out:
            raise bad_request(f"tool_choice {choice!r} needs 'tools'.", "tool_choice")
        setup.mode = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}.",
                "tool_choice",
            )
        if name not in setup.names:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not in 'tools'.", "tool_choice"
            )
        setup.mode, setup.name = "named", name
    else:
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}.",
            "tool_choice",
        )
    return setup


def constrain(setup: ToolSetup, template: str | None, native: bool) -> None:
    """Pick the call format of the chat template (`template`; ``native``: it renders the
    tools) and build the grammar of the answer (nothing in mode ``none``). A 400 naming
    ``tools`` for ``auto`` with a template whose call format the server does not know, or
    when the grammar does not compile."""
    if setup.mode == "none" or not setup.tools:
        return
    syntax = detect_syntax(template, native)
    if syntax is None:
        if setup.mode == "auto":
            raise bad_request(
                "This model's chat template renders tools but writes tool calls in a format "
                "the server does not know (it knows <tool_call> tags, Llama 3 JSON, and its "
                "own JSON for templates without tools support), so a call could not be told "
                "from text. Use tool_choice 'required' or a named function (the answer is "
                "then a JSON call object), or 'none'.",
                "tools",
                "unsupported",
            )
        syntax = detect_syntax(None, False)
    assert syntax is not None
    fns = [t for t in setup.tools if setup.mode != "named" or t["function"]["name"] == setup.name]
    grammar = call_grammar(syntax, fns, setup.mode, setup.parallel)

    try:
        check_grammar_fields(SimpleNamespace(json_schema=None, regex=None, grammar=grammar))
    except ValueError as exc:
        raise bad_request(f"Invalid tools: {exc}", "tools") from None
    setup.syntax, setup.grammar = syntax, grammar


# ---------------------------------------------------------------------------------------
# rendering


def chat_template(engine: Any) -> str | None:
    """The engine's chat template (its ``tool_use`` one when it has several)."""
    template = getattr(getattr(engine, "tokenizer", None), "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def template_supports_tools(engine: Any) -> bool:
    """Whether the engine's chat template renders ``tools`` (it mentions them)."""
    template = chat_template(engine)
    return template is not None and "tools" in template


def fallback_system_text(tools: list[dict[str, Any]]) -> str:
    """The system text describing the tools for a template without tools support."""
    lines = [
        "You can call the following functions. To call one, answer with only a JSON object "
        '{"name": <function name>, "arguments": <object of arguments>} and nothing else.',
        "",
        "Functions:",
    ]
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    return "\n".join(lines)


def _arguments_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def chat_messages(messages: list[Any], setup: ToolSetup, native: bool) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (tool calls and tool results included;
    without ``native`` tools support, rewritten as documented in the module)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d = m.as_dict()
        calls = getattr(m, "tool_calls", None) or []
        if calls and m.role != "assistant":
            raise bad_request(f"messages[{i}]: only assistant messages have tool_calls.",
                              "messages")  # fmt: skip
        parsed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not \
                    isinstance(fn.get("arguments", "{}"), str | dict):  # fmt: skip
                raise bad_request(
                    f"messages[{i}].tool_calls[{j}] must be {{'id': ..., 'type': 'function', "
                    "'function': {'name': ..., 'arguments': '<JSON string>'}}.",
                    "messages",
                )
            parsed.append({
                "id": call.get("id") or f"call_{j}", "type": "function",
                "function": {"name": fn["name"],
                             "arguments": _arguments_value(fn.get("arguments", "{}"))},
            })  # fmt: skip
        if native:
            if parsed:
                d["tool_calls"] = parsed
            if m.role == "tool" and getattr(m, "tool_call_id", None):
                d["tool_call_id"] = m.tool_call_id
        else:
            if parsed:
                text = "\n".join(
                    json.dumps({"name": c["function"]["name"],
                                "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                    for c in parsed
                )  # fmt: skip
                d["content"] = (d["content"] + "\n" + text) if d["content"] else text
            if m.role == "tool":
                ref = getattr(m, "tool_call_id", None) or getattr(m, "name", None)
                label = f"Tool result ({ref})" if ref else "Tool result"
                d = {"role": "user", "content": f"{label}: {d['content']}"}
        out.append(d)
    if setup.tools and not native:
        text = fallback_system_text(setup.tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + text).strip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
