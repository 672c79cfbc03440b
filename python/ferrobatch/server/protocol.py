"""OpenAI wire format: request bodies, the error shape, usage, and body validation."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "APIError",
    "ChatCompletionResponse",
    "CompletionResponse",
    "ErrorResponse",
    "Health",
    "ModelCard",
    "ModelList",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "SamplingFields",
    "StreamOptions",
    "bad_request",
    "error_responses",
    "parse",
    "usage",
]

#: ``max_tokens`` of ``/v1/completions`` when the request leaves it out (OpenAI's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return APIError(400, message, param=param, code=code or "invalid_value")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ---------------------------------------------------------------------------------------
# request schemas


class _Schema(BaseModel):
    # strict: no silent coercion ("5" is not an integer, 1 is not a boolean); unknown
    # fields are ignored, as OpenAI-compatible servers usually do.
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``"field": null`` means "not given" (many clients send nulls for unset fields)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Schema):
    """``stream_options``: ``include_usage`` adds a last chunk with token counts."""

    include_usage: bool = False


class SamplingFields(_Schema):
    """Sampling fields shared by both endpoints (OpenAI names, plus a few extensions)."""

    model: str | None = Field(None, description="Served model name (default: the only one).")
    n: int = Field(1, ge=1, le=128, description="Choices per prompt.")
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="Sampling temperature; 0 = greedy. Default 1.0."
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="Extension: -1 or 0 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Extension.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="Extension.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings.")
    stop_token_ids: list[int] | None = Field(None, description="Extension.")
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="Extension: keep going past EOS.")
    skip_special_tokens: bool = Field(True, description="Extension.")
    priority: int | None = Field(
        None, ge=-(2**31), lt=2**31,
        description="Extension (--scheduling-policy priority): lower runs first and may "
        "preempt running requests of higher value.")
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        """Whether the stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions`` body."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: prompt scoring (vLLM's), no generated token returned
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # as chat's (vLLM accepts it here too)
    # chat's, refused here (rather than ignored: a client sending them expects calls)
    tools: Any = None
    tool_choice: Any = None


class ContentPart(_Schema):
    """A text part of a message's content (images and audio are not supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Schema):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: calls it made
    tool_call_id: str | None = None  # tool: the call this result answers

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (content parts joined)."""
        if self.content is None:
            content = ""
        elif isinstance(self.content, str):
            content = self.content
        else:
            content = "".join(part.text for part in self.content)
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name:
            out["name"] = self.name
        return out


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields this server does not implement, refused rather than ignored (each
    # changes what the client expects back: calls, audio, a predicted output)
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None


# ---------------------------------------------------------------------------------------
# response schemas (for the OpenAPI document; the routes build plain dicts of this shape)


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Out):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Out):
    """``logprobs`` of a text-completion choice (OpenAI's legacy shape)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Out):
    """``POST /v1/completions`` answer (``stream: false``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None = None


class ToolCallFunction(_Out):
    name: str
    arguments: str


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Out):
    """``POST /v1/chat/completions`` answer (``stream: false``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    """Every error: OpenAI's shape."""

    error: ErrorDetail


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    """``/health``: ``ok`` (200), or ``loading`` / ``failed`` / ``shutting_down`` (503)."""

    status: Literal["ok", "loading", "failed", "shutting_down"]
    model: str | None = None
    error: str | None = None


# ---------------------------------------------------------------------------------------
# validation


def parse(schema: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body against ``schema``; a 400 naming the field on failure."""
    if not body.strip():
        raise APIError(400, "Request body is empty: send a JSON object.", code="invalid_json")
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc, body) from None


# Friendly descriptions of union-typed fields for validation messages.
_FIELD_TYPES = {
    "prompt": (
        "a string, an array of strings, an array of token ids or an array of token-id arrays"
    ),
    "stop": "a string or an array of strings",
    "content": "a string or an array of text content parts",
}


def _validation_error(exc: ValidationError, body: bytes = b"") -> APIError:
    """Turn pydantic's first error into a 400 naming the field."""
    err = exc.errors(include_url=False)[0]
    etype = err.get("type", "")
    if etype == "json_invalid":
        if (unicode := _unicode_error(body)) is not None:
            return unicode
        if "recursion limit" in str(err.get("msg", "")):
            field = _deep_field(body)
            where = f" (in '{field}')" if field else ""
            return bad_request(
                f"The request body nests JSON objects and arrays too deep{where}: at most "
                f"{JSON_NESTING_LIMIT} levels below the top-level object are accepted.",
                field,
                "nesting_too_deep",
            )
        return APIError(
            400,
            f"Request body is not valid JSON: {err.get('msg', '')}. "
            "Send a JSON object with Content-Type: application/json.",
            code="invalid_json",
        )
    if etype == "model_type" and not err.get("loc"):
        return APIError(400, "Request body must be a JSON object.", code="invalid_json")
    param, union = _error_path(err.get("loc", ()))
    if etype == "missing":
        return APIError(400, f"Missing required field '{param}'.", param=param, code="missing")
    if union and param is not None:
        expected = _FIELD_TYPES.get(param.split(".")[-1].split("[")[0])
        if expected:
            return bad_request(
                f"Invalid type for '{param}': expected {expected}.", param, "invalid_type"
            )
    msg = err.get("msg", "invalid value")
    code = "invalid_type" if etype.endswith("_type") else "invalid_value"
    given = err.get("input")
    shown = ""
    if given is not None and not isinstance(given, dict | list) and err.get("loc"):
        shown = f" (got {json.dumps(given)[:80]})"
    return bad_request(f"Invalid value for '{param}': {msg}{shown}.", param, code)


#: Objects and arrays a body may nest below its top-level object (pydantic-core's parser).
JSON_NESTING_LIMIT = 200


def _deep_field(body: bytes) -> str | None:
    """The top-level field of a JSON object body in which nesting passes the limit (a scan
    of the bytes: no recursion, whatever the depth)."""
    depth, key, in_string, escaped = 0, None, False, False
    start = 0
    for i, byte in enumerate(body):
        ch = chr(byte)
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 1:
                    key = body[start:i].decode("utf-8", "replace")
        elif ch == '"':
            in_string, start = True, i + 1
        elif ch in "[{":
            depth += 1
            if depth > JSON_NESTING_LIMIT + 1:
                return key
        elif ch in "]}":
            depth -= 1
    return None


def _unicode_error(body: bytes) -> APIError | None:
    """A clear 400 for JSON that is well formed but not valid Unicode: a body that is not
    UTF-8, or a lone surrogate escape such as ``"\\ud800"`` (pydantic's parser calls it an
    "unexpected end of hex escape"); names the field holding it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return APIError(
            400,
            f"Request body is not valid UTF-8 (byte {exc.start}): send JSON encoded as UTF-8.",
            code="invalid_json",
        )
    try:
        value = json.loads(text)  # Python's parser accepts lone surrogates; find the field
    except (ValueError, RecursionError):
        return None
    found = _find_surrogate(value, "")
    if found is None:
        return None
    path, char = found
    where = f"'{path}'" if path else "the request body"
    return bad_request(
        f"Invalid value for {where}: it contains the lone surrogate escape \\u{ord(char):04x}, "
        "which is not a Unicode character. Send text as UTF-8, or characters outside the "
        "Basic Multilingual Plane as a surrogate pair (\\ud83d\\ude00).",
        path or None,
        "invalid_unicode",
    )


def _find_surrogate(value: Any, path: str, depth: int = 0) -> tuple[str, str] | None:
    """(field path, the surrogate) of the first string holding a lone surrogate."""
    if depth > 64:
        return None
    if isinstance(value, str):
        for ch in value:
            if "\ud800" <= ch <= "\udfff":
                return path, ch
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if (found := _find_surrogate(key, sub, depth + 1)) is not None:
                return found
            if (found := _find_surrogate(item, sub, depth + 1)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := _find_surrogate(item, f"{path}[{i}]", depth + 1)) is not None:
                return found
    return None


def _error_path(loc: tuple[Any, ...]) -> tuple[str | None, bool]:
    """(``a.b[0]``-style field path, whether it stopped at a union branch tag)."""
    path: list[str] = []
    for part in loc:
        if isinstance(part, int):
            path.append(f"[{part}]")
        elif (
            "[" in part
            or part in ("str", "int", "float", "bool", "dict", "list")
            or (part and part[0].isupper())
        ):
            return "".join(path) or None, True  # a union branch tag ("list[int]", ...)
        else:
            path.append(("." if path else "") + part)
    return "".join(path) or None, False


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries of the error statuses a route answers."""
    text = {400: "Invalid request (the field is named in param)", 401: "Missing or wrong key",
            404: "Unknown model", 408: "Body too slow", 413: "Body too large",
            429: "Queue full; retry after Retry-After", 500: "Server error",
            503: "Engine loading, failed, or shutting down"}  # fmt: skip
    return {c: {"model": ErrorResponse, "description": text[c]} for c in codes}
