"""Batch-invariant mode against the default, same model, same workload, interleaved: throughput
(medians of generated tokens per second of wall time and per CPU-second) at each thread count,
and each mode's greedy agreement with the fp32 reference (ferrobatch in fp32, whose greedy
tokens are `model.generate`'s).

The workload: 64 prompts x 64 new tokens, greedy, EOS off, prefix caching off (every repeat
prefills every prompt in full), the thread governor off (each run on exactly the threads
asked); "smollm2" (the bundled SmolLM2-135M-Instruct's chat prompts) or "tiny-llama"
(benches/e2e_cpu.py's), or a GGUF / checkpoint path (its chat template on the same chat
questions; `--prompts` / `--new` shrink it for a large model).

    python benches/batch_invariant.py smollm2 --dtype bfloat16 --threads 1 2 --repeats 3
    python benches/batch_invariant.py /path/model.gguf --dtype float32 --threads 1 2 \\
        --prompts 16 --new 32 --no-agreement
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "python")]

import ferrobatch  # noqa: E402,F401 - before torch: OpenMP's wait policy
import torch  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402
from ferrobatch.workloads import agreement, chat_prompts  # noqa: E402

MODES = ("default", "batch_invariant")


def _workload(name: str, dtype: torch.dtype, prompts: int) -> tuple[Any, list[list[int]]]:
    """(model or path, prompts)."""
    import e2e_cpu  # local: it imports torch and transformers (after ferrobatch)

    if name in ("smollm2", "tiny-llama"):
        model, ids = e2e_cpu.ab_workload(name, dtype)
        return model, ids[:prompts]
    return name, []


def _engine(model: Any, dtype: str, invariant: bool) -> Engine:
    cfg = ContinuousBatchingConfig(allow_block_sharing=False, adaptive_threads=False,
                                   batch_invariant=invariant)
    return Engine(model, config=cfg, dtype=dtype)


def _chat_ids(engine: Engine, n: int) -> list[list[int]]:
    return chat_prompts(engine.encode_chat, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", help="smollm2, tiny-llama, or a model path")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--no-agreement", action="store_true",
                    help="skip the fp32 reference and the agreement figures")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, prompts = _workload(args.workload, dtype, args.prompts)
    engines = {m: _engine(model, args.dtype, m == "batch_invariant") for m in MODES}
    if not prompts:
        prompts = _chat_ids(engines["default"], args.prompts)
    sp = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    result: dict[str, Any] = {"cpu": _cpu(), "workload": args.workload, "dtype": args.dtype,
                              "prompts": len(prompts), "new": args.new, "runs": {}}
    tokens: dict[str, list[list[int]]] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for mode in MODES:  # warm-up
            tokens[mode] = [o.token_ids for o in engines[mode].generate(prompts, sp,
                                                                        progress=False)]
        for _ in range(args.repeats):
            for mode in MODES:
                t, c = time.perf_counter(), time.process_time()
                outs = engines[mode].generate(prompts, sp, progress=False)
                n = sum(len(o.token_ids) for o in outs)
                runs[mode].append((n / (time.perf_counter() - t), n / (time.process_time() - c)))
        for mode, got in runs.items():
            wall = statistics.median(w for w, _ in got)
            cpu = statistics.median(c for _, c in got)
            result["runs"][f"{mode}@{threads}"] = {"wall": wall, "cpu": cpu, "all": got}
            print(f"{args.workload} {args.dtype} threads={threads} {mode}: {wall:.0f} tok/s "
                  f"wall, {cpu:.0f} tok per CPU-second (wall: "
                  f"{', '.join(f'{w:.0f}' for w, _ in got)})", flush=True)
        d = result["runs"][f"default@{threads}"]
        b = result["runs"][f"batch_invariant@{threads}"]
        print(f"  batch_invariant / default: {b['wall'] / d['wall']:.3f} wall, "
              f"{b['cpu'] / d['cpu']:.3f} per CPU-second", flush=True)
    for engine in engines.values():
        engine.close()
    if not args.no_agreement:
        torch.set_num_threads(max(args.threads))
        with _engine(model if not isinstance(model, torch.nn.Module) else model.float(),
                     "float32", False) as ref_engine:
            ref = [o.token_ids for o in ref_engine.generate(prompts, sp, progress=False)]
        for mode in MODES:
            agree = agreement(tokens[mode], ref)
            result[f"agreement_{mode}"] = agree
            print(f"{mode}: {agree['requests']:.1%} of requests equal the fp32 reference "
                  f"({agree['tokens']:.1%} of tokens before the first divergence)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
