"""ferrobatch: continuous-batching LLM inference (Rust scheduler, PyTorch model).

`from ferrobatch import Engine, ContinuousBatchingConfig, SamplingParams, RequestOutput`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferrobatch.config import ContinuousBatchingConfig
from ferrobatch.outputs import RequestOutput
from ferrobatch.sampling import SamplingParams

if TYPE_CHECKING:
    from ferrobatch.engine import Engine

__version__ = "0.1.0"
__all__ = ["ContinuousBatchingConfig", "Engine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from ferrobatch.engine import Engine

        return Engine
    raise AttributeError(f"module 'ferrobatch' has no attribute {name!r}")
