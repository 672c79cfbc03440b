"""`ferrobatch.cpu.quant_ops.linear` (GGUF quantized weights) on one thread: weight bytes read
per second at m = 1 (decode), hot (the weight stays in cache between calls) and cold (calls
rotate through copies of the weight larger than the last-level cache, so every call reads it
from memory), against this machine's read bandwidth (the best of a numpy sum, a numpy max
and a torch sum of a 1 GiB array); and GOP/s (2 m n k / s) at m = 512 (prefill), with
torch's fp32 product of the dequantized weight for scale. Times are the calling thread's CPU
time (the machine may be shared: wall time would count other processes' turns), best of
`--repeats`.

    .venv/bin/python benches/quant_linear.py
    .venv/bin/python benches/quant_linear.py --types q4_k q6_k --backend portable
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from ferrobatch.cpu import quant_ops

SHAPES = [(1536, 1536), (8960, 1536)]
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144),
         "q5_k": (256, 176), "q6_k": (256, 210), "q5_0": (32, 22), "q5_1": (32, 24),
         "iq4_nl": (32, 18), "q3_k": (256, 110), "q2_k": (256, 84), "iq4_xs": (256, 136)}


def cpu_time(fn, calls: int) -> float:
    """Seconds of this thread's CPU time a call."""
    t = time.thread_time_ns()
    for i in range(calls):
        fn(i)
    return (time.thread_time_ns() - t) * 1e-9 / calls


def best(fn, calls: int, repeats: int) -> float:
    return min(cpu_time(fn, calls) for _ in range(repeats))


def read_bandwidth(repeats: int) -> dict[str, float]:
    """GB/s of one thread reading a 1 GiB array: numpy's sum (pairwise, compute can bound
    it), its max and torch's sum; the largest is the bandwidth the kernels are held to."""
    a = np.ones(1 << 27)
    probes = {"np.sum": lambda i: a.sum(), "np.max": lambda i: a.max(),
              "torch.sum": lambda i: torch.from_numpy(a).sum()}
    return {name: a.nbytes / best(f, 1, repeats) / 1e9 for name, f in probes.items()}


def blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF rows with fp16 factors of 0.01 (values do not change the speed)."""
    block, nbytes = BLOCK[qtype]
    b = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    one = np.full((n, k // block, 1), 0.01, np.float16).view(np.uint8)
    at = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2],
          "q6_k": [208], "q5_0": [0], "q5_1": [0, 2], "iq4_nl": [0], "q3_k": [108],
          "q2_k": [80, 82], "iq4_xs": [0]}[qtype]
    for a in at:
        b[..., a:a + 2] = one
    return b.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="+", default=list(quant_ops.QTYPES))
    ap.add_argument("--backend", default=None,
                    help="portable, avx2, avx512vnni or amx_int8 (default: best)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cold-mib", type=int, default=640,
                    help="MiB of weight copies the cold calls rotate through (> the L3)")
    ap.add_argument("--prefill-rows", type=int, default=512)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64, 512],
                    help="rows of the many-rows table (AVX-512 VNNI, and AMX-INT8 where the "
                         "CPU has it)")
    ap.add_argument("--int8-peak", type=float, default=740.0,
                    help="GOP/s of vpdpbusd alone on one core")
    ap.add_argument("--only-rows", action="store_true", help="the many-rows table alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = args.backend or quant_ops.backend()
    if args.only_rows:
        rows_table(args, backend)
        return
    probes = read_bandwidth(args.repeats)
    bw = max(probes.values())
    print(f"backend {backend}, 1 thread; read bandwidth of 1 GiB (GB/s): "
          + ", ".join(f"{k} {v:.1f}" for k, v in probes.items()) + f" -> {bw:.1f}")
    print(f"{'type':>5} {'n x k':>10} {'MiB':>6} | {'m=1 hot us':>10} {'GB/s':>6} | "
          f"{'m=1 cold us':>11} {'GB/s':>6} {'of bw':>6} | {'m=512 ms':>8} {'GOP/s':>6} "
          f"{'torch fp32':>10}")
    rng = np.random.default_rng(0)
    for qtype in args.types:
        for n, k in SHAPES:
            shape(qtype, n, k, args, backend, bw, rng)
    rows_table(args, backend)


MANY_ROWS_ENV = "FERROBATCH_QUANT_MANY_ROWS"


def rows_table(args: argparse.Namespace, backend: str) -> None:
    """The many-rows table: panel kernels against many-rows kernels (AVX-512 VNNI's register
    tiles and, where the CPU has them, the AMX int8 tiles), interleaved."""
    if backend not in ("avx512vnni", "amx_int8"):
        return
    amx = quant_ops.backend_available("amx_int8")
    print(f"\nmany rows, 1 thread, medians of {args.repeats} (interleaved); "
          f"share of {args.int8_peak:.0f} GOP/s")
    print(f"{'type':>5} {'n x k':>10} {'m':>4} | {'panel ms':>8} {'GOP/s':>6} {'peak':>5} | "
          f"{'many ms':>8} {'GOP/s':>6} {'peak':>5} | {'speed-up':>8}"
          + (f" | {'amx ms':>8} {'GOP/s':>6} {'peak':>5} | {'vs many':>7}" if amx else ""))
    rng = np.random.default_rng(1)
    for qtype in args.types:
        for n, k in SHAPES:
            w = quant_ops.pack(qtype, blocks(qtype, n, k, rng), n, k)
            for m in args.rows:
                x, out = torch.randn(m, k), torch.empty(m, n)
                calls = max(1, int(2e8 / (2 * m * n * k)))
                times: dict[str, list[float]] = {"panel": [], "many": []}
                if amx:
                    times["amx"] = []
                for _ in range(args.repeats):
                    for arm in times:
                        if arm == "panel":  # past any m: the many-rows kernels off
                            os.environ[MANY_ROWS_ENV] = str(1 << 30)
                        else:
                            os.environ.pop(MANY_ROWS_ENV, None)
                        be = "amx_int8" if arm == "amx" else "avx512vnni"
                        times[arm].append(cpu_time(
                            lambda i, x=x, w=w, out=out, be=be: quant_ops.linear(x, w, out, be),
                            calls))
                os.environ.pop(MANY_ROWS_ENV, None)
                ops = 2 * m * n * k
                gops = {a: ops / statistics.median(t) / 1e9 for a, t in times.items()}
                cell = {a: f"{ops / gops[a] / 1e6:>8.2f} {gops[a]:>6.0f} "
                           f"{gops[a] / args.int8_peak:>5.0%}" for a in times}
                print(f"{qtype:>5} {f'{n}x{k}':>10} {m:>4} | {cell['panel']} | {cell['many']} | "
                      f"{gops['many'] / gops['panel']:>7.2f}x"
                      + (f" | {cell['amx']} | {gops['amx'] / gops['many']:>6.2f}x" if amx else ""),
                      flush=True)


def shape(qtype: str, n: int, k: int, args: argparse.Namespace, backend: str, bw: float,
          rng: np.random.Generator) -> None:
    """One line of the table: [n, k] of `qtype`."""
    w = quant_ops.pack(qtype, blocks(qtype, n, k, rng), n, k)
    mib = w.nbytes / 2**20
    x1 = torch.randn(1, k)
    out1 = torch.empty(1, n)
    hot = best(lambda i: quant_ops.linear(x1, w, out1, backend), 200, args.repeats)
    copies = [w] + [quant_ops.PackedWeight(w.qtype, n, k, w.packed.clone())
                    for _ in range(int(args.cold_mib / mib))]
    cold = best(lambda i: quant_ops.linear(x1, copies[i % len(copies)], out1, backend),
                len(copies), args.repeats)
    copies.clear()
    m = args.prefill_rows
    xm = torch.randn(m, k)
    outm = torch.empty(m, n)
    pre = best(lambda i: quant_ops.linear(xm, w, outm, backend), 1, args.repeats)
    wf = torch.from_numpy(quant_ops.dequantize(qtype, blocks(qtype, n, k, rng), n, k))
    ref = best(lambda i: torch.mm(xm, wf.t()), 1, args.repeats)
    ops = 2 * m * n * k
    print(f"{qtype:>5} {f'{n}x{k}':>10} {mib:>6.2f} | {hot * 1e6:>10.1f} "
          f"{w.nbytes / hot / 1e9:>6.1f} | {cold * 1e6:>11.1f} "
          f"{w.nbytes / cold / 1e9:>6.1f} {w.nbytes / cold / 1e9 / bw:>6.0%} | "
          f"{pre * 1e3:>8.2f} {ops / pre / 1e9:>6.0f} {ops / ref / 1e9:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
