"""Single-stream decode alone, ferrobatch against ``llama-bench`` tg128, alternated round by
round on the same cores: on a host whose speed drifts by 10-20% within minutes (shared VMs)
the full driver's three repeats, minutes apart, can land either side of a target; this
check takes one ~10 s measurement of each engine per round, so every round's ratio sees
the same host.

    export LLAMACPP_BIN=/path/to/llama.cpp/build/bin
    .venv/bin/python benches/peers/llamacpp_single.py --gguf model.gguf --threads 2 --pin 0-1

Prints each round (ferrobatch first on even rounds) and the medians: ferrobatch's tokens
per second of one ``generate`` of 128 tokens after ``CODE_PROMPT`` (greedy, EOS ignored,
prefix caching off), and ``llama-bench -p 0 -n 128 -r 1``'s average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "benches" / "peers"))

# ferrobatch first: it sets its OpenMP wait policy before torch loads the runtime
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402, I001
import compare_cpu  # noqa: E402
import llamacpp_tools as lt  # noqa: E402
import torch  # noqa: E402
from llamacpp_compare import CODE_PROMPT, cpu_name, cpus_of, engine_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    engine_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    cpus = cpus_of(args)
    bins = lt.bin_dir(args.llamacpp_bin)
    compare_cpu.pin_self(cpus)
    torch.set_num_threads(args.threads)
    print(f"CPU {cpu_name()}; cores {cpus}; {args.threads} thread(s); load "
          f"{os.getloadavg()}", flush=True)
    engine = Engine(args.gguf, config=ContinuousBatchingConfig(allow_block_sharing=False))
    prompt = [engine.tokenizer(CODE_PROMPT).input_ids]
    params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    engine.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), progress=False)
    ours: list[float] = []
    theirs: list[float] = []
    for r in range(args.rounds):
        for side in ("ferrobatch", "llama") if r % 2 == 0 else ("llama", "ferrobatch"):
            if side == "ferrobatch":
                start = time.perf_counter()
                out = engine.generate(prompt, params, progress=False)[0]
                ours.append(len(out.token_ids) / (time.perf_counter() - start))
            else:
                theirs.append(lt.llama_bench(bins, args.gguf, cpus, args.threads, 0,
                                             args.new)["tg"])
        print(f"round {r}: ferrobatch {ours[-1]:.2f} tok/s, llama-bench tg{args.new} "
              f"{theirs[-1]:.2f} ({ours[-1] / theirs[-1]:.2f}x)", flush=True)
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    print(f"medians of {args.rounds}: ferrobatch {statistics.median(ours):.2f} tok/s, "
          f"llama-bench {statistics.median(theirs):.2f}; median ratio "
          f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}); "
          f"load {os.getloadavg()[0]:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
