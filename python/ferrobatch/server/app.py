"""The FastAPI app: engine loading at startup, error handlers and the routes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ferrobatch.metrics import ServerMetrics
from ferrobatch.server import checks, params, tools
from ferrobatch.server.background import DEFAULT_READ_TIMEOUT
from ferrobatch.server.embeddings import EmbeddingRequest, add_embedding_routes
from ferrobatch.server.lora_routes import LoadLoraRequest, UnloadLoraRequest, add_lora_routes
from ferrobatch.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    bad_request,
    error_responses,
    parse,
    usage,
)
from ferrobatch.server.responses import ChatFormat, CompletionFormat, ResponseMeta, ToolChatFormat
from ferrobatch.server.run import (
    ClientGone,
    Job,
    Run,
    check_engine_room,
    collect,
    wait_disconnect,
)
from ferrobatch.server.state import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    BodyClientGone,
    ServerState,
    engine_error,
    read_body,
)
from ferrobatch.server.streaming import EventStreamResponse, sse_chunks

__all__ = ["create_app"]

logger = logging.getLogger("ferrobatch.server")


def create_app(
    engine: Any = None,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int | None = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float | None = DEFAULT_READ_TIMEOUT,
    stream_buffer: int = 1024,
    stream_stall_timeout: float = 60.0,
    engine_loader: Callable[[], Any] | None = None,
    close_engine: bool | None = None,
) -> FastAPI:
    """Build the OpenAI-compatible app around ``engine``.

    Args:
        engine: a started or startable ``ferrobatch.Engine`` (anything with the §6 surface).
            ``None`` with ``engine_loader``: the app answers 503 until the loader returns.
        model_name: the name clients pass as ``model`` (``engine.model_name`` also works).
        api_key: when set, every ``/v1`` call needs ``Authorization: Bearer <api_key>``.
        max_queue: requests (choices) allowed to wait for their first token; more get 429.
            ``None`` = unbounded.
        max_body_bytes: request body cap; larger bodies get 413.
        body_timeout: seconds a request body may take once its headers arrived; slower
            (or shorter than its Content-Length) gets 408. ``None`` = no deadline.
        stream_buffer: events (token deltas) one response holds for a client that does not
            read its stream (its socket buffers full); the engine requests then wait for it.
        stream_stall_timeout: seconds a full buffer may wait; then the requests are cancelled
            (freeing their cache) and the stream ends with a ``stream_stalled`` error.
        engine_loader: builds the engine in a background thread at startup.
        close_engine: close the engine at shutdown (default: only an engine the app loaded).
    """
    if engine is None and engine_loader is None:
        raise ValueError("create_app needs an engine or an engine_loader")
    if max_queue is not None and max_queue < 1:
        raise ValueError("max_queue must be >= 1 or None")
    if max_body_bytes < 1024:
        raise ValueError("max_body_bytes must be >= 1024")
    if stream_buffer < 1 or not stream_stall_timeout > 0:
        raise ValueError("stream_buffer must be >= 1 and stream_stall_timeout > 0")
    if body_timeout is not None and body_timeout <= 0:
        raise ValueError("body_timeout must be > 0 or None")
    state = ServerState(
        engine=engine,
        model_name=model_name,
        api_key=api_key or None,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        body_timeout=body_timeout,
        stream_buffer=stream_buffer,
        stream_stall_timeout=stream_stall_timeout,
        metrics=ServerMetrics(),
        owns_engine=bool(close_engine) if close_engine is not None else engine is None,
    )
    app = FastAPI(
        title="ferrobatch",
        description="OpenAI-compatible API of the ferrobatch continuous-batching engine.",
        lifespan=_lifespan(state, engine_loader),
        docs_url=None,
        redoc_url=None,
    )
    app.state.ferrobatch = state
    _add_error_handlers(app, state)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    add_embedding_routes(app, state)
    add_lora_routes(app, state)
    _install_openapi(app)
    return app


# Bodies larger than this are validated in the tokenizer thread, not on the event loop.
_PARSE_ON_LOOP_BYTES = 64 * 1024


_errors = error_responses


# One Server-Sent Event (OpenAPI 3.1: a text/event-stream schema describes each event).
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "A JSON chunk (object text_completion / chat.completion.chunk), an "
            "error object {error: {...}} (the stream then ends), or the literal [DONE] last.",
        },
        "event": {"type": "string"},
    },
}

_GENERATION_ERRORS = _errors(400, 401, 404, 408, 413, 429, 500, 503)


def _generation_responses(model: type[Any]) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": "The whole response (JSON), or with stream=true Server-Sent Events "
            "of chunks ending with 'data: [DONE]'.",
            "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        },
        **_GENERATION_ERRORS,
    }


def _nullable_optionals(schema: dict[str, Any]) -> None:
    """Optional fields accept ``null`` ("not given"); say so in the schema."""
    required = set(schema.get("required", ()))
    for name, prop in (schema.get("properties") or {}).items():
        if name in required:
            continue
        branches = prop.get("anyOf", [prop])
        if any(b.get("type") == "null" for b in branches):
            continue
        meta = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **meta}


def _install_openapi(app: FastAPI) -> None:
    """Declare the request bodies (the routes read and validate them themselves, for the
    body-size limit and OpenAI-shaped errors, so FastAPI cannot see them)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description,
                          routes=app.routes)  # fmt: skip
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in (
            ("/v1/completions", CompletionRequest),
            ("/v1/chat/completions", ChatCompletionRequest),
            ("/v1/embeddings", EmbeddingRequest),
            ("/v1/load_lora_adapter", LoadLoraRequest),
            ("/v1/unload_lora_adapter", UnloadLoraRequest),
        ):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            defs = body.pop("$defs", {})
            for part in (body, *defs.values()):
                _nullable_optionals(part)
            schemas.update(defs)
            schemas[model.__name__] = body
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }  # fmt: skip
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _lifespan(state: ServerState, engine_loader: Callable[[], Any] | None) -> Any:
    """Startup loads the engine in a thread (when a loader is given); shutdown closes it."""

    def load() -> None:
        assert engine_loader is not None
        try:
            loaded = engine_loader()
            if state.closing:
                with contextlib.suppress(Exception):
                    loaded.close()
                return
            state.engine = loaded
            logger.info("engine ready: %s", state.primary_name())
        except Exception as exc:
            logger.exception("engine failed to load")
            state.load_error = f"{type(exc).__name__}: {exc}"

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.engine is None and engine_loader is not None:
            threading.Thread(target=load, name="ferrobatch-load", daemon=True).start()
        try:
            yield
        finally:
            state.closing = True
            if state.owns_engine and state.engine is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(state.engine.close)
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error answers in OpenAI's JSON shape and is counted."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        state.metrics.on_request_error(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        state.metrics.on_request_error(exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(BodyClientGone)
    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: Exception) -> Response:
        # Nobody reads this answer: the client left while sending its body.
        logger.info("client %s left while sending its body (%s %s)",
                    _peer(request), request.method, request.url.path)  # fmt: skip
        state.metrics.on_client_gone("body")
        return Response(status_code=499)

    @app.exception_handler(ClientGone)
    async def _client_gone_waiting(request: Request, exc: Exception) -> Response:
        # Nobody reads this answer: the client left before its prompt was tokenized.
        state.metrics.on_client_gone("tokenize")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        state.metrics.on_request_error(500)
        err = APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error")
        return JSONResponse(err.body(), status_code=500)


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """``/health``, ``/metrics`` and ``/v1/models``."""

    @app.get(
        "/health",
        responses={200: {"model": Health}, 503: {"model": Health, "description": "Not ready"}},
    )
    async def health() -> Response:
        """200 when the engine is ready, 503 while it loads or when it failed."""
        err = engine_error(state.engine) if state.engine is not None else None
        if err is not None:
            return JSONResponse(
                {"status": "failed", "error": f"{type(err).__name__}: {err}"}, status_code=503
            )
        if state.closing or state.engine is None:
            status = (
                "shutting_down" if state.closing else ("failed" if state.load_error else "loading")
            )
            body: dict[str, Any] = {"status": status}
            if state.load_error:
                body["error"] = state.load_error
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "model": state.primary_name()})

    @app.head("/health", include_in_schema=False)
    async def health_head() -> Response:
        """`health`'s status (load balancers probe with HEAD; the body is not sent)."""
        return await health()

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                         "description": "Prometheus text exposition format 0.0.4 (OpenMetrics "
                                        "1.0 when Accept asks for application/openmetrics-text)"}},
    )  # fmt: skip
    async def metrics(request: Request) -> Response:
        """Prometheus text format (OpenMetrics when the ``Accept`` header asks for it)."""
        stats = None
        if state.engine is not None:
            try:
                stats = state.engine.stats()
                take_steps = getattr(state.engine, "take_step_records", None)
                if take_steps is not None:  # step times and prefill budgets since the last
                    state.metrics.on_steps(take_steps())
            except Exception as exc:  # pragma: no cover - scrape must not fail
                logger.warning("engine.stats() failed: %s", exc)
        ready = state.engine is not None and not state.closing
        body, content_type = state.metrics.exposition(stats, ready, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    served_since = int(time.time())

    def model_entry(engine: Any, adapter: str | None = None) -> dict[str, Any]:
        entry = {
            "id": adapter or state.primary_name(),
            "object": "model",
            "created": served_since,  # (the same on every call: when the server started)
            "owned_by": "ferrobatch",
            "max_model_len": int(getattr(engine, "max_model_len", 0) or 0),
        }
        if adapter is not None:  # a LoRA adapter: its base model and where it came from
            entry.update(parent=state.primary_name(), root=engine.lora.path_of(adapter))
        return entry

    @app.get("/v1/models", responses={200: {"model": ModelList}, **_errors(401, 503)})
    async def models(request: Request) -> Response:
        """The served model and its LoRA adapters."""
        state.require_auth(request)
        engine = state.require_engine()
        data = [model_entry(engine)]
        for name in state.lora_names():
            with contextlib.suppress(KeyError):  # unloaded meanwhile
                data.append(model_entry(engine, name))
        return JSONResponse({"object": "list", "data": data})

    @app.get(
        "/v1/models/{model_id:path}",
        responses={200: {"model": ModelCard}, **_errors(401, 404, 503)},
    )
    async def model(model_id: str, request: Request) -> Response:
        """One model by name (404 unless it is the served one)."""
        state.require_auth(request)
        engine = state.require_engine()
        state.check_model(model_id)
        adapter = state.lora_of(model_id)
        return JSONResponse({**model_entry(engine, adapter), "id": model_id})


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``."""

    async def tokenize(request: Request, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the tokenizer thread, unless the client has left by the time its
        turn comes (a long prompt ahead of it in the one thread: its work is skipped)."""
        loop = asyncio.get_running_loop()
        gone = threading.Event()

        def guarded() -> Any:
            if gone.is_set():
                raise _TokenizeSkipped
            return fn(*args)

        watcher = asyncio.create_task(wait_disconnect(request.receive))
        watcher.add_done_callback(lambda t: t.cancelled() or t.exception() or gone.set())
        try:
            return await loop.run_in_executor(state.tokenize_pool, guarded)
        except _TokenizeSkipped:
            raise ClientGone() from None
        except APIError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"Could not tokenize the input: {exc}") from None
        finally:
            watcher.cancel()

    async def accept(request: Request, schema: type[Any]) -> tuple[Any, Any]:
        """(engine, validated body) after auth, readiness and model checks."""
        state.require_auth(request)
        engine = state.require_engine()
        checks.check_content_type(request.headers.get("content-type"))
        body = await read_body(request, state.max_body_bytes, state.body_timeout)
        if len(body) > _PARSE_ON_LOOP_BYTES:  # validating a big body takes the loop too long
            loop = asyncio.get_running_loop()
            req = await loop.run_in_executor(state.tokenize_pool, parse, schema, body)
        else:
            req = parse(schema, body)
        state.check_model(req.model)
        checks.check_stream_options(req.stream_options, req.stream)
        return engine, req

    @app.post("/v1/completions", responses=_generation_responses(CompletionResponse))
    async def completions(request: Request) -> Response:
        """OpenAI text completions."""
        arrival = time.perf_counter()
        engine, req = await accept(request, CompletionRequest)
        _check_completion_options(req)
        _check_stop_token_ids(engine, req)
        count = _prompt_count(req.prompt)
        state.check_size(count, req.n, "prompt")  # cheap checks before any tokenizing
        state.admit(count * req.n)
        guided = params.response_format_sampling(req.response_format)
        if req.max_tokens == 0:  # prompt scoring returns no tokens: nothing to constrain
            guided = {}

        def prepare() -> tuple[list[list[int]], list[int]]:  # in the tokenizer thread
            prompts = params.completion_prompts(engine, req.prompt)
            max_tokens_each = []
            for ids in prompts:
                params.check_vocab(engine, ids)
                max_tokens_each.append(params.check_context(engine, len(ids), req.max_tokens,
                                                            "prompt"))  # fmt: skip
            return prompts, max_tokens_each

        prompts, max_tokens_each = await tokenize(request, prepare)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs: list[Job] = []
        for p, ids in enumerate(prompts):
            base = params.base_sampling(req, max_tokens_each[p], req.logprobs)
            base["lora"] = state.lora_of(req.model)  # model=<adapter name>: that adapter
            base.update(guided)
            for i, sp in enumerate(params.choice_samplings(base, req.n)):
                index = p * req.n + i
                jobs.append(Job(index, ids, sp, f"{rid}-{index}", arrival,
                                prompt_only=req.max_tokens == 0))  # fmt: skip
        echo_texts: dict[int, str] = {}
        if req.echo:
            texts = params.prompt_texts(engine, req.prompt, prompts)
            echo_texts = {job.index: texts[job.index // req.n] for job in jobs}
        params.check_with_engine(engine, jobs, "prompt")
        fmt = CompletionFormat(state, req.logprobs, echo_texts, req.skip_special_tokens)
        prompt_tokens = sum(len(p) for p in prompts)
        return await _respond(state, request, engine, "completions", jobs, fmt, req, rid,
                              prompt_tokens)  # fmt: skip

    @app.post("/v1/chat/completions", responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions (the model's chat template)."""
        arrival = time.perf_counter()
        engine, req = await accept(request, ChatCompletionRequest)
        _check_chat_options(req)
        checks.check_messages(req.messages)
        _check_stop_token_ids(engine, req)
        state.check_size(1, req.n, "messages")
        state.admit(req.n)
        setup = tools.prepare_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        if setup.parses_output and req.response_format not in (None, {"type": "text"}):
            raise bad_request("response_format cannot be combined with tools unless tool_choice "
                              "is 'none': tool calls are decoded under their own grammar.",
                              "response_format")  # fmt: skip
        native = bool(setup.tools) and tools.template_supports_tools(engine)
        tools.constrain(setup, tools.chat_template(engine), native)
        messages = tools.chat_messages(req.messages, setup, native)
        if native:
            encode = functools.partial(engine.encode_chat, tools=setup.tools)
        else:
            encode = engine.encode_chat
        prompt_ids = list(await tokenize(request, encode, messages))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens else req.max_tokens
        max_tokens = params.check_context(engine, len(prompt_ids), max_tokens, "messages")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        base = params.base_sampling(req, max_tokens, top_n)
        base["lora"] = state.lora_of(req.model)  # model=<adapter name>: that adapter
        base.update(params.response_format_sampling(req.response_format))
        if setup.grammar is not None:
            base["grammar"] = setup.grammar
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [
            Job(i, prompt_ids, sp, f"{rid}-{i}", arrival)
            for i, sp in enumerate(params.choice_samplings(base, req.n))
        ]
        params.check_with_engine(engine, jobs, "messages")
        fmt: ChatFormat = ChatFormat(state, top_n, req.skip_special_tokens)
        if setup.parses_output:
            assert setup.syntax is not None
            fmt = ToolChatFormat(state, top_n, req.skip_special_tokens, setup.names,
                                 setup.syntax)  # fmt: skip
            for job in jobs:  # (the metrics count what the response says)
                job.reason_of = fmt.finish_reason_of
        return await _respond(state, request, engine, "chat", jobs, fmt, req, rid,
                              len(prompt_ids))  # fmt: skip


class _TokenizeSkipped(Exception):
    """A tokenizer-thread job whose client left before it started."""


def _check_stop_token_ids(engine: Any, req: CompletionRequest | ChatCompletionRequest) -> None:
    """``stop_token_ids`` must be token ids of the model (a 400 naming the field)."""
    vocab = engine.vocab_size
    for i, t in enumerate(req.stop_token_ids or ()):
        if not 0 <= t < vocab:
            raise bad_request(
                f"Invalid value for 'stop_token_ids[{i}]': {t} is not a token id of this model "
                f"(the vocabulary is [0, {vocab})).",
                "stop_token_ids",
            )


def _prompt_count(prompt: Any) -> int:
    """How many prompts a ``/v1/completions`` body holds (without tokenizing)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _check_completion_options(req: CompletionRequest) -> None:
    """Reject the ``/v1/completions`` options the server does not support."""
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix", "unsupported")
    for name in ("tools", "tool_choice"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported on /v1/completions: use "
                              "/v1/chat/completions for tool calls.", name, "unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (or be left out).", "best_of", "unsupported")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 (prompt scoring) needs echo=true.", "max_tokens")


def _check_chat_options(req: ChatCompletionRequest) -> None:
    """Reject the ``/v1/chat/completions`` options the server does not support."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name} (the deprecated form of function calling) is not "
                              "supported: use tools and tool_choice.", name, "unsupported")
    if req.modalities is not None and req.modalities != ["text"]:
        raise bad_request("modalities other than text are not supported.", "modalities",
                          "unsupported")
    if req.audio is not None:
        raise bad_request("audio output is not supported.", "audio", "unsupported")
    if req.prediction is not None:
        raise bad_request("prediction (predicted outputs) is not supported.", "prediction",
                          "unsupported")


async def _respond(
    state: ServerState,
    request: Request,
    engine: Any,
    endpoint: str,
    jobs: list[Job],
    fmt: ChatFormat | CompletionFormat,
    req: CompletionRequest | ChatCompletionRequest,
    rid: str,
    prompt_tokens: int,
) -> Response:
    """Admit and start the choices; answer with their SSE stream or the whole response."""
    if state.shutdown_expired:
        raise state.shutdown_error()
    state.admit(len(jobs))
    check_engine_room(engine, len(jobs), state.unsubmitted)
    run = Run(state, engine, endpoint, jobs)
    run.start()
    state.runs.add(run)
    meta = ResponseMeta(rid, int(time.time()), req.model or state.primary_name(), prompt_tokens)
    if req.stream:
        content = sse_chunks(run, meta, fmt, req.include_usage)
        return EventStreamResponse(content, run, on_close=lambda: state.runs.discard(run))
    try:
        accs = await collect(run, request.receive)
    except ClientGone:
        state.metrics.on_client_gone("response")
        return Response(status_code=499)
    finally:
        state.runs.discard(run)
    choices = [fmt.choice(job.index, accs[job.index]) for job in jobs]
    completion_tokens = sum(len(accs[job.index].token_ids) for job in jobs)
    return JSONResponse({
        "id": rid, "object": fmt.object, "created": meta.created,
        "model": meta.model, "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    })  # fmt: skip
