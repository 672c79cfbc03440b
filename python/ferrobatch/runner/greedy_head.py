"""Greedy tokens from a linear output head without computing every fp32 logit.

The head's weight is fp32, or bf16 / fp16 (then "fp32 logits" are the fp32 products of the
rows with the exactly widened weight, and bf16 / fp16 rows are widened exactly too).

For greedy rows only the argmax of `hidden @ W.T` is needed. `GreedyHead` screens the
vocabulary with a cheap low-precision product, keeps every token whose screened score is
within a proven error bound of the row's best, and rescores only those candidates in fp32
(one fp32 product of the rows with the union of the candidates' weight rows; ties go to the
lowest token id, as `argmax`). The result is the argmax of the fp32 logits. Three proven
screens, tried in this order (each only while it is on):

* int8 (`torch._int_mm`, exact int32 accumulation; about a third of the fp32 product's time
  on CPUs with VNNI). The weight is quantized once with one scale `s = max |W| / 127`
  (`w_ji = s p_ji + f_ji`, `|f_ji| <= s/2`), each hidden row with its own
  `t = max |h| / 127` (`h_i = t q_i + e_i`, `|e_i| <= t/2`); the screened score
  `a_j = t s sum_i q_i p_ji` satisfies
  `|a_j - h . w_j| <= (s/2) ||h||_1 + (t/2) max_j ||w_j||_1 + (3/4) K t s`.
  Weights with outlier rows or features make that window wide: when the int8 screen
  leaves too many candidates on more than a quarter of its first calls, it is dropped.
* int16 (`_core.i16_linear`: exact int32 sums of int16 products on AVX-512 VNNI, half the
  fp32 product's time and bytes). The weight is quantized once with one scale
  `s = max |W| / Q_w` (`w_j = s p_j + f_j`), each row with `t = max |h| / Q_h`
  (`h = t q + e`), `Q_h = Q_w = floor(sqrt((2^31 - 1) / K))` (every partial sum fits an
  int32). Since `h . w_j - t s q . p_j = t q . f_j + e . w_j`, Cauchy-Schwarz gives
  `|a_j - h . w_j| <= ||t q|| ||f_j|| + ||e|| ||w_j|| <= (||e|| + rho ||t q||) u_j` with
  `u_j = max(||w_j||, ||f_j|| / rho)` (`rho`: the median of `||f_j|| / ||w_j||`), all norms
  of known vectors. About 11 bits a side instead of int8's 7 make the window ~15x narrower:
  where outlier features keep the int8 screen from deciding (SmolLM2-135M's hidden rows,
  384 of its chat rows: 1.5-2.5 candidates a row, at most 29), this one still does.
* bf16 (oneDNN, weight reordered once; about half the fp32 time with native bf16 dot
  products): `a_j` is `bf(h) . bf(w_j)` accumulated in fp32 and rounded to bf16, so with
  `u = 2^-8`, `|a_j - h . w_j| <= (2u + u^2 + K 2^-24 + u (1 + ...)) ||h|| ||w_j||
  <= 0.013 ||h|| max_j ||w_j||` (K <= 4096).
  Where `ferrobatch.cpu.amx_ops` runs (AMX tiles or AVX-512 BF16) and the policy gives it
  the call's rows (`linear_policy`, as for any product with fp32 outputs), the same sums
  come from it without the final rounding to bf16 (and 1.6x faster at one row): with
  `u = 2^-9` (bf16 rounding to nearest),
  `|a_j - h . w_j| <= (2u (1 + u) + K 2^-24 (1 + u)^2) ||h|| ||w_j|| <= 0.0045 ||h||
  ||w_j||`, plus `K 2^-126 max_j ||w_j||` for inputs the products flush to zero.

With `eps` the screen's bound and `delta = K 2^-24 ||h||_2 max_j ||w_j||_2` the rounding of
the fp32 logits themselves, every token with `a_j < max_j a_j - 2 (eps + delta)` has a
smaller fp32 logit than the screened best, so the fp32 argmax is among the others. When a
screen leaves too many candidates, or anything is not finite, the next one is tried, and
`argmax` returns None when none decides (the caller then computes the full fp32 logits).

A half-precision head (bf16 / fp16 weight: a model whose promise is "as close to fp32 as the
best peer", not exact parity) may also take a third, statistical screen, `window8`, when
`wins` finds it the fastest: int8 products with one scale per weight row
(`w_j = s_j p_j + f_j`) and per hidden row (`h = t q + e`), scores `t s_j q . p_j`, and a
window of `Z = 6` standard deviations of the rounding error under the model that the
rounding errors are independent of the values they meet:
`sigma_ij = (||e_i||_2 ||w_j||_2 + ||t q_i||_2 ||f_j||_2) / sqrt(K)`. That is not a proof:
it keeps the fp32 argmax unless the error of a score is more than `Z` of its sigmas (on
SmolLM2-135M's head and 954 hidden rows of chat prompts the largest error was 4.1 sigmas
over 47M (row, token) pairs, 7.7 candidates per row were kept). fp32 heads never take it.

Where fp32 products of a half-precision weight's widened copy are faster than half-precision
ones (`ferrobatch.runner.linear_policy`'s probe: Intel cores with AVX-512 BF16 but no AMX),
calls of `full_rows` rows or more (the policy's "greedy" rule,
`linear_policy.GREEDY_FULL_ROWS`) skip the screens: the full fp32 logits on a packed fp32
copy of the weight, and their argmax, cost less than the bf16 screen there.

The per-call host work is in Rust (`ferrobatch._core`): the rows' norms (`row_norms`), the
selection over the screen's scores as they come, bf16 bits or int32 (`greedy_select`), and
each row's best candidate (`greedy_pick`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import psutil
import torch

from ferrobatch import _core
from ferrobatch.cpu import amx_ops, f32_ops, onednn
from ferrobatch.runner import linear_policy as policy
from ferrobatch.runner.linear_policy import Backend
from ferrobatch.runner.panel_weights import HeldWeight
from ferrobatch.sampling.sampler import argmax_rows

logger = logging.getLogger("ferrobatch")

__all__ = ["GreedyHead"]

_BF16_BOUND = 0.013
_WIDE_BOUND = 0.0045  # the bf16 screen's sums not rounded to bf16 (module docstring)
_MAX_CANDIDATES = 64  # per row on average; beyond it the screen is not worth it
_MAX_STAGE1 = 1024  # per row on average after the first (coarse) selection
_INT8_TRIAL_CALLS = 16  # the int8 screen is judged after this many calls ...
_INT8_MAX_MISS_SHARE = 0.25  # ... and dropped when it failed to decide more often than this
_EXTRA_BYTES_PER_WEIGHT = 2 + 2 + 1 + 2 + 4 + 4  # see `GreedyHead.supported`
#: the statistical window of `window8`, in standard deviations of its scores' rounding error
_WINDOW_SIGMAS = 6.0
_MAX_AVAILABLE_SHARE = 0.1

_HAVE_INT_MM = hasattr(torch, "_int_mm")
_HAVE_I16 = bool(getattr(_core, "i16_linear_available", lambda: False)())


_Candidates = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""`_core.greedy_select`'s (rows, cols, unique, inverse), int64."""


def _select(scores: np.ndarray, base: np.ndarray, gain: np.ndarray, per_token: np.ndarray
            ) -> _Candidates | None:
    """The (row, token) pairs that may hold each row's fp32 argmax, or None when too many.

    Screened score `a_j` (`scores` [N, V]: bf16 bit patterns as uint16, float32, or exact
    int32) is within `eps_j = base + gain * per_token[j]` of the token's fp32 logit
    (row-wise `base`, `gain`, in the scores' units). The argmax `j*` has
    `a_j* + eps_j* >= max_k (a_k - eps_k)`. Stage 1 keeps `a_j >= LB1 - base - gain *
    max(per_token)` with `LB1 = a_m - eps_m` at the screened best `m` (the threshold
    rounded down into the scores' type); stage 2 keeps, of those, `a_j + eps_j >= LB2`,
    `LB2` the best `a_k - eps_k` among them (both lower bounds of the true maximum, so `j*`
    survives). None also when a threshold is not finite. The rule in full:
    `ferrobatch-kernels`' `select` module."""
    return _core.greedy_select(scores, base, gain, per_token, max_stage1=_MAX_STAGE1,
                               max_candidates=_MAX_CANDIDATES, threads=torch.get_num_threads())


class GreedyHead:
    """Argmax rows of `hidden @ weight.T` (fp32 CPU, no bias) via bounded low-precision
    screens. What they need (int8 and bf16 copies of the weight, its norms) is derived once
    and recomputed when the weight object or its version changes."""

    def __init__(self, weight: torch.Tensor, invariant: bool = False) -> None:
        """`invariant` (batch-invariant mode): the candidates are rescored on the product
        the packed head runs there (`linear_policy.choose_invariant`: `f32_ops`, or
        `amx_ops` on bf16 weights with AMX tiles, whose inputs are then rounded to bf16
        before the screens too), so the token is the argmax of exactly the logits a
        full-logits step computes (the screens' windows cover any fp32 summation order),
        and the statistical `window8` screen and the full-rows path are off."""
        self._weight = weight
        self.invariant = invariant
        #: the rows are rounded to bf16 and the candidates rescored on `amx_ops`
        self.bf16_rows = invariant and policy.choose_invariant(
            weight.dtype, policy.Isa.detect()) is Backend.AMX_OPS
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None  # bf16, oneDNN layout
        self._wide: amx_ops.AmxWeight | None = None  # bf16 packed for `amx_ops`
        #: the bf16 screen's calls go to `amx_ops` (fp32 sums, a tighter bound) where it runs
        #: and the policy gives it their rows (`linear_policy`: fp32 outputs)
        self.wide = amx_ops.available()
        self._isa = policy.Isa.detect()
        self._qweight: torch.Tensor | None = None  # [V, K] int8
        self._scale = 1.0  # s
        self._w1 = np.zeros(0)  # ||w_j||_1
        self._w2 = np.zeros(0)  # ||w_j||_2
        self._w1max = 0.0
        self._w2max = 0.0
        self.int8 = _HAVE_INT_MM  # the int8 screen is on (dropped when it rarely decides)
        #: from this many rows, the exact argmax of the fp32 product of the widened weight
        #: (packed once in `_full`) instead of a screen (the policy's "greedy" rule, where
        #: its probe finds fp32 products faster); None: never
        self.full_rows = None if invariant else policy.rows_from(
            "greedy", weight.dtype, self._isa, policy.probe(weight.dtype))
        self._full: torch.Tensor | None = None
        #: the statistical int8 screen of half heads (module docstring), chosen by `wins`
        self.window8 = False
        self._rows8: _RowScaled | None = None
        self._window8_trial = _Trial()
        self._best_other = float("inf")
        #: the chosen screen's time over the full fp32 head's, as `wins` measured it
        self._screen_share = float("inf")
        self._int8_trial = _Trial()
        #: the int16 screen is on (dropped, like int8, when it rarely decides)
        self.int16 = _HAVE_I16
        self._w16: _Int16Weight | None = None  # made when first used
        self._int16_trial = _Trial()

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        """An fp32 2-D CPU weight with at most 4096 input features, oneDNN present and
        running bf16 products here (the screens pack bf16 copies: oneDNN refuses them
        without AVX-512 or AVX-NE-CONVERT, as on AMD Zen 3), and the memory the screen
        takes (`_EXTRA_BYTES_PER_WEIGHT` per weight element: the two bf16 copies and the
        int8 and packed int16 ones it keeps, fp32 temporaries while deriving them and the
        construction check's packed fp32 copy) within `_MAX_AVAILABLE_SHARE` of available
        memory."""
        if not (
            onednn.packing_available(torch.bfloat16)
            and not isinstance(weight, HeldWeight)  # (its rescoring would rebuild it)
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[1] <= 4096
        ):
            return False
        need = weight.numel() * (_EXTRA_BYTES_PER_WEIGHT + 4)  # (+ `_full`, where used)
        available = psutil.virtual_memory().available
        if need > _MAX_AVAILABLE_SHARE * available:
            logger.info("ferrobatch: no greedy head screen (it needs %.0f MiB, more than %.0f%% "
                        "of the %.0f MiB available)", need / 2**20, 100 * _MAX_AVAILABLE_SHARE,
                        available / 2**20)
            return False
        return True

    def _prepare(self) -> None:
        w = self._weight
        key = (id(w), w._version)
        if self._packed is None or self._key != key:
            with torch.no_grad():
                wd = w.detach().float()  # exact for a half-precision weight
                self._packed = onednn.pack(w.detach().bfloat16())
                self._wide = amx_ops.pack(w.detach().bfloat16()) if self.wide else None
                self._full = None  # packed again when next used
                # fp32 norms rounded up (relative error <= K 2^-24 <= 2^-12)
                self._w2 = wd.norm(dim=1).double().numpy() * (1 + 2.0**-10)
                self._w1 = wd.abs().sum(dim=1).double().numpy() * (1 + 2.0**-10)
                self._w2max = float(self._w2.max())
                self._w1max = float(self._w1.max())
                amax = float(wd.abs().max())
                self._scale = amax / 127.0 if amax > 0 else 1.0
                # fp32 division: |w - s p| <= s/2 + 127 s 2^-24 (covered in _screen_int8)
                self._qweight = (
                    torch.round(wd / self._scale).clamp_(-127, 127).to(torch.int8).contiguous()
                    if self.int8 else None
                )
                self._rows8 = None  # made again when next used
                self._w16 = None
            self._key = key

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is the head weight this screen reads (and so keeps alive)."""
        return self._weight is weight

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Token ids [N] (int64, CPU) = argmax of the fp32 logits of `hidden` [N, K] (with
        `window8`, up to its statistical window: module docstring); None when no screen can
        decide cheaply (the caller then computes full logits)."""
        self._prepare()
        n, k = hidden.shape
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if hidden.device.type != "cpu" or hidden.dtype not in (
                torch.float32, torch.bfloat16, torch.float16):
            return None
        hidden = hidden.detach().contiguous()
        if self.bf16_rows:  # (`amx_ops` rounds its rows so: the logits are those of these)
            hidden = hidden.bfloat16()
        wide = hidden.float()  # exact widening (itself when fp32)
        if self.window8:
            tokens = self._window8(wide)
            if tokens is not None:
                self._window8_trial.record(decided=True)
                return tokens
            if not self._window8_trial.record(decided=False):
                logger.info("ferrobatch: int8 window screen rarely decides here; not used")
                self.window8 = False
                self._rows8 = None
        if self.full_rows is not None and n >= self.full_rows:
            if self._full is None:
                with torch.no_grad():
                    self._full = onednn.pack(self._weight.detach().float())
            # (what the caller's full logits would give: the first maximum, NaN wins)
            return argmax_rows(onednn.linear(wide, self._full))
        l2, l1, hmax = _core.row_norms(wide.numpy())  # f64 sums
        if not (np.isfinite(l1).all() and (hmax > 0).all()):
            return None  # non-finite, or an all-zero row (every logit ties)
        # the fp32 logits' own rounding, in the screens' windows
        # (plus a tiny absolute term for flushed denormals in the low-precision products)
        delta = k * (2.0**-24 * l2 * self._w2max + 2.0**-120)
        cand = None
        if self.int8:
            cand = self._screen_int8(wide, l1, hmax, delta)
            if not self._int8_trial.record(decided=cand is not None):
                logger.info("ferrobatch: int8 head screen rarely decides here; not used")
                self.int8 = False
                self._qweight = None
        if cand is None and self.int16:
            cand = self._screen_int16(wide, hmax, delta)
            if not self._int16_trial.record(decided=cand is not None):
                logger.info("ferrobatch: int16 head screen rarely decides here; not used")
                self.int16 = False
                self._w16 = None
        if cand is None:
            cand = self._screen_bf16(hidden, l2, delta)
        if cand is None:
            return None
        return self._rescore(wide, cand)

    def _window8(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The statistical int8 screen (module docstring) over fp32 rows, then the fp32
        rescoring; None when a row is not finite or all zero, or too many candidates stay."""
        if self._rows8 is None:
            self._rows8 = _RowScaled(self._weight)
        w8 = self._rows8
        k = hidden.shape[1]
        l2, _, hmax = _core.row_norms(hidden.numpy())
        if not (np.isfinite(l2).all() and (hmax > 0).all()):
            return None
        q, t, e_norm, near_norm = _quantized_rows(hidden, hmax, 127.0)
        acc = torch._int_mm(q.to(torch.int8), w8.qweight.t())  # [N, V] int32, exact
        scores = acc.float().mul_(w8.scale)  # in units of each row's t
        tn = t.squeeze(1).numpy()
        # eps_ij / t_i = Z (||e_i|| ||w_j|| + ||t q_i|| ||f_j||) / (sqrt(K) t_i)
        #             <= Z (||e_i|| + rho ||t q_i||) u_j / (sqrt(K) t_i), u_j (see _RowScaled)
        gain = _WINDOW_SIGMAS * (e_norm + w8.rho * near_norm) / (np.sqrt(k) * tn)
        delta = k * (2.0**-24 * l2 * w8.w2max + 2.0**-120) / tn  # the fp32 logits' rounding
        cand = _select(scores.numpy(), delta, gain, w8.per_token)
        return None if cand is None else self._rescore(hidden, cand)

    def _screen_int8(self, hidden: torch.Tensor, l1: np.ndarray, hmax: np.ndarray,
                     delta: np.ndarray) -> _Candidates | None:
        assert self._qweight is not None
        k = hidden.shape[1]
        t = hmax / 127.0
        q = torch.round(hidden.double() / torch.from_numpy(t).unsqueeze(1)).to(torch.int8)
        acc = torch._int_mm(q, self._qweight.t()).numpy()  # [N, V] int32, exact
        s = self._scale
        unit = t * s  # one integer step of acc
        # eps_j = (s/2)||h||_1 + (3/4) K t s + delta + (t/2)||w_j||_1, in units of t*s
        # (+ K/256 + 1 units: the fp32 quantization of the weight, and rounding)
        base = (0.5 * s * l1 + 0.75 * k * unit + delta) / unit
        base += k / 256.0 + 1.0
        gain = np.full(len(unit), 0.5 / s)
        return _select(acc, base, gain, self._w1)

    def _screen_int16(self, hidden: torch.Tensor, hmax: np.ndarray, delta: np.ndarray
                      ) -> _Candidates | None:
        if self._w16 is None:
            self._w16 = _Int16Weight(self._weight)
        w16 = self._w16
        n, k = hidden.shape
        q, t, e_norm, near_norm = _quantized_rows(hidden, hmax, w16.qmax)
        rows = torch.zeros(n, w16.k, dtype=torch.int16)  # (k padded to even: a zero column)
        rows[:, :k] = q.to(torch.int16)
        acc = torch.empty(n, w16.n, dtype=torch.int32)
        threads = torch.get_num_threads()
        _core.i16_linear(rows.numpy(), w16.packed.numpy(), acc.numpy(), n=w16.n, k=w16.k,
                         threads=threads)
        unit = t.squeeze(1).numpy() * w16.scale  # one integer step of acc, per row
        # eps_ij = (||e_i|| + rho ||t q_i||) u_j + delta_i (module docstring), in units of
        # t_i s; the f64 norms and products: a relative 2^-40 at most, covered by 2^-30
        gain = (e_norm + w16.rho * near_norm) * (1 + 2.0**-30) / unit
        base = delta / unit + 1.0
        return _select(acc.numpy(), base, gain, w16.per_token)

    def _screen_bf16(self, hidden: torch.Tensor, l2: np.ndarray, delta: np.ndarray
                     ) -> _Candidates | None:
        assert self._packed is not None
        if self.wide and self._wide is not None and policy.choose(
                torch.bfloat16, hidden.shape[0], self._isa, policy.Probe(),
                fp32_outputs=True) is Backend.AMX_OPS:
            sums = amx_ops.linear(hidden, self._wide).numpy()  # [N, V] fp32
            # eps_j = 0.0045 ||h||_2 ||w_j||_2 + delta + K 2^-126 max ||w_j||_2
            base = delta + hidden.shape[1] * 2.0**-126 * self._w2max
            return _select(sums, base, _WIDE_BOUND * l2, self._w2)
        # bf(h) of the rows as given (rounding a half row to bf16 is that of its widening)
        approx = onednn.linear(hidden.bfloat16(), self._packed).contiguous()  # [N, V] bf16
        bits = approx.view(torch.int16).numpy().view(np.uint16)
        # eps_j = 0.013 ||h||_2 ||w_j||_2 + delta
        return _select(bits, delta, _BF16_BOUND * l2, self._w2)

    def _rescore(self, hidden: torch.Tensor, cand: _Candidates) -> torch.Tensor | None:
        """The fp32 argmax among each row's candidates (ties: lowest token id)."""
        rows, cols, unique, inverse = cand
        weight = self._weight.detach().index_select(0, torch.from_numpy(unique))
        if self.bf16_rows:  # each column's sums as the full head's on `amx_ops`, bit for bit
            logits = amx_ops.linear(hidden, amx_ops.pack(weight.bfloat16())).numpy()
        elif self.invariant:  # ... on `f32_ops` (a half weight in its half panels)
            logits = f32_ops.linear(hidden, f32_ops.pack(weight)).numpy()
        else:
            logits = torch.mm(hidden, weight.float().t()).numpy()  # [N, len(unique)]
        tokens = _core.greedy_pick(logits, rows, cols, inverse)
        return None if tokens is None else torch.from_numpy(tokens)

    def wins(self, rows: int = 64, rounds: int = 5) -> bool:
        """Whether a screen (int8, int16 or bf16 first) agrees with the fp32 argmax on random
        rows and takes at most 80% of the CPU time of the fastest fp32 head + argmax here;
        keeps the fastest configuration (an int8 first keeps int16 behind it). False on any
        failure. Timed on one thread: with more, the CPU time counts what OpenMP workers
        spend spinning between the screen's parallel and serial parts, not work. A half
        head's full fp32 path (`full_rows`) is kept only where the chosen screen is slower
        than it at `rows`."""
        if not self.supported(self._weight):
            return False
        threads, full_rows = torch.get_num_threads(), self.full_rows
        torch.set_num_threads(1)
        self.full_rows = None  # (the screens are what is judged)
        self._screen_share = float("inf")
        self.window8 = False
        try:
            won = self._wins(rows, rounds)
            if won and self._weight.dtype != torch.float32 and _HAVE_INT_MM \
                    and not self.invariant:
                self.window8 = self._window8_wins(rows, rounds)
                if self.window8:  # its int8 copy replaces the proven int8 screen's
                    self.int8 = False
                    self._qweight = None
            if not self.window8:
                self._rows8 = None  # (built while it was judged)
            return won
        finally:
            torch.set_num_threads(threads)
            self.full_rows = full_rows if self._screen_share >= 1.0 else None

    def _window8_wins(self, rows: int, rounds: int) -> bool:
        """Whether the statistical int8 screen of a half head gives the fp32 argmax of
        random rows in at most 90% of the time of the best other head (`_wins`' figures)."""
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(rows, self._weight.shape[1], generator=gen)
        try:
            with torch.inference_mode():
                ref = torch.mm(x, self._weight.detach().float().t()).argmax(dim=1)
                got = self._window8(x)
                if got is None or not torch.equal(got, ref):
                    return False
                took = _best_time(lambda: self._window8(x), rounds)
        except Exception as exc:  # noqa: BLE001 - an op missing from this build
            logger.info("ferrobatch: no int8 window screen (%s)", exc)
            return False
        return took <= 0.9 * self._best_other

    def _wins(self, rows: int, rounds: int) -> bool:
        gen = torch.Generator().manual_seed(0)
        k = self._weight.shape[1]
        x = torch.randn(rows, k, generator=gen)
        w = self._weight.detach().float()
        timed: dict[tuple[bool, bool], float] = {}  # (int8, int16) on -> time
        try:
            with torch.inference_mode():
                # (rows rounded to bf16 where `argmax` rounds them)
                ref = torch.mm(x.bfloat16().float() if self.bf16_rows else x,
                               w.t()).argmax(dim=1)
                fulls: list = [lambda: torch.mm(x, w.t()).numpy().argmax(-1)]
                if onednn.available():  # the runner's fastest fp32 head on CPU
                    full_packed = onednn.pack(w, rows)
                    fulls.append(lambda: onednn.linear(x, full_packed).numpy().argmax(-1))
                full = min(_best_time(fn, rounds) for fn in fulls)
                # (int8 first, int16 first, bf16 alone: the first two fall back to bf16)
                configs = [c for c, on in (((True, False), self.int8),
                                           ((False, True), self.int16),
                                           ((False, False), True)) if on]
                for config in configs:
                    self.int8, self.int16 = config
                    got = self.argmax(x)
                    if got is not None and torch.equal(got, ref):
                        timed[config] = _best_time(lambda: self.argmax(x), rounds)
                    elif got is not None:
                        logger.info("ferrobatch: greedy head screen disagrees; not used")
                        return False
        except Exception as exc:  # noqa: BLE001 - an op missing from this build
            logger.info("ferrobatch: no greedy head screen (%s)", exc)
            return False
        finally:
            # judge the screens on the model's own rows
            self._int8_trial, self._int16_trial = _Trial(), _Trial()
        if not timed:
            return False
        self._best_other = min(full, *timed.values())  # (for `_window8_wins`)
        best = min(timed, key=timed.__getitem__)
        # int8 first keeps int16 behind it (it may fail to decide on the model's own rows)
        self.int8, self.int16 = best[0], best[1] or (best[0] and _HAVE_I16)
        if not self.int8:
            self._qweight = None
        if not self.int16:
            self._w16 = None
        self._screen_share = timed[best] / full
        if self._weight.dtype != torch.float32:
            return True  # exact fp32-accumulated argmax of a half head: worth it at any speed
        return timed[best] <= 0.8 * full


class _Trial:
    """The calls and misses of a screen judged on the model's own rows: it stays on until
    `_INT8_TRIAL_CALLS` calls have passed with more than `_INT8_MAX_MISS_SHARE` of them
    undecided."""

    def __init__(self) -> None:
        self.calls = 0
        self.misses = 0

    def record(self, *, decided: bool) -> bool:
        """Count one call; whether the screen stays on."""
        self.calls += 1
        self.misses += not decided
        return not (self.calls >= _INT8_TRIAL_CALLS
                    and self.misses > _INT8_MAX_MISS_SHARE * self.calls)


class _RowScaled:
    """A head weight [V, K] in int8 with one scale per row (`w_j = s_j p_j + f_j`, `s_j =
    max |w_j| / 127`) and what `GreedyHead._window8`'s window needs: `per_token` `u_j =
    max(||w_j||_2, ||f_j||_2 / rho)` with `rho` the median of `||f_j|| / ||w_j||`, so that
    `||e|| ||w_j|| + ||x|| ||f_j|| <= (||e|| + rho ||x||) u_j`."""

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.no_grad():  # (temporaries: 4 + 4 + 1 bytes a weight, as `supported` counts)
            w = weight.detach().float()
            amax = w.abs().amax(dim=1)
            scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).unsqueeze(1)
            q = w.div(scale).round_().clamp_(-127, 127)
            self.qweight = q.to(torch.int8).contiguous()
            f = q.mul_(scale).sub_(w)  # -f_j, in place of q
            w2 = w.norm(dim=1).double().numpy()
            f2 = f.norm(dim=1).double().numpy()
        self.scale = scale.squeeze(1)  # fp32 [V]
        self.rho, self.per_token = _folded_norms(w2, f2)
        self.w2max = float(w2.max()) if w2.size else 0.0


class _Int16Weight:
    """A head weight [V, K] in int16 with one scale for all of it, packed for
    `_core.i16_linear` (`w_j = s p_j + f_j`, `s = max |W| / qmax`, `|p| <= qmax`), with
    what `GreedyHead._screen_int16`'s bound needs: `per_token` `u_j = max(||w_j||_2,
    ||f_j||_2 / rho)` rounded up, `rho` the median of `||f_j|| / ||w_j||`. `qmax` keeps
    `K qmax^2 < 2^31`, so the int32 sums are exact (`K` even: a zero column is added to an
    odd one)."""

    _ROWS_PER_PASS = 4096  # rows quantized at a time (bounds the f64 temporaries)

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        self.n, self.k = int(n), int(k + k % 2)
        self.qmax = float(math.isqrt((2**31 - 1) // max(self.k, 1)))
        self.qmax = min(self.qmax, 32767.0)
        with torch.no_grad():
            w = weight.detach()
            amax = float(w.abs().max()) if w.numel() else 0.0
            self.scale = amax / self.qmax if amax > 0 else 1.0
            q16 = torch.zeros(self.n, self.k, dtype=torch.int16)
            w2 = np.empty(self.n)
            f2 = np.empty(self.n)
            for lo in range(0, self.n, self._ROWS_PER_PASS):
                rows = w[lo:lo + self._ROWS_PER_PASS].double()
                q = torch.round(rows / self.scale).clamp_(-self.qmax, self.qmax)
                q16[lo:lo + len(rows), :k] = q.to(torch.int16)
                w2[lo:lo + len(rows)] = torch.linalg.vector_norm(rows, dim=1).numpy()
                f2[lo:lo + len(rows)] = torch.linalg.vector_norm(
                    rows - q * self.scale, dim=1).numpy()
            self.packed = torch.empty(_core.i16_packed_len(self.n, self.k), dtype=torch.int16)
            _core.i16_pack(q16.numpy(), self.packed.numpy())
        self.rho, per_token = _folded_norms(w2, f2)
        self.per_token = per_token * (1 + 2.0**-30)


def _quantized_rows(hidden: torch.Tensor, hmax: np.ndarray, qmax: float
                    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Each row `h` of `hidden` [N, K] as `t q + e` with `t = max |h| / qmax` (`hmax`, every
    entry > 0): `q` (f64, integers in `-qmax..qmax`), `t` (f64 [N, 1]) and the f64 norms
    `||e||` and `||t q||` the screens' windows take."""
    exact = hidden.double()
    t = torch.from_numpy(hmax / qmax).unsqueeze(1)
    q = torch.round(exact / t).clamp_(-qmax, qmax)  # (|h| <= hmax: a no-op clamp)
    near = (q * t).numpy()  # t q
    return q, t, np.linalg.norm(exact.numpy() - near, axis=1), np.linalg.norm(near, axis=1)


def _folded_norms(w2: np.ndarray, f2: np.ndarray) -> tuple[float, np.ndarray]:
    """(`rho`, `u`) for weight rows of norms `w2` and rounding norms `f2`: `rho` the median
    of `f2 / w2` (1 when that is 0), `u_j = max(w2_j, f2_j / rho)`, so that
    `||e|| w2_j + ||x|| f2_j <= (||e|| + rho ||x||) u_j` (one rank-one window)."""
    ratio = f2[w2 > 0] / w2[w2 > 0]
    median = float(np.median(ratio)) if ratio.size else 0.0
    rho = median if median > 0 else 1.0
    return rho, np.maximum(w2, f2 / rho)


def _best_time(fn: Any, rounds: int) -> float:
    """Best CPU time of `fn` over `rounds` calls after a warm-up (the machine may be busy)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best
