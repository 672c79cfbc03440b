"""Function calling on ``/v1/chat/completions``: ``tools`` / ``tool_choice``.

* The tools are rendered through the chat template's own tools support
  (``apply_chat_template(messages, tools=[...])``) when the template mentions ``tools``;
  otherwise they are described in a system message (`fallback_system_text`), added to the
  first system message or put first.
* ``tool_choice``: ``"none"`` (plain text; the tools are still rendered), ``"auto"`` (the
  default with tools: the model decides; a tool call is parsed from its output, see
  `parse_tool_calls`), ``"required"`` and ``{"type": "function", "function": {"name": ...}}``
  (the output is constrained by guided decoding to ``{"name": ..., "arguments": {...}}``,
  ``arguments`` matching the function's ``parameters``; ``required``: any of the tools).
* Input: assistant messages with ``tool_calls`` and ``tool`` messages are accepted. With a
  tools-aware template they go to it as Hugging Face expects (``arguments`` as an object);
  otherwise the calls are written into the assistant text as the same JSON the model is told
  to emit, and a tool result becomes a user message ``Tool result (<id>): ...``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ferrobatch.sampling.grammar import check_grammar_fields
from ferrobatch.server.protocol import bad_request

__all__ = [
    "ToolSetup",
    "chat_messages",
    "fallback_system_text",
    "parse_tool_calls",
    "prepare_tools",
    "template_supports_tools",
]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class ToolSetup:
    """A request's validated tools: the OpenAI tool objects, the mode (``none``, ``auto``,
    ``required``, ``named``), the forced function's name, and the guided JSON schema of the
    forced modes (None otherwise)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "none"
    name: str | None = None
    schema: dict[str, Any] | None = None

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def parses_output(self) -> bool:
        """Whether the output is checked for tool calls (buffered when streamed)."""
        return bool(self.tools) and self.mode != "none"


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _check_schema(schema: dict[str, Any], what: str, param: str) -> None:
    class _Fields:
        json_schema, regex, grammar = schema, None, None

    try:
        check_grammar_fields(_Fields)
    except ValueError as exc:
        msg = str(exc).replace("json_schema is", "the schema is")
        raise bad_request(f"Invalid {what}: {msg}", param) from None


def prepare_tools(tools: Any, tool_choice: Any) -> ToolSetup:
    """Validate ``tools`` and ``tool_choice`` (a 400 naming the param) into a `ToolSetup`."""
    out: list[dict[str, Any]] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be an array of tool objects.", "tools")
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
            _check_schema(parameters, f"{where}.function.parameters", "tools")
            clean = {"name": name, "parameters": parameters}
            if desc is not None:
                clean["description"] = desc
            out.append({"type": "function", "function": clean})
    setup = ToolSetup(out)
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
    if setup.mode == "named":
        fn = next(t["function"] for t in out if t["function"]["name"] == setup.name)
        setup.schema = _call_schema(fn)
    elif setup.mode == "required":
        schemas = [_call_schema(t["function"]) for t in out]
        setup.schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if setup.schema is not None:
        _check_schema(setup.schema, "tools for tool_choice", "tool_choice")
    return setup


# ---------------------------------------------------------------------------------------
# rendering


def template_supports_tools(engine: Any) -> bool:
    """Whether the engine's chat template renders ``tools`` (it mentions them)."""
    template = getattr(getattr(engine, "tokenizer", None), "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


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


# ---------------------------------------------------------------------------------------
# output


def _call_from(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(name, str) and name in names:
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if isinstance(args, dict):
            return {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
    return None


def parse_tool_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """Tool calls in a model's output, else None. Recognised: the whole output (stripped,
    a fenced ```json block allowed) being a JSON object ``{"name", "arguments"}`` (or
    ``"parameters"``), a JSON array of such objects, or ``<tool_call>{...}</tool_call>``
    blocks (Hermes / Qwen templates). ``name`` must be one of the tools'; anything else is
    plain content."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    if fence:
        body = fence.group(1)
    tagged = _TOOL_CALL_TAG.findall(body) if "<tool_call>" in body else None
    candidates: list[Any] = []
    if tagged:
        for part in tagged:
            try:
                candidates.append(json.loads(part))
            except ValueError:
                return None
    else:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        candidates = value if isinstance(value, list) else [value]
    calls = [_call_from(c, names) for c in candidates]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]
