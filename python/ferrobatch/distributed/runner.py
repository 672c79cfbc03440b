"""`TPRunner`: rank 0's model runner. Each step is sent to the other ranks (one header and
one payload broadcast, `broadcast.send`) before rank 0 runs the same forward itself; the
model's collectives (transformers' plan: all-reduce after each row-wise layer) then meet.
Logits are complete on every rank (the head is replicated, `shard`), so tokens are sampled
once, on rank 0. Only a plan planned ahead (async batching) needs some of them elsewhere:
the previous plan's samples its `prev_token_index` names go along as one more broadcast."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ferrobatch.distributed import broadcast
from ferrobatch.distributed.group import TPGroup, TPWorkerError


class TPRunner:
    """Wraps a `ModelRunner`: `execute*` broadcast the step first; everything else is the
    wrapped runner's."""

    def __init__(self, runner: Any, group: TPGroup) -> None:
        self._runner = runner
        self.group = group
        self._device = group.device if group.backend == "nccl" else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_runner", "group", "_device"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._runner, name, value)

    def _run(self, cmd: int, plan: Any, call: Any, extra: Any = (),
             prev_tokens: torch.Tensor | None = None) -> Any:
        group = self.group
        if group.failed is not None:
            raise TPWorkerError(f"tensor-parallel group is down: {group.failed}") from group.failed
        if group.closed:
            raise TPWorkerError("tensor-parallel group is shut down")
        with group.lock:
            try:
                broadcast.send(cmd, plan, extra, device=self._device, prev_tokens=prev_tokens)
                out = call()
            except TPWorkerError:
                raise
            except Exception as exc:
                err = TPWorkerError(
                    f"tensor-parallel step failed ({type(exc).__name__}: {exc}); another rank "
                    "died or timed out, the engine is shut down")
                group.fail(err)
                raise err from exc
            finally:
                group.last_send = time.monotonic()
        return out

    def execute(self, plan: Any, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The wrapped `execute`, on every rank."""
        return self._run(broadcast.EXECUTE, plan,
                         lambda: self._runner.execute(plan, prev_tokens), (), prev_tokens)

    def execute_greedy(self, plan: Any, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The wrapped `execute_greedy` (rank 0); the other ranks run the same forward."""
        return self._run(broadcast.GREEDY, plan,
                         lambda: self._runner.execute_greedy(plan, prev_tokens), (), prev_tokens)

    def execute_with_prompt(self, plan: Any, prompt_indices: np.ndarray,
                            prev_tokens: torch.Tensor | None = None) -> Any:
        """The wrapped `execute_with_prompt`, on every rank."""
        return self._run(
            broadcast.WITH_PROMPT, plan,
            lambda: self._runner.execute_with_prompt(plan, prompt_indices, prev_tokens),
            prompt_indices, prev_tokens)

    def noop(self) -> None:
        """Keep the workers' wait short of the collective timeout (the watchdog, idle)."""
        broadcast.send(broadcast.NOOP, device=self._device)
        self.group.last_send = time.monotonic()

    def stop_workers(self) -> None:
        """Tell the workers to leave their loop."""
        broadcast.send(broadcast.STOP, device=self._device)

