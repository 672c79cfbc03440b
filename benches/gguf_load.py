"""A GGUF file through `ferrobatch.gguf`: load time, resident memory after the load and after
generating, time to the first token, and a few greedy chat answers (batched, left-padded,
`model.generate` on the loaded quantized model).

    .venv/bin/python benches/gguf_load.py /path/model.gguf --max-new-tokens 24
    .venv/bin/python benches/gguf_load.py model.gguf --backend reference   # force the
                                                                            # reference path
RSS is this process's resident set (`/proc/self/status` VmRSS, and its file-backed part
RssFile: the quantized blocks are views of the file's memory map, resident once touched).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.",
]


def rss() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(line.split()[1]) / 1024  # MiB
    return out


def mapped_rss(path: str) -> float:
    """MiB of `path`'s pages resident in this process's mappings of it (`/proc/self/smaps`)."""
    target, total, inside = str(Path(path).resolve()), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5] == target
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    ap.add_argument("--backend", default="auto", choices=("auto", "kernel", "reference"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-cache", action="store_true", help="ignore the config/tokenizer cache")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import torch
    from ferrobatch.gguf import modules
    from ferrobatch.gguf.loader import load_gguf

    if args.threads:
        torch.set_num_threads(args.threads)
    modules.set_backend(args.backend)
    size = Path(args.path).stat().st_size / 2**20
    base = rss()
    print(f"file {size:.0f} MiB; RSS before load {base['VmRSS']:.0f} MiB (imports; file-backed "
          f"{base['RssFile']:.0f}, anonymous {base['RssAnon']:.0f})", flush=True)
    t0 = time.perf_counter()
    model, tok = load_gguf(args.path, cache=not args.no_cache)
    t_load = time.perf_counter() - t0
    after = rss()
    info = model.ferrobatch_gguf
    print(f"load {t_load:.1f} s; RSS after load {after['VmRSS']:.0f} MiB "
          f"(+{after['VmRSS'] - base['VmRSS']:.0f}; file-backed {after['RssFile']:.0f}, "
          f"anonymous {after['RssAnon']:.0f}); quantized {info.quantized_bytes / 2**20:.0f} "
          f"MiB ({info.mapped_bytes / 2**20:.0f} mapped), float {info.float_bytes / 2**20:.0f} "
          f"MiB; types {info.types}; the file's pages resident {mapped_rss(args.path):.0f} MiB",
          flush=True)
    qs = QUESTIONS[:args.questions]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in qs]
    batch = tok(texts, return_tensors="pt", padding=True)
    t1 = time.perf_counter()
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=1, do_sample=False)
    t_first = time.perf_counter() - t1
    mid = rss()
    print(f"first token (prefill of {batch['input_ids'].shape} ) {t_first:.1f} s; load + "
          f"first token {t_load + t_first:.1f} s; RSS {mid['VmRSS']:.0f} MiB "
          f"(file-backed {mid['RssFile']:.0f}, anonymous {mid['RssAnon']:.0f}; the file's pages "
          f"{mapped_rss(args.path):.0f}), peak {mid['VmHWM']:.0f} MiB", flush=True)
    t2 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False)
    dt = time.perf_counter() - t2
    new = out[:, batch["input_ids"].shape[1]:]
    n = int((new != tok.pad_token_id).sum())
    end = rss()
    print(f"generate {args.max_new_tokens} steps x {len(qs)}: {dt:.1f} s "
          f"({dt / args.max_new_tokens:.2f} s a step, {n} tokens); RSS {end['VmRSS']:.0f} MiB "
          f"(file-backed {end['RssFile']:.0f}, anonymous {end['RssAnon']:.0f}; the file's pages "
          f"{mapped_rss(args.path):.0f}), peak {end['VmHWM']:.0f} MiB", flush=True)
    for q, row in zip(qs, new, strict=True):
        print(f"\nQ: {q}\nA: {tok.decode(row, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
