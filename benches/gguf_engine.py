"""A GGUF model through the engine on the quantized kernels: construction time and resident
memory, one chat answer, single-stream decode (one request, 128 tokens) and offline
throughput (32 chat prompts x 64 tokens), greedy, EOS ignored; tokens per wall second and
per CPU-second.

    taskset -c 1 .venv/bin/python benches/gguf_engine.py model.gguf --threads 1
    .venv/bin/python benches/gguf_engine.py model.gguf --ab 3    # lean layers vs own, A/B
    .venv/bin/python benches/gguf_engine.py model.gguf --ab 3 --arms lean,per_kernel
                                      # decode layers in one call against one call a kernel
    .venv/bin/python benches/gguf_engine.py model.gguf --ab 10 --arms lean,per_layer
                                      # the whole stack in one call against one a layer
    .venv/bin/python benches/gguf_engine.py model.gguf --construct   # one line; run it
                                                                     # against another tree
    .venv/bin/python benches/gguf_engine.py model.gguf --backends amx_int8,avx512vnni --ab 3
                                      # the quantized products' backends, A/B, one engine
    .venv/bin/python benches/gguf_engine.py model.gguf --many-rows 9,1000000 --ab 3
                                      # the fewest rows of the many-rows kernels, A/B
    .venv/bin/python benches/gguf_engine.py model.gguf --huge-ab 10 --prompts 1
                                      # packed weights on 4 KiB vs huge pages, two engines

The file's read bandwidth limit for single-stream decode is (bytes of the matrices read per
token) / (measured read bandwidth): `benches/quant_linear.py` measures the bandwidth.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path

import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.runner.fused_layer import FusedStack
from ferrobatch.workloads import chat_prompts


def rss_mib() -> dict[str, float]:
    """VmRSS, its anonymous / file-backed parts and the peak (VmHWM), MiB."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


def timed(engine: Engine, prompts: list[list[int]], n: int) -> tuple[int, float, float]:
    """(generated tokens, wall s, CPU s) of one `generate` call."""
    c0, w0 = time.process_time(), time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True),
                           progress=False)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return sum(len(o.token_ids) for o in outs), wall, cpu


def construct(path: str) -> None:
    """Construction, the first token of a chat prompt, RSS after both (one line)."""
    start = time.perf_counter()
    engine = Engine(path)
    built = time.perf_counter() - start
    rss = rss_mib()
    question = [{"role": "user", "content": "What is the capital of France? One sentence."}]
    engine.chat([question], SamplingParams(max_new_tokens=1), progress=False)
    first = time.perf_counter() - start
    print(f"construction {built:.1f} s, first token at {first:.1f} s; RSS after construction "
          + ", ".join(f"{k} {v:.0f} MiB" for k, v in rss.items()))
    engine.close()


#: the arms `interleaved` compares: the engine as it runs (decoder layers lean over the
#: quantized products, a decode step's layers in one `_core.lean_layers_forward` call, the
#: base model's forward run directly), the same through the model's own base-model forward,
#: the lean layers in one call each, the lean layers without the one call, the model's own
#: layers (transformers' code, each `QuantLinear` on its own)
ARMS = ("lean", "model_forward", "per_layer", "per_kernel", "own")


def _set_arm(engine: Engine, lean: object, direct: object, arm: str) -> None:
    acts = engine.runner.activations
    acts.lean = None if arm == "own" else lean
    lean.fused_enabled = arm in ("lean", "model_forward", "per_layer")
    FusedStack.ENABLED = arm in ("lean", "model_forward")
    engine.runner.direct_forward = direct if arm == "lean" else None


def interleaved(engine: Engine, repeats: int, prompts: int, arms: list[str]) -> None:
    """Two of `ARMS` on the same engine, alternated, medians of `repeats`: single stream
    (128 tokens) and `prompts` chat prompts x 64 (their prefill included)."""
    lean = engine.runner.activations.lean
    direct = engine.runner.direct_forward
    if lean is None:
        raise SystemExit("this model's layers do not run lean; nothing to compare")

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)

    single = [engine.tokenizer("def fibonacci(n):").input_ids]
    batch = chat_prompts(encode, prompts)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for arm in arms:  # warm-up: the own layers pack their weights on first use, a first
        _set_arm(engine, lean, direct, arm)  # large batch allocates
        timed(engine, single, 4)
        timed(engine, batch, 4)
    for r in range(repeats):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            _set_arm(engine, lean, direct, arm)
            for what, ps, n in (("single stream x 128", single, 128),
                                (f"{prompts} x 64", batch, 64)):
                got, wall, cpu = timed(engine, ps, n)
                results.setdefault((what, arm), []).append((got / wall, got / cpu))
                print(f"  run {r} {arm:10} {what}: {got / wall:.2f} tok/s, "
                      f"{got / cpu:.2f} tok per CPU-s", flush=True)
    _set_arm(engine, lean, direct, "lean")
    for (what, arm), runs in results.items():
        print(f"{what:22} {arm:10}: median {statistics.median(w for w, _ in runs):.2f} tok/s "
              f"wall, {statistics.median(c for _, c in runs):.2f} tok per CPU-s "
              f"({len(runs)} runs)")


BACKEND_ENV = "FERROBATCH_QUANT_BACKEND"
MANY_ROWS_ENV = "FERROBATCH_QUANT_MANY_ROWS"


def env_ab(path: str, env: str, values: list[str], repeats: int, prompts: int,
           pp: int) -> None:
    """Two values of a kernel switch read at each quantized product (`env`: the backend,
    `FERROBATCH_QUANT_BACKEND`, or the fewest rows of the many-rows kernels,
    `FERROBATCH_QUANT_MANY_ROWS`) on one engine, alternated: prefill of the first `pp`
    tokens of README.md (one token generated) and `prompts` chat prompts x 64; prefix
    caching off; medians of `repeats`."""
    engine = Engine(path, config=ContinuousBatchingConfig(allow_block_sharing=False))
    tok = engine.tokenizer
    readme = tok((Path(__file__).resolve().parents[1] / "README.md").read_text()).input_ids[:pp]

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)

    batch = chat_prompts(encode, prompts)
    work = ((f"prefill {len(readme)}", [readme], 1), (f"{prompts} x 64", batch, 64))
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(repeats + 1):  # run 0 warms up
        for value in (values if r % 2 == 0 else values[::-1]):
            os.environ[env] = value
            for what, ps, n in work:
                got, wall, _ = timed(engine, ps, n)
                rate = (len(readme) if what.startswith("prefill") else got) / wall
                if r:
                    results.setdefault((what, value), []).append(rate)
                    print(f"  run {r} {value:10} {what}: {rate:.1f} tok/s", flush=True)
    os.environ.pop(env, None)
    for what, _, _ in work:
        med = {b: statistics.median(results[(what, b)]) for b in values}
        print(f"{what:14} " + ", ".join(f"{b} {v:.1f} tok/s" for b, v in med.items())
              + f"; {values[0]} / {values[1]} = {med[values[0]] / med[values[1]]:.2f}x")
    engine.close()


HUGE_ENV = "FERROBATCH_HUGE_WEIGHTS"


def anon_huge_mib() -> float:
    """This process's anonymous memory on transparent huge pages, MiB."""
    with open("/proc/self/smaps_rollup") as smaps:
        for line in smaps:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


def huge_ab(path: str, repeats: int, prompts: int) -> None:
    """Packed weights on 4 KiB pages against transparent huge pages (`FERROBATCH_HUGE_WEIGHTS`
    0 / 1, read as the weights are packed): one engine built each way in this process (their
    construction times and the huge pages each took), then single stream (128 tokens) and
    `prompts` chat prompts x 64 on the two alternated, medians of `repeats`."""
    engines = {}
    for value in ("0", "1"):
        os.environ[HUGE_ENV] = value
        huge, start = anon_huge_mib(), time.perf_counter()
        engines[value] = Engine(path, config=ContinuousBatchingConfig(allow_block_sharing=False))
        print(f"{HUGE_ENV}={value}: built in {time.perf_counter() - start:.1f} s, "
              f"{anon_huge_mib() - huge:.0f} MiB more on huge pages", flush=True)
    os.environ.pop(HUGE_ENV)
    tok = engines["0"].tokenizer

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)

    work = (("single stream x 128", [tok("def fibonacci(n):").input_ids], 128),
            (f"{prompts} x 64", chat_prompts(encode, prompts), 64))
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(repeats + 1):  # run 0 warms up
        for value in (("0", "1") if r % 2 == 0 else ("1", "0")):
            for what, ps, n in work:
                got, wall, cpu = timed(engines[value], ps, n if r else 4)
                if r:
                    results.setdefault((what, value), []).append(got / wall)
                    print(f"  run {r} huge={value} {what}: {got / wall:.2f} tok/s, "
                          f"{got / cpu:.2f} tok per CPU-s", flush=True)
    for what, _, _ in work:
        med = {v: statistics.median(results[(what, v)]) for v in ("0", "1")}
        print(f"{what:20} 4 KiB {med['0']:.2f} tok/s, huge {med['1']:.2f}; "
              f"{med['1'] / med['0']:.3f}x")
    for engine in engines.values():
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a .gguf file")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--construct", action="store_true",
                        help="only construction, first token and RSS (one line)")
    parser.add_argument("--ab", type=int, default=0, metavar="REPEATS",
                        help="two arms (--arms) interleaved, medians of REPEATS runs "
                             "(single stream and offline)")
    parser.add_argument("--arms", default="lean,own", metavar="A,B",
                        help=f"with --ab: two of {', '.join(ARMS)} (lean: as the engine "
                             "runs; model_forward: the same through the model's own "
                             "base-model forward; per_layer: one call a layer, not the "
                             "whole stack in one; per_kernel: lean layers without the "
                             "one-call layer; own: the model's own layers)")
    parser.add_argument("--backends", default=None, metavar="A,B",
                        help="with --ab: two quantized-product backends instead (prefill "
                             "and offline)")
    parser.add_argument("--many-rows", default=None, metavar="A,B",
                        help="with --ab: two values of the fewest rows of the many-rows "
                             "kernels instead (prefill and offline)")
    parser.add_argument("--pp", type=int, default=512, help="prompt tokens of --backends' "
                        "prefill")
    parser.add_argument("--huge-ab", type=int, default=0, metavar="REPEATS",
                        help="packed weights on 4 KiB pages against huge pages: two engines, "
                             "alternated, medians of REPEATS (single stream and offline)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.huge_ab:
        huge_ab(args.model, args.huge_ab, args.prompts)
        return
    if args.construct:
        construct(args.model)
        return
    if args.ab and (args.backends or args.many_rows):
        env, values = ((BACKEND_ENV, args.backends) if args.backends
                       else (MANY_ROWS_ENV, args.many_rows))
        env_ab(args.model, env, values.split(","), args.ab, args.prompts, args.pp)
        return
    if args.ab:  # (prefix caching off: repeats of the batch must prefill it each time)
        engine = Engine(args.model,
                        config=ContinuousBatchingConfig(allow_block_sharing=False))
        arms = args.arms.split(",")
        if len(arms) != 2 or not set(arms) <= set(ARMS):
            raise SystemExit(f"--arms takes two of {ARMS}, not {args.arms!r}")
        interleaved(engine, args.ab, args.prompts, arms)
        engine.close()
        return

    start = time.perf_counter()
    engine = Engine(args.model)
    print(f"engine built in {time.perf_counter() - start:.1f} s; RSS {rss_mib()}")
    question = [{"role": "user", "content": "What is the capital of France? One sentence."}]
    start = time.perf_counter()
    answer = engine.chat([question], SamplingParams(max_new_tokens=20), progress=False)[0]
    print(f"chat: {answer.text!r} ({time.perf_counter() - start:.1f} s)")

    prompt = engine.tokenizer("def fibonacci(n):").input_ids
    timed(engine, [prompt], 4)  # warm-up
    n, wall, cpu = timed(engine, [prompt], 128)
    print(f"single stream, {args.threads} thread(s): {n / wall:.2f} tok/s wall, "
          f"{n / cpu:.2f} tok per CPU-s")

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)

    n, wall, cpu = timed(engine, chat_prompts(encode, args.prompts), 64)
    print(f"{args.prompts} x 64, {args.threads} thread(s): {n / wall:.1f} tok/s wall, "
          f"{n / cpu:.1f} tok per CPU-s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RSS {rss_mib()}, peak {peak:.0f} MiB")
    engine.close()


if __name__ == "__main__":
    main()
