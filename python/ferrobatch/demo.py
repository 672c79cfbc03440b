"""`python -m ferrobatch.demo` (= `make run`): chat with the bundled SmolLM2-135M-Instruct.

Sends a handful of real prompts through one continuous-batching `Engine.chat` call and
prints each answer, then the throughput and what the cache did.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
import time

import torch

from ferrobatch import Engine, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning a new language.",
    "How do I reverse a list in Python? Show a short example.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small coffee shop by the sea.",
    "Summarize the story of Cinderella in three sentences.",
]


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code."""
    ap = argparse.ArgumentParser(prog="python -m ferrobatch.demo", description=__doc__)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    engine = Engine()
    print(
        f"loaded {engine.model_name} in {time.perf_counter() - t_load:.1f} s "
        f"(torch threads={torch.get_num_threads()}, cache: {engine.num_blocks} blocks of "
        f"{engine.config.page_size} tokens)",
        flush=True,
    )
    if engine.memory_explanation:
        print(f"cache sizing: {engine.memory_explanation}", flush=True)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed
    )
    with engine:
        t0 = time.perf_counter()
        outs = engine.chat(conversations, sampling, progress=True)
        wall = time.perf_counter() - t0
        stats = engine.stats()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        print(f"\n### {prompt}")
        print(textwrap.indent(out.text.strip() or "(empty)", "  "))
        print(
            f"  [{len(out.token_ids)} tokens, finish={out.finish_reason}, "
            f"ttft={out.ttft or 0:.2f} s]"
        )
    gen = sum(len(o.token_ids) for o in outs)
    prompt_toks = sum(len(o.prompt_token_ids) for o in outs)
    print(
        f"\n{len(outs)} requests, {prompt_toks} prompt + {gen} generated tokens in {wall:.2f} s: "
        f"{gen / wall:.1f} generated tok/s ({(gen + prompt_toks) / wall:.1f} tok/s incl. prompts), "
        f"{stats.get('steps')} steps"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
