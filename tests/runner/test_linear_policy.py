"""The linear-backend policy (`ferrobatch.runner.linear_policy`): its table reproduces the
rules that used to be spread over the packed linears, `amx_ops`, the fp32-copies probe and
the one-call layer, for every CPU kind, thread count, probe verdict and row count; the
head's and the greedy head's rules; the table as logged; and the packed linears ask it."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest
import tiny_models as tm
import torch
from ferrobatch.runner import linear_policy as policy
from ferrobatch.runner.cpu_linear import PackedLinears, packing_available
from ferrobatch.runner.linear_policy import Backend, Isa, Probe

B = Backend
ONEDNN_ALL = {"onednn:float32", "onednn:bfloat16", "onednn:float16"}


def _old_backend(dtype, rows, *, amx, f32_kernel, fp32_rows, threads, fp32_outputs):
    """The rules as `PackedLinears.wide_product` / its layers' `run`, `amx_ops.takes` and
    `F32_KERNEL_ROWS` wrote them before the policy (`amx`: the `amx_ops` backend the
    packed linears hold copies for, or None)."""
    half = dtype in (torch.bfloat16, torch.float16)
    if half and fp32_rows is not None and rows >= fp32_rows:
        # (since the half panels: f32_ops at every row count, no fp32 copies beside them)
        return B.F32_OPS if f32_kernel else B.ONEDNN_FP32
    if fp32_outputs and amx is not None and dtype == torch.bfloat16:
        limit = {"amx": (64, 64), "avx512_bf16": (None, 64)}[amx][threads > 1]
        if limit is None or rows <= limit:
            return B.AMX_OPS
    if dtype == torch.float32 and f32_kernel and rows <= 128:
        return B.F32_OPS
    return B.ONEDNN


def _old_one_call(backend, rows):
    """`fused_layer.takes` before the policy, from the backend the old rules chose."""
    if rows > 256:
        return None
    return {B.F32_OPS: True, B.AMX_OPS: False}.get(backend)


ROWS = [0, 1, 2, 3, 4, 15, 16, 17, 31, 32, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1024]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_table_is_the_old_rules(dtype):
    for amx, f32_kernel, fp32_rows, threads, fp32_outputs in itertools.product(
            (None, "amx", "avx512_bf16"), (False, True), (None, 4, 16), (1, 2),
            (False, True)):
        if dtype == torch.float32:
            fp32_rows = None  # (fp32 copies are of half-precision weights only)
        features = set(ONEDNN_ALL) | ({amx} if amx else set()) | (
            {"f32_ops"} if f32_kernel else set())
        isa, probe = Isa(frozenset(features)), Probe(fp32_from_rows=fp32_rows)
        for rows in ROWS:
            want = _old_backend(dtype, rows, amx=amx, f32_kernel=f32_kernel,
                                fp32_rows=fp32_rows, threads=threads,
                                fp32_outputs=fp32_outputs)
            got = policy.choose(dtype, rows, isa, probe, fp32_outputs=fp32_outputs,
                                threads=threads)
            assert got is want, (dtype, amx, f32_kernel, fp32_rows, threads, rows)
            if fp32_outputs:
                assert policy.one_call(got, rows) == _old_one_call(want, rows)


def test_without_onednn_a_layer_keeps_its_own_forward():
    assert policy.choose(torch.bfloat16, 8, Isa(), Probe()) is B.TORCH
    assert policy.choose("q8_0", 8, Isa(frozenset(ONEDNN_ALL)), Probe()) is B.TORCH


def test_a_weight_format_is_a_new_row(monkeypatch):
    """A format (here a made-up quantized one) gets its backend from a row naming it and
    the feature its kernel needs; other formats are unchanged."""
    row = policy.Rule(B.F32_OPS, frozenset({"q8_0"}), ("q8_0_ops",), rows=(1, 64))
    monkeypatch.setattr(policy, "RULES", (row, *policy.RULES))
    isa = Isa(frozenset({"q8_0_ops", "f32_ops", *ONEDNN_ALL}))
    assert policy.choose("q8_0", 64, isa, Probe()) is B.F32_OPS
    assert policy.choose("q8_0", 65, isa, Probe()) is B.TORCH
    assert policy.choose("q8_0", 1, isa.without("q8_0_ops"), Probe()) is B.TORCH
    assert policy.choose(torch.bfloat16, 64, isa, Probe()) is B.ONEDNN


def test_head_rules_follow_the_timed_shares():
    isa = Isa(frozenset(ONEDNN_ALL))

    def head(**shares):
        probe = Probe(shares=tuple((B[k.upper()], v) for k, v in shares.items()))
        rule = policy.choose_rule(torch.float32, 64, isa, probe, use="head")
        return rule.backend if rule.use == "head" else None

    assert head(onednn=0.5) is B.ONEDNN
    assert head(onednn=0.9) is None  # (below 0.9 of F.linear's time only)
    assert head(onednn=0.95, transposed=0.9) is B.TRANSPOSED
    assert head(onednn=0.95, transposed=0.93) is None
    assert head() is None
    assert head(onednn=0.5) is B.ONEDNN and policy.choose_rule(
        torch.bfloat16, 64, isa, Probe(shares=((B.ONEDNN, 0.1),)), use="head").use != "head"


def test_greedy_full_rows_only_for_half_heads_with_fp32_copies():
    isa = Isa(frozenset(ONEDNN_ALL))
    for dtype in (torch.bfloat16, torch.float16):
        assert policy.rows_from("greedy", dtype, isa, Probe(fp32_from_rows=16)) \
            == policy.GREEDY_FULL_ROWS
        assert policy.rows_from("greedy", dtype, isa, Probe()) is None
        assert policy.rows_from("greedy", dtype, isa.without("onednn:float32"),
                                Probe(fp32_from_rows=16)) is None
    assert policy.rows_from("greedy", torch.float32, isa, Probe(fp32_from_rows=16)) is None


def test_the_table_as_it_applies_here_is_logged_once(caplog):
    isa = Isa(frozenset({"avx512_bf16", "f32_ops", *ONEDNN_ALL}))
    text = policy.describe("bfloat16", isa, Probe(fp32_from_rows=16), threads=1)
    assert text == "1-15 onednn (fp32 outputs: amx_ops), 16+ f32_ops"
    assert policy.describe("bfloat16", isa, Probe(fp32_from_rows=1), threads=1) == "1+ f32_ops"
    no_f32 = isa.without("f32_ops")
    assert policy.describe("bfloat16", no_f32, Probe(fp32_from_rows=16), threads=1) \
        == "1-15 onednn (fp32 outputs: amx_ops), 16+ onednn_fp32"
    assert policy.describe("float32", isa, Probe(), threads=2) == "1-128 f32_ops, 129+ onednn"
    assert policy.describe("bfloat16", isa, Probe(), threads=2) \
        == "1-64 onednn (fp32 outputs: amx_ops), 65+ onednn"
    odd = Isa(frozenset({"weird"}))
    with caplog.at_level(logging.INFO, logger="ferrobatch"):
        line = policy.log_table(isa=odd, threads=3)
        policy.log_table(isa=odd, threads=3)
    assert caplog.text.count("linear backends by rows here") == 1
    for fmt in ("float32:", "bfloat16:", "float16:"):
        assert fmt in line
    assert "3 threads" in line and "1+ torch" in line


def test_reachable_names_the_copies_worth_making():
    isa = Isa(frozenset({"avx512_bf16", "f32_ops", *ONEDNN_ALL}))
    # half panels from one row: nothing else is ever chosen for a product
    assert policy.reachable("bfloat16", isa, Probe(fp32_from_rows=1)) == {B.F32_OPS}
    assert policy.reachable("bfloat16", isa, Probe(fp32_from_rows=16)) \
        == {B.ONEDNN, B.AMX_OPS, B.F32_OPS}
    assert policy.reachable("bfloat16", isa.without("f32_ops"), Probe(fp32_from_rows=16)) \
        == {B.ONEDNN, B.AMX_OPS, B.ONEDNN_FP32}
    assert policy.reachable("float32", isa, Probe()) == {B.F32_OPS, B.ONEDNN}
    for dtype in ("bfloat16", "float16", "float32"):
        for probe in (Probe(), Probe(fp32_from_rows=1), Probe(fp32_from_rows=16)):
            found = policy.reachable(dtype, isa, probe)
            for rows, threads, wide in itertools.product((1, 7, 16, 64, 65, 128, 129, 300, 5000),
                                                         (1, 2, 3), (False, True)):
                assert policy.choose(dtype, rows, isa, probe, fp32_outputs=wide,
                                     threads=threads) in found


def test_limited_bounds_a_backends_rows():
    rules = policy.limited(B.F32_OPS, 2)
    assert all(r.rows[1] == 2 for r in rules if r.backend is B.F32_OPS and r.use == "product")
    assert [dataclasses.replace(r, rows=(0, 0)) for r in rules] \
        == [dataclasses.replace(r, rows=(0, 0)) for r in policy.RULES]


@pytest.mark.skipif(not packing_available(torch.float32), reason="no oneDNN packed linears")
def test_packed_linears_ask_the_policy_and_follow_its_inputs():
    model = tm.llama()
    lin = PackedLinears.of(model, in_thread=lambda: True, dtypes=(torch.float32,))
    assert lin is not None
    probe = Probe(fp32_from_rows=lin.fp32_rows)
    for rows in ROWS:
        assert lin.backend(rows) is policy.choose(torch.float32, rows, lin.isa, probe)
    if lin.f32_kernel:
        assert lin.backend(1) is B.F32_OPS
        lin.f32_kernel = False  # (what `benches/fused_layer_ab.py f32` switches)
        assert lin.backend(1) is B.ONEDNN and lin.one_call(1) is None


def test_the_invariant_table_chooses_by_format_and_isa_only():
    f32 = Isa(frozenset({"f32_ops", *ONEDNN_ALL}))
    dpbf16 = Isa(frozenset({"f32_ops", "avx512_bf16", *ONEDNN_ALL}))
    tiles = Isa(frozenset({"amx", "f32_ops", *ONEDNN_ALL}))
    bare = Isa(frozenset(ONEDNN_ALL))
    assert policy.choose_invariant(torch.float32, f32) is B.F32_OPS
    assert policy.choose_invariant(torch.bfloat16, f32) is B.F32_OPS  # half panels
    assert policy.choose_invariant(torch.float16, f32) is B.F32_OPS
    # AVX-512 BF16 without tiles: the half panels' fp32 FMAs, not vdpbf16ps
    assert policy.choose_invariant(torch.bfloat16, dpbf16) is B.F32_OPS
    assert policy.choose_invariant(torch.float16, dpbf16) is B.F32_OPS
    assert policy.choose_invariant(torch.bfloat16, tiles) is B.AMX_OPS
    assert policy.choose_invariant(torch.float16, tiles) is B.F32_OPS
    # no product whose rows ignore their batch: oneDNN's and MKL's are not such
    for dtype in (torch.float32, torch.bfloat16, "q8_0"):
        assert policy.choose_invariant(dtype, bare) is None
    assert all(r.rows == (0, None) and r.threads == (1, None) and not r.fp32_copies
               and r.max_share is None for r in policy.INVARIANT_RULES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_packed_linears_take_one_product_at_every_row_count(dtype):
    if not packing_available(dtype):
        pytest.skip(f"no packed {dtype} linears on this CPU (oneDNN)")
    model = tm.llama().to(dtype)
    lin = PackedLinears.of(model, in_thread=lambda: True, activation_dtype=torch.float32,
                           amx=True, dtypes=(dtype,), invariant=True)
    assert lin is not None
    want = policy.choose_invariant(dtype, Isa.detect())
    if want is None:
        with pytest.raises(ValueError, match="batch_invariant"):
            lin.invariant_backend()
        return
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            assert {lin.backend(rows, out) for rows in ROWS for out in (False, True)} == {want}
            assert {lin.input_dtype(rows) for rows in ROWS[1:]} == {
                torch.float32 if want.fp32_inputs else dtype}
    finally:
        torch.set_num_threads(threads)
    # a row's product is the same bits in a call of any size
    packed = lin.packed_of([model.model.layers[0].self_attn.o_proj])
    x = torch.randn(300, packed.layers[0].in_features,
                    generator=torch.Generator().manual_seed(0))
    full = lin.wide_product(packed, x)
    assert full.dtype == torch.float32
    for lo, hi in ((0, 1), (0, 5), (7, 24), (100, 101), (0, 129)):
        assert torch.equal(lin.wide_product(packed, x[lo:hi]), full[lo:hi])
