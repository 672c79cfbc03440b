"""The output head: base model + head split checked once, the CPU product for the head chosen
once (the packed linears' where they hold it; else `linear_policy`'s "head" rules over a
timed probe: packed oneDNN weight, transposed copy, or the module's own forward), logit
scaling and softcapping, and the greedy screen of `ferrobatch.runner.greedy_head` (the
runner's `head` part)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ferrobatch.cpu import f32_ops, onednn
from ferrobatch.gguf import modules as quant_modules
from ferrobatch.model_config import text_config
from ferrobatch.models import layer_types_of
from ferrobatch.runner import linear_policy as policy
from ferrobatch.runner.greedy_head import GreedyHead
from ferrobatch.runner.linear_policy import Backend
from ferrobatch.runner.patches import eval_mode

logger = logging.getLogger("ferrobatch")


__all__ = ["OutputHead", "WeightDerived"]


class OutputHead:
    """The runner's logits: hidden states [N, hidden] -> logits [N, vocab] (`logits`), and
    greedy tokens without every fp32 logit where the greedy screen applies (`greedy`).

    Built once per runner (after its packed linears: the checks run outside them): whether
    base model + head reproduce the model's full forward (`split`; why not in
    `split_error`), which product the head runs on (`backend`: the packed linears' where
    they hold the head, else the policy's "head" rules over a timed probe), and the greedy
    head."""

    def __init__(self, model: PreTrainedModel, device: torch.device, vocab_size: int,
                 batch_invariant: bool = False, packed: bool = False) -> None:
        """`batch_invariant`: no head product of its own and no greedy screen (the module's
        own forward: inside a step the packed linears' batch-invariant product). `packed`:
        the packed linears hold the head, so inside a step its product is theirs, chosen by
        rows in `linear_policy`'s table like every other layer's; no copy of its own is
        probed or made. A timed probe would pick by the noise of the moment, and two
        engines on one model would then compute different logit bits; it could only win
        by chance: `f32_ops` is 1.1-2.0x the packed oneDNN copy on SmolLM2's 49152 x 576
        fp32 head at 1-32 rows and level at 64-128 (AMD Zen 4, 1 and 2 threads), and the
        table takes that oneDNN product itself beyond `f32_ops`' rows; a head on bf16
        panels (1.5B's 152k x 1536, 2 threads) takes 19 ms at one row against oneDNN's
        33."""
        cfg = text_config(model.config)
        self._model = model
        self._device = device
        self._vocab_size = vocab_size
        #: the base model (None: not separable) and the output head module
        self.base = getattr(model, "base_model", None)
        self.module = model.get_output_embeddings()
        self._final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self._logit_scale = getattr(model, "logit_scale", None) or getattr(
            cfg, "logit_scale", None
        )
        self._logits_scaling = getattr(cfg, "logits_scaling", None)
        self._transposed = WeightDerived(lambda w: w.t().contiguous())
        self._packed = WeightDerived(onednn.pack)
        #: the head's own product (`linear_policy`'s "head" rules): `onednn` on a packed
        #: copy, `transposed` on a transposed copy, None: the module's own forward (inside a
        #: step the packed linears' product where they hold the head)
        self.backend: Backend | None = None
        self.split_error: str | None = None
        self.split = self._check_split()
        if self.split and not batch_invariant and not packed:
            self.backend = self._choose_backend()
        #: the greedy screen (`greedy_head`), None where it does not apply or win; in
        #: batch-invariant mode only its proven screens, rescored on `f32_ops` (the head's
        #: product there), so a screened token is the full logits' argmax bit for bit
        self.greedy = self._make_greedy(batch_invariant)

    def _cpu_fp32_linear_head(self) -> bool:
        head = self.module
        return (
            self._device.type == "cpu"
            and type(head) is torch.nn.Linear
            and head.weight.dtype == torch.float32
        )

    def _choose_backend(self) -> Backend | None:
        """The policy's "head" rule for this head on CPU, timed once against `F.linear` on
        64 random rows (the packed copy first, checked against `F.linear` and kept only
        where it wins; then the transposed copy); None: the module's own forward."""
        if not self._cpu_fp32_linear_head():
            return None
        isa = policy.Isa.detect()
        shares: list[tuple[Backend, float]] = []
        for backend, share in ((Backend.ONEDNN, self._packed_share),
                               (Backend.TRANSPOSED, self._transposed_share)):
            value = share()
            if value is not None:
                shares.append((backend, value))
            rule = policy.choose_rule(self.module.weight.dtype, 64, isa,
                                      policy.Probe(shares=tuple(shares)), use="head")
            if rule.use == "head":
                break
        else:
            rule = None
        if rule is None or rule.backend is not Backend.ONEDNN:
            self._packed.clear()
        if rule is None or rule.backend is not Backend.TRANSPOSED:
            self._transposed.clear()
        return None if rule is None else rule.backend

    def _packed_share(self) -> float | None:
        """The time of oneDNN's product on the head weight reordered once into its blocked
        layout (`onednn.pack`, the op inductor uses for frozen linears) over `F.linear`'s
        (MKL's sgemm repacks the whole 32000-wide weight on every call: ~2x slower at decode
        batch sizes on the tiny-llama model); None where oneDNN is unavailable or its product
        differs from `F.linear`'s on random input."""
        if not onednn.available():
            return None
        head = self.module
        weight = head.weight.detach()
        bias = head.bias.detach() if head.bias is not None else None
        x = torch.randn(64, weight.shape[1])
        try:
            with torch.inference_mode():
                packed = self._packed.get(head.weight)
                got = onednn.linear(x, packed, bias)
                ref = F.linear(x, weight, bias)
        except Exception as exc:  # noqa: BLE001 - an op missing from this build: skip it
            logger.info("ferrobatch: no packed output head (%s)", exc)
            return None
        if got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
            return None
        t_packed, t_linear = _best_times(
            (lambda: onednn.linear(x, packed, bias), lambda: F.linear(x, weight, bias))
        )
        return _share(t_packed, t_linear)

    def _transposed_share(self) -> float | None:
        """The time of a product with a transposed contiguous copy of the head weight over
        `F.linear`'s (MKL is often faster on the former at decode batch sizes, depending on
        the shape)."""
        weight = self.module.weight.detach()
        wt = self._transposed.get(self.module.weight)
        x = torch.randn(64, weight.shape[1])
        best = _best_times((lambda: F.linear(x, weight), lambda: torch.mm(x, wt)))
        return _share(best[1], best[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of the final hidden states `hidden` [N, hidden] (scaled and
        softcapped as the model's own forward)."""
        head = self.module
        if self.backend is Backend.ONEDNN:
            logits = onednn.linear(hidden, self._packed.get(head.weight), head.bias)
        elif self.backend is Backend.TRANSPOSED:
            logits = torch.mm(hidden, self._transposed.get(head.weight))
            if head.bias is not None:
                logits += head.bias
        else:
            logits = head(hidden)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._logits_scaling is not None:
            logits = logits / self._logits_scaling
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    def _make_greedy(self, invariant: bool = False) -> GreedyHead | None:
        """The bounded screens of `ferrobatch.runner.greedy_head` for greedy rows, when the
        head is a plain CPU `nn.Linear` (no bias, scale or softcap) the screens support and
        they agree with the fp32 argmax and are clearly faster here; else None."""
        head = self.module
        if not (
            self.split
            and type(head) is torch.nn.Linear
            and head.bias is None
            and self._device.type == "cpu"
            and self._logit_scale is None
            and self._logits_scaling is None
            and not self._final_softcap
            and GreedyHead.supported(head.weight)
            and (not invariant or f32_ops.available())
        ):
            return None
        greedy = GreedyHead(head.weight, invariant=invariant)
        return greedy if greedy.wins() else None

    def _check_split(self) -> bool:
        """Whether base model + output head reproduces the full forward (checked once on a
        short input with the model's own attention). Like with like: the head runs over the
        same 6 rows as the full forward's (a matmul of another M may take another kernel),
        within a tolerance of a few units in the last place of the logits' dtype (bf16: one
        ulp at |logit| 0.5 is 0.002). Why it fails is kept in `split_error`."""
        self.split_error = None
        model = self._model
        if self.base is None or self.base is model or self.module is None:
            self.split_error = "the model has no separable base model / output head"
            return False
        ids = torch.arange(3, 9, device=self._device).unsqueeze(0) % self._vocab_size
        try:
            # (a GGUF model's products: the reference path's over a few layers' weights, as
            # the engine's probes run them; the kernels would pack every weight for it)
            with torch.inference_mode(), eval_mode(model), \
                    quant_modules.few_layers(model, lambda: layer_types_of(model)):
                full = model(input_ids=ids, use_cache=False).logits[0]
                hidden = self.base(input_ids=ids, use_cache=False)[0][0]
                split = self.logits(hidden)
        except Exception as exc:  # noqa: BLE001 - fall back to the full forward
            self.split_error = f"{type(exc).__name__}: {exc}"[:300]
            logger.info("ferrobatch: full forward for logits (%s)", exc)
            return False
        if full.shape != split.shape:
            self.split_error = f"shapes {tuple(full.shape)} != {tuple(split.shape)}"
        else:
            ulp = max(torch.finfo(t.dtype).eps for t in (full, split, hidden)
                      if t.is_floating_point())
            tol = max(1e-3, 4 * ulp)
            diff = (full.float() - split.float()).abs()
            bound = tol + tol * full.float().abs()
            if not bool((diff <= bound).all()):
                self.split_error = (f"max |logit diff| {diff.max().item():.3g} over "
                                    f"tolerance {tol:.3g} (rtol = atol)")
        if self.split_error is not None:
            logger.info("ferrobatch: output head not separable (%s); using logits_to_keep",
                        self.split_error)
            return False
        return True

    def close(self) -> None:
        """Drop the derived copies and the greedy head."""
        self._transposed.clear()
        self._packed.clear()
        self.greedy = None


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


def _share(t: float, ref: float) -> float:
    """`t` as a share of `ref` (infinite when `ref` measured nothing)."""
    return t / ref if ref > 0 else float("inf")


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
