"""End-to-end CPU throughput: ferrobatch vs transformers `generate_batch` vs padded `generate`.

The tiny-llama workload: a random-init Llama (hidden 256, 4 layers, 4/2
heads, vocab 32000, fp32, `torch.manual_seed(0)`), 64 prompts from `random.Random(1234)`
with lengths 16..256, greedy, EOS off, 64 new tokens each, 1 torch thread. All three run in
one process on the same prompts; outputs are compared; the median of `--repeats` timed runs
(after one warm-up) is reported as generated tokens per second of wall time and of process
CPU time (the latter is steadier when other work shares the cores), with ratios.

    python benches/e2e_cpu.py                  # the tiny-llama workload
    python benches/e2e_cpu.py --smollm2        # bundled SmolLM2-135M-Instruct, 64 chat prompts
    python benches/e2e_cpu.py --only ferrobatch --page-size 64 --max-batch-tokens 1024
    python benches/e2e_cpu.py --only ferrobatch --async   # the async pipeline on CPU
    python benches/e2e_cpu.py --only ferrobatch --dtype bfloat16   # the model in bf16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
import transformers  # noqa: E402
from ferrobatch.workloads import (  # noqa: E402
    agreement,
    chat_prompts,
    left_padded,
    tiny_llama_model,
    tiny_llama_prompts,
)
from transformers import GenerationConfig  # noqa: E402

transformers.logging.set_verbosity_error()

METHODS = ("ferrobatch", "generate_batch", "padded_generate")

def smollm2_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` chat prompts through the tokenizer's chat template."""

    def encode(messages: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return ids["input_ids"] if hasattr(ids, "keys") else ids

    return chat_prompts(encode, n)


def ab_workload(workload: str, dtype: torch.dtype,
                n: int = 64) -> tuple[Any, list[list[int]]]:
    """The model in `dtype` and `n` prompts of an in-engine A/B bench: "smollm2" (the bundled
    checkpoint, EOS off, its chat prompts) or "tiny-llama" (`ferrobatch.workloads`' model and
    prompts)."""
    if workload not in ("smollm2", "tiny-llama"):
        raise SystemExit(f"unknown workload {workload!r}: 'tiny-llama' or 'smollm2'")
    if workload == "smollm2":
        from ferrobatch.models import load_model

        model, tok = load_model(None, dtype=dtype)
        model.generation_config.eos_token_id = None
        return model, smollm2_prompts(tok, n)
    return tiny_llama_model().to(dtype), tiny_llama_prompts(n)


# ----------------------------------------------------------------------------- runners


def run_ferrobatch(model: Any, prompts: list[list[int]], new: int, args: Any) -> Callable:
    """A fresh engine per timed run (built and warmed up on other prompts outside the timer),
    so a repeat never profits from the prefix cache of the previous one."""
    import gc

    from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams

    cfg = ContinuousBatchingConfig(
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        num_blocks=args.num_blocks,
        scheduler_type=args.scheduler,
        use_async_batching=True if args.async_batching else None,
    )
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    rng = random.Random(99)
    vocab = int(model.config.vocab_size)
    warm = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(8)]
    state: dict[str, Any] = {}

    def prepare() -> None:
        if "engine" in state:
            state.pop("engine").close()
            gc.collect()
        engine = Engine(model, config=cfg)
        engine.generate(warm, SamplingParams(max_new_tokens=4, ignore_eos=True), progress=False)
        state["engine"] = engine

    def run() -> list[list[int]]:
        outs = state["engine"].generate(prompts, sp, progress=False)
        return [o.token_ids for o in outs]

    run.prepare = prepare  # type: ignore[attr-defined]
    run.state = state  # type: ignore[attr-defined]
    return run


def run_generate_batch(model: Any, prompts: list[list[int]], new: int, args: Any) -> Callable:
    gc = GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )

    def run() -> list[list[int]]:
        res = model.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False)
        by_id = sorted(res.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
        return [list(r.generated_tokens) for r in by_id]

    return run


def run_padded_generate(model: Any, prompts: list[list[int]], new: int, args: Any) -> Callable:
    bs = args.padded_batch

    def run() -> list[list[int]]:
        outs: list[list[int]] = []
        for start in range(0, len(prompts), bs):
            ids, mask = left_padded(prompts[start : start + bs])
            width = ids.shape[1]
            with torch.no_grad():
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=None,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            outs.extend(gen[:, width:].tolist())
        return outs

    return run


RUNNERS = {
    "ferrobatch": run_ferrobatch,
    "generate_batch": run_generate_batch,
    "padded_generate": run_padded_generate,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smollm2", action="store_true", help="bundled SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--only", nargs="+", choices=METHODS, default=None,
        help="methods to run (default: all three; with --smollm2 ferrobatch and padded_generate:"
        " generate_batch sizes its cache at 60%% of RAM and was OOM-killed here)",
    )
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--scheduler", default="fifo", choices=("fifo", "prefill_first"))
    ap.add_argument("--padded-batch", type=int, default=64)
    ap.add_argument(
        "--async", dest="async_batching", action="store_true",
        help="ferrobatch with use_async_batching=True (the one-step-in-flight pipeline; on CPU "
        "it runs step after step, so this measures its bookkeeping cost)",
    )
    ap.add_argument(
        "--generate-batch-repeats", type=int, default=1,
        help="timed runs of generate_batch (slow; at most --repeats)",
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="the model's dtype (fp32 by default)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    if args.only is None:
        args.only = ["ferrobatch", "padded_generate"] if args.smollm2 else list(METHODS)

    from ferrobatch import ContinuousBatchingConfig

    defaults = ContinuousBatchingConfig()
    args.page_size = args.page_size or defaults.page_size
    args.max_batch_tokens = args.max_batch_tokens or defaults.max_batch_tokens
    torch.set_num_threads(args.threads)

    if args.smollm2:
        from ferrobatch.models import load_model

        model, tok = load_model(None, device="cpu", dtype=getattr(torch, args.dtype))
        model.generation_config.eos_token_id = None  # the bench's own copy: EOS off
        prompts = smollm2_prompts(tok, args.prompts)
        workload = f"SmolLM2-135M-Instruct {args.dtype}, {args.prompts} chat prompts"
    else:
        model = tiny_llama_model().to(getattr(torch, args.dtype))
        prompts = tiny_llama_prompts(args.prompts)
        workload = f"tiny-llama {args.dtype}, {args.prompts} prompts of 16..256 tokens"
    new = args.max_new_tokens
    n_tokens = new * len(prompts)
    print(
        f"workload: {workload}; {new} new tokens each (greedy, EOS off); "
        f"torch threads={torch.get_num_threads()}; repeats={args.repeats} (median)\n"
        f"ferrobatch config: page_size={args.page_size} max_batch_tokens={args.max_batch_tokens} "
        f"num_blocks={args.num_blocks or 'auto'} scheduler={args.scheduler} "
        f"async={args.async_batching}",
        flush=True,
    )

    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    runs = {name: RUNNERS[name](model, prompts, new, args) for name in args.only}
    for run in runs.values():
        if getattr(run, "prepare", None) is None:
            run()  # warm-up (allocations, first-call overheads); engines warm up in prepare()
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu_times: dict[str, list[float]] = {name: [] for name in runs}
    # round-robin over the methods so that a change in machine load hits them all alike
    for rep in range(args.repeats):
        for name, run in runs.items():
            if name == "generate_batch" and rep >= args.generate_batch_repeats:
                continue
            prepare = getattr(run, "prepare", None)
            if prepare is not None:
                prepare()
            t0, c0 = time.perf_counter(), time.process_time()
            outputs[name] = run()
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(time.process_time() - c0)
            print(f"  repeat {rep + 1}: {name} {times[name][-1]:.2f} s", flush=True)
    for name, run in runs.items():
        out = outputs[name]
        got = sum(len(o) for o in out)
        med = statistics.median(times[name])
        cpu = statistics.median(cpu_times[name])
        results[name] = {
            "seconds": med,
            "tok_s": got / med,
            "generated_tokens": got,
            "times": times[name],
            "cpu_seconds": cpu,
            "tok_per_cpu_s": got / cpu,
        }
        if hasattr(run, "state"):
            engine = run.state.pop("engine")
            st = engine.stats()
            results[name]["num_blocks"] = engine.num_blocks
            results[name]["steps_per_run"] = st.get("steps")
            results[name]["prefix_hit_tokens"] = st.get("prefix_hit_tokens")
            results[name]["greedy_screen"] = bool(getattr(engine.runner, "fast_greedy", False))
            engine.close()
        print(
            f"{name:>16}: {got / med:8.1f} tok/s wall ({med:.2f} s median of "
            f"{[round(t, 2) for t in times[name]]}); {got / cpu:8.1f} tok per CPU-second",
            flush=True,
        )
        if "greedy_screen" in results[name]:
            print(f"{'':>16}  greedy tokens through the bounded head screen (int8 or bf16): "
                  f"{'on' if results[name]['greedy_screen'] else 'off'}")
        if got != n_tokens:
            print(f"{'':>16}  warning: {got} tokens generated, expected {n_tokens}")

    if "ferrobatch" in results:
        fb = results["ferrobatch"]["tok_s"]
        for other in ("padded_generate", "generate_batch"):
            if other in results:
                ratio = fb / results[other]["tok_s"]
                cpu_ratio = results["ferrobatch"]["tok_per_cpu_s"] / results[other]["tok_per_cpu_s"]
                results["ferrobatch"][f"x_{other}"] = ratio
                results["ferrobatch"][f"x_{other}_cpu"] = cpu_ratio
                print(f"ferrobatch / {other}: {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU time")
    names = list(outputs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            agree = agreement(outputs[a], outputs[b])
            same, tok = agree["requests"], agree["tokens"]
            print(
                f"agreement {a} vs {b}: {same:.0%} of requests identical, "
                f"{tok:.1%} of tokens before the first divergence"
            )
            results.setdefault("agreement", {})[f"{a}~{b}"] = agree
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
