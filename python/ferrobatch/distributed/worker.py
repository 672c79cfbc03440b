"""The loop of ranks 1..N-1: build the same engine as rank 0 (the same shard of the same
checkpoint, the same cache size, the same construction probes), then run every step rank 0
sends, until it says stop (or the group breaks: the process then exits non-zero)."""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ferrobatch.distributed import broadcast
from ferrobatch.distributed.group import TPGroup

logger = logging.getLogger("ferrobatch")


def serve(runner: Any, group: TPGroup) -> None:
    """Run rank 0's steps on this rank's runner until STOP.

    Only rank 0 samples, so with a separable head and eager steps a worker asks for no
    logits at all (an empty `logits_indices`): the base model's forward (every collective)
    runs, the replicated head (no collective) is skipped. Graph steps keep the plan as is
    (its shape is the graph's key)."""
    device = group.device if group.backend == "nccl" else None
    skip_head = bool(getattr(runner, "head_skippable", False))
    empty = np.zeros(0, np.int32)
    while True:
        cmd, plan = broadcast.receive(device)
        if cmd == broadcast.STOP:
            return
        if cmd == broadcast.NOOP or plan is None:
            continue
        if cmd in (broadcast.EXECUTE, broadcast.GREEDY):
            if skip_head:
                plan.logits_indices, plan.logits_rows = empty, empty
            runner.execute(plan, plan.prev_tokens)
        elif cmd == broadcast.WITH_PROMPT:
            runner.execute_with_prompt(plan, plan.extra.astype("int64"), plan.prev_tokens)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {cmd}")


def main(rank: int, world_size: int, init_method: str, device: Any,
         make_engine: Callable[..., Any], engine_kwargs: dict[str, Any]) -> None:
    """A spawned worker: join the group, build the engine (``make_engine(**engine_kwargs)``,
    the class rank 0 runs) and serve its runner, leave."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    kwargs = dict(engine_kwargs)
    threads = kwargs.pop("num_threads", None)
    if threads:
        torch.set_num_threads(int(threads))
    logging.basicConfig(level=kwargs.pop("log_level", logging.WARNING))
    dev = TPGroup.device_for(rank, device)
    group = TPGroup.init(rank, world_size, init_method, dev)
    code = 0
    try:
        engine = make_engine(**kwargs)
        serve(engine.runner, group)
    except BaseException as exc:  # noqa: BLE001 - a broken group: leave quietly
        logger.error("ferrobatch tp worker %d: %s: %s", rank, type(exc).__name__, exc)
        code = 1
    finally:
        group.closed = True
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    # `os._exit` skips the interpreter's exit handlers, multiprocessing's among them: run
    # that one here, so the semaphores this process made (tqdm's lock, taken by
    # transformers' loading bars) are unlinked instead of left to the resource tracker
    # ("There appear to be N leaked semaphore objects" when rank 0's process exits).
    multiprocessing.util._exit_function()
    os._exit(code)
