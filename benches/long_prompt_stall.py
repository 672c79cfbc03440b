"""A long prompt arriving while streams run, and a short request during its prefill: the
running streams' inter-token gaps, the short request's and the long prompt's time to first
token, and the engine's step times, with the step-time budget (`max_step_ms`) on and off.

Per trial (a fresh engine, the bundled SmolLM2-135M-Instruct unless `--model`, fp32,
greedy, `torch.set_num_threads(--threads)`): `--streams` chat streams start (EOS ignored,
long outputs) and run a few tokens; then a `--long`-token prompt arrives (random token ids,
1 new token), and `--short-after` seconds later a short chat request (`--short-tokens` new
tokens). Measured until the long prompt's first token: every gap between two deliveries of
a stream (p50 / p99 / max), the engine's step times (p50 / p99 / max, `take_step_records`),
the short request's TTFT, and the long prompt's TTFT. `--alone` also times the long prompt
with nothing else running (the budget does not bind then: a request alone prefills in
`max_batch_tokens` chunks). Configurations are interleaved trial by trial; medians over
`--repeats` are printed as JSON lines and a table, with the CPU and the thread count.
`--routes kernel,sdpa` also interleaves the attention route of prompt rows: the tiled CPU
prefill kernel (default) or gather + SDPA (`ModelRunner.prefill_kernel = False`).

    python benches/long_prompt_stall.py                                 # 250 ms vs off
    python benches/long_prompt_stall.py --budgets 150,250,500,off --repeats 3
    python benches/long_prompt_stall.py --model /path/to/q4_k_m.gguf --long 3000
    python benches/long_prompt_stall.py --budgets 500,off --alone --routes kernel,sdpa
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402
from ferrobatch.workloads import chat_prompts  # noqa: E402


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`, 0.0 when empty."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class Stream(threading.Thread):
    """Consume `engine.stream(...)`, stamping each delivery that carries tokens."""

    def __init__(self, engine: Engine, prompt: list[int], sp: SamplingParams) -> None:
        super().__init__(daemon=True)
        self.it = engine.stream(prompt, sp)
        self.submitted = time.perf_counter()
        self.stamps: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            for out in self.it:
                if out.token_ids:
                    self.stamps.append(time.perf_counter())
                if self.stop.is_set():
                    break
        finally:
            self.it.close()

    def first(self) -> float | None:
        """Seconds from submission to the first delivery."""
        return self.stamps[0] - self.submitted if self.stamps else None


def trial(args: argparse.Namespace, budget: float | None, prompts: list[list[int]],
          route: str = "kernel") -> dict:
    """One trial (see the module docs) with `max_step_ms=budget`, prompt rows on `route`."""
    cfg = ContinuousBatchingConfig(max_step_ms=budget, num_blocks=args.num_blocks)
    engine = Engine(args.model, config=cfg, dtype=args.dtype)
    engine.runner.prefill_kernel = route == "kernel"
    try:
        vocab = engine.runner.vocab_size
        gen = torch.Generator().manual_seed(7)
        # two different prompts: the second must not hit the first's prefix-cache blocks
        long_prompt, alone_prompt = (
            torch.randint(100, min(vocab, 30000), (args.long,), generator=gen).tolist()
            for _ in range(2)
        )
        engine.generate([prompts[0]], max_new_tokens=4, progress=False)  # warm the kernels
        out: dict[str, Any] = {"max_step_ms": budget, "route": route}
        if args.alone:
            t0 = time.perf_counter()
            engine.generate([alone_prompt], max_new_tokens=1, progress=False)
            out["long_ttft_alone_s"] = time.perf_counter() - t0
        long_sp = SamplingParams(max_new_tokens=1)
        stream_sp = SamplingParams(max_new_tokens=4000, ignore_eos=True)
        streams = [Stream(engine, prompts[1 + i], stream_sp) for i in range(args.streams)]
        for s in streams:
            s.start()
        while any(len(s.stamps) < 4 for s in streams):
            time.sleep(0.01)
        engine.take_step_records()
        t_long = time.perf_counter()
        long = Stream(engine, long_prompt, long_sp)
        long.start()
        time.sleep(args.short_after)
        short = Stream(engine, prompts[-1], SamplingParams(max_new_tokens=args.short_tokens))
        short.start()
        long.join()
        short.join()
        t_end = time.perf_counter()
        steps = [sec for sec, _ in engine.take_step_records()]
        for s in streams:
            s.stop.set()
        gaps = []
        for s in streams:
            ts = [t for t in s.stamps if t_long <= t <= t_end]
            before = [t for t in s.stamps if t < t_long]
            if before:
                ts = before[-1:] + ts
            gaps += [b - a for a, b in zip(ts, ts[1:], strict=False)]
        for s in streams:
            s.join(timeout=30)
        out.update(
            gap_p50_s=pct(gaps, 0.5), gap_p99_s=pct(gaps, 0.99), gap_max_s=max(gaps, default=0),
            step_p50_s=pct(steps, 0.5), step_p99_s=pct(steps, 0.99),
            step_max_s=max(steps, default=0), steps=len(steps),
            short_ttft_s=short.first(), long_ttft_s=long.first(),
            cost={k: round(v, 4) for k, v in engine.stats().items() if k.startswith("cost_")},
        )  # fmt: skip
        return out
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint / GGUF path (default: bundled)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budgets", default="250,off", help="max_step_ms values; 'off' = None")
    p.add_argument("--long", type=int, default=6000, help="long prompt tokens")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--short-after", type=float, default=1.0, help="seconds after the long one")
    p.add_argument("--short-tokens", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--alone", action="store_true", help="also time the long prompt alone")
    p.add_argument("--routes", default="kernel",
                   help="prompt rows' attention: kernel (prefill kernel), sdpa (gather + SDPA)")
    args = p.parse_args()
    routes = args.routes.split(",")
    if not set(routes) <= {"kernel", "sdpa"}:
        p.error("--routes: kernel and/or sdpa")
    torch.set_num_threads(args.threads)
    budgets = [None if b == "off" else float(b) for b in args.budgets.split(",")]
    engine_tok = Engine(args.model, config=ContinuousBatchingConfig(num_blocks=64))
    tok = engine_tok.tokenizer

    def encode(messages: list[dict[str, str]]) -> list[int]:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return ids["input_ids"] if hasattr(ids, "keys") else ids

    prompts = chat_prompts(encode, max(8, args.streams + 2))
    engine_tok.close()
    print(f"# CPU: {cpu_name()}; torch threads: {args.threads}; long prompt {args.long} "
          f"tokens, {args.streams} stream(s), short request {args.short_after}s later",
          flush=True)  # fmt: skip
    results: dict[str, list[dict]] = {f"{b} {r}": [] for b in budgets for r in routes}
    for rep in range(args.repeats):
        for b in budgets:
            for route in routes:
                r = trial(args, b, prompts, route)
                r["repeat"] = rep
                print(json.dumps(r), flush=True)
                results[f"{b} {route}"].append(r)
    keys = ("gap_p50_s", "gap_p99_s", "gap_max_s", "step_p50_s", "step_p99_s", "step_max_s",
            "short_ttft_s", "long_ttft_s") + (("long_ttft_alone_s",) if args.alone else ())
    print("| max_step_ms route | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for b, rs in results.items():
        med = [statistics.median(r[k] for r in rs if r[k] is not None) for k in keys]
        print(f"| {b} | " + " | ".join(f"{v:.3f}" for v in med) + " |")


if __name__ == "__main__":
    main()
