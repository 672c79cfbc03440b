"""Which product multiplies by a weight on CPU: one table, asked by everything that does.

The packed linears (`cpu_linear`: the model's `nn.Linear` layers, and the lean layers'
products), the one-call lean layer (`fused_layer`), the output head (`output_head`) and the
greedy head's screens (`greedy_head`) each ask `choose` (or `choose_rule`) with the weight
format, the call's row count, what this CPU and build run (`Isa`) and what the timed probes
found (`Probe`); the first rule of `RULES` that applies names the backend. `log_table`
writes the table as it applies here once, as one INFO line.

Backends (`Backend`):

* `amx_ops`: bf16 products summed and kept in fp32 (`ferrobatch.cpu.amx_ops`: AMX tiles,
  or `vdpbf16ps` on AVX-512 BF16); only for callers that take fp32 outputs (the lean
  layers, the greedy head's bf16 screen);
* `f32_ops`: fp32 products on AVX-512F (`ferrobatch.cpu.f32_ops`) of fp32 weights, or of
  half-precision ones packed as stored and widened exactly in registers (outputs bit for
  bit those of fp32 copies);
* `onednn_fp32`: oneDNN's packed product on fp32 copies of half-precision weights;
* `onednn`: oneDNN's packed product in the weight's dtype (`ferrobatch.cpu.onednn`; its
  outputs rounded to that dtype);
* `transposed`: `torch.mm` with a transposed contiguous copy (the output head only);
* `torch`: `F.linear`, the layer's own forward.

Half-precision weights take fp32 products (`onednn_fp32` on fp32 copies, `f32_ops` on the
half weights widened in registers) from the row count the probe returns (`probe(dtype)`:
one timing per process and dtype, `measure_gain`): on Intel
cores with AVX-512 BF16 and no AMX, `vdpbf16ps` runs at half the rate of the two fp32 FMA
ports, and the fp32 product of the widened weight took 0.51-0.58x the time of the bf16 one
from 64 rows, 0.56-0.75x at 16, while at 1-4 rows, where the weight's bytes are the cost,
the bf16 one took 0.3-0.6x the fp32 one's (`benches/amx_linear.py --fp32`). With AMX tiles
or on Zen 4 bf16 products run at 2-5x the fp32 rate and the probe says no.

Batch-invariant mode (`ContinuousBatchingConfig.batch_invariant`) asks `choose_invariant`
instead: its table, `INVARIANT_RULES`, names one backend per weight format and ISA, never by
rows, threads or a timing, and only backends whose every output is a sum in a fixed k order
(columns, never the k loop, split between threads), so a row's products do not depend on
what else its step holds.

A new weight format (GGUF Q8_0, Q4_K, ...) is a new row: a `Backend` member for its kernel,
a `Rule` naming the format in `weights` and the `Isa` feature its kernel needs (detected in
`Isa.detect`), and the callers' dispatch on the new backend.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

import torch

from ferrobatch.cpu import amx_ops, f32_ops, onednn

logger = logging.getLogger("ferrobatch")

__all__ = ["FP32_IN_BF16", "FP32_ROWS", "F32_KERNEL_ROWS", "GREEDY_FULL_ROWS",
           "INVARIANT_RULES", "ONE_CALL_MAX_ROWS", "RULES", "Backend", "Isa", "Probe", "Rule",
           "choose", "choose_invariant", "choose_rule", "describe", "reachable",
           "format_of", "fp32_from_rows", "limited", "log_table", "measure_gain", "one_call",
           "probe", "rows_from"]


class Backend(StrEnum):
    """A product (see the module docstring)."""

    AMX_OPS = "amx_ops"
    F32_OPS = "f32_ops"
    ONEDNN_FP32 = "onednn_fp32"
    ONEDNN = "onednn"
    TRANSPOSED = "transposed"
    TORCH = "torch"
    #: GGUF quantized weights' products (`ferrobatch.cpu.quant_ops`), chosen by the weights'
    #: format rather than by the rules below; named here for the one-call layer
    QUANT_OPS = "quant_ops"

    @property
    def fp32_inputs(self) -> bool:
        """Whether it computes on fp32 inputs whatever the weight dtype (a half-precision
        weight's input is then kept in fp32, not rounded to it)."""
        return self in (Backend.F32_OPS, Backend.ONEDNN_FP32, Backend.QUANT_OPS)


#: weight formats by torch dtype (quantized formats will be named by string only)
FORMATS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
HALF = frozenset({"bfloat16", "float16"})
#: fp32 weights whose every value is a bf16 one (a bf16 checkpoint run in fp32), which
#: `f32_ops` packs as bf16 (`panel_weights.bf16_exact`)
FP32_IN_BF16 = "float32_in_bfloat16"
ANY: frozenset[str] = frozenset()


def format_of(dtype: torch.dtype | str) -> str:
    """The weight format of a torch dtype (a string is one already)."""
    return dtype if isinstance(dtype, str) else FORMATS.get(dtype, str(dtype))


#: fp32 copies of half-precision weights from this many rows, where the probe finds them
#: clearly faster: below it the weight's bytes, twice as many in fp32, cost more than the
#: arithmetic saved (crossover at 4-16 rows)
FP32_ROWS = 16
#: fp32 products of up to this many rows on `f32_ops` (`benches/f32_linear.py` at SmolLM2's
#: shapes, Xeon with AVX-512, 1 thread: 1.2-2.7x oneDNN's packed fp32 product at 1-4 rows,
#: level at 64, 0.9x at 128-256 and 0.83x at 2048; at 2 threads level at 16-64). Up to it a
#: row's fp32 result does not depend on its step's row count.
F32_KERNEL_ROWS = 128
#: most rows `amx_ops` takes where oneDNN's product is faster beyond (AMX tiles at any
#: thread count; AVX-512 BF16 on more than one thread)
AMX_ROWS = 64
#: most rows of a step for the one-call lean layer (`fused_layer`: its per-thread scratch
#: stays a few MiB; above it the Python between the kernels is under 5% of a layer)
ONE_CALL_MAX_ROWS = 256
#: from this many rows a half-precision greedy head's argmax is that of the full fp32
#: product (on such a Xeon, 1 thread, SmolLM2's head: the bf16 screen took 2.7 / 12.6 / 46
#: ms at 1 / 16 / 64 rows, the fp32 product and argmax 7.7 / 15 / 35 ms)
GREEDY_FULL_ROWS = 32


@dataclass(frozen=True)
class Isa:
    """What runs products here: `features` such as "amx" or "avx512_bf16" (`amx_ops`'
    backend), "f32_ops", and "onednn:<format>" for each weight format oneDNN's packed
    product runs. `Isa.detect()` is this CPU and build; a caller that prepared fewer copies
    narrows it (`without`)."""

    features: frozenset[str] = frozenset()

    @classmethod
    @functools.cache
    def detect(cls) -> Isa:
        """This CPU and build (detected once)."""
        found = set()
        if amx_ops.available():
            found.add(amx_ops.backend())
        if f32_ops.available():
            found.add("f32_ops")
        found.update(f"onednn:{name}" for dtype, name in FORMATS.items()
                     if onednn.packing_available(dtype))
        return cls(frozenset(found))

    def has(self, feature: str) -> bool:
        return feature in self.features

    def without(self, *features: str) -> Isa:
        return Isa(self.features - set(features))

    def __str__(self) -> str:
        return ", ".join(sorted(self.features)) or "nothing"


@dataclass(frozen=True)
class Probe:
    """What timed probes found: `fp32_from_rows`, from how many rows the fp32 copies of a
    half-precision weight are faster here (None: they are not, or no copies were made);
    `shares`, a measured product's time over `F.linear`'s on the same weight (the output
    head's)."""

    fp32_from_rows: int | None = None
    shares: tuple[tuple[Backend, float], ...] = ()

    def share(self, backend: Backend) -> float | None:
        return next((s for b, s in self.shares if b is backend), None)


@dataclass(frozen=True)
class Rule:
    """One row of the table: `backend` runs a call when its weights are of a format in
    `weights` (empty: any), this CPU has every feature of `needs` ("{w}" stands for the
    weight format), its rows are within `rows` and torch's threads within `threads`
    (inclusive; None: no bound), and: with `fp32_copies`, the probe found fp32 copies
    faster (from `Probe.fp32_from_rows` rows: the floor of `rows` rises to it); with
    `fp32_outputs`, the caller takes fp32 outputs; with `max_share`, a timed probe found the
    backend below that share of `F.linear`'s time (`Probe.share`). `use`: "product" rules
    apply to every caller, "head" ones to the output head, "greedy" ones to the greedy head
    (before the product rules)."""

    backend: Backend
    weights: frozenset[str] = ANY
    needs: tuple[str, ...] = ()
    rows: tuple[int, int | None] = (0, None)
    threads: tuple[int, int | None] = (1, None)
    fp32_copies: bool = False
    fp32_outputs: bool = False
    max_share: float | None = None
    use: str = "product"
    why: str = ""

    def applies(self, fmt: str, rows: int, isa: Isa, probe: Probe, threads: int,
                fp32_outputs: bool) -> bool:
        lo, hi = self.rows
        if self.fp32_copies:
            if probe.fp32_from_rows is None:
                return False
            lo = max(lo, probe.fp32_from_rows)
        if self.weights and fmt not in self.weights:
            return False
        if rows < lo or (hi is not None and rows > hi):
            return False
        if threads < self.threads[0] or (self.threads[1] is not None
                                         and threads > self.threads[1]):
            return False
        if self.fp32_outputs and not fp32_outputs:
            return False
        if self.max_share is not None:
            share = probe.share(self.backend)
            if share is None or share >= self.max_share:
                return False
        return all(isa.has(need.format(w=fmt)) for need in self.needs)


_ONEDNN = ("onednn:{w}",)
_BF16 = frozenset({"bfloat16"})
_FP32 = frozenset({"float32"})

#: the table, first match wins (see the module docstring and each rule's `why`)
RULES: tuple[Rule, ...] = (
    # an output head outside the packed linears (fp32 weights), timed once against F.linear
    # on 64 random rows
    Rule(Backend.ONEDNN, _FP32, _ONEDNN, max_share=0.9, use="head",
         why="MKL's sgemm repacks the whole (32000-wide) head weight on every call: ~2x "
             "slower than the packed product at decode sizes on the tiny-llama model"),
    Rule(Backend.TRANSPOSED, _FP32, max_share=0.93, use="head",
         why="MKL is often faster on a transposed copy at decode sizes, by shape"),
    # a half-precision greedy head: the full fp32 product's argmax instead of a screen
    Rule(Backend.ONEDNN_FP32, HALF, ("onednn:float32",), rows=(GREEDY_FULL_ROWS, None),
         fp32_copies=True, use="greedy",
         why="35 ms instead of the bf16 screen's 46 at 64 rows of SmolLM2's head"),
    # products
    Rule(Backend.F32_OPS, HALF, ("f32_ops",), fp32_copies=True,
         why="fp32 products where they are faster (AVX-512 BF16 without AMX), on the half "
             "weights as stored, widened in registers: faster than the bf16 product at every "
             "row count, and than fp32 copies up to 64 rows; from 256 rows the copies are "
             "5-22% faster but take twice the weights' memory, so none are made"),
    Rule(Backend.ONEDNN_FP32, HALF, ("onednn:float32",), fp32_copies=True,
         why="fp32 copies beyond f32_ops' rows"),
    Rule(Backend.AMX_OPS, _BF16, ("amx",), rows=(0, AMX_ROWS), fp32_outputs=True,
         why="AMX tiles: twice oneDNN's speed at one row, level at 64, up to 1.5x slower "
             "from 256"),
    Rule(Backend.AMX_OPS, _BF16, ("avx512_bf16",), threads=(1, 1), fp32_outputs=True,
         why="one thread: 1.5-2x oneDNN at one row, level at 64-256, 0.87-0.94x at 1024, "
             "which costs less end to end than oneDNN's bf16-rounded outputs"),
    Rule(Backend.AMX_OPS, _BF16, ("avx512_bf16",), rows=(0, AMX_ROWS), threads=(2, None),
         fp32_outputs=True,
         why="more threads: oneDNN's product splits better from 256 rows (0.6-0.9x)"),
    Rule(Backend.F32_OPS, frozenset({FP32_IN_BF16}), ("f32_ops",),
         why="fp32 weights that are all bf16 values, packed as bf16 and widened exactly in "
             "registers: the fp32 panels' outputs bit for bit at half the bytes, at every "
             "row count (no oneDNN fp32 copy: from 256 rows it was 5-22% faster, at twice "
             "the weights' memory)"),
    Rule(Backend.F32_OPS, _FP32, ("f32_ops",), rows=(0, F32_KERNEL_ROWS),
         why="1.2-2.7x oneDNN's packed fp32 product at 1-4 rows, level at 16-64"),
    Rule(Backend.ONEDNN, ANY, _ONEDNN,
         why="the weight packed once (F.linear reorders a half weight on every call)"),
    Rule(Backend.TORCH, ANY, why="the layer's own forward"),
)


#: batch-invariant mode's table (`choose_invariant`): by weight format and ISA only
INVARIANT_RULES: tuple[Rule, ...] = (
    Rule(Backend.AMX_OPS, _BF16, ("amx",), use="invariant",
         why="AMX tiles: each fp32 sum runs over k in tile order whatever the rows "
             "(bf16 products 2-5x the fp32 rate there)"),
    Rule(Backend.F32_OPS, HALF, ("f32_ops",), use="invariant",
         why="half weights as stored, widened exactly in registers: each output a plain "
             "fp32 sum in input order, half the bytes of fp32 copies, and fp32 FMAs "
             "(vdpbf16ps was 0.69x the default at 64 rows without AMX)"),
    Rule(Backend.F32_OPS, frozenset({"float32", FP32_IN_BF16}), ("f32_ops",),
         use="invariant", why="each output a plain fp32 sum in input order"),
)


def choose_invariant(dtype: torch.dtype | str, isa: Isa) -> Backend | None:
    """The batch-invariant product of `dtype` weights here (`INVARIANT_RULES`, first match:
    by weight format and ISA only, so every call of every row count and thread count takes
    it), or None: no product here whose rows are independent of their batch."""
    fmt = format_of(dtype)
    for rule in INVARIANT_RULES:
        if rule.applies(fmt, 1, isa, Probe(), 1, fp32_outputs=True):
            return rule.backend
    return None


def choose_rule(dtype: torch.dtype | str, rows: int, isa: Isa, probe: Probe, *,
                fp32_outputs: bool = False, threads: int | None = None,
                use: str = "product") -> Rule:
    """The first rule of `RULES` for a call of `rows` rows on weights of `dtype` (a torch
    dtype or a format name) here: `use` "head" / "greedy" rules first for those callers,
    then the product rules; `fp32_outputs`: the caller takes fp32 outputs; `threads`:
    torch's thread count (None: now)."""
    fmt = format_of(dtype)
    threads = torch.get_num_threads() if threads is None else threads
    for rule in RULES:
        if rule.use in (use, "product") and rule.applies(fmt, rows, isa, probe, threads,
                                                         fp32_outputs):
            return rule
    raise LookupError(f"no rule for {fmt} weights")  # (the last rule takes anything)


def choose(dtype: torch.dtype | str, rows: int, isa: Isa, probe: Probe, *,
           fp32_outputs: bool = False, threads: int | None = None) -> Backend:
    """The backend of a product (`choose_rule` with `use="product"`)."""
    return choose_rule(dtype, rows, isa, probe, fp32_outputs=fp32_outputs,
                       threads=threads).backend


def one_call(backend: Backend, rows: int) -> bool | None:
    """Whether a lean layer of a `rows`-row step whose every product takes `backend` may run
    in one call of `_core.LeanLayer`, and on which products: True on `f32_ops`, False on
    `amx_ops`, None not at all."""
    if rows > ONE_CALL_MAX_ROWS:
        return None
    return _ONE_CALL.get(backend)


#: the products the one-call layer runs on, as `one_call` names them (True: fp32 weights)
_ONE_CALL = {Backend.F32_OPS: True, Backend.AMX_OPS: False}


def reachable(dtype: torch.dtype | str, isa: Isa, probe: Probe) -> frozenset[Backend]:
    """Every backend a product of `dtype` weights may take here (`choose` over every row
    count, thread count and output kind): the copies worth making."""
    fmt = format_of(dtype)
    rows, threads = {1}, {1}
    for rule in RULES:
        if rule.use != "product":
            continue
        rows.add(max(1, rule.rows[0]))
        threads.add(rule.threads[0])
        if rule.rows[1] is not None:
            rows.add(rule.rows[1] + 1)
        if rule.threads[1] is not None:
            threads.add(rule.threads[1] + 1)
    if probe.fp32_from_rows is not None:
        rows.add(probe.fp32_from_rows)
    return frozenset(choose(fmt, r, isa, probe, fp32_outputs=wide, threads=t)
                     for r in rows for t in threads for wide in (False, True))


def rows_from(use: str, dtype: torch.dtype | str, isa: Isa, probe: Probe,
              threads: int = 1) -> int | None:
    """The fewest rows from which a `use` rule (e.g. "greedy") applies to `dtype` weights
    here, or None (never)."""
    fmt = format_of(dtype)
    for rule in RULES:
        if rule.use != use:
            continue
        lo = rule.rows[0]
        if rule.fp32_copies and probe.fp32_from_rows is not None:
            lo = max(lo, probe.fp32_from_rows)
        if rule.applies(fmt, lo, isa, probe, threads, fp32_outputs=True):
            return lo
    return None


def limited(backend: Backend, max_rows: int) -> tuple[Rule, ...]:
    """`RULES` with `backend`'s product rules bounded to `max_rows` rows (tests)."""
    return tuple(dataclasses.replace(r, rows=(r.rows[0], max_rows))
                 if r.backend is backend and r.use == "product" else r for r in RULES)


# --- the probe: fp32 copies of half-precision weights ----------------------------------

#: fp32 must take at most 1 / this of the half-precision product's time at the probe shape
#: (a noisy machine must not flip the choice: where it applies, fp32 is about twice as fast)
_MIN_GAIN = 1.3
_PROBE_SHAPE = (64, 1024, 1024)  # rows, output features, input features
_probed: dict[str, int | None] = {}


@functools.cache
def fp32_from_rows(dtype: torch.dtype) -> int | None:
    """From how many rows a `dtype` (bf16 / fp16) weight's product is faster as the fp32
    product of its widened copy here (`FP32_ROWS`), or None (not clearly faster, or oneDNN's
    packed products don't run here). Measured once per process and dtype."""
    if not (onednn.packing_available(dtype) and onednn.packing_available(torch.float32)):
        return None
    try:
        gain = measure_gain(dtype)
    except RuntimeError as exc:  # a product this build or CPU doesn't run
        logger.info("ferrobatch: no fp32 product probe for %s (%s)", dtype,
                    str(exc).splitlines()[0])
        return None
    # f32_ops reads the half weights as stored (the bf16 product's bytes): fp32 from 1 row
    rows = (1 if f32_ops.available() else FP32_ROWS) if gain >= _MIN_GAIN else None
    logger.info("ferrobatch: fp32 products of widened %s weights take %.2fx the time of %s "
                "ones here%s", dtype, 1 / gain, dtype,
                f"; used from {rows} row{'s' if rows != 1 else ''}" if rows else "")
    return rows


def probe(dtype: torch.dtype) -> Probe:
    """The probe's verdict for `dtype` weights (fp32 copies only for half precision)."""
    rows = fp32_from_rows(dtype) if format_of(dtype) in HALF else None
    _probed[format_of(dtype)] = rows
    return Probe(fp32_from_rows=rows)


def measure_gain(dtype: torch.dtype, rounds: int = 5) -> float:
    """The half-precision product's time over the fp32 one's at `_PROBE_SHAPE` on one thread
    (the faster of `amx_ops` and oneDNN's packed product for the half one; for the fp32 one
    `f32_ops`' half panels where they run, else oneDNN's product on an fp32 copy; best of
    `rounds`, interleaved)."""
    rows, n, k = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(dtype)
    with torch.inference_mode():
        packed = onednn.pack(w, rows)
        if f32_ops.available():
            panels = f32_ops.pack(w)
            fp32: Callable[[], object] = lambda: f32_ops.linear(x, panels)  # noqa: E731
        else:
            wide = onednn.pack(w.float(), rows)
            fp32 = lambda: onednn.linear(x, wide)  # noqa: E731
        halves: list[Callable[[], object]] = [lambda: onednn.linear(x.to(dtype), packed)]
        if dtype == torch.bfloat16 and amx_ops.available():
            tiles = amx_ops.pack(w)
            halves.append(lambda: amx_ops.linear(x, tiles))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            best_half, best_fp32 = float("inf"), float("inf")
            for _ in range(rounds):
                best_half = min(best_half, *(_time(fn) for fn in halves))
                best_fp32 = min(best_fp32, _time(fp32))
        finally:
            torch.set_num_threads(threads)
    return best_half / best_fp32


def _time(fn: Callable[[], object]) -> float:
    fn()  # warm: the first call of a shape may set up oneDNN's kernel
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- the table as it applies here --------------------------------------------------------


def describe(fmt: str, isa: Isa, probe: Probe, threads: int) -> str:
    """`fmt` weights' backends by row range here, e.g. "1-15 onednn (fp32 outputs:
    amx_ops), 16-128 f32_ops, 129+ onednn_fp32"."""
    cuts = {1}
    for rule in RULES:
        if rule.use == "product":
            lo = max(rule.rows[0], probe.fp32_from_rows or 1) if rule.fp32_copies \
                else rule.rows[0]
            cuts.add(max(lo, 1))
            if rule.rows[1] is not None:
                cuts.add(rule.rows[1] + 1)
    starts = sorted(cuts)
    parts: list[tuple[int, int | None, str]] = []
    for i, lo in enumerate(starts):
        hi = starts[i + 1] - 1 if i + 1 < len(starts) else None
        plain = choose(fmt, lo, isa, probe, threads=threads)
        wide = choose(fmt, lo, isa, probe, threads=threads, fp32_outputs=True)
        text = str(plain) if wide is plain else f"{plain} (fp32 outputs: {wide})"
        if parts and parts[-1][2] == text:
            parts[-1] = (parts[-1][0], hi, text)
        else:
            parts.append((lo, hi, text))
    return ", ".join(f"{lo}{'+' if hi is None else '' if hi == lo else f'-{hi}'} {text}"
                     for lo, hi, text in parts)


def log_table(formats: Iterable[str] = ("float32", "bfloat16", "float16"),
              isa: Isa | None = None, threads: int | None = None) -> str:
    """One INFO line: the table as it applies on this CPU (formats whose fp32-copies probe
    has not run are shown without fp32 copies, marked "not probed"); logged once per
    distinct line. Returns the line."""
    isa = Isa.detect() if isa is None else isa
    threads = torch.get_num_threads() if threads is None else threads
    parts = []
    for fmt in formats:
        rows = _probed.get(fmt)
        note = "" if fmt not in HALF else (
            "; fp32 copies not probed" if fmt not in _probed else
            "; fp32 copies faster" if rows is not None else "; fp32 copies not faster")
        parts.append(f"{fmt}: {describe(fmt, isa, Probe(fp32_from_rows=rows), threads)}{note}")
    line = (f"ferrobatch: linear backends by rows here ({isa}; {threads} "
            f"thread{'s' if threads > 1 else ''}): " + "; ".join(parts))
    _log_once(line)
    return line


@functools.cache
def _log_once(line: str) -> None:
    logger.info("%s", line)
