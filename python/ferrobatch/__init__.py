"""ferrobatch: continuous-batching LLM inference (Rust scheduler, PyTorch model).

`from ferrobatch import Engine, ContinuousBatchingConfig, SamplingParams, RequestOutput`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin while they wait (libgomp's default) collapse throughput as soon
# as anything else wants the cores: measured here, a 16-token request through `ferrobatch
# serve` at 2 threads took 5-23 s spinning and 0.9 s passive, and the brief workload at 2
# threads on a busy machine ran 8x faster passive. libgomp reads this when torch loads it,
# so it must be set before the first `import torch`; OMP_WAIT_POLICY=ACTIVE opts out.
#: torch was loaded before ferrobatch with no wait policy set: its threads spin
OPENMP_SPINS = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ferrobatch.config import ContinuousBatchingConfig  # noqa: E402 - after the policy
from ferrobatch.engine.outputs import RequestOutput  # noqa: E402
from ferrobatch.errors import FieldError  # noqa: E402
from ferrobatch.sampling.params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from ferrobatch.engine.llm_engine import Engine

__version__ = "0.1.0"
__all__ = ["ContinuousBatchingConfig", "Engine", "FieldError", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from ferrobatch.engine.llm_engine import Engine

        return Engine
    raise AttributeError(f"module 'ferrobatch' has no attribute {name!r}")
