"""Running one target request alone or inside a scripted mix of other requests (arrival steps,
cancellations), one engine step at a time in the caller's thread, and comparing what came
back bit for bit."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ferrobatch import Engine, SamplingParams


@dataclass(frozen=True)
class Other:
    """A batch mate: its prompt and sampling, the step it arrives at and the step it is
    cancelled at (None: never)."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    arrive: int = 0
    cancel: int | None = None


def _submit(engine: Engine, prompt: Sequence[int], sp: SamplingParams) -> Any:
    req = engine._make_request(list(prompt), sp, None)
    engine._submit(req, bounded=False)
    return req


def run_target(engine: Engine, target: Sequence[int], sp: SamplingParams,
               others: Sequence[Other] = (), target_arrives: int = 0
               ) -> tuple[list[int], list[list[tuple[int, bytes]]] | None]:
    """The target's (token ids, logprobs as sorted (token, float64 bits) pairs per token)
    when it arrives at step `target_arrives` among `others`; the engine is stepped in this
    thread until every request is done."""
    step = 0
    target_req = None
    live: dict[int, Any] = {}
    pending = dict(enumerate(others))
    while True:
        if target_req is None and step >= target_arrives:
            target_req = _submit(engine, target, sp)
        for i, o in list(pending.items()):
            if o.arrive <= step:
                live[i] = _submit(engine, o.prompt, o.sampling)
                del pending[i]
        for i, req in live.items():
            if others[i].cancel == step and not req.done.is_set():
                engine.cancel(req.request_id)
        done = target_req is not None and target_req.done.is_set()
        if done and not pending and all(r.done.is_set() for r in live.values()):
            break
        engine._drive_once()
        step += 1
    for req in [target_req, *live.values()]:
        engine._forget(req)
    if target_req.error is not None:
        raise target_req.error
    out = target_req.output
    return list(out.token_ids), logprob_bits(out.logprobs)


def logprob_bits(logprobs: list[dict[int, float]] | None) -> list[list[tuple[int, bytes]]] | None:
    """Each token's logprob entries as sorted (token id, IEEE-754 float64 bytes) pairs: equal
    lists mean bit-identical logprobs."""
    if logprobs is None:
        return None
    return [sorted((int(t), struct.pack("<d", v)) for t, v in d.items()) for d in logprobs]
