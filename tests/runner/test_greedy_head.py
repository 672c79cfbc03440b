"""The bounded int8 screen for greedy tokens (`ferrobatch.runner.greedy_head`) and its use by the
runner and the engine: always the fp32 argmax (first maximum), full logits when it cannot
decide, greedy parity with `model.generate` when it is forced on."""

from __future__ import annotations

import random

import pytest
import tiny_models as tm
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.runner.greedy_head import GreedyHead
from ferrobatch.runner.model_runner import ModelRunner
from ref_planner import RefPlanner

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(
    not GreedyHead.supported(torch.zeros(2, 2)), reason="no torch._int_mm in this torch build"
)


def _fp32_argmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.t()).argmax(dim=1)


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("vocab,dim", [(5000, 64), (32000, 256), (777, 300)])
def test_screen_is_the_fp32_argmax(vocab: int, dim: int, int8: bool) -> None:
    gen = torch.Generator().manual_seed(vocab)
    w = torch.randn(vocab, dim, generator=gen) * dim**-0.5
    head = GreedyHead(w)
    head.int8 = int8 and head.int8
    for scale in (1e-3, 0.1, 1.0, 30.0):
        x = torch.randn(37, dim, generator=gen) * scale
        got = head.argmax(x)
        assert got is not None and got.dtype == torch.int64
        assert torch.equal(got, _fp32_argmax(x, w))


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
    assert decided >= 15  # the bf16 screen decides where int8 does not
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
    argmax = runner._greedy_head.argmax
    monkeypatch.setattr(runner._greedy_head, "argmax", lambda h: calls.append(1) or argmax(h))
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
