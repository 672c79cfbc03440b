"""Incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded ahead of the output so the first generated token keeps the leading
# space (or other context-dependent text) it has in the full sequence.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, a token at a time.

    Text is emitted only once it is stable: never an incomplete UTF-8 character, and never
    characters that could still turn out to start a stop string. When a stop string
    appears (possibly across token boundaries) the text is cut just before it and
    `stopped` becomes True. With `incremental=False` (no stop strings, nobody streaming)
    decoding is deferred to `finish()`, which returns the same text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        incremental: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.incremental = incremental or bool(self.stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._context_len = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # decoded (and, after a stop, cut) output text
        self._emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self.stop_string: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; returns the text newly safe to emit (may be empty)."""
        if self.stopped:
            return ""
        if not self.incremental:
            self._ids.extend(token_ids)
            return ""
        for t in token_ids:
            self._ids.append(int(t))
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                before = len(self.text)
                self.text += new_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                if self.stop and self._check_stop(before):
                    break
        return self._take(final=self.stopped)

    def _check_stop(self, before: int) -> bool:
        start = max(0, before - self._hold)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.stopped = True
        self.stop_string = best[1]
        return True

    def _take(self, *, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def finish(self) -> str:
        """Flush at the end of the request: the text not yet emitted."""
        if not self.stopped:
            full = self._decode(self._ids)
            head = self._decode(self._ids[: self._context_len])
            if full.startswith(head):
                tail = full[len(head) :]
            else:  # context decoding is not a prefix (rare tokenizers): decode output alone
                tail = self._decode(self._ids[self._context_len :])
            before = len(self.text)
            if not self.incremental or tail.startswith(self.text):
                self.text = tail
            if self.stop:
                self._check_stop(min(before, self._emitted))
        return self._take(final=True)
