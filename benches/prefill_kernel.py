"""The tiled CPU prefill attention kernel against the two routes it replaces, one layer's
attention of one chunk (SmolLM2-135M shapes: 9 query heads, 3 KV heads, head size 64; page
16): the prefill kernel over the paged cache in place; the decode kernel with one kernel row
per query token; the gather of the cached keys + SDPA with an additive mask (the path of
`forward.paged_attention_forward` for a prompt row). Chunks of 64 / 256 / 512 tokens at
0 / 1k / 2k / 4k cached keys, fp32 and bf16; the routes interleaved, medians of 5 calls in
milliseconds per call; the kernels' threads on torch's OpenMP team, as in an engine.

    python benches/prefill_kernel.py 1            # threads
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "python")]

import ferrobatch  # noqa: E402,F401 - before torch: OpenMP's wait policy
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ferrobatch import _core  # noqa: E402
from ferrobatch.cpu.arrays import KERNEL_DTYPES, numpy_view  # noqa: E402
from ferrobatch.cpu.threads import share_torch_openmp  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16


def setup(q_len: int, ctx: int, dtype: torch.dtype) -> dict:
    """A cache holding one row's `ctx + q_len` keys in shuffled chunks, and its queries."""
    n = ctx + q_len
    width = -(-n // PAGE)
    gen = torch.Generator().manual_seed(q_len + ctx)
    chunks = torch.randperm(width + 4, generator=gen)[:width].numpy().astype(np.int32) + 1
    slots_total = (width + 5) * PAGE
    k = torch.randn(slots_total, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(slots_total, KV_HEADS, DIM, generator=gen).to(dtype)
    q = torch.randn(q_len, HEADS, DIM, generator=gen).to(dtype)
    pos = np.arange(n)
    slots = torch.from_numpy(chunks[pos // PAGE].astype(np.int64) * PAGE + pos % PAGE)
    valid = np.arange(n)[None, :] <= np.arange(ctx, n)[:, None]
    mask = torch.from_numpy(np.where(valid, np.float32(0), np.float32(-np.inf))).to(dtype)
    return {"q": q, "k": k, "v": v, "table": chunks[None, :], "slots": slots, "mask": mask,
            "ctx": ctx, "n": n}


def prefill_kernel(s: dict) -> None:
    q = s["q"]
    out = torch.empty_like(q)
    ty = KERNEL_DTYPES[q.dtype]
    _core.paged_prefill_attention(
        numpy_view(q), numpy_view(s["k"]), numpy_view(s["v"]), s["table"],
        np.array([0, q.shape[0]], dtype=np.int32), np.array([s["n"]], dtype=np.int32),
        numpy_view(out), q_dtype=ty, cache_dtype=ty, out_dtype=ty, page=PAGE, window=0,
        scale=DIM**-0.5, softcap=0.0, threads=torch.get_num_threads())


def decode_kernel(s: dict) -> None:
    q = s["q"]
    out = torch.empty_like(q)
    ty = KERNEL_DTYPES[q.dtype]
    t = q.shape[0]
    _core.paged_decode_attention(
        numpy_view(q), numpy_view(s["k"]), numpy_view(s["v"]),
        np.ascontiguousarray(np.repeat(s["table"], t, axis=0)),
        np.arange(s["ctx"] + 1, s["n"] + 1, dtype=np.int32), numpy_view(out), q_dtype=ty,
        cache_dtype=ty, out_dtype=ty, page=PAGE, window=0, scale=DIM**-0.5, softcap=0.0,
        threads=torch.get_num_threads())


def gather_sdpa(s: dict) -> None:
    q = s["q"].transpose(0, 1).unsqueeze(0)
    k = s["k"].index_select(0, s["slots"]).transpose(0, 1).unsqueeze(0)
    v = s["v"].index_select(0, s["slots"]).transpose(0, 1).unsqueeze(0)
    causal = s["ctx"] == 0
    F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else s["mask"],
                                   is_causal=causal, scale=DIM**-0.5, enable_gqa=True)


ROUTES = {"prefill kernel": prefill_kernel, "decode kernel": decode_kernel,
          "gather+SDPA": gather_sdpa}


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(threads)
    share_torch_openmp()  # the kernels' threads on torch's OpenMP team, as in an engine
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    print(f"# {cpu}, torch.set_num_threads({threads}); ms per call, median of 5")
    print("| dtype | chunk | context | " + " | ".join(ROUTES) + " |")
    print("|---|---|---|" + "---|" * len(ROUTES))
    for dtype in (torch.float32, torch.bfloat16):
        for q_len in (64, 256, 512):
            for ctx in (0, 1024, 2048, 4096):
                s = setup(q_len, ctx, dtype)
                times: dict[str, list[float]] = {r: [] for r in ROUTES}
                for _ in range(6):
                    for name, fn in ROUTES.items():
                        t = time.perf_counter()
                        fn(s)
                        times[name].append(time.perf_counter() - t)
                cells = [f"{sorted(v[1:])[2] * 1e3:.2f}" for v in times.values()]
                print(f"| {str(dtype)[6:]} | {q_len} | {ctx} | " + " | ".join(cells) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
