"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's names and bodies):
LoRA adapters loaded and unloaded while the server runs; a request picks one as ``model``."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ferrobatch.errors import FieldError
from ferrobatch.server import checks
from ferrobatch.server.protocol import bad_request, error_responses, parse
from ferrobatch.server.state import ServerState, read_body

__all__ = ["LoadLoraRequest", "UnloadLoraRequest", "add_lora_routes"]


class LoadLoraRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` body."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str = Field(min_length=1, description="The name requests pass as 'model'.")
    lora_path: str = Field(min_length=1, description="A PEFT adapter directory on the server.")


class UnloadLoraRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` body."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str = Field(min_length=1)


# the routes' 200: a line of text (as vLLM answers)
_TEXT_OK: dict[int | str, dict[str, object]] = {
    200: {"description": "Done", "content": {"text/plain": {"schema": {"type": "string"}}}}}


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """Register the adapter routes on `app`."""

    async def engine_of(request: Request, schema: type[BaseModel]) -> tuple[object, object]:
        state.require_auth(request)
        engine = state.require_engine()
        checks.check_content_type(request.headers.get("content-type"))
        body = parse(schema, await read_body(request, state.max_body_bytes, state.body_timeout))
        if getattr(engine, "lora", None) is None:
            raise bad_request("This server was started without LoRA support (--lora-modules "
                              "or --enable-lora).", "lora_name")
        return engine, body

    @app.post("/v1/load_lora_adapter",
              responses={**_TEXT_OK, **error_responses(400, 401, 408, 413, 500, 503)})
    async def load_lora_adapter(request: Request) -> Response:
        """Load a PEFT adapter; 400 naming the field when it can't be."""
        engine, req = await engine_of(request, LoadLoraRequest)
        assert isinstance(req, LoadLoraRequest)
        if req.lora_name in state.served_names():
            raise bad_request(f"The name {req.lora_name!r} is already served.", "lora_name")
        loop = asyncio.get_running_loop()
        try:  # reading the weights: off the event loop
            load = engine.load_lora  # type: ignore[attr-defined]
            await loop.run_in_executor(state.tokenize_pool, load, req.lora_name, req.lora_path)
        except FieldError as exc:
            param = "lora_path" if exc.field == "lora_modules" else exc.field or "lora_path"
            raise bad_request(str(exc), param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter",
              responses={**_TEXT_OK, **error_responses(400, 401, 408, 413, 500, 503)})
    async def unload_lora_adapter(request: Request) -> Response:
        """Unload an adapter (its running requests finish with it)."""
        engine, req = await engine_of(request, UnloadLoraRequest)
        assert isinstance(req, UnloadLoraRequest)
        try:
            engine.unload_lora(req.lora_name)  # type: ignore[attr-defined]
        except FieldError as exc:
            raise bad_request(str(exc), "lora_name") from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

