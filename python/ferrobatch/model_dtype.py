"""Where models are cached, and the dtype a checkpoint loads in: what `models` and `gguf`
both need (a leaf over torch, transformers and the compiled core)."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers loads: never a hub

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402

from ferrobatch import _core  # noqa: E402

__all__ = ["DTYPE_NAMES", "cache_root", "checkpoint_dtype", "cpu_has_native_bf16",
           "default_dtype", "is_floating", "resolve_dtype", "stored_tensors"]


def cache_root() -> Path:
    """ferrobatch's cache directory: `$FERROBATCH_CACHE` or `~/.cache/ferrobatch`."""
    env = os.environ.get("FERROBATCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ferrobatch"


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact parity); bf16 on CUDA when supported, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16 dot products),
    as the kernel crate detects it (`_core.amx_backend`, what `cpu.amx_ops` runs on)."""
    backend = getattr(_core, "amx_backend", None)
    return backend is not None and str(backend()) != "none"


def checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype a checkpoint directory's config.json names (`dtype` / `torch_dtype`)."""
    try:
        cfg = PretrainedConfig.get_config_dict(str(path), local_files_only=True)[0]
    except Exception:  # noqa: BLE001 - an unreadable config says nothing about the dtype
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    value = getattr(torch, str(name).replace("torch.", ""), None) if name else None
    return value if isinstance(value, torch.dtype) else None


def stored_tensors(files: Iterable[Path]) -> Iterator[tuple[str, str, list[int]]]:
    """(name, safetensors dtype name such as "BF16", shape) of every tensor in the
    safetensors `files`, from their headers (nothing else is read); raises what
    `safe_open` raises on a file it cannot read."""
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is no mapping
                part = f.get_slice(key)
                yield key, part.get_dtype(), part.get_shape()


def is_floating(stored: str) -> bool:
    """Whether a safetensors dtype name is a floating one (read in the model's dtype)."""
    return stored.startswith(("F", "BF"))


def resolve_dtype(
    dtype: torch.dtype | str | None, device: torch.device, path: Path | None = None
) -> torch.dtype:
    """The dtype to load a checkpoint in.

    None: `default_dtype(device)` (fp32 on CPU: exact parity with `model.generate` in fp32).
    "auto": on CUDA as None; on CPU bf16 when the checkpoint at `path` is stored in bf16 or
    fp16 and the CPU has native bf16 (AMX / AVX512-BF16: about 5x faster products than
    fp32 here, while fp16 products have no such units), else fp32. A name ("float32",
    "bfloat16", "float16") or a `torch.dtype` is taken as is. Anything else: `ValueError`."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, not {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)} or a torch.dtype, "
                         f"not {dtype!r}")
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cpu":
        return default_dtype(device)
    stored = checkpoint_dtype(path) if path is not None else None
    if stored in (torch.bfloat16, torch.float16) and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32
