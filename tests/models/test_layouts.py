"""Attention layout from what the model's forward does: a `sliding_window` the
architecture never reads is ignored, one it applies through its mask only is kept; per-layer
sizes (Gemma3n) are sized; per-layer or grouped KV shapes (MiMo-V2-Flash, JetMoe) and
Llama-4's attention temperature tuning are refused at construction, naming the feature.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.engine import memory
from ferrobatch.models import attention_layout, layer_types_of
from tiny_models import COMMON, VOCAB, generate_greedy

torch.set_num_threads(1)

NEW = 10


def _build(prefix: str, *, cls: str | None = None, **overrides):
    kwargs = {**COMMON, "initializer_range": 0.2, "max_position_embeddings": 256, **overrides}
    config = getattr(transformers, prefix + "Config")(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, cls or prefix + "ForCausalLM")(config).eval()


def _generate_no_cache(m, prompt: list[int]) -> list[int]:
    """The model's own greedy answer: every step a full forward, no cache."""
    with torch.inference_mode():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, use_cache=False)
    return out[0, len(prompt):].tolist()


def _engine_tokens(m, prompts, **cfg):
    config = ContinuousBatchingConfig(page_size=8, **{"num_blocks": 128, **cfg})
    with Engine(m, config=config) as eng:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=NEW), progress=False)
        layer_types = eng.layer_types
    return [o.token_ids for o in outs], layer_types


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("prefix", ["Llama", "Gemma"])
def test_a_sliding_window_the_architecture_ignores_is_not_applied(prefix: str, window: int):
    """Llama and Gemma never read `sliding_window`: full attention, the model's answer.
    (`generate` with its cache keeps only the last window-1 keys of such a config in
    `DynamicCache`, so its decode differs from the model's own forward; ferrobatch gives the
    forward's answer, i.e. `generate(use_cache=False)`, and the same first token as
    `generate`.)"""
    m = _build(prefix, sliding_window=window, **({"head_dim": 16} if prefix == "Gemma" else {}))
    assert layer_types_of(m.config)[0] == "sliding_attention"  # what the config declares
    assert layer_types_of(m) == ["full_attention"] * 2  # what the model does
    prompts = _prompts(window, [20, 5, 33])
    for cfg in ({}, dict(max_batch_tokens=8)):
        got, types = _engine_tokens(m, prompts, **cfg)
        assert types == ["full_attention"] * 2
        for p, toks in zip(prompts, got, strict=True):
            assert toks == _generate_no_cache(m, p), f"{prefix} w={window} {len(p)} {cfg}"
            assert toks[0] == generate_greedy(m, p, 1)[0]


def test_a_window_applied_through_the_mask_only_is_kept() -> None:
    """PhiMoE applies `sliding_window` through its mask, not the attention keyword."""
    m = _build("Phimoe", num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    layout = attention_layout(m)
    assert layout.recorded
    assert layout.layer_types == ("sliding_attention",) * 2 and layout.sliding_window == 8
    prompts = _prompts(1, [20, 5, 13])
    got, _ = _engine_tokens(m, prompts, max_batch_tokens=8)
    for p, toks in zip(prompts, got, strict=True):
        assert toks == generate_greedy(m, p, NEW)


def test_declared_windows_that_are_used_are_kept() -> None:
    """Mistral (keyword + mask on every layer), Qwen2 (max_window_layers), Gemma3 (hybrid)."""
    m = _build("Mistral", sliding_window=12)
    assert attention_layout(m).layer_types == ("sliding_attention",) * 2
    q = _build("Qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=10,
               max_window_layers=1)
    assert attention_layout(q).layer_types == ("full_attention",) + ("sliding_attention",) * 2
    g = _build("Gemma3Text", cls="Gemma3ForCausalLM", num_hidden_layers=2, head_dim=16,
               sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    assert attention_layout(g).layer_types == ("sliding_attention", "full_attention")
    assert attention_layout(g).sliding_window == 16


def _gemma3n():
    cfg = transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64,
        hidden_size_per_layer_input=8, intermediate_size=[128, 96, 128, 112],
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
        num_kv_shared_layers=2, laurel_rank=4, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4, max_position_embeddings=256,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.Gemma3nForCausalLM(cfg).eval()


def test_per_layer_sizes_are_sized() -> None:
    """Gemma3n's per-layer `intermediate_size` list: sizing counts the widest layer."""
    m = _gemma3n()
    shape = memory._Shape.of(m.config)
    assert shape.intermediate == 128
    num, why = memory.choose_num_blocks(m, page_size=8, max_batch_tokens=64,
                                        max_requests_per_batch=4, free_bytes=1 << 30)
    assert num > 4 and "num_blocks" in why


@pytest.mark.parametrize("cfg", [
    {}, dict(max_batch_tokens=8), dict(num_blocks=None, max_batch_tokens=16),
    dict(num_blocks=12, max_batch_tokens=16), dict(num_blocks=12, cpu_offload_space=0.01),
])
def test_gemma3n_matches_generate(cfg: dict) -> None:
    m = _gemma3n()
    prompts = _prompts(3, [20, 5, 33])
    got, types = _engine_tokens(m, prompts, **cfg)
    assert types == ["sliding_attention", "full_attention"] * 2
    for p, toks in zip(prompts, got, strict=True):
        assert toks == generate_greedy(m, p, NEW), f"{len(p)}-token prompt, {cfg}"


REFUSED = {
    "mimo_v2_flash_per_layer_kv": (
        lambda: _build("MiMoV2Flash", head_dim=16, v_head_dim=8, sliding_window=8,
                       layer_types=["full_attention", "sliding_attention"],
                       mlp_layer_types=["dense", "sparse"], n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32),
        "per-layer KV shapes",
    ),
    "jetmoe_grouped_kv": (
        lambda: _build("JetMoe", num_local_experts=4, num_experts_per_tok=2, kv_channels=16),
        "grouped or repeated KV heads",
    ),
    "llama4_temperature_tuning": (
        lambda: _build("Llama4Text", cls="Llama4ForCausalLM", intermediate_size_mlp=128,
                       num_local_experts=2, num_experts_per_tok=1, head_dim=16,
                       no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=4,
                       interleave_moe_layer_step=1, attention_chunk_size=None),
        "temperature tuning",
    ),
}

if hasattr(transformers, "Gemma4TextConfig"):  # (transformers 5.24; its full-attention layers'
    # global_head_dim differs from the sliding ones' head_dim, and the config refuses a
    # global `head_dim` read)
    REFUSED["gemma4_global_head_dim"] = (
        lambda: _build("Gemma4Text", cls="Gemma4ForCausalLM", head_dim=16,
                       tie_word_embeddings=False),
        "per-layer KV shapes",
    )


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_at_construction_naming_the_feature(name: str) -> None:
    build, words = REFUSED[name]
    m = build()
    impl = m.config._attn_implementation
    with pytest.raises(NotImplementedError, match=words):
        Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=32))
    assert m.config._attn_implementation == impl
    with torch.no_grad():  # the caller's model still generates on its own
        m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_llama4_without_temperature_tuning_is_supported() -> None:
    m = _build("Llama4Text", cls="Llama4ForCausalLM", intermediate_size_mlp=128,
               num_local_experts=2, num_experts_per_tok=1, head_dim=16, no_rope_layers=[1, 0],
               attn_temperature_tuning=False, interleave_moe_layer_step=1,
               attention_chunk_size=None)
    prompts = _prompts(4, [33, 5])
    got, _ = _engine_tokens(m, prompts, max_batch_tokens=8)
    for p, toks in zip(prompts, got, strict=True):
        assert toks == generate_greedy(m, p, NEW)
