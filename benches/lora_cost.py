"""What LoRA costs: the same workload on an engine without adapters, on one with adapters
loaded whose requests use none, and with every request on an adapter (half on each of two).

A random PEFT adapter (rank `--rank` on every attention and MLP projection) is made for the
model; three engines share the model and run the workload's prompts x `--new` greedy tokens
(EOS off), interleaved, `--repeats` timed runs after a warm-up; medians of generated tokens
per second of wall time and per CPU-second.

    python benches/lora_cost.py smollm2 --dtype bfloat16 --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]
                                                               / "python")]

import ferrobatch  # noqa: E402,F401 - before torch: OpenMP's wait policy
import torch  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model: Any, path: str, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter for `model`, saved to `path`."""
    import peft  # local: a test / bench dependency only

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                          init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(model).float(), cfg).save_pretrained(path)


def timed(engine: Engine, prompts: list[list[int]],
          sps: list[SamplingParams]) -> tuple[float, float]:
    """(generated tokens per wall second, per CPU-second) of one run."""
    w0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, sps, progress=False)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = sum(len(o.token_ids) for o in outs)
    return n / wall, n / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=("smollm2", "tiny-llama"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import e2e_cpu  # (after ferrobatch: it imports torch)

    model, prompts = e2e_cpu.ab_workload(args.workload, getattr(torch, args.dtype))
    prompts = prompts[: args.prompts]
    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    paths = {name: f"{tmp}/{name}" for name in ("a", "b")}
    for i, path in enumerate(paths.values()):
        make_adapter(model, path, args.rank, seed=i)
    cfg = ContinuousBatchingConfig(allow_block_sharing=False, adaptive_threads=False)
    plain = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    runs = {
        "no adapters": (Engine(model, config=cfg), [plain] * len(prompts)),
        "adapters loaded, unused": (Engine(model, config=cfg, lora_modules=paths),
                                    [plain] * len(prompts)),
        "every request on an adapter": (
            Engine(model, config=cfg, lora_modules=paths),
            [SamplingParams(max_new_tokens=args.new, ignore_eos=True, lora="ab"[i % 2])
             for i in range(len(prompts))]),
    }
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for engine, sps in runs.values():  # warm-up
        engine.generate(prompts[:4], sps[:4], progress=False)
    for _ in range(args.repeats):
        for name, (engine, sps) in runs.items():
            results[name].append(timed(engine, prompts, sps))
    base_wall = statistics.median(w for w, _ in results["no adapters"])
    base_cpu = statistics.median(c for _, c in results["no adapters"])
    print(f"{args.workload} {args.dtype}, {len(prompts)} x {args.new}, rank {args.rank}, "
          f"{args.threads} thread(s), medians of {args.repeats}")
    for name, rs in results.items():
        wall = statistics.median(w for w, _ in rs)
        cpu = statistics.median(c for _, c in rs)
        print(f"  {name:30s} {wall:7.1f} tok/s ({wall / base_wall:.2f}x)  "
              f"{cpu:7.1f} tok/CPU-s ({cpu / base_cpu:.2f}x)")
    for engine, _ in runs.values():
        engine.close()


if __name__ == "__main__":
    main()
