"""The in-place CPU decode attention kernel against the gather + SDPA path, same engine.

One engine, its runner's ``decode_kernel`` switched on and off between interleaved repeats
of the same workload (64 prompts x 64 new tokens, greedy, EOS off; a fresh token appended
to every prompt per repeat, though a prompt's full blocks are still reused from the repeat
before, so the figures are mostly decode); medians of 3 in generated tokens per
second of wall time and per CPU-second.

    python benches/decode_kernel_ab.py tiny-llama bfloat16 1     # workload, dtype, threads
    python benches/decode_kernel_ab.py smollm2 bfloat16 1
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]
                                                               / "python")]

import ferrobatch  # noqa: E402,F401 - before torch: OpenMP's wait policy
import torch  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402


def main() -> None:
    defaults = ["tiny-llama", "bfloat16", "1"]
    workload, dtype, threads = (sys.argv[1:] + defaults[len(sys.argv) - 1:])[:3]
    torch.set_num_threads(int(threads))
    import e2e_cpu  # (after ferrobatch: it imports torch)

    model, prompts = e2e_cpu.ab_workload(workload, getattr(torch, dtype))
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
    engine = Engine(model, config=ContinuousBatchingConfig(num_blocks=2048))
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for rep in range(3):
        for kernel in (True, False):
            engine.runner.decode_kernel = kernel
            t, c = time.perf_counter(), time.process_time()
            outs = engine.generate([p + [3 + rep] for p in prompts], sp, progress=False)
            n = sum(len(o.token_ids) for o in outs)
            runs[kernel].append((n / (time.perf_counter() - t), n / (time.process_time() - c)))
    for kernel, got in runs.items():
        wall = sorted(w for w, _ in got)[1]
        cpu = sorted(c for _, c in got)[1]
        print(f"{workload} {dtype} threads={threads} {'kernel' if kernel else 'gather+SDPA'}: "
              f"{wall:.0f} tok/s wall, {cpu:.0f} tok per CPU-second")
    engine.close()


if __name__ == "__main__":
    main()
