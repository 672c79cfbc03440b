"""The draft-model proposer: a smaller model sharing the tokenizer proposes k tokens
greedily, with its own paged KV cache, scheduler and runner.

Each target request that may speculate has a *mirror* request in the draft's scheduler whose
tokens are the target's tokens plus the draft's own guesses. Before a target step:

1. the mirror is cut back (`Scheduler.rewind`) to its common prefix with the target's
   tokens (the guesses the target rejected are forgotten, their KV overwritten later);
2. the target tokens the mirror lacks are proposed to the draft's scheduler as its own
   speculative row (they are known: the draft's update is fed them, so all are accepted),
   and the draft's argmax after the last of them is its first guess;
3. k - 1 more greedy draft steps; the guesses beyond the target's tokens are proposed to the
   target's scheduler (`Scheduler.propose`).

A mirror that cannot be cut back (swapped out, ring moved on) or that finished is cancelled
and added again with the target's tokens as its prompt (prefix-cache hits cover its full
blocks). Mirrors of requests that do not speculate this step (paused, finished) are
cancelled.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ferrobatch.core import Scheduler
from ferrobatch.errors import FieldError
from ferrobatch.models import load_model, model_lock
from ferrobatch.runner.model_runner import ModelRunner
from ferrobatch.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from ferrobatch.config import ContinuousBatchingConfig
    from ferrobatch.engine.request import Request

__all__ = ["DraftProposer"]

logger = logging.getLogger("ferrobatch")


class DraftProposer:
    """Greedy k-token proposals from a draft model (see the module docstring).

    The target model's side: its engine `config` (page size, batch budgets), `device` and
    `dtype` (the draft is loaded there), `vocab_size` (the draft must share the tokenizer)
    and `num_blocks` (the draft's cache size unless `cfg.draft_num_blocks`)."""

    def __init__(
        self,
        cfg: SpeculativeConfig,
        *,
        config: ContinuousBatchingConfig,
        device: torch.device,
        dtype: torch.dtype,
        vocab_size: int,
        num_blocks: int,
    ) -> None:
        self.k = cfg.num_speculative_tokens
        draft, _ = load_model(cfg.draft_model, device=device, dtype=dtype)
        vocab = getattr(draft.config, "vocab_size", None)
        if vocab != vocab_size:
            raise FieldError(
                f"draft_model has vocab_size {vocab} but the model has "
                f"{vocab_size}: the draft must share the tokenizer",
                field="draft_model",
            )
        num_blocks = cfg.draft_num_blocks or num_blocks
        if cfg.draft_num_blocks is not None and \
                num_blocks * config.page_size < config.max_batch_tokens:
            logger.warning(
                "ferrobatch: draft_num_blocks=%d holds %d tokens, fewer than one step's "
                "max_batch_tokens (%d): a request the draft's cache cannot hold with its "
                "proposals is not speculated", num_blocks, num_blocks * config.page_size,
                config.max_batch_tokens)
        self.runner = ModelRunner(
            draft, num_blocks=num_blocks, page_size=config.page_size, device=device,
            dtype=dtype, use_cuda_graph=False, config=config,
        )  # fmt: skip
        self.scheduler = Scheduler(
            num_blocks, config.page_size, config.max_batch_tokens,
            max_requests_per_batch=config.max_requests_per_batch,
            layer_types=list(self.runner.layer_types), sliding_window=self.runner.sliding_window,
        )  # fmt: skip
        self.lock = model_lock(draft)
        self.mirrors: dict[str, list[int]] = {}  # request id -> the mirror's tokens
        self.names: dict[str, str] = {}  # request id -> its mirror's id (unique per add)
        self.owner: dict[str, str] = {}  # mirror id -> request id
        self.adds = 0
        self.forward_steps = 0

    # ------------------------------------------------------------------ proposals

    def propose(self, scheduler: Scheduler, ids: list[str], reqs: Mapping[str, Request]) -> int:
        """Draft up to k tokens for each request in `ids`; propose them to `scheduler`."""
        want = set(ids)
        for rid in [r for r in self.mirrors if r not in want]:
            self._drop(rid)
        targets: dict[str, list[int]] = {}
        for rid in ids:
            req = reqs[rid]
            tgt = req.prompt_ids + req.sstate.output_ids
            targets[rid] = tgt
            self._sync(rid, tgt, req.params.max_new_tokens - len(req.sstate.output_ids))
        for _ in range(self.k):
            if not self._draft_step(targets):
                break
        n = 0
        for rid, tgt in targets.items():
            m = self.mirrors.get(rid)
            if m is not None and len(m) > len(tgt) and m[: len(tgt)] == tgt:
                n += scheduler.propose(rid, m[len(tgt) : len(tgt) + self.k])
        return n

    def _sync(self, rid: str, tgt: list[int], remaining: int) -> None:
        """Cut the mirror back to its common prefix with `tgt`; propose what it lacks."""
        m = self.mirrors.get(rid)
        if m is not None:
            c = _common_prefix(m, tgt)
            if c < len(m) and not self.scheduler.rewind(self.names[rid], c):
                self._drop(rid)
                m = None
            else:
                del m[c:]
        if m is None:
            self._add(rid, tgt, remaining)
            return
        if len(tgt) > len(m):
            self.scheduler.propose(self.names[rid], tgt[len(m) :])

    def _add(self, rid: str, tgt: list[int], remaining: int) -> None:
        # room for the target's remaining tokens plus k guesses (rewinds give tokens back)
        name = f"{rid}#{self.adds}"
        self.adds += 1
        try:
            self.scheduler.add_request(name, tgt, max(1, remaining) + self.k + 1)
        except ValueError:  # too long for the draft's cache: this request gets no drafts
            return
        self.mirrors[rid] = list(tgt)
        self.names[rid] = name
        self.owner[name] = rid

    def _drop(self, rid: str) -> None:
        self.mirrors.pop(rid, None)
        name = self.names.pop(rid, None)
        if name is not None:
            self.owner.pop(name, None)
            self.scheduler.cancel(name)

    def _draft_step(self, targets: dict[str, list[int]]) -> bool:
        """One draft forward: known target tokens fed where the mirror lags, argmax beyond."""
        s = self.scheduler
        plan = s.schedule()
        if plan is None:
            self._absorb(s.update(()))
            return False
        with self.lock, torch.inference_mode():
            if self.runner.fast_greedy:
                guess = self.runner.execute_greedy(plan).numpy()
            else:
                guess = self.runner.execute(plan).float().argmax(dim=-1).numpy()
        self.forward_steps += 1
        rids = [self.owner.get(n) for n in plan.request_ids]
        rows = np.asarray(plan.logits_rows)
        nxt = np.asarray(plan.positions)[np.asarray(plan.logits_indices)] + 1
        feed = guess.astype(np.int32)
        for e in range(len(feed)):
            rid = rids[rows[e]]
            tgt = targets.get(rid) if rid is not None else None
            if tgt is not None and nxt[e] < len(tgt):
                feed[e] = tgt[nxt[e]]
        self._absorb(s.update(feed))
        return True

    def _absorb(self, out: Any) -> None:
        for d in out:
            rid = self.owner.get(d.request_id)
            m = self.mirrors.get(rid) if rid is not None else None
            if m is None:
                continue
            m.extend(d.new_token_ids)
            if d.finished:  # length: it is added again when it speculates next
                self._drop(rid)

    # ------------------------------------------------------------------ lifetime

    def forget(self, request_id: str) -> None:
        """The target request left: its mirror goes too."""
        if request_id in self.mirrors:
            self._drop(request_id)

    def close(self) -> None:
        """Give the draft model back untouched."""
        self.runner.close()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
