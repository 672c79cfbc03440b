"""What each endpoint's choices look like: chat and text completion, as stream chunks and
as whole responses, with their logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferrobatch.server.run import Accumulator
from ferrobatch.server.state import ServerState

__all__ = ["ChatFormat", "CompletionFormat", "ResponseMeta"]


@dataclass
class ResponseMeta:
    """Fields every response and chunk of one request shares."""

    id: str
    created: int
    model: str
    prompt_tokens: int


class ChatFormat:
    """``/v1/chat/completions`` choices (``top_n``: top logprobs per token, None = off)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, top_n: int | None) -> None:
        self.state = state
        self.top_n = top_n

    def opening(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """First chunk of each choice: the assistant role."""
        return [_chat_chunk(i, {"role": "assistant", "content": ""}, None) for i in indices]

    def piece(self, index: int, delta: Any, ids: list[int]) -> dict[str, Any] | None:
        """Chunk choice carrying a delta's text (None when there is nothing to send)."""
        if not (delta.text or (ids and self.top_n is not None)):
            return None
        lp = None
        if self.top_n is not None and delta.logprobs:
            lp = _chat_logprobs(self.state, ids, delta.logprobs, self.top_n)
        return _chat_chunk(index, {"content": delta.text or ""}, None, lp)

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        """Last chunk choice of a choice."""
        return _chat_chunk(index, {}, reason)

    def choice(self, index: int, acc: Accumulator) -> dict[str, Any]:
        """A whole (non-streamed) choice."""
        lp = None
        if self.top_n is not None:
            lp = _chat_logprobs(self.state, acc.token_ids, acc.logprobs, self.top_n)
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(acc.text)},
            "logprobs": lp, "finish_reason": acc.finish_reason,
        }  # fmt: skip


class CompletionFormat:
    """``/v1/completions`` choices (``logprobs``: top-n, None = off; ``echo_texts``: prompt
    text put before each choice's output)."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(
        self, state: ServerState, logprobs: int | None, echo_texts: dict[int, str]
    ) -> None:
        self.state = state
        self.logprobs = logprobs
        self.echo_texts = echo_texts
        self.offsets: dict[int, int] = {}  # per choice: text offset of the next token

    def opening(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The echoed prompts."""
        return [_text_chunk(i, text, None) for i, text in self.echo_texts.items()]

    def piece(self, index: int, delta: Any, ids: list[int]) -> dict[str, Any] | None:
        """Chunk choice carrying a delta's text (None when there is nothing to send)."""
        if not (delta.text or (ids and self.logprobs is not None)):
            return None
        lp = None
        if self.logprobs is not None and delta.logprobs:
            lp, self.offsets[index] = _completion_logprobs(
                self.state, ids, delta.logprobs, self.logprobs, self.offsets.get(index, 0)
            )
        return _text_chunk(index, delta.text or "", None, lp)

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        """Last chunk choice of a choice."""
        return _text_chunk(index, "", reason)

    def choice(self, index: int, acc: Accumulator) -> dict[str, Any]:
        """A whole (non-streamed) choice."""
        text = self.echo_texts.get(index, "") + "".join(acc.text)
        lp = None
        if self.logprobs is not None:
            lp, _ = _completion_logprobs(self.state, acc.token_ids, acc.logprobs,
                                         self.logprobs, 0)  # fmt: skip
        return _text_chunk(index, text, acc.finish_reason, lp)


def _chat_chunk(index: int, delta: dict[str, Any], finish: str | None, lp: Any = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}


def _text_chunk(index: int, text: str, finish: str | None, lp: Any = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}


# ---------------------------------------------------------------------------------------
# logprobs


def _top(d: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def _finite(value: float) -> float:
    return -9999.0 if math.isinf(value) or math.isnan(value) else float(value)


def _chat_logprobs(
    state: ServerState, token_ids: Sequence[int], lps: Sequence[dict[int, float]], n: int
) -> dict[str, Any]:
    content = []
    for tid, d in zip(token_ids, lps, strict=False):
        text = state.token_str(tid)
        content.append({
            "token": text,
            "logprob": _finite(d.get(tid, -9999.0)),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := state.token_str(t)), "logprob": _finite(v),
                 "bytes": list(s.encode("utf-8"))}
                for t, v in _top(d, n)
            ],
        })  # fmt: skip
    return {"content": content}


def _completion_logprobs(
    state: ServerState,
    token_ids: Sequence[int],
    lps: Sequence[dict[int, float]],
    n: int,
    offset: int,
) -> tuple[dict[str, Any], int]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps, strict=False):
        text = state.token_str(tid)
        tokens.append(text)
        token_lps.append(_finite(d.get(tid, -9999.0)))
        tops.append({state.token_str(t): _finite(v) for t, v in _top(d, n)} if n else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }, offset
