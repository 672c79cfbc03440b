"""bf16 weights, every product the linear policy can pick, at one model's shapes: `f32_ops`'
half panels (fp32 products of the weights as stored), oneDNN's bf16 product (activations
rounded to bf16), oneDNN's fp32 product on an fp32 copy (twice the bytes) and `amx_ops`
(`vdpbf16ps` or AMX tiles, fp32 outputs). Milliseconds of CPU time for one call of each of
a decoder layer's four products (q/k/v stacked, o, gate/up stacked, down), summed; medians
of 3, interleaved; random weights.

    .venv/bin/python benches/half_products.py --shapes qwen2.5-1.5b --threads 1
    .venv/bin/python benches/half_products.py --shapes smollm2 --rows 1 8 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import ferrobatch  # noqa: F401 - before torch: OpenMP's wait policy
import torch
from ferrobatch.cpu import amx_ops, f32_ops, onednn
from ferrobatch.cpu.threads import share_torch_openmp

#: (output features, input features) of q/k/v, o, gate/up and down
SHAPES = {
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576),
                "down": (576, 1536)},
    "qwen2.5-1.5b": {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536),
                     "down": (1536, 8960)},
}


def cpu_ms(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e3


def products(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each backend's product of `x` by the bf16 weight `w`."""
    half, packed, wide = f32_ops.pack(w), onednn.pack(w), onednn.pack(w.float())
    runs: dict[str, Callable[[], object]] = {
        "f32_ops half panels": lambda: f32_ops.linear(x, half),
        "oneDNN bf16": lambda: onednn.linear(x.bfloat16(), packed),
        "oneDNN fp32 copy": lambda: onednn.linear(x, wide)}
    if amx_ops.available():
        tiles = amx_ops.pack(w)
        runs[f"amx_ops ({amx_ops.backend()})"] = lambda: amx_ops.linear(x, tiles)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 256, 512])
    args = ap.parse_args()
    if not f32_ops.available():
        raise SystemExit("no AVX-512F here (or the extension lacks f32_linear)")
    torch.set_num_threads(args.threads)
    share_torch_openmp()
    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        total: dict[str, dict[str, list[float]]] = {}
        for name, (n, k) in SHAPES[args.shapes].items():
            w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
            x = torch.randn(rows, k, generator=gen)
            calls = max(2, int(2e8 / (n * k * max(rows, 8))))
            for _ in range(3):
                for label, fn in products(w, x).items():
                    total.setdefault(label, {}).setdefault(name, []).append(cpu_ms(fn, calls))
        ms = {label: sum(statistics.median(v) for v in d.values())
              for label, d in total.items()}
        base = ms["f32_ops half panels"]
        print(f"{rows:4d} rows: " + ", ".join(f"{label} {t:.2f} ms ({base / t:.2f}x)"
                                              for label, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
