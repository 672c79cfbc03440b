"""The ``ferrobatch`` command: ``serve``, ``generate`` and ``bench``.

    ferrobatch serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY]
    ferrobatch generate [MODEL] --prompt "The capital of France is" --max-new-tokens 16
    ferrobatch generate [MODEL] --file prompts.jsonl --format jsonl > out.jsonl
    ferrobatch bench [MODEL]

MODEL is a local checkpoint directory; without it, the bundled SmolLM2-135M-Instruct. The
cache and scheduler flags map one-to-one onto ``ContinuousBatchingConfig`` fields; a flag
left out keeps the field's default.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import runpy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["build_config", "build_engine", "build_parser", "main"]

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_DTYPES = ("auto", "float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------------------
# flags


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers >= ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


# (flag dest = ContinuousBatchingConfig field, argparse kwargs). Defaults are None: a flag
# that is not given leaves the config's own default in place.
CONFIG_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("page_size", dict(type=int, metavar="TOKENS",
     help="Tokens per KV-cache page (>= 4); a block is one page per layer of an "
          "attention type.")),
    ("num_blocks", dict(type=_positive_int, metavar="N",
     help="KV-cache capacity in full-attention blocks. Default: sized from free memory "
          "(see --max-memory-percent).")),
    ("max_batch_tokens", dict(type=_positive_int, metavar="TOKENS",
     help="Query tokens per forward pass; longer prompts are prefilled in chunks.")),
    ("max_memory_percent", dict(type=float, metavar="FRACTION",
     help="Share (0..1] of free memory the cache may take when --num-blocks is not given. "
          "Default: 0.9 on CUDA, 0.3 on CPU.")),
    ("max_requests_per_batch", dict(type=_positive_int, metavar="N",
     help="Rows per forward pass; caps logits memory for large vocabularies.")),
    ("scheduler_type", dict(choices=("fifo", "prefill_first"),
     help="fifo: decodes first, then in-flight prefills, then new requests in arrival order; "
          "prefill_first: finish chunked prefills before resuming decodes.")),
    ("safety_margin", dict(type=float, metavar="FRACTION",
     help="Share [0, 1) of the cache held in reserve for running decodes: below it no new "
          "prefill is admitted. Default: 0.15 for fifo, 0 for prefill_first.")),
    ("allow_block_sharing", dict(action=argparse.BooleanOptionalAction,
     help="Prefix caching: share full blocks between requests with the same prompt prefix "
          "(full-attention-only models). Default: on.")),
    ("cpu_offload_space", dict(type=float, metavar="GIB",
     help="GiB of CPU swap pool for preempted requests; 0 = off (preempted requests are "
          "soft-reset and recomputed). Default: 0.")),
    ("q_padding_interval_size", dict(type=_nonneg_int, metavar="TOKENS",
     help="CUDA-graph query-length padding interval; 0 = preset.")),
    ("kv_padding_interval_size", dict(type=_nonneg_int, metavar="TOKENS",
     help="CUDA-graph key-length padding interval; 0 = preset.")),
    ("use_cuda_graph", dict(action=argparse.BooleanOptionalAction,
     help="Capture CUDA graphs for decode steps. Default: decided automatically "
          "(off on CPU).")),
    ("use_async_batching", dict(action=argparse.BooleanOptionalAction,
     help="Overlap CPU scheduling with GPU compute (two I/O buffer sets; needs CUDA graphs). "
          "Default: decided automatically.")),
    ("max_queue_size", dict(type=_nonneg_int, metavar="N",
     help="Engine-side bound on waiting requests; 0 = unlimited. (serve's --max-queue bounds "
          "the HTTP queue.)")),
]  # fmt: skip


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cache and scheduler (ContinuousBatchingConfig fields, one flag per field)"
    )
    defaults = _config_defaults()
    for name, kwargs in CONFIG_FLAGS:
        kwargs = dict(kwargs)
        if "Default" not in kwargs["help"] and defaults.get(name) is not None:
            kwargs["help"] += f" Default: {defaults[name]}."
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **kwargs)


def _config_defaults() -> dict[str, Any]:
    """ContinuousBatchingConfig's field defaults (for --help)."""
    import dataclasses

    from ferrobatch.config import ContinuousBatchingConfig

    return {
        f.name: f.default
        for f in dataclasses.fields(ContinuousBatchingConfig)
        if f.default is not dataclasses.MISSING
    }


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="Logging level. Default: warning.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Local checkpoint directory (config, weights, tokenizer). Default: the bundled "
        "SmolLM2-135M-Instruct (prepared into a cache directory on first use).",
    )
    group = parser.add_argument_group("model")
    group.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="Tokenizer directory, when it is not beside the model.",
    )
    group.add_argument(
        "--device", default=None, help="torch device (cpu, cuda, cuda:1, mps). Default: cpu."
    )
    group.add_argument(
        "--dtype",
        default="auto",
        choices=_DTYPES,
        help="Weights and cache dtype. auto: float32 on CPU, bfloat16 on CUDA.",
    )
    group.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="torch CPU threads (torch.set_num_threads). Default: torch's choice.",
    )
    group.add_argument(
        "--engine-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="Seed of the engine's sampler for requests without their own seed.",
    )


# (flag dest = SamplingParams field, argparse kwargs), after --max-new-tokens whose default
# depends on the command.
SAMPLING_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("temperature", dict(type=float, default=0.0,
     help="0 = greedy (the default, as model.generate); > 0 samples.")),
    ("top_k", dict(type=int, default=0, help="Keep the k most likely; 0 = off.")),
    ("top_p", dict(type=float, default=1.0, help="Nucleus sampling mass (0, 1].")),
    ("min_p", dict(type=float, default=0.0, help="Min-p filter [0, 1]; 0 = off.")),
    ("repetition_penalty", dict(type=float, default=1.0,
     help="transformers-style penalty on prompt and generated tokens; 1 = off.")),
    ("presence_penalty", dict(type=float, default=0.0,
     help="OpenAI-style penalty [-2, 2] on tokens already generated.")),
    ("frequency_penalty", dict(type=float, default=0.0,
     help="OpenAI-style penalty [-2, 2] proportional to generated counts.")),
    ("seed", dict(type=int, default=None, help="Per-request sampling seed (reproducible).")),
    ("stop", dict(action="append", default=[], metavar="TEXT",
     help="Stop string (repeatable); the output excludes it.")),
    ("ignore_eos", dict(action="store_true", help="Keep generating past the EOS token.")),
    ("logprobs", dict(type=_nonneg_int, default=None, metavar="N",
     help="Record the top-N log-probabilities per token (JSONL output).")),
]  # fmt: skip


def _add_sampling_flags(parser: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    group = parser.add_argument_group("sampling (SamplingParams)")
    group.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=max_new_tokens,
        metavar="N",
        help=f"Tokens to generate per prompt at most. Default: {max_new_tokens}.",
    )
    for name, kwargs in SAMPLING_FLAGS:
        group.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``ferrobatch`` argument parser (subcommands serve, generate, bench)."""
    parser = argparse.ArgumentParser(
        prog="ferrobatch",
        description="Continuous-batching LLM inference: Rust scheduler and paged KV cache, "
        "PyTorch forward.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'ferrobatch COMMAND --help' for the flags of each command.",
    )
    parser.add_argument("--version", action="store_true", help="Print the version and exit.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # serve ------------------------------------------------------------------------------
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server.",
        description="Serve MODEL over an OpenAI-compatible HTTP API: POST /v1/completions, "
        "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics (Prometheus). "
        "Every connection joins the same continuous batch.",
    )
    _add_model_flags(serve)
    group = serve.add_argument_group("server")
    group.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to bind. Default: 127.0.0.1 (loopback only); use 0.0.0.0 to expose "
        "it, ideally with --api-key.",
    )
    group.add_argument("--port", type=int, default=8000, help="TCP port. Default: 8000.")
    group.add_argument(
        "--api-key",
        default=os.environ.get("FERROBATCH_API_KEY"),
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on /v1 endpoints (401 otherwise). "
        "Default: $FERROBATCH_API_KEY, else no key.",
    )
    group.add_argument(
        "--max-queue",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="Requests (choices) that may wait for their first token; more get 429 with "
        "Retry-After. Default: 1024.",
    )
    group.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=2 * 1024 * 1024,
        metavar="BYTES",
        help="Largest request body accepted; larger get 413. Default: 2 MiB.",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="Name clients pass as 'model'. Default: the MODEL directory's name "
        f"({DEFAULT_SERVED_NAME} for the bundled model).",
    )
    _add_config_flags(serve)

    # generate ---------------------------------------------------------------------------
    gen = sub.add_parser(
        "generate",
        help="Generate for prompts given on the command line or in a JSONL file.",
        description="Generate completions offline, all prompts in one continuous batch.",
    )
    _add_model_flags(gen)
    group = gen.add_argument_group("input and output")
    group.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="A prompt (repeatable).",
    )
    group.add_argument(
        "--file",
        type=Path,
        default=None,
        metavar="PROMPTS.jsonl",
        help='One prompt per line: a JSON string, {"prompt": "..."} or '
        '{"messages": [{"role": ..., "content": ...}, ...]} (chat template). \'-\' reads '
        "standard input.",
    )
    group.add_argument(
        "--chat",
        action="store_true",
        help="Wrap every plain prompt as a user message and apply the chat template.",
    )
    group.add_argument(
        "--system", default=None, metavar="TEXT", help="System message for --chat prompts."
    )
    group.add_argument(
        "--format",
        choices=("text", "jsonl"),
        default="text",
        help="text: the completions, separated by headers when there are several; jsonl: one "
        "JSON object per prompt (text, finish_reason, token counts, ...). Default: text.",
    )
    group.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="PATH",
        help="Write here instead of standard output.",
    )
    group.add_argument(
        "--no-progress", action="store_true", help="Hide the progress bar (shown on stderr)."
    )
    _add_sampling_flags(gen, max_new_tokens=128)
    _add_config_flags(gen)

    # bench ------------------------------------------------------------------------------
    bench = sub.add_parser(
        "bench",
        help="Offline throughput benchmark; prints a table.",
        description="Throughput of the end-to-end benchmark (benches/e2e_cpu.py's workload): "
        "without MODEL, the design brief's random-init tiny Llama with random prompts of "
        "16..256 tokens; with MODEL (or --smollm2), chat prompts through its template. "
        "Greedy, EOS off; the median of --repeats timed runs after one warm-up.",
    )
    _add_model_flags(bench)
    group = bench.add_argument_group("workload")
    group.add_argument(
        "--smollm2", action="store_true", help="Use the bundled SmolLM2-135M-Instruct."
    )
    group.add_argument(
        "--prompts", type=_positive_int, default=64, metavar="N", help="Default: 64."
    )
    group.add_argument(
        "--min-len",
        type=_positive_int,
        default=16,
        metavar="TOKENS",
        help="Shortest random prompt (tiny model). Default: 16.",
    )
    group.add_argument(
        "--max-len",
        type=_positive_int,
        default=256,
        metavar="TOKENS",
        help="Longest random prompt (tiny model). Default: 256.",
    )
    group.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=64,
        metavar="N",
        help="Tokens per prompt (EOS off). Default: 64.",
    )
    group.add_argument(
        "--repeats", type=_positive_int, default=3, metavar="N", help="Timed runs. Default: 3."
    )
    group.add_argument(
        "--compare",
        action="store_true",
        help="Also time transformers' padded generate and generate_batch on the same "
        "prompts (needs benches/e2e_cpu.py from a source checkout).",
    )
    group.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="Also write the figures here."
    )
    _add_config_flags(bench)
    return parser


# ---------------------------------------------------------------------------------------
# building the engine


def build_config(args: argparse.Namespace) -> Any:
    """``ContinuousBatchingConfig`` from the config flags that were given (ValueError if bad)."""
    from ferrobatch.config import ContinuousBatchingConfig

    given = {name: getattr(args, name) for name, _ in CONFIG_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    return ContinuousBatchingConfig(**given)


def _dtype(name: str) -> Any:
    if name == "auto":
        return None
    import torch

    return getattr(torch, name)


def build_engine(args: argparse.Namespace, model: Any = None) -> Any:
    """An ``Engine`` from the model, config and device flags (``model`` overrides MODEL)."""
    from ferrobatch.engine import Engine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return Engine(
        model if model is not None else args.model,
        config=build_config(args),
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=_dtype(args.dtype),
        seed=args.engine_seed,
    )


def _sampling(args: argparse.Namespace) -> Any:
    from ferrobatch.sampling import SamplingParams

    fields = {name: getattr(args, name) for name, _ in SAMPLING_FLAGS}
    fields["stop"] = tuple(fields["stop"])
    return SamplingParams(max_new_tokens=args.max_new_tokens, **fields)


# ---------------------------------------------------------------------------------------
# serve


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible server until interrupted."""
    import uvicorn

    from ferrobatch.server import create_app

    build_config(args)  # fail fast on a bad flag, before binding the port
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
            return build_engine(args)
        except BaseException as exc:  # reported below; the server stops instead of idling
            failures.append(exc)
            if server is not None:
                server.should_exit = True
            raise

    app = create_app(
        None,
        model_name=name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        engine_loader=load,
    )
    print(
        f"ferrobatch: serving '{name}' on http://{args.host}:{args.port}/v1 "
        "(loading the model; /health answers 503 until it is ready)",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
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


# ---------------------------------------------------------------------------------------
# generate


def _read_prompt_file(path: Path) -> list[tuple[Any, str | list[dict[str, Any]]]]:
    """(kind, value) per line: ("text", str) or ("chat", messages)."""
    stream: IO[str]
    if str(path) == "-":
        stream = sys.stdin
        lines = stream.read().splitlines()
    else:
        lines = path.read_text(encoding="utf-8").splitlines()
    out: list[tuple[Any, Any]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if isinstance(item, str):
            out.append(("text", item))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            out.append(("text", item["prompt"]))
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            out.append(("chat", item["messages"]))
        else:
            raise ValueError(
                f'{path}:{lineno}: expected a JSON string, {{"prompt": str}} or '
                '{"messages": [...]}'
            )
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for every prompt and write text or JSONL."""
    items: list[tuple[str, Any]] = [("text", p) for p in args.prompt]
    if args.file is not None:
        items.extend(_read_prompt_file(args.file))
    if not items:
        raise ValueError("no prompts: give --prompt TEXT (repeatable) or --file PROMPTS.jsonl")
    sampling = _sampling(args)
    engine = build_engine(args)
    try:
        prompts = [_encode_item(engine, kind, value, args) for kind, value in items]
        t0 = time.perf_counter()
        outputs = engine.generate(prompts, sampling, progress=not args.no_progress)
        elapsed = time.perf_counter() - t0
    finally:
        engine.close()
    out_stream: IO[str]
    with contextlib.ExitStack() as stack:
        if args.output is not None:
            out_stream = stack.enter_context(open(args.output, "w", encoding="utf-8"))
        else:
            out_stream = sys.stdout
        for i, ((kind, value), out) in enumerate(zip(items, outputs, strict=True)):
            if args.format == "jsonl":
                out_stream.write(_jsonl_record(i, kind, value, out) + "\n")
            else:
                out_stream.write(_text_block(i, kind, value, out, several=len(items) > 1))
    total = sum(len(o.token_ids) for o in outputs)
    if not args.no_progress:
        print(
            f"ferrobatch: {len(outputs)} prompts, {total} tokens in {elapsed:.2f} s "
            f"({total / max(elapsed, 1e-9):.1f} tok/s)",
            file=sys.stderr,
        )
    return 0


def _encode_item(engine: Any, kind: str, value: Any, args: argparse.Namespace) -> Any:
    """The prompt to generate for: chat messages (and --chat text) through the template."""
    if kind == "chat":
        return engine.encode_chat(value)
    if args.chat:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        msgs.append({"role": "user", "content": value})
        return engine.encode_chat(msgs)
    return value


def _jsonl_record(index: int, kind: str, value: Any, out: Any) -> str:
    """One output as a JSON line (without the newline)."""
    record: dict[str, Any] = {
        "index": index,
        ("messages" if kind == "chat" else "prompt"): value,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "token_ids": list(out.token_ids),
        "ttft_s": out.ttft,
    }
    if out.logprobs is not None:
        record["logprobs"] = [{str(k): v for k, v in d.items()} for d in out.logprobs]
    return json.dumps(record, ensure_ascii=False)


def _text_block(index: int, kind: str, value: Any, out: Any, *, several: bool) -> str:
    """One output as text; with several prompts, under a header and followed by a blank line."""
    if not several:
        return out.text + "\n"
    shown = value if kind == "text" else value[-1].get("content", "")
    shown = str(shown).replace("\n", " ")
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"=== [{index}] {shown}\n{out.text}\n\n"


# ---------------------------------------------------------------------------------------
# bench


def _bench_module() -> dict[str, Any] | None:
    """benches/e2e_cpu.py's namespace (a source checkout), or None."""
    candidates = [
        Path(__file__).resolve().parents[2] / "benches" / "e2e_cpu.py",
        Path.cwd() / "benches" / "e2e_cpu.py",
    ]
    for path in candidates:
        if path.is_file():
            return runpy.run_path(str(path), run_name="ferrobatch_bench_e2e")
    return None


def _time_runs(run: Callable[[], list[list[int]]], repeats: int) -> tuple[list[float], int]:
    run()  # warm-up
    times = []
    got = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        got = sum(len(o) for o in out)
    return times, got


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain aligned text table; ``columns`` = (key, header)."""
    cells = [[h for _, h in columns]]
    for row in rows:
        line = []
        for key, _ in columns:
            value = row.get(key, "")
            if isinstance(value, float):
                value = f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
            line.append(str(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for n, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    """Time the end-to-end workload and print a table."""
    import torch

    from ferrobatch import workloads
    from ferrobatch.sampling import SamplingParams

    if args.min_len > args.max_len:
        raise ValueError("--min-len must be <= --max-len")
    torch.set_num_threads(args.threads or 1)
    mod = _bench_module()
    if args.compare and mod is None:
        raise ValueError("--compare needs benches/e2e_cpu.py (a source checkout)")
    chat = args.model is not None or args.smollm2
    if chat:
        engine = build_engine(args)
        model = engine.model
        prompts = workloads.chat_prompts(engine.encode_chat, args.prompts)
        label = f"{'SmolLM2-135M-Instruct' if args.model is None else args.model}, chat prompts"
    else:
        model = workloads.brief_model()
        engine = build_engine(args, model=model)
        prompts = workloads.brief_prompts(args.prompts, args.min_len, args.max_len)
        label = f"tiny Llama (brief §4), prompts of {args.min_len}..{args.max_len} tokens"
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    print(
        f"workload: {label}; {len(prompts)} prompts x {args.max_new_tokens} new tokens "
        f"(greedy, EOS off); torch threads={torch.get_num_threads()}; "
        f"median of {args.repeats}",
        file=sys.stderr,
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    try:

        def run_fb() -> list[list[int]]:
            return [o.token_ids for o in engine.generate(prompts, sp, progress=False)]

        times, got = _time_runs(run_fb, args.repeats)
        med = statistics.median(times)
        stats = engine.stats()
        rows.append({
            "method": "ferrobatch", "tok_s": got / med, "seconds": med, "tokens": got,
            "steps": int(stats.get("steps", 0)) // (args.repeats + 1) or "",
            "num_blocks": engine.num_blocks,
            "page_size": engine.config.page_size,
        })  # fmt: skip
    finally:
        engine.close()
    if args.compare and mod is not None:
        if "RUNNERS" not in mod:
            raise ValueError("--compare: benches/e2e_cpu.py has no RUNNERS table")
        ns = argparse.Namespace(padded_batch=64)
        if chat:
            model.generation_config.eos_token_id = None
        for name in ("padded_generate", "generate_batch"):
            run = mod["RUNNERS"][name](model, prompts, args.max_new_tokens, ns)
            times, got = _time_runs(run, args.repeats)
            med = statistics.median(times)
            rows.append({"method": name, "tok_s": got / med, "seconds": med, "tokens": got})
    base = rows[0]["tok_s"]
    for row in rows:
        row["vs_ferrobatch"] = row["tok_s"] / base
    columns = [("method", "method"), ("tok_s", "tok/s"), ("seconds", "seconds"),
               ("tokens", "tokens"), ("vs_ferrobatch", "x ferrobatch"), ("steps", "steps/run"),
               ("num_blocks", "blocks"), ("page_size", "page")]  # fmt: skip
    print(format_table(rows, columns))
    if args.json:
        args.json.write_text(json.dumps({"workload": label, "results": rows}, indent=2) + "\n")
    return 0


# ---------------------------------------------------------------------------------------
# entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ferrobatch`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from ferrobatch import __version__

        print(f"ferrobatch {__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    commands = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench}
    try:
        return commands[args.command](args)
    except ValueError as exc:  # bad flag values, prompt files, sampling parameters
        print(f"ferrobatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
