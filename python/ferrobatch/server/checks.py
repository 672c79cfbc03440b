"""Request checks that OpenAI makes beyond the body's shape: the ``Content-Type``, the
roles' required fields, tool results that answer the calls before them, and options that
need another option."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferrobatch.server.protocol import APIError, bad_request

__all__ = ["check_content_type", "check_messages", "check_stream_options"]


def check_content_type(value: str | None) -> None:
    """A body must be JSON: ``application/json`` (parameters such as ``charset`` allowed)
    or a ``+json`` type; a request without the header is read as JSON too."""
    if value is None or not value.strip():
        return
    media = value.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and
                                        media.endswith("+json")):  # fmt: skip
        return
    raise APIError(
        400,
        f"Unsupported content type: {value!r}. This endpoint only accepts JSON bodies: send "
        "the header 'Content-Type: application/json'.",
        code="unsupported_content_type",
    )


def check_stream_options(stream_options: Any, stream: bool) -> None:
    """``stream_options`` only goes with ``stream: true``."""
    if stream_options is not None and not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
            "stream_options",
        )


def _missing(where: str) -> APIError:
    return bad_request(f"Missing required parameter: '{where}'.", where, "missing")


def check_messages(messages: Sequence[Any]) -> None:
    """Each role's required fields (``content``; an assistant's ``content`` or
    ``tool_calls``; a tool result's ``tool_call_id`` and the ``id`` of each call), and that
    tool results answer, one for one, the calls of the assistant message before them."""
    pending: dict[str, int] | None = None  # ids of the last assistant calls not answered
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        calls = m.tool_calls or []
        if m.role == "assistant":
            if m.content is None and not calls:
                raise bad_request(
                    f"Invalid value for '{where}.content': an assistant message needs "
                    "'content' or 'tool_calls'.", f"{where}.content",
                )  # fmt: skip
        elif m.content is None:
            raise _missing(f"{where}.content")
        if m.role != "tool":
            _check_unanswered(pending)
            pending = _call_ids(calls, where) if m.role == "assistant" and calls else None
            continue
        if not m.tool_call_id:
            raise _missing(f"{where}.tool_call_id")
        if pending is None:
            raise bad_request(
                f"Invalid value for '{where}.role': a message with role 'tool' must answer a "
                "call of the assistant message with 'tool_calls' before it.", f"{where}.role",
            )  # fmt: skip
        if m.tool_call_id not in pending:
            raise bad_request(
                f"Invalid value for '{where}.tool_call_id': {m.tool_call_id!r} is not the id "
                "of an unanswered call of the assistant message before it.",
                f"{where}.tool_call_id",
            )
        del pending[m.tool_call_id]
    _check_unanswered(pending)


def _call_ids(calls: list[Any], where: str) -> dict[str, int]:
    ids: dict[str, int] = {}
    for j, call in enumerate(calls):
        cid = call.get("id") if isinstance(call, dict) else None
        if not isinstance(cid, str) or not cid:
            raise _missing(f"{where}.tool_calls[{j}].id")
        ids[cid] = j
    return ids


def _check_unanswered(pending: dict[str, int] | None) -> None:
    if pending:
        raise bad_request(
            "An assistant message with 'tool_calls' must be followed by tool messages "
            f"answering each call; not answered: {', '.join(sorted(pending))}.",
            "messages",
        )
