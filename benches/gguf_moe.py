"""A mixture-of-experts GGUF through the engine: its experts as one kernel call a layer
against the per-expert loop (`ferrobatch.gguf.experts.ONE_CALL`), one engine, the two
alternated in every repeat; single-stream decode and an offline batch, tokens per wall
second and per CPU-second, and single stream against the read-bandwidth limit (bytes a
token: every quantized matrix but the experts and the token embedding, plus the experts a
token picks).

    python benches/synthetic_gguf.py qwen3-30b-a3b /tmp/a3b8.gguf --layers 8
    taskset -c 1 python benches/gguf_moe.py /tmp/a3b8.gguf --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch
from ferrobatch import Engine, SamplingParams
from ferrobatch.gguf import experts as moe
from ferrobatch.gguf.reader import GGUFFile


def bytes_a_token(path: str) -> float:
    """Quantized bytes one decode step reads: all matrices but the token embedding, the
    experts' tensors scaled by expert_used_count / expert_count."""
    f = GGUFFile(path)
    arch = f.architecture
    share = f.metadata[f"{arch}.expert_used_count"] / f.metadata[f"{arch}.expert_count"]
    total = 0.0
    for t in f.tensors.values():
        if t.name == "token_embd.weight" or len(t.shape) < 2:
            continue
        total += t.nbytes * (share if "_exps." in t.name else 1.0)
    return total


def read_bandwidth() -> float:
    """GB/s of torch's sum over a 1 GiB array on this process's threads (best of 5)."""
    t = torch.ones(1 << 27, dtype=torch.float64)
    t.sum()
    best = min(_timed(t.sum) for _ in range(5))
    return t.numel() * 8 / best / 1e9


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU-second) of one `generate`."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0)
    c0, t0 = time.process_time(), time.perf_counter()
    outs = engine.generate(prompts, params, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / wall, tokens / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(args.gguf)
    rng = np.random.default_rng(0)
    vocab = engine.model.config.vocab_size
    single = [[int(t) for t in rng.integers(100, vocab, 24)]]
    batch = [[int(t) for t in rng.integers(100, vocab, 24)] for _ in range(args.batch)]
    run(engine, single, 4)
    results: dict[str, dict[str, list[tuple[float, float]]]] = {
        arm: {"single": [], "batch": []} for arm in ("one call", "per expert")}
    for r in range(args.repeats):
        arms = ("one call", "per expert") if r % 2 == 0 else ("per expert", "one call")
        for arm in arms:
            moe.ONE_CALL = arm == "one call"
            results[arm]["single"].append(run(engine, single, args.new))
            results[arm]["batch"].append(run(engine, batch, args.new))
    moe.ONE_CALL = True
    engine.close()
    gb = bytes_a_token(args.gguf) / 1e9
    bw = read_bandwidth()
    print(f"{args.gguf}: {gb:.3f} GB read a token; read bandwidth {bw:.1f} GB/s "
          f"({args.threads} thread(s)); medians of {args.repeats}")
    print("| experts | single stream tok/s (per CPU-s) | share of the bandwidth limit | "
          f"{args.batch} x {args.new} tok/s (per CPU-s) |")
    print("|---|---|---|---|")
    for arm, res in results.items():
        s_wall = statistics.median(w for w, _ in res["single"])
        s_cpu = statistics.median(c for _, c in res["single"])
        b_wall = statistics.median(w for w, _ in res["batch"])
        b_cpu = statistics.median(c for _, c in res["batch"])
        print(f"| {arm} | {s_wall:.1f} ({s_cpu:.1f}) | {s_wall * gb / bw:.0%} | "
              f"{b_wall:.1f} ({b_cpu:.1f}) |")


if __name__ == "__main__":
    main()
