"""The int8 KV cache (`PagedKVCache(kv_dtype="int8")`): quantization on write, the CPU
decode kernel reading int8 + scales in place against a reference that dequantizes first,
the SDPA paths' dequantized reads, swaps carrying the scales, and its memory sizing."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models
import torch
import transformers
from ferrobatch.attention import kernels
from ferrobatch.attention.kv_cache import RESERVED_CHUNKS, PagedKVCache, quantize_int8
from ferrobatch.attention.paged_step import _KernelDecode
from ferrobatch.engine import memory
from ferrobatch.errors import FieldError

PAGE = 4


def _cache(**kw) -> PagedKVCache:
    args = dict(num_layers=2, num_blocks=12, page_size=PAGE, num_kv_heads=2, head_dim=16,
                kv_dtype="int8")
    return PagedKVCache(**{**args, **kw})


def _dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.unsqueeze(-1)


def test_quantize_is_symmetric_absmax_per_vector() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g) * torch.tensor([0.01, 1.0, 40.0])[None, :, None]
    x[2, 1] = 0.0
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5, 3)
    assert torch.equal(s, x.abs().amax(-1) / 127)
    assert q.abs().max() == 127 and (q[2, 1] == 0).all() and s[2, 1] == 0
    # every element within half a step of its scale
    err = (_dequantized(q, s) - x).abs()
    assert (err <= s.unsqueeze(-1) / 2 + 1e-6 * x.abs()).all()


def test_write_then_read_gives_the_quantized_values_once() -> None:
    cache = _cache()
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([8, 9, 13, 30])
    k, v = torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    cache.write(1, slots, k, v)
    assert cache.keys[1].dtype == torch.int8 and cache.key_scales[1].shape == (
        cache.num_slots, 2)
    k_out, v_out = torch.empty(4, 2, 16), torch.empty(4, 2, 16)
    cache.read_slots(1, slots, k_out, v_out)
    assert torch.equal(k_out, _dequantized(*quantize_int8(k)))
    assert torch.equal(v_out, _dequantized(*quantize_int8(v)))
    assert not cache.keys[0].any() and not cache.key_scales[0].any()  # other layer untouched
    # bf16 compute dtype: the same values, rounded once to bf16
    half = _cache(dtype=torch.bfloat16)
    half.write(0, slots, k.bfloat16(), v.bfloat16())
    kb, vb = torch.empty(4, 2, 16, dtype=torch.bfloat16), torch.empty(4, 2, 16,
                                                                       dtype=torch.bfloat16)
    half.read_slots(0, slots, kb, vb)
    assert torch.equal(kb, _dequantized(*quantize_int8(k.bfloat16())).bfloat16())


def test_gather_chunks_dequantizes_whole_chunks() -> None:
    cache = _cache()
    g = torch.Generator().manual_seed(2)
    slots = torch.arange(3 * PAGE, 5 * PAGE)
    k, v = torch.randn(len(slots), 2, 16, generator=g), torch.randn(len(slots), 2, 16,
                                                                    generator=g)
    cache.write(0, slots, k, v)
    gk, gv = cache.gather_chunks(cache.keys[0], cache.values[0], torch.tensor([4, 0, 3]), 0)
    want_k = _dequantized(*quantize_int8(k))
    assert torch.equal(gk[:PAGE], want_k[PAGE:]) and torch.equal(gk[2 * PAGE:], want_k[:PAGE])
    assert not gk[PAGE:2 * PAGE].any()  # the zero chunk reads as zeros
    assert torch.equal(gv[:PAGE], _dequantized(*quantize_int8(v))[PAGE:])


def test_swap_round_trip_carries_the_scales() -> None:
    cache = _cache(cpu_offload_blocks=3)
    assert cache.scale_pool is not None and cache.swap_pool.dtype == torch.int8
    g = torch.Generator().manual_seed(3)
    chunk = RESERVED_CHUNKS + 1
    slots = torch.arange(chunk * PAGE, (chunk + 1) * PAGE)
    for layer in range(2):
        cache.write(layer, slots, torch.randn(PAGE, 2, 16, generator=g),
                    torch.randn(PAGE, 2, 16, generator=g))
    before = [torch.empty(PAGE, 2, 16) for _ in range(4)]
    for layer in range(2):
        cache.read_slots(layer, slots, before[2 * layer], before[2 * layer + 1])
    cache.swap(swap_out=np.array([[chunk, 2]]))
    cache.storage.zero_()
    cache.scales.zero_()
    dest = RESERVED_CHUNKS + 7
    cache.swap(swap_in=np.array([[2, dest]]))
    back = torch.arange(dest * PAGE, (dest + 1) * PAGE)
    for layer in range(2):
        k, v = torch.empty(PAGE, 2, 16), torch.empty(PAGE, 2, 16)
        cache.read_slots(layer, back, k, v)
        assert torch.equal(k, before[2 * layer]) and torch.equal(v, before[2 * layer + 1])


def _reference(q, k, v, tables, seqlens, page, window, scale, softcap):
    """Attention of each row over its keys, from fp32 (dequantized) caches, in fp64."""
    rows, heads, dim = q.shape
    g = heads // k.shape[1]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    width = tables.shape[1]
    for r in range(rows):
        n = int(seqlens[r])
        pos = range(max(0, n - window) if window else 0, n)
        cols = [(p // page) % width if window else p // page for p in pos]
        slots = torch.tensor([int(tables[r, c]) * page + p % page for c, p in zip(cols, pos,
                                                                                   strict=True)])
        kr = k[slots].double().repeat_interleave(g, dim=1)  # [n, H, D]
        vr = v[slots].double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,nhd->hn", q[r].double(), kr) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[r] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vr)
    return out


@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_decode_kernel_reads_int8_in_place(dim: int, window: int, softcap) -> None:
    g = torch.Generator().manual_seed(dim + window)
    cache = _cache(head_dim=dim, num_blocks=20)
    slots = torch.arange(RESERVED_CHUNKS * PAGE, cache.num_slots)
    k = torch.randn(len(slots), 2, dim, generator=g) * 2
    v = torch.randn(len(slots), 2, dim, generator=g)
    cache.write(0, slots, k, v)
    rows, width = 5, 4 if window else 6
    tables = torch.randint(RESERVED_CHUNKS, cache.num_chunks, (rows, width), generator=g)
    seqlens = torch.randint(1, width * PAGE + 1, (rows,), generator=g)
    kd = _KernelDecode(tokens=None, block_tables=tables.int().numpy(),
                       seqlens=seqlens.int().numpy(), window=window)
    q = torch.randn(rows, 6, dim, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (the kernel's split over threads; restored for later tests)
    try:
        for out_dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-2)):
            out = torch.empty(rows, 6, dim, dtype=out_dtype)
            kernels.decode_kernel(q, cache.keys[0], cache.values[0], kd, out, PAGE, 0.25,
                                  softcap, (cache.key_scales[0], cache.value_scales[0]))
            kf, vf = torch.empty(cache.num_slots, 2, dim), torch.empty(cache.num_slots, 2, dim)
            cache.read_slots(0, torch.arange(cache.num_slots), kf, vf)
            want = _reference(q, kf, vf, tables, seqlens, PAGE, window, 0.25, softcap)
            assert torch.allclose(out.double(), want, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


def test_decode_kernel_refuses_missing_scales() -> None:
    cache = _cache()
    kd = _KernelDecode(tokens=None, block_tables=np.full((1, 2), RESERVED_CHUNKS, np.int32),
                       seqlens=np.array([3], np.int32), window=0)
    out = torch.empty(1, 2, 16)
    with pytest.raises(FieldError, match="k_scales"):
        kernels.decode_kernel(torch.zeros(1, 2, 16), cache.keys[0], cache.values[0], kd, out,
                              PAGE, 1.0, None)
    with pytest.raises(FieldError, match="k_scales"):
        kernels.decode_kernel(torch.zeros(1, 2, 16), cache.keys[0], cache.values[0], kd, out,
                              PAGE, 1.0, None, (cache.key_scales[0][:-1], cache.value_scales[0]))


def test_int8_sizing_counts_the_scales() -> None:
    cfg = transformers.LlamaConfig(**{**tiny_models.COMMON, "num_hidden_layers": 24,
                                      "head_dim": 64})  # 24 layers, 2 KV heads of 64
    per = {d: memory.kv_bytes_per_chunk(cfg, 32, torch.bfloat16, d) for d in ("auto", "int8")}
    assert per["auto"] == 24 * 2 * 32 * 2 * 64 * 2
    assert per["int8"] == 24 * 2 * 32 * 2 * (64 + 4)
    cache = _cache(num_layers=24, page_size=32, head_dim=64, num_blocks=1)
    assert cache.bytes_per_chunk == per["int8"]
    assert cache.nbytes == cache.num_chunks * per["int8"]
    blocks = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kv in ("auto", "int8"):
            blocks[(dtype, kv)], why = memory.choose_num_blocks(
                cfg, page_size=32, max_batch_tokens=64, max_requests_per_batch=4,
                max_memory_percent=1.0, free_bytes=4 << 30, dtype=dtype,
                max_model_len=1 << 30, kv_cache_dtype=kv)
            assert (kv == "int8") == ("int8" in why)
    # the same budget: bf16 2*64 bytes a (slot, head) -> 64 + 4 (+ the bf16 gather
    # workspace, 1.5/24 of a bf16 chunk); fp32 4*64 -> 64 + 4 (+ an fp32 workspace)
    bf16 = blocks[(torch.bfloat16, "int8")] / blocks[(torch.bfloat16, "auto")]
    f32 = blocks[(torch.float32, "int8")] / blocks[(torch.float32, "auto")]
    assert 1.75 < bf16 < 1.85 and 3.1 < f32 < 3.35


def test_int8_is_cpu_only() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        _cache(device="cuda")
    with pytest.raises(ValueError, match="kv_dtype"):
        _cache(kv_dtype="int4")
