"""Write a Hugging Face checkpoint directory with a real model's shapes and random bf16
weights, for quantize-on-load's memory and time at sizes no checkpoint here has (an
8B-shaped Llama). One safetensors shard a decoder layer, generated and written one at a
time (memory stays flat); no tokenizer. The shapes are `synthetic_gguf.SHAPES`.

    python benches/synthetic_checkpoint.py llama-3-8b /tmp/llama8b-bf16
    python benches/gguf_quality.py /tmp/llama8b-bf16 --quantization q4_k --load-only --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from synthetic_gguf import SHAPES, Shape

CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}


def config(shape: Shape, vocab: int) -> transformers.PretrainedConfig:
    """The checkpoint's config (bf16, the shape's sizes)."""
    return getattr(transformers, CONFIGS[shape.arch])(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, rope_theta=shape.rope_base,
        tie_word_embeddings=shape.tied, dtype="bfloat16", bos_token_id=1, eos_token_id=2)


def layer_tensors(shape: Shape, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Decoder layer `i`'s tensors, random bf16 (matrices of order 1e-2, norms near 1)."""
    head = shape.hidden // shape.heads
    kv = shape.kv_heads * head
    p = f"model.layers.{i}."
    sizes = {"self_attn.q_proj": (shape.hidden, shape.hidden),
             "self_attn.k_proj": (kv, shape.hidden), "self_attn.v_proj": (kv, shape.hidden),
             "self_attn.o_proj": (shape.hidden, shape.hidden),
             "mlp.gate_proj": (shape.ffn, shape.hidden), "mlp.up_proj": (shape.ffn, shape.hidden),
             "mlp.down_proj": (shape.hidden, shape.ffn)}
    out = {f"{p}{name}.weight": 0.02 * torch.randn(*size, generator=gen)
           for name, size in sizes.items()}
    if shape.qkv_bias:
        for name, size in sizes.items():
            if name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                out[f"{p}{name}.bias"] = 0.02 * torch.randn(size[0], generator=gen)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{p}{norm}.weight"] = 1 + 0.05 * torch.randn(shape.hidden, generator=gen)
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    shape, start = SHAPES[args.shape], time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    config(shape, args.vocab).save_pretrained(args.out)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [
        {"model.embed_tokens.weight": 0.02 * torch.randn(args.vocab, shape.hidden, generator=gen),
         "model.norm.weight": 1 + 0.05 * torch.randn(shape.hidden, generator=gen)}]
    if not shape.tied:
        shards[0]["lm_head.weight"] = 0.02 * torch.randn(args.vocab, shape.hidden, generator=gen)
    weight_map, total = {}, 0
    for s in range(shape.layers + 1):
        tensors = ({k: v.to(torch.bfloat16) for k, v in shards[0].items()} if s == 0
                   else layer_tensors(shape, s - 1, gen))
        name = f"model-{s:05d}-of-{shape.layers + 1:05d}.safetensors"
        save_file(tensors, str(args.out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        if s == 0:
            shards.clear()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"{args.out}: {total / 1e9:.2f} GB of bf16 weights in {shape.layers + 1} shards "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
