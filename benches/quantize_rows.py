"""The K-type weight quantizer of quantize-on-load (`ferrobatch.cpu.quant_ops.quantize`):
CPU time per weight on one thread, best of the repeats, on Gaussian rows.

    .venv/bin/python benches/quantize_rows.py --types Q4_K,Q5_K,Q6_K --shape 512x1536
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from ferrobatch.cpu import quant_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_K,Q5_K,Q6_K")
    parser.add_argument("--shape", default="512x1536", help="rows x inputs (inputs: 256s)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, k = (int(v) for v in args.shape.split("x"))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    print(f"{platform.processor() or platform.machine()}, 1 thread, [{n}, {k}] rows")
    for qtype in args.types.split(","):
        took = []
        for _ in range(args.repeats):
            start = time.process_time()
            quant_ops.quantize(w, qtype)
            took.append(time.process_time() - start)
        print(f"{qtype}: {min(took) / w.numel() * 1e9:.1f} ns a weight (CPU time)")


if __name__ == "__main__":
    main()
