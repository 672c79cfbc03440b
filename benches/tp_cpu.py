"""Tensor parallelism on CPU: TP=2 (gloo, one torch thread per rank) against TP=1 with two
torch threads: the same two cores, so the difference is what splitting the model costs
(two all-reduces per layer, the step's plan broadcast, the head computed on every rank).

Workloads: tiny-llama (a random-init Llama: hidden 256, 4 layers, 4/2 heads, vocab
32000, fp32; 64 prompts of 16..256 tokens from ``random.Random(1234)``, 64 new tokens,
greedy, EOS off) and, with ``--smollm2``, the bundled SmolLM2-135M-Instruct (fp32) on chat
prompts (SmolLM2-135M has 9 attention heads: TP=2 refuses it, and the bench says so).
Both engines are built once (prefix caching off, so repeats do not hit each
other's blocks) and timed interleaved, ``--repeats`` times each (after one warm-up); the
median is reported as generated tokens per wall second and per CPU second (all ranks'
processes), with ms per step. Outputs of the two are compared (greedy, fp32: identical).

    python benches/tp_cpu.py                 # tiny-llama workload
    python benches/tp_cpu.py --smollm2       # SmolLM2-135M
    python benches/tp_cpu.py --hidden 1024 --prompts 16 --new 32   # a wider model
    python benches/tp_cpu.py --gguf FILE --prompts 8 --new 32      # a GGUF file (quantized)
    python benches/tp_cpu.py --gguf FILE --rss 2   # TP=2 alone: every rank's RSS

With ``--gguf`` the prompts are the tiny-llama workload's token ids (every id is below
32000); ``--rss N`` builds the TP=N setup alone, generates once and prints each rank's resident
memory (VmRSS) and peak (VmHWM) instead of timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402, I001
from ferrobatch.errors import FieldError  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from ferrobatch.workloads import tiny_llama_model, tiny_llama_prompts, chat_prompts  # noqa: E402

transformers.logging.set_verbosity_error()


def _proc_cpu(pid: int) -> float:
    """utime + stime of a process (seconds), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(pid: int, key: str) -> str:
    """A /proc/PID/status field in MiB ("VmRSS", "VmHWM")."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return f"{int(line.split()[1]) / 1024:.0f} MiB"
    return "?"


def _cpu(engine: Engine) -> float:
    tp = getattr(engine, "tp", None)
    workers = [p.pid for p in tp.procs] if tp is not None else []
    return time.process_time() + sum(_proc_cpu(pid) for pid in workers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", action="store_true")
    ap.add_argument("--gguf", type=Path, default=None, help="a GGUF file (quantized model)")
    ap.add_argument("--rss", type=int, default=0, metavar="TP",
                    help="only the setup of this TP size, alone: every rank's memory")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=None,
                    help="tiny-llama widened to this hidden size (intermediate 2.75x, "
                         "head_dim 64, GQA 2:1): where compute outweighs the all-reduces")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    if args.gguf is not None:
        path, prompts, name = args.gguf, tiny_llama_prompts(args.prompts), args.gguf.name
    elif args.smollm2:
        from ferrobatch.models import bundled_model_dir

        path = bundled_model_dir()
        tok = transformers.AutoTokenizer.from_pretrained(str(path))

        def encode(messages: list[dict[str, str]]) -> list[int]:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        prompts = chat_prompts(encode, args.prompts)
        name = "SmolLM2-135M-Instruct fp32"
    else:
        path = Path(tmp.name) / "tiny-llama"
        wide = {}
        if args.hidden:
            heads = args.hidden // 64
            wide = dict(hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2))
        tiny_llama_model(0, **wide).save_pretrained(path)
        prompts = tiny_llama_prompts(args.prompts)
        name = "tiny-llama fp32" + (f", hidden {args.hidden}" if args.hidden else "")
    cfg = ContinuousBatchingConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                                   num_blocks=2048, allow_block_sharing=False)
    sp = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    setups = {"TP=1 x 2 threads": (1, 2), "TP=2 x 1 thread": (2, 1)}
    if args.rss:
        for label, (tp, threads) in setups.items():
            if tp != args.rss:
                continue
            torch.set_num_threads(threads)
            with Engine(str(path), config=cfg, dtype="float32", tensor_parallel_size=tp) as eng:
                eng.generate(prompts, sp, progress=False)
                pids = [os.getpid()] + ([p.pid for p in eng.tp.procs] if eng.tp else [])
                print(f"{name}: {label}: " + "; ".join(
                    f"rank {r}: RSS {_status(pid, 'VmRSS')}, peak {_status(pid, 'VmHWM')}"
                    for r, pid in enumerate(pids)))
        return
    engines: dict[str, Engine] = {}
    for label, (tp, threads) in setups.items():
        torch.set_num_threads(threads)
        try:
            engines[label] = Engine(str(path), config=cfg, dtype="float32",
                                    tensor_parallel_size=tp)
        except FieldError as exc:  # e.g. SmolLM2-135M: 9 heads do not split 2 ways
            print(f"{name}: {label} refused: {exc}")
            for eng in engines.values():
                eng.close()
            sys.exit(2)
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in setups}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for rep in range(args.repeats + 1):
            for label, (_tp, threads) in setups.items():
                eng = engines[label]
                torch.set_num_threads(threads)
                steps0, cpu0, t0 = eng.stats()["steps"], _cpu(eng), time.perf_counter()
                outs = eng.generate(prompts, sp, progress=False)
                wall, cpu = time.perf_counter() - t0, _cpu(eng) - cpu0
                steps = eng.stats()["steps"] - steps0
                outputs[label] = [o.token_ids for o in outs]
                if rep:  # the first round warms up
                    results[label].append((wall, cpu, steps))
    finally:
        for eng in engines.values():
            eng.close()
    tokens = args.prompts * args.new
    same = outputs["TP=1 x 2 threads"] == outputs["TP=2 x 1 thread"]
    print(f"{name}: {args.prompts} prompts x {args.new} new tokens, page {args.page_size}, "
          f"max_batch_tokens {args.max_batch_tokens}; medians of {args.repeats}; "
          f"outputs identical: {same}")
    print(f"{'setup':<18} {'tok/s wall':>10} {'tok/CPU-s':>10} {'ms/step':>8} {'steps':>6}")
    base = None
    for label, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        steps = statistics.median(r[2] for r in runs)
        rate = tokens / wall
        base = base or rate
        print(f"{label:<18} {rate:>10.1f} {tokens / cpu:>10.1f} {1000 * wall / steps:>8.2f} "
              f"{int(steps):>6}   x{rate / base:.2f} wall")
    tmp.cleanup()


if __name__ == "__main__":
    main()
