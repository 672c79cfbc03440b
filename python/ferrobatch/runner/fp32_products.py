"""Whether a half-precision model's matrix products run faster in fp32 on this CPU.

A bf16 product is not faster than an fp32 one everywhere. With AMX tiles, or on AMD Zen 4
(whose 512-bit fp32 FMAs issue at half rate), bf16 dot products are 2-5x the fp32 rate.
On Intel cores that expose AVX-512 BF16 but not AMX (Sapphire / Emerald Rapids under a
hypervisor that hides the tiles, Cooper Lake), `vdpbf16ps` runs at about half the rate of
two fp32 FMA ports: measured on such a Xeon (1 thread, SmolLM2-135M's product shapes), the
fp32 product of the widened weight took 0.51-0.58x the time of the bf16 one (ferrobatch's
AVX-512 BF16 kernel or oneDNN's, the two within 5%) from 64 rows on and 0.56-0.75x at 16
rows, while at 1-4 rows, where reading the weight is the cost, the bf16 product (half the
bytes) took 0.3-0.6x the fp32 one's time (`benches/amx_linear.py --fp32`).

`fp32_from_rows(dtype)` measures that once per process and dtype: the number of rows from
which the packed linears (`ferrobatch.runner.cpu_linear`) use an fp32 copy of a
half-precision weight (the product then also keeps its input in fp32: closer to the exact
computation than rounding it to bf16), or None where the half-precision product is not
clearly slower. The margin (`_MIN_GAIN`) keeps a noisy machine from flipping the choice:
where it applies, fp32 is about twice as fast.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from ferrobatch.cpu import amx_ops
from ferrobatch.runner.cpu_linear import packing_available

logger = logging.getLogger("ferrobatch")

__all__ = ["FP32_ROWS", "fp32_from_rows", "measure_gain"]

#: rows from which fp32 products are used where they win: below it the weight's bytes,
#: twice as many in fp32, cost more than the arithmetic saved (crossover at 4-16 rows)
FP32_ROWS = 16
#: fp32 must take at most 1 / this of the half-precision product's time at the probe shape
_MIN_GAIN = 1.3
_PROBE = (64, 1024, 1024)  # rows, output features, input features


@functools.cache
def fp32_from_rows(dtype: torch.dtype) -> int | None:
    """From how many rows a `dtype` (bf16 / fp16) weight's product is faster as the fp32
    product of its widened copy here (`FP32_ROWS`), or None (not clearly faster, or
    oneDNN's packed products don't run here). Measured once per process and dtype."""
    if not (packing_available(dtype) and packing_available(torch.float32)):
        return None
    try:
        gain = measure_gain(dtype)
    except RuntimeError as exc:  # a product this build or CPU doesn't run
        logger.info("ferrobatch: no fp32 product probe for %s (%s)", dtype,
                    str(exc).splitlines()[0])
        return None
    wins = gain >= _MIN_GAIN
    logger.info("ferrobatch: fp32 products of widened %s weights take %.2fx the time of %s "
                "ones here%s", dtype, 1 / gain, dtype,
                f"; used from {FP32_ROWS} rows" if wins else "")
    return FP32_ROWS if wins else None


def measure_gain(dtype: torch.dtype, rounds: int = 5) -> float:
    """The half-precision product's time over the fp32 one's at `_PROBE` on one thread
    (the faster of `amx_ops` and oneDNN's packed product for the half one; best of
    `rounds`, interleaved)."""
    rows, n, k = _PROBE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(dtype)
    linear = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        wide = torch.ops.mkldnn._reorder_linear_weight(w.float(), rows)
        halves: list[Callable[[], object]] = [
            lambda: linear(x.to(dtype), packed, None, "none", [], "")]
        if dtype == torch.bfloat16 and amx_ops.available():
            tiles = amx_ops.pack(w)
            halves.append(lambda: amx_ops.linear(x, tiles))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            best_half, best_fp32 = float("inf"), float("inf")
            for _ in range(rounds):
                best_half = min(best_half, *(_time(fn) for fn in halves))
                best_fp32 = min(best_fp32, _time(lambda: linear(x, wide, None, "none", [], "")))
        finally:
            torch.set_num_threads(threads)
    return best_half / best_fp32


def _time(fn: Callable[[], object]) -> float:
    fn()  # warm: the first call of a shape may set up oneDNN's kernel
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
