"""Micro-benchmark: one decode step at batch 64 on the design brief §4 model, 1 thread.

Compares `ModelRunner.execute` on a packed decode plan (ferrobatch paged cache) against the
model's plain forward for the same step (static padded batch with a DynamicCache, as
`model.generate` does), and against the step's matrix work alone (base model without
attention is not separable, so the lm head on 64 rows is shown as the floor's largest part).
Also `execute_greedy` (greedy tokens through the bounded int8 screen of
`ferrobatch.runner.greedy_head`, when the runner enabled it) and that screen alone.

    python benches/runner_step.py [page_size]
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "python")]

from ferrobatch.runner.model_runner import ModelRunner  # noqa: E402
from ref_planner import RefPlanner  # noqa: E402
from tiny_models import bench_llama  # noqa: E402
from transformers import DynamicCache  # noqa: E402


def timeit(fn, n: int = 10) -> float:
    """Best-of-5 mean CPU time (process time: robust to other load on a shared machine)."""
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - t) / n)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(1)
    model = bench_llama()
    rng = random.Random(1234)
    batch, gen = 64, 32  # mid-generation: prompts of 16-256 tokens plus 32 generated
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(16, 256))] for _ in range(batch)]
    page = int(sys.argv[1]) if len(sys.argv) > 1 else 32  # the engine's default page_size
    runner = ModelRunner(model, num_blocks=2048, page_size=page)
    planner = RefPlanner(page_size=page, num_blocks=2048, layer_types=runner.layer_types,
                         sliding_window=None)
    for i, p in enumerate(prompts):
        planner.add(f"r{i}", p + [5] * gen)
    # Fill the cache: prefill everything but the last token of each request.
    for i, p in enumerate(prompts):
        planner.plan([(f"r{i}", len(p) + gen - 1)])
    plan = planner.plan([(f"r{i}", 1) for i in range(batch)])
    step = lambda: runner.execute(plan)  # noqa: E731  (re-running the same plan is idempotent)
    t_runner = timeit(step)
    t_greedy = timeit(lambda: runner.execute_greedy(plan)) if runner.fast_greedy else None

    # Plain forward: padded batch decode step with a DynamicCache of the longest length.
    lens = [len(p) + gen - 1 for p in prompts]
    lmax = max(lens)
    cfg = model.config
    kvh, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    past = [(torch.randn(batch, kvh, lmax, hd), torch.randn(batch, kvh, lmax, hd))
            for _ in range(cfg.num_hidden_layers)]
    mask = torch.zeros(batch, lmax + 1, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, lmax - n:] = 1  # left padding, as generate does
    ids = torch.full((batch, 1), 5)
    pos = torch.tensor([[n] for n in lens])

    def plain() -> None:
        cache = DynamicCache(config=cfg)
        for layer, (k, v) in enumerate(past):
            cache.update(k, v, layer)
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                  logits_to_keep=1)

    def cache_only() -> None:
        cache = DynamicCache(config=cfg)
        for layer, (k, v) in enumerate(past):
            cache.update(k, v, layer)

    t_plain = timeit(plain) - timeit(cache_only)
    hidden = torch.randn(batch, cfg.hidden_size)
    with torch.inference_mode():
        t_head = timeit(lambda: model.lm_head(hidden))
        t_runner_head = timeit(lambda: runner._head_logits(hidden))
        t_screen = (timeit(lambda: runner._greedy_head.argmax(hidden))
                    if runner.fast_greedy else None)
    head_gflop = 2 * batch * cfg.hidden_size * cfg.vocab_size / 1e9
    path = ("oneDNN, reordered weight" if runner._use_head_packed
            else "transposed copy" if runner._use_head_wt else "F.linear")
    print(f"decode step, batch {batch}, page {page}, keys {min(lens)}..{lmax} "
          f"(mean {sum(lens) / batch:.0f}), 1 thread, CPU ms")
    print(f"  ferrobatch ModelRunner.execute : {t_runner:7.2f} ms")
    if t_greedy is not None:
        print(f"  ... execute_greedy (head screen) : {t_greedy:7.2f} ms")
    print(f"  plain padded forward (HF sdpa) : {t_plain:7.2f} ms")
    print(f"  lm head alone (64 x 32000)     : {t_head:7.2f} ms  "
          f"({head_gflop / t_head * 1e3:.0f} GFLOP/s, nn.Linear)")
    print(f"  lm head as the runner runs it  : {t_runner_head:7.2f} ms  "
          f"({head_gflop / t_runner_head * 1e3:.0f} GFLOP/s, {path})")
    if t_screen is not None:
        print(f"  greedy tokens via the screen   : {t_screen:7.2f} ms  "
              f"({'int8' if runner._greedy_head.int8 else 'bf16'} product + fp32 rescoring "
              "of the candidates)")


if __name__ == "__main__":
    main()
