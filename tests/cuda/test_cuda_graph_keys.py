"""ferrobatch.cuda.graphs on CPU: padding arithmetic, padded plans, the graph-cache key (every
shape integer, max key length included), LRU eviction, and that padded steps give the real
rows the same logits as unpadded ones (a toy paged model through the torch attention).

Capture itself needs CUDA; here a "graph" is a closure that bakes in its key's integers the
way a captured graph bakes in its shapes. One test captures a real CUDA graph when a GPU is
present.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # ferrobatch.cuda defines its Triton kernels on import; without CUDA they can only run
    # interpreted (tests/cuda/test_triton_attention.py), which must be decided before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")
from ferrobatch import _core, defaults  # noqa: E402
from ferrobatch.config import ContinuousBatchingConfig  # noqa: E402
from ferrobatch.cuda import graphs  # noqa: E402
from ferrobatch.cuda import triton_attention as ta  # noqa: E402
from ferrobatch.cuda.graphs import GraphBuckets, GraphCache, GraphKey, dummy_plan, pad_plan  # noqa: E402
from ref_planner import FULL, SLIDING, RefPlanner  # noqa: E402

torch.set_num_threads(1)

PAGE = 4
WINDOW = 5


# ----------------------------------------------------------------------------- arithmetic


def test_padding_arithmetic():
    b = GraphBuckets(q_interval=8, kv_interval=32)
    assert [b.pad_tokens(n) for n in (0, 1, 2, 3, 5, 8, 9, 16, 17, 100)] == [
        0, 1, 2, 4, 8, 8, 16, 16, 24, 104,
    ]
    assert [b.pad_kv(n) for n in (0, 1, 32, 33, 64, 65)] == [32, 32, 32, 64, 64, 96]
    cfg = ContinuousBatchingConfig(q_padding_interval_size=16, kv_padding_interval_size=512,
                                   max_requests_per_batch=100)
    fb = GraphBuckets.from_config(cfg, num_kv_heads=2)
    assert (fb.q_interval, fb.kv_interval, fb.max_rows, fb.num_kv_heads) == (16, 512, 112, 2)
    d = GraphBuckets.from_config(ContinuousBatchingConfig())
    assert (d.q_interval, d.kv_interval) == (
        defaults.DEFAULT_Q_INTERVAL, defaults.DEFAULT_KV_INTERVAL
    )
    with pytest.raises(ValueError):
        GraphBuckets(q_interval=0)


def _planner(types=(FULL, SLIDING)) -> RefPlanner:
    window = WINDOW if SLIDING in types else None
    return RefPlanner(page_size=PAGE, num_blocks=120, layer_types=list(types),
                      sliding_window=window)


def _decode_plan(lengths, types=(FULL, SLIDING)):
    pl = _planner(types)
    for i, n in enumerate(lengths):
        pl.add(f"r{i}", [7] * n)
    pl.plan([(f"r{i}", n - 1) for i, n in enumerate(lengths) if n > 1])
    return pl.plan([(f"r{i}", 1) for i in range(len(lengths))])


def test_pad_decode_plan_layout():
    plan = _decode_plan([3, 9, 1, 14, 6])  # B = T = N = 5
    b = GraphBuckets(q_interval=4, kv_interval=8, num_kv_heads=2)
    p = pad_plan(plan, b, page_size=PAGE, sliding_window=WINDOW)
    assert p is not None and (p.num_tokens, p.num_rows, p.num_logits) == (5, 5, 5)
    k = p.key
    assert (k.tokens, k.rows, k.logits_rows, k.max_seqlen_q, k.max_seqlen_k) == (8, 8, 8, 1, 16)
    assert dict(k.table_widths) == {FULL: 4, SLIDING: plan.block_tables[SLIDING].shape[1]}
    # Real rows untouched.
    assert np.array_equal(p.cu_seqlens_q[:6], plan.cu_seqlens_q)
    assert np.array_equal(p.seqlens_k[:5], plan.seqlens_k)
    assert np.array_equal(p.input_ids[:5], plan.input_ids)
    assert np.array_equal(p.positions[:5], plan.positions)
    assert np.array_equal(p.logits_indices[:5], plan.logits_indices)
    for typ in (FULL, SLIDING):
        w = plan.block_tables[typ].shape[1]
        assert np.array_equal(p.block_tables[typ][:5, :w], plan.block_tables[typ])
        assert not p.block_tables[typ][5:].any() and not p.block_tables[typ][:, w:].any()
        assert np.array_equal(p.slot_mapping[typ][:5], plan.slot_mapping[typ])
        # Padding tokens write into the scratch chunk, one slot each (mod page).
        assert p.slot_mapping[typ][5:].tolist() == [PAGE + i % PAGE for i in range(5, 8)]
    # Padding: one single-token row per padding token reading one key (zero chunk).
    assert p.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert p.seqlens_k[5:].tolist() == [1, 1, 1]
    assert p.positions[5:].tolist() == [0, 0, 0] and p.input_ids[5:].tolist() == [0, 0, 0]
    assert all(a.dtype == np.int32 and a.flags.c_contiguous for a in p.arrays().values())


def test_pad_mixed_plan():
    pl = _planner()
    for i, n in enumerate([11, 3, 6]):
        pl.add(f"r{i}", [7] * n)
    plan = pl.plan([("r0", 11), ("r1", 2), ("r2", 6)])  # T = 19, B = 3, N = 2
    assert pad_plan(plan, GraphBuckets(q_interval=8), page_size=PAGE) is None  # decode_only
    b = GraphBuckets(q_interval=8, kv_interval=8, decode_only=False)
    p = pad_plan(plan, b, page_size=PAGE, sliding_window=WINDOW)
    k = p.key
    assert (k.tokens, k.max_seqlen_q, k.logits_rows) == (24, 16, 2)
    assert k.rows == b.pad_tokens(3 + 5) == 8
    assert p.cu_seqlens_q.tolist() == [0, 11, 13, 19, 20, 21, 22, 23, 24]
    assert p.seqlens_k.tolist() == [11, 2, 6, 1, 1, 1, 1, 1]
    assert np.array_equal(p.logits_indices[:2], plan.logits_indices)
    assert pad_plan(plan, GraphBuckets(q_interval=8, max_tokens=16, decode_only=False),
                    page_size=PAGE) is None


def _widen(plan, typ: str, width: int):
    t = plan.block_tables[typ]
    wide = np.zeros((t.shape[0], width), np.int32)
    wide[:, : t.shape[1]] = t
    plan.block_tables = {**plan.block_tables, typ: wide}
    return plan


def test_plans_differing_only_in_max_kv_length_get_different_keys():
    b = GraphBuckets(q_interval=4, kv_interval=8)
    short = _widen(_decode_plan([3, 5, 7, 2], types=(FULL,)), FULL, 6)
    long = _decode_plan([3, 5, 21, 2], types=(FULL,))
    assert long.block_tables[FULL].shape[1] == 6
    ks = pad_plan(short, b, page_size=PAGE).key
    kl = pad_plan(long, b, page_size=PAGE).key
    # Same T, B, N, table width, splits: only the max key length tells them apart.
    assert ks != kl
    assert (ks.max_seqlen_k, kl.max_seqlen_k) == (8, 24)
    assert dataclasses.replace(ks, max_seqlen_k=0) == dataclasses.replace(kl, max_seqlen_k=0)
    # Within one kv bucket the key is shared (that is the point of padding).
    same = _widen(_decode_plan([3, 5, 6, 2], types=(FULL,)), FULL, 6)
    assert pad_plan(same, b, page_size=PAGE).key == ks


def test_key_changes_with_every_shape_integer():
    b = GraphBuckets(q_interval=4, kv_interval=8, num_kv_heads=1, num_sms=16, block_n=4)
    base = pad_plan(_decode_plan([3, 5, 7]), b, page_size=PAGE, sliding_window=WINDOW).key
    more_rows = pad_plan(_decode_plan([3, 5, 7, 4, 4]), b, page_size=PAGE,
                         sliding_window=WINDOW).key
    assert more_rows.tokens != base.tokens and more_rows.rows != base.rows
    longer = pad_plan(_decode_plan([3, 5, 30]), b, page_size=PAGE, sliding_window=WINDOW).key
    assert longer.max_seqlen_k != base.max_seqlen_k
    assert dict(longer.table_widths)[FULL] != dict(base.table_widths)[FULL]
    assert dict(longer.num_splits)[FULL] != dict(base.num_splits)[FULL]  # few SMs: splits grow
    assert dict(longer.num_splits)[SLIDING] == dict(base.num_splits)[SLIDING]  # window caps
    plan = _decode_plan([3, 5, 7])
    plan.logits_indices, plan.logits_rows = plan.logits_indices[:1], plan.logits_rows[:1]
    fewer_logits = pad_plan(plan, b, page_size=PAGE, sliding_window=WINDOW).key
    assert fewer_logits.logits_rows != base.logits_rows
    assert {f.name for f in dataclasses.fields(GraphKey)} == {
        "tokens", "rows", "logits_rows", "max_seqlen_q", "max_seqlen_k", "table_widths",
        "num_splits", "page_size",
    }


def test_dummy_plan_matches_key_and_touches_only_scratch():
    for decode_only, lengths in ((True, [3, 9, 1]), (False, None)):
        b = GraphBuckets(q_interval=4, kv_interval=8, decode_only=decode_only)
        if lengths:
            plan = _decode_plan(lengths)
        else:
            pl = _planner()
            pl.add("a", [7] * 13)
            plan = pl.plan([("a", 13)])
        key = pad_plan(plan, b, page_size=PAGE, sliding_window=WINDOW).key
        d = dummy_plan(key)
        assert d.key == key and len(d.input_ids) == key.tokens
        assert len(d.cu_seqlens_q) == key.rows + 1 and d.cu_seqlens_q[-1] == key.tokens
        assert np.diff(d.cu_seqlens_q).max() <= key.max_seqlen_q
        assert np.array_equal(d.seqlens_k, np.diff(d.cu_seqlens_q))
        for typ, width in key.table_widths:
            assert d.block_tables[typ].shape == (key.rows, width)
            assert not d.block_tables[typ].any()
            assert ((d.slot_mapping[typ] // PAGE) == _core.SCRATCH_CHUNK).all()
        assert len(d.logits_indices) == key.logits_rows


def test_static_inputs_start_16_byte_aligned_and_round_trip():
    """Triton specialises pointers on 16-byte alignment: every static input view must start
    on one (rows 5 and 3 give odd-sized arrays), and loading a plan must land each array in
    its own view unchanged."""
    b = GraphBuckets(q_interval=4, kv_interval=8, num_kv_heads=2)
    for lengths in ([3, 9, 1, 14, 6], [2, 5, 3]):
        padded = pad_plan(_decode_plan(lengths), b, page_size=PAGE, sliding_window=WINDOW)
        inputs = graphs.StaticInputs(padded.key, "cpu")
        base = inputs.flat.data_ptr()
        assert base % 16 == 0
        for name, t in inputs.tensors.items():
            assert (t.data_ptr() - base) % 16 == 0, name
        inputs.load(padded)
        for name, arr in padded.arrays().items():
            assert np.array_equal(inputs.tensors[name].numpy(), arr), name


# ----------------------------------------------------------------------------- the cache


def test_graph_cache_lru_bound_and_release():
    captured, released = [], []

    def capture(key):
        captured.append(key)
        return {"key": key}

    cache = GraphCache(capture, max_graphs=2, release=released.append)
    keys = [GraphKey(t, t, t, 1, 16, (), (), PAGE) for t in (1, 2, 4)]
    assert cache.get(keys[0])["key"] == keys[0]
    cache.get(keys[1])
    cache.get(keys[0])  # hit: keys[0] becomes most recent
    cache.get(keys[2])  # evicts keys[1], the least recently used
    assert cache.keys() == [keys[0], keys[2]] and keys[1] not in cache
    assert released == [{"key": keys[1]}]
    assert cache.stats() == {"graphs": 2, "graph_hits": 1, "graph_misses": 3,
                             "graph_evictions": 1}
    cache.get(keys[1])  # recaptured
    assert captured == [keys[0], keys[1], keys[2], keys[1]] and len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and len(released) == 4
    with pytest.raises(ValueError):
        GraphCache(capture, max_graphs=0)


# ----------------------------------------------------------------------------- toy model


class ToyPagedLM:
    """Embedding + position embedding, one attention layer per entry of `types` over its own
    paged K/V, output head. Enough to check that padding leaves real rows' logits and the
    cache's data chunks exactly as an unpadded step does."""

    def __init__(self, types=(FULL, SLIDING), num_blocks=120, seed=0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.types = list(types)
        self.heads, self.kv_heads, self.dim, dm, vocab = 4, 2, 8, 32, 50
        r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
        self.emb, self.pos = r(vocab, dm), r(256, dm)
        self.layers = [
            (r(dm, self.heads * self.dim), r(dm, self.kv_heads * self.dim),
             r(dm, self.kv_heads * self.dim), r(self.heads * self.dim, dm))
            for _ in self.types
        ]
        self.head = r(dm, vocab)
        slots = (num_blocks + 2) * PAGE
        self.k = [torch.zeros(slots, self.kv_heads, self.dim) for _ in self.types]
        self.v = [torch.zeros(slots, self.kv_heads, self.dim) for _ in self.types]

    def clone_cache(self, other: ToyPagedLM) -> None:
        self.k = [t.clone() for t in other.k]
        self.v = [t.clone() for t in other.v]

    def forward(self, a: dict, *, max_seqlen_q: int, max_seqlen_k: int | None) -> torch.Tensor:
        """`a`: plan arrays by `PaddedPlan.arrays()` names (torch tensors)."""
        x = self.emb[a["input_ids"].long()] + self.pos[a["positions"].long()]
        t = x.shape[0]
        for i, (typ, (wq, wk, wv, wo)) in enumerate(zip(self.types, self.layers, strict=True)):
            q = (x @ wq).view(t, self.heads, self.dim)
            k = (x @ wk).view(t, self.kv_heads, self.dim)
            v = (x @ wv).view(t, self.kv_heads, self.dim)
            o = ta.paged_attention(
                q, k, v, self.k[i], self.v[i], a[f"slot_mapping/{typ}"],
                a[f"block_tables/{typ}"], a["cu_seqlens_q"], a["seqlens_k"],
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, page_size=PAGE,
                scale=self.dim**-0.5, sliding_window=WINDOW if typ == SLIDING else None,
                backend="torch",
            )
            x = x + o.reshape(t, -1) @ wo
        return x[a["logits_indices"].long()] @ self.head


def _arrays(plan) -> dict:
    out = {k: torch.from_numpy(np.ascontiguousarray(getattr(plan, k), dtype=np.int32))
           for k in ("input_ids", "positions", "cu_seqlens_q", "seqlens_k", "logits_indices")}
    for typ in plan.block_tables:
        out[f"slot_mapping/{typ}"] = torch.from_numpy(plan.slot_mapping[typ].astype(np.int32))
        out[f"block_tables/{typ}"] = torch.from_numpy(plan.block_tables[typ].astype(np.int32))
    return out


def _eager(model: ToyPagedLM, plan) -> torch.Tensor:
    """Unpadded, through the reference (reads before the write, any step shape)."""
    return model.forward(_arrays(plan), max_seqlen_q=int(np.diff(plan.cu_seqlens_q).max()),
                         max_seqlen_k=None)


def _data_chunks_equal(a: ToyPagedLM, b: ToyPagedLM) -> bool:
    """Data chunks (2..) equal up to float rounding: later layers' K/V depend on earlier
    layers' attention, which the padded decode path sums in another order."""
    pairs = zip(a.k + a.v, b.k + b.v, strict=True)
    return all(torch.allclose(x[2 * PAGE :], y[2 * PAGE :], atol=1e-6, rtol=1e-6)
               for x, y in pairs)


@pytest.mark.parametrize("decode_only", [True, False])
def test_padded_steps_give_real_rows_the_same_logits(decode_only):
    """Prefill chunks, mixed and decode-only steps over a hybrid (full + sliding) toy model:
    every step run unpadded on one copy and padded (graph shapes, graph cache with a closure
    per key as the 'graph') on another. Real rows' logits agree, data chunks stay identical,
    the zero chunk stays zero."""
    eager, padded = ToyPagedLM(), ToyPagedLM()
    b = GraphBuckets(q_interval=4, kv_interval=8, decode_only=decode_only, num_kv_heads=2)

    def capture(key):
        def graph(a):
            # What a graph bakes in: the key's query and key-length bounds.
            return padded.forward(a, max_seqlen_q=key.max_seqlen_q, max_seqlen_k=key.max_seqlen_k
                                  if key.max_seqlen_q == 1 else None)
        return graph

    cache = GraphCache(capture, max_graphs=3)
    pl = _planner()
    lengths = [1, 4, 5, 9, 17, 2]
    for i, n in enumerate(lengths):
        pl.add(f"r{i}", [3 + i] * n)
    padded_steps = 0
    for step in range(9):
        rows = []
        for i in range(len(lengths)):
            rid = f"r{i}"
            rem = pl.remaining(rid)
            if rem == 0:
                pl.append(rid, 7 + step)
                rem = 1
            if step < 3 and (i + step) % 3 == 2:
                continue
            rows.append((rid, min(rem, [3, 6, 13][(i + step) % 3])))
        plan = pl.plan(rows)
        want = _eager(eager, plan)
        p = pad_plan(plan, b, page_size=PAGE, sliding_window=WINDOW)
        if p is None:
            got = _eager(padded, plan)
        else:
            padded_steps += 1
            arrays = {k: torch.from_numpy(v) for k, v in p.arrays().items()}
            got = cache.get(p.key)(arrays)[: p.num_logits]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert _data_chunks_equal(eager, padded), f"step {step}: data chunks differ"
        assert all(not t[:PAGE].any() for t in padded.k + padded.v), "zero chunk written"
    assert padded_steps >= (4 if decode_only else 9)


def test_a_key_without_max_kv_length_replays_a_truncating_graph():
    """The reference's bug, reproduced: a graph captured for a short max key length and
    replayed for a longer one (a key without max_seqlen_k) gives wrong logits; the full key
    captures a second graph and gives eager's logits."""
    b = GraphBuckets(q_interval=4, kv_interval=8, num_kv_heads=2)
    lengths = [3, 5, 6, 2]

    def run(key_fn) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        eager, padded = ToyPagedLM(types=(FULL,)), ToyPagedLM(types=(FULL,))

        current: dict = {}

        def capture(_lookup_key):
            # Like a real capture, shapes come from the step being captured, not the key.
            shape = current["key"]
            return lambda a: padded.forward(a, max_seqlen_q=1, max_seqlen_k=shape.max_seqlen_k)

        cache = GraphCache(capture, max_graphs=8)
        pl = _planner(types=(FULL,))
        for i, n in enumerate(lengths):
            pl.add(f"r{i}", [5 + i] * n)
        plan = pl.plan([(f"r{i}", n) for i, n in enumerate(lengths)])
        _eager(eager, plan)
        _eager(padded, plan)
        wants, gots = [], []
        for step in range(4):  # row 2 grows past the first kv bucket (8) at step 2
            for i in range(len(lengths)):
                pl.append(f"r{i}", 9)
            extra = 10 if step == 2 else 1
            rows = [(f"r{i}", 1) for i in range(len(lengths))]
            if extra > 1:  # feed row 2 a chunk of cached context first (unpadded, eager)
                for _ in range(extra - 1):
                    pl.append("r2", 9)
                pre = pl.plan([("r2", extra - 1)])
                _eager(eager, pre)
                _eager(padded, pre)
            plan = _widen(pl.plan(rows), FULL, 8)  # same table width every step
            p = pad_plan(plan, b, page_size=PAGE)
            current["key"] = p.key
            arrays = {k: torch.from_numpy(v) for k, v in p.arrays().items()}
            wants.append(_eager(eager, plan))
            gots.append(cache.get(key_fn(p.key))(arrays)[: p.num_logits])
        return wants, gots, len(cache)

    wants, gots, n = run(lambda k: k)
    assert n == 2
    for w, g in zip(wants, gots, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    wants, gots, n = run(lambda k: dataclasses.replace(k, max_seqlen_k=0))
    assert n == 1  # one graph served both kv buckets
    torch.testing.assert_close(gots[0], wants[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(gots[3][2], wants[3][2], atol=1e-3)  # row 2 attends truncated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_cuda_graph_replays_like_eager():  # pragma: no cover - GPU only
    dev = torch.device("cuda")
    eager, model = ToyPagedLM(types=(FULL,)), ToyPagedLM(types=(FULL,))
    for m in (eager, model):
        m.emb, m.pos, m.head = m.emb.to(dev), m.pos.to(dev), m.head.to(dev)
        m.layers = [tuple(w.to(dev) for w in ws) for ws in m.layers]
        m.k, m.v = [t.to(dev) for t in m.k], [t.to(dev) for t in m.v]
    pl = _planner(types=(FULL,))
    for i, n in enumerate([3, 9, 4]):
        pl.add(f"r{i}", [5 + i] * n)
    first = pl.plan([(f"r{i}", n) for i, n in enumerate([3, 9, 4])])
    for m in (eager, model):
        m.forward({k: v.to(dev) for k, v in _arrays(first).items()}, max_seqlen_q=9,
                  max_seqlen_k=None)
    b = GraphBuckets(q_interval=4, kv_interval=16, num_kv_heads=2)
    pool = torch.cuda.graph_pool_handle()

    def capture(key):
        fn = lambda a: model.forward(a, max_seqlen_q=1, max_seqlen_k=key.max_seqlen_k)  # noqa: E731
        return graphs.CapturedGraph.for_plan(fn, key, dev, pool=pool)

    cache = GraphCache(capture, max_graphs=2)
    for _ in range(3):
        for i in range(3):
            pl.append(f"r{i}", 9)
        plan = pl.plan([(f"r{i}", 1) for i in range(3)])
        want = eager.forward({k: v.to(dev) for k, v in _arrays(plan).items()}, max_seqlen_q=1,
                             max_seqlen_k=None)
        p = pad_plan(plan, b, page_size=PAGE)
        got = cache.get(p.key).replay(p)[: p.num_logits]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
