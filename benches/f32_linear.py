"""`ferrobatch.cpu.f32_ops.linear` (AVX-512F, packed fp32 weights) against oneDNN's packed fp32
product (`ferrobatch.cpu.onednn.linear`, as the packed linears call it) at
SmolLM2-135M's product shapes plus its head, interleaved, medians of `--repeats`, and each
one's largest error against an fp64 product.

    .venv/bin/python benches/f32_linear.py --threads 1
    .venv/bin/python benches/f32_linear.py --threads 2 --rows 16 64 256

`--half bfloat16` (or `float16`) times instead the same product over half weights: in
`f32_ops`' half panels (widened in registers), in its fp32 panels (the widened copy: the same
outputs, checked bit for bit) and, for bf16 where it runs, on `amx_ops` (vdpbf16ps / AMX).

    .venv/bin/python benches/f32_linear.py --half bfloat16 --rows 1 8 64 256
"""

from __future__ import annotations

import argparse
import statistics

import torch
from amx_linear import SHAPES, timed  # (benches/ is the script's directory)
from ferrobatch.cpu import amx_ops, f32_ops, onednn
from ferrobatch.cpu.threads import share_torch_openmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256, 2048])
    ap.add_argument("--half", choices=["bfloat16", "float16"],
                    help="half weights: half panels vs fp32 panels vs amx_ops")
    args = ap.parse_args()
    if not f32_ops.available():
        raise SystemExit("no AVX-512F here (or the extension lacks f32_linear)")
    torch.set_num_threads(args.threads)
    share_torch_openmp()  # the kernel's column splits on torch's OpenMP team, as in the engine
    if args.half:
        half(getattr(torch, args.half), args.rows, args.repeats)
        return
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


def half(dtype: torch.dtype, rows_list: list[int], repeats: int) -> None:
    """Half weights: `f32_ops` on its half panels, on its fp32 panels, and `amx_ops`."""
    amx = dtype == torch.bfloat16 and amx_ops.available()
    print(f"{'product':>8} {'rows':>5} {'half us':>9} {'fp32 us':>9} {'amx us':>9} "
          f"{'fp32/half':>9} {'amx/half':>8} {'bits equal':>10}")
    totals = [0.0, 0.0, 0.0]
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).to(dtype)
        packs = [f32_ops.pack(w), f32_ops.pack(w.float())]
        amx_w = amx_ops.pack(w) if amx else None
        for rows in rows_list:
            x = torch.randn(rows, k)
            outs = [torch.empty(rows, n), torch.empty(rows, n)]
            fns = [lambda p=p, o=o, x=x: f32_ops.linear(x, p, o)
                   for p, o in zip(packs, outs, strict=True)]
            if amx_w is not None:
                fns.append(lambda x=x, a=amx_w: amx_ops.linear(x, a))
            calls = max(3, int(1e8 / (rows * n * k)))
            times: list[list[float]] = [[] for _ in fns]
            for _ in range(repeats):
                for fn, t in zip(fns, times, strict=True):
                    t.append(timed(fn, calls))
            med = [statistics.median(t) for t in times] + [float("nan")] * (3 - len(fns))
            for i in range(3):
                totals[i] += med[i]
            same = torch.equal(fns[0]().view(torch.int32), fns[1]().view(torch.int32))
            print(f"{name:>8} {rows:>5} {med[0]:>9.1f} {med[1]:>9.1f} {med[2]:>9.1f} "
                  f"{med[1] / med[0]:>9.2f} {med[2] / med[0]:>8.2f} {str(same):>10}")
    print(f"sum of medians: half {totals[0]:.0f} us, fp32 {totals[1]:.0f} us, "
          f"amx_ops {totals[2]:.0f} us")


if __name__ == "__main__":
    main()
