"""``ferrobatch serve``: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import logging
import sys
from pathlib import Path
from typing import Any

from ferrobatch.cli.build import build_config, build_engine
from ferrobatch.cli.flags import DEFAULT_SERVED_NAME
from ferrobatch.spec.cli import spec_config_from_args

__all__ = ["cmd_serve"]


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


def freeze_startup_heap() -> None:
    """Move every object alive now (the model, torch, transformers) out of the collector's
    reach, so a full collection while serving walks only what requests created: a request
    that allocates many objects no longer stalls every stream for a walk of the whole heap."""
    gc.collect()
    gc.freeze()


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible server until interrupted."""
    # local: fastapi / uvicorn (the serve extra, ~0.4 s) load for this command only
    from ferrobatch.server import create_app
    from ferrobatch.server.background import make_server

    build_config(args)  # fail fast on a bad flag or model path, before binding the port
    spec_config_from_args(args)
    if args.model:
        from ferrobatch.models import check_model_path  # local: imports torch

        check_model_path(args.model)
    name = args.served_model_name or (
        Path(args.model).expanduser().resolve().name if args.model else DEFAULT_SERVED_NAME
    )
    if not _is_loopback(args.host) and not args.api_key:
        logging.getLogger("ferrobatch").warning(
            "serving on %s without --api-key: anyone who can reach it can use it", args.host
        )
    failures: list[BaseException] = []
    server: Any = None

    def load() -> Any:
        try:
            engine = build_engine(args)
        except BaseException as exc:  # reported below; the server stops instead of idling
            failures.append(exc)
            if server is not None:
                server.should_exit = True
            raise
        freeze_startup_heap()
        return engine

    app = create_app(
        None,
        model_name=name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.read_timeout,
        engine_loader=load,
    )
    print(
        f"ferrobatch: serving '{name}' on http://{args.host}:{args.port}/v1 "
        "(loading the model; /health answers 503 until it is ready)",
        file=sys.stderr,
        flush=True,
    )
    server = make_server(
        app,
        args.host,
        args.port,
        log_level=args.log_level,
        read_timeout=args.read_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises SIGINT after shutdown
        server.run()
    if failures:
        exc = failures[0]
        print(
            f"ferrobatch serve: error: the model failed to load: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    if not server.started:
        return 1  # uvicorn could not bind (it logged why)
    return 0
