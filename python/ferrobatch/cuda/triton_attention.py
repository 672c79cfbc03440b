"""Paged attention over ferrobatch's KV cache for CUDA: Triton kernels, a flash-attn wrapper,
and a pure-torch reference (the test oracle and the last-resort backend).

Cache layout (ARCHITECTURE.md §2): per layer, `k_cache` / `v_cache` are
`[(num_blocks + 2) * page_size, num_kv_heads, head_dim]` slot tensors; chunk 0 is all zeros,
chunk 1 takes padding writes. Step metadata (ARCHITECTURE.md §3) is used as the plan gives
it: packed queries `q [T, H, D]`, `cu_seqlens_q [B+1]`, `seqlens_k [B]` (keys visible to the
row's last token, this step's tokens included), `block_tables [B, W]` int32 and the new keys
`k_new / v_new [T, Hkv, D]` of this step.

Key position `p` of row `r` lives at slot `table[r][c] * page_size + p % page_size` with
`c = p // page_size` for full attention and `c = (p // page_size) % ring` for a sliding
layer (`ring` = the ring's chunk count R, by default the table width): the core's rule
(`_core.table_columns` / `_core.slots`), which the host-side reference calls. The Triton
kernels and `static_decode_attention` (captured into CUDA graphs, so no host round trip)
compute the same column arithmetic on the device, in-kernel. A query at position
`q` sees keys `0 ..= q` (full) or `q - w + 1 ..= q` (sliding window `w`).

Order of work per layer and attention type (`paged_attention` does exactly this):

1. `paged_prefill_attention` for rows with more than one query token, **before** the new
   K/V are written: it reads a row's cached keys (positions `< start`, `start = seqlens_k -
   q_len`) from the paged cache and its new keys from `k_new / v_new`. A sliding ring only
   holds the last `w` positions cached before the step, and this step's writes may reuse
   ring slots that early queries of a long chunk still need, so new keys never come from
   the cache. (Full attention could read them from the cache either way.)
2. `write_kv`: the new K/V go to `slot_mapping` (tokens the ring will not keep, and padding
   tokens, are mapped to the scratch chunk by the plan).
3. `paged_decode_attention` for single-token rows, **after** the write: every key is in the
   cache (the new token's write lands in a ring slot no visible key needs). Long contexts
   are split across `num_splits` programs per (row, KV head) and reduced by a second kernel
   (split-K / flash-decoding).

Both kernels take every row of the batch and skip the rows that belong to the other kernel
(`q_len != 1` for decode, `q_len < min_q_len` for prefill) on the device, so one launch
configuration serves any mix of rows: the grid only depends on (B, max query length,
heads, splits), which is what a CUDA graph needs.

Backends (`select_backend`): "flash_attn" (flash-attn's paged kernels, `flash_attn_with_kvcache`
for decode-only steps and `flash_attn_varlen_func` otherwise; full attention and pages that
are a multiple of 256 only, as flash-attn 2 requires), "triton" (the kernels here), "torch"
(`reference_paged_attention`, gather + SDPA per row, correct and slow; decode-only steps with
a known max key length use `static_decode_attention`, fixed-shape and CUDA-graph capturable).

Numerics: fp32 inputs use IEEE fp32 dot products (no TF32); fp16/bf16 inputs accumulate in
fp32 and cast the probabilities to the value dtype for the second product.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch
import torch.nn.functional as F

from ferrobatch import _core

try:  # triton is optional: the engine runs on CPU without it
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - any import failure means "no triton"
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "choose_num_splits",
    "flash_attn_available",
    "flash_attn_paged_attention",
    "flash_attn_paged_decode",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference_paged_attention",
    "select_backend",
    "static_decode_attention",
    "write_kv",
]

def _interpreter_scalar_bounds() -> None:
    """Let triton's interpreter (`TRITON_INTERPRET=1`, CPU tests and `gpu_check --smoke`)
    take loop bounds that are tensors, as the kernels' `range(s_lo, s_hi, BLOCK_N)` loops
    have. The interpreter turns a scalar tensor into a Python int with `int(data)`, and its
    scalars are 1-element numpy arrays, which numpy >= 2.4 refuses to convert (triton 3.7
    squeezes them first; 3.6, the GPU machine's version, does not). This patches the
    interpreter's scalar conversion to take the one element. Only the interpreter is
    touched: compiled kernels (the GPU path) never call it, and the kernels' source, so
    what they compile to, is the same either way."""
    try:
        # local: triton's interpreter, only under TRITON_INTERPRET=1 (triton is optional)
        from triton.runtime import interpreter as interp
    except Exception:  # noqa: BLE001 - no interpreter in this triton
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_ferrobatch_scalars", False):
        return

    def patch_lang_tensor(tensor: object, scope: object) -> None:
        orig(tensor, scope)
        scope.set_attr(  # type: ignore[attr-defined]
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patch_lang_tensor._ferrobatch_scalars = True  # type: ignore[attr-defined]
    interp._patch_lang_tensor = patch_lang_tensor


if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalar_bounds()

_NEG = -1.0e30  # "minus infinity" for running maxima: finite, so max - max never makes NaN
# Kernels read module globals only when they are constexpr.
_NEG_CONST = tl.constexpr(_NEG) if HAS_TRITON else _NEG


# ------------------------------------------------------------------------ backend choice


def flash_attn_available() -> bool:
    """Whether `flash_attn` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def select_backend(
    device: torch.device | str, *, page_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """The attention backend for `device`: "flash_attn" when flash-attn is installed (and,
    when `page_size` is given, it is a multiple of 256, which flash-attn 2's paged kernel
    requires, and when `dtype` is given, it is fp16 or bf16: flash-attn has no fp32
    kernels), else "triton" on CUDA when triton imports, else "torch".

    "flash_attn" covers full-attention layers; sliding layers use the Triton kernels (or the
    torch reference without triton) under every backend, see `docs/cuda-wiring.md`.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return "torch"
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if flash_attn_available() and half and (page_size is None or page_size % 256 == 0):
        return "flash_attn"
    if HAS_TRITON:
        return "triton"
    return "torch"


def choose_num_splits(
    num_rows: int,
    num_kv_heads: int,
    max_seqlen_k: int,
    *,
    block_n: int = 64,
    num_sms: int = 132,
    max_splits: int = 16,
) -> int:
    """Decode split count: enough (row, KV head, split) programs to fill the GPU about twice,
    never more splits than key tiles; a power of two (few distinct CUDA-graph keys).

    A pure function of its integer arguments, so a CUDA-graph key that holds the padded row
    count and padded max key length determines it."""
    programs = max(1, num_rows * num_kv_heads)
    tiles = max(1, -(-max_seqlen_k // block_n))
    want = max(1, -(-2 * num_sms // programs))
    n = max(1, min(max_splits, tiles, want))
    return 1 << (n.bit_length() - 1)  # round down to a power of two


# ------------------------------------------------------------------------ torch reference


def reference_paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    ring_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every row, gather + SDPA per row, to run **before** the step's write.

    q `[T, H, D]`; k_new/v_new `[T, Hkv, D]`; caches `[slots, Hkv, D]`. A row's cached keys
    (positions `< start`) come from the cache through its block-table row (ring formula for
    sliding layers), its new keys from k_new/v_new. Returns `[T, H, D]` in q's dtype; tokens
    of no row (beyond `cu_seqlens_q[-1]`) are zero. Rows with no query token are skipped.
    """
    num_tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    ring = (ring_size or block_tables.shape[1]) if sliding_window else None
    if out is None:
        out = torch.zeros_like(q)
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    lens = [int(x) for x in seqlens_k.tolist()]
    tables = block_tables.cpu().numpy().astype(np.int32, copy=False)
    dev = q.device
    for r in range(len(lens)):
        s, e = cu[r], cu[r + 1]
        q_len = e - s
        if q_len <= 0:
            continue
        start = lens[r] - q_len
        if start < 0:
            raise ValueError(f"row {r}: seqlens_k {lens[r]} < query length {q_len}")
        c0 = max(0, start - sliding_window + 1) if sliding_window else 0
        # the core's slot rule (`_core.slots`: ring column for sliding layers), on the host
        pos = np.arange(c0, start)
        slots = _core.slots(tables, np.full(len(pos), r), pos, page_size, ring)
        slots = torch.from_numpy(slots).to(dev)
        k = torch.cat([k_cache.index_select(0, slots), k_new[s:e]]).float()  # [Lk, Hkv, D]
        v = torch.cat([v_cache.index_select(0, slots), v_new[s:e]]).float()
        qp = torch.arange(start, start + q_len, device=dev)[:, None]
        kp = torch.arange(c0, start + q_len, device=dev)[None, :]
        keep = kp <= qp
        if sliding_window:
            keep &= kp > qp - sliding_window
        qh = q[s:e].float().transpose(0, 1)  # [H, q, D]
        kh = k.transpose(0, 1).repeat_interleave(group, 0)  # [H, Lk, D]
        vh = v.transpose(0, 1).repeat_interleave(group, 0)
        if softcap:
            scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~keep, float("-inf"))
            o = torch.matmul(torch.softmax(scores, -1), vh)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=scale)
        out[s:e] = o.transpose(0, 1).to(out.dtype)
    return out


def static_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    max_seqlen_k: int,
    page_size: int,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    ring_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode for the single-token rows in pure torch with shapes fixed by (B, T,
    `max_seqlen_k`): no host sync, no data-dependent shape, so it can be captured in a CUDA
    graph (the SDPA last resort under graphs). Run **after** `write_kv`.

    Every row gathers `K = max_seqlen_k` key positions (`min(max_seqlen_k, w)` for a
    sliding layer) through its table and masks those beyond its length: **keys past
    `max_seqlen_k` are never read**, which is why `max_seqlen_k` must be in the graph key.
    Tokens of rows with other query lengths keep `out`'s values.
    """
    num_tokens, heads, dim = q.shape
    rows = seqlens_k.shape[0]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if out is None:
        out = torch.zeros_like(q)
    dev = q.device
    cu = cu_seqlens_q.long()
    lens = seqlens_k.long()[:, None]  # [B, 1]
    is_decode = (cu[1:] - cu[:-1]) == 1  # [B]
    if sliding_window:
        keys = max(1, min(int(max_seqlen_k), int(sliding_window)))
        pos = lens - keys + torch.arange(keys, device=dev)[None, :]  # last `keys` positions
        valid = (pos >= 0) & (pos >= lens - sliding_window)
        ring = int(ring_size or block_tables.shape[1])
    else:
        keys = max(1, int(max_seqlen_k))
        pos = torch.arange(keys, device=dev)[None, :].expand(rows, keys)
        valid = pos < lens
        ring = 0
    pos = pos.clamp(min=0)
    col = torch.div(pos, page_size, rounding_mode="floor")
    # the core's column rule (`_core.table_columns`) on the device: this runs inside graphs
    col = col % ring if ring else col.clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.long().gather(1, col) * page_size + pos % page_size  # [B, K]
    k = k_cache.index_select(0, slots.reshape(-1)).view(rows, keys, kv_heads, dim)
    v = v_cache.index_select(0, slots.reshape(-1)).view(rows, keys, kv_heads, dim)
    tok = torch.where(is_decode, cu[:-1], torch.full_like(cu[:-1], num_tokens))  # T = dummy
    qr = torch.cat([q, q.new_zeros(1, heads, dim)]).index_select(0, tok)  # [B, H, D]
    qg = qr.view(rows, kv_heads, group, dim).float()
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1).float()) * scale  # [B, Hkv, G, K]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid[:, None, None, :], _NEG)  # finite: empty rows stay finite
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v.permute(0, 2, 1, 3).float()).reshape(rows, heads, dim)
    staged = torch.zeros(num_tokens + 1, heads, dim, dtype=out.dtype, device=dev)
    staged.index_copy_(0, tok, o.to(out.dtype))
    mask = torch.zeros(num_tokens + 1, dtype=torch.bool, device=dev)
    mask.index_fill_(0, tok, True)
    out.copy_(torch.where(mask[:num_tokens, None, None], staged[:num_tokens], out))
    return out


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's new K/V `[T, Hkv, D]` to their slots (`slot_mapping [T]`)."""
    idx = slot_mapping.long() if slot_mapping.dtype != torch.long else slot_mapping
    k_cache.index_copy_(0, idx, k_new.to(k_cache.dtype))
    v_cache.index_copy_(0, idx, v_new.to(v_cache.dtype))


# ------------------------------------------------------------------------ triton kernels

if HAS_TRITON:

    @triton.jit
    def _scores(q, k, scale, softcap, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
        """q [M, D] @ k[N, D]^T, scaled, optionally soft-capped, in log2 units."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): finite for every finite x.
            x = s / softcap
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
        return s * 1.4426950408889634

    # Integer arguments that change from step to step are not specialised (triton compiles
    # a variant per value == 1 / % 16 == 0 of a specialised integer): the table width
    # `stride_tb` (eager steps: whatever the longest row needs; graphs: the bucket's).
    @triton.jit(do_not_specialize=["stride_tb"])
    def _decode_kernel(
        Q, K, V, TABLE, CU, SEQLENS, OUT, PART_ACC, PART_M, PART_L,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
        stride_tb, stride_ot, stride_oh,
        scale, softcap, window, ring, page_size, num_heads,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One program per (row, KV head, split): the GROUP query heads of that KV head over
        the split's share of the row's keys. With one split it writes the output; else the
        unnormalized partial sum, running max and sum for `_reduce_kernel`."""
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        q_tok = tl.load(CU + row)
        q_len = tl.load(CU + row + 1) - q_tok
        if q_len != 1:
            return
        total = tl.load(SEQLENS + row)
        lo = 0
        if SLIDING:
            lo = tl.maximum(total - window, 0)
        per_split = tl.cdiv(tl.cdiv(total - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        s_lo = lo + split * per_split
        s_hi = tl.minimum(s_lo + per_split, total)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        q_ptrs = Q + q_tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

        m_i = tl.full([BLOCK_G], _NEG_CONST, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(s_lo, s_hi, BLOCK_N):
            pos = start + offs_n
            k_mask = pos < s_hi
            # the core's column rule (`_core.table_columns`), in-kernel
            col = pos // page_size
            if SLIDING:
                col = col % ring
            blk = tl.load(TABLE + row * stride_tb + col, mask=k_mask, other=0)
            slot = blk.to(tl.int64) * page_size + pos % page_size
            kv_mask = k_mask[:, None] & d_mask[None, :]
            k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            s = _scores(q, k, scale, softcap, SOFTCAP, IEEE)
            s = tl.where(k_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            o_ptrs = (OUT + q_tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                      + offs_d[None, :])
            tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        else:
            base = (row * num_heads + heads).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_G]
            tl.store(PART_M + base, m_i, mask=g_mask)
            tl.store(PART_L + base, l_i, mask=g_mask)
            tl.store(PART_ACC + base[:, None] * BLOCK_D + offs_d[None, :], acc,
                     mask=g_mask[:, None])

    @triton.jit
    def _reduce_kernel(
        CU, OUT, PART_ACC, PART_M, PART_L, stride_ot, stride_oh, num_heads,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """One program per (row, query head): merge the splits' partial softmax sums."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        q_tok = tl.load(CU + row)
        if tl.load(CU + row + 1) - q_tok != 1:
            return
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < NUM_SPLITS
        base = (row * num_heads + head).to(tl.int64) * NUM_SPLITS + offs_s
        m = tl.load(PART_M + base, mask=s_mask, other=_NEG_CONST)
        l_s = tl.load(PART_L + base, mask=s_mask, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
        denom = tl.sum(w * l_s, 0)
        acc = tl.load(PART_ACC + base[:, None] * BLOCK_D + offs_d[None, :],
                      mask=s_mask[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(OUT + q_tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
                 o.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)

    @triton.jit(do_not_specialize=["stride_tb", "min_q_len"])
    def _prefill_kernel(
        Q, KN, VN, K, V, TABLE, CU, SEQLENS, OUT,
        stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
        stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_ot, stride_oh,
        scale, softcap, window, ring, page_size, min_q_len,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One program per (row, query tile, query head): causal attention of BLOCK_M query
        tokens over the row's cached keys (paged cache) and its new keys (KN / VN)."""
        row = tl.program_id(0)
        tile = tl.program_id(1)
        head = tl.program_id(2)
        q_tok = tl.load(CU + row)
        q_len = tl.load(CU + row + 1) - q_tok
        if (q_len < min_q_len) | (tile * BLOCK_M >= q_len):
            return
        kvh = head // GROUP
        ctx = tl.load(SEQLENS + row) - q_len  # cached keys before this step

        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q_pos = ctx + offs_m
        q_ptrs = (Q + (q_tok + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh
                  + offs_d[None, :])
        q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

        hi = ctx + tl.minimum((tile + 1) * BLOCK_M, q_len)  # last query position + 1
        lo = 0
        if SLIDING:
            lo = tl.maximum(ctx + tile * BLOCK_M - window + 1, 0)
        m_i = tl.full([BLOCK_M], _NEG_CONST, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            in_range = pos < hi
            cached = in_range & (pos < ctx)
            new = in_range & (pos >= ctx)
            # the core's column rule (`_core.table_columns`), in-kernel
            col = pos // page_size
            if SLIDING:
                col = col % ring
            blk = tl.load(TABLE + row * stride_tb + col, mask=cached, other=0)
            slot = blk.to(tl.int64) * page_size + pos % page_size
            new_tok = (q_tok + pos - ctx).to(tl.int64)
            c_mask = cached[:, None] & d_mask[None, :]
            n_mask = new[:, None] & d_mask[None, :]
            k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=c_mask, other=0.0)
            k += tl.load(KN + new_tok[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :],
                         mask=n_mask, other=0.0)
            s = _scores(q, k, scale, softcap, SOFTCAP, IEEE)
            keep = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
            if SLIDING:
                keep = keep & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=c_mask, other=0.0)
            v += tl.load(VN + new_tok[:, None] * stride_vnt + kvh * stride_vnh + offs_d[None, :],
                         mask=n_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = (OUT + (q_tok + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh
                  + offs_d[None, :])
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use backend 'torch'")


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, (int(n) - 1).bit_length()))


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("attention tensors need a contiguous last (head_dim) dimension")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    ring_size: int | None = None,
    num_splits: int = 1,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Split-K paged decode for the single-token rows of a packed batch (run **after**
    `write_kv`). Writes `out[cu_seqlens_q[r]]` for every row `r` with one query token; other
    tokens of `out` are left as they are. `workspace` (partial acc, max, sum) can be passed
    to keep allocations out of a captured graph; see `decode_workspace`."""
    _require_triton()
    _check_last_dim(q, k_cache, v_cache)
    num_tokens, heads, dim = q.shape
    rows = seqlens_k.shape[0]
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError("query heads must be a multiple of KV heads")
    if out is None:
        out = torch.zeros_like(q)
    if rows == 0:
        return out
    sliding = bool(sliding_window)
    ring = int(ring_size or block_tables.shape[1]) if sliding else 0
    block_d = _pow2(dim)
    num_splits = max(1, int(num_splits))
    if num_splits > 1:
        acc, m, lsum = workspace or decode_workspace(rows, heads, dim, num_splits, q.device)
    else:
        acc = m = lsum = out  # unused by the kernel
    group = heads // kv_heads
    _decode_kernel[(rows, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, out, acc, m, lsum,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), ring, int(page_size),
        heads,
        GROUP=group, HEAD_DIM=dim, BLOCK_G=_pow2(group), BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, SLIDING=sliding, SOFTCAP=bool(softcap),
        IEEE=q.dtype == torch.float32,
    )
    if num_splits > 1:
        _reduce_kernel[(rows, heads)](
            cu_seqlens_q, out, acc, m, lsum, out.stride(0), out.stride(1), heads,
            HEAD_DIM=dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=_pow2(num_splits, 2),
        )
    return out


def decode_workspace(
    rows: int, heads: int, dim: int, num_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial-result buffers of a split decode: acc `[rows*heads*splits, pow2(dim)]`, running
    max and sum `[rows*heads*splits]` (fp32)."""
    n = rows * heads * num_splits
    return (
        torch.empty(n, _pow2(dim), dtype=torch.float32, device=device),
        torch.empty(n, dtype=torch.float32, device=device),
        torch.empty(n, dtype=torch.float32, device=device),
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int,
    page_size: int,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    ring_size: int | None = None,
    min_q_len: int = 2,
    block_m: int = 64,
    block_n: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length causal attention of the rows with at least `min_q_len` query tokens
    (run **before** `write_kv`): cached keys from the paged cache, new keys from `k_new /
    v_new`. `max_seqlen_q` (an upper bound is fine) sizes the grid. Writes those rows'
    tokens of `out`; other tokens are left as they are."""
    _require_triton()
    _check_last_dim(q, k_new, v_new, k_cache, v_cache)
    num_tokens, heads, dim = q.shape
    rows = seqlens_k.shape[0]
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError("query heads must be a multiple of KV heads")
    if out is None:
        out = torch.zeros_like(q)
    if rows == 0 or max_seqlen_q < max(1, min_q_len):
        return out
    if k_new.dtype != k_cache.dtype:
        k_new, v_new = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype)
    sliding = bool(sliding_window)
    ring = int(ring_size or block_tables.shape[1]) if sliding else 0
    block_d = _pow2(dim)
    if block_d > 128:  # keep the fp32 accumulator tile within registers for head_dim 256
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    grid = (rows, triton.cdiv(int(max_seqlen_q), block_m), heads)
    _prefill_kernel[grid](
        q, k_new, v_new, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, out,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), ring, int(page_size),
        int(min_q_len),
        GROUP=heads // kv_heads, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_D=block_d,
        BLOCK_N=block_n, SLIDING=sliding, SOFTCAP=bool(softcap),
        IEEE=q.dtype == torch.float32,
    )
    return out


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int,
    page_size: int,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    ring_size: int | None = None,
    num_splits: int = 1,
    backend: str = "triton",
    block_m: int = 64,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """One layer's attention for a packed step, cache write included, in the safe order:
    prefill rows (before the write) → `write_kv` → decode rows (after the write).

    `backend`: "triton", "torch" or "flash_attn" (full attention only: write, then
    flash-attn's paged varlen kernel over all rows; needs `max_seqlen_k`). "torch" runs
    `static_decode_attention` after the write for a decode-only step when `max_seqlen_k` is
    given (capturable), else `reference_paged_attention` before the write.
    `max_seqlen_q` must bound every row's query length (1 = decode-only step: no prefill
    launch). Returns `[T, H, D]`; tokens of no row are zero when `out` is not given."""
    if out is None:
        out = torch.zeros_like(q)
    if backend == "torch" and max_seqlen_q == 1 and max_seqlen_k is not None:
        # Decode-only step with a known (padded) max key length: fixed shapes, capturable.
        write_kv(k_cache, v_cache, k_new, v_new, slot_mapping)
        return static_decode_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k,
            max_seqlen_k=max_seqlen_k, page_size=page_size, scale=scale, softcap=softcap,
            sliding_window=sliding_window, ring_size=ring_size, out=out,
        )
    if backend == "torch":
        reference_paged_attention(
            q, k_new, v_new, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k,
            page_size=page_size, scale=scale, softcap=softcap, sliding_window=sliding_window,
            ring_size=ring_size, out=out,
        )
        write_kv(k_cache, v_cache, k_new, v_new, slot_mapping)
        return out
    if backend == "flash_attn" and not sliding_window:
        write_kv(k_cache, v_cache, k_new, v_new, slot_mapping)
        if max_seqlen_q == 1 and q.shape[0] == seqlens_k.shape[0]:
            # Decode-only step (one token per row, as padded decode plans are too).
            return flash_attn_paged_decode(
                q, k_cache, v_cache, block_tables, seqlens_k, page_size=page_size,
                scale=scale, softcap=softcap, out=out,
            )
        if max_seqlen_k is None:
            raise ValueError("the flash_attn backend needs max_seqlen_k")
        return flash_attn_paged_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, page_size=page_size,
            scale=scale, softcap=softcap, out=out,
        )
    if backend not in ("triton", "flash_attn"):
        raise ValueError(f"unknown attention backend {backend!r}")
    if max_seqlen_q > 1:
        paged_prefill_attention(
            q, k_new, v_new, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k,
            max_seqlen_q=max_seqlen_q, page_size=page_size, scale=scale, softcap=softcap,
            sliding_window=sliding_window, ring_size=ring_size, block_m=block_m,
            block_n=block_n, out=out,
        )
    write_kv(k_cache, v_cache, k_new, v_new, slot_mapping)
    paged_decode_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, page_size=page_size,
        scale=scale, softcap=softcap, sliding_window=sliding_window, ring_size=ring_size,
        num_splits=num_splits, block_n=block_n, out=out,
    )
    return out


# ------------------------------------------------------------------------ flash-attn


def flash_attn_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    page_size: int,
    scale: float,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full attention of every row through `flash_attn_varlen_func(..., block_table=...)`,
    run **after** `write_kv` (it reads every key, new ones included, from the cache).

    UNTESTED on a GPU from this repository (CI has no GPU and no flash-attn); parity is
    checked by `benches/gpu_check.py` when flash-attn is installed there. Requirements:
    CUDA fp16/bf16 tensors, `page_size % 256 == 0` (flash-attn 2's paged kernel), int32
    tables and lengths. Sliding rings are not linear page lists, so sliding layers do not
    come here (see `paged_attention`).
    """
    try:
        # local: flash-attn is optional (CUDA only), imported where it is called
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("flash_attn is not installed") from exc
    if page_size % 256:
        raise ValueError("flash-attn's paged kernel needs page_size % 256 == 0")
    num_slots, kv_heads, dim = k_cache.shape
    k_pages = k_cache.view(num_slots // page_size, page_size, kv_heads, dim)
    v_pages = v_cache.view(num_slots // page_size, page_size, kv_heads, dim)
    lens = seqlens_k.to(torch.int32)
    cu_k = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, out=cu_k[1:])
    res = flash_attn_varlen_func(
        q, k_pages, v_pages,
        cu_seqlens_q.to(torch.int32), cu_k, int(max_seqlen_q), int(max_seqlen_k),
        dropout_p=0.0, softmax_scale=float(scale), causal=True,
        softcap=float(softcap or 0.0), block_table=block_tables.to(torch.int32),
    )
    if out is None:
        return res
    out.copy_(res)
    return out


def flash_attn_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    softcap: float | None = None,
    num_splits: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode-only step (row `r` = token `r`) through `flash_attn_with_kvcache` with a block
    table, run **after** `write_kv`; flash-attn splits long contexts itself (`num_splits=0`:
    its heuristic). Same requirements and the same caveat as `flash_attn_paged_attention`:
    not run on a GPU from this repository."""
    try:
        # local: flash-attn is optional (CUDA only), imported where it is called
        from flash_attn import flash_attn_with_kvcache
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("flash_attn is not installed") from exc
    if page_size % 256:
        raise ValueError("flash-attn's paged kernel needs page_size % 256 == 0")
    num_slots, kv_heads, dim = k_cache.shape
    res = flash_attn_with_kvcache(
        q.unsqueeze(1),  # [B, 1, H, D]
        k_cache.view(num_slots // page_size, page_size, kv_heads, dim),
        v_cache.view(num_slots // page_size, page_size, kv_heads, dim),
        cache_seqlens=seqlens_k.to(torch.int32),
        block_table=block_tables.to(torch.int32),
        softmax_scale=float(scale),
        causal=True,
        softcap=float(softcap or 0.0),
        num_splits=int(num_splits),
    ).squeeze(1)
    if out is None:
        return res
    out.copy_(res)
    return out
