"""Sampling states of a speculative plan: one per `logits_indices` entry.

Entry `j` of a speculative row samples the token after the row's `j` first proposals, so
its state sees them as generated (penalties count them); its generator is the request's
own (seeded rows draw their positions one after the other: reproducible). The core then
accepts the longest prefix of proposals the samples match, plus the next sample: for greedy
rows exactly the non-speculative tokens, for sampled rows the rejection rule for a
deterministic proposal (accept `x` with probability `p(x)`, else a draw from `p` without `x`,
renormalised), so the output distribution is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferrobatch.sampling.sampler import SamplingState

if TYPE_CHECKING:
    from ferrobatch.core import StepPlan

__all__ = ["entry_states", "has_spec_rows"]


def has_spec_rows(rows: Sequence[int]) -> bool:
    """Whether a plan's `logits_rows` name a row twice (a speculative row)."""
    return len(rows) > 1 and len(set(rows)) < len(rows)


def entry_states(
    plan: StepPlan, rows: Sequence[int], states: Sequence[SamplingState], device: torch.device
) -> list[SamplingState]:
    """`states` (one per entry of `rows` = `plan.logits_rows`) with each speculative entry's
    proposals so far added to its request's output (plain greedy states are shared: no
    penalty reads them)."""
    out = list(states)
    ids = np.asarray(plan.input_ids)
    cu = np.asarray(plan.cu_seqlens_q)
    i = 0
    n = len(rows)
    while i < n:
        r = rows[i]
        j = i
        while j < n and rows[j] == r:
            j += 1
        s = states[i]
        if j - i > 1 and not s.plain_greedy:
            s.generator_for(device)  # created once, shared by every entry
            props = ids[cu[r] + 1 : cu[r + 1]].tolist()
            for e in range(1, j - i):
                out[i + e] = dataclasses.replace(s, output_ids=s.output_ids + props[:e])
                out[i + e].generator = s.generator
        i = j
    return out
