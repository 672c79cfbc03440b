"""`kv_cache_dtype="int8"` against the model-dtype cache ("auto"): blocks for the same memory
budget, throughput, and quality.

* Blocks: `choose_num_blocks` for both at the CPU default budget of a machine with 16 GiB
  available (min(25%, 4 GiB)), and the KV bytes one token takes.
* Speed: two engines (prefix caching off, the same `num_blocks`), the workload's prompts x
  `--new` tokens greedy with EOS off, `--repeats` interleaved timed runs after a warm-up;
  medians of generated tokens per second of wall time and per CPU-second.
* Quality: greedy agreement of the int8 run with the auto run (`workloads.agreement`:
  identical requests, tokens before the first divergence), and the mean KL(auto || int8)
  of the next-token distributions along the auto run's greedy continuations, teacher-forced
  (each prompt + its auto continuation, one request at a time, its fp32 prompt logits from
  `ModelRunner.execute_with_prompt`: every key read from the cache, quantized in int8).

    python benches/kv_cache_dtype.py smollm2 bfloat16          # workload, model dtype
    python benches/kv_cache_dtype.py smollm2 float32 --threads 1 --repeats 3
    python benches/kv_cache_dtype.py /work/models/x.gguf auto --prompts 16 --new 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]
                                                               / "python")]

import ferrobatch  # noqa: E402,F401 - before torch: OpenMP's wait policy
import torch  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402
from ferrobatch.engine import memory  # noqa: E402
from ferrobatch.workloads import agreement  # noqa: E402

KVS = ("auto", "int8")


def workload(name: str, dtype: str, n: int) -> tuple[Any, Any, list[list[int]]]:
    """(model, tokenizer, prompts): e2e_cpu's A/B workloads, or a GGUF / checkpoint path
    (its tokenizer's chat prompts)."""
    import e2e_cpu  # (after ferrobatch: it imports torch)

    if name in ("smollm2", "tiny-llama"):
        model, prompts = e2e_cpu.ab_workload(name, getattr(torch, dtype))
        return model, None, prompts[:n]
    from ferrobatch.models import load_model  # local: only for a model path

    model, tok = load_model(name, dtype=None if dtype == "auto" else dtype)
    model.generation_config.eos_token_id = None
    return model, tok, e2e_cpu.smollm2_prompts(tok, n)


def blocks_for_budget(model: Any, dtype: torch.dtype) -> dict[str, tuple[int, int]]:
    """Per kv dtype: (blocks at the default CPU budget of 16 GiB available, bytes/token)."""
    out = {}
    for kv in KVS:
        cfg = ContinuousBatchingConfig(kv_cache_dtype=kv)
        n, _ = memory.choose_num_blocks(model, config=cfg, dtype=dtype, free_bytes=16 << 30,
                                        max_model_len=1 << 30)
        per_token = memory.kv_bytes_per_chunk(model.config, 1, dtype, kv)
        out[kv] = (n, per_token)
    return out


def timed(engine: Engine, prompts: list[list[int]], sp: SamplingParams
          ) -> tuple[float, float, list[list[int]]]:
    t, c = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, sp, progress=False)
    n = sum(len(o.token_ids) for o in outs)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return n / wall, n / cpu, [o.token_ids for o in outs]


def teacher_forced_logits(engine: Engine, seqs: list[list[int]], start: list[int]
                          ) -> list[torch.Tensor]:
    """fp32 log-softmax of the next-token logits at positions `start[i] ..` of each
    sequence, one request at a time."""
    runner = engine.runner
    own = runner.execute_with_prompt
    got: list[torch.Tensor] = []

    def capture(plan: Any, idx: Any, prev: Any = None) -> Any:
        logits, extra = own(plan, idx, prev)
        got.append(extra.float())
        return logits, extra

    runner.execute_with_prompt = capture
    out = []
    try:
        for seq, s in zip(seqs, start, strict=True):
            got.clear()
            engine.generate([seq], SamplingParams(max_new_tokens=1, prompt_logprobs=0),
                            progress=False)
            rows = torch.cat(got)  # positions 0 .. len-2 predict tokens 1 .. len-1
            out.append(rows[s - 1:].log_softmax(-1))
    finally:
        runner.execute_with_prompt = own
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", help="smollm2 | tiny-llama | a model path (GGUF)")
    p.add_argument("dtype", help="model dtype: float32 | bfloat16 | auto (a path's own)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--kl-prompts", type=int, default=16, help="sequences for the KL")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _, prompts = workload(args.workload, args.dtype, args.prompts)
    mdtype = next(model.parameters()).dtype
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    print(f"{args.workload} {mdtype} | {cpu} | torch threads {args.threads}")
    for kv, (n, per) in blocks_for_budget(model, mdtype).items():
        print(f"  budget 4 GiB: kv_cache_dtype={kv}: {n} blocks ({per} bytes per token)")

    sp = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    need = sum(-(-(len(q) + args.new) // 32) for q in prompts) + 8
    engines = {kv: Engine(model, config=ContinuousBatchingConfig(
        allow_block_sharing=False, num_blocks=need, kv_cache_dtype=kv)) for kv in KVS}
    for e in engines.values():
        e.generate(prompts[:4], SamplingParams(max_new_tokens=4), progress=False)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {kv: [] for kv in KVS}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for kv in KVS:
            w, c, toks = timed(engines[kv], prompts, sp)
            runs[kv].append((w, c))
            tokens.setdefault(kv, toks)
    for kv in KVS:
        wall = statistics.median(w for w, _ in runs[kv])
        cps = statistics.median(c for _, c in runs[kv])
        print(f"  {kv}: {wall:.1f} tok/s wall, {cps:.1f} tok per CPU-second "
              f"(wall runs: {', '.join(f'{w:.1f}' for w, _ in runs[kv])})")
    agree = agreement(tokens["auto"], tokens["int8"])
    print(f"  greedy agreement: {100 * agree['requests']:.0f}% identical requests, "
          f"{100 * agree['tokens']:.1f}% of tokens before the first divergence")

    k = min(args.kl_prompts, len(prompts))
    seqs = [list(q) + list(t) for q, t in zip(prompts[:k], tokens["auto"][:k], strict=True)]
    start = [len(q) for q in prompts[:k]]
    ref = teacher_forced_logits(engines["auto"], seqs, start)
    got = teacher_forced_logits(engines["int8"], seqs, start)
    kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(ref, got, strict=True)])
    top1 = torch.cat([(r.argmax(-1) == g.argmax(-1)).float()
                      for r, g in zip(ref, got, strict=True)])
    print(f"  teacher-forced over {kl.numel()} positions of {k} auto continuations: mean KL "
          f"{kl.mean():.2e} (p99 {kl.quantile(0.99):.2e}, max {kl.max():.2e}), top-1 "
          f"agreement {100 * top1.mean():.2f}%")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
