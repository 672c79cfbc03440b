"""Hooks shared by every test folder: the `needs_isa` mark (`isa_helpers.py`)."""

from __future__ import annotations

import isa_helpers


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "needs_isa(available, *isas, what): skip unless available; fail instead where "
        "FERROBATCH_REQUIRE_ISA names one of isas (isa_helpers.py)")
    config.addinivalue_line(
        "markers", "kernel_products: GGUF tests on the quantized kernels (tests/gguf run the "
        "reference products otherwise)")


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers(name="needs_isa"):
        isa_helpers.require_or_skip(*mark.args, **mark.kwargs)
