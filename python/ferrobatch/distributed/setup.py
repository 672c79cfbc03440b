"""What `Engine(..., tensor_parallel_size=N)` does with N: validate it, start or join the
group, load this rank's shard, agree on values across ranks, and hand the engine the
runner it steps with (rank 0: `TPRunner` and the watchdog; a ``torchrun`` rank > 0: the
worker loop, then exit)."""

from __future__ import annotations

import atexit
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from ferrobatch import models
from ferrobatch.distributed import broadcast, quant_shard, shard, worker
from ferrobatch.distributed import group as group_mod
from ferrobatch.distributed.group import TPGroup
from ferrobatch.distributed.runner import TPRunner
from ferrobatch.errors import FieldError
from ferrobatch.gguf import narrow_read, quantize
from ferrobatch.gguf.source import gguf_path_of
from ferrobatch.models import _has_tokenizer_files, bundled_model_dir, resolve_dtype

logger = logging.getLogger("ferrobatch")


def start(size: Any, model: Any, *, device: Any, make_engine: Callable[..., Any],
          worker_kwargs: dict[str, Any]) -> TPGroup | None:
    """The group for `size` ranks (None for 1); refuses what cannot be sharded first.

    Spawned workers build their engine with ``make_engine(**worker_kwargs, model=...,
    tensor_parallel_size=size)`` (`worker.main`): `make_engine` is pickled by reference,
    a module-level class or function (the engine passes its class)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise FieldError(f"tensor_parallel_size must be an integer >= 1, not {size!r}",
                         field=shard.FIELD)
    if size == 1:
        return None
    path = checkpoint_path(model)
    if gguf_path_of(path) is not None:
        if worker_kwargs.get("quantization") is not None:
            raise FieldError(f"{path.name} is a GGUF file: its tensors keep the types they are "
                             "stored in (quantization must be None)", "quantization")
        quant_shard.check_gguf(path, size)
    else:
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
    return TPGroup.spawn(size, device, worker.main, (make_engine, kwargs))


def checkpoint_path(model: Any) -> Path:
    """The checkpoint every rank loads its shard from; a loaded model is refused."""
    if model is None:
        return bundled_model_dir()
    if isinstance(model, (str, os.PathLike)):
        gguf_file = gguf_path_of(model)  # a GGUF file: each rank cuts its share of it
        return gguf_file if gguf_file is not None else Path(model).expanduser()
    raise FieldError(
        f"tensor_parallel_size > 1 needs a checkpoint path (each rank loads its own shard); "
        f"a loaded {type(model).__name__} cannot be sharded: pass its directory "
        "(model.save_pretrained(dir); Engine(dir, tensor_parallel_size=N))",
        field=shard.FIELD)


def load(group: TPGroup, model: Any, dtype: Any,
         quantization: str | None = None, ordered: bool = False) -> tuple[Any, Any]:
    """(this rank's shard, the tokenizer) of `model`'s checkpoint: a GGUF file's or one
    quantized on load (`quant_shard`), else a float checkpoint's (`shard`; with `ordered`,
    the batch-invariant mode, plain slices from `quant_shard` whose row-parallel layers sum
    their parts in rank order)."""
    path = checkpoint_path(model)
    if gguf_path_of(path) is not None:
        if quantization is not None:
            raise FieldError(f"{path.name} is a GGUF file: its tensors keep the types they are "
                             "stored in (quantization must be None)", "quantization")
        return quant_shard.load_gguf_shard(path, group.rank, group.world_size, dtype,
                                           ordered)
    if quantization is not None:
        quantize.check_device(group.device)

        def load_share(read_in: Any, wanted: Any) -> tuple[Any, Any]:  # (as on one rank)
            plain = functools.partial(models.load_model, path, device=group.device,
                                      dtype=read_in)
            return quant_shard.load_quantized_shard(
                group.rank, group.world_size, quantization, plain, ordered, dtype=wanted)

        return narrow_read.quantized_load(path, dtype, load_share)
    if ordered:
        plain = functools.partial(models.load_model, path, device=group.device, dtype=dtype)
        return quant_shard.load_float_shard(group.rank, group.world_size, plain)
    dt = resolve_dtype(dtype, group.device, path)
    loaded = shard.load(path, group.rank, group.world_size, dt)
    tok = (AutoTokenizer.from_pretrained(str(path), local_files_only=True)
           if _has_tokenizer_files(path) else None)
    return loaded, tok


def agree(value: int, group: TPGroup) -> int:
    """Rank 0's `value` on every rank of `group` (e.g. the cache's `num_blocks`)."""
    return broadcast.agree(value, group.device if group.backend == "nccl" else None)


def attach(runner: Any, group: TPGroup, on_failure: Callable[[BaseException], None]) -> Any:
    """The runner the engine steps with, once it is built (every rank calls this at the same
    point). Rank 0: a `TPRunner` around `runner` (each step goes to every rank first), and
    the watchdog, which reports a dead worker through `on_failure`; a spawned worker:
    `runner` itself (`worker.main` serves with it); a ``torchrun`` rank > 0: serve rank 0's
    steps here, then exit."""
    group.steady()
    if group.rank != 0:
        if group.from_env:
            worker.serve(runner, group)
            group.shutdown()
            raise SystemExit(0)
        return runner
    wrapped = TPRunner(runner, group)
    group.watch(on_failure, wrapped.noop)
    atexit.register(group.shutdown, wrapped.stop_workers)
    return wrapped
