"""Quality of the quantized kernels' products on a GGUF model: mean KL divergence of the
next-token distribution and top-1 agreement against the same model's fp32 forward over the
dequantized weights (the reference products), over real text.

    .venv/bin/python benches/gguf_quality.py model.gguf --tokens 1024 --text README.md

Both forwards see the same weights: the difference is the kernels' int8 activations alone
(llama.cpp's `llama-perplexity --kl-divergence` measures its own side the same way, against
the logits of a higher-precision run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from ferrobatch.gguf import modules
from ferrobatch.models import load_model


def logits(model: torch.nn.Module, ids: torch.Tensor, window: int) -> torch.Tensor:
    """fp32 next-token logits of every position, `window` tokens a forward (no overlap)."""
    out = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], window):
            chunk = ids[:, start:start + window]
            out.append(model(input_ids=chunk, use_cache=False).logits[0].float())
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--text", default="README.md")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    ids = tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids
    ids = ids[:, : args.tokens]
    with modules.backend("reference"):
        ref = logits(model, ids, args.window)
    with modules.backend("kernel"):
        got = logits(model, ids, args.window)
    logp_ref, logp_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float()
    print(f"{ids.shape[1]} positions of {args.text}: mean KL {kl.mean():.6f} "
          f"(p99 {kl.quantile(0.99):.5f}, max {kl.max():.4f}), top-1 agreement "
          f"{100 * top1.mean():.2f}%")


if __name__ == "__main__":
    main()
