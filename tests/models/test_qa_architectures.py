"""Greedy parity on architectures beyond tests/tiny_models.py, and clear construction-time
errors for architectures the paged attention cannot run.

Every model is a tiny random-init fp32 model (hidden 64, 2 layers, vocab 512) built from
its config; every request's tokens must equal `model.generate` on that prompt alone, under
the default settings, chunked prefill, a pool far too small (preemption), CPU offload and
shared prefixes with block sharing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
from collections.abc import Iterator

import pytest
import torch
import transformers
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.errors import FieldError
from tiny_models import COMMON, VOCAB

torch.set_num_threads(1)

NEW = 10
_GPT = (
    "num_key_value_heads",
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
)

# name -> (config/model prefix, config overrides, COMMON keys the config must not get)
SUPPORTED: dict[str, tuple[str, dict, tuple[str, ...]]] = {
    "qwen2_tied": ("Qwen2", dict(tie_word_embeddings=True), ()),
    "phi3": ("Phi3", {}, ()),
    "phi": ("Phi", dict(num_key_value_heads=4), ()),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2), ()),
    "qwen2_moe": (
        "Qwen2Moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        (),
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
        (),
    ),
    "olmo2": ("Olmo2", {}, ()),
    "olmo3_hybrid": ("Olmo3", dict(sliding_window=8), ()),
    "gemma": ("Gemma", dict(head_dim=16), ()),
    "cohere_logit_scale": ("Cohere", dict(logit_scale=0.5), ()),
    "cohere2_hybrid": ("Cohere2", dict(sliding_window=8, head_dim=16), ()),
    "starcoder2_bias_sliding": ("Starcoder2", dict(sliding_window=10, use_bias=True), ()),
    "gpt_neox_partial_rotary": ("GPTNeoX", dict(num_key_value_heads=4, rotary_pct=0.25), ()),
    "granite_scaling": (
        "Granite",
        dict(
            logits_scaling=2.0,
            residual_multiplier=0.5,
            embedding_multiplier=2.0,
            attention_multiplier=0.3,
        ),
        (),
    ),
    "smollm3_nope": ("SmolLM3", dict(no_rope_layer_interval=2), ()),
    "llama_rope_llama3": (
        "Llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        ),
        (),
    ),
    "llama_rope_yarn": (
        "Llama",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        ),
        (),
    ),
    "llama_bias_tied_mqa": (
        "Llama",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, num_key_value_heads=1),
        (),
    ),
    "exaone4_hybrid": ("Exaone4", dict(sliding_window=8, head_dim=16), ()),
    "gptj": ("GPTJ", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=1024), _GPT),
    "opt": ("OPT", dict(ffn_dim=128, word_embed_proj_dim=64), ("num_key_value_heads",)),
    "gpt_bigcode_mqa": (
        "GPTBigCode",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024, multi_query=True),
        _GPT,
    ),
}

# name -> (prefix, overrides, dropped keys, words the construction error must contain)
UNSUPPORTED: dict[str, tuple[str, dict, tuple[str, ...], str]] = {
    "falcon": (
        "Falcon",
        dict(num_kv_heads=2, new_decoder_architecture=True),
        (),
        "AttentionInterface",
    ),
    "bloom": ("Bloom", dict(n_layer=2, n_head=4), (), "AttentionInterface"),
    # attends twice in each layer (two softmax maps): more calls than layers
    "diffllama": ("DiffLlama", {}, (), "one attention call a layer"),
    "stablelm": ("StableLm", dict(partial_rotary_factor=0.25), (), "AttentionInterface"),
    "deepseek_v3_mla": (
        "DeepseekV3",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=8,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        (),
        "latent attention",
    ),
    "gpt_neo": (
        "GPTNeo",
        dict(num_layers=2, num_heads=4, window_size=8, attention_types=[[["global", "local"], 1]]),
        ("num_key_value_heads",),
        "AttentionInterface",
    ),
    "qwen3_next_linear": (
        "Qwen3Next",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            full_attention_interval=2,
        ),
        (),
        "linear_attention",
    ),
    "lfm2_conv": ("Lfm2", dict(layer_types=["conv", "full_attention"]), (), "conv"),
}


def _build(prefix: str, overrides: dict, drop: tuple[str, ...]):
    kwargs = {k: v for k, v in {**COMMON, **overrides}.items() if k not in drop}
    config = getattr(transformers, prefix + "Config")(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, prefix + "ForCausalLM")(config).eval().to(torch.float32)


@functools.cache
def model(name: str):
    prefix, overrides, drop = SUPPORTED[name]
    return _build(prefix, overrides, drop)


def prompts(seed: int, n: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    lengths = [1, 2, 7, 8, 9, 23, 40]
    return [
        prefix
        + [
            rng.randrange(3, VOCAB)
            for _ in range(rng.randint(1, 12) if shared_prefix else lengths[i % 7])
        ]
        for i in range(n)
    ]


def reference(m, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = m.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            min_new_tokens=0,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


SCENARIOS = {
    "default": (1, 0, {}),
    "chunked": (2, 0, dict(max_batch_tokens=13, max_requests_per_batch=3)),
    # the longest request needs ceil((40 + 10) / 8) = 7 blocks: 9 is far too small for 7
    "preempt": (3, 0, dict(num_blocks=9, max_batch_tokens=32)),
    "offload": (3, 0, dict(num_blocks=9, max_batch_tokens=32, cpu_offload_space=0.01)),
    "shared": (4, 21, dict(max_batch_tokens=48, allow_block_sharing=True)),
}


def assert_parity(m, name: str, *, probe_below: float | None = None) -> None:
    """Every SCENARIOS run of `m` gives `model.generate`'s tokens and frees every block
    (and the construction probe's error is below `probe_below` when given)."""
    for scenario, (seed, shared, cfg) in SCENARIOS.items():
        ps = prompts(seed, 6, shared)
        config = ContinuousBatchingConfig(page_size=8, **{"num_blocks": 128, **cfg})
        with Engine(m, config=config) as eng:
            if probe_below is not None:
                assert eng.probe_relative_error is not None
                assert eng.probe_relative_error < probe_below
            outs = eng.generate(ps, SamplingParams(max_new_tokens=NEW), progress=False)
            stats = eng.stats()
        for p, o in zip(ps, outs, strict=True):
            assert o.token_ids == reference(m, p), f"{name}/{scenario}: {len(p)}-token prompt"
        assert stats["num_used_blocks"] == 0
        if scenario == "preempt":
            assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_parity_beyond_tiny_models(name: str) -> None:
    m = model(name)
    if not getattr(m, "_supports_attention_backend", True):
        # older transformers releases (GPT-J in 5.17) hard-wire their attention: refused
        with pytest.raises(NotImplementedError, match="AttentionInterface"):
            Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=32))
        return
    assert_parity(m, name)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_architecture_fails_at_construction(name: str) -> None:
    prefix, overrides, drop, words = UNSUPPORTED[name]
    m = _build(prefix, overrides, drop)
    impl = m.config._attn_implementation
    with pytest.raises(NotImplementedError, match=words):
        Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=32))
    # the caller's model is left as it was and still generates on its own
    assert m.config._attn_implementation == impl
    with torch.no_grad():
        m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0)


@contextlib.contextmanager
def skewed_attention() -> Iterator[None]:
    """ferrobatch's paged attention registered with its keys scaled ×3: runs, but wrong
    (the lean layers' direct call to the CPU kernel too, which skips the registry; the
    one-call layer, which does its attention in Rust, is kept out)."""
    from ferrobatch.attention import context, forward, registry
    from ferrobatch.runner import fused_layer, lean_layers

    real = forward.paged_attention_forward
    real_direct = lean_layers.kernel_only_attention
    real_fused = fused_layer.FusedLayer.forward

    def skewed(module, query, key, value, *args, **kwargs):
        return real(module, query, key * 3.0, value, *args, **kwargs)

    def skewed_direct(step, layer_idx, q, k, v, scaling, softcap=None):
        return real_direct(step, layer_idx, q, (k * 3.0).to(k.dtype), v, scaling, softcap)

    registry.AttentionInterface.register(context.ATTENTION_NAME, skewed)
    lean_layers.kernel_only_attention = skewed_direct
    fused_layer.FusedLayer.forward = lambda self, *args, **kwargs: False
    try:
        yield
    finally:
        registry.AttentionInterface.register(context.ATTENTION_NAME, real)
        lean_layers.kernel_only_attention = real_direct
        fused_layer.FusedLayer.forward = real_fused


def test_probe_catches_silently_wrong_attention() -> None:
    """An attention that runs but computes something else (here: keys scaled) is refused at
    construction, not discovered as wrong tokens."""
    m = model("qwen2_tied")
    refused = pytest.raises(NotImplementedError, match="differ from the model's own forward")
    with skewed_attention(), refused:
        Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=32))
    with Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=32)) as eng:
        out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), progress=False)[0]
    assert out.token_ids == reference(m, [5, 6, 7])[:4]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_pass_the_probe(dtype: torch.dtype) -> None:
    """The construction probe must not refuse a supported model for rounding alone; a bf16
    model passed with dtype=None runs in bf16 and matches its own bf16 `generate`."""
    m = _build("Cohere2", dict(sliding_window=8, head_dim=16), ()).to(dtype)
    with Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=64)) as eng:
        assert eng.probe_relative_error is not None and eng.probe_relative_error < 0.05
        assert eng.runner.cache.keys[0].dtype == dtype
        ps = prompts(9, 3)
        outs = eng.generate(ps, SamplingParams(max_new_tokens=6), progress=False)
    assert all(len(o.token_ids) == 6 or o.finish_reason == "stop" for o in outs)


def test_non_finite_weights_are_named_not_blamed_on_attention() -> None:
    """A model whose own forward gives NaN logits is refused naming the tensor that holds
    the NaN (field "model"), not as an attention feature the paged attention lacks."""
    m = copy.deepcopy(model("phi3"))  # (`model` caches its models)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[2, 9] = float("nan")
    with pytest.raises(FieldError, match=r"non-finite logits .*model\.layers\.1\.mlp\."
                                         r"down_proj\.weight holds nan at \[2, 9\]") as err:
        Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=32))
    assert err.value.field == "model"


def test_fp32_probe_error_is_tiny() -> None:
    with Engine(model("phi3"), config=ContinuousBatchingConfig(page_size=8, num_blocks=32)) as eng:
        assert eng.probe_relative_error is not None and eng.probe_relative_error < 1e-4


def test_probe_still_refuses_with_a_one_block_cache() -> None:
    """The probe shrinks its prompt to the cache, so even `num_blocks=1` cannot let an
    attention that computes something else slip through to wrong tokens. (GPT-OSS sinks and
    Nemotron's kwargs-dropping layers, once refused here, are supported: see
    tests/models/test_attention_sinks.py.)"""
    refused = pytest.raises(NotImplementedError, match="differ from the model's own forward")
    with skewed_attention(), refused:
        Engine(model("qwen2_tied"), config=ContinuousBatchingConfig(page_size=8, num_blocks=1))
    with Engine(model("phi3"), config=ContinuousBatchingConfig(page_size=8, num_blocks=1)) as eng:
        assert eng.probe_relative_error is not None and eng.probe_relative_error < 1e-4
