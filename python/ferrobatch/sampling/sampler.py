"""The batched on-device sampler and the per-request state it keeps between steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ferrobatch.sampling.guided import mask_rows
from ferrobatch.sampling.params import SamplingParams


@dataclass
class SamplingState:
    """What the sampler needs to remember about one request between steps."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    guide: Any = None  # a `ferrobatch.sampling.guided.Guide` for guided requests
    plain_greedy: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        # a guided row needs its full logits (masked): never the runner's greedy screen
        self.plain_greedy = (
            p.greedy and not p.has_penalties and p.logprobs is None and self.guide is None
        )

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """The request's own generator when it is seeded (created on first use)."""
        if self.params.seed is None:
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(int(self.params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return self.generator


@dataclass
class SampleResult:
    """Sampled token ids [N] (int64, CPU) and optional per-row logprob dicts."""

    token_ids: torch.Tensor
    logprobs: list[dict[int, float] | None] | None = None


@dataclass
class DeviceSample:
    """A step's samples still on the logits' device (nothing synchronized yet).

    `token_ids` [N] int64; with logprobs, `lp_rows` (the rows that asked), `lp_counts` (their
    top-n), `lp_chosen` [len(lp_rows)] the chosen tokens' logprobs and `lp_top_vals` /
    `lp_top_idx` [len(lp_rows), max n] (None when every n is 0). `device_tensors()` lists
    what has to reach the host; `finish(host)` builds the `SampleResult` from host copies of
    them (in that order), `to_host()` does both with plain blocking copies.
    """

    token_ids: torch.Tensor
    lp_rows: list[int] | None = None
    lp_counts: list[int] | None = None
    lp_chosen: torch.Tensor | None = None
    lp_top_vals: torch.Tensor | None = None
    lp_top_idx: torch.Tensor | None = None

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors whose host copies `finish` takes, in order."""
        out = [self.token_ids]
        if self.lp_rows is not None:
            assert self.lp_chosen is not None
            out.append(self.lp_chosen)
            if self.lp_top_vals is not None and self.lp_top_idx is not None:
                out += [self.lp_top_vals, self.lp_top_idx]
        return out

    def finish(self, host: Sequence[torch.Tensor]) -> SampleResult:
        """The `SampleResult` from CPU copies of `device_tensors()`."""
        token_ids = host[0]
        if self.lp_rows is None or self.lp_counts is None:
            return SampleResult(token_ids)
        ids = token_ids.tolist()
        chosen_lp = host[1].tolist()
        top_vals = host[2].tolist() if len(host) > 2 else None
        top_idx = host[3].tolist() if len(host) > 3 else None
        out: list[dict[int, float] | None] = [None] * len(ids)
        for j, i in enumerate(self.lp_rows):
            d: dict[int, float] = {}
            n = self.lp_counts[j]
            if n and top_vals is not None and top_idx is not None:
                for t, v in zip(top_idx[j][:n], top_vals[j][:n], strict=True):
                    d[int(t)] = float(v)
            d[int(ids[i])] = float(chosen_lp[j])
            out[i] = d
        return SampleResult(token_ids, out)

    def to_host(self) -> SampleResult:
        """Copy to the CPU (blocking) and finish."""
        return self.finish([t.cpu() for t in self.device_tensors()])


class Sampler:
    """Samples one token per logits row, every row with its own parameters, in one batch.

    `sample` never synchronizes with the device: every host-built tensor goes up with a
    non-blocking copy (from pinned memory on CUDA) and the result stays on the device, so a
    pipeline can queue the sampling of a step behind its forward and read it back later.
    """

    def __init__(self, device: torch.device | None = None, seed: int | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SampleResult:
        """Pick the next token of each row; `states[i]` describes row i of `logits` [N, V]."""
        return self.sample(logits, states).to_host()

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> DeviceSample:
        """Like `__call__`, but the result stays on the logits' device (no synchronization)."""
        n = logits.shape[0]
        if n != len(states):
            raise ValueError(f"logits has {n} rows but {len(states)} sampling states were given")
        if n == 0:
            return DeviceSample(torch.empty(0, dtype=torch.int64, device=logits.device))
        if all(s.plain_greedy for s in states):
            return DeviceSample(argmax_rows(logits))
        params = [s.params for s in states]
        raw = logits
        scores = logits.float().clone()
        dev = scores.device
        vocab = scores.shape[1]
        self._apply_penalties(scores, states, dev, vocab)
        if any(s.guide is not None for s in states):
            mask_rows(scores, states)

        chosen = argmax_rows(scores).to(dev)
        if not all(p.greedy for p in params):
            sample_rows = [i for i, p in enumerate(params) if not p.greedy]
            idx = _to_device(sample_rows, torch.int64, dev)
            sub = scores.index_select(0, idx)
            sub = self._warp(sub, [params[i] for i in sample_rows])
            probs = torch.softmax(sub, dim=-1)
            noise = self._exponential_noise([states[i] for i in sample_rows], vocab, dev)
            picked = (probs / noise).argmax(dim=-1)
            chosen = chosen.index_copy(0, idx, picked)
        if any(p.logprobs is not None for p in params):
            return self._logprobs(raw, params, chosen)
        return DeviceSample(chosen)

    # -- pieces ---------------------------------------------------------------------------

    @staticmethod
    def _apply_penalties(
        scores: torch.Tensor, states: Sequence[SamplingState], dev: torch.device, vocab: int
    ) -> None:
        rep_rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
        if rep_rows:
            hist = [states[i].prompt_ids + states[i].output_ids for i in rep_rows]
            ids = _pad_ids(hist, pad=vocab, dev=dev).clamp_(0, vocab)
            idx = _to_device(rep_rows, torch.int64, dev)
            sub = torch.nn.functional.pad(scores.index_select(0, idx), (0, 1))
            pen = _to_device(
                [states[i].params.repetition_penalty for i in rep_rows], torch.float32, dev
            ).unsqueeze(1)
            got = sub.gather(1, ids)
            got = torch.where(got < 0, got * pen, got / pen)
            sub = sub.scatter(1, ids, got)[:, :vocab]
            scores.index_copy_(0, idx, sub)
        pf_rows = [
            i
            for i, s in enumerate(states)
            if (s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0)
            and s.output_ids
        ]
        if pf_rows:
            hist = [states[i].output_ids for i in pf_rows]
            ids = _pad_ids(hist, pad=vocab, dev=dev).clamp_(0, vocab)
            counts = torch.zeros(len(pf_rows), vocab + 1, device=dev)
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
            counts = counts[:, :vocab]
            pres = _to_device(
                [states[i].params.presence_penalty for i in pf_rows], torch.float32, dev
            )
            freq = _to_device(
                [states[i].params.frequency_penalty for i in pf_rows], torch.float32, dev
            )
            idx = _to_device(pf_rows, torch.int64, dev)
            delta = pres.unsqueeze(1) * (counts > 0).float() + freq.unsqueeze(1) * counts
            scores.index_copy_(0, idx, scores.index_select(0, idx) - delta)

    @staticmethod
    def _warp(sub: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        dev = sub.device
        vocab = sub.shape[1]
        temp = _to_device([p.temperature for p in params], torch.float32, dev).unsqueeze(1)
        sub = sub / temp
        ks = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
        if any(ks):
            kmax = max(ks)
            top_vals = torch.topk(sub, kmax, dim=-1).values
            k_idx = _to_device([max(k, 1) - 1 for k in ks], torch.int64, dev).unsqueeze(1)
            thresh = top_vals.gather(1, k_idx)
            active = _to_device([k > 0 for k in ks], torch.bool, dev).unsqueeze(1)
            sub = sub.masked_fill(active & (sub < thresh), -math.inf)
        if any(p.top_p < 1.0 for p in params):
            top_p = _to_device([p.top_p for p in params], torch.float32, dev).unsqueeze(1)
            sorted_logits, sorted_idx = torch.sort(sub, descending=False, dim=-1)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = cum <= (1 - top_p)
            remove[:, -1] = False
            mask = remove.scatter(1, sorted_idx, remove)
            sub = sub.masked_fill(mask, -math.inf)
        if any(p.min_p > 0.0 for p in params):
            min_p = _to_device([p.min_p for p in params], torch.float32, dev).unsqueeze(1)
            probs = torch.softmax(sub, dim=-1)
            top = probs.amax(dim=-1, keepdim=True)
            remove = probs < min_p * top
            remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
            sub = sub.masked_fill(remove, -math.inf)
        return sub

    def _exponential_noise(
        self, states: Sequence[SamplingState], vocab: int, dev: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(len(states), vocab, device=dev)
        unseeded = [i for i, s in enumerate(states) if s.params.seed is None]
        if len(unseeded) == len(states):
            noise.exponential_(generator=self._generator)
        else:
            for i, s in enumerate(states):
                gen = s.generator_for(dev)
                noise[i].exponential_(generator=gen if gen is not None else self._generator)
        return noise.clamp_(min=1e-20)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, params: Sequence[SamplingParams], chosen: torch.Tensor
    ) -> DeviceSample:
        """`chosen` [N] (on the device) with the logprob tensors of the rows that ask."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        counts = [params[i].logprobs or 0 for i in rows]
        dev = raw.device
        idx = _to_device(rows, torch.int64, dev)
        lp = torch.log_softmax(raw.index_select(0, idx).float(), dim=-1)
        n_max = max(counts)
        top_vals = top_idx = None
        if n_max > 0:
            top_vals, top_idx = torch.topk(lp, min(n_max, lp.shape[1]), dim=-1)
        chosen_dev = chosen.to(dev)
        chosen_lp = lp.gather(1, chosen_dev.index_select(0, idx).unsqueeze(1)).squeeze(1)
        return DeviceSample(chosen, rows, counts, chosen_lp, top_vals, top_idx)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax as int64 on `x`'s device; same result as `torch.argmax` (first
    maximum, NaN wins), through numpy on CPU where torch's reduction is many times slower."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1).astype(np.int64))
    return x.argmax(dim=-1)


def _to_device(values: Sequence[Any], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A small host-built tensor on `dev` without a device synchronization (a plain
    `torch.tensor(..., device=cuda)` waits for the stream; this goes up non-blocking from
    pinned memory, which the caching host allocator keeps until the copy ran)."""
    t = torch.tensor(values, dtype=dtype)
    if dev.type == "cpu":
        return t
    if dev.type == "cuda":
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


def _pad_ids(rows: Sequence[Sequence[int]], *, pad: int, dev: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    if dev.type == "cpu":
        return out
    if dev.type == "cuda":
        out = out.pin_memory()
    return out.to(dev, non_blocking=True)
