"""In-batch prefix sharing (`ContinuousBatchingConfig.defer_shared_prefixes`) on and off,
same model and prompts, fresh engines, interleaved repeats (64 prompts x 64 new tokens,
greedy, EOS off, prefix caching on): medians of generated tokens per second of wall time
and per CPU-second, the prompt tokens served as prefix hits, and whether both gave the same
tokens.

    python benches/defer_ab.py smollm2 bfloat16 1 3     # workload, dtype, threads, repeats
    python benches/defer_ab.py smollm2 float32 1 3 16   # ... and page_size
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]
                                                               / "python")]

import ferrobatch  # noqa: E402,F401 - before torch: OpenMP's wait policy
import torch  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402


def main() -> None:
    args = sys.argv[1:] + ["smollm2", "bfloat16", "1", "3", "32"][len(sys.argv) - 1:]
    workload, dtype, threads, repeats, page = (args[0], args[1], int(args[2]), int(args[3]),
                                               int(args[4]))
    torch.set_num_threads(threads)
    import e2e_cpu  # (after ferrobatch: it imports torch)

    model, prompts = e2e_cpu.ab_workload(workload, getattr(torch, dtype))
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    tokens: dict[bool, list] = {}
    hits: dict[bool, tuple[int, int, int]] = {}
    for rep in range(repeats):
        for defer in (True, False):
            cfg = ContinuousBatchingConfig(page_size=page, defer_shared_prefixes=defer)
            with Engine(model, config=cfg) as engine:
                # warm-up on tokens the workload never starts with (no cache hits carried)
                warm = [[7 + i] * 40 for i in range(4)]
                engine.generate(warm, SamplingParams(max_new_tokens=2), progress=False)
                before = engine.scheduler.stats()
                t, c = time.perf_counter(), time.process_time()
                outs = engine.generate(prompts, sp, progress=False)
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                st = engine.scheduler.stats()
            n = sum(len(o.token_ids) for o in outs)
            runs[defer].append((n / wall, n / cpu))
            hits[defer] = (st["prefix_hit_tokens"] - before["prefix_hit_tokens"],
                           st["prompt_tokens"] - before["prompt_tokens"],
                           st["deferred_admissions"] - before["deferred_admissions"])
            if rep == 0:
                tokens[defer] = [o.token_ids for o in outs]
    for defer, got in runs.items():
        wall = statistics.median(w for w, _ in got)
        cpu = statistics.median(c for _, c in got)
        h, p, d = hits[defer]
        print(f"{workload} {dtype} threads={threads} page={page} defer={defer}: {wall:.0f} tok/s "
              f"wall, {cpu:.0f} tok per CPU-second (wall: {', '.join(f'{w:.0f}' for w, _ in got)}"
              f"); prefix hits {h} of {p} prompt tokens, {d} put off")
    ratios = [a[0] / b[0] for a, b in zip(runs[True], runs[False], strict=True)]
    print("pairwise wall ratios on/off:", ", ".join(f"{r:.2f}" for r in ratios),
          f"(median {statistics.median(ratios):.2f})")
    print("same tokens:", tokens[True] == tokens[False])


if __name__ == "__main__":
    main()
