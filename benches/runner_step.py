"""Micro-benchmark: one decode step at batch 64 on the tiny-llama model, 1 thread.

Compares `ModelRunner.execute` on a packed decode plan (ferrobatch paged cache) against the
model's plain forward for the same step (static padded batch with a DynamicCache, as
`model.generate` does), and against the step's matrix work alone (base model without
attention is not separable, so the lm head on 64 rows is shown as the floor's largest part).
Also `execute_greedy` (greedy tokens through the bounded int8 screen of
`ferrobatch.runner.greedy_head`, when the runner enabled it) and that screen alone.

With `--head`: `GreedyHead.argmax` alone on 64 real hidden rows (final-norm outputs of a
forward) with bf16 head weights, each screen forced: the tiny-llama model in bf16 (vocab
32000, hidden 256; rows from the last positions of 64 tiny-llama prompts) and the bundled
SmolLM2-135M (vocab 49152, hidden 576; rows from the last 64 positions of the chat
questions as text). Run it pinned, e.g. `taskset -c 1`.

    python benches/runner_step.py [page_size]
    python benches/runner_step.py --head
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "python")]

from ferrobatch.runner.linear_policy import Backend  # noqa: E402
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
        t_runner_head = timeit(lambda: runner.head.logits(hidden))
        t_screen = (timeit(lambda: runner.head.greedy.argmax(hidden))
                    if runner.fast_greedy else None)
    head_gflop = 2 * batch * cfg.hidden_size * cfg.vocab_size / 1e9
    path = {Backend.ONEDNN: "oneDNN, reordered weight",
            Backend.TRANSPOSED: "transposed copy"}.get(runner.head.backend, "F.linear")
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
              f"({'int8' if runner.head.greedy.int8 else 'bf16'} product + fp32 rescoring "
              "of the candidates)")


def head_rows_tiny_llama(model, rows: int = 64) -> torch.Tensor:
    """Final hidden states at the last position of `rows` tiny-llama prompts."""
    from ferrobatch.workloads import tiny_llama_prompts

    with torch.inference_mode():
        return torch.cat([model.model(input_ids=torch.tensor([p])).last_hidden_state[0, -1:]
                          for p in tiny_llama_prompts(rows)])


def head_rows_text(model, tokenizer, rows: int = 64) -> torch.Tensor:
    """Final hidden states at the last `rows` positions of the chat questions as one text."""
    from ferrobatch.workloads import CHAT_QUESTIONS

    ids = tokenizer(" ".join(CHAT_QUESTIONS), return_tensors="pt").input_ids
    assert ids.shape[1] >= rows
    with torch.inference_mode():
        return model.model(input_ids=ids).last_hidden_state[0, -rows:].contiguous()


def head_main() -> None:
    """`GreedyHead.argmax` CPU time per call at 64 rows, each screen, 1 thread."""
    from ferrobatch.cpu import onednn
    from ferrobatch.models import bundled_model_dir
    from ferrobatch.runner.greedy_head import GreedyHead
    from ferrobatch.workloads import tiny_llama_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tiny = tiny_llama_model().to(torch.bfloat16)
    cases = [("tiny-llama, vocab 32000, hidden 256", tiny.lm_head.weight,
              head_rows_tiny_llama(tiny))]
    path = str(bundled_model_dir())
    smol = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    cases.append(("SmolLM2-135M, vocab 49152, hidden 576", smol.lm_head.weight,
                  head_rows_text(smol, AutoTokenizer.from_pretrained(path))))
    print("GreedyHead.argmax, 64 rows, bf16 head weight, 1 thread, CPU ms per call")
    for name, weight, hidden in cases:
        ref = torch.mm(hidden.float(), weight.float().t()).argmax(dim=1)
        head = GreedyHead(weight)
        head.argmax(hidden)  # derives the packed bf16 weight
        with torch.inference_mode():
            rows = hidden.bfloat16()
            t = timeit(lambda: onednn.linear(rows, head._packed), 20)  # noqa: B023
        print(f"  {name:38s} {'(bf16 product alone)':17s}: {t:7.3f} ms")
        for int8 in (False, True):
            head = GreedyHead(weight)
            head.int8 = int8 and head.int8
            got = head.argmax(hidden)
            assert got is None or torch.equal(got, ref)
            with torch.inference_mode():
                t = timeit(lambda: head.argmax(hidden), 20)  # noqa: B023
            screen = "int8 (then bf16)" if int8 else "bf16"
            print(f"  {name:38s} {screen:17s}: {t:7.3f} ms"
                  f"{'' if got is not None else '  (undecided: full logits needed)'}")


if __name__ == "__main__":
    if "--head" in sys.argv[1:]:
        head_main()
    else:
        main()
