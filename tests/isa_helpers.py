"""The gate of tests that need an instruction set (ISA) the CPU may lack.

`require_or_skip(available, *isas, what=...)` in a test, or the mark
`needs_isa(available, *isas, what=...)` on a test or module (run by `tests/conftest.py`):
where `available` is false the test is skipped with the reason `needs <isa> (<what>)` —
unless the environment variable `FERROBATCH_REQUIRE_ISA` (a comma list) names one of
`isas`, the ISAs any of which would have made it available: then the test fails, so a
machine that has the ISA (CI sets the variable from its /proc/cpuinfo) cannot pass a test it
never ran. The Rust tests read the same variable (`rust/kernels/src/isa.rs`, whose table is
the one list of recognised names; they fail on a name they do not recognise).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from ferrobatch.runner.greedy_head import GreedyHead

REQUIRE_ENV = "FERROBATCH_REQUIRE_ISA"

_ISA_RS = Path(__file__).resolve().parent.parent / "rust" / "kernels" / "src" / "isa.rs"


def recognised() -> frozenset[str]:
    """The ISA names `rust/kernels/src/isa.rs` recognises (its `Isa::name`)."""
    return frozenset(re.findall(r'Isa::\w+ => "(\w+)"', _ISA_RS.read_text()))


def required() -> frozenset[str]:
    """The ISAs `FERROBATCH_REQUIRE_ISA` names (lower case, blanks and empty items dropped)."""
    value = os.environ.get(REQUIRE_ENV, "")
    return frozenset(n.strip().lower() for n in value.split(",") if n.strip())


def require_or_skip(available: bool, *isas: str, what: str) -> None:
    """Return where `available`; else fail when `FERROBATCH_REQUIRE_ISA` names one of `isas`
    (any of which would make `what` available), else skip the test."""
    __tracebackhide__ = True  # reports point at the test, not here
    unknown = set(isas) - recognised()
    assert not unknown, f"not ISA names of rust/kernels/src/isa.rs: {sorted(unknown)}"
    if available:
        return
    needs = " or ".join(isas)
    forced = sorted(set(isas) & required())
    if forced:
        pytest.fail(f"needs {needs} ({what}) and {REQUIRE_ENV} requires {', '.join(forced)}, "
                    "but it is not available here", pytrace=False)
    pytest.skip(f"needs {needs} ({what})")


def needs_isa(available: bool, *isas: str, what: str) -> pytest.MarkDecorator:
    """`require_or_skip(available, *isas, what=what)` before the test runs, as a mark."""
    return pytest.mark.needs_isa(available, *isas, what=what)


#: skips a test of the greedy head screen where it does not run (it packs bf16 copies, and
#: oneDNN has no bf16 products without AVX-512 or AVX-NE-CONVERT, as on AMD Zen 3)
needs_greedy_screen = pytest.mark.skipif(
    not GreedyHead.supported(torch.zeros(2, 2)),
    reason="no greedy head screen here (oneDNN without bf16 products on this CPU)")
