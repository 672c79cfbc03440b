"""The benchmark workloads: "tiny-llama" (a random-init tiny Llama and its prompts) and chat
questions.

One source for ``benches/e2e_cpu.py``, ``ferrobatch bench`` and the tests: a random-init
Llama (hidden 256, 4 layers, 4/2 heads, vocab 32000, fp32, ``torch.manual_seed(0)``, EOS
off) and 64 prompts from ``random.Random(1234)`` with lengths 16..256.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers

__all__ = [
    "CHAT_QUESTIONS",
    "TINY_LLAMA_VOCAB",
    "agreement",
    "chat_prompts",
    "left_padded",
    "tiny_llama_config",
    "tiny_llama_model",
    "tiny_llama_prompts",
]

#: Vocabulary size of the tiny-llama model.
TINY_LLAMA_VOCAB = 32000

#: User questions of the chat workload (``ferrobatch bench MODEL``, ``--smollm2``).
CHAT_QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Give me three tips for better sleep.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "What are prime numbers? Give examples.",
    "Suggest a name for a friendly robot.",
    "How does a bicycle stay upright?",
    "Translate 'good morning' into Spanish and French.",
    "What is machine learning?",
    "Describe a cat to someone who has never seen one.",
    "List the planets of the solar system.",
    "What should I pack for a weekend hiking trip?",
)


def tiny_llama_config(**overrides: Any) -> Any:
    """The tiny-llama ``LlamaConfig`` (no EOS token), with ``overrides`` applied."""
    fields: dict[str, Any] = dict(
        vocab_size=TINY_LLAMA_VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=None,
    )
    return transformers.LlamaConfig(**{**fields, **overrides})


def tiny_llama_model(seed: int = 0, **overrides: Any) -> Any:
    """The tiny-llama model: a random-init fp32 Llama in eval mode (weights from
    ``torch.manual_seed``)."""
    config = tiny_llama_config(**overrides)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval().to(torch.float32)


def tiny_llama_prompts(
    n: int = 64, min_len: int = 16, max_len: int = 256, vocab: int = TINY_LLAMA_VOCAB
) -> list[list[int]]:
    """``n`` random prompts (token ids 3..vocab) from ``random.Random(1234)``."""
    rng = random.Random(1234)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        out.append([rng.randrange(3, vocab) for _ in range(length)])
    return out


def chat_prompts(
    encode_chat: Callable[[list[dict[str, str]]], list[int]],
    n: int,
    questions: Sequence[str] = CHAT_QUESTIONS,
) -> list[list[int]]:
    """``n`` single-turn chat prompts cycling through ``questions`` (repeats get a variant
    suffix), each encoded by ``encode_chat(messages)``."""
    out = []
    for i in range(n):
        q = questions[i % len(questions)]
        if i >= len(questions):
            q = f"{q} (variant {i // len(questions)})"
        out.append([int(t) for t in encode_chat([{"role": "user", "content": q}])])
    return out


def left_padded(prompts: Sequence[Sequence[int]]) -> tuple[Any, Any]:
    """(input_ids, attention_mask) int64 tensors, prompts right-aligned over 0 padding (the
    padded ``model.generate`` baseline)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def agreement(
    a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]
) -> dict[str, float | None]:
    """How far two methods' outputs for the same prompts agree: `requests`, the share of
    identical sequences; `tokens`, the share of tokens before each pair's first divergence
    (over the longer of the two lists: a missing sequence counts as different); and
    `first_divergence`, the mean 0-based position of the first differing token over the
    pairs that differ (a length mismatch diverges where the shorter ends; None when all
    pairs are identical)."""
    n = max(len(a), len(b))
    same = sum(list(x) == list(y) for x, y in zip(a, b, strict=False))
    agree = total = 0
    firsts: list[int] = [0] * abs(len(a) - len(b))  # missing sequences differ at once
    for x, y in zip(a, b, strict=False):
        total += max(len(x), len(y))
        pos = 0
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            pos += 1
        agree += pos
        if list(x) != list(y):
            firsts.append(pos)
    return {
        "requests": same / max(1, n),
        "tokens": agree / max(1, total),
        "first_divergence": sum(firsts) / len(firsts) if firsts else None,
    }
