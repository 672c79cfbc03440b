"""ferrobatch: continuous-batching LLM inference (Rust scheduler, PyTorch model).

`from ferrobatch import Engine, ContinuousBatchingConfig, SamplingParams, SpeculativeConfig`
(and `RequestOutput`, `EmbeddingOutput`, `FieldError`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# How torch's OpenMP threads wait between parallel regions (libgomp reads this when torch
# loads it, so before the first `import torch`). Measured on a 2-core Intel Xeon (AMX), a
# sleeping thread took ~100 us to wake, more than a decode step's products: asleep
# (OMP_WAIT_POLICY=PASSIVE), 2 threads ran SmolLM2 bf16 in 5.5 s, slower than 1 thread;
# spinning 30000 rounds first, 3.5 s (longer spins gain nothing). Spinning beside another
# busy process is what collapses a step, and the engine's `ThreadGovernor` drops to fewer
# threads while that lasts. A policy or spin count set by the caller is kept.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "30000"

from ferrobatch.config import ContinuousBatchingConfig  # noqa: E402 - after the policy
from ferrobatch.engine.outputs import EmbeddingOutput, RequestOutput  # noqa: E402
from ferrobatch.errors import FieldError  # noqa: E402
from ferrobatch.sampling.params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from ferrobatch.engine.llm_engine import Engine
    from ferrobatch.spec.config import SpeculativeConfig

__version__ = "0.1.0"
__all__ = [
    "ContinuousBatchingConfig",
    "EmbeddingOutput",
    "Engine",
    "FieldError",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
]


def __getattr__(name: str) -> Any:
    # Engine and SpeculativeConfig load on first use: `import ferrobatch` stays light.
    if name == "Engine":
        from ferrobatch.engine.llm_engine import Engine

        return Engine
    if name == "SpeculativeConfig":
        from ferrobatch.spec.config import SpeculativeConfig

        return SpeculativeConfig
    raise AttributeError(f"module 'ferrobatch' has no attribute {name!r}")
