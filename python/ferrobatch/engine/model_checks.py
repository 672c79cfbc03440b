"""What `Engine` reads from a model before it runs it, and what it refuses: the lengths its
config names, its generation defaults and end-of-sequence ids, and the architecture checks
(`check_architecture`: `NotImplementedError` naming what the paged path cannot run)."""

from __future__ import annotations

from typing import Any

from ferrobatch.models import attention_layout
from ferrobatch.sampling.params import SamplingParams

_LENGTH_KEYS = ("sliding_window", "attention_chunk_size", "original_max_position_embeddings",
                "window_size", "local_window_size")


def config_lengths(config: Any) -> set[int]:
    """Sequence lengths a model's config names (windows, chunks, rope switch points), in the
    config, its text config and their rope parameters (per layer type too)."""
    out: set[int] = set()
    cfgs = [config]
    getter = getattr(config, "get_text_config", None)
    if getter is not None:
        cfgs.append(getter())
    dicts: list[dict[str, Any]] = []
    for cfg in cfgs:
        dicts.append({k: getattr(cfg, k, None) for k in _LENGTH_KEYS})
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        if isinstance(rope, dict):
            dicts.append(rope)
            dicts.extend(v for v in rope.values() if isinstance(v, dict))
    for d in dicts:
        for k in _LENGTH_KEYS:
            v = d.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 2:
                out.add(v)
    return out


def generation_defaults(model: Any) -> SamplingParams | None:
    """What `sampling=None` means: the model's own `generation_config` (as `model.generate`
    and vLLM apply it): its do_sample / temperature / top_k / top_p / min_p /
    repetition_penalty / max_new_tokens, transformers' defaults for what it leaves unset,
    except the length, which stays the engine's default unless the config sets
    `max_new_tokens`. Fields ferrobatch cannot honour are named in a warning and left out.
    None when the model has no generation config (greedy)."""
    gc = getattr(model, "generation_config", None)
    if gc is None:
        return None
    return SamplingParams.from_generation_config(gc, unsupported="warn", lengths=False)


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos]


def check_architecture(model: Any, tcfg: Any) -> None:
    """Refuse, with a clear error, models the paged attention cannot run."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{name} does not dispatch attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False); ferrobatch cannot run it"
        )
    if getattr(tcfg, "kv_lora_rank", None):
        raise NotImplementedError(
            f"{name} uses multi-head latent attention (kv_lora_rank): keys and values of "
            "different head sizes are not supported by ferrobatch's paged cache"
        )
    # Attention sinks (GPT-OSS) run on the SDPA path (the runner routes them there).
    for m in model.modules():
        if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True):
            raise NotImplementedError(
                f"{name} uses attention temperature tuning on its no-rope layers (Llama-4): the "
                "layer computes its positions from the cache length inside its forward, which "
                "in a packed step are not each request's positions; not supported"
            )
    layout = attention_layout(model)
    shapes = layout.shapes
    if layout.recorded and len(set(shapes)) > 1:
        per_layer = ", ".join(f"layer {i}: {kv} KV heads x {d}" for i, (_, kv, d, _) in
                              enumerate(shapes))
        raise NotImplementedError(
            f"{name} has per-layer KV shapes ({per_layer}): ferrobatch's paged cache holds "
            "one KV shape for every layer"
        )
    if layout.recorded and shapes and shapes[0][2] != shapes[0][3]:
        raise NotImplementedError(
            f"{name}: keys and values of different head sizes ({shapes[0][2]} and "
            f"{shapes[0][3]}) are not supported by ferrobatch's paged cache"
        )
    heads = int(getattr(tcfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(tcfg, "num_key_value_heads", None) or heads)
    hd = int(getattr(tcfg, "head_dim", None) or (tcfg.hidden_size // heads if heads else 0))
    if layout.recorded and shapes and shapes[0][1:3] != (kv, hd):
        raise NotImplementedError(
            f"{name}: its attention layers get {shapes[0][1]} KV heads of size {shapes[0][2]} "
            f"(grouped or repeated KV heads), not the config's num_key_value_heads={kv} x "
            f"head_dim={hd} ferrobatch's paged cache is built with; not supported"
        )
