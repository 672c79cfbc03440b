"""Greedy tokens from an fp32 linear output head without computing every fp32 logit.

For greedy rows only the argmax of `hidden @ W.T` is needed. `GreedyHead` screens the
vocabulary with a bf16 product (oneDNN, weight reordered once; about half the time of the
fp32 product on CPUs with native bf16 dot products), keeps every token whose screened score
is within a proven error bound of the row's best, and rescores only those candidates in
fp32. The result is the argmax of the fp32 logits:

For row `h` and token `j` the screened score `a_j` is the bf16 product `bf(h) . bf(w_j)`
accumulated in fp32 and rounded to bf16. With unit roundoffs `u = 2^-8` (bf16) and
`2^-24` (fp32) and `S_j = sum_i |h_i w_ji| <= ||h|| ||w_j||`:

    |a_j - h . w_j| <= (2u + u^2 + K 2^-24) S_j + u (1 + ...) |h . w_j|
                    <= C ||h|| max_j ||w_j||          with C = 0.0125 (K <= 4096)

so, with `eps` that bound, the fp32 argmax `j*` satisfies `a_j* >= max_j a_j - 2 eps`
(every token outside that set has a smaller fp32 logit than the screened best). The
candidates' fp32 logits are recomputed exactly (fp32 dot products; ties go to the lowest
token id, as `argmax`). When a row has too many candidates, or anything is not finite,
`argmax` returns None and the caller computes the full fp32 logits.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

logger = logging.getLogger("ferrobatch")

__all__ = ["GreedyHead"]

_BOUND_C = 0.0125
_MAX_CANDIDATES = 64  # per row on average; beyond it the screen is not worth it

_HAVE = bool(
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


def _mkldnn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class GreedyHead:
    """Argmax rows of `hidden @ weight.T` (fp32 CPU, no bias) via a bounded bf16 screen.

    The bf16 copy of the weight (reordered for oneDNN) and the largest row norm are derived
    once and recomputed when the weight object or its version changes.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self._weight = weight
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None
        self._wmax = 0.0

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        """An fp32 2-D CPU weight with at most 4096 input features, and oneDNN present."""
        return (
            _HAVE
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
                self._wmax = float(wd.norm(dim=1).max())
            self._key = key

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Token ids [N] (int64, CPU) = argmax of the fp32 logits of `hidden` [N, K]; None
        when the screen cannot decide cheaply (the caller then computes full logits)."""
        self._prepare()
        assert self._packed is not None
        n = hidden.shape[0]
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        hidden = hidden.contiguous()
        approx = _mkldnn_linear(hidden.bfloat16(), self._packed).float().numpy()  # [N, V]
        vocab = approx.shape[1]
        best = approx.max(axis=1)
        eps = _BOUND_C * hidden.norm(dim=1).numpy().astype(np.float64) * self._wmax
        if not (np.isfinite(best).all() and np.isfinite(eps).all()):
            return None
        thr = best.astype(np.float64) - 2.0 * eps
        # (numpy: torch's broadcast compare and 2-D nonzero are several times slower here)
        thr32 = np.nextafter(thr.astype(np.float32), np.float32(-np.inf))  # rounded down
        flat = np.flatnonzero(approx >= thr32[:, None])
        if len(flat) > _MAX_CANDIDATES * n:
            return None
        r, c = flat // vocab, flat % vocab
        w = self._weight.detach()
        rows_t, cols_t = torch.from_numpy(r), torch.from_numpy(c)
        e = (hidden.index_select(0, rows_t) * w.index_select(0, cols_t)).sum(dim=1).numpy()
        if not np.isfinite(e).all():
            return None
        order = np.lexsort((c, -e, r))  # per row: highest logit first, then lowest id
        r_sorted = r[order]
        first = np.flatnonzero(np.r_[True, r_sorted[1:] != r_sorted[:-1]])
        if len(first) != n:  # every row keeps its own best; anything else is a bug
            return None
        return torch.from_numpy(c[order[first]].astype(np.int64))

    def wins(self, rows: int = 64, rounds: int = 5) -> bool:
        """Whether the screen agrees with the fp32 argmax on random rows and takes at most
        80% of the CPU time of `full` (the fp32 head + argmax) here; False on any failure."""
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
                full_packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
                best = [float("inf"), float("inf")]
                fns = (
                    lambda: self.argmax(x),
                    lambda: _mkldnn_linear(x, full_packed).numpy().argmax(axis=-1),
                )
                for rnd in range(rounds):
                    for i, fn in enumerate(fns):
                        start = time.process_time()
                        fn()
                        if rnd:
                            best[i] = min(best[i], time.process_time() - start)
        except Exception as exc:  # noqa: BLE001 - an op missing from this build
            logger.info("ferrobatch: no greedy head screen (%s)", exc)
            return False
        return best[0] <= 0.8 * best[1]
