"""The core's speculative rows through the bindings, under random operation sequences
(hypothesis): proposals (right, wrong, prompt lookup), tiny pools (preemption, soft reset,
offload), prefix sharing, sliding rings, cancellation and recompute. The "model" is a
deterministic function of the context, so every output must equal the non-speculative
reference, and the invariants hold after every call."""

from __future__ import annotations

import hashlib

import numpy as np
from ferrobatch.core import Scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VOCAB = 12
EOS = 11


def model(ctx: list[int]) -> int:
    h = hashlib.blake2b(np.asarray(ctx[-6:], dtype=np.int32).tobytes(), digest_size=4)
    return int.from_bytes(h.digest(), "little") % VOCAB


def reference(prompt: list[int], max_new: int) -> list[int]:
    toks, out = list(prompt), []
    while len(out) < max_new:
        t = model(toks)
        toks.append(t)
        out.append(t)
        if t == EOS:
            break
    return out


op_st = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12), st.integers(1, 14), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(0, 5), st.integers(0, 99), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 40), st.just(0), st.just(0)),
    st.tuples(st.just("recompute"), st.integers(0, 40), st.just(0), st.just(0)),
)


class Run:
    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.toks: dict[str, list[int]] = {}
        self.prompt: dict[str, list[int]] = {}
        self.max_new: dict[str, int] = {}
        self.done: dict[str, list[int]] = {}
        self.cancelled: set[str] = set()
        self.n = 0

    def add(self, length: int, max_new: int, shared: int) -> None:
        rid = f"q{self.n}"
        self.n += 1
        p = [1, 2, 3, 1, 2][: shared + 1] + [(self.n * 7 + j) % 10 for j in range(length)]
        try:
            self.s.add_request(rid, p, max_new, eos_token_ids=[EOS])
        except ValueError:
            return
        self.toks[rid], self.prompt[rid], self.max_new[rid] = list(p), p, max_new

    def step(self, k: int, salt: int, ngram: bool) -> bool:
        if k:
            if ngram:
                self.s.propose_ngram(k, 1, 3)
            else:
                for j, rid in enumerate(sorted(self.toks)):
                    ctx, prop = list(self.toks[rid]), []
                    for e in range(k):
                        t = model(ctx) if (salt + j + e) % 4 else (model(ctx) + 1) % VOCAB
                        ctx.append(t)
                        prop.append(t)
                    self.s.propose(rid, prop)
        plan = self.s.schedule()
        if plan is None:
            self.absorb(self.s.update(()))
            return False
        self.s.check_invariants()
        ids = np.asarray(plan.input_ids).tolist()
        pos = np.asarray(plan.positions).tolist()
        cu = np.asarray(plan.cu_seqlens_q).tolist()
        rows = np.asarray(plan.logits_rows).tolist()
        li = np.asarray(plan.logits_indices).tolist()
        rids = plan.request_ids
        sampled = []
        for t, r in zip(li, rows, strict=True):
            start = pos[cu[r]]
            ctx = self.toks[rids[r]][:start] + ids[cu[r] : t + 1]
            sampled.append(model(ctx))
        self.absorb(self.s.update(np.asarray(sampled, dtype=np.int32)))
        self.s.check_invariants()
        return True

    def absorb(self, out) -> None:
        for d in out:
            rid = d.request_id
            if d.finish_reason == "cancelled":
                self.cancelled.add(rid)
                self.toks.pop(rid, None)
                continue
            self.toks[rid].extend(d.new_token_ids)
            if d.finished:
                self.done[rid] = self.toks.pop(rid)[len(self.prompt[rid]) :]

    def finish(self) -> None:
        for i in range(5000):
            if not self.s.has_unfinished():
                break
            self.step(1 + i % 4, i, i % 5 == 0)
        assert not self.s.has_unfinished()
        st_ = self.s.stats()
        assert st_["num_used_blocks"] == 0
        for rid, got in self.done.items():
            assert got == reference(self.prompt[rid], self.max_new[rid]), rid


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_st, min_size=1, max_size=60),
    num_blocks=st.integers(6, 30),
    page=st.integers(1, 5),
    mbt=st.integers(1, 24),
    layers=st.sampled_from([("full_attention",), ("sliding_attention",),
                            ("full_attention", "sliding_attention")]),
    offload=st.sampled_from([0, 32]),
)  # fmt: skip
def test_random_ops_with_proposals(ops, num_blocks, page, mbt, layers, offload) -> None:
    s = Scheduler(
        num_blocks=num_blocks, page_size=page, max_batch_tokens=mbt, layer_types=list(layers),
        sliding_window=5, cpu_offload_blocks=offload,
    )  # fmt: skip
    run = Run(s)
    for name, a, b, c in ops:
        if name == "add":
            run.add(a, b, c)
        elif name == "step":
            run.step(a, b, c)
        elif name == "cancel" and run.toks:
            rid = sorted(run.toks)[a % len(run.toks)]
            s.cancel(rid)
        elif name == "recompute" and run.toks:
            s.recompute(sorted(run.toks)[a % len(run.toks)])
        s.check_invariants()
    run.finish()
    st_ = s.stats()
    assert st_["spec_accepted"] <= st_["spec_proposed"]


def test_speculative_row_shape_and_rollback() -> None:
    s = Scheduler(num_blocks=20, page_size=4, max_batch_tokens=64)
    s.add_request("a", [1, 2, 3, 1, 2], 10)
    plan = s.schedule()
    s.update([3])
    assert s.propose_ngram(3, 1, 2) == 1  # "... 2 3" seen before: propose 1 2 3
    plan = s.schedule()
    assert plan.input_ids.tolist() == [3, 1, 2, 3]
    assert plan.positions.tolist() == [5, 6, 7, 8]
    assert plan.logits_indices.tolist() == [0, 1, 2, 3]
    assert plan.logits_rows.tolist() == [0, 0, 0, 0]
    used = s.stats()["num_used_blocks"]
    assert used == 3  # 9 keys
    out = s.update([1, 2, 9, 4])  # 1, 2 accepted, 9 the bonus
    assert [d.new_token_ids for d in out] == [[1], [2], [9]]
    assert s.stats()["spec_accepted"] == 2 and s.stats()["spec_proposed"] == 3
    assert s.stats()["num_used_blocks"] == 2  # rollback: 8 keys cached
    plan = s.schedule()
    assert plan.input_ids.tolist() == [9] and plan.positions.tolist() == [8]
    s.check_invariants()
    assert s.propose("nope", [1]) is False
    assert s.spec_cap == 4
