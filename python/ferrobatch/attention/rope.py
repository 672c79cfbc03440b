"""Rotary embeddings that transformers derives from the whole forward, made per request.

transformers' "longrope" (Phi-3 / Phi-3.5 / Phi-4-mini, PhiMoE, any config with
`rope_type="longrope"`) picks its frequencies, and PhiMoE its cos/sin scale, from
`max(position_ids) + 1` of the forward: short factors up to `original_max_position_embeddings`
(the threshold), long factors beyond. Under `model.generate` that maximum is the request's own
length: its prompt for the prefill, `position + 1` for each decode step. In a packed step it
would be the largest position of any request in the step, or of one chunk of a chunked
prefill, so one request's answer would depend on its batch mates.

`LongRope` restores the per-request rule. Each token is *long* when its request is long (its
prompt was longer than the threshold, or it crossed the threshold and was recomputed) or its
own position is at or past the threshold; else *short*. During a ferrobatch forward the
rotary module's own forward is called twice on the step's positions, once with every
position forced short (long tokens' positions zeroed, so the maximum stays below the
threshold) and once forced long (one extra position at the threshold appended), and each
token keeps the output of its kind: the model's own rope code, no copy of its formulas.

Crossing the threshold. Phi-3 and PhiMoE's `prepare_inputs_for_generation` drop the cache
when a sequence first grows past the threshold, so `generate` recomputes the whole sequence
with long factors at that step. The engine does the same: after the update in which a short
request's length reaches `threshold + 1`, `after_update` marks it long and asks the
scheduler to `recompute()` it (a soft reset: prompt + generated tokens prefilled again).
Models whose generation does not recompute keep their short keys and use long factors only
from the threshold on, as `generate` does. Prefix caching is off for these models: a block's
keys depend on whether its request is long, not on its tokens alone.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ferrobatch.core import Scheduler, StepPlan

logger = logging.getLogger("ferrobatch")

__all__ = ["LongRope", "forward_derived_rope"]


def _rope_type(module: torch.nn.Module) -> Any:
    return getattr(module, "rope_type", None)


def forward_derived_rope(model: Any) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every rotary embedding in `model` whose frequencies depend on the
    forward's length (transformers' `dynamic_rope_update`: "longrope" and "dynamic" types)."""
    out = []
    for name, m in model.named_modules():
        rt = _rope_type(m)
        kinds = rt.values() if isinstance(rt, dict) else [rt]
        if any(isinstance(k, str) and (k == "longrope" or "dynamic" in k) for k in kinds):
            out.append((name, m))
    return out


def _generation_recomputes(model: Any) -> bool:
    """Whether the model's `prepare_inputs_for_generation` drops the cache when a sequence
    crosses `original_max_position_embeddings` (Phi-3, PhiMoE): read from its own code."""
    fn = getattr(type(model), "prepare_inputs_for_generation", None)
    try:
        src = inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        return False
    return "original_max_position_embeddings" in src


class LongRope:
    """Per-request longrope factors for a packed step (see the module docstring).

    `threshold`: `original_max_position_embeddings`; `recompute`: whether crossing it
    recomputes the request (as the model's `generate` does). `long` holds the ids of the
    requests whose cached keys use the long factors.
    """

    def __init__(self, modules: list[torch.nn.Module], threshold: int, recompute: bool) -> None:
        self.modules = modules
        self.threshold = int(threshold)
        self.recompute = bool(recompute)
        self.long: set[str] = set()

    @classmethod
    def of(cls, model: Any, max_model_len: int) -> LongRope | None:
        """The `LongRope` of `model`, or None when no rotary embedding of it switches
        factors within `max_model_len` positions. "dynamic" (NTK) rope only changes past
        `max_position_embeddings`, which the engine's context never reaches: None.
        Raises `NotImplementedError` for a longrope layout it does not handle (per-layer-type
        rope parameters with longrope)."""
        name = type(model).__name__
        sites = []
        thresholds = set()
        for _, m in forward_derived_rope(model):
            rt = _rope_type(m)
            if isinstance(rt, dict):
                if "longrope" in rt.values():
                    raise NotImplementedError(
                        f"{name}: per-layer-type longrope rotary embeddings are not supported "
                        "(the short/long factor choice depends on the whole forward)"
                    )
                continue
            if rt != "longrope":
                continue
            params = getattr(getattr(m, "config", None), "rope_parameters", None) or {}
            thr = params.get("original_max_position_embeddings")
            if thr is None:
                raise NotImplementedError(
                    f"{name}: a longrope rotary embedding without "
                    "original_max_position_embeddings is not supported"
                )
            sites.append(m)
            thresholds.add(int(thr))
        if not sites:
            return None
        if len(thresholds) > 1:
            raise NotImplementedError(
                f"{name}: longrope rotary embeddings with different "
                f"original_max_position_embeddings {sorted(thresholds)} are not supported"
            )
        thr = thresholds.pop()
        if thr >= max_model_len:
            return None  # every position of every request stays short
        recompute = _generation_recomputes(model)
        cfg_thr = getattr(model.config, "original_max_position_embeddings", None)
        if recompute and cfg_thr is None:
            recompute = False  # the model's condition reads the config attribute: never true
        elif recompute and int(cfg_thr) != thr:
            raise NotImplementedError(
                f"{name}: generation recomputes at original_max_position_embeddings={cfg_thr} "
                f"but its rope switches factors at {thr}; not supported"
            )
        return cls(sites, thr, recompute)

    # -- requests ---------------------------------------------------------------------------

    def add(self, request_id: str, prompt_len: int) -> None:
        """A new request: long when its prompt is longer than the threshold."""
        if prompt_len > self.threshold:
            self.long.add(request_id)
        else:
            self.long.discard(request_id)

    def forget(self, request_id: str) -> None:
        self.long.discard(request_id)

    def crossing(self, plan: StepPlan) -> list[str]:
        """Requests of `plan` that cross the threshold with the token it samples (a short
        request sampled at position `threshold - 1`): with `recompute`, each must be
        recomputed before its next forward. Empty without `recompute`."""
        if not self.recompute:
            return []
        idx = np.asarray(plan.logits_indices, dtype=np.int64)
        if not len(idx):
            return []
        pos = np.asarray(plan.positions, dtype=np.int64)[idx]
        hit = np.flatnonzero(pos == self.threshold - 1)
        if not len(hit):
            return []
        rows = np.asarray(plan.logits_rows, dtype=np.int64)[hit]
        rids = list(plan.request_ids)
        return [rids[r] for r in rows if rids[r] not in self.long]

    def after_update(self, scheduler: Scheduler, plan: StepPlan, finished: list[str]) -> int:
        """After `scheduler.update()` of `plan`: forget finished requests; recompute (with
        long factors from now on) the ones that crossed the threshold. Returns how many
        were recomputed."""
        done = set(finished)
        for rid in done:
            self.long.discard(rid)
        n = 0
        for rid in self.crossing(plan):
            if rid in done:
                continue
            self.long.add(rid)
            if scheduler.recompute(rid):
                n += 1
        return n

    # -- the forward --------------------------------------------------------------------------

    def token_flags(self, plan: StepPlan) -> np.ndarray | None:
        """Per token of `plan`: long (True) or short; None when every token is short."""
        pos = np.asarray(plan.positions, dtype=np.int64)
        flags = pos >= self.threshold
        if self.long:
            rids = list(plan.request_ids)
            row_long = np.fromiter((r in self.long for r in rids), dtype=bool, count=len(rids))
            if row_long.any():
                cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
                flags |= np.repeat(row_long, np.diff(cu))
        return flags if flags.any() else None

    @contextmanager
    def forward(self, plan: StepPlan, device: torch.device) -> Iterator[None]:
        """Within the block, the rotary modules give each token of `plan` its own factors.
        The modules' `forward` is replaced on the instances for the block only, and their
        frequency buffers are restored afterwards."""
        flags = self.token_flags(plan)
        if flags is None:  # all short: the positions' maximum is below the threshold
            yield
            return
        all_long = bool(flags.all())
        mask = None if all_long else torch.from_numpy(flags).to(device)
        originals = []
        for m in self.modules:
            # the rope update writes the chosen frequencies into the module's buffer: put
            # back what the caller's model had
            saved = {k: b.clone() for k, b in m._buffers.items()
                     if b is not None and k.endswith("inv_freq")}
            originals.append((m, m.__dict__.get("forward"), saved))
            m.forward = _per_token_forward(m.forward, self.threshold, mask)
        try:
            yield
        finally:
            for m, orig, saved in originals:
                if orig is None:
                    del m.forward
                else:
                    m.forward = orig
                for k, b in saved.items():
                    m._buffers[k].copy_(b)


def _per_token_forward(orig: Any, threshold: int, mask: torch.Tensor | None) -> Any:
    """`orig` (a rotary forward `(x, position_ids, ...) -> (cos, sin)`) with long factors
    for every token (`mask` None) or for the tokens where `mask` is True."""

    def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = position_ids.shape[-1]
        extra = torch.full((*position_ids.shape[:-1], 1), threshold, dtype=position_ids.dtype,
                           device=position_ids.device)
        long_out = orig(x, torch.cat([position_ids, extra], dim=-1), *args, **kwargs)
        long_out = tuple(t[..., :n, :] for t in long_out)
        if mask is None:
            return long_out
        short_pos = position_ids.masked_fill(mask.view(*([1] * (position_ids.dim() - 1)), n), 0)
        short_out = orig(x, short_pos, *args, **kwargs)
        sel = mask.view(*([1] * (position_ids.dim() - 1)), n, 1)
        return tuple(torch.where(sel, lo, so) for lo, so in zip(long_out, short_out, strict=True))

    return forward
