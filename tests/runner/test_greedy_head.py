"""The bounded int8 / int16 / bf16 screens for greedy tokens
(`ferrobatch.runner.greedy_head`) and their use by the runner and the engine: always the
fp32 argmax (first maximum), full logits when they cannot decide, greedy parity with
`model.generate` when they are forced on."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams, _core
from ferrobatch.cpu import amx_ops, f32_ops, onednn
from ferrobatch.errors import FieldError
from ferrobatch.runner import greedy_head as gh
from ferrobatch.runner import linear_policy
from ferrobatch.runner.greedy_head import GreedyHead
from ferrobatch.runner.model_runner import ModelRunner
from isa_helpers import needs_greedy_screen, needs_isa
from ref_planner import RefPlanner

torch.set_num_threads(1)

pytestmark = needs_greedy_screen


@pytest.fixture(autouse=True)
def _screens_only(monkeypatch):
    """The screens at any row count, whatever this CPU's fp32 products (the full fp32 path
    of half-precision heads has tests of its own)."""
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda dtype: None)


def _fp32_argmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.t()).argmax(dim=1)


def _only(head: GreedyHead, screen: str) -> GreedyHead:
    """`head` with `screen` ("int8", "int16" or "bf16") first: int8 and int16 off unless
    named (bf16 stays the fallback of both)."""
    head.int8 = screen == "int8" and head.int8
    head.int16 = screen == "int16" and head.int16
    return head


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("screen", ["int8", "int16", "bf16"])
@pytest.mark.parametrize("vocab,dim", [(5000, 64), (32000, 256), (777, 300), (900, 65)])
def test_screen_is_the_fp32_argmax(vocab: int, dim: int, screen: str, wide: bool) -> None:
    gen = torch.Generator().manual_seed(vocab)
    w = torch.randn(vocab, dim, generator=gen) * dim**-0.5
    head = _only(GreedyHead(w), screen)
    head.wide = wide and head.wide
    for scale in (1e-3, 0.1, 1.0, 30.0):
        x = torch.randn(37, dim, generator=gen) * scale
        got = head.argmax(x)
        assert got is not None and got.dtype == torch.int64
        assert torch.equal(got, _fp32_argmax(x, w))


@needs_isa(amx_ops.available(), "avx512_bf16", "amx_bf16", what="fp32-output bf16 products")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_screen_decides_with_fewer_candidates(dtype: torch.dtype) -> None:
    """The bf16 screen through `amx_ops` (fp32 sums): the same argmax as fp32, from a
    tighter window than the bf16-rounded screen's."""
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(8000, 128, generator=gen) * 0.09).to(dtype)
    x = torch.randn(24, 128, generator=gen)
    kept = {}
    for wide in (True, False):
        head = GreedyHead(w)
        _only(head, "bf16").wide = wide
        calls = []
        real = gh._select
        def spy(scores, *a, calls=calls, real=real):
            out = real(scores, *a)
            calls.append((scores.dtype, None if out is None else len(out[0])))
            return out
        gh._select = spy
        try:
            got = head.argmax(x)
        finally:
            gh._select = real
        assert got is not None and torch.equal(got, _fp32_argmax(x, w.float()))
        assert calls[0][0] == (np.float32 if wide else np.uint16)
        kept[wide] = calls[0][1]
    assert kept[True] <= kept[False]


def test_heavy_tailed_rows_and_outlier_weights() -> None:
    gen = torch.Generator().manual_seed(2)
    dim, vocab = 96, 4000
    w = torch.randn(vocab, dim, generator=gen) * 0.05
    w[17] *= 2.0  # a larger row
    w[:, 3] *= 10.0  # an outlier feature sets the int8 scale: that screen rarely decides
    head = GreedyHead(w)
    torch.manual_seed(0)
    decided = 0
    for trial in range(20):
        x = torch.distributions.StudentT(2.0).sample((16, dim)) * (1 + trial % 10)
        x[:, trial % dim] *= 10.0
        got = head.argmax(x)
        if got is not None:  # None (full logits) is allowed; a wrong token is not
            assert torch.equal(got, _fp32_argmax(x, w))
            decided += 1
    assert decided >= 15  # the int16 (or bf16) screen decides where int8 does not
    assert not head.int8  # dropped after its trial calls
    w[:, 5] *= 40.0  # in place: re-derived; both screens too coarse now -> full logits
    x = torch.distributions.StudentT(2.0).sample((16, dim))
    got = head.argmax(x)
    assert got is None or torch.equal(got, _fp32_argmax(x, w))


def test_ties_go_to_the_lowest_id_and_near_ties_are_resolved_in_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    dim = 64
    w = torch.randn(300, dim, generator=gen) * 0.1
    x = torch.randn(8, dim, generator=gen)
    best = _fp32_argmax(x, w)
    # exact twins of every row's winner at a higher id, and a near-twin (a 1e-4 relative
    # nudge, far below the screen's resolution) at a lower id, slightly better or worse
    w2 = torch.cat([w, w[best]])
    got = GreedyHead(w2).argmax(x)
    assert torch.equal(got, _fp32_argmax(x, w2))
    assert torch.equal(got, best)
    for sign in (1.0, -1.0):
        nudge = (1 + sign * 1e-4) * w[best[0]]
        w3 = torch.cat([nudge.unsqueeze(0), w])
        got = GreedyHead(w3).argmax(x[:1])
        assert torch.equal(got, _fp32_argmax(x[:1], w3))
        assert int(got[0]) == (0 if sign > 0 else int(best[0]) + 1)


def test_non_finite_or_undecidable_rows_return_none() -> None:
    w = torch.randn(100, 16)
    head = GreedyHead(w)
    x = torch.randn(3, 16)
    x[1, 2] = float("nan")
    assert head.argmax(x) is None
    x[1, 2] = float("inf")
    assert head.argmax(x) is None
    # every logit equal: every token is a candidate, too many to rescore
    assert GreedyHead(torch.ones(1000, 16)).argmax(torch.randn(4, 16)) is None
    assert GreedyHead(w).argmax(torch.randn(0, 16)).shape == (0,)
    assert head.argmax(torch.randn(3, 16, dtype=torch.float64)) is None


def test_follows_in_place_weight_changes() -> None:
    w = torch.randn(400, 32)
    head = GreedyHead(w)
    x = torch.randn(5, 32)
    assert torch.equal(head.argmax(x), _fp32_argmax(x, w))
    with torch.no_grad():
        w.mul_(-1)
    assert torch.equal(head.argmax(x), _fp32_argmax(x, w))


def _forced_runner(model, monkeypatch) -> ModelRunner:
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: True)
    runner = ModelRunner(model, num_blocks=128, page_size=4)
    assert runner.fast_greedy
    return runner


def test_runner_execute_greedy_equals_argmax_of_execute(monkeypatch) -> None:
    model = tm.llama()
    runner = _forced_runner(model, monkeypatch)
    planner = RefPlanner(page_size=4, num_blocks=128, layer_types=runner.layer_types,
                         sliding_window=None)
    rng = random.Random(3)
    for i in range(5):
        planner.add(f"r{i}", [rng.randrange(3, tm.VOCAB) for _ in range(rng.randint(2, 30))])
    plan = planner.plan([(f"r{i}", n) for i, n in enumerate((3, 1, 7, 2, 5))])
    calls = []
    argmax = runner.head.greedy.argmax
    monkeypatch.setattr(runner.head.greedy, "argmax", lambda h: calls.append(1) or argmax(h))
    tokens = runner.execute_greedy(plan)
    assert calls, "the screen was not used"
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, runner.execute(plan).argmax(dim=1))


def test_engine_greedy_parity_with_the_screen(monkeypatch) -> None:
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: True)
    model = tm.llama()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, tm.VOCAB) for _ in range(n)] for n in (1, 5, 9, 17, 33, 4)]
    used = []
    argmax = GreedyHead.argmax
    monkeypatch.setattr(GreedyHead, "argmax", lambda self, h: used.append(1) or argmax(self, h))
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=256, max_batch_tokens=16)
    with Engine(model, config=cfg) as eng:
        assert eng.runner.fast_greedy
        greedy = SamplingParams(max_new_tokens=12)
        sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5)
        # the last request samples: steps holding it take the full-logits path
        outs = eng.generate(prompts, [greedy] * (len(prompts) - 1) + [sampled], progress=False)
    assert used, "the screen was never used"
    for prompt, out in zip(prompts[:-1], outs[:-1], strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 min_new_tokens=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_not_supported_when_its_copies_would_take_too_much_memory(monkeypatch) -> None:
    import ferrobatch.runner.greedy_head as gh

    w = torch.zeros(1000, 64)
    assert GreedyHead.supported(w)
    tight = type("Mem", (), {"available": w.numel() * gh._EXTRA_BYTES_PER_WEIGHT})()
    monkeypatch.setattr(gh.psutil, "virtual_memory", lambda: tight)
    assert not GreedyHead.supported(w)


def _select_reference(scores: np.ndarray, base: np.ndarray, gain: np.ndarray,
                      per_token: np.ndarray, max_stage1: int = gh._MAX_STAGE1,
                      max_candidates: int = gh._MAX_CANDIDATES
                      ) -> tuple[np.ndarray, np.ndarray] | None:
    """The selection rule in numpy (`GreedyHead`'s former `_select`), uint16 = bf16 bits."""
    if scores.dtype == np.uint16:
        scores = torch.from_numpy(scores.view(np.int16)).view(torch.bfloat16).float().numpy()
    n, vocab = scores.shape
    best = scores.argmax(axis=1)
    a_best = scores[np.arange(n), best].astype(np.float64)
    lb1 = a_best - base - gain * per_token[best]
    thr = lb1 - base - gain * float(per_token.max())
    if not np.isfinite(thr).all():
        return None
    if scores.dtype == np.int32:
        thr = np.maximum(np.floor(thr) - 1, np.iinfo(np.int32).min).astype(np.int32)
    else:
        thr = np.nextafter(thr.astype(np.float32), np.float32(-np.inf))  # rounded down
    flat = np.flatnonzero(scores >= thr[:, None])
    if len(flat) > max_stage1 * n:
        return None
    r, c = flat // vocab, flat % vocab
    a = scores.reshape(-1)[flat].astype(np.float64)
    eps = base[r] + gain[r] * per_token[c]
    lb2 = np.full(n, -np.inf)
    np.maximum.at(lb2, r, a - eps)
    keep = a + eps >= lb2[r] - np.abs(lb2[r]) * 1e-12 - 1e-300
    r, c = r[keep], c[keep]
    if len(r) > max_candidates * n:
        return None
    return r, c


def _random_selection_case(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Scores (one of the three types) with ties, ulp ladders, equal rows and non-finite
    values now and then, and bounds from zero to wide."""
    n, vocab = int(rng.integers(1, 6)), int(rng.choice([1, 3, 130, 700]))
    kind = rng.choice(["bf16", "f32", "i32"])
    scale = float(rng.choice([1e-3, 1.0, 50.0]))
    x = rng.normal(size=(n, vocab)) * scale
    if rng.random() < 0.5:  # ties: a few shared levels
        levels = rng.normal(size=4) * scale
        mask = rng.random((n, vocab)) < 0.3
        x[mask] = rng.choice(levels, size=int(mask.sum()))
    if rng.random() < 0.1:
        x[int(rng.integers(n))] = x[0, 0]  # an all-equal row
    if kind == "f32" and rng.random() < 0.3:  # steps of one ulp below the top
        top = np.float32(x.max())
        ladder = [top]
        for _ in range(5):
            ladder.append(np.nextafter(ladder[-1], np.float32(-np.inf)))
        x.reshape(-1)[rng.integers(x.size, size=8)] = rng.choice(ladder, size=8)
    if kind == "i32":
        scores = np.round(x * 100).astype(np.int32)
    else:
        if rng.random() < 0.1:
            x[int(rng.integers(n)), int(rng.integers(vocab))] = rng.choice(
                [np.nan, -np.nan, np.inf, -np.inf])
        t = torch.from_numpy(x.astype(np.float32))
        scores = (t.bfloat16().view(torch.int16).numpy().view(np.uint16) if kind == "bf16"
                  else t.numpy())
    width = float(rng.choice([0.0, 1e-3, 0.1, 1.0])) * scale * (100 if kind == "i32" else 1)
    base = rng.random(n) * width
    gain = rng.random(n) * width * float(rng.choice([0.0, 0.1]))
    per_token = rng.random(vocab) * 3
    if rng.random() < 0.05:
        base[int(rng.integers(n))] = rng.choice([np.nan, np.inf])
    return scores, base, gain, per_token


def test_kernel_selection_equals_the_numpy_rule_on_random_cases() -> None:
    rng = np.random.default_rng(11)
    outcomes = {"none": 0, "some": 0}
    for _ in range(1500):
        scores, base, gain, per_token = _random_selection_case(rng)
        limits = [(gh._MAX_STAGE1, gh._MAX_CANDIDATES),
                  (int(rng.integers(1, 40)), int(rng.integers(1, 8)))]
        for s1, kept in limits:
            with np.errstate(all="ignore"):
                want = _select_reference(scores, base, gain, per_token, s1, kept)
            got = _core.greedy_select(scores, base, gain, per_token, max_stage1=s1,
                                      max_candidates=kept, threads=int(rng.integers(1, 4)))
            assert (got is None) == (want is None), (scores, base, gain, per_token)
            outcomes["none" if got is None else "some"] += 1
            if got is not None:
                rows, cols, unique, inverse = got
                assert np.array_equal(rows, want[0]) and np.array_equal(cols, want[1])
                assert np.array_equal(unique, np.unique(cols))
                assert np.array_equal(unique[inverse], cols)
    assert min(outcomes.values()) > 500, outcomes


def test_screen_scores_pass_to_the_kernel_as_they_are() -> None:
    # the module's `_select` is the kernel with the module's limits
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(4, 300)).astype(np.float32)
    base, gain, per_token = np.full(4, 0.05), np.full(4, 0.01), rng.random(300)
    got = gh._select(scores, base, gain, per_token)
    want = _select_reference(scores, base, gain, per_token)
    assert got is not None and want is not None
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def _select_args(**over) -> dict:
    args = dict(scores=np.zeros((2, 3), np.float32), base=np.zeros(2), gain=np.zeros(2),
                per_token=np.zeros(3), max_stage1=8, max_candidates=8, threads=1)
    args.update(over)
    return args


@pytest.mark.parametrize("over,field", [
    (dict(scores=np.zeros((2, 3), np.float64)), "scores"),
    (dict(scores=np.zeros(6, np.float32)), "scores"),
    (dict(scores=np.zeros((3, 2), np.float32).T), "scores"),
    (dict(base=np.zeros(3)), "base"),
    (dict(base=np.zeros(2, np.float32)), "base"),
    (dict(gain=np.zeros((2, 1))), "gain"),
    (dict(per_token=np.zeros(4)), "per_token"),
    (dict(per_token=np.zeros(6)[::2]), "per_token"),
])
def test_select_rejects_bad_arguments_naming_them(over: dict, field: str) -> None:
    with pytest.raises(FieldError) as err:
        _core.greedy_select(**_select_args(**over))
    assert err.value.field == field


def test_pick_best_candidate_and_its_errors() -> None:
    logits = np.array([[1.0, 3.0, 3.0], [-0.0, 0.0, 2.0]], np.float32)
    rows, cols, inverse = (np.array(v, np.int64) for v in ([0, 0, 1, 1], [8, 4, 9, 2],
                                                             [1, 2, 0, 1]))
    assert _core.greedy_pick(logits, rows, cols, inverse).tolist() == [4, 2]
    assert _core.greedy_pick(logits, rows[:2], cols[:2], inverse[:2]) is None  # row 1: none
    bad = logits.copy()
    bad[1, 0] = np.inf
    assert _core.greedy_pick(bad, rows, cols, inverse) is None
    with pytest.raises(FieldError) as err:
        _core.greedy_pick(logits, rows, cols[:3], inverse)
    assert err.value.field == "cols"
    with pytest.raises(FieldError) as err:
        _core.greedy_pick(logits.astype(np.float64), rows, cols, inverse)
    assert err.value.field == "logits"
    with pytest.raises(FieldError, match="outside"):
        _core.greedy_pick(logits, rows, cols, inverse + 1)


def _both(scores, base, gain, per_token, s1=gh._MAX_STAGE1, kept=gh._MAX_CANDIDATES):
    """The kernel's (rows, cols) or None, asserted equal to the numpy rule's."""
    got = _core.greedy_select(scores, base, gain, per_token, max_stage1=s1,
                              max_candidates=kept, threads=1)
    want = _select_reference(scores, base, gain, per_token, s1, kept)
    assert (got is None) == (want is None)
    if got is None:
        return None
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    return got[1].tolist()


def test_stage1_thresholds_are_rounded_down_as_the_rule_says() -> None:
    # floats: one ulp below f32(thr) survives stage 1 (then stage 2 drops it)
    top = np.float32(3.0)
    below = np.nextafter(top, np.float32(-np.inf))
    f = np.array([[top, below, np.nextafter(below, np.float32(-np.inf))]], np.float32)
    zeros, per = np.zeros(1), np.zeros(3)
    assert _both(f, zeros, zeros, per, s1=2) == [0]
    assert _both(f, zeros, zeros, per, s1=1) is None  # two in stage 1
    # int32: floor(thr) - 1, thr = 10 - 2 * 0.25
    i = np.array([[10, 9, 8, 7]], np.int32)
    assert _both(i, np.full(1, 0.25), zeros, np.zeros(4), s1=3) == [0]  # 10, 9, 8 in stage 1
    assert _both(i, np.full(1, 0.25), zeros, np.zeros(4), s1=2) is None


@pytest.mark.parametrize("d,kept", [(0.0, True), (0.5e-10, True), (2e-10, False)])
def test_stage2_keeps_its_relative_slack_and_no_more(d: float, kept: bool) -> None:
    # lb2 = 100 (token 0); token 1 has a + eps = 100 - d
    per = np.array([0.0, 10.0 - d])
    for scores in (np.array([[100, 90]], np.float32), np.array([[100, 90]], np.int32)):
        assert _both(scores, np.zeros(1), np.ones(1), per) == ([0, 1] if kept else [0])


def test_row_norms_are_the_f64_norms() -> None:
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(4)) * 3
    x[2] = 0.0
    l2, l1, amax = _core.row_norms(x.numpy())
    x64 = x.double()
    np.testing.assert_allclose(l2, x64.norm(dim=1).numpy(), rtol=1e-14)
    np.testing.assert_allclose(l1, x64.abs().sum(dim=1).numpy(), rtol=1e-14)
    assert np.array_equal(amax, x64.abs().amax(dim=1).numpy())
    x[1, 3], x[4, 0] = float("nan"), float("-inf")
    l2, l1, amax = _core.row_norms(x.numpy())
    assert np.isnan(l1[1]) and np.isnan(amax[1]) and np.isinf(l1[4]) and np.isinf(amax[4])
    assert np.isfinite(l1[[0, 2, 3]]).all()
    for bad in (x.double().numpy(), x.numpy().T, x.numpy()[0]):
        with pytest.raises(FieldError) as err:
            _core.row_norms(bad)
        assert err.value.field == "x"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rows_and_weight_give_the_argmax_of_their_widening(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(3000, 96, generator=gen) * 0.1).to(dtype)
    x = torch.randn(19, 96, generator=gen).to(dtype)
    for screen in ("int8", "int16", "bf16"):
        head = _only(GreedyHead(w), screen)
        got = head.argmax(x)
        assert got is not None
        assert torch.equal(got, _fp32_argmax(x.float(), w.float()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_head_from_full_rows_is_the_argmax_of_full_fp32_logits(monkeypatch, dtype):
    """Where fp32 products win, calls of `full_rows` rows or more take the argmax of the
    full fp32 product of the widened weight (first maximum, NaN wins, as the full logits
    would give); fewer rows are screened; `wins` judges the screens, not that path."""
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda d: 16)
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(3000, 96, generator=gen) * 0.1).to(dtype)
    head = GreedyHead(w)
    assert head.full_rows == linear_policy.GREEDY_FULL_ROWS
    assert GreedyHead(w.float()).full_rows is None  # an fp32 head: screens as before
    screened = []
    monkeypatch.setattr(head, "_screen_bf16", lambda *a: screened.append(1) or None)
    _only(head, "bf16")
    for rows in (head.full_rows, 2 * head.full_rows + 3):
        x = torch.randn(rows, 96, generator=gen)
        x[1] = x[0]  # equal rows, equal answers
        got = head.argmax(x)
        assert got is not None and torch.equal(got, _fp32_argmax(x, w.float()))
    assert not screened
    assert head.argmax(torch.randn(head.full_rows - 1, 96)) is None and screened
    x = torch.randn(head.full_rows, 96)
    x[3, 5] = float("nan")  # as the full logits' argmax: NaN wins
    assert torch.equal(head.argmax(x), (x @ w.float().t()).argmax(dim=1))
    tie = GreedyHead(torch.ones(50, 8, dtype=dtype))  # every logit equal: token 0
    tie.full_rows = 1
    assert torch.equal(tie.argmax(torch.randn(4, 8).abs()), torch.zeros(4, dtype=torch.int64))
    monkeypatch.undo()
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda d: 16)
    judged = GreedyHead(w)
    assert judged.wins(rows=64, rounds=1)
    assert (judged.full_rows is None) == (judged._screen_share < 1.0)


@pytest.mark.parametrize("screen_time,keeps_full", [(0.5, False), (2.0, True)])
def test_wins_keeps_the_full_fp32_path_only_where_it_beats_the_screen(
        monkeypatch, screen_time, keeps_full):
    monkeypatch.setattr(linear_policy, "fp32_from_rows", lambda d: 16)
    fulls = 2 if onednn.available() else 1  # `_wins` times the full heads first
    calls = []

    def fake_time(fn, rounds):
        calls.append(fn())
        return 1.0 if len(calls) <= fulls else screen_time

    monkeypatch.setattr(gh, "_best_time", fake_time)
    head = GreedyHead((torch.randn(3000, 96) * 0.1).bfloat16())
    assert head.wins(rows=64, rounds=1)
    assert (head.full_rows == linear_policy.GREEDY_FULL_ROWS) == keeps_full
    assert keeps_full or head.full_rows is None


def _window8_head(w: torch.Tensor) -> GreedyHead:
    head = GreedyHead(w)
    head.window8 = True
    head.int8 = False
    return head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,dim", [(5000, 64), (32000, 256), (777, 300)])
def test_window8_gives_the_fp32_argmax_of_half_heads(vocab: int, dim: int, dtype) -> None:
    """The statistical int8 screen of half heads: on rows of any scale, with outlier
    features and rows, the tokens are the fp32 argmax of the widened weight, and the screen
    decided (no fall back to the other paths)."""
    gen = torch.Generator().manual_seed(vocab + dim)
    w = (torch.randn(vocab, dim, generator=gen) * dim**-0.5).to(dtype)
    w[3] *= 4.0  # a row with a larger scale
    head = _window8_head(w)
    fallbacks = []
    head._screen_bf16 = lambda *a: fallbacks.append(1) or None  # type: ignore[method-assign]
    head.full_rows = None
    for scale in (1e-3, 0.1, 1.0, 30.0):
        for rows in (1, 7, 64):
            x = torch.randn(rows, dim, generator=gen) * scale
            x[:, 5] *= 20.0  # an outlier feature sets each row's int8 step
            got = head.argmax(x.to(dtype) if dtype == torch.float16 else x)
            assert got is not None and got.dtype == torch.int64
            xw = x.to(dtype).float() if dtype == torch.float16 else x
            assert torch.equal(got, _fp32_argmax(xw, w.float()))
    assert not fallbacks
    assert head._window8_trial.calls == 12 and head._window8_trial.misses == 0


def test_window8_keeps_every_near_tie_for_the_fp32_rescoring() -> None:
    """Tokens whose logits differ far below the int8 resolution are all candidates: the
    fp32 rescoring picks the winner, ties going to the lowest id."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 64, generator=gen) * 0.1
    x = torch.randn(8, 64, generator=gen)
    best = _fp32_argmax(x, w)
    w2 = torch.cat([w, w[best]]).bfloat16()  # exact twins at higher ids
    head = _window8_head(w2)
    assert torch.equal(head.argmax(x), _fp32_argmax(x, w2.float()))
    for sign in (1.0, -1.0):
        nudged = ((1 + sign * 1e-2) * w2[int(best[0])].float()).bfloat16()
        w3 = torch.cat([nudged.unsqueeze(0), w2])
        got = _window8_head(w3).argmax(x[:1])
        assert torch.equal(got, _fp32_argmax(x[:1], w3.float()))


def test_window8_falls_back_and_is_dropped_when_it_rarely_decides(monkeypatch) -> None:
    """Non-finite or all-zero rows, and rows whose window holds too many tokens, go to the
    other paths (exact answers or None); after its trial calls a screen that rarely
    decides is dropped."""
    w = torch.ones(1000, 16).bfloat16()  # every logit equal: every token a candidate
    head = _window8_head(w)
    head.full_rows = None
    for _ in range(gh._INT8_TRIAL_CALLS):
        got = head.argmax(torch.randn(4, 16).abs())
        assert got is None or torch.equal(got, torch.zeros(4, dtype=torch.int64))
    assert not head.window8 and head._rows8 is None
    head = _window8_head(torch.randn(100, 16).bfloat16())
    x = torch.randn(3, 16)
    x[1, 2] = float("nan")
    assert head._window8(x) is None
    assert head._window8(torch.zeros(2, 16)) is None


def test_wins_takes_window8_for_half_heads_only(monkeypatch) -> None:
    """`wins` turns the statistical screen on for a half head where it is the fastest
    (timings faked), never for an fp32 head, and not where it is slower."""
    times = iter([])

    def fake_time(fn, rounds):
        fn()
        return next(times)

    monkeypatch.setattr(gh, "_best_time", fake_time)
    w = torch.randn(3000, 96) * 0.1
    timings = 2 if onednn.available() else 1  # the full heads
    for weight, window_time, taken in ((w.bfloat16(), 0.2, True), (w.bfloat16(), 0.95, False),
                                       (w, 0.2, False)):
        head = GreedyHead(weight)
        screens = 1 + head.int8 + head.int16  # the configurations `_wins` times
        times = iter([1.0] * timings + [0.5] * screens + [window_time])
        assert head.wins(rows=16, rounds=1)
        assert head.window8 == taken
        assert (head._rows8 is not None) == taken
        x = torch.randn(5, 96)
        assert torch.equal(head.argmax(x), _fp32_argmax(x, weight.float()))


def test_engine_bf16_tokens_are_the_same_with_window8(monkeypatch) -> None:
    """A bf16 model's greedy tokens through the engine with the statistical screen equal
    those of the exact paths (same steps, same hidden rows: the same fp32 argmax)."""
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: True)
    model = tm.llama().to(torch.bfloat16)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, tm.VOCAB) for _ in range(n)] for n in (1, 6, 13, 30, 3)]
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=256, max_batch_tokens=24)
    outs = {}
    for window8 in (False, True):
        with Engine(model, config=cfg) as eng:
            head = eng.runner.head.greedy
            assert head is not None
            head.window8 = window8
            got = eng.generate(prompts, SamplingParams(max_new_tokens=10), progress=False)
            outs[window8] = [o.token_ids for o in got]
            assert head._window8_trial.calls > 0 if window8 else head._window8_trial.calls == 0
            assert head._window8_trial.misses == 0
    assert outs[True] == outs[False]


_NEEDS_I16 = needs_isa(gh._HAVE_I16, "avx512_vnni", what="int16 products")


def _spy_select(monkeypatch) -> list:
    """Each `_select` call's (scores dtype, candidates kept or None)."""
    calls: list = []
    real = gh._select

    def spy(scores, *a):
        out = real(scores, *a)
        calls.append((scores.dtype, None if out is None else len(out[0])))
        return out

    monkeypatch.setattr(gh, "_select", spy)
    return calls


@_NEEDS_I16
@pytest.mark.parametrize("dim", [96, 577])
def test_int16_keeps_few_candidates_where_outliers_widen_int8(monkeypatch, dim) -> None:
    """Rows with a few features 100-300x the others (as SmolLM2's final hidden rows have):
    the int8 screen's window is wide (it keeps many candidates, or too many to decide), the
    int16 one's ~15x narrower: a few candidates a row, and the fp32 argmax."""
    gen = torch.Generator().manual_seed(dim)
    vocab = 6000
    w = torch.randn(vocab, dim, generator=gen) * dim**-0.5
    x = torch.randn(64, dim, generator=gen)
    x[:, 7] *= 300.0
    x[:, dim - 2] *= -100.0
    ref = _fp32_argmax(x, w)
    calls = _spy_select(monkeypatch)
    int8 = _only(GreedyHead(w), "int8")
    assert torch.equal(int8.argmax(x), ref)
    int8_kept = calls[0][1]  # None: too many candidates (the bf16 screen answered)
    calls.clear()
    head = _only(GreedyHead(w), "int16")
    got = head.argmax(x)
    assert got is not None and torch.equal(got, ref)
    assert calls[0][0] == np.int32 and calls[0][1] <= 64 * 4
    assert int8_kept is None or int8_kept > 4 * calls[0][1]


@_NEEDS_I16
def test_int16_scores_stay_in_int32_at_any_width() -> None:
    """`qmax` keeps every partial sum of `K` products within an int32 (`K` rounded up to
    even), so the kernel's sums are exact; the widest rows and weights reach it."""
    for k in (1, 2, 65, 576, 4096):
        w16 = gh._Int16Weight(torch.randn(40, k))
        assert w16.k == k + k % 2
        assert w16.k * w16.qmax**2 < 2**31
    k = 4096
    w = torch.full((20, k), -0.5)
    w16 = gh._Int16Weight(w)
    rows = torch.full((3, k), -int(w16.qmax), dtype=torch.int16)
    acc = torch.empty(3, 20, dtype=torch.int32)
    _core.i16_linear(rows.numpy(), w16.packed.numpy(), acc.numpy(), n=20, k=k)
    assert (acc.long() == k * int(w16.qmax) ** 2).all()


def test_int16_is_dropped_when_it_rarely_decides(monkeypatch) -> None:
    """Like the int8 screen: after its trial calls with too many misses it is off, and the
    bf16 screen (or the full logits) answers."""
    w = torch.randn(500, 32)
    head = _only(GreedyHead(w), "int16")
    monkeypatch.setattr(head, "_screen_int16", lambda *a: None)
    for _ in range(gh._INT8_TRIAL_CALLS):
        x = torch.randn(4, 32)
        got = head.argmax(x)
        assert got is None or torch.equal(got, _fp32_argmax(x, w))
    assert not head.int16 and head._w16 is None


@_NEEDS_I16
def test_engine_fp32_parity_with_the_int16_screen(monkeypatch) -> None:
    """An fp32 model's greedy tokens through the engine with the int16 screen first equal
    `model.generate`'s."""
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: True)
    monkeypatch.setattr(GreedyHead, "__init__", _int16_first(GreedyHead.__init__))
    model = tm.llama()
    rng = random.Random(17)
    prompts = [[rng.randrange(3, tm.VOCAB) for _ in range(n)] for n in (1, 5, 9, 17, 40)]
    calls = _spy_select(monkeypatch)
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=256, max_batch_tokens=16)
    with Engine(model, config=cfg) as eng:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=10), progress=False)
    assert calls and all(dtype == np.int32 for dtype, _ in calls)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                 min_new_tokens=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def _int16_first(init):
    def patched(self, weight, invariant=False):
        init(self, weight, invariant)
        self.int8 = False
    return patched


@needs_isa(f32_ops.available(), "avx512f", what="batch-invariant rescoring")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("screen", ["int8", "int16", "bf16"])
def test_invariant_head_is_the_argmax_of_the_f32_ops_logits(screen: str, dtype) -> None:
    """Batch-invariant mode: every screen's token is the argmax (first maximum) of the very
    logits `f32_ops` gives the full head, also among near ties (pairs of weight rows a few
    ulps apart), whatever rows share the call."""
    gen = torch.Generator().manual_seed(3)
    vocab, dim = 3000, 96
    w = torch.randn(vocab, dim, generator=gen) * dim**-0.5
    w[1::2] = w[0::2] * (1 + 2.0**-20 * torch.randn(vocab // 2, dim, generator=gen))
    w = w.to(dtype)
    head = _only(GreedyHead(w, invariant=True), screen)
    assert head.full_rows is None and not head.window8
    full = f32_ops.pack(w)
    x = torch.randn(64, dim, generator=gen)
    x[32:] = w[torch.randint(0, vocab, (32,), generator=gen)].float() * 3  # near ties
    want = torch.from_numpy(f32_ops.linear(x, full).numpy().argmax(-1))
    for lo, hi in ((0, 64), (0, 1), (5, 11), (40, 64)):
        got = head.argmax(x[lo:hi])
        assert got is not None and torch.equal(got, want[lo:hi]), (lo, hi)
