"""The grammar fields of a request (``json_schema``, ``regex``, ``grammar``): checked and
turned into llguidance's grammar text. No torch: `SamplingParams` (``import ferrobatch``)
and the server's request checks use it; `ferrobatch.sampling.guided` builds the matchers.
"""

from __future__ import annotations

import json
from typing import Any

from ferrobatch.errors import FieldError

__all__ = ["GRAMMAR_FIELDS", "check_grammar_fields", "grammar_text", "llguidance_module"]

GRAMMAR_FIELDS = ("json_schema", "regex", "grammar")
_JSON_DEFAULTS = {"whitespace_flexible": False}


def llguidance_module() -> Any:
    """The llguidance module; ValueError naming the extra when it is not installed."""
    try:
        import llguidance  # local: an optional dependency (the structured extra)
    except ImportError as exc:  # pragma: no cover - the extra is in requirements-dev
        raise ValueError(
            "structured outputs (json_schema / regex / grammar) need llguidance: "
            "pip install 'ferrobatch[structured]'"
        ) from exc
    return llguidance


def grammar_text(name: str, value: Any) -> str:
    """llguidance's grammar text for one field (json_schema: a dict, a JSON string or True
    for any JSON value; regex and grammar: strings); `FieldError` naming the field."""
    llg = llguidance_module()
    if name == "json_schema":
        if value is True:
            value = {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise FieldError(f"json_schema is not valid JSON: {exc}", "json_schema") from None
        if not isinstance(value, dict):
            raise FieldError(
                f"json_schema must be a JSON schema object (a dict), got {type(value).__name__}",
                "json_schema",
            )
        try:
            text = json.dumps(value)
        except (TypeError, ValueError) as exc:
            msg = f"json_schema is not JSON-serializable: {exc}"
            raise FieldError(msg, "json_schema") from None
        if (where := _counted_open_object(value)) is not None:
            raise FieldError(
                f"json_schema: minProperties / maxProperties at {where} need "
                "additionalProperties: false and no patternProperties (the guided decoder "
                "cannot keep undeclared keys distinct, so a repeated key could make the "
                "count)", "json_schema")
        # compact JSON (one space after ',' and ':', no free whitespace): small models
        # otherwise spin in whitespace; a schema's own "x-guidance" options take precedence
        return llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)
    if not isinstance(value, str) or not value:
        raise FieldError(f"{name} must be a non-empty string, got {value!r}", name)
    if name == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    return llg.LLMatcher.grammar_from_lark(value)


def _counted_open_object(schema: Any) -> str | None:
    """Where (a JSON path) `schema` bounds the key count of an object that takes keys it
    does not declare, or None."""
    stack: list[tuple[Any, str]] = [(schema, "$")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            counted = "minProperties" in node or "maxProperties" in node
            if counted and (node.get("additionalProperties", True) is not False
                            or node.get("patternProperties")):
                return path
            stack.extend((v, f"{path}.{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def check_grammar_fields(params: Any) -> str | None:
    """Validate the grammar fields of `params` (at most one set, each compiles); the name of
    the one set, else None. `FieldError` names the field."""
    set_ = [n for n in GRAMMAR_FIELDS if getattr(params, n) is not None]
    if not set_:
        return None
    if len(set_) > 1:
        raise FieldError(
            f"at most one of json_schema, regex, grammar may be set, got {set_}"
        )
    name = set_[0]
    grammar = grammar_text(name, getattr(params, name))
    err = llguidance_module().LLMatcher.validate_grammar(grammar)
    if err:
        raise FieldError(f"{name} is invalid: {err.strip()}", name)
    return name
