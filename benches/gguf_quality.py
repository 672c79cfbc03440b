"""Quality of the quantized kernels' products on a GGUF model: mean KL divergence of the
next-token distribution and top-1 agreement against the same model's fp32 forward over the
dequantized weights (the reference products), over real text.

    .venv/bin/python benches/gguf_quality.py model.gguf --tokens 1024 --text README.md

Both forwards see the same weights: the difference is the kernels' int8 activations alone
(llama.cpp's `llama-perplexity --kl-divergence` measures its own side the same way, against
the logits of a higher-precision run).

With `--quantization q8_0,q4_k,...` the model is a float checkpoint (a directory, or
"bundled" for SmolLM2): each type quantizes it on load (`Engine(path, quantization=...)`'s
path, kernel products) and is measured against the checkpoint's own fp32 forward, with its
load time; `--load-only` loads the first type alone and prints the load time and RSS.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import time
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


def _compare(ref: torch.Tensor, got: torch.Tensor) -> str:
    logp_ref, logp_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float()
    return (f"mean KL {kl.mean():.6f} (p99 {kl.quantile(0.99):.5f}, max {kl.max():.4f}), "
            f"top-1 agreement {100 * top1.mean():.2f}%")


def _status_mib(field: str) -> float:
    """A `/proc/self/status` field (kB) in MiB."""
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text()
                .splitlines() if line.startswith(f"{field}:")) / 1024


def _rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB."""
    return _status_mib("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _trim() -> None:
    """Freed weights back to the OS (the caller dropped its references)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def quantized_types(args: argparse.Namespace) -> None:
    """Each type of `--quantization` on load against the float checkpoint's fp32 forward."""
    path = None if args.model == "bundled" else args.model
    qtypes = args.quantization.split(",")
    if args.load_only:
        start = time.perf_counter()
        model, _ = load_model(path, dtype=torch.float32, quantization=qtypes[0])
        rss, peak = _rss_mib()  # (with the model held)
        print(f"{qtypes[0]}: load {time.perf_counter() - start:.1f} s, RSS after load "
              f"{rss:.0f} MiB (peak {peak:.0f} MiB), {torch.get_num_threads()} threads, "
              f"{model.ferrobatch_quantization['quantized_bytes'] / 2**20:.0f} MiB quantized; "
              f"anonymous {_status_mib('RssAnon'):.0f} MiB, file {_status_mib('RssFile'):.0f} "
              "MiB (the peak counts the checkpoint's mapped pages too)")
        return
    model, tokenizer = load_model(path, dtype=torch.float32)
    ids = tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids
    ids = ids[:, : args.tokens]
    ref = logits(model, ids, args.window)
    del model
    _trim()
    for qtype in qtypes:
        start = time.perf_counter()
        model, _ = load_model(path, dtype=torch.float32, quantization=qtype)
        load_s = time.perf_counter() - start
        kept = len(model.ferrobatch_quantization["float_layers"])
        got = logits(model, ids, args.window)
        print(f"{qtype}: {ids.shape[1]} positions of {args.text}: {_compare(ref, got)}; load "
              f"{load_s:.1f} s, {kept} layers kept float", flush=True)
        del model, got
        _trim()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--text", default="README.md")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quantization", default=None,
                        help="comma-separated types to quantize the float checkpoint `model` "
                        "to on load, each against its fp32 forward")
    parser.add_argument("--load-only", action="store_true",
                        help="with --quantization: load time and RSS of the first type only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quantization:
        quantized_types(args)
        return
    model, tokenizer = load_model(args.model)
    ids = tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids
    ids = ids[:, : args.tokens]
    with modules.backend("reference"):
        ref = logits(model, ids, args.window)
    with modules.backend("kernel"):
        got = logits(model, ids, args.window)
    print(f"{ids.shape[1]} positions of {args.text}: {_compare(ref, got)}")


if __name__ == "__main__":
    main()
