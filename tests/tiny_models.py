"""Tiny random-init causal LMs (fp32, fixed seed) for the runner and engine tests.

Every builder returns a model in eval mode whose attention type per layer exercises one
case of ARCHITECTURE.md §3: full attention, sliding window on every layer, hybrid
sliding/full layers, GQA, attention and final logit softcapping, learned positions.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import transformers
from ferrobatch.workloads import tiny_llama_model
from transformers import PreTrainedModel

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _build(cls_name: str, config_name: str, seed: int, **overrides) -> PreTrainedModel:
    kwargs = {**COMMON, **overrides}
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config)
    return model.eval().to(torch.float32)


def llama(seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Llama, full attention, GQA 4/2 (``overrides``: other config fields)."""
    return _build("LlamaForCausalLM", "LlamaConfig", seed, **overrides)


def qwen3(seed: int = 0) -> PreTrainedModel:
    """Qwen3 (q/k norms), full attention, 3 layers."""
    return _build("Qwen3ForCausalLM", "Qwen3Config", seed, num_hidden_layers=3, head_dim=16)


def mistral(seed: int = 0) -> PreTrainedModel:
    """Mistral: sliding window 12 on every layer."""
    return _build("MistralForCausalLM", "MistralConfig", seed, sliding_window=12)


def qwen2_sliding(seed: int = 0) -> PreTrainedModel:
    """Qwen2 with a sliding window of 10 on layers >= 1 (layer 0 full)."""
    return _build(
        "Qwen2ForCausalLM", "Qwen2Config", seed, num_hidden_layers=3,
        use_sliding_window=True, sliding_window=10, max_window_layers=1,
    )


def gemma2(seed: int = 0) -> PreTrainedModel:
    """Gemma2: alternating sliding (8) / full layers, attention and final softcapping."""
    return _build(
        "Gemma2ForCausalLM", "Gemma2Config", seed, num_hidden_layers=4, head_dim=16,
        sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=16, tie_word_embeddings=True,
    )


def gemma3(seed: int = 0) -> PreTrainedModel:
    """Gemma3 text: hybrid layer_types (sliding 16 / full), q/k norms, local/global rope."""
    return _build(
        "Gemma3ForCausalLM", "Gemma3TextConfig", seed, num_hidden_layers=4, head_dim=16,
        sliding_window=16, query_pre_attn_scalar=16, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )


def gemma(seed: int = 0) -> PreTrainedModel:
    """Gemma (the first): `1 + w` norms, the GELU-tanh gate, no sandwich norms."""
    return _build("GemmaForCausalLM", "GemmaConfig", seed, head_dim=16,
                  tie_word_embeddings=True)


def phi4_mini(seed: int = 0) -> PreTrainedModel:
    """Phi-3 layers with Phi-4-mini's rotary embedding over 3/4 of each head."""
    return _build("Phi3ForCausalLM", "Phi3Config", seed, partial_rotary_factor=0.75,
                  tie_word_embeddings=False)


def gpt2(seed: int = 0) -> PreTrainedModel:
    """GPT-2: learned positions, MHA, Conv1D projections."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval().to(torch.float32)


BUILDERS: dict[str, Callable[..., PreTrainedModel]] = {
    "llama": llama,
    "qwen3": qwen3,
    "mistral": mistral,
    "qwen2_sliding": qwen2_sliding,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "gpt2": gpt2,
}


def bench_llama(seed: int = 0) -> PreTrainedModel:
    """The tiny-llama benchmark model: hidden 256, 4 layers, 4/2 heads, vocab 32000."""
    return tiny_llama_model(seed)


def transformers_cb_config(**fields: Any) -> Any:
    """A `transformers.ContinuousBatchingConfig` with `page_size` given under whichever name
    this transformers release uses (`page_size` since 5.2x, `block_size` in 5.17)."""
    import inspect

    params = inspect.signature(transformers.ContinuousBatchingConfig.__init__).parameters
    if "page_size" in fields and "page_size" not in params:
        fields["block_size"] = fields.pop("page_size")
    return transformers.ContinuousBatchingConfig(**fields)


def generate_greedy(model: PreTrainedModel, prompt: list[int], new: int, *,
                    ignore_eos: bool = False) -> list[int]:
    """The correctness oracle: `model.generate`'s greedy continuation of `prompt` alone (at
    most `new` tokens; it stops at EOS unless `ignore_eos`)."""
    stop = dict(min_new_tokens=new, eos_token_id=None) if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=0, **stop)
    return out[0, len(prompt):].tolist()


def random_prompts(seed: int, n: int, lo: int, hi: int, vocab: int = VOCAB) -> list[list[int]]:
    """`n` prompts of `lo .. hi` random token ids in `3 .. vocab`, from `random.Random(seed)`."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


#: engine configurations (`ContinuousBatchingConfig` fields) that exercise each scheduling
#: mode: chunked prefill, preemption, CPU offload, shared prompt prefixes
SCHEDULING_SETUPS: dict[str, dict[str, Any]] = {
    "default": dict(),
    "chunked": dict(max_batch_tokens=16),
    "preempt": dict(num_blocks=24, page_size=4),
    "offload": dict(num_blocks=24, page_size=4, cpu_offload_space=0.01),
    "prefix": dict(),
}


def bf16_quality_case(setup: str, new: int = 16
                      ) -> tuple[PreTrainedModel, list[list[int]], list[list[int]]]:
    """A bf16 tiny Llama, prompts for scheduling `setup` (enough requests that one near-tie
    is not the verdict; "prefix": all sharing 12 tokens) and the fp32 model's greedy
    `new`-token references for them."""
    fp32 = llama(seed=3)
    bf16 = llama(seed=3).to(torch.bfloat16)
    prompts = random_prompts(11, 60, 4, 20)
    if setup == "prefix":
        prompts = [prompts[0][:12] + p for p in prompts]
    ref = [generate_greedy(fp32, p, new, ignore_eos=True) for p in prompts]
    return bf16, prompts, ref


def mixed_prompts(seed: int, n: int = 7, shared_prefix: int = 0) -> tuple[tuple[int, ...], ...]:
    """Mixed lengths (1 .. 57 tokens), or `shared_prefix` tokens in common and 1 .. 20 more."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        length = [1, 2, 7, 8, 9, 23, 40, 57][i % 8] if not shared_prefix else rng.randint(1, 20)
        out.append(tuple(prefix + [rng.randrange(3, VOCAB) for _ in range(length)]))
    return tuple(out)
