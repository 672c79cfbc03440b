"""The one-call lean layer (`ferrobatch.runner.fused_layer`) against the lean layer's separate
kernel calls, same engine; or (switch `f32`) fp32 products on `f32_ops` (and the one-call
layer over them) against oneDNN's fp32 products.

One engine, its lean layers' `fused_enabled` (or its packed linears' `f32_kernel`)
switched on and off between interleaved repeats
of the same workload (64 prompts x 64 new tokens, greedy, EOS off; prefix caching off, so
every repeat prefills every prompt in full); medians in generated tokens per second
of wall time and per CPU-second, and whether both gave the same tokens (they must: the two
paths are bit-equal).

    python benches/fused_layer_ab.py smollm2 bfloat16 1 5   # workload, dtype, threads, repeats
    python benches/fused_layer_ab.py tiny-llama bfloat16 2
    python benches/fused_layer_ab.py smollm2 float32 1 5 f32   # f32_ops on / off
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]
                                                               / "python")]

import ferrobatch  # noqa: E402,F401 - before torch: OpenMP's wait policy
import torch  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402


def main() -> None:
    args = sys.argv[1:] + ["tiny-llama", "bfloat16", "1", "3", "fused"][len(sys.argv) - 1:]
    workload, dtype, threads, repeats = args[0], args[1], int(args[2]), int(args[3])
    switch = args[4]
    torch.set_num_threads(threads)
    import e2e_cpu  # (after ferrobatch: it imports torch)

    model, prompts = e2e_cpu.ab_workload(workload, getattr(torch, dtype))
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
    engine = Engine(model, config=ContinuousBatchingConfig(allow_block_sharing=False))
    lean, linears = engine.runner.activations.lean, engine.runner.activations.linears
    if switch == "f32":
        if linears is None or not linears.f32_kernel:
            sys.exit("no fp32 products on f32_ops here (no AVX-512F, or no fp32 products)")

        def turn(on: bool) -> None:
            linears.f32_kernel = on
    else:
        if lean is None or lean._layers[0].fused is None:
            sys.exit("no lean layers, or no one-call layer in this build / on this CPU")

        def turn(on: bool) -> None:
            lean.fused_enabled = on
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    tokens: dict[bool, list] = {}
    for rep in range(repeats):
        for fused in (True, False):
            turn(fused)
            t, c = time.perf_counter(), time.process_time()
            outs = engine.generate(prompts, sp, progress=False)
            n = sum(len(o.token_ids) for o in outs)
            runs[fused].append((n / (time.perf_counter() - t), n / (time.process_time() - c)))
            if rep == 0:
                tokens[fused] = [o.token_ids for o in outs]
    for fused, got in runs.items():
        wall = statistics.median(w for w, _ in got)
        cpu = statistics.median(c for _, c in got)
        on, off = ("f32_ops", "oneDNN") if switch == "f32" else ("one call", "separate")
        print(f"{workload} {dtype} threads={threads} {on if fused else off}: "
              f"{wall:.0f} tok/s wall, {cpu:.0f} tok per CPU-second "
              f"(wall: {', '.join(f'{w:.0f}' for w, _ in got)})")
    print("same tokens:", tokens[True] == tokens[False])
    engine.close()


if __name__ == "__main__":
    main()
