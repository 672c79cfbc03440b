"""`ferrobatch.cpu.amx_ops.linear` (AMX tiles or AVX-512 BF16, fp32 outputs) against oneDNN's
packed bf16 product (as the packed linears call it: input converted to bf16, output in bf16)
at SmolLM2-135M's product shapes, interleaved, medians of `--repeats`; also each one's
largest error against the exact product of the bf16-rounded input.

    .venv/bin/python benches/amx_linear.py --threads 1
    .venv/bin/python benches/amx_linear.py --fp32    # also oneDNN's fp32 product of the
                                                     # widened weight (`linear_policy`'s probe)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from ferrobatch.cpu import amx_ops, onednn
from ferrobatch.cpu.threads import share_torch_openmp

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def timed(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 1024])
    ap.add_argument("--fp32", action="store_true",
                    help="also time the fp32 product of the widened weight (column 'fp32 us')")
    args = ap.parse_args()
    if not amx_ops.available():
        raise SystemExit("neither AMX bf16 tiles nor AVX-512 BF16 on this machine (or the "
                         "extension lacks the products)")
    torch.set_num_threads(args.threads)
    # the kernel's column splits on torch's OpenMP team, as in the engine (else each call
    # starts threads of its own that fight torch's spinning workers for the cores)
    share_torch_openmp()
    print(f"{'product':>8} {'rows':>5} {'amx us':>8} {'oneDNN us':>10} {'ratio':>6} "
          f"{'amx err':>8} {'oneDNN err':>10}" + (f" {'fp32 us':>8}" if args.fp32 else ""))
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).bfloat16()
        amx_w = amx_ops.pack(w)
        dnn_w = onednn.pack(w)
        wide_w = onednn.pack(w.float()) if args.fp32 else None
        for rows in args.rows:
            x = torch.randn(rows, k)
            def amx(x=x, amx_w=amx_w):
                return amx_ops.linear(x, amx_w)

            def dnn(x=x, dnn_w=dnn_w):
                return onednn.linear(x.to(torch.bfloat16), dnn_w)

            def wide(x=x, wide_w=wide_w):
                return onednn.linear(x, wide_w)

            calls = max(3, 20000 // rows)
            ta, td, tw = [], [], []
            for _ in range(args.repeats):
                ta.append(timed(amx, calls))
                td.append(timed(dnn, calls))
                if args.fp32:
                    tw.append(timed(wide, calls))
            exact = x.bfloat16().double() @ w.double().t()
            ea = (amx().double() - exact).abs().max().item()
            ed = (dnn().double() - exact).abs().max().item()
            a, d = statistics.median(ta), statistics.median(td)
            fp32 = f" {statistics.median(tw):>8.0f}" if args.fp32 else ""
            print(f"{name:>8} {rows:>5} {a:>8.0f} {d:>10.0f} {d / a:>6.2f} {ea:>8.1e} {ed:>10.1e}"
                  + fp32, flush=True)


if __name__ == "__main__":
    main()
