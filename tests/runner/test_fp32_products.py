"""fp32 products of half-precision weights where they are faster (`ferrobatch.runner.
linear_policy`'s probe): the probe's verdict, the packed linears' and lean layers' use of the fp32
copies from `fp32_rows` rows (forced here, whatever this CPU's verdict), and bf16 quality
with them under every scheduling mode."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.cpu import f32_ops, fused_ops
from ferrobatch.runner import linear_policy
from ferrobatch.runner.cpu_linear import PackedLinears, packing_available
from ferrobatch.runner.linear_policy import Backend
from ferrobatch.runner.model_runner import ModelRunner
from ferrobatch.workloads import agreement
from ref_planner import drive_runner

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not packing_available(), reason="no oneDNN packed linears")

ROWS = 4  # forced threshold: the tests' steps have rows on both sides of it


@pytest.fixture
def forced(monkeypatch):
    """fp32 products from `ROWS` rows, whatever this CPU's probe says."""
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda dtype: ROWS)


@pytest.fixture
def never(monkeypatch):
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda dtype: None)


@pytest.mark.parametrize("gain,f32,rows", [(2.0, False, linear_policy.FP32_ROWS),
                                            (2.0, True, 1), (1.1, True, None)])
def test_the_probe_uses_fp32_only_where_it_is_clearly_faster(monkeypatch, gain, f32, rows):
    # (with f32_ops' half panels, which read the half weights' bytes, from one row)
    linear_policy.fp32_from_rows.cache_clear()
    monkeypatch.setattr(linear_policy, "measure_gain", lambda dtype: gain)
    monkeypatch.setattr(linear_policy.f32_ops, "available", lambda: f32)
    try:
        assert linear_policy.fp32_from_rows(torch.bfloat16) == rows
    finally:
        linear_policy.fp32_from_rows.cache_clear()


def test_a_product_the_cpu_refuses_means_no_fp32_copies(monkeypatch):
    def refuse(dtype):
        raise RuntimeError("no fp16 product here\nmore")

    linear_policy.fp32_from_rows.cache_clear()
    monkeypatch.setattr(linear_policy, "measure_gain", refuse)
    try:
        assert linear_policy.fp32_from_rows(torch.float16) is None
    finally:
        linear_policy.fp32_from_rows.cache_clear()


def test_the_measured_gain_is_a_positive_ratio():
    gain = linear_policy.measure_gain(torch.bfloat16, rounds=1)
    assert 0 < gain < 100


def test_products_from_fp32_rows_are_fp32_products_of_the_widened_weights(forced):
    model = tm.llama().to(torch.bfloat16)
    runner = ModelRunner(model, num_blocks=64, page_size=4)
    lin = runner.activations.linears
    assert lin is not None and lin.fp32_rows == ROWS
    attn = model.model.layers[0].self_attn
    packed = lin.packed_of([attn.q_proj, attn.k_proj, attn.v_proj])
    assert packed is not None
    w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float()
    gen = torch.Generator().manual_seed(0)
    # (on f32_ops' half panels where they run, else on oneDNN's fp32 copies)
    for rows in (ROWS, 3 * ROWS + 1, linear_policy.F32_KERNEL_ROWS + 1):
        x = torch.randn(rows, w.shape[1], generator=gen)
        assert lin.input_dtype(rows) == torch.float32
        got = lin.wide_product(packed, x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    x = torch.randn(ROWS - 1, w.shape[1], generator=gen)
    assert lin.input_dtype(ROWS - 1) == torch.bfloat16
    # below it: the half product (the input rounded to bf16), as without fp32 copies
    torch.testing.assert_close(lin.wide_product(packed, x), F.linear(x.bfloat16().float(), w),
                               rtol=2e-2, atol=2e-2)
    if lin.f32_kernel:  # f32_ops' half panels at every row count: no fp32 copies
        assert packed.f32 is not None and packed.wide is None
    else:
        assert packed.wide is not None and packed.nbytes >= 6 * w.numel()  # bf16 + fp32
    runner.close()
    # no fp32 copies with model-dtype activations
    assert PackedLinears.of(model, in_thread=lambda: True, fp32_rows=ROWS).fp32_rows is None


def test_general_layers_keep_their_output_dtypes(forced):
    """Layers that are not lean (Gemma2's, lean layers off) on fp32 copies: the grouped
    outputs are rounded to the weight dtype as the half products' are, and the logits match
    those without."""
    model = tm.gemma2().to(torch.bfloat16)
    prompts = tm.random_prompts(3, 6, 3, 12)
    runner = ModelRunner(model, num_blocks=64, page_size=4, lean_layers=False)
    assert runner.activations.linears is not None and runner.activations.linears.fp32_rows == ROWS
    assert runner.activations.lean is None
    got = drive_runner(runner, prompts, 4, forced=True)
    runner.close()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_policy, "fp32_from_rows", lambda dtype: None)
        plain = ModelRunner(model, num_blocks=64, page_size=4, lean_layers=False)
        want = drive_runner(plain, prompts, 4, forced=True)
        plain.close()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)


@pytest.mark.skipif(not fused_ops.available(), reason="no fused kernels in this build")
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_lean_layers_on_fp32_copies_compute_what_the_own_layers_compute(forced, name):
    model = tm.BUILDERS[name]().to(torch.bfloat16)
    prompts = tm.random_prompts(5, 6, 2, 30)
    got = {}
    for lean in (True, False):
        runner = ModelRunner(model, num_blocks=128, page_size=4, lean_layers=lean)
        assert (runner.activations.lean is not None) == lean
        assert runner.activations.linears.fp32_rows == ROWS
        got[lean] = drive_runner(runner, prompts, 6, forced=True)
        runner.close()
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


def test_attention_output_is_rounded_only_before_half_input_products(forced):
    """A step whose o product takes fp32 inputs gets the attention output in fp32 (never
    rounded to the bf16 cache's type on the way); one on bf16-input products gets it in the
    cache's type, which the product rounds to anyway."""
    model = tm.llama().to(torch.bfloat16)
    runner = ModelRunner(model, num_blocks=64, page_size=4)
    try:
        acts, linears = runner.activations, runner.activations.linears
        assert runner.cache.dtype == torch.bfloat16
        for rows in (1, ROWS - 1, ROWS, 64):
            f32_inputs = linears.input_dtype(rows) == torch.float32
            assert acts.attention_dtype(rows) == (None if f32_inputs else torch.bfloat16)
        assert acts.attention_dtype(ROWS) is None
    finally:
        runner.close()


@pytest.mark.parametrize("setup", list(tm.SCHEDULING_SETUPS))
def test_bf16_on_fp32_copies_is_at_least_as_close_to_fp32_as_without(forced, setup):
    """bf16 engine outputs against the fp32 greedy reference with fp32 products from `ROWS`
    rows: at least as close as with half products alone (both under the same batch)."""
    new = 16
    bf16, prompts, ref = tm.bf16_quality_case(setup, new)
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    cfg = ContinuousBatchingConfig(**tm.SCHEDULING_SETUPS[setup])
    scores = {}
    for rows in (ROWS, None):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(linear_policy, "fp32_from_rows", lambda dtype, rows=rows: rows)
            with Engine(bf16, config=cfg) as engine:
                assert engine.runner.activations.linears.fp32_rows == rows
                outs = engine.generate(prompts, sp, progress=False)
                stats = engine.stats()
        scores[rows] = agreement([o.token_ids for o in outs], ref)["tokens"]
        if setup in ("preempt", "offload"):
            assert stats["num_preemptions"] > 0, stats
    assert scores[ROWS] >= scores[None] - 0.05, scores


def test_no_fp32_copies_where_they_would_not_fit(monkeypatch):
    """Memory for the half-precision copies but not the fp32 ones: packed, without them."""
    from types import SimpleNamespace

    from ferrobatch.runner import cpu_linear

    model = tm.llama().to(torch.bfloat16)
    weights = sum(m.weight.numel() * 2 for m in model.modules()
                  if type(m) is torch.nn.Linear)
    share = cpu_linear._MAX_AVAILABLE_SHARE
    # every copy the table may use with fp32 products from ROWS rows (the half panels where
    # f32_ops runs, else fp32 copies at twice the bytes), beside the bf16 products' below
    full = cpu_linear._copy_bytes(torch.bfloat16, weights, True, ROWS, f32_ops.available(),
                                  False)
    assert full > cpu_linear._copy_bytes(torch.bfloat16, weights, True, None, False, False)
    monkeypatch.setattr(cpu_linear.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=int((full - 1) / share)))
    kw = dict(activation_dtype=torch.float32, in_thread=lambda: True, amx=True, fp32_rows=ROWS)
    lin = PackedLinears.of(model, **kw)
    assert lin is not None and lin.fp32_rows is None
    monkeypatch.setattr(cpu_linear.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=int(full / share) + 1))
    assert PackedLinears.of(model, **kw).fp32_rows == ROWS


def test_every_copy_is_packed_at_construction(forced):
    """No step pays for packing: the copy of every backend the table may choose here
    (`linear_policy.reachable`) exists once the runner is built, and no other."""
    runner = ModelRunner(tm.llama().to(torch.bfloat16), num_blocks=64, page_size=4)
    lin = runner.activations.linears
    assert lin is not None
    used = linear_policy.reachable(torch.bfloat16, lin.isa,
                                   linear_policy.Probe(fp32_from_rows=lin.fp32_rows))
    for packed in lin._packs:
        assert (packed.wide is not None) == (Backend.ONEDNN_FP32 in used)
        assert (packed.f32 is not None) == (Backend.F32_OPS in used)
        assert (packed.amx is not None) == (Backend.AMX_OPS in used)
        assert (packed.weight is not None) == (Backend.ONEDNN in used)
    runner.close()
