"""Reading a half-precision checkpoint in its own dtype before quantizing it on load.

transformers maps a safetensors tensor stored in the dtype it is read in straight from the
file (file pages, no copy), so a checkpoint read in its stored dtype costs no anonymous
memory before it is quantized; a converted read holds the whole converted model (one
process streams those instead, `stream_quantize`; tensor-parallel ranks read their shares).

A bf16 checkpoint asked for in fp32 (quantize-on-load's default) used to be read whole in
fp32 first: twice its bytes, 6.2 GB for a 1.5B model, 32 GB for an 8B one, before a single
matrix was quantized. Read in its stored dtype instead, every matrix widens to fp32 inside
`quantize_weight` one at a time, and the few float tensors left (norms, biases, layers that
stay float) widen afterwards. Widening bf16 or fp16 to fp32 is exact, so the model is the
one an fp32 read gives, bit for bit, with one exception this module rules out first: a
non-persistent buffer the model builds in the default dtype (Gemma3's `embed_scale`) would
be rounded to half precision. Such models, checkpoints whose files are not all half
precision whatever their config says, and anything these checks cannot read are read in
fp32 as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ferrobatch.model_dtype import checkpoint_dtype, is_floating, resolve_dtype, stored_tensors

__all__ = ["in_place_read", "quantized_load", "read_dtype", "widen"]

logger = logging.getLogger("ferrobatch")

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _skeleton(path: Path, dtype: torch.dtype) -> nn.Module:
    """The model of `path` built on the meta device (no memory) with `dtype` the default."""
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def tensor_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Every parameter's and buffer's dtype, by name."""
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    return {name: t.dtype for name, t in named}


def _non_persistent(model: nn.Module) -> set[str]:
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            for name in module._non_persistent_buffers_set}


def _files_hold_only(path: Path, dtype: torch.dtype) -> bool:
    """Whether `path`'s safetensors files exist and every floating tensor in them is stored
    in `dtype` (read from their headers; a config that names bf16 over fp32 files, or
    pickled weights, say no)."""
    files = sorted(path.glob("*.safetensors"))
    name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}.get(dtype)
    try:
        for _, stored, _ in stored_tensors(files):
            if is_floating(stored) and stored != name:
                return False
    except Exception:  # noqa: BLE001 - an unreadable header: read as asked
        return False
    return bool(files)


def read_dtype(path: Path, wanted: torch.dtype) -> tuple[torch.dtype, dict[str, torch.dtype]]:
    """(the dtype to read the checkpoint at `path` in, each tensor's dtype in a read in
    `wanted`): the checkpoint's stored bf16 / fp16 where `wanted` is fp32, its safetensors
    hold every floating tensor in that dtype and no non-persistent buffer follows the
    default dtype; else `wanted` (and an empty map)."""
    stored = checkpoint_dtype(path)
    if wanted != torch.float32 or stored not in HALF_DTYPES:
        return wanted, {}
    if not _files_hold_only(path, stored):
        return wanted, {}
    try:
        wide, narrow = _skeleton(path, wanted), _skeleton(path, stored)
    except Exception as exc:  # noqa: BLE001 - no skeleton, no shortcut: read as asked
        logger.info("ferrobatch: reading %s in %s (its %s skeleton failed: %s)", path, wanted,
                    stored, exc)
        return wanted, {}
    wide_dtypes, narrow_dtypes = tensor_dtypes(wide), tensor_dtypes(narrow)
    rounded = [n for n in _non_persistent(wide) if wide_dtypes[n] != narrow_dtypes.get(n)]
    if rounded:
        logger.info("ferrobatch: reading %s in %s: buffers %s follow the default dtype", path,
                    wanted, ", ".join(rounded[:3]))
        return wanted, {}
    return stored, wide_dtypes


def in_place_read(path: Path,
                  wanted: torch.dtype) -> tuple[torch.dtype, dict[str, torch.dtype]] | None:
    """`read_dtype(path, wanted)` where the plain load of that dtype maps every floating
    tensor from the safetensors files as stored, copying nothing (they are all stored in
    it: `wanted` itself, or the half precision a narrow read takes); None where some tensor
    would be converted as it is read (Gemma3's narrow read refused, an fp32 checkpoint read
    in bf16, pickled weights): `stream_quantize` then keeps one matrix converted at a
    time, not the whole model."""
    read_in, wide = read_dtype(path, wanted)
    if read_in != wanted:  # a narrow read: `read_dtype` checked the files hold only `read_in`
        return read_in, wide
    return (read_in, wide) if _files_hold_only(path, read_in) else None


def widen(model: nn.Module, read_in: torch.dtype, wide: dict[str, torch.dtype],
          wanted: torch.dtype) -> None:
    """Each floating tensor of `model` still in `read_in` to the dtype a read in `wanted`
    gives it (`wide`, by name; `wanted` for names it lacks), in place."""
    for prefix, module in model.named_modules():
        for kind in (module._parameters, module._buffers):
            for name, t in kind.items():
                if t is None or t.dtype != read_in:
                    continue
                to = wide.get(f"{prefix}.{name}" if prefix else name, wanted)
                if to == read_in:
                    continue
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(to)
                else:
                    kind[name] = t.to(to)
    model.config.dtype = wanted


def quantized_load(path: Path, dtype: Any,
                   load: Callable[[torch.dtype, torch.dtype], tuple[Any, Any]],
                   read: tuple[torch.dtype, dict[str, torch.dtype]] | None = None,
                   ) -> tuple[Any, Any]:
    """`load(read_in, wanted)` (the checkpoint at `path` read in `read_in` and quantized,
    its embedding giving `wanted`: `dtype` resolved on the CPU), then widened to what a
    read in `wanted` gives: the model and tokenizer quantize-on-load returns. `read`:
    `read_dtype(path, wanted)` where the caller has it."""
    wanted = resolve_dtype(dtype, torch.device("cpu"), path)
    read_in, wide = read if read is not None else read_dtype(path, wanted)
    loaded, tokenizer = load(read_in, wanted)
    if read_in != wanted:
        widen(loaded, read_in, wide, wanted)
    return loaded, tokenizer
