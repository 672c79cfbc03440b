"""Prompt rows on the tiled CPU prefill kernel against gather + SDPA, same engine.

One engine (the bundled SmolLM2-135M-Instruct, `max_step_ms` off, prompts chunked by
`max_batch_tokens`), its runner's ``prefill_kernel`` switched on and off between
interleaved repeats of one long prompt alone (fresh random ids each time, so no prefix
hits; 1 new token): the prompt's time to first token, medians over the repeats, in
seconds of wall time and prompt tokens per CPU-second.

    python benches/prefill_route_ab.py 1 128 4096 3 float32  # threads chunk tokens reps dtype
    python benches/prefill_route_ab.py 1 2048 4096 3 bfloat16
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import ferrobatch  # noqa: E402,F401 - before torch: OpenMP's wait policy
import torch  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine  # noqa: E402


def main() -> None:
    defaults = ["1", "128", "4096", "3", "float32"]
    threads, chunk, n, reps, dtype = (sys.argv[1:] + defaults[len(sys.argv) - 1:])[:5]
    torch.set_num_threads(int(threads))
    n = int(n)
    cfg = ContinuousBatchingConfig(max_batch_tokens=int(chunk), num_blocks=2 * n // 16 + 64,
                                   max_step_ms=None)
    engine = Engine(None, config=cfg, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    engine.generate([[5, 6, 7, 8]], max_new_tokens=2, progress=False)  # warm up
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(int(reps)):
        for kernel in (True, False):
            engine.runner.prefill_kernel = kernel
            prompt = torch.randint(100, 30000, (n,), generator=gen).tolist()
            t, c = time.perf_counter(), time.process_time()
            engine.generate([prompt], max_new_tokens=1, progress=False)
            runs[kernel].append((time.perf_counter() - t, time.process_time() - c))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    print(f"# {cpu}; torch threads {threads}; {n}-token prompt in chunks of {chunk}, {dtype}")
    for kernel, got in runs.items():
        wall = statistics.median(w for w, _ in got)
        cpu_s = statistics.median(c for _, c in got)
        print(f"{'prefill kernel' if kernel else 'gather+SDPA'}: TTFT {wall:.2f} s wall, "
              f"{cpu_s:.2f} CPU-s, {n / cpu_s:.0f} prompt tok per CPU-second")
    engine.close()


if __name__ == "__main__":
    main()
