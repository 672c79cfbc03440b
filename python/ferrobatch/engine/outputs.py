"""`RequestOutput`: a request's result, or one streamed delta of it; `EmbeddingOutput`: an
embedding request's result."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A request's tokens and text so far (or, as a delta, only the new ones).

    `finish_reason` is "stop" (EOS, a stop token or a stop string), "length"
    (`max_new_tokens` reached), "cancelled", or None while running. `logprobs` has one
    `{token_id: logprob}` dict per token (top-n plus the chosen token) when requested;
    `prompt_logprobs` one per prompt token (None for the first, then the token's logprob
    given the ones before it plus the top-n) with `SamplingParams.prompt_logprobs` (in a
    stream: in the first delta only).
    `ttft` is seconds from arrival to the first token; `token_times` are seconds since
    arrival, one per token.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    finished: bool = False
    logprobs: list[dict[int, float]] | None = None
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids)


@dataclass(frozen=True)
class EmbeddingOutput:
    """One prompt's embedding: `embedding` (floats, `dimensions` long), the pooling that made
    it, whether it is L2-normalized, and the prompt's token ids."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    pooling: str
    normalized: bool

    @property
    def dimensions(self) -> int:
        """The embedding's length (the model's hidden size)."""
        return len(self.embedding)
