"""Benchmark: one steady-state decode step through the Python bindings (crossing included).

A step is `plan = sched.schedule()` + `sched.update(tokens)` with `tokens` an int32 numpy array
of one token per sampled row, N requests all decoding (prefilled before timing, max_new_tokens
large enough that none finishes while timed). Each repeat builds a fresh scheduler (128-token
prompts, page_size 32, contexts ~128-400 tokens while timed, as in benches/scheduler.rs) and
times `--steps` steps; reported: the median over repeats of the mean step time, in
microseconds (wall clock; "cpu" = process CPU time per step, less sensitive to other load on a
shared machine). Target: <= 25 us at N = 1024.

    python benches/step_bindings.py [--ns 64,256,1024,4096] [--steps 256] [--repeats 7]
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

PROMPT_LEN = 128


def make(n: int, steps: int, page_size: int, sharing: bool) -> Scheduler:
    """N distinct 128-token prompts, all prefilled and decoding, none finishing within
    `steps` more steps (max_new_tokens is twice what the run can reach)."""
    max_new = 2 * steps + 64
    blocks_per_req = -(-(PROMPT_LEN + max_new) // page_size) + 1
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
        s.add_request(f"req-{i}", [(i * 131 + j * 7) % 30000 + 3 for j in range(PROMPT_LEN)],
                      max_new)
    # prefill everything (several steps: the token budget is smaller than N * PROMPT_LEN)
    while True:
        plan = s.schedule()
        assert plan is not None
        n_sampled = len(plan.logits_indices)
        s.update(np.full(n_sampled, 7, dtype=np.int32))
        if n_sampled == n and len(plan.input_ids) == n:
            return s


def bench(n: int, steps: int, repeats: int, page_size: int, sharing: bool) -> list[float]:
    """Each repeat: a fresh scheduler (not timed), 8 warm-up steps, then `steps` timed steps
    (contexts grow from ~128 to ~128 + steps + prefill steps tokens)."""
    toks = np.full(n, 7, dtype=np.int32)
    per_step = []
    cpu_per_step = []
    for _ in range(repeats):
        s = make(n, steps + 8, page_size, sharing)
        for _ in range(8):
            s.schedule()
            s.update(toks)
        c0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(steps):
            plan = s.schedule()
            s.update(toks)
        dt = time.perf_counter() - t0
        dc = time.process_time() - c0
        per_step.append(dt / steps * 1e6)
        cpu_per_step.append(dc / steps * 1e6)
        assert len(plan.logits_indices) == n, "every request must still be decoding"
        st = s.stats()
        assert st["num_soft_resets"] + st["num_offloads"] == 0 and st["running"] == n
        s.check_invariants()
    return per_step, cpu_per_step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="64,256,1024,4096")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--no-sharing", action="store_true", help="allow_block_sharing=False")
    args = ap.parse_args(argv)
    print(f"decode step (schedule + update) through ferrobatch._core, page_size="
          f"{args.page_size}, prefix sharing {'off' if args.no_sharing else 'on'}")
    print(f"{'N':>6} {'median us/step':>15} {'min':>9} {'max':>9} {'cpu us/step':>12}   "
          "us/request")
    for n in (int(x) for x in args.ns.split(",")):
        ts, cpu = bench(n, args.steps, args.repeats, args.page_size, not args.no_sharing)
        med = statistics.median(ts)
        print(f"{n:>6} {med:>15.2f} {min(ts):>9.2f} {max(ts):>9.2f} "
              f"{statistics.median(cpu):>12.2f}   {med / n:.4f}", flush=True)

if __name__ == "__main__":
    main()
