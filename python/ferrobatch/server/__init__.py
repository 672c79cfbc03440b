"""OpenAI-compatible HTTP server on top of :class:`ferrobatch.Engine`.

``create_app(engine, model_name=...)`` builds a FastAPI app that serves

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming with Server-Sent
  Events in the OpenAI chunk format, ``n``, sampling parameters, stop strings, seeds,
  logprobs, ``stream_options.include_usage``),
* ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text format).

Every connection feeds the same engine loop (``engine.astream``), so requests from all
clients join one continuous batch. A client that disconnects has its requests cancelled at
once, which frees their cache blocks. Errors use OpenAI's JSON shape
``{"error": {"message", "type", "param", "code"}}``.

Run it with ``ferrobatch serve`` (see :mod:`ferrobatch.cli`) or, embedded, with
:class:`BackgroundServer`.

Modules: ``protocol`` (request bodies, errors, validation), ``params`` (prompts, sampling,
context checks), ``state`` (per-app state and route checks), ``run`` (choices as engine
requests), ``responses`` (choice shapes, logprobs), ``streaming`` (SSE), ``app`` (routes),
``background`` (uvicorn in a thread).
"""

from ferrobatch.server.app import create_app
from ferrobatch.server.background import BackgroundServer
from ferrobatch.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ferrobatch.server.state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE

__all__ = [
    "APIError",
    "BackgroundServer",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "create_app",
]
