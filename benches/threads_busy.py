"""CPU threads on an idle and on a busy machine: the wait policy and the thread governor.

Each case runs the SmolLM2-135M bf16 chat workload (64 prompts x 64 new tokens, greedy, EOS
off; `e2e_cpu.smollm2_prompts`) in a fresh process (the OpenMP wait settings only take
effect before torch loads), pinned to `--cpus`, while `busy` processes spin
(`while True: pass`) on the same cores. Reported: wall and CPU seconds of `generate`,
median of `--repeats`, and the thread count the engine ended on.

Cases: ferrobatch's defaults (`GOMP_SPINCOUNT=30000`, `adaptive_threads=True`) at 2 threads;
the same without the governor; the old passive policy without the governor; 1 thread. Each
with 0, 1 and 2 busy processes.

    .venv/bin/python benches/threads_busy.py --repeats 3
    .venv/bin/python benches/threads_busy.py --busy 1 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "default (spin 30000 + governor)": ({}, 2, True),
    "no governor": ({}, 2, False),
    "old passive, no governor": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2, False),
    "1 thread": ({}, 1, True),
}

CHILD = """
import json, sys, time
import ferrobatch  # before torch: its OpenMP settings
import torch
from transformers import AutoTokenizer
sys.path.insert(0, {benches!r})
import e2e_cpu
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.models import bundled_model_dir
torch.set_num_threads({threads})
d = bundled_model_dir()
prompts = e2e_cpu.smollm2_prompts(AutoTokenizer.from_pretrained(str(d)), 64)
eng = Engine(str(d), dtype=torch.bfloat16,
             config=ContinuousBatchingConfig(adaptive_threads={adaptive}))
eng.generate([p[::-1] for p in prompts[:8]], SamplingParams(max_new_tokens=4, ignore_eos=True),
             progress=False)
c0, t0 = time.process_time(), time.perf_counter()
eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True), progress=False)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({{"wall": wall, "cpu": cpu, "threads_at_end": torch.get_num_threads()}}))
"""


def run_case(env: dict[str, str], threads: int, adaptive: bool, busy: int,
             cpus: list[int]) -> dict[str, float]:
    """One timed generate in a fresh process beside `busy` spinning processes."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        for p in spinners:
            os.sched_setaffinity(p.pid, cpus)
        child_env = {k: v for k, v in os.environ.items()
                     if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        child_env.update(env, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "python"))
        code = CHILD.format(benches=str(ROOT / "benches"), threads=threads, adaptive=adaptive)
        done = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                              text=True, timeout=600,
                              preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", default="0,1", help="cores for the run and the busy processes")
    ap.add_argument("--busy", type=int, nargs="*", default=[0, 1, 2],
                    help="numbers of busy processes to try (default 0 1 2)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    cpus = [int(c) for c in args.cpus.split(",")]
    results = []
    for busy in args.busy:
        for label, (env, threads, adaptive) in CASES.items():
            runs = [run_case(env, threads, adaptive, busy, cpus) for _ in range(args.repeats)]
            wall = statistics.median(r["wall"] for r in runs)
            cpu = statistics.median(r["cpu"] for r in runs)
            ended = runs[-1]["threads_at_end"]
            print(f"busy={busy}  {label:34s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  "
                  f"threads at the end {ended}", flush=True)
            results.append({"busy": busy, "case": label, "wall_s": wall, "cpu_s": cpu,
                            "threads_at_end": ended, "runs": runs})
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
