"""The same model through the engine twice, quantized (a GGUF file) and in bf16 (the float
checkpoint of the same weights), interleaved in one process: offline throughput (chat
prompts x 64 tokens), single-stream decode (128 tokens), prefill (one 512-token prompt),
greedy, EOS ignored, prefix caching off; tokens per wall second and per CPU-second, medians
of the repeats, and the RSS each engine added at construction.

    .venv/bin/python benches/quant_vs_bf16.py model-q4_k_m.gguf bf16-dir/ --threads 1 --repeats 3

Each arm runs the same token ids (the GGUF tokenizer's chat template; the checkpoint must be
the same model). The bf16 engine is built first and measured for RSS before the GGUF one.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.workloads import chat_prompts

ROOT = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build(path: str, dtype: str | None) -> tuple[Engine, float, float]:
    """(engine, construction seconds, MiB of RSS it added)."""
    gc.collect()
    before, start = rss_mib(), time.perf_counter()
    cfg = ContinuousBatchingConfig(allow_block_sharing=False, adaptive_threads=False)
    engine = Engine(path, config=cfg, dtype=dtype)
    return engine, time.perf_counter() - start, rss_mib() - before


def timed(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(generated tokens per wall s, per CPU s) of one `generate` call."""
    c0, w0 = time.process_time(), time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True),
                           progress=False)
    n = sum(len(o.token_ids) for o in outs) if new > 1 else sum(len(p) for p in prompts)
    return n / (time.perf_counter() - w0), n / (time.process_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("bf16", help="the float checkpoint of the same model (loaded as bf16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {}
    for name, path, dtype in (("bf16", args.bf16, "bfloat16"), ("gguf", args.gguf, None)):
        engine, secs, added = build(path, dtype)
        engines[name] = engine
        print(f"{name}: built in {secs:.1f} s, RSS +{added:.0f} MiB", flush=True)
    gguf = engines["gguf"]
    chat = chat_prompts(gguf.encode_chat, args.prompts)
    single = [gguf.tokenizer("def fibonacci(n):").input_ids]
    text = (ROOT / "README.md").read_text()
    long = [gguf.tokenizer(text).input_ids[:512]]
    work = {"offline": (chat, 64), "single": (single, 128), "prefill": (long, 1)}
    for engine in engines.values():  # warm-up
        timed(engine, chat[:4], 4)
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in range(args.repeats):
        order = ("bf16", "gguf") if r % 2 == 0 else ("gguf", "bf16")
        for what, (prompts, new) in work.items():
            for name in order:
                got = timed(engines[name], prompts, new)
                runs.setdefault((what, name), []).append(got)
                print(f"  repeat {r} {what:8} {name}: {got[0]:.1f} tok/s, {got[1]:.1f} "
                      f"tok per CPU-s", flush=True)
    print(f"\n{args.threads} thread(s), medians of {args.repeats}: tok/s wall / per CPU-s")
    for what in work:
        b = [statistics.median(x[i] for x in runs[(what, "bf16")]) for i in (0, 1)]
        q = [statistics.median(x[i] for x in runs[(what, "gguf")]) for i in (0, 1)]
        print(f"| {what} | {b[0]:.1f} / {b[1]:.1f} | {q[0]:.1f} / {q[1]:.1f} | "
              f"{q[0] / b[0]:.2f}x / {q[1] / b[1]:.2f}x |")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
