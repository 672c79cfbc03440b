"""From parsed flags to a ``ContinuousBatchingConfig``, an ``Engine`` and ``SamplingParams``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ferrobatch.cli.flags import CONFIG_FLAGS, SAMPLING_FLAGS
from ferrobatch.config import ContinuousBatchingConfig
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.spec.cli import spec_config_from_args

__all__ = ["build_config", "build_engine", "build_sampling", "check_readable", "check_writable"]


def build_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """``ContinuousBatchingConfig`` from the config flags that were given (ValueError if bad)."""
    given = {name: getattr(args, name) for name, _ in CONFIG_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    return ContinuousBatchingConfig(**given)


def build_engine(args: argparse.Namespace, model: Any = None) -> Any:
    """An ``Engine`` from the model, config and device flags (``model`` overrides MODEL)."""
    # local: torch + transformers take seconds to import; --help / --version stay instant
    import torch

    from ferrobatch.engine.llm_engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    return Engine(
        model if model is not None else args.model,
        config=build_config(args),
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        seed=args.engine_seed,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        speculative_config=spec_config_from_args(args),
        quantization=getattr(args, "quantization", None),
        lora_modules=dict(getattr(args, "lora_modules", None) or []) or None,
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 4),
    )


def build_sampling(args: argparse.Namespace) -> SamplingParams:
    """``SamplingParams`` from the sampling flags."""
    fields = {name: getattr(args, name) for name, _ in SAMPLING_FLAGS}
    fields["stop"] = tuple(fields["stop"])
    return SamplingParams(max_new_tokens=args.max_new_tokens, **fields)


def check_readable(path: Path, flag: str) -> None:
    """`ValueError` (a one-line CLI error) unless `path` is a readable file."""
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file" if not path.exists() else
                         f"{flag} {path}: not a file")


def check_writable(path: Path, flag: str) -> None:
    """`ValueError` unless a file can be written at `path` (its folder exists, it is no
    folder itself)."""
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, not a file")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: the folder {path.parent} does not exist")
