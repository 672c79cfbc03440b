"""Benchmark: one steady-state decode step through the Python bindings (crossing included).

A step is `plan = sched.schedule()` + `sched.update(tokens)` with `tokens` an int32 numpy array
of one token per sampled row, N requests all decoding (prefilled before timing, max_new_tokens
large enough that none finishes while timed). Reports the median over several repeats of the
mean step time of a repeat, in microseconds. Target: <= 25 us at N = 1024.

    python benches/step_bindings.py [--ns 64,256,1024,4096] [--steps 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from ferrobatch.core import Scheduler  # noqa: E402

PROMPT_LEN = 32


def make(n: int, steps_total: int, page_size: int, sharing: bool) -> Scheduler:
    blocks_per_req = -(-(PROMPT_LEN + steps_total + 2) // page_size) + 1
    s = Scheduler(
        n * blocks_per_req + 16,
        page_size,
        max(n, 8192),
        max_requests_per_batch=n,
        scheduler_type="fifo",
        safety_margin=0.0,
        allow_block_sharing=sharing,
    )
    for i in range(n):
        # distinct prompts (no prefix hits): ids from a simple per-request pattern
        s.add_request(f"req-{i}", [(i * 31 + j) % 30000 + 3 for j in range(PROMPT_LEN)],
                      steps_total + 8)
    # prefill everything (several steps if the token budget is smaller than N * PROMPT_LEN)
    while True:
        plan = s.schedule()
        assert plan is not None
        n_sampled = len(plan.logits_indices)
        s.update(np.full(n_sampled, 7, dtype=np.int32))
        st = s.stats()
        if st["waiting"] == 0 and n_sampled == n and len(plan.input_ids) == n:
            break
    return s


def bench(n: int, steps: int, repeats: int, page_size: int, sharing: bool) -> list[float]:
    warmup = 20
    s = make(n, warmup + steps * repeats, page_size, sharing)
    toks = np.full(n, 7, dtype=np.int32)
    for _ in range(warmup):
        s.schedule()
        s.update(toks)
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            plan = s.schedule()
            s.update(toks)
        dt = time.perf_counter() - t0
        per_step.append(dt / steps * 1e6)
        assert len(plan.logits_indices) == n, "every request must still be decoding"
    s.check_invariants()
    return per_step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="64,256,1024,4096")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--no-sharing", action="store_true", help="allow_block_sharing=False")
    args = ap.parse_args(argv)
    print(f"decode step (schedule + update) through ferrobatch._core, page_size="
          f"{args.page_size}, prefix sharing {'off' if args.no_sharing else 'on'}")
    print(f"{'N':>6} {'median us/step':>15} {'min':>9} {'max':>9}   us/request")
    for n in (int(x) for x in args.ns.split(",")):
        steps = max(20, args.steps * 256 // max(n, 256))
        ts = bench(n, steps, args.repeats, args.page_size, not args.no_sharing)
        med = statistics.median(ts)
        print(f"{n:>6} {med:>15.2f} {min(ts):>9.2f} {max(ts):>9.2f}   {med / n:.4f}",
              flush=True)


if __name__ == "__main__":
    main()
