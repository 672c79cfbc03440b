"""What a model argument names for `models.load_model`: a GGUF file (loaded quantized by
`loader.load_gguf`), a checkpoint to quantize on load (`quantize`), or neither (None: the
plain path loads it)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ferrobatch.errors import FieldError
from ferrobatch.gguf import narrow_read, quantize, stream_quantize
from ferrobatch.gguf.loader import load_gguf
from ferrobatch.gguf.reader import is_gguf_file, shard_paths
from ferrobatch.model_dtype import resolve_dtype

__all__ = ["gguf_path_of", "load"]


def gguf_path_of(model: Any) -> Path | None:
    """The GGUF file `model` (a path) names, or None: a file whose name ends in `.gguf` or
    that starts with the GGUF magic, or a directory with no `config.json` holding exactly
    one `*.gguf` or one split file's shards (the first shard; any other set of files:
    `FieldError` naming them)."""
    if not isinstance(model, str | os.PathLike):
        return None
    p = Path(model).expanduser()
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" or is_gguf_file(p) else None
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(x for x in p.iterdir() if x.suffix.lower() == ".gguf" and x.is_file())
        if len(found) == 1:
            return found[0]
        if found and shard_paths(found[0], len(found)) == found:  # one split file's shards
            return found[0]
        if len(found) > 1:
            raise FieldError(f"{p} holds {len(found)} GGUF files "
                             f"({', '.join(x.name for x in found)}); name one", "model")
    return None


def load(model: Any, *, device: Any, dtype: Any, quantization: str | None,
         load_plain: Callable[..., tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """`(model, tokenizer)` when `model` is a GGUF file or `quantization` is asked for, else
    None. `load_plain(path, device=, dtype=, **from_pretrained)` loads a checkpoint the
    plain way (`models.load_checkpoint`), to be quantized here: read as stored where that
    gives the same model (`narrow_read`: transformers maps the tensors from the files), else
    quantized one matrix at a time as transformers reads and converts it
    (`stream_quantize`)."""
    path = gguf_path_of(model)
    if path is not None:
        if quantization is not None:
            raise FieldError(f"{path.name} is a GGUF file: its tensors keep the types they are "
                             "stored in (quantization must be None)", "quantization")

        return load_gguf(path, device=device, dtype=dtype)
    if quantization is None:
        return None

    qtype = quantize.check_name(quantization)
    if not isinstance(model, str | os.PathLike):
        raise FieldError("a loaded model is never converted: pass its checkpoint directory "
                         "to quantize it on load", "quantization")
    quantize.check_device(device)

    path = Path(model).expanduser()
    wanted = resolve_dtype(dtype, torch.device("cpu"), path)
    read = narrow_read.in_place_read(path, wanted)
    if read is None and stream_quantize.AVAILABLE:  # converting: a matrix at a time
        return stream_quantize.load(qtype, wanted,
                                    functools.partial(load_plain, path, device=device))

    def load(read_in: Any, wanted: Any) -> tuple[Any, Any]:  # tensors mapped from the files
        loaded, tokenizer = load_plain(path, device=device, dtype=read_in)
        quantize.quantize_model(loaded, qtype, dtype=wanted)
        return loaded, tokenizer

    return narrow_read.quantized_load(path, dtype, load, read)
