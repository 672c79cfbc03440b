"""`ferrobatch.cpu.f32_ops.linear` (AVX-512F, packed fp32 weights) against oneDNN's packed fp32
product (`ferrobatch.cpu.onednn.linear`, as the packed linears call it) at
SmolLM2-135M's product shapes plus its head, interleaved, medians of `--repeats`, and each
one's largest error against an fp64 product.

    .venv/bin/python benches/f32_linear.py --threads 1
    .venv/bin/python benches/f32_linear.py --threads 2 --rows 16 64 256
"""

from __future__ import annotations

import argparse
import statistics

import torch
from amx_linear import SHAPES, timed  # (benches/ is the script's directory)
from ferrobatch.cpu import f32_ops, onednn
from ferrobatch.cpu.threads import share_torch_openmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256, 2048])
    args = ap.parse_args()
    if not f32_ops.available():
        raise SystemExit("no AVX-512F here (or the extension lacks f32_linear)")
    torch.set_num_threads(args.threads)
    share_torch_openmp()  # the kernel's column splits on torch's OpenMP team, as in the engine
    print(f"{'product':>8} {'rows':>5} {'ours us':>9} {'oneDNN us':>10} {'ratio':>6} "
          f"{'GFLOP/s':>8} {'our err':>8} {'oneDNN err':>10}")
    totals = [0.0, 0.0]
    for name, (n, k) in {**SHAPES, "head": (49152, 576)}.items():
        w = torch.randn(n, k) * 0.05
        ours_w = f32_ops.pack(w)
        dnn_w = onednn.pack(w)
        for rows in args.rows:
            x = torch.randn(rows, k)
            out = torch.empty(rows, n)

            def ours(x=x, ours_w=ours_w, out=out):
                return f32_ops.linear(x, ours_w, out)

            def dnn(x=x, dnn_w=dnn_w):
                return onednn.linear(x, dnn_w)

            calls = max(3, int(2e8 / (rows * n * k)))
            a, b = [], []
            for _ in range(args.repeats):
                a.append(timed(ours, calls))
                b.append(timed(dnn, calls))
            ta, tb = statistics.median(a), statistics.median(b)
            totals[0] += ta
            totals[1] += tb
            exact = (x.double() @ w.double().t())
            ea = (ours().double() - exact).abs().max().item()
            eb = (dnn().double() - exact).abs().max().item()
            print(f"{name:>8} {rows:>5} {ta:>9.1f} {tb:>10.1f} {tb / ta:>6.2f} "
                  f"{2 * rows * n * k / ta / 1e3:>8.1f} {ea:>8.1e} {eb:>10.1e}")
    print(f"sum of medians: ours {totals[0]:.0f} us, oneDNN {totals[1]:.0f} us "
          f"({totals[1] / totals[0]:.2f}x)")


if __name__ == "__main__":
    main()
