"""``POST /v1/embeddings``: OpenAI embeddings (``openai``'s ``embeddings.create``) through
`Engine.aembed`, batched with the generation requests in the engine's steps."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ferrobatch.errors import FieldError
from ferrobatch.sampling.pooling import encode_vector
from ferrobatch.server import checks, params
from ferrobatch.server.protocol import (
    APIError,
    _Schema,
    bad_request,
    error_responses,
    parse,
    usage,
)
from ferrobatch.server.state import ServerState, read_body

__all__ = ["EmbeddingRequest", "add_embedding_routes"]


class EmbeddingRequest(_Schema):
    """``POST /v1/embeddings`` body (OpenAI's fields, plus ``pooling`` / ``normalize``)."""

    model: str | None = Field(None, description="Served model name (default: the only one).")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, a token-id list or a list of them.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None, ge=1, description="Accepted only as the model's own embedding size.")
    user: str | None = None
    pooling: Literal["last", "mean", "cls"] | None = Field(
        None, description="Extension: the checkpoint's pooling when left out, else 'last'.")
    normalize: bool | None = Field(None, description="Extension: L2-normalize (default on).")


def add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    """Register ``POST /v1/embeddings`` on `app`."""

    @app.post("/v1/embeddings",
              responses=error_responses(400, 401, 404, 408, 413, 429, 500, 503))
    async def embeddings(request: Request) -> Response:
        """OpenAI embeddings of one input or a list of them."""
        state.require_auth(request)
        engine = state.require_engine()
        checks.check_content_type(request.headers.get("content-type"))
        body = await read_body(request, state.max_body_bytes, state.body_timeout)
        req = parse(EmbeddingRequest, body)
        state.check_model(req.model)
        if not callable(getattr(engine, "aembed", None)):
            raise bad_request("This engine can't compute embeddings.", "model")
        if state.lora_of(req.model) is not None:
            raise bad_request("Embeddings come from the base model; a LoRA adapter can't be "
                              "chosen for them.", "model")
        _check_dimensions(engine, req.dimensions)
        loop = asyncio.get_running_loop()
        prompts = await loop.run_in_executor(state.tokenize_pool, _prompts, engine, req.input)
        state.check_size(len(prompts), 1, "input")
        state.admit(len(prompts))
        state.waiting += len(prompts)
        try:
            outs = await engine.aembed(prompts, pooling=req.pooling, normalize=req.normalize)
        except FieldError as exc:
            raise bad_request(f"The engine rejected the request: {exc}",
                              _param(exc.field)) from None
        finally:
            state.waiting -= len(prompts)
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_vector(out.embedding, req.encoding_format)}
                for i, out in enumerate(outs)]
        tokens = sum(len(p) for p in prompts)
        return JSONResponse({
            "object": "list", "data": data, "model": req.model or state.primary_name(),
            "usage": {k: v for k, v in usage(tokens, 0).items() if k != "completion_tokens"},
            "created": int(time.time()),
        })


def _prompts(engine: Any, inputs: Any) -> list[list[int]]:
    """Token ids of each input (in the tokenizer thread), each checked against the
    vocabulary and the context (400 naming ``input``)."""
    if isinstance(inputs, list) and not inputs:
        raise bad_request("'input' must not be empty.", "input")
    if isinstance(inputs, str | list) and any(isinstance(x, str) and not x for x in
                                              ([inputs] if isinstance(inputs, str) else inputs)):
        raise bad_request("'input' must not contain empty strings.", "input")
    if engine.tokenizer is None and (isinstance(inputs, str) or isinstance(inputs[0], str)):
        raise bad_request("This model has no tokenizer: send token ids as 'input'.", "input")
    try:
        prompts = params.completion_prompts(engine, inputs)
    except APIError as exc:
        exc.param = "input"
        raise
    for ids in prompts:
        if any(not 0 <= t < engine.vocab_size for t in ids):
            raise bad_request(f"Token ids in 'input' must be in [0, {engine.vocab_size}).",
                              "input")
        params.check_context(engine, len(ids), 1, "input")
    return prompts


def _check_dimensions(engine: Any, dimensions: int | None) -> None:
    """``dimensions``: no checkpoint ferrobatch serves is trained to be truncated, so only
    its own embedding size is accepted."""
    size = int(engine.embedding_size)
    if dimensions is not None and dimensions != size:
        raise bad_request(
            f"This model's embeddings have {size} dimensions and can't be shortened; "
            f"'dimensions' must be {size} or left out.", "dimensions")


def _param(field: str | None) -> str:
    """The request field an engine `FieldError` names."""
    return {"prompt": "input", None: "input"}.get(field, field or "input")
