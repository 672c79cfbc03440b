"""What `Engine(..., tensor_parallel_size=N)` does with N: validate it, start or join the
group, load this rank's shard, and attach the group to the engine (rank 0: `TPRunner` and
the watchdog; a ``torchrun`` rank > 0: the worker loop, then exit)."""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ferrobatch.distributed import group as group_mod
from ferrobatch.distributed import shard
from ferrobatch.distributed.group import TPGroup
from ferrobatch.errors import FieldError

logger = logging.getLogger("ferrobatch")


def start(size: Any, model: Any, *, device: Any, worker_kwargs: dict[str, Any]) -> TPGroup | None:
    """The group for `size` ranks (None for 1); refuses what cannot be sharded first."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise FieldError(f"tensor_parallel_size must be an integer >= 1, not {size!r}",
                         field=shard.FIELD)
    if size == 1:
        return None
    path = checkpoint_path(model)
    from transformers import AutoConfig

    shard.check(AutoConfig.from_pretrained(str(path), local_files_only=True), size)
    existing = group_mod.current()
    if existing is not None:  # a spawned worker building its engine
        return existing
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return TPGroup.join_env(size, device)
    os.environ.setdefault("LOCAL_RANK", "0")
    kwargs = dict(worker_kwargs, model=str(path), tensor_parallel_size=size,
                  num_threads=torch.get_num_threads(),
                  log_level=logging.getLogger("ferrobatch").getEffectiveLevel())
    return TPGroup.spawn(size, device, kwargs)


def checkpoint_path(model: Any) -> Path:
    """The checkpoint every rank loads its shard from; a loaded model is refused."""
    from ferrobatch.models import bundled_model_dir

    if model is None:
        return bundled_model_dir()
    if isinstance(model, (str, os.PathLike)):
        from ferrobatch.gguf.source import gguf_path_of

        if gguf_path_of(model) is not None:  # quantized GGUF modules are not sharded
            raise FieldError("a GGUF model cannot be sharded: tensor_parallel_size must be 1",
                             field=shard.FIELD)
        return Path(model).expanduser()
    raise FieldError(
        f"tensor_parallel_size > 1 needs a checkpoint path (each rank loads its own shard); "
        f"a loaded {type(model).__name__} cannot be sharded: pass its directory "
        "(model.save_pretrained(dir); Engine(dir, tensor_parallel_size=N))",
        field=shard.FIELD)


def load(group: TPGroup, model: Any, dtype: Any) -> tuple[Any, Any]:
    """(this rank's shard, the tokenizer) of `model`'s checkpoint."""
    from transformers import AutoTokenizer

    from ferrobatch.models import _has_tokenizer_files, resolve_dtype

    path = checkpoint_path(model)
    dt = resolve_dtype(dtype, group.device, path)
    loaded = shard.load(path, group.rank, group.world_size, dt)
    tok = (AutoTokenizer.from_pretrained(str(path), local_files_only=True)
           if _has_tokenizer_files(path) else None)
    return loaded, tok


def attach(engine: Any, group: TPGroup) -> None:
    """Rank 0: steps go through `TPRunner`, the watchdog reports a dead worker to every
    waiting caller; a ``torchrun`` rank > 0: serve rank 0's steps, then exit."""
    from ferrobatch.distributed.runner import TPRunner

    group.steady()
    if group.rank != 0:
        if group.from_env:
            from ferrobatch.distributed import worker

            worker.serve(engine.runner, group)
            group.shutdown()
            raise SystemExit(0)
        return
    runner = TPRunner(engine.runner, group)
    engine.runner = runner

    def on_failure(exc: BaseException) -> None:
        engine._fail_all(exc, fatal=True)
        engine._wakeup.set()

    group.watch(on_failure, runner.noop)
    atexit.register(group.shutdown, runner.stop_workers)

