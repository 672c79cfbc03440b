"""Batch-invariant mode against the default, same model, same workload, interleaved: throughput
(medians of generated tokens per second of wall time and per CPU-second) at each thread count,
and each mode's greedy agreement with the fp32 reference (ferrobatch in fp32, whose greedy
tokens are `model.generate`'s): free-running (the share of whole requests, and of tokens
before the first divergence) and teacher-forced (each mode scoring the reference's own
continuations as prompt tokens: how often its top token is the reference's next token, and
the mean |difference| of that token's log-probability from the reference's; tens of
thousands of positions, so it separates the modes' accuracy where whole-request counts,
decided by a few near-ties, cannot).

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
import copy
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
        return e2e_cpu.ab_workload(name, dtype, prompts)
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
    if not args.no_agreement:
        torch.set_num_threads(max(args.threads))
        fp32 = model if not isinstance(model, torch.nn.Module) else copy.deepcopy(model).float()
        with _engine(fp32, "float32", False) as ref_engine:
            ref = [o.token_ids for o in ref_engine.generate(prompts, sp, progress=False)]
            ref_lp = _forced(ref_engine, prompts, ref)
        for mode in MODES:
            agree = agreement(tokens[mode], ref)
            agree.update(_forced_agreement(_forced(engines[mode], prompts, ref), ref_lp,
                                           prompts, ref))
            result[f"agreement_{mode}"] = agree
            print(f"{mode}: {agree['requests']:.1%} of requests equal the fp32 reference "
                  f"({agree['tokens']:.1%} of tokens before the first divergence); "
                  f"teacher-forced: top-1 {agree['forced_top1']:.2%}, mean |d logprob| "
                  f"{agree['forced_dlogprob']:.5f}")
    for engine in engines.values():
        engine.close()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def _forced(engine: Engine, prompts: list[list[int]],
            ref: list[list[int]]) -> list[list[dict[int, float] | None]]:
    """`engine`'s prompt log-probabilities (top-1 plus the token's) of each prompt followed
    by the reference's continuation."""
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logprobs=1)
    outs = engine.generate([p + r for p, r in zip(prompts, ref, strict=True)], sp,
                           progress=False)
    return [o.prompt_logprobs or [] for o in outs]


def _forced_agreement(got: list, ref_lp: list, prompts: list[list[int]],
                      ref: list[list[int]]) -> dict[str, float]:
    """Over the reference's continuation positions: the share where `got`'s top token is the
    reference's token, and the mean |difference| of that token's log-probability."""
    top1 = n = 0
    dlp = 0.0
    for p, r, lp, base in zip(prompts, ref, got, ref_lp, strict=True):
        for j, token in enumerate(r, start=len(p)):
            here, there = lp[j], base[j]
            if here is None or there is None:
                continue
            top1 += max(here, key=here.__getitem__) == token
            dlp += abs(here[token] - there[token])
            n += 1
    return {"forced_top1": top1 / max(1, n), "forced_dlogprob": dlp / max(1, n),
            "forced_positions": n}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
