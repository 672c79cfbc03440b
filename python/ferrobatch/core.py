"""The Rust core: scheduler and paged KV-cache allocator (re-exported from ``ferrobatch._core``).

See ARCHITECTURE.md section 3 for the step contract (``StepPlan`` fields) and the docstrings
of :class:`Scheduler` (``snapshot()`` keys) and :class:`StepOutput` (array views).
"""

from ferrobatch._core import Delta, Scheduler, StepOutput, StepPlan

__all__ = ["Delta", "Scheduler", "StepOutput", "StepPlan"]
