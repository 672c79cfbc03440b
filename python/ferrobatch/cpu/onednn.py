"""oneDNN's packed linear product, which torch exposes only through private ops: the one
place ferrobatch calls them.

`torch.ops.mkldnn._reorder_linear_weight` lays a weight out once in oneDNN's blocked
layout and `torch.ops.mkldnn._linear_pointwise` multiplies by it (the ops inductor uses
for frozen linears); neither is a public API, so a torch release may drop or change them.
At first use `check()` looks both up once and compares their schemas with the arguments
passed here. Where they are missing or different, `available()` is False and
`unavailable_reason()` says which op and which torch version, so callers fall back (the
packed linears, the packed output head and the greedy head's screens are then off, as on
a build without oneDNN). `pack` / `linear` called anyway raise `OneDNNUnavailable` with
that reason.

`packing_available(dtype)` also runs a tiny product once per weight dtype: oneDNN refuses
fp16 weights on CPUs without AVX-NE-CONVERT or AVX512-FP16 (AMD Zen 4) and bf16 ones
without AVX-512.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger("ferrobatch")

__all__ = ["BATCH_HINT", "OneDNNUnavailable", "available", "check", "linear", "pack",
           "packing_available", "unavailable_reason"]

#: oneDNN's layout choice is tuned for this many rows (any count works)
BATCH_HINT = 64

#: the private ops and the argument types their default overloads must take (in order;
#: further arguments need defaults): what `pack` and `linear` pass them
EXPECTED: dict[str, tuple[str, ...]] = {
    "_reorder_linear_weight": ("Tensor", "Optional[int]"),
    "_linear_pointwise": ("Tensor", "Tensor", "Optional[Tensor]", "str",
                          "List[Optional[number]]", "Optional[str]"),
}


class OneDNNUnavailable(RuntimeError):
    """oneDNN's packed linear ops are missing from this torch build or take other
    arguments than ferrobatch passes."""


def _namespace() -> Any:
    """Where the ops live (`torch.ops.mkldnn`; tests put a stand-in here)."""
    return torch.ops.mkldnn


#: (reorder, linear) overloads once `check` found them; None before or where unavailable
_ops: tuple[Any, Any] | None = None


def _why_not(name: str, packet: Any) -> str | None:
    """Why `packet` (an op of `_namespace()`, or None) is not the op `EXPECTED` describes."""
    where = f"torch.ops.mkldnn.{name}"
    version = f"torch {torch.__version__}"
    if packet is None:
        return f"{version} has no {where}"
    try:
        args = packet.default._schema.arguments
    except AttributeError:
        return f"{version}: {where} has no default overload with a schema"
    want = EXPECTED[name]
    have = tuple(str(a.type) for a in args)
    extra_without_default = [a.name for a in args[len(want):]
                             if not getattr(a, "has_default_value", lambda: False)()]
    if have[:len(want)] != want or extra_without_default:
        return (f"{version}: {where} takes ({', '.join(have)}); ferrobatch passes "
                f"({', '.join(want)})")
    return None


@functools.cache
def check() -> str | None:
    """Look the ops up and check their schemas (once per process): None when usable, else
    the reason, naming the op and the torch version (logged once)."""
    global _ops
    if not torch.backends.mkldnn.is_available():
        reason: str | None = f"torch {torch.__version__} is built without oneDNN (mkldnn)"
    else:
        ns = _namespace()
        packets = {name: getattr(ns, name, None) for name in EXPECTED}
        reason = next((why for why in (_why_not(n, p) for n, p in packets.items())
                       if why is not None), None)
        if reason is None:
            _ops = (packets["_reorder_linear_weight"].default,
                    packets["_linear_pointwise"].default)
    if reason is not None:
        _ops = None
        logger.info("ferrobatch: no oneDNN packed linears (%s)", reason)
    return reason


def available() -> bool:
    """Whether the ops are present with the expected arguments (`check`)."""
    return check() is None


def unavailable_reason() -> str | None:
    """Why not (`check`): the op and the torch version; None when available."""
    return check()


def _require() -> tuple[Any, Any]:
    reason = check()
    if reason is not None or _ops is None:
        raise OneDNNUnavailable(f"oneDNN's packed linear ops are unavailable: {reason}")
    return _ops


def pack(weight: torch.Tensor, batch_hint: int = BATCH_HINT) -> torch.Tensor:
    """`weight` [n, k] reordered once into oneDNN's blocked layout for `linear`."""
    return _require()[0](weight, batch_hint)


def linear(x: torch.Tensor, packed: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + b` on a weight from `pack` (in the weight's dtype: `x` must have it)."""
    ops = _ops if _ops is not None else _require()
    return ops[1](x, packed, bias, "none", [], "")


@functools.cache
def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the ops are available and run `dtype` weights on this CPU (probed once per
    dtype on a tiny product: oneDNN refuses fp16 weights on CPUs without AVX-NE-CONVERT or
    AVX512-FP16, such as AMD Zen 4, and bf16 ones without AVX-512)."""
    if not available():
        return False
    try:
        with torch.inference_mode():
            w = pack(torch.ones(16, 16, dtype=dtype), 4)
            y = linear(torch.ones(4, 16, dtype=dtype), w)
        ok = bool((y == 16).all())
    except RuntimeError as exc:
        logger.info("ferrobatch: oneDNN's packed linears don't run %s weights here (%s)",
                    dtype, str(exc).splitlines()[0])
        return False
    if not ok:
        logger.info("ferrobatch: oneDNN's packed %s product is wrong here; not used", dtype)
    return ok


def reset() -> None:
    """Forget the checks (tests that replace `_namespace`)."""
    global _ops
    _ops = None
    check.cache_clear()
    packing_available.cache_clear()
