"""What each GGUF architecture becomes: the transformers config (transformers' own GGUF
mapping, plus the metadata llama.cpp writes that the mapping drops), the tensor processor
(llama's q/k row order, Gemma's norm offsets), and what is refused.

Supported: the architectures the engine runs, as llama.cpp's `convert_hf_to_gguf.py` writes
them: `llama` (Llama, and Mistral when `general.name` says so, as transformers decides),
`qwen2`, `qwen3`, `gemma2`, `gemma3` (text), `phi3` (with LongRoPE: Phi-3 128k, Phi-3.5,
Phi-4-mini), `gpt2`, `starcoder2`, and the mixtures of experts `qwen2moe`, `qwen3moe` and
`llama` with experts (Mixtral). Anything else is refused with a
`FieldError` (field "model") before anything is built.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
from transformers import MixtralConfig
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.modeling_gguf_pytorch_utils import (
    GGUF_SUPPORTED_ARCHITECTURES,
    TENSOR_PROCESSORS,
    TensorProcessor,
)

from ferrobatch.errors import FieldError

__all__ = ["MOE_ARCHITECTURES", "OWN_CONFIG", "SUPPORTED_ARCHITECTURES", "check_architecture",
           "fix_config", "is_moe", "model_type", "moe_config", "own_config_dict", "process",
           "refuse_metadata", "row_permutation", "tensor_processor"]

logger = logging.getLogger("ferrobatch")

#: GGUF `general.architecture` values ferrobatch loads (each tested with a file written here)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2",
                           "starcoder2", "nemotron", "qwen2moe", "qwen3moe", "gpt-oss")
#: the Qwen mixtures of experts among them (their experts: `ferrobatch.gguf.experts`)
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")
#: architectures whose config is made here from transformers' mapping table
#: (`own_config_dict`), not by transformers' GGUF reader
OWN_CONFIG = ("gpt-oss",)
#: transformers' model type of a GGUF architecture, where the two names differ
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}

#: metadata (`{arch}.` + key) that changes the computation in ways no supported model uses:
#: refused when present (a model loaded without it would compute something else)
_REFUSED_KEYS = ("logit_scale", "embedding_scale", "residual_scale", "attention.scale",
                 "attention.clamp_kqv", "attention.max_alibi_bias", "expert_count")


def own_config_dict(metadata: dict[str, Any], arch: str, vocab_rows: int,
                    tied: bool) -> dict[str, Any] | None:
    """The config dict transformers' GGUF reader would make of a gpt-oss file, made here from
    its mapping table (its reader fails on every file whose YaRN keys llama.cpp wrote); None
    for the other architectures (transformers' reader serves them). `vocab_rows`: the token
    embedding's rows; `tied`: whether the file has no output head."""
    if arch not in OWN_CONFIG:
        return None
    out: dict[str, Any] = {"model_type": model_type(arch), "tie_word_embeddings": tied}
    for key, name in GGUF_CONFIG_MAPPING[model_type(arch)].items():
        value = _meta(metadata, arch, key)
        if name is not None and value is not None:
            out[name] = value
    for key, name in GGUF_CONFIG_MAPPING["tokenizer"].items():
        value = metadata.get(f"tokenizer.{key}")
        if value is not None:
            out[name] = int(value)
    out.setdefault("vocab_size", vocab_rows)
    return out


def model_type(arch: str) -> str:
    """transformers' model type of the GGUF architecture `arch` ("qwen3moe" -> "qwen3_moe")."""
    return _MODEL_TYPES.get(arch, arch)


def check_architecture(arch: str, path: Any) -> None:
    """`FieldError` unless ferrobatch loads GGUF files of `arch`."""

    if arch in SUPPORTED_ARCHITECTURES and model_type(arch) in GGUF_SUPPORTED_ARCHITECTURES:
        return
    raise FieldError(
        f"{path}: GGUF architecture {arch!r} is not supported (ferrobatch loads "
        f"{', '.join(SUPPORTED_ARCHITECTURES)})", "model")


def tensor_processor(arch: str, config_dict: dict[str, Any]) -> Any:
    """transformers' tensor processor for `arch` (its base class when it has none)."""

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config_dict)


def process(processor: Any, weights: np.ndarray, name: str) -> np.ndarray:
    """`processor.process` of one tensor, its values only (a processor that files a tensor
    under another name, as GPT-2's does for `output.weight`, writes into a scratch dict)."""
    out = processor.process(weights=weights, name=name, tensor_key_mapping={},
                            parsed_parameters={"tensors": {}})
    return np.asarray(out.weights)


def row_permutation(processor: Any, name: str, rows: int,
                    transposed: bool = False) -> np.ndarray | None:
    """How `processor` reorders the rows of tensor `name` (GGUF name) with `rows` rows:
    None when it leaves them (and their values) alone, else the permutation `p` (row `i` of
    the result is row `p[i]` of the file's). Found by processing the column of row indices;
    `ValueError` when the processor does anything but reorder rows (the tensor cannot stay
    quantized then). `transposed`: the processor must transpose the tensor and do nothing
    else (GPT-2's `Conv1D` weights, which keep the file's rows as a `QuantLinear`)."""
    index = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    out = process(processor, index.copy(), name)
    if transposed:
        if not np.array_equal(out, index.T):
            raise ValueError(f"the conversion of {name} is not a transposition")
        return None
    if out.shape != index.shape:
        raise ValueError(f"the conversion of {name} changes its shape")
    perm = out.reshape(-1)
    if np.array_equal(perm, index.reshape(-1)):
        return None
    if not np.array_equal(np.sort(perm), index.reshape(-1)):
        raise ValueError(f"the conversion of {name} changes its values")
    return perm.astype(np.int64)


def _meta(metadata: dict[str, Any], arch: str, key: str) -> Any:
    return metadata.get(f"{arch}.{key}")


#: metadata (`{arch}.` + key) llama.cpp requires of every supported architecture: a file
#: without it is refused, not run with transformers' default for it
_REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "attention.head_count")
#: the norm epsilon's key (required too), where it is not `attention.layer_norm_rms_epsilon`
_NORM_EPS_KEY = {"gpt2": "attention.layer_norm_epsilon",
                 "starcoder2": "attention.layer_norm_epsilon",
                 "nemotron": "attention.layer_norm_epsilon"}
#: architectures whose rotary embedding may turn only the head's first dimensions
#: (`rope.dimension_count` < head size: transformers' `partial_rotary_factor`)
_PARTIAL_ROPE = ("phi3", "nemotron")
#: metadata the mixtures of experts require besides (`{arch}.` + key): a `llama` file's
#: experts (Mixtral) are `feed_forward_length` wide
_MOE_KEYS = {"llama": ("expert_count", "expert_used_count")}
_MOE_KEYS_DEFAULT = ("expert_count", "expert_used_count", "expert_feed_forward_length")
_MOE_SHARED_KEYS = {"qwen2moe": ("expert_shared_feed_forward_length",)}


def is_moe(metadata: dict[str, Any], arch: str) -> bool:
    """Whether the file is a mixture of experts: Qwen2/3-MoE, gpt-oss, or a `llama` file
    with experts (Mixtral, as llama.cpp writes it)."""
    return arch in (*MOE_ARCHITECTURES, "gpt-oss") or (
        arch == "llama" and int(_meta(metadata, arch, "expert_count") or 0) > 0)


def moe_config(config: Any, metadata: dict[str, Any], arch: str) -> Any:
    """`config` itself, or for a `llama` file with experts the transformers Mixtral config
    of the same values (llama.cpp's Llama graph with experts: softmax over every expert, the
    top `expert_used_count` renormalized to sum 1, experts `feed_forward_length` wide, the
    whole context attended)."""
    if arch != "llama" or not is_moe(metadata, arch):
        return config
    values = {k: v for k, v in config.to_dict().items() if k not in ("architectures",
                                                                      "sliding_window")}
    return MixtralConfig.from_dict({
        **values, "model_type": "mixtral", "sliding_window": None, "router_jitter_noise": 0.0,
        "num_local_experts": int(_meta(metadata, arch, "expert_count")),
        "num_experts_per_tok": int(_meta(metadata, arch, "expert_used_count"))})


def refuse_metadata(metadata: dict[str, Any], arch: str, path: Any) -> None:
    """`FieldError` for required metadata that is missing, and for metadata that would
    change the computation and is not handled."""
    required = (*_REQUIRED_KEYS, _NORM_EPS_KEY.get(arch, "attention.layer_norm_rms_epsilon"))
    moe = is_moe(metadata, arch)
    if moe:
        required = (*required, *_MOE_KEYS.get(arch, _MOE_KEYS_DEFAULT),
                    *_MOE_SHARED_KEYS.get(arch, ()))
    missing = [f"{arch}.{key}" for key in required if _meta(metadata, arch, key) is None]
    if missing:
        raise FieldError(f"{path}: GGUF metadata lacks {', '.join(missing)} (required, as "
                         "llama.cpp requires it)", "model")
    for key in _REFUSED_KEYS:
        value = _meta(metadata, arch, key)
        if value is None or key == "expert_count" and (moe or value == 0):
            continue  # (experts: a MoE file's, or none)
        raise FieldError(f"{path}: GGUF metadata {arch}.{key} is not supported", "model")
    if moe:
        _refuse_routing(metadata, arch, path)
    scaling = _meta(metadata, arch, "rope.scaling.type")
    allowed = ("yarn",) if arch == "gpt-oss" else ("linear",)
    if scaling not in (None, "none", *allowed):
        raise FieldError(f"{path}: rope scaling {scaling!r} ({arch}.rope.scaling.type) is not "
                         f"supported for {arch} (only {allowed[0]})", "model")
    if arch == "gpt-oss":
        _refuse_gpt_oss(metadata, path)
    k, v = _meta(metadata, arch, "attention.key_length"), _meta(metadata, arch,
                                                                "attention.value_length")
    if k is not None and v is not None and k != v:
        raise FieldError(f"{path}: key length {k} != value length {v} is not supported", "model")


def _refuse_gpt_oss(metadata: dict[str, Any], path: Any) -> None:
    """`FieldError` for gpt-oss metadata transformers' model cannot compute: a separate rope
    base for the sliding layers, a YaRN log multiplier or extrapolation factor other than
    llama.cpp's defaults."""
    base = _meta(metadata, "gpt-oss", "rope.freq_base")
    swa_base = _meta(metadata, "gpt-oss", "rope.freq_base_swa")
    if swa_base is not None and (base is None or float(swa_base) != float(base)):
        raise FieldError(f"{path}: gpt-oss.rope.freq_base_swa {swa_base} != rope.freq_base "
                         f"{base} is not supported", "model")
    for key, default in (("rope.scaling.yarn_log_multiplier", 0.0),
                         ("rope.scaling.yarn_ext_factor", 1.0)):
        value = _meta(metadata, "gpt-oss", key)
        if value is not None and float(value) != default:
            raise FieldError(f"{path}: gpt-oss.{key} {value} is not supported", "model")


def _refuse_routing(metadata: dict[str, Any], arch: str, path: Any) -> None:
    """`FieldError` for routing metadata other than the softmax over all experts, top
    `expert_used_count`, unscaled, that llama.cpp's Qwen2/3-MoE graphs compute."""
    gating = _meta(metadata, arch, "expert_gating_func")
    if gating is not None and int(gating) != 1:  # llama.cpp: 1 softmax, 2 sigmoid
        raise FieldError(f"{path}: {arch}.expert_gating_func {gating} is not supported "
                         "(softmax only)", "model")
    scale = _meta(metadata, arch, "expert_weights_scale")
    if scale is not None and float(scale) not in (0.0, 1.0):
        raise FieldError(f"{path}: {arch}.expert_weights_scale {scale} is not supported",
                         "model")
    for key in ("expert_group_count", "expert_shared_count"):
        if _meta(metadata, arch, key) not in (None, 0, 1):
            raise FieldError(f"{path}: {arch}.{key} {_meta(metadata, arch, key)} is not "
                             "supported", "model")
    used, count = _meta(metadata, arch, "expert_used_count"), _meta(metadata, arch,
                                                                    "expert_count")
    if not 0 < int(used) <= int(count):
        raise FieldError(f"{path}: {arch}.expert_used_count {used} is not 1 .. expert_count "
                         f"({count})", "model")


def _longrope(config: Any, metadata: dict[str, Any], arch: str, path: Any,
              factors: tuple[list[float], list[float]], head_dim: int) -> None:
    """transformers' "longrope" rotary parameters from a Phi-3 file's factors and metadata.

    Which factors a token uses is transformers' rule (the request's length against the
    threshold, `ferrobatch.attention.rope`); llama.cpp picks one set for the whole context
    it was started with (long where that context exceeds the threshold)."""
    short, long = factors
    params = config.rope_parameters
    dims = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
    if len(short) != dims // 2 or len(long) != dims // 2:
        raise FieldError(f"{path}: rope_factors_short / rope_factors_long have {len(short)} / "
                         f"{len(long)} values, the rotary dimensions {dims} need {dims // 2}",
                         "model")
    context = int(_meta(metadata, arch, "context_length"))
    threshold = int(_meta(metadata, arch, "rope.scaling.original_context_length") or context)
    if not 0 < threshold <= context:
        raise FieldError(f"{path}: {arch}.rope.scaling.original_context_length {threshold} "
                         f"is not 1 .. context_length ({context})", "model")
    attn = float(_meta(metadata, arch, "rope.scaling.attn_factor") or 1.0)
    if not (math.isfinite(attn) and attn > 0):
        raise FieldError(f"{path}: {arch}.rope.scaling.attn_factor {attn} is not a positive "
                         "number", "model")
    params.update(rope_type="longrope", short_factor=list(short), long_factor=list(long),
                  original_max_position_embeddings=threshold, attention_factor=attn)
    config.original_max_position_embeddings = threshold
    config.max_position_embeddings = context


def _swa_layers(metadata: dict[str, Any], layers: int, path: Any) -> list[bool]:
    """Which layers attend through the sliding window, as llama.cpp reads a gpt-oss file:
    `attention.sliding_window_pattern` as one flag a layer, or a period `n` (layer `i`
    slides where `i % n < n - 1`, every layer where `n` is 0); 2 when absent."""
    pattern = _meta(metadata, "gpt-oss", "attention.sliding_window_pattern")
    if isinstance(pattern, list | tuple | np.ndarray):
        if len(pattern) != layers:
            raise FieldError(f"{path}: gpt-oss.attention.sliding_window_pattern has "
                             f"{len(pattern)} values for {layers} layers", "model")
        return [bool(x) for x in pattern]
    n = 2 if pattern is None else int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _gpt_oss(config: Any, metadata: dict[str, Any], path: Any) -> None:
    """gpt-oss's config from what llama.cpp writes: the experts' width, the sliding layers,
    YaRN (llama.cpp's defaults for the betas; the correction range not truncated, as the
    original model's config says: llama.cpp rounds it to whole dimensions), and the SwiGLU
    clamp (7.0) and slope (1.702), which llama.cpp's graph fixes and the file does not hold."""
    width = _meta(metadata, "gpt-oss", "expert_feed_forward_length")
    config.intermediate_size = int(width)
    window = _meta(metadata, "gpt-oss", "attention.sliding_window")
    if not window or int(window) <= 0:
        raise FieldError(f"{path}: gpt-oss.attention.sliding_window must be a positive "
                         f"number, not {window}", "model")
    config.sliding_window = int(window)
    slides = _swa_layers(metadata, int(config.num_hidden_layers), path)
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in slides]
    config.swiglu_limit, config.swiglu_alpha = 7.0, 1.702
    theta = float(_meta(metadata, "gpt-oss", "rope.freq_base") or 10000.0)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if _meta(metadata, "gpt-oss", "rope.scaling.type") == "yarn":
        context = int(_meta(metadata, "gpt-oss", "context_length"))
        params.update(
            rope_type="yarn",
            factor=float(_meta(metadata, "gpt-oss", "rope.scaling.factor") or 1.0),
            original_max_position_embeddings=int(_meta(
                metadata, "gpt-oss", "rope.scaling.original_context_length") or context),
            beta_fast=float(_meta(metadata, "gpt-oss", "rope.scaling.yarn_beta_fast") or 32.0),
            beta_slow=float(_meta(metadata, "gpt-oss", "rope.scaling.yarn_beta_slow") or 1.0),
            truncate=False)
        attn = _meta(metadata, "gpt-oss", "rope.scaling.yarn_attn_factor")
        if attn is not None:
            params["attention_factor"] = float(attn)
    config.rope_parameters = params


def fix_config(config: Any, metadata: dict[str, Any], arch: str, path: Any,
               rope_factors: tuple[list[float], list[float]] | None = None) -> None:
    """Metadata llama.cpp writes that transformers' GGUF mapping leaves out, applied to the
    transformers `config` so the model computes what llama.cpp computes from the same file:

    * `attention.key_length` -> `head_dim` (Qwen3 and others whose head size is not
      hidden / heads); where the config has no `head_dim`, it must equal hidden / heads;
    * `rope.dimension_count` below the head size: Phi-3's and Nemotron's
      `partial_rotary_factor`; elsewhere refused;
    * Phi-3 LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): `rope_factors` (the file's
      `rope_factors_short` / `rope_factors_long` tensors, read by the loader),
      `rope.scaling.original_context_length` (the threshold; the context length when absent)
      and `rope.scaling.attn_factor` (cos/sin scale; 1 when absent, as llama.cpp) make
      transformers' "longrope" parameters;
    * `rope.scaling.type` linear + `rope.scaling.factor` (Gemma 3: the global layers only, as
      llama.cpp);
    * Gemma 2: `attn_logit_softcapping`, `final_logit_softcapping`; Gemma 2 / 3:
      `query_pre_attn_scalar` as llama.cpp derives it (the head size, hidden / heads for the
      27B shapes);
    * GPT-2: `context_length` -> `n_positions`, `feed_forward_length` -> `n_inner`;
    * Nemotron: `attention.layer_norm_epsilon` -> `norm_eps` (transformers reads the RMS
      key, which llama.cpp does not write for it); its norm weights are stored plus one
      (layernorm1p as a plain LayerNorm), which transformers' tensor processor undoes;
    * Mistral (written as `llama`) and StarCoder2: no sliding window (llama.cpp attends over
      the whole context); Phi-3: `attention.sliding_window`;
    * StarCoder2: `rope.freq_base` -> `rope_theta` and `vocab_size` (transformers' mapping
      drops both);
    * gpt-oss: the experts' width, the sliding layers, YaRN and the SwiGLU constants
      (`_gpt_oss`);
    * Qwen2/3-MoE: `expert_feed_forward_length` -> `moe_intermediate_size` (Qwen2-MoE's
      `expert_shared_feed_forward_length` -> `shared_expert_intermediate_size`), every layer
      a MoE layer, and the top experts' weights renormalized to sum 1 for Qwen3-MoE, not for
      Qwen2-MoE (llama.cpp's graphs).
    """
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    key_length = _meta(metadata, arch, "attention.key_length")
    if key_length is not None:
        if hasattr(config, "head_dim"):
            config.head_dim = int(key_length)
        elif int(key_length) != hidden // heads:
            raise FieldError(f"{path}: head size {key_length} != hidden / heads "
                             f"({hidden // heads}) is not supported for {arch}", "model")
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    rope_dims = _meta(metadata, arch, "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        if arch in _PARTIAL_ROPE:
            config.rope_parameters["partial_rotary_factor"] = int(rope_dims) / head_dim
        else:
            raise FieldError(f"{path}: rotary dimensions {rope_dims} != head size {head_dim} "
                             f"is not supported for {arch}", "model")
    if rope_factors is not None:
        _longrope(config, metadata, arch, path, rope_factors, head_dim)
    elif float(_meta(metadata, arch, "rope.scaling.attn_factor") or 1.0) != 1.0:
        raise FieldError(f"{path}: {arch}.rope.scaling.attn_factor without LongRoPE factors is "
                         "not supported", "model")
    if _meta(metadata, arch, "rope.scaling.type") == "linear":
        factor = float(_meta(metadata, arch, "rope.scaling.factor") or 1.0)
        params = config.rope_parameters
        target = params.get("full_attention", params) if arch == "gemma3" else params
        if factor != 1.0:
            target.update(rope_type="linear", factor=factor)
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = _meta(metadata, arch, key)
            if value is not None:
                setattr(config, key, float(value))
    if arch in ("gemma2", "gemma3"):
        # llama.cpp (llama-model.cpp, f_attention_scale): 1/sqrt(hidden / heads) for the 27B
        # models (46 layers of 4608 for Gemma 2, 62 of 5376 for Gemma 3), else 1/sqrt(head size)
        big = (arch == "gemma2" and config.num_hidden_layers == 46 and hidden == 4608) or (
            arch == "gemma3" and config.num_hidden_layers == 62 and hidden == 5376)
        config.query_pre_attn_scalar = hidden // heads if big else head_dim
    if getattr(config, "model_type", None) == "mistral" or arch == "starcoder2":
        config.sliding_window = None
    if arch == "starcoder2":
        if _meta(metadata, arch, "rope.freq_base") is not None:
            config.rope_parameters["rope_theta"] = float(_meta(metadata, arch, "rope.freq_base"))
        if _meta(metadata, arch, "vocab_size") is not None:
            config.vocab_size = int(_meta(metadata, arch, "vocab_size"))
    if arch in MOE_ARCHITECTURES:
        config.moe_intermediate_size = int(_meta(metadata, arch, "expert_feed_forward_length"))
        config.decoder_sparse_step = 1
        config.mlp_only_layers = []
        config.norm_topk_prob = arch == "qwen3moe"
        if arch == "qwen2moe":
            config.shared_expert_intermediate_size = int(
                _meta(metadata, arch, "expert_shared_feed_forward_length"))
    if arch == "gpt-oss":
        _gpt_oss(config, metadata, path)
    if arch == "phi3":
        window = _meta(metadata, arch, "attention.sliding_window")
        config.sliding_window = int(window) if window else None
    if arch == "nemotron":
        config.norm_eps = float(_meta(metadata, arch, "attention.layer_norm_epsilon"))
    if arch == "gpt2":  # transformers maps these onto names GPT2Config does not read
        if _meta(metadata, arch, "context_length") is not None:
            config.n_positions = int(_meta(metadata, arch, "context_length"))
        if _meta(metadata, arch, "feed_forward_length") is not None:
            config.n_inner = int(_meta(metadata, arch, "feed_forward_length"))
    if not math.isfinite(float(getattr(config, "rms_norm_eps", 1e-6) or 1e-6)):
        raise FieldError(f"{path}: rms_norm_eps is not finite", "model")
