"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the log-probability of every prompt
token given the tokens before it (the first has none), plus the top-n alternatives, computed
from the logits of the prompt positions while the prompt is prefilled, chunk by chunk.

The logits at position `p` give the distribution of token `p + 1`, so a request of `L`
prompt tokens needs the logits of positions `0 .. L-2` (position `L-1`'s row is the sampled
one). A step finds, for each row of a request that still needs some (`PromptJob.of`), the
token indices of those positions in the plan; the runner returns their logits besides the
sampled rows' (`ModelRunner.execute_with_prompt`) and `PromptJob.record` appends one dict per
position to the request's `output.prompt_logprobs` (which starts as `[None]`). Positions are
recorded once: a request recomputed after a soft reset (or a longrope crossing) skips those
already done. Requests that want prompt logprobs take no prefix-cache hits
(`Scheduler.add_request(..., skip_prefix_lookup=True)`), so every position is computed by
some step; requests that don't ask cost nothing (no extra logits, no extra work).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ferrobatch.core import StepPlan

__all__ = ["PromptJob"]

# rows of [rows, vocab] fp32 log-softmax computed at once (bounds the temporary)
_CHUNK_ROWS = 256


@dataclass
class PromptJob:
    """The prompt positions of one plan whose next-token logprobs are wanted.

    `indices` [M] token indices into the plan (for the runner); `targets` [M] the prompt
    token each one scores (the next prompt token); `spans`: (request, start, count, n) per
    request, its entries `start .. start+count` of `indices`, its top-n.
    """

    indices: np.ndarray
    targets: np.ndarray
    spans: list[tuple[Any, int, int, int]]

    @classmethod
    def of(cls, plan: StepPlan, pending: dict[str, Any]) -> PromptJob | None:
        """The job of `plan` for the requests in `pending` (by id: those with prompt
        positions left; the ones done or finished are dropped from it). None when no row
        needs any; the caller skips this altogether while `pending` is empty."""
        for rid in [k for k, req in pending.items() if _complete(req)]:
            del pending[rid]
        if not pending:
            return None
        wanting = []
        for r, rid in enumerate(plan.request_ids):
            req = pending.get(rid)
            if req is not None:
                wanting.append((r, req))
        if not wanting:
            return None
        cu = np.asarray(plan.cu_seqlens_q)
        positions = np.asarray(plan.positions)
        idx_parts, tgt_parts, spans = [], [], []
        total = 0
        for r, req in wanting:
            t0, t1 = int(cu[r]), int(cu[r + 1])
            if t1 <= t0:
                continue
            start = int(positions[t0])
            done = len(req.output.prompt_logprobs) - 1  # positions 0 .. done-1 recorded
            end = min(start + (t1 - t0), len(req.prompt_ids) - 1)
            if start > done:
                raise RuntimeError(
                    f"prompt logprobs of {req.request_id!r}: positions {done}..{start} were "
                    "never computed (a prefix-cache hit?)"
                )
            lo = done
            if end <= lo:
                continue
            idx_parts.append(np.arange(t0 + (lo - start), t0 + (end - start), dtype=np.int64))
            tgt_parts.append(np.asarray(req.prompt_ids[lo + 1 : end + 1], dtype=np.int64))
            spans.append((req, total, end - lo, int(req.params.prompt_logprobs)))
            total += end - lo
        if not spans:
            return None
        return cls(np.concatenate(idx_parts), np.concatenate(tgt_parts), spans)

    def record(self, logits: torch.Tensor) -> None:
        """Append each position's `{token_id: logprob}` (top-n, then the prompt token) to
        its request's `output.prompt_logprobs`; `logits` [M, vocab], rows of `indices`."""
        if logits.shape[0] != len(self.indices):
            raise ValueError(f"got {logits.shape[0]} prompt logit rows for {len(self.indices)}")
        n_max = max(n for _, _, _, n in self.spans)
        targets = torch.from_numpy(self.targets).to(logits.device)
        chosen_parts, vals_parts, idx_parts = [], [], []
        for a in range(0, logits.shape[0], _CHUNK_ROWS):
            lp = torch.log_softmax(logits[a : a + _CHUNK_ROWS].float(), dim=-1)
            chosen_parts.append(lp.gather(1, targets[a : a + _CHUNK_ROWS, None]).squeeze(1))
            if n_max:
                v, i = torch.topk(lp, min(n_max, lp.shape[1]), dim=-1)
                vals_parts.append(v)
                idx_parts.append(i)
        chosen = torch.cat(chosen_parts).cpu().tolist()
        tvals = torch.cat(vals_parts).cpu().tolist() if n_max else None
        tidx = torch.cat(idx_parts).cpu().tolist() if n_max else None
        tg = self.targets.tolist()
        for req, start, count, n in self.spans:
            out = req.output.prompt_logprobs
            for j in range(start, start + count):
                d: dict[int, float] = {}
                if n and tvals is not None and tidx is not None:
                    for t, v in zip(tidx[j][:n], tvals[j][:n], strict=True):
                        d[int(t)] = float(v)
                d[int(tg[j])] = float(chosen[j])
                out.append(d)


def _complete(req: Any) -> bool:
    """Every prompt position recorded, or the request is over."""
    return req.done.is_set() or len(req.output.prompt_logprobs) >= len(req.prompt_ids)
