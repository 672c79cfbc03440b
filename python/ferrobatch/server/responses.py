"""What each endpoint's choices look like: chat and text completion, as stream chunks and
as whole responses, with their logprobs."""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferrobatch.server.run import Accumulator
from ferrobatch.server.state import ServerState
from ferrobatch.server.tool_syntax import ToolSyntax, parse_calls

__all__ = ["ChatFormat", "CompletionFormat", "ResponseMeta", "ToolChatFormat"]


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

    def __init__(
        self, state: ServerState, top_n: int | None, skip_special_tokens: bool = True
    ) -> None:
        self.state = state
        self.top_n = top_n
        self.skip_special_tokens = skip_special_tokens
        self.tracks: dict[int, LogprobTrack] = {}

    def _track(self, index: int) -> LogprobTrack:
        track = self.tracks.get(index)
        if track is None:
            track = self.tracks[index] = LogprobTrack(
                token_bytes(self.state), self.skip_special_tokens
            )
        return track

    def opening(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """First chunk of each choice: the assistant role."""
        return [_chat_chunk(i, {"role": "assistant", "content": ""}, None) for i in indices]

    def piece(self, index: int, delta: Any, ids: list[int]) -> dict[str, Any] | None:
        """Chunk choice carrying a delta's text and the logprobs of the tokens that text
        covers (None when there is nothing to send)."""
        entries: list[TokenEntry] = []
        if self.top_n is not None:
            track = self._track(index)
            track.add(ids, delta.logprobs or [])
            entries = track.take(len(delta.text or ""), delta.finish_reason)
        if not (delta.text or entries):
            return None
        lp = _chat_logprobs(entries, self.top_n) if self.top_n is not None else None
        return _chat_chunk(index, {"content": delta.text or ""}, None, lp)

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        """Last chunk choice of a choice."""
        return _chat_chunk(index, {}, reason)

    def choice(self, index: int, acc: Accumulator) -> dict[str, Any]:
        """A whole (non-streamed) choice."""
        lp = None
        text = "".join(acc.text)
        if self.top_n is not None:
            track = self._track(index)
            track.add(acc.token_ids, acc.logprobs)
            lp = _chat_logprobs(track.take(len(text), acc.finish_reason), self.top_n)
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": lp, "finish_reason": acc.finish_reason,
        }  # fmt: skip


class ToolChatFormat(ChatFormat):
    """Chat choices of a request whose output may hold tool calls (``tools`` with
    ``tool_choice`` other than ``"none"``), written under `syntax` and read back at the end
    (`ferrobatch.server.tool_syntax.parse_calls`). A choice with calls answers
    ``tool_calls``, finish_reason ``"tool_calls"`` and the text around them as ``content``
    (null when none); other output is plain content. Cut by ``max_tokens``, the whole calls
    before the cut are answered with finish_reason ``"length"`` (the cut one is dropped).
    When streamed, a choice's text is held
    back until it is known not to be a call (a JSON-format answer whose first non-blank
    character does not open one streams from there on); a call is sent in the last chunk as
    one ``tool_calls`` delta holding the whole call (with the logprobs of its tokens)."""

    def __init__(
        self, state: ServerState, top_n: int | None, skip_special_tokens: bool,
        names: set[str], syntax: ToolSyntax,
    ) -> None:  # fmt: skip
        super().__init__(state, top_n, skip_special_tokens)
        self.names = names
        self.syntax = syntax
        self._text: dict[int, list[str]] = {}
        self._lp: dict[int, list[Any]] = {}
        self._plain: set[int] = set()

    def _calls(
        self, text: str, reason: str | None
    ) -> tuple[str | None, list[dict[str, Any]]] | None:
        if reason not in (None, "stop", "length"):
            return None  # aborted
        return parse_calls(text, self.syntax, self.names, partial=reason == "length")

    def finish_reason_of(self, text: str, reason: str) -> str:
        """The finish_reason a choice whose whole text is `text` answers (the engine ended
        it with `reason`): "tool_calls" when it holds calls (`_reason`), else `reason`."""
        found = self._calls(text, reason)
        return self._reason(reason) if found is not None and found[1] else reason

    @staticmethod
    def _reason(reason: str | None) -> str:
        """The finish_reason of a choice with calls: ``length`` stays (a call was cut)."""
        return "length" if reason == "length" else "tool_calls"

    def _is_plain(self, text: str) -> bool:
        """Whether held-back text is already known to be no call (JSON formats only)."""
        head = text.lstrip()
        return self.syntax.leading_only and bool(head) and not head.startswith(
            self.syntax.trigger
        )

    def piece(self, index: int, delta: Any, ids: list[int]) -> dict[str, Any] | None:
        chunk = super().piece(index, delta, ids)
        if chunk is None or index in self._plain:
            return chunk
        self._text.setdefault(index, []).append(chunk["delta"].get("content") or "")
        if chunk["logprobs"] is not None:
            self._lp.setdefault(index, []).extend(chunk["logprobs"]["content"])
        text = "".join(self._text[index])
        if not self._is_plain(text):
            return None
        self._plain.add(index)
        del self._text[index]
        lp = {"content": self._lp.pop(index, [])} if self.top_n is not None else None
        return _chat_chunk(index, {"content": text}, None, lp)

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        if index in self._plain:
            return super().finish(index, reason)
        text = "".join(self._text.pop(index, []))
        lp_entries = self._lp.pop(index, None)
        lp = {"content": lp_entries} if self.top_n is not None else None
        found = self._calls(text, reason)
        if found is None:
            return _chat_chunk(index, {"content": text} if text else {}, reason, lp)
        content, calls = found
        delta: dict[str, Any] = {"content": content} if content else {}
        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        return _chat_chunk(index, delta, self._reason(reason), lp)

    def choice(self, index: int, acc: Accumulator) -> dict[str, Any]:
        out = super().choice(index, acc)
        found = self._calls(out["message"]["content"], acc.finish_reason)
        if found is not None:
            content, calls = found
            out["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            out["finish_reason"] = self._reason(acc.finish_reason)
        return out


class CompletionFormat:
    """``/v1/completions`` choices (``logprobs``: top-n, None = off; ``echo_texts``: prompt
    text put before each choice's output; with ``logprobs`` the prompt tokens' logprobs come
    first, the first one null, as OpenAI's and vLLM's ``echo``)."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(
        self, state: ServerState, logprobs: int | None, echo_texts: dict[int, str],
        skip_special_tokens: bool = True,
    ) -> None:  # fmt: skip
        self.state = state
        self.logprobs = logprobs
        self.echo_texts = echo_texts
        self.skip_special_tokens = skip_special_tokens
        self.tracks: dict[int, LogprobTrack] = {}
        self.echo_pending = set(echo_texts) if logprobs is not None else set()

    def _track(self, index: int) -> LogprobTrack:
        track = self.tracks.get(index)
        if track is None:
            track = self.tracks[index] = LogprobTrack(
                token_bytes(self.state), self.skip_special_tokens,
                base=len(self.echo_texts.get(index, "")),
            )  # fmt: skip
        return track

    def opening(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The echoed prompts (with logprobs: sent with the first delta instead, which
        carries the prompt tokens' logprobs)."""
        return [
            _text_chunk(i, text, None)
            for i, text in self.echo_texts.items() if i not in self.echo_pending
        ]  # fmt: skip

    def _prompt_entries(self, index: int, delta: Any) -> list[TokenEntry]:
        plp = getattr(delta, "prompt_logprobs", None)
        ids = getattr(delta, "prompt_token_ids", None) or []
        return prompt_entries(token_bytes(self.state), ids, plp, self.skip_special_tokens)

    def piece(self, index: int, delta: Any, ids: list[int]) -> dict[str, Any] | None:
        """Chunk choice carrying a delta's text and the logprobs of the tokens that text
        covers (None when there is nothing to send)."""
        text = delta.text or ""
        entries: list[TokenEntry] = []
        if index in self.echo_pending:
            self.echo_pending.discard(index)
            entries = self._prompt_entries(index, delta)
            text = self.echo_texts[index] + text
        if self.logprobs is not None:
            track = self._track(index)
            track.add(ids, delta.logprobs or [])
            entries += track.take(len(delta.text or ""), delta.finish_reason)
        if not (text or entries):
            return None
        lp = _completion_logprobs(entries, self.logprobs) if self.logprobs is not None else None
        return _text_chunk(index, text, None, lp)

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        """Last chunk choice of a choice."""
        return _text_chunk(index, "", reason)

    def choice(self, index: int, acc: Accumulator) -> dict[str, Any]:
        """A whole (non-streamed) choice."""
        out = "".join(acc.text)
        text = self.echo_texts.get(index, "") + out
        lp = None
        if self.logprobs is not None:
            entries = []
            if index in self.echo_texts:
                entries = prompt_entries(token_bytes(self.state), acc.prompt_token_ids,
                                         acc.prompt_logprobs, self.skip_special_tokens)
            track = self._track(index)
            track.add(acc.token_ids, acc.logprobs)
            entries += track.take(len(out), acc.finish_reason)
            lp = _completion_logprobs(entries, self.logprobs)
        return _text_chunk(index, text, acc.finish_reason, lp)


def _chat_chunk(index: int, delta: dict[str, Any], finish: str | None, lp: Any = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}


def _text_chunk(index: int, text: str, finish: str | None, lp: Any = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}


# ---------------------------------------------------------------------------------------
# logprobs


@dataclass
class TokenEntry:
    """One token of a logprobs list: its text, real bytes, logprob (None: the first prompt
    token), top alternatives (token id, logprob) and character offset in the choice text."""

    token_id: int
    text: str
    raw: bytes
    logprob: float | None
    top: list[tuple[int, float]] | None
    offset: int
    tb: TokenBytes


class TokenBytes:
    """Each token's real bytes (a byte-level BPE token that is part of a UTF-8 character is
    those bytes, not U+FFFD), its display text (the bytes as text when they are valid
    UTF-8, else OpenAI's ``bytes:\\xNN`` form), and which tokens are special (skipped in text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[bytes, str]] = {}
        self._byte_level = False
        try:
            self._byte_level = "ByteLevel" in tokenizer.backend_tokenizer.to_str()
        except Exception:  # noqa: BLE001 - not a fast tokenizer: decode-based fallback
            pass
        self._unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(tok, "special", False):
                special.add(int(tid))
        self.special = special

    def get(self, tid: int) -> tuple[bytes, str]:
        """(bytes, display text) of one token (cached)."""
        hit = self._cache.get(tid)
        if hit is not None:
            return hit
        raw = self._raw(tid)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        if len(self._cache) < 1_000_000:
            self._cache[tid] = (raw, text)
        return raw, text

    def _raw(self, tid: int) -> bytes:
        tok = self.tokenizer
        if self._byte_level and tid not in self.special:
            piece = tok.convert_ids_to_tokens(tid)
            if isinstance(piece, str) and piece and all(c in self._unbyte for c in piece):
                return bytes(self._unbyte[c] for c in piece)
        piece = tok.convert_ids_to_tokens(tid) if hasattr(tok, "convert_ids_to_tokens") else None
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and \
                piece.endswith(">"):  # sentencepiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        try:
            text = tok.decode([tid], skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - a broken tokenizer entry
            text = ""
        return text.encode("utf-8")


_TOKEN_BYTES: dict[int, TokenBytes] = {}


def token_bytes(state: ServerState) -> TokenBytes:
    """The `TokenBytes` of the state's engine tokenizer (one per tokenizer)."""
    tok = state.engine.tokenizer
    tb = _TOKEN_BYTES.get(id(tok))
    if tb is None or tb.tokenizer is not tok:
        tb = _TOKEN_BYTES[id(tok)] = TokenBytes(tok)
    return tb


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))  # fmt: skip
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


class LogprobTrack:
    """A choice's generated tokens turned into logprob entries that cover exactly its text.

    Each token's character offset comes from its bytes (an incremental UTF-8 decode, special
    tokens empty when skipped, as in the text): a token belongs to the text when it starts
    before the text's end. `take(n_chars, finish_reason)` is called with the length of each
    piece of text handed out (stream deltas, or the whole text once) and returns the entries
    of the tokens that text now covers; when the choice ends with "stop" (EOS, a stop token,
    a stop string), the tokens beyond the text (the EOS token, a matched stop string's) are
    dropped; with any other finish the rest are returned.
    """

    def __init__(self, tb: TokenBytes, skip_special_tokens: bool, base: int = 0) -> None:
        self.tb = tb
        self.skip_special = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = base  # offset of the next token
        self._text_end = base  # end of the text handed out so far
        self._pending: list[TokenEntry] = []

    def add(self, ids: Sequence[int], lps: Sequence[dict[int, float]]) -> None:
        for tid, d in zip(ids, lps, strict=False):
            raw, text = self.tb.get(int(tid))
            self._pending.append(TokenEntry(int(tid), text, raw, d.get(tid, -9999.0),
                                            list(d.items()), self._chars, self.tb))  # fmt: skip
            if not (self.skip_special and tid in self.tb.special):
                self._chars += len(self._decoder.decode(raw))

    def take(self, n_chars: int, finish_reason: str | None) -> list[TokenEntry]:
        self._text_end += n_chars
        if finish_reason is not None and finish_reason != "stop":
            out, self._pending = self._pending, []
            return out
        k = 0
        while k < len(self._pending) and self._pending[k].offset < self._text_end:
            k += 1
        out, self._pending = self._pending[:k], self._pending[k:]
        if finish_reason is not None:
            self._pending = []
        return out


def prompt_entries(
    tb: TokenBytes, ids: Sequence[int], plp: Sequence[dict[int, float] | None] | None,
    skip_special_tokens: bool,
) -> list[TokenEntry]:  # fmt: skip
    """The echoed prompt's entries: the first token's logprob None, offsets from 0."""
    if not plp:
        return []
    track = LogprobTrack(tb, skip_special_tokens)
    entries = []
    for tid, d in zip(ids, plp, strict=False):
        raw, text = tb.get(int(tid))
        lp = None if d is None else d.get(tid, -9999.0)
        top = None if d is None else list(d.items())
        entries.append(TokenEntry(int(tid), text, raw, lp, top, track._chars, tb))
        if not (skip_special_tokens and tid in tb.special):
            track._chars += len(track._decoder.decode(raw))
    return entries


def _top(items: list[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    return sorted(items, key=lambda kv: (-kv[1], kv[0]))[:n]


def _finite(value: float) -> float:
    return -9999.0 if math.isinf(value) or math.isnan(value) else float(value)


def _chat_logprobs(entries: Sequence[TokenEntry], n: int | None) -> dict[str, Any]:
    content = []
    for e in entries:
        top = []
        for t, v in _top(e.top or [], n or 0):
            raw, text = e.tb.get(t)
            top.append({"token": text, "logprob": _finite(v), "bytes": list(raw)})
        content.append({
            "token": e.text,
            "logprob": _finite(e.logprob if e.logprob is not None else -9999.0),
            "bytes": list(e.raw),
            "top_logprobs": top,
        })  # fmt: skip
    return {"content": content}


def _completion_logprobs(entries: Sequence[TokenEntry], n: int | None) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.text)
        token_lps.append(None if e.logprob is None else _finite(e.logprob))
        if e.top is None:
            tops.append(None)
        else:
            tops.append(
                {e.tb.get(t)[1]: _finite(v) for t, v in _top(e.top, n)} if n else None
            )
        offsets.append(e.offset)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
