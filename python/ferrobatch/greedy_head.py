"""Greedy tokens from an fp32 linear output head without computing every fp32 logit.

For greedy rows only the argmax of `hidden @ W.T` is needed. `GreedyHead` screens the
vocabulary with a cheap low-precision product, keeps every token whose screened score is
within a proven error bound of the row's best, and rescores only those candidates in fp32
(one fp32 product of the rows with the union of the candidates' weight rows; ties go to the
lowest token id, as `argmax`). The result is the argmax of the fp32 logits. Two screens:

* int8 (`torch._int_mm`, exact int32 accumulation; about a third of the fp32 product's time
  on CPUs with VNNI). The weight is quantized once with one scale `s = max |W| / 127`
  (`w_ji = s p_ji + f_ji`, `|f_ji| <= s/2`), each hidden row with its own
  `t = max |h| / 127` (`h_i = t q_i + e_i`, `|e_i| <= t/2`); the screened score
  `a_j = t s sum_i q_i p_ji` satisfies
  `|a_j - h . w_j| <= (s/2) ||h||_1 + (t/2) max_j ||w_j||_1 + (3/4) K t s`.
  Weights with outlier rows or features make that window wide: when the int8 screen
  leaves too many candidates on more than a quarter of its first calls, it is dropped.
* bf16 (oneDNN, weight reordered once; about half the fp32 time with native bf16 dot
  products): `a_j` is `bf(h) . bf(w_j)` accumulated in fp32 and rounded to bf16, so with
  `u = 2^-8`, `|a_j - h . w_j| <= (2u + u^2 + K 2^-24 + u (1 + ...)) ||h|| ||w_j||
  <= 0.013 ||h|| max_j ||w_j||` (K <= 4096).

With `eps` the screen's bound and `delta = K 2^-24 ||h||_2 max_j ||w_j||_2` the rounding of
the fp32 logits themselves, every token with `a_j < max_j a_j - 2 (eps + delta)` has a
smaller fp32 logit than the screened best, so the fp32 argmax is among the others. When a
screen leaves too many candidates, or anything is not finite, the next one is tried, and
`argmax` returns None when none decides (the caller then computes the full fp32 logits).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

logger = logging.getLogger("ferrobatch")

__all__ = ["GreedyHead"]

_BF16_BOUND = 0.013
_MAX_CANDIDATES = 64  # per row on average; beyond it the screen is not worth it
_INT8_TRIAL_CALLS = 16  # the int8 screen is judged after this many calls ...
_INT8_MAX_MISS_SHARE = 0.25  # ... and dropped when it failed to decide more often than this

_HAVE_INT_MM = hasattr(torch, "_int_mm")
_HAVE_MKLDNN = bool(
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


def _mkldnn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class GreedyHead:
    """Argmax rows of `hidden @ weight.T` (fp32 CPU, no bias) via bounded low-precision
    screens. What they need (int8 and bf16 copies of the weight, its norms) is derived once
    and recomputed when the weight object or its version changes."""

    def __init__(self, weight: torch.Tensor) -> None:
        self._weight = weight
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None  # bf16, oneDNN layout
        self._qweight: torch.Tensor | None = None  # [V, K] int8
        self._scale = 1.0  # s
        self._w1max = 0.0  # max_j ||w_j||_1
        self._w2max = 0.0  # max_j ||w_j||_2
        self.int8 = _HAVE_INT_MM  # the int8 screen is on (dropped when it rarely decides)
        self._int8_calls = 0
        self._int8_misses = 0

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        """An fp32 2-D CPU weight with at most 4096 input features, and oneDNN present."""
        return (
            _HAVE_MKLDNN
            and weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[1] <= 4096
        )

    def _prepare(self) -> None:
        w = self._weight
        key = (id(w), w._version)
        if self._packed is None or self._key != key:
            with torch.no_grad():
                wd = w.detach()
                self._packed = torch.ops.mkldnn._reorder_linear_weight(wd.bfloat16(), 64)
                w64 = wd.double()
                self._w2max = float(w64.norm(dim=1).max())
                self._w1max = float(w64.abs().sum(dim=1).max())
                amax = float(w64.abs().max())
                self._scale = amax / 127.0 if amax > 0 else 1.0
                self._qweight = (
                    torch.round(w64 / self._scale).to(torch.int8).contiguous()
                    if self.int8 else None
                )
            self._key = key

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Token ids [N] (int64, CPU) = argmax of the fp32 logits of `hidden` [N, K]; None
        when no screen can decide cheaply (the caller then computes full logits)."""
        self._prepare()
        n, k = hidden.shape
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        hidden = hidden.contiguous()
        h64 = hidden.double()
        hmax = h64.abs().amax(dim=1)
        if not bool(torch.isfinite(hmax).all()) or not bool((hmax > 0).all()):
            return None  # non-finite, or an all-zero row (every logit ties)
        # the fp32 logits' own rounding, in the screens' windows
        # (plus a tiny absolute term for flushed denormals in the low-precision products)
        delta = k * (2.0**-24 * h64.norm(dim=1).numpy() * self._w2max + 2.0**-120)
        cand = None
        if self.int8:
            cand = self._screen_int8(h64, hmax, delta)
            self._int8_calls += 1
            self._int8_misses += cand is None
            if (self._int8_calls >= _INT8_TRIAL_CALLS
                    and self._int8_misses > _INT8_MAX_MISS_SHARE * self._int8_calls):
                logger.info("ferrobatch: int8 head screen rarely decides here; bf16 only")
                self.int8 = False
                self._qweight = None
        if cand is None:
            cand = self._screen_bf16(hidden, h64, delta)
        if cand is None:
            return None
        return self._rescore(hidden, *cand)

    def _select(
        self, scores: np.ndarray, window: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, tokens) of the scores within `window` of their row's best; None when too
        many. `window` is already in the scores' units and rounded outwards."""
        n, vocab = scores.shape
        thr = scores.max(axis=1).astype(np.float64) - window
        if scores.dtype == np.int32:
            thr = np.maximum(np.floor(thr), np.iinfo(np.int32).min).astype(np.int32)
        else:
            thr = np.nextafter(thr.astype(np.float32), np.float32(-np.inf))  # rounded down
        # (numpy: torch's broadcast compare and 2-D nonzero are several times slower here)
        flat = np.flatnonzero(scores >= thr[:, None])
        if len(flat) > _MAX_CANDIDATES * n:
            return None
        return flat // vocab, flat % vocab

    def _screen_int8(self, h64: torch.Tensor, hmax: torch.Tensor, delta: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        assert self._qweight is not None
        k = h64.shape[1]
        t = hmax / 127.0
        q = torch.round(h64 / t.unsqueeze(1)).to(torch.int8)
        acc = torch._int_mm(q, self._qweight.t()).numpy()  # [N, V] int32, exact
        s, t_np = self._scale, t.numpy()
        eps = (0.5 * s * h64.abs().sum(dim=1).numpy() + 0.5 * t_np * self._w1max
               + 0.75 * k * t_np * s)
        window = np.ceil(2.0 * (eps + delta) / (t_np * s)) + 1.0  # integer units of t*s
        if not np.isfinite(window).all():
            return None
        return self._select(acc, window)

    def _screen_bf16(self, hidden: torch.Tensor, h64: torch.Tensor, delta: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        assert self._packed is not None
        approx = _mkldnn_linear(hidden.bfloat16(), self._packed).float().numpy()  # [N, V]
        eps = _BF16_BOUND * h64.norm(dim=1).numpy() * self._w2max
        window = 2.0 * (eps + delta)
        if not (np.isfinite(approx.max(axis=1)).all() and np.isfinite(window).all()):
            return None
        return self._select(approx, window)

    def _rescore(self, hidden: torch.Tensor, r: np.ndarray, c: np.ndarray
                 ) -> torch.Tensor | None:
        """The fp32 argmax among each row's candidates (ties: lowest token id)."""
        n = hidden.shape[0]
        cols, where = np.unique(c, return_inverse=True)
        weight = self._weight.detach().index_select(0, torch.from_numpy(cols))
        e = torch.mm(hidden, weight.t()).numpy()[r, where]
        if not np.isfinite(e).all():
            return None
        order = np.lexsort((c, -e, r))  # per row: highest logit first, then lowest id
        r_sorted = r[order]
        first = np.flatnonzero(np.r_[True, r_sorted[1:] != r_sorted[:-1]])
        if len(first) != n:  # every row keeps its own best; anything else is a bug
            return None
        return torch.from_numpy(c[order[first]].astype(np.int64))

    def wins(self, rows: int = 64, rounds: int = 5) -> bool:
        """Whether the screens agree with the fp32 argmax on random rows and take at most 80%
        of the CPU time of the fastest fp32 head + argmax here; False on any failure."""
        if not self.supported(self._weight):
            return False
        gen = torch.Generator().manual_seed(0)
        k = self._weight.shape[1]
        x = torch.randn(rows, k, generator=gen)
        w = self._weight.detach()
        try:
            with torch.inference_mode():
                got = self.argmax(x)
                ref = torch.mm(x, w.t()).argmax(dim=1)
                if got is None or not torch.equal(got, ref):
                    logger.info("ferrobatch: greedy head screen disagrees; not used")
                    return False
                fns: list = [
                    lambda: self.argmax(x), lambda: torch.mm(x, w.t()).numpy().argmax(-1)
                ]
                if _HAVE_MKLDNN:  # the runner's fastest fp32 head on CPU
                    full_packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
                    fns.append(lambda: torch.ops.mkldnn._linear_pointwise(
                        x, full_packed, None, "none", [], "").numpy().argmax(-1))
                best = [float("inf")] * len(fns)
                for rnd in range(rounds):
                    for i, fn in enumerate(fns):
                        start = time.process_time()
                        fn()
                        if rnd:
                            best[i] = min(best[i], time.process_time() - start)
        except Exception as exc:  # noqa: BLE001 - an op missing from this build
            logger.info("ferrobatch: no greedy head screen (%s)", exc)
            return False
        finally:
            self._int8_calls = self._int8_misses = 0  # judge int8 on the model's own rows
        return best[0] <= 0.8 * min(best[1:])
