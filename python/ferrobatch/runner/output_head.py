"""The output head: base model + head split checked once, the fastest CPU product for the
head timed once (packed oneDNN weight, transposed copy or `F.linear`), logit scaling and
softcapping, and the greedy screen of `ferrobatch.runner.greedy_head` (the runner's
`OutputHead` part)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ferrobatch.runner.greedy_head import GreedyHead
from ferrobatch.runner.patches import eval_mode

logger = logging.getLogger("ferrobatch")


class OutputHead:
    """`ModelRunner`'s logits: hidden states [N, hidden] -> logits [N, vocab]."""

    def _cpu_fp32_linear_head(self) -> bool:
        head = self._head
        return (
            self.device.type == "cpu"
            and type(head) is torch.nn.Linear
            and head.weight.dtype == torch.float32
        )

    def _packed_head_wins(self) -> bool:
        """On CPU, whether oneDNN's matmul with the head weight reordered once into its
        blocked layout (`mkldnn._reorder_linear_weight`, the op inductor uses for frozen
        linears) is clearly faster than `F.linear` (MKL sgemm repacks the whole 32000-wide
        weight on every call: ~2x slower at decode batch sizes on the tiny-llama model).
        Checked against `F.linear` on random input first; False when unavailable."""
        if not self._cpu_fp32_linear_head() or not _HAVE_MKLDNN_LINEAR:
            return False
        head = self._head
        weight = head.weight.detach()
        bias = head.bias.detach() if head.bias is not None else None
        x = torch.randn(64, weight.shape[1])
        try:
            with torch.inference_mode():
                packed = self._head_packed.get(head.weight)
                got = _mkldnn_linear(x, packed, bias)
                ref = F.linear(x, weight, bias)
        except Exception as exc:  # noqa: BLE001 - an op missing from this build: skip it
            logger.info("ferrobatch: no packed output head (%s)", exc)
            self._head_packed.clear()
            return False
        if got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
            self._head_packed.clear()
            return False
        t_packed, t_linear = _best_times(
            (lambda: _mkldnn_linear(x, packed, bias), lambda: F.linear(x, weight, bias))
        )
        if t_packed < 0.9 * t_linear:
            return True
        self._head_packed.clear()
        return False

    def _transposed_head_wins(self) -> bool:
        """On CPU, time the output head as `F.linear` against a product with a transposed
        contiguous copy of its weight (MKL is often faster on the latter at decode batch
        sizes, depending on the shape); True when the copy is clearly faster."""
        if not self._cpu_fp32_linear_head():
            return False
        weight = self._head.weight.detach()
        wt = self._head_wt.get(self._head.weight)
        x = torch.randn(64, weight.shape[1])
        best = _best_times((lambda: F.linear(x, weight), lambda: torch.mm(x, wt)))
        if best[1] < 0.93 * best[0]:
            return True
        self._head_wt.clear()
        return False

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._use_head_packed:
            packed = self._head_packed.get(self._head.weight)
            logits = _mkldnn_linear(hidden, packed, self._head.bias)
        elif self._use_head_wt:
            logits = torch.mm(hidden, self._head_wt.get(self._head.weight))
            if self._head.bias is not None:
                logits += self._head.bias
        else:
            logits = self._head(hidden)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._logits_scaling is not None:
            logits = logits / self._logits_scaling
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    def _make_greedy_head(self) -> GreedyHead | None:
        """The bounded int8 screen of `ferrobatch.runner.greedy_head` for greedy rows, when the
        head is a plain fp32 CPU `nn.Linear` (no bias, scale or softcap) and the screen agrees
        with the fp32 argmax and is clearly faster here; else None."""
        head = self._head
        if not (
            self._split_head
            and type(head) is torch.nn.Linear
            and head.bias is None
            and self.device.type == "cpu"
            and self._logit_scale is None
            and self._logits_scaling is None
            and not self._final_softcap
            and GreedyHead.supported(head.weight)
        ):
            return None
        greedy = GreedyHead(head.weight)
        return greedy if greedy.wins() else None

    def _check_split_head(self) -> bool:
        """Whether base model + output head reproduces the full forward (checked once on a
        short input with the model's own attention). Like with like: the head runs over the
        same 6 rows as the full forward's (a matmul of another M may take another kernel),
        within a tolerance of a few units in the last place of the logits' dtype (bf16: one
        ulp at |logit| 0.5 is 0.002). Why it fails is kept in `split_head_error`."""
        self.split_head_error: str | None = None
        if self._base is None or self._base is self.model or self._head is None:
            self.split_head_error = "the model has no separable base model / output head"
            return False
        ids = torch.arange(3, 9, device=self.device).unsqueeze(0) % self.vocab_size
        try:
            with torch.inference_mode(), eval_mode(self.model):
                full = self.model(input_ids=ids, use_cache=False).logits[0]
                hidden = self._base(input_ids=ids, use_cache=False)[0][0]
                split = self._head_logits(hidden)
        except Exception as exc:  # noqa: BLE001 - fall back to the full forward
            self.split_head_error = f"{type(exc).__name__}: {exc}"[:300]
            logger.info("ferrobatch: full forward for logits (%s)", exc)
            return False
        if full.shape != split.shape:
            self.split_head_error = f"shapes {tuple(full.shape)} != {tuple(split.shape)}"
        else:
            ulp = max(torch.finfo(t.dtype).eps for t in (full, split, hidden)
                      if t.is_floating_point())
            tol = max(1e-3, 4 * ulp)
            diff = (full.float() - split.float()).abs()
            bound = tol + tol * full.float().abs()
            if not bool((diff <= bound).all()):
                self.split_head_error = (f"max |logit diff| {diff.max().item():.3g} over "
                                         f"tolerance {tol:.3g} (rtol = atol)")
        if self.split_head_error is not None:
            logger.info("ferrobatch: output head not separable (%s); using logits_to_keep",
                        self.split_head_error)
            return False
        return True


_HAVE_MKLDNN_LINEAR = bool(
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


class WeightDerived:
    """A tensor derived from a weight (a transposed copy, a reordered layout), recomputed
    only when the weight object or its in-place version counter changes."""

    def __init__(self, derive: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._derive = derive
        self._key: tuple[int, int] | None = None
        self._value: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (id(weight), weight._version)
        if self._value is None or self._key != key:
            with torch.no_grad():
                self._value = self._derive(weight.detach())
            self._key = key
        return self._value

    def clear(self) -> None:
        self._key = self._value = None


def _mkldnn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _best_times(fns: Any, rounds: int = 5) -> list[float]:
    """Best CPU time of each function over `rounds` (the first a warm-up; the machine may be
    busy, so process time and the best of the rest)."""
    best = [float("inf")] * len(fns)
    with torch.inference_mode():
        for rnd in range(rounds):
            for i, fn in enumerate(fns):
                start = time.process_time()
                fn()
                if rnd:
                    best[i] = min(best[i], time.process_time() - start)
    return best
