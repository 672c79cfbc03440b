"""The exceptions ferrobatch raises: bad input (shared by the core, the engine and the server)
and the engine's refusals."""

from __future__ import annotations


class FieldError(ValueError):
    """A value that fails validation; `field` names the argument it came from.

    Raised alike by `SamplingParams`, `ContinuousBatchingConfig`, the engine and the Rust
    core (through the bindings). `field` is the argument's name as the caller spelled it
    (`"max_new_tokens"`, `"page_size"`, `"prompt"`), or None when no single argument is at
    fault; the server reports it as the OpenAI error's `param`.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[FieldError], tuple[str, str | None]]:
        return (type(self), (str(self), self.field))


class EngineClosedError(RuntimeError):
    """The engine was closed while the request was waiting (or before it was added)."""


class QueueFullError(RuntimeError):
    """`max_queue_size` unfinished requests are already in the engine (the server answers
    429)."""
