"""The ``ferrobatch`` argument parser: model, sampling and config flags, one table each."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrobatch.config import ContinuousBatchingConfig
from ferrobatch.spec.cli import add_spec_flags

__all__ = ["CONFIG_FLAGS", "DEFAULT_SERVED_NAME", "SAMPLING_FLAGS", "build_parser"]

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers >= ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)


def _port(text: str) -> int:
    """A TCP port number, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value


def _seconds(*, allow_zero: bool) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number of seconds (> 0, or >= 0)."""

    def parse(text: str) -> float:
        value = float(text)
        if not value < float("inf") or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if allow_zero else '>'} 0 seconds, got {text}"
            )
        return value

    return parse


_positive_float = _seconds(allow_zero=False)
_non_negative_float = _seconds(allow_zero=True)


# (flag dest = ContinuousBatchingConfig field, argparse kwargs). Defaults are None: a flag
# that is not given leaves the config's own default in place. Values are checked once, by
# ContinuousBatchingConfig / SamplingParams (a FieldError, exit status 2), not here.
CONFIG_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("page_size", dict(type=int, metavar="TOKENS",
     help="Tokens per KV-cache page (>= 4); a block is one page per layer of an "
          "attention type.")),
    ("num_blocks", dict(type=int, metavar="N",
     help="KV-cache capacity in full-attention blocks. Default: sized from free memory "
          "(see --max-memory-percent).")),
    ("max_batch_tokens", dict(type=int, metavar="TOKENS",
     help="Query tokens per forward pass; longer prompts are prefilled in chunks.")),
    ("max_memory_percent", dict(type=float, metavar="FRACTION",
     help="Share (0..1] of free memory the cache may take when --num-blocks is not given. "
          "Default: 0.9 of free memory on CUDA; on CPU 0.25 of available memory, at most "
          "4 GiB.")),
    ("max_requests_per_batch", dict(type=int, metavar="N",
     help="Rows per forward pass; caps logits memory for large vocabularies.")),
    ("scheduling_policy", dict(choices=("fcfs", "priority"),
     help="fcfs: arrival order; priority: lower request priority first, and a waiting "
          "request that doesn't fit preempts running ones of lower priority (each at most "
          "3 times). Default: fcfs.")),
    ("scheduler_type", dict(choices=("fifo", "prefill_first"),
     help="fifo: decodes first, then in-flight prefills, then new requests in arrival order; "
          "prefill_first: finish chunked prefills before resuming decodes.")),
    ("safety_margin", dict(type=float, metavar="FRACTION",
     help="Share [0, 1) of the cache held in reserve for running decodes: below it no new "
          "prefill is admitted. Default: 0.15 for fifo, 0 for prefill_first.")),
    ("allow_block_sharing", dict(action=argparse.BooleanOptionalAction,
     help="Prefix caching: share full blocks between requests with the same prompt prefix "
          "(full-attention-only models). Default: on.")),
    ("defer_shared_prefixes", dict(action=argparse.BooleanOptionalAction,
     help="With prefix caching, admit a request one step later when another request of the "
          "same step computes its next prompt block, so it reuses that block instead of "
          "computing it again (shared system prompts arriving together). Default: on.")),
    ("max_step_ms", dict(type=float, metavar="MS",
     help="CPU: step-time budget for chunked prefill while other requests run or wait: "
          "long prompts are prefilled in chunks sized to take about this long, and short "
          "requests are served beside them; 0 = off (token budget only). Default: 500.")),
    ("cpu_offload_space", dict(type=float, metavar="GIB",
     help="GiB of CPU swap pool for preempted requests; 0 = off (preempted requests are "
          "soft-reset and recomputed). Default: 0.")),
    ("q_padding_interval_size", dict(type=int, metavar="TOKENS",
     help="CUDA-graph query-length padding interval; 0 = preset.")),
    ("kv_padding_interval_size", dict(type=int, metavar="TOKENS",
     help="CUDA-graph key-length padding interval; 0 = preset.")),
    ("use_cuda_graph", dict(action=argparse.BooleanOptionalAction,
     help="Capture CUDA graphs for decode steps. Default: decided automatically "
          "(off on CPU).")),
    ("use_async_batching", dict(action=argparse.BooleanOptionalAction,
     help="Plan the next step while the current one runs (one step in flight). Default: on "
          "with CUDA graphs on CUDA, else off; --use-async-batching enables it on any "
          "device, CPU included.")),
    ("max_queue_size", dict(type=int, metavar="N",
     help="Engine-side bound on unfinished requests (running or waiting); 0 = unlimited. "
          "A server answers 429 beyond it. (serve's --max-queue bounds the requests waiting "
          "for their first token.)")),
    ("adaptive_threads", dict(action=argparse.BooleanOptionalAction,
     help="CPU: run torch on fewer threads (never more than --threads) while other "
          "processes keep this process's cores busy, and go back up when they free up.")),
    ("kv_cache_dtype", dict(metavar="DTYPE",
     help="KV-cache storage: auto (the model's dtype) or int8 (one fp32 scale per token and "
          "KV head: ~2x the blocks of a bf16 cache for the same memory; CPU only).")),
    ("batch_invariant", dict(action=argparse.BooleanOptionalAction,
     help="A request's tokens and logprobs are bit-identical whatever else shares its "
          "steps (batch mates, prompt chunking, prefix hits, preemption, threads). CPU, "
          "full-attention models. Default: off.")),
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
        help="Local checkpoint directory (config, weights, tokenizer), or a GGUF file (or a "
        "directory holding exactly one), loaded with its matrices kept quantized. Default: "
        "the bundled SmolLM2-135M-Instruct (prepared into a cache directory on first use).",
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
        help="Weights and cache dtype. auto: on CPU bfloat16 when the checkpoint is stored "
        "in bfloat16/float16 and the CPU has native bf16 (AMX or AVX512-BF16), else float32; "
        "on CUDA bfloat16 (float16 without bf16 support). float32 is the exact mode (greedy "
        "output equal to model.generate in fp32); bfloat16/float16 on CPU run the linear "
        "layers on packed half-precision weights with fp32 activations.",
    )
    group.add_argument(
        "--quantization",
        default=None,
        type=str.lower,  # (Q4_K as q4_k, as the Python API takes it)
        choices=("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"),
        help="Quantize a float checkpoint's linear layers on load (CPU; weights kept "
        "quantized, products on ferrobatch.gguf's QuantLinear). q8_0/q4_0/q4_1/q5_0/q5_1 use "
        "gguf's "
        "quantizers, q4_k/q5_k/q6_k the kernels' (layers whose input width is not a "
        "multiple of 256 stay float). Not for GGUF files (already quantized). Default: none.",
    )
    group.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="torch CPU threads (torch.set_num_threads). Default: torch's choice (one per "
        "physical core). Waiting threads spin briefly (ferrobatch sets GOMP_SPINCOUNT=30000 "
        "unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set), and while other processes keep "
        "the cores busy the engine runs on fewer threads (see --adaptive-threads).",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_positive_int,
        default=1,
        metavar="N",
        help="Shard the model over N ranks with its transformers tensor-parallel plan "
        "(torch.distributed: NCCL on CUDA, one device per rank; gloo on CPU). The engine "
        "starts N-1 worker processes, or joins a torchrun launch. Default: 1.",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="PEFT LoRA adapters to load at start (adapter_config.json + "
        "adapter_model.safetensors in PATH); a request picks one by NAME (the server's "
        "'model' field). Decoder layers then run unfused.",
    )
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="Take LoRA adapters (POST /v1/load_lora_adapter) even without --lora-modules.",
    )
    group.add_argument(
        "--max-loras",
        type=_positive_int,
        default=4,
        metavar="N",
        help="LoRA adapters with requests running at once; requests of another adapter "
        "wait until one of them is idle. Default: 4.",
    )
    group.add_argument(
        "--engine-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="Seed of the engine's sampler for requests without their own seed.",
    )
    add_spec_flags(parser)


def _lora_module(value: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--lora-modules``."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


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
    ("logprobs", dict(type=int, default=None, metavar="N",
     help="Record the top-N log-probabilities per token (JSONL output).")),
]  # fmt: skip


def _add_sampling_flags(parser: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    group = parser.add_argument_group("sampling (SamplingParams)")
    group.add_argument(
        "--max-new-tokens",
        type=int,
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
    group.add_argument("--port", type=_port, default=8000, help="TCP port. Default: 8000.")
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
        "--read-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="A connection must send a request's headers within SECONDS of connecting (or of "
        "its previous response), and the body within SECONDS of the headers; slower headers "
        "close the connection, a slower body (or one shorter than its Content-Length) gets "
        "408. Default: 30.",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="On SIGTERM / SIGINT: stop accepting, give in-flight requests SECONDS to finish, "
        "then end streams with an error event and [DONE] and answer the rest with 503; "
        "exit 0. Default: 30.",
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
        "without MODEL, tiny-llama (a random-init Llama: hidden 256, 4 layers) with random "
        "prompts of 16..256 tokens; with MODEL (or --smollm2), chat prompts through its template. "
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
        type=int,
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
        "prompts (needs benches/e2e_cpu.py from a source checkout), and vLLM's CPU build "
        "when its venv exists (benches/peers/setup_vllm_cpu.sh; through "
        "benches/compare_cpu.py, tiny-llama and --smollm2 workloads).",
    )
    group.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="Also write the figures here."
    )
    _add_config_flags(bench)
    return parser
