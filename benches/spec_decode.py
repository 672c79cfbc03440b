"""Speculative decoding on CPU: latency and throughput, spec vs non-spec interleaved.

    python benches/spec_decode.py                 # docs/benchmarks.md (SmolLM2, fp32, 1 thread)
    python benches/spec_decode.py --quick         # batch 1 and 4 only, 2 repeats

Bundled SmolLM2-135M-Instruct in fp32, ``torch.set_num_threads(1)``, greedy, a fixed number
of new tokens (``ignore_eos``), prefix caching off (so repeats never hit each other's prompt
blocks). Workloads: ``edit`` (the answer repeats a given text: "repeat / correct / rewrite
this text: ..."; prompt lookup pays) and ``chat`` (open questions; it does not). Methods:
``off`` (no speculation), ``ngram`` (k=4, prompt lookup 1..3, the default switch-off rules),
``ngram-forced`` (no batch switch-off: what the rule avoids), ``draft-random`` (a random-init
2-layer draft sharing the vocabulary: acceptance ~0, the overhead bound). For each batch
size, methods run interleaved, repeated; medians of the repeats. Greedy outputs of every
method are checked identical to ``off``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
import transformers  # noqa: E402
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams, models  # noqa: E402
from ferrobatch.spec import SpeculativeConfig  # noqa: E402
from ferrobatch.workloads import chat_prompts  # noqa: E402

transformers.logging.set_verbosity_error()

TEXTS = [
    "The river rose quickly after three days of rain, and the old bridge near the mill was "
    "closed to traffic. Farmers on the east bank had to drive twenty miles to reach the market.",
    "Our team meeting is moved to Thursday at ten. Please bring the quarterly numbers, the "
    "draft of the hiring plan, and any questions about the new office layout.",
    "To reset the router, hold the small button on the back for ten seconds until the light "
    "blinks orange, then wait two minutes before connecting your laptop again.",
    "Marie Curie was the first person to win Nobel Prizes in two different sciences. She "
    "studied radioactivity with her husband Pierre and discovered polonium and radium.",
]
ASKS = [
    "Repeat the following text exactly, word for word:",
    "Correct any mistakes in this text and return the full text:",
    "Rewrite this text, keeping every sentence:",
    "Copy this paragraph and then continue it:",
]


def edit_prompts(encode: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msg = f"{ASKS[i % len(ASKS)]}\n\n{TEXTS[(i // len(ASKS) + i) % len(TEXTS)]}"
        if i >= len(ASKS) * len(TEXTS):
            msg += f" ({i})"
        out.append(encode([{"role": "user", "content": msg}]))
    return out


def random_draft(vocab: int) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to(torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--methods", default="off,ngram,ngram-forced,draft-random")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.batches, args.repeats = "1,4", 2
    torch.set_num_threads(1)
    model, tok = models.load_model(None, dtype="float32")

    def encode(messages: list[dict[str, str]]) -> list[int]:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    cfg = ContinuousBatchingConfig(num_blocks=192, page_size=32, max_batch_tokens=512,
                                   allow_block_sharing=False)  # fmt: skip
    k = args.k
    specs = {
        "off": None,
        "ngram": SpeculativeConfig(num_speculative_tokens=k),
        "ngram-forced": SpeculativeConfig(num_speculative_tokens=k, max_spec_tokens_per_step=None),
        "draft-random": SpeculativeConfig(method="draft", draft_model=random_draft(
            model.config.vocab_size), num_speculative_tokens=k),
    }  # fmt: skip
    methods = args.methods.split(",")
    engines = {m: Engine(model, config=cfg, tokenizer=tok, speculative_config=specs[m])
               for m in methods}  # fmt: skip
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    results = []
    for wl in args.workloads.split(","):
        for b in [int(x) for x in args.batches.split(",")]:
            prompts = (edit_prompts if wl == "edit" else chat_prompts)(encode, b)
            for e in engines.values():  # warm-up, outside the timer
                e.generate(prompts[:1], SamplingParams(max_new_tokens=4), progress=False)
            times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
            outs: dict[str, Any] = {}
            before = {m: engines[m].stats() for m in methods}
            for _ in range(args.repeats):
                for m in methods:  # interleaved
                    t0, c0 = time.perf_counter(), time.process_time()
                    o = engines[m].generate(prompts, sp, progress=False)
                    times[m].append((time.perf_counter() - t0, time.process_time() - c0))
                    outs[m] = [x.token_ids for x in o]
            for m in methods:
                st = engines[m].stats()
                d = {key: st.get(key, 0) - before[m].get(key, 0)
                     for key in ("spec_rows", "spec_proposed", "spec_accepted", "steps",
                                 "generated_tokens")}  # fmt: skip
                wall = statistics.median(t for t, _ in times[m])
                cpu = statistics.median(c for _, c in times[m])
                ntok = sum(len(t) for t in outs[m])
                row = dict(
                    workload=wl, batch=b, method=m, wall_s=wall, tok_s=ntok / wall,
                    tok_per_cpu_s=ntok / cpu, ms_per_token_per_req=1000 * wall * b / ntok,
                    acceptance=d["spec_accepted"] / d["spec_proposed"] if d["spec_proposed"]
                    else None,
                    tokens_per_spec_row=(d["spec_rows"] + d["spec_accepted"]) / d["spec_rows"]
                    if d["spec_rows"] else None,
                    target_steps=d["steps"] / args.repeats,
                    identical=outs[m] == outs[methods[0]],
                )  # fmt: skip
                results.append(row)
            base = next(r for r in results[-len(methods) :] if r["method"] == methods[0])
            for r in results[-len(methods) :]:
                r["speedup"] = base["wall_s"] / r["wall_s"]
                print(_fmt(r), flush=True)
    for e in engines.values():
        e.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print()
    print(markdown(results, args))


def _fmt(r: dict[str, Any]) -> str:
    acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
    tps = "-" if r["tokens_per_spec_row"] is None else f"{r['tokens_per_spec_row']:.2f}"
    return (f"{r['workload']:5} b={r['batch']:<3} {r['method']:13} wall {r['wall_s']:7.2f}s "
            f"{r['tok_s']:7.1f} tok/s {r['tok_per_cpu_s']:7.1f} tok/cpu-s x{r['speedup']:.2f} "
            f"acc {acc} tok/row {tps} steps {r['target_steps']:.0f} "
            f"same={r['identical']}")  # fmt: skip


def markdown(rows: list[dict[str, Any]], args: Any) -> str:
    head = ("| workload | batch | method | wall s | tok/s | tok/CPU-s | ms/token/request | "
            "x off | acceptance | tokens/spec row | target steps | same output |")  # fmt: skip
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        tps = "-" if r["tokens_per_spec_row"] is None else f"{r['tokens_per_spec_row']:.2f}"
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['method']} | {r['wall_s']:.2f} | "
            f"{r['tok_s']:.1f} | {r['tok_per_cpu_s']:.1f} | {r['ms_per_token_per_req']:.1f} | "
            f"{r['speedup']:.2f} | {acc} | {tps} | {r['target_steps']:.0f} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
