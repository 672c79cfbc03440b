"""Tiny GGUF files written the way llama.cpp's `convert_hf_to_gguf.py` writes them, from tiny
random transformers models, with every matrix of a chosen type.

`write_gguf` returns the file and the *reference* weights: for every parameter of the
source model, exactly the values the file holds (dequantized with `gguf.quants`, back in the
transformers layout), so `reference_model` (the source model with those weights, fp32) is
the oracle "gguf.quants.dequantize + fp32 forward". gguf-py quantizes Q8_0 / Q4_0 / Q4_1 /
Q5_0 / Q5_1; IQ4_NL matrices are quantized here (nearest table value, `quantize_iq4_nl`);
K-type (and IQ4_XS) matrices are random blocks with small fp16 scales. `k_m_types` names the
tensors a llama.cpp `Q4_K_M` / `Q5_K_M` file gives more bits, and `LLAMA_CPP_FALLBACK` the
types its quantizer falls back to for rows that are not whole 256-weight blocks.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

K_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")
QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "Q3_K",
          "Q2_K", "IQ4_XS")
#: llama.cpp's type for a matrix whose rows are not whole blocks of the type it asked for
#: (`llama_tensor_get_type`'s fallback; any other type: Q8_0 here)
LLAMA_CPP_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "IQ4_NL",
                      "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}

# config of the tiny models: widths that are whole K-type blocks (256)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)

# GGUF arch -> (config class, model class, config overrides)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=64, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(head_dim=64, sliding_window=None, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # head size 32 (not hidden / heads = 64, nor Qwen3Config's default 128): key_length
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=64, sliding_window=8, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, query_pre_attn_scalar=64,
                    tie_word_embeddings=True)),
    # llama.cpp's Gemma 3 layers: every sixth full attention, the others sliding
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=64, sliding_window=8, query_pre_attn_scalar=64,
                    tie_word_embeddings=True, num_hidden_layers=6)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    # LayerNorm1P with biases, squared-ReLU MLP (up / down, no gate), rope on the first
    # half of each head (llama.cpp: `rope.dimension_count`), a norm epsilon off the default
    "nemotron": ("NemotronConfig", "NemotronForCausalLM",
                 dict(head_dim=64, norm_eps=1e-4, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5})),
    # Conv1D linears (weights [in, out]), learned positions, LayerNorm with biases
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_inner=512, tie_word_embeddings=True)),
    # LayerNorm and every linear with biases, an ungated GELU MLP (c_fc / c_proj), rope theta
    # off its config default; llama.cpp attends over the whole context (no sliding window)
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
                   dict(norm_epsilon=1e-5, use_bias=True, sliding_window=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                        tie_word_embeddings=True)),
    # mixtures of experts: 4 experts, 2 a token (Qwen3-MoE renormalizes their weights,
    # Qwen2-MoE does not and adds a gated shared expert), as llama.cpp computes them
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                      norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512, norm_topk_prob=False,
                      tie_word_embeddings=False)),
    # Mixtral: a `llama` file with experts (their width `feed_forward_length`), top-2 of 4
    # renormalized
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                     tie_word_embeddings=False)),
    # gpt-oss: attention sinks, every other layer sliding, YaRN, biases everywhere, 4 experts
    # (2 a token) with biases and the clamped SwiGLU
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                     intermediate_size=256, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                      "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False,
                                      "original_max_position_embeddings": 64})),
}
#: GGUF architecture -> transformers' model type, where they differ
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss"}
#: architectures whose norm weights llama.cpp stores plus one
_NORM_PLUS_ONE = ("gemma2", "gemma3", "nemotron")
#: the test architectures llama.cpp writes as `llama`
_LLAMA_FILES = ("mistral", "mixtral")
#: GPT-2's Conv1D weights, which llama.cpp writes transposed (as [out, in] rows)
_CONV1D = (".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight", ".ffn_down.weight")


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A random fp32 model of `arch` (a key of `ARCHS`), norms perturbed off their init."""
    cfg_name, cls_name, extra = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval().float()
    with torch.no_grad():  # norms of 1 (or 0 for Gemma) would hide a wrong offset
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (HF rotate-half rows -> interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _random_k_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)

    def f16(x: np.ndarray) -> np.ndarray:
        return x.astype(np.float16)[..., None].view(np.uint8)

    d = (rng.random((n, k // block)) + 0.25) * 3e-4
    if qtype in ("Q4_K", "Q5_K"):
        # value d*sc*q - dmin*m, sc, m ~ U(0..63), q ~ U(0..15 or 31): dmin = mean(q) * d
        # centres the weights on 0
        blocks[..., 0:2] = f16(d)
        blocks[..., 2:4] = f16(d * (7.5 if qtype == "Q4_K" else 15.5))
    elif qtype == "Q6_K":  # ql[128] qh[64] scales int8[16] d fp16; value d*sc*(q-32)
        blocks[..., 208:210] = f16(d / 10)
    elif qtype == "Q3_K":  # hmask[32] qs[64] scales[12] d; value d*(sc-32)*(q-4..3)
        blocks[..., 108:110] = f16(3 * d)
    elif qtype == "Q2_K":  # scales[16] qs[64] d dmin; value d*sc*q - dmin*m, q ~ U(0..3)
        blocks[..., 80:82] = f16(20 * d)
        blocks[..., 82:84] = f16(30 * d)
    else:  # IQ4_XS: d scales_h scales_l[4] qs[128]; value d*(ls-32)*kvalues[q]
        blocks[..., 0:2] = f16(d / 10)
    return blocks.reshape(n, k // block * size)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """Float rows [n, k] as IQ4_NL blocks: per 32 weights `d` = the value of largest
    magnitude / -127 (fp16), each weight the table index nearest `w / d`."""
    n, k = x.shape
    values = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    b = x.reshape(n, k // 32, 32).astype(np.float32)
    big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    d = (big / -127).astype(np.float16)
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d.astype(np.float32)))
    idx = np.abs((b * inv)[..., None] - values).argmin(-1).astype(np.uint8)
    qs = idx[..., :16] | (idx[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8), qs], -1).reshape(n, -1)


def k_m_types(config: Any, base: str = "Q4_K") -> dict[str, str]:
    """The types llama.cpp's `Q4_K_M` (`base` Q4_K) or `Q5_K_M` (Q5_K) gives the GGUF
    tensors that get more bits: the output head, and attn_v / ffn_down of every other layer
    Q6_K (its `use_more_bits` in a small model); the rest are `base`."""
    types = {"output.weight": "Q6_K"}
    for i in range(0, config.num_hidden_layers, 2):
        types[f"blk.{i}.attn_v.weight"] = "Q6_K"
        types[f"blk.{i}.ffn_down.weight"] = "Q6_K"
    return types


@dataclass
class Written:
    path: Path
    reference: dict[str, torch.Tensor]  # HF name -> the values the file holds (fp32)
    types: dict[str, str]  # GGUF tensor name -> type written


def write_gguf(path: Path, model: transformers.PreTrainedModel, arch: str, qtype: str = "Q8_0",
               *, seed: int = 0, name: str | None = None, tokenizer: bool = False,
               embed_qtype: str | None = None, output_qtype: str | None = None,
               types: dict[str, str] | None = None, rope_freqs: np.ndarray | None = None,
               extra_metadata: dict[str, Any] | None = None,
               metadata: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
               extra_tensors: dict[str, np.ndarray] | None = None,
               fallback: dict[str, str] | None = None,
               drop_metadata: tuple[str, ...] = (), split_max_tensors: int = 0,
               small_first_shard: bool = False) -> Written:
    """Write `model` as llama.cpp would (GGUF architecture `arch`: "mistral" is written as
    "llama" named "mistral", as transformers recognises it). Matrices of `qtype` (the token
    embedding `embed_qtype`, the output head `output_qtype`, any GGUF tensor named in `types`
    its own), vectors F32. `metadata` replaces the config's values of the standard keys
    (`feed_forward_length`, ...: a file whose metadata and tensors disagree), and
    `drop_metadata` leaves keys out; `drop` leaves GGUF tensors out, `extra_tensors` adds
    F32 ones. A matrix whose rows are not whole blocks
    of its type is written as `fallback[type]` (`LLAMA_CPP_FALLBACK`: as llama.cpp), else
    Q8_0. `split_max_tensors` writes a split file as llama.cpp's converter does (shards
    `STEM-0000i-of-0000n.gguf` beside `path`; `small_first_shard`: the first one holds the
    metadata alone); `Written.path` is then the first shard."""
    lie = metadata or {}
    rng = np.random.default_rng(seed)
    cfg = model.config
    file_arch = "llama" if arch in _LLAMA_FILES else arch
    w = gguf.GGUFWriter(str(path), file_arch, split_max_tensors=split_max_tensors,
                        small_first_shard=small_first_shard)
    w.add_name(name or ("mistral" if arch == "mistral" else f"tiny-{arch}"))
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    gpt2 = arch == "gpt2"
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(lie.get("feed_forward_length",
                                      cfg.n_inner if gpt2 else cfg.intermediate_size))
    w.add_head_count(heads)
    if gpt2:
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        tokenizer = True  # (transformers takes GPT-2's vocabulary size from the tokens)
    else:
        w.add_head_count_kv(kv)
        if arch == "starcoder2":  # LayerNorm, its epsilon `norm_epsilon`
            w.add_layer_norm_eps(cfg.norm_epsilon)
        elif arch == "nemotron":  # LayerNorm1P, `norm_eps`
            w.add_layer_norm_eps(cfg.norm_eps)
        else:
            w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        theta = cfg.rope_parameters.get("rope_theta") if "rope_theta" in cfg.rope_parameters \
            else cfg.rope_parameters["full_attention"]["rope_theta"]
        w.add_rope_freq_base(theta)
    w.add_vocab_size(cfg.vocab_size)
    if file_arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "nemotron":  # (llama.cpp's converter: the rotated share of the hidden width)
        partial = cfg.rope_parameters["partial_rotary_factor"]
        w.add_rope_dimension_count(int(partial * cfg.hidden_size) // heads)
    if arch in ("qwen3", "gemma2", "gemma3", "qwen3moe"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "mixtral":  # (the experts' width: feed_forward_length)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "gpt-oss":  # (llama.cpp's converter: experts, window, YaRN)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        rope = cfg.rope_parameters
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif arch in MODEL_TYPES:  # (llama.cpp's MoE keys)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    long_rope = _long_rope(cfg) if arch == "phi3" else None
    if long_rope is not None:  # (llama.cpp's Phi-3 LongRoPE: the factors are tensors)
        w.add_rope_scaling_orig_ctx_len(long_rope["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(long_rope["attn_factor"])
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for kv_data in w.kv_data:
        for key in drop_metadata:
            kv_data.pop(key, None)
    if tokenizer:
        add_tiny_tokenizer(w, cfg.vocab_size)
    else:  # the special ids alone (as a file whose tokenizer transformers cannot convert)
        w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_id)
        w.add_pad_token_id(cfg.pad_token_id)

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == file_arch)
    name_map = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    tied = getattr(cfg, "tie_word_embeddings", False)
    reference: dict[str, torch.Tensor] = {}
    written: dict[str, str] = {}
    for hf_name, x, gname in _gguf_tensors(model, name_map, tied):
        if gname in drop:
            continue
        perm = None
        if file_arch == "llama" and gname.endswith(".weight") and (".attn_q." in gname
                                                            or ".attn_k." in gname):
            n_kv = heads if ".attn_q." in gname else kv
            x = _permute(x, heads, n_kv)
            perm = np.argsort(_permute(np.arange(x.shape[0])[:, None], heads, n_kv)[:, 0])
        if arch in _NORM_PLUS_ONE and gname.endswith("norm.weight"):
            x = (x + 1).astype(np.float32)
        conv1d = gpt2 and gname.endswith(_CONV1D)
        if conv1d:
            x = np.ascontiguousarray(x.T)
        t = (types or {}).get(gname)
        if gname.endswith((".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".bias")):
            t = t or "F32"  # (llama.cpp keeps the routers and the biases in floats)
        if t is None and x.ndim >= 2:
            t = embed_qtype if gname == "token_embd.weight" and embed_qtype else \
                output_qtype if gname == "output.weight" and output_qtype else qtype
        t = t or "F32"
        if t not in ("F32", "F16", "BF16") and \
                x.shape[1] % GGML_QUANT_SIZES[GGMLQuantizationType[t]][0]:
            t = (fallback or {}).get(t, "Q8_0")  # rows that are not whole blocks
        gtype = GGMLQuantizationType[t]
        if t == "F32":
            data, values = x.astype(np.float32), x.astype(np.float32)
            w.add_tensor(gname, data)
        elif t == "F16":
            data = x.astype(np.float16)
            values = data.astype(np.float32)
            w.add_tensor(gname, data)
        elif t == "BF16":
            bf = torch.from_numpy(x).to(torch.bfloat16)
            data = bf.view(torch.uint8).numpy()
            values = bf.float().numpy()
            w.add_tensor(gname, data, raw_dtype=gtype)
        else:
            *lead, k = x.shape  # (an experts tensor: [experts, rows, k])
            n = int(np.prod(lead))
            flat = x.reshape(n, k)
            data = _random_k_blocks(t, n, k, rng) if t in K_TYPES else \
                quantize_iq4_nl(flat) if t == "IQ4_NL" else quantize(flat, gtype)
            values = dequantize(data, gtype).reshape(x.shape)
            w.add_tensor(gname, data.reshape(*lead, -1), raw_dtype=gtype)
        if perm is not None:
            values = values[perm]
        if conv1d:
            values = values.T
        if arch in _NORM_PLUS_ONE and gname.endswith("norm.weight"):
            values = values - 1
        ref = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        if gname.endswith(".ffn_gate_inp_shexp.weight"):
            ref = ref.reshape(1, -1)
        if arch == "gpt-oss" and ".ffn_" in gname and "_exps." in gname:
            # gpt-oss's fused experts: x @ W layouts, gate and up interleaved
            part = 1 if ".ffn_up_exps." in gname else 0
            value = ref.transpose(-1, -2) if ref.dim() == 3 else ref
            if ".ffn_down_exps." in gname:
                reference[hf_name] = value.contiguous()
            else:
                shape = (*value.shape[:-1], 2 * value.shape[-1])
                whole = reference.setdefault(hf_name, torch.zeros(shape))
                whole[..., part::2] = value
            written[gname] = t
            continue
        if gname.endswith((".ffn_gate_exps.weight", ".ffn_up_exps.weight")):
            # gate and up side by side per expert in the model's fused gate_up_proj
            part = 0 if ".ffn_gate_exps." in gname else 1
            experts, rows, cols = ref.shape
            whole = reference.setdefault(hf_name, torch.zeros(experts, 2 * rows, cols))
            whole[:, part * rows:(part + 1) * rows] = ref
            written[gname] = t
            continue
        reference[hf_name] = ref
        if tied and hf_name == "model.embed_tokens.weight":
            reference["lm_head.weight"] = ref
        written[gname] = t
    for gname, x in (extra_tensors or {}).items():
        w.add_tensor(gname, x.astype(np.float32))
        written[gname] = "F32"
    if long_rope is not None:
        for kind in ("short", "long"):
            factors = np.asarray(long_rope[f"{kind}_factor"], np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
            written[f"rope_factors_{kind}.weight"] = "F32"
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
        written["rope_freqs.weight"] = "F32"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Written(w.format_shard_names(Path(path))[0], reference, written)


def _long_rope(cfg: Any) -> dict[str, Any] | None:
    """A Phi-3 config's LongRoPE parameters as llama.cpp's converter writes them (its
    attention factor computed from the context lengths as the converter does), or None."""
    params = cfg.rope_parameters
    if params.get("rope_type") != "longrope" or not params.get("long_factor"):
        return None
    orig = params["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / orig
    attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    return {**params, "original_max_position_embeddings": orig, "attn_factor": attn}


def _gguf_tensors(model: transformers.PreTrainedModel, name_map: Any,
                  tied: bool) -> list[tuple[str, np.ndarray, str]]:
    """(parameter name, values, GGUF tensor name) of every tensor llama.cpp writes of
    `model` (a `tied` output head: none): a fused experts `gate_up_proj` [E, 2 I, H] is two
    tensors, `ffn_gate_exps` and `ffn_up_exps` [E, I, H]; Qwen2-MoE's shared expert gate
    [1, H] a vector."""
    out = []
    for hf_name, param in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        x = param.detach().float().numpy().copy()
        base, suffix = hf_name.rsplit(".", 1)
        blk = f"blk.{hf_name.split('.')[2]}" if hf_name.startswith("model.layers.") else ""
        if suffix == "sinks":  # (gpt-oss's attention sinks)
            out.append((hf_name, x, f"{blk}.attn_sinks.weight"))
            continue
        if base.endswith(".mlp.experts") and model.config.model_type == "gpt_oss":
            out.extend(_oss_experts(hf_name, x, blk, suffix))
            continue
        if base.endswith(".mlp.experts"):
            if suffix == "gate_up_proj":
                rows = x.shape[1] // 2
                out.append((hf_name, x[:, :rows].copy(), f"{blk}.ffn_gate_exps.weight"))
                out.append((hf_name, x[:, rows:].copy(), f"{blk}.ffn_up_exps.weight"))
            else:
                out.append((hf_name, x, f"{blk}.ffn_down_exps.weight"))
            continue
        gname = name_map.get_name(base)
        assert gname is not None, hf_name
        if gname.endswith("ffn_gate_inp_shexp"):
            x = x.reshape(-1)
        out.append((hf_name, x, f"{gname}.{suffix}"))
    return out


def _oss_experts(hf_name: str, x: np.ndarray, blk: str,
                 suffix: str) -> list[tuple[str, np.ndarray, str]]:
    """gpt-oss's fused expert tensors as llama.cpp's converter writes them: `gate_up_proj`
    [E, H, 2 I] (gate and up interleaved) as `ffn_gate_exps` / `ffn_up_exps` [E, I, H],
    `down_proj` [E, I, H] as `ffn_down_exps` [E, H, I], the biases split the same way."""
    if suffix == "gate_up_proj":
        x = np.swapaxes(x, 1, 2)  # [E, 2 I, H], rows interleaved
        return [(hf_name, x[:, 0::2].copy(), f"{blk}.ffn_gate_exps.weight"),
                (hf_name, x[:, 1::2].copy(), f"{blk}.ffn_up_exps.weight")]
    if suffix == "gate_up_proj_bias":
        return [(hf_name, x[:, 0::2].copy(), f"{blk}.ffn_gate_exps.bias"),
                (hf_name, x[:, 1::2].copy(), f"{blk}.ffn_up_exps.bias")]
    if suffix == "down_proj":
        return [(hf_name, np.swapaxes(x, 1, 2).copy(), f"{blk}.ffn_down_exps.weight")]
    return [(hf_name, x, f"{blk}.ffn_down_exps.bias")]


def reference_model(model: transformers.PreTrainedModel,
                    written: Written) -> transformers.PreTrainedModel:
    """`model` (deep-copied) with the file's values: the oracle of a loaded file."""
    ref = copy.deepcopy(model)
    missing, unexpected = ref.load_state_dict(written.reference, strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing
    return ref.eval()


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet (the byte-level BPE tokens of every byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def add_tiny_tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary of `vocab` tokens (bytes, a few merges, specials at 0-2
    and 509-511... ), a chat template, BOS 1 / EOS 2."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    assert len(tokens) == vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (vocab - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def assert_greedy_as_generate(engine: Any, prompts: list[list[int]], new: int = 8) -> None:
    """Each prompt's engine tokens, batched with the others and then alone, equal the greedy
    `generate` of the engine's own model on that prompt alone."""
    from ferrobatch import SamplingParams

    params = SamplingParams(max_new_tokens=new)
    together = engine.generate(prompts, params, progress=False)
    for prompt, out in zip(prompts, together, strict=True):
        with torch.inference_mode():
            own = engine.model.generate(torch.tensor([prompt]), max_new_tokens=new,
                                        do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == own, prompt
        assert engine.generate([prompt], params, progress=False)[0].token_ids == own


def assert_plan_refused(path: Path, match: str) -> None:
    """`loader.plan(path)` raises a `FieldError` on field "model" matching `match`."""
    import pytest
    from ferrobatch.errors import FieldError
    from ferrobatch.gguf import loader

    with pytest.raises(FieldError, match=match) as err:
        loader.plan(path)
    assert err.value.field == "model"
