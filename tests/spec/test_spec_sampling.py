"""Speculative decoding with sampling: the core's acceptance (longest prefix whose samples
match the proposal, then the next sample) over the sampler's per-entry draws keeps the
target distribution, with temperature / top-k / repetition penalty applied to it exactly as
the non-speculative sampler does; seeded runs reproduce."""

from __future__ import annotations

import numpy as np
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.core import Scheduler
from ferrobatch.sampling.sampler import Sampler, SamplingState
from ferrobatch.spec import SpeculativeConfig
from ferrobatch.spec.verify import entry_states

torch.set_num_threads(1)

V = 6
L1 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])  # the target's logits after the last token
L2 = torch.tensor([0.0, 1.0, 2.0, 0.3, 1.2, -0.5])  # ... after the proposal
X = 1  # the proposal (deterministic)
N = 1500  # requests per round
ROUNDS = 4
PARAMS = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5, max_new_tokens=4)


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a / a.sum() - b / b.sum()).sum())


def spec_round(sampler: Sampler, seed: int) -> tuple[list[int], list[int]]:
    """N requests each with one proposal X: (first tokens, second tokens where X was kept)."""
    s = Scheduler(num_blocks=4 * N, page_size=4, max_batch_tokens=4 * N,
                  max_requests_per_batch=N)  # fmt: skip
    states = {}
    for i in range(N):
        s.add_request(f"r{i}", [0, 3], 4)
        states[f"r{i}"] = SamplingState(PARAMS, [0, 3])
    plan = s.schedule()
    s.update(np.zeros(plan.num_sampled, dtype=np.int32))  # first generated token: 0
    for st in states.values():
        st.output_ids.append(0)
    for i in range(N):
        assert s.propose(f"r{i}", [X])
    plan = s.schedule()
    rows = np.asarray(plan.logits_rows).tolist()
    assert len(rows) == 2 * N
    rids = plan.request_ids
    ents = entry_states(plan, rows, [states[rids[r]] for r in rows], torch.device("cpu"))
    assert ents[1].output_ids == [0, X] and ents[0].output_ids == [0]
    logits = torch.stack([L1, L2] * N)
    toks = sampler(logits, ents).token_ids.numpy().astype(np.int32)
    out = s.update(toks)
    by: dict[str, list[int]] = {}
    for d in out:
        by.setdefault(d.request_id, []).extend(d.new_token_ids)
    first, second = [], []
    for i in range(N):
        got = by[f"r{i}"]
        assert 1 <= len(got) <= 2
        first.append(got[0])
        if got[0] == X:
            assert len(got) == 2  # accepted: the bonus token comes with it
            second.append(got[1])
        else:
            assert len(got) == 1
    s.check_invariants()
    return first, second


def test_rejection_sampling_matches_the_non_speculative_sampler() -> None:
    sampler = Sampler(seed=1234)
    first, second = [], []
    for k in range(ROUNDS):
        f, sec = spec_round(sampler, k)
        first += f
        second += sec
    n = len(first)
    # the non-speculative sampler: position 1 from L1 (history [0, 3, 0]), position 2 from L2
    # with X generated (history [0, 3, 0, X]), same parameters
    ref1 = sampler(torch.stack([L1] * n), [SamplingState(PARAMS, [0, 3], [0])] * n)
    ref2 = sampler(torch.stack([L2] * n), [SamplingState(PARAMS, [0, 3], [0, X])] * n)
    c1 = np.bincount(first, minlength=V).astype(float)
    r1 = np.bincount(ref1.token_ids.numpy(), minlength=V).astype(float)
    c2 = np.bincount(second, minlength=V).astype(float)
    r2 = np.bincount(ref2.token_ids.numpy(), minlength=V).astype(float)
    assert c1[5] == 0 and r1[5] == 0  # top-k 5 removed the last token
    # TV distance of two samples of n (and about n * p(X)) draws over 6 outcomes: a few
    # hundredths from noise; a wrong rule (e.g. always accepting, or the penalty not seeing
    # X) moves it by > 0.1
    assert tv(c1, r1) < 0.04, (c1, r1)
    assert len(second) > 0.15 * n
    assert tv(c2, r2) < 0.06, (c2, r2)
    # the penalised X is rarer after itself than without the penalty
    plain = sampler(torch.stack([L2] * n), [SamplingState(PARAMS, [0, 3], [0])] * n)
    p_plain = np.bincount(plain.token_ids.numpy(), minlength=V)[X] / n
    assert c2[X] / c2.sum() < p_plain - 0.03


def test_seeded_speculative_sampling_reproduces() -> None:
    model = tiny_models.llama()
    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=32)
    prompts = [[5, 6, 7] * 5, [9, 9, 9, 9, 9, 9]]
    sp = SamplingParams(temperature=0.3, top_p=0.9, seed=7, max_new_tokens=40)
    spec = SpeculativeConfig(num_speculative_tokens=3, min_acceptance_rate=0.0)
    runs = []
    for _ in range(2):
        with Engine(model, config=cfg, speculative_config=spec) as eng:
            runs.append([o.token_ids for o in eng.generate(prompts, sp, progress=False)])
            assert eng.stats()["spec_rows"] > 0
    assert runs[0] == runs[1]
