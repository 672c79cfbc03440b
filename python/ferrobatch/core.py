"""The Rust core: scheduler, paged KV-cache allocator and the block-table arithmetic
(re-exported from ``ferrobatch._core``, typed by ``_core.pyi``).

See ARCHITECTURE.md section 3 for the step contract (``StepPlan`` fields) and the docstrings
of :class:`Scheduler` (``snapshot()`` keys) and :class:`StepOutput` (array views).
"""

from ferrobatch._core import (
    SCRATCH_CHUNK,
    ZERO_CHUNK,
    Delta,
    Scheduler,
    StepOutput,
    StepPlan,
    slots,
    table_columns,
)

__all__ = [
    "SCRATCH_CHUNK",
    "ZERO_CHUNK",
    "Delta",
    "Scheduler",
    "StepOutput",
    "StepPlan",
    "slots",
    "table_columns",
]
