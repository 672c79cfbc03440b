"""Guided (structured) decoding: a per-request token mask from a grammar, with llguidance.

A request with `SamplingParams(json_schema=...)`, `regex=...` or `grammar=...` (Lark, as
llguidance reads it) gets a `Guide` when it is made (`GuideFactory.guide`, in the caller's
thread: the grammar is compiled there, not in a step). The sampler asks each guided row's
`Guide` for the tokens the grammar allows next (`fill`) and masks the others out of its
scores (`mask_rows`); the end-of-sequence tokens are allowed only where the grammar accepts.

The matcher follows the request's own record of generated tokens (`SamplingState.output_ids`,
what the router appended): `fill` first consumes the tokens it has not seen. So nothing has
to be rolled back when a request is preempted (a soft reset re-feeds the generated tokens
as prompt; they are already consumed, none is sampled again), and the async pipeline, which
samples step N+1 after recording step N, needs nothing either.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from ferrobatch.errors import FieldError
from ferrobatch.sampling.grammar import (
    GRAMMAR_FIELDS,
    check_grammar_fields,
    grammar_text,
    llguidance_module,
)

__all__ = ["GRAMMAR_FIELDS", "Guide", "GuideFactory", "check_grammar_fields", "mask_rows"]


class GuideFactory:
    """Builds `Guide`s for one engine's tokenizer (its llguidance tokenizer made once, on
    first use; thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None

    def ll_tokenizer(self, field: str | None = None) -> Any:
        """llguidance's view of the tokenizer; `FieldError` on `field` (the grammar field
        asked for) without a tokenizer or an end-of-sequence token."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise FieldError(f"{field or 'structured outputs'}: structured outputs "
                                     "need the model's tokenizer (pass tokenizer= to "
                                     "Engine)", field)
                if not self.eos_token_ids:
                    raise FieldError(f"{field or 'structured outputs'}: structured outputs "
                                     "need an end-of-sequence token", field)
                import llguidance.hf  # local: llguidance is optional (the structured extra)

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._ll_tokenizer

    def guide(self, params: Any) -> Guide | None:
        """A fresh `Guide` for `params`, None without a grammar field."""
        name = check_grammar_fields(params)
        if name is None:
            return None
        llg = llguidance_module()
        # (log_level 0: llguidance's own warnings would go to stderr, grammar and all;
        # its errors reach the caller through `get_error`)
        matcher = llg.LLMatcher(self.ll_tokenizer(name),
                                grammar_text(name, getattr(params, name)), log_level=0)
        if matcher.is_error():
            raise FieldError(f"{name} is invalid: {matcher.get_error()}", name)
        return Guide(matcher, self.vocab_size, self.eos_token_ids, name)


#: words of llguidance's errors that name one of its resource limits (`LLParserLimits`)
_LIMIT_WORDS = ("max is", "TooComplex", "fuel", "limit", "too many", "too large")


class Guide:
    """One request's grammar matcher (of the `SamplingParams` field `field`) and how many
    of its generated tokens it consumed."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: list[int],
                 field: str = "grammar") -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.field = field
        self.consumed = 0

    def failure(self) -> FieldError | None:
        """Why the matcher failed while generating (llguidance gave up: a schema with no
        finite instance, a limit of its own), as a `FieldError` on the grammar's field; None
        while it has not. Such a request ends with this error, not with "stop": its output
        cannot match the grammar."""
        m = self.matcher
        if not m.is_error():
            return None
        error = m.get_error().split("\n<state>", 1)[0].strip()  # (then its state, grammar)
        if any(word in error for word in _LIMIT_WORDS):
            return FieldError(f"{self.field}: no output can satisfy it within the grammar "
                              "engine's limits (a grammar with no finite instance, or one too "
                              f"large or ambiguous for it: {error})", self.field)
        return FieldError(f"{self.field}: no output can satisfy it (the grammar engine "
                          f"stopped: {error})", self.field)

    def sync(self, output_ids: list[int]) -> None:
        """Consume the generated tokens not consumed yet."""
        m = self.matcher
        while self.consumed < len(output_ids):
            tok = output_ids[self.consumed]
            self.consumed += 1
            if m.is_stopped() or m.is_error():
                continue
            m.consume_token(int(tok))

    def fill(self, output_ids: list[int], bitmask: np.ndarray, row: int) -> None:
        """Row `row` of `bitmask` (int32 words, llguidance's layout): the tokens allowed after
        `output_ids`. A stopped or failed matcher allows only the end-of-sequence tokens."""
        self.sync(output_ids)
        m = self.matcher
        if m.is_stopped() or m.is_error():
            bitmask[row] = 0
            words = bitmask.view(np.uint32)
            for t in self.eos_token_ids:
                words[row, t // 32] |= np.uint32(1 << (t % 32))
            return
        import llguidance.numpy as lnp  # local: llguidance is optional (the structured extra)

        lnp.fill_next_token_bitmask(m, bitmask, row)


def mask_rows(scores: torch.Tensor, states: Any) -> None:
    """Set to -inf, in place, the scores of the tokens the guided rows' grammars forbid."""
    rows = [i for i, s in enumerate(states) if s.guide is not None]
    if not rows:
        return
    vocab = scores.shape[1]
    words = (max(vocab, states[rows[0]].guide.vocab_size) + 31) // 32
    bitmask = np.zeros((len(rows), words), dtype=np.int32)
    for j, i in enumerate(rows):
        states[i].guide.fill(states[i].output_ids, bitmask, j)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbid = torch.from_numpy(allowed == 0)
    dev = scores.device
    if dev.type == "cpu":
        idx = torch.tensor(rows, dtype=torch.int64)
    else:
        if dev.type == "cuda":
            forbid = forbid.pin_memory()
        forbid = forbid.to(dev, non_blocking=True)
        idx = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    sub = scores.index_select(0, idx).masked_fill_(forbid, -torch.inf)
    scores.index_copy_(0, idx, sub)
