"""`load_gguf` on tiny files written as llama.cpp writes them: every supported architecture,
every kept type, logits equal to the oracle (the file's values dequantized by gguf.quants in
an fp32 transformers model) and, where transformers' own GGUF loader reads the metadata
fully, to transformers' dequantized model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrobatch.gguf import loader
from ferrobatch.gguf.loader import load_gguf
from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear
from gguf_files import (
    CHAT_TEMPLATE,
    LLAMA_CPP_FALLBACK,
    QTYPES,
    reference_model,
    tiny_model,
    write_gguf,
)

IDS = torch.tensor([[3, 17, 99, 5, 200, 7, 8, 9, 11, 400, 13, 14]])

CASES = [("llama", q) for q in QTYPES] + [("qwen2", q) for q in QTYPES] + [
    ("qwen3", "Q4_K"), ("qwen3", "Q4_1"), ("mistral", "Q5_K"), ("mistral", "Q8_0"),
    ("gemma2", "Q6_K"), ("gemma2", "Q4_0"), ("gemma3", "Q4_K"), ("gemma3", "Q8_0"),
    ("phi3", "Q5_K"), ("phi3", "Q4_1"), ("gpt2", "Q4_K"), ("gpt2", "Q8_0"),
    ("starcoder2", "Q4_K"), ("starcoder2", "Q6_K"), ("starcoder2", "Q8_0"),
    ("nemotron", "Q4_K"), ("nemotron", "Q8_0"),
]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits[0]


@pytest.mark.parametrize(("arch", "qtype"), CASES)
def test_logits_equal_dequantized_oracle(gguf_file, arch: str, qtype: str) -> None:
    written, source = gguf_file(arch, qtype)
    model, _ = load_gguf(written.path)
    want = _logits(reference_model(source, written))
    # (a product's bias is added after it, where `nn.Linear`'s addmm starts from it: the
    # two round apart, by up to 1.6e-5 in these logits on AMD Zen 3's AVX2 sgemm)
    torch.testing.assert_close(_logits(model), want, rtol=1e-4, atol=1e-4)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(type(m) is not torch.nn.Linear for m in model.modules())
    kept = {m.qtype for m in linears}
    assert qtype in kept and kept <= {qtype, "Q8_0"}  # (Q8_0: rows not whole K-blocks)
    assert isinstance(model.get_input_embeddings(), QuantEmbedding)
    info = model.ferrobatch_gguf
    assert info.architecture == ("llama" if arch == "mistral" else arch)
    assert info.quantized_bytes == sum(
        t.nbytes for t in loader.GGUFFile(written.path).tensors.values() if t.qtype == qtype
        or t.qtype == "Q8_0")
    # float parameters: the norms and biases only
    assert info.float_bytes < 0.05 * info.quantized_bytes + 40_000
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q4_K"), ("qwen2", "Q6_K"),
                                             ("phi3", "Q4_0")])
def test_logits_equal_transformers_gguf_loader(gguf_file, arch: str, qtype: str) -> None:
    """An oracle independent of the test writer: transformers' own GGUF loading (which
    dequantizes everything) of the same file. (Of the architectures whose metadata it reads
    fully: it takes Qwen3's head size, Gemma's softcapping and attention scale, GPT-2's
    context and MLP widths from defaults, which `arch.fix_config` reads from the file.)"""
    from transformers import AutoModelForCausalLM

    written, _ = gguf_file(arch, qtype)
    theirs = AutoModelForCausalLM.from_pretrained(str(written.path.parent),
                                                  gguf_file=written.path.name,
                                                  dtype=torch.float32).eval()
    model, _ = load_gguf(written.path)
    torch.testing.assert_close(_logits(model), _logits(theirs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "base"), [("qwen2", "Q4_K"), ("llama", "Q5_K"),
                                            ("gemma3", "Q4_K")])
def test_k_m_mix_of_a_width_not_whole_k_blocks(k_m_file, arch: str, base: str) -> None:
    """A Q4_K_M / Q5_K_M file of a model whose hidden width is not whole 256-weight blocks
    (as Qwen2.5-0.5B's 896): its Q5_0 / Q5_1 / Q8_0 fallbacks stay quantized next to the
    K-types, and the logits equal the oracle."""
    written, source = k_m_file(arch, base)
    fallback = LLAMA_CPP_FALLBACK[base]
    assert set(written.types.values()) == {base, "Q6_K", fallback, "Q8_0", "F32"}
    assert written.types["blk.0.attn_q.weight"] == fallback
    model, _ = load_gguf(written.path)
    torch.testing.assert_close(_logits(model), _logits(reference_model(source, written)),
                               rtol=1e-5, atol=1e-5)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
    assert {m.qtype for m in quant} == {base, "Q6_K", fallback, "Q8_0"}
    assert model.get_input_embeddings().qtype == fallback
    assert all(type(m) is not torch.nn.Linear for m in model.modules())


def test_tied_head_shares_the_embedding(gguf_file) -> None:
    written, _ = gguf_file("qwen2", "Q4_K")
    model, _ = load_gguf(written.path)
    assert model.config.tie_word_embeddings
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, QuantLinear) and isinstance(emb, QuantEmbedding)
    assert head.weight_q is emb.weight_q and head.qdata.data_ptr() == emb.qdata.data_ptr()


def test_weights_are_views_of_the_file(gguf_file) -> None:
    """Unpermuted blocks are the file's mapped bytes; llama's q/k rows are reordered copies."""
    written, _ = gguf_file("llama", "Q4_0")
    model, _ = load_gguf(written.path)
    f = loader.GGUFFile(written.path)
    info = model.ferrobatch_gguf
    qk = sum(t.nbytes for n, t in f.tensors.items() if ".attn_q." in n or ".attn_k." in n)
    assert info.mapped_bytes == info.quantized_bytes - qk
    down = model.model.layers[0].mlp.down_proj
    assert np.array_equal(down.qdata.numpy(), f.raw("blk.0.ffn_down.weight"))


def test_mixed_types(gguf_file) -> None:
    """F16 / F32 matrices become plain `nn.Linear` in the model's dtype next to quantized
    ones."""
    written, source = gguf_file("llama", "Q4_1", output_qtype="F32", embed_qtype="F16",
                                types={"blk.0.attn_q.weight": "F16",
                                       "blk.1.ffn_up.weight": "F32",
                                       "blk.1.attn_v.weight": "BF16"})
    model, _ = load_gguf(written.path)
    plain = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert plain == {"lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj",
                     "model.layers.1.self_attn.v_proj"}
    assert type(model.get_input_embeddings()) is torch.nn.Embedding
    torch.testing.assert_close(_logits(model), _logits(reference_model(source, written)),
                               rtol=1e-5, atol=1e-5)


def test_tokenizer_and_chat_template(gguf_file) -> None:
    written, _ = gguf_file("llama", "Q8_0", tokenizer=True)
    model, tok = load_gguf(written.path)
    assert tok is not None and tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token_id == 2 == model.config.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "hi the"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi the<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and tok.decode(ids) == text
    # the second load reads config and tokenizer from the cache: the same
    p = loader.plan(written.path)
    assert p.config_cached
    model2, tok2 = load_gguf(written.path)
    assert tok2(text)["input_ids"] == ids and tok2.chat_template == CHAT_TEMPLATE
    assert model2.config.to_dict() == model.config.to_dict()


def test_a_tokenizer_that_changes_when_saved_is_converted_on_every_load(tmp_path) -> None:
    # transformers' save and load of this Gemma tokenizer (no unk token) gives one that
    # cannot tokenize text; the cache marks it, and the second load converts again
    path = tmp_path / "gemma2.gguf"
    write_gguf(path, tiny_model("gemma2", seed=1), "gemma2", "Q8_0", tokenizer=True)
    _, first = load_gguf(path)
    ids = first("hello world").input_ids
    assert (loader.plan(path).cache_dir / "convert-tokenizer").is_file()
    _, second = load_gguf(path)
    assert second("hello world").input_ids == ids


def test_cache_follows_the_file(gguf_file, tmp_path) -> None:
    import shutil

    written, _ = gguf_file("qwen2", "Q8_0")
    copy = tmp_path / "m.gguf"
    shutil.copy(written.path, copy)
    load_gguf(copy)
    assert loader.plan(copy).config_cached
    assert not loader.plan(copy, cache=False).config_cached
    copy.write_bytes(copy.read_bytes() + bytes(32))  # another size and mtime: another key
    assert not loader.plan(copy).config_cached


def test_plan_commits_no_weights(gguf_file) -> None:
    written, _ = gguf_file("gemma2", "Q4_K")
    p = loader.plan(written.path)
    assert all(t.device.type == "meta" for t in p.model.parameters())
    assert {i.entry.qtype for i in p.items if i.quantized} == {"Q4_K"}


def test_llama3_rope_freqs(gguf_file) -> None:
    """`rope_freqs.weight` divides the rotary frequencies (llama.cpp's freq_factors)."""
    factors = np.linspace(1.0, 8.0, 32).astype(np.float32)
    written, source = gguf_file("llama", "Q8_0", rope_freqs=factors)
    model, _ = load_gguf(written.path)
    ref = reference_model(source, written)
    rot = ref.model.rotary_emb
    rot.inv_freq = rot.inv_freq / torch.from_numpy(factors)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, rot.inv_freq)
    torch.testing.assert_close(_logits(model), _logits(ref), rtol=1e-5, atol=1e-5)


def test_config_fixups(gguf_file) -> None:
    """Metadata llama.cpp writes that transformers' mapping drops."""
    w, _ = gguf_file("qwen3", "Q8_0")
    assert loader.plan(w.path).config.head_dim == 32  # attention.key_length
    w, _ = gguf_file("gemma2", "Q8_0")
    c = loader.plan(w.path).config
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.query_pre_attn_scalar) == \
        (5.0, 3.0, 64)
    w, _ = gguf_file("mistral", "Q8_0")
    c = loader.plan(w.path).config
    assert c.model_type == "mistral" and c.sliding_window is None
    w, _ = gguf_file("phi3", "Q8_0", extra_metadata={"phi3.rope.dimension_count": 48,
                                                     "phi3.attention.sliding_window": 7})
    c = loader.plan(w.path).config
    assert c.rope_parameters["partial_rotary_factor"] == 0.75 and c.sliding_window == 7
    w, _ = gguf_file("llama", "Q8_0", extra_metadata={"llama.rope.scaling.type": "linear",
                                                      "llama.rope.scaling.factor": 4.0})
    c = loader.plan(w.path).config
    assert c.rope_parameters["rope_type"] == "linear" and c.rope_parameters["factor"] == 4.0
    w, _ = gguf_file("gemma3", "Q8_0", extra_metadata={"gemma3.rope.scaling.type": "linear",
                                                       "gemma3.rope.scaling.factor": 8.0})
    rp = loader.plan(w.path).config.rope_parameters
    assert rp["full_attention"]["factor"] == 8.0
    assert rp["sliding_attention"]["rope_type"] == "default"
    # StarCoder2: rope theta and vocabulary size (dropped by transformers' mapping), the
    # whole context attended, as llama.cpp does
    w, _ = gguf_file("starcoder2", "Q8_0")
    c = loader.plan(w.path).config
    assert c.rope_parameters["rope_theta"] == 100000.0 and c.vocab_size == 512
    assert c.sliding_window is None and c.norm_epsilon == pytest.approx(1e-5)


def test_directory_with_one_file(gguf_file) -> None:
    from ferrobatch.gguf.source import gguf_path_of
    from ferrobatch.models import load_model

    written, _ = gguf_file("qwen3", "Q6_K")
    assert gguf_path_of(written.path.parent) == written.path
    assert gguf_path_of(str(written.path)) == written.path
    model, _ = load_model(written.path.parent)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                                  "phi3", "gpt2", "starcoder2", "qwen3moe", "qwen2moe",
                                  "mixtral", "nemotron"])
def test_cached_config_is_the_same(gguf_file, arch: str) -> None:
    """The config read back from the cache is the one transformers made of the file."""
    written, _ = gguf_file(arch, "Q8_0")
    fresh = loader.plan(written.path, cache=False)
    load_gguf(written.path)  # fills the cache
    cached = loader.plan(written.path)
    assert cached.config_cached
    a, b = fresh.config.to_dict(), cached.config.to_dict()
    a.pop("transformers_version", None), b.pop("transformers_version", None)
    assert a == b


def test_bfloat16_model(gguf_file) -> None:
    """`dtype=torch.bfloat16`: norms, biases and activations in bf16, products still fp32 over
    the quantized blocks."""
    written, source = gguf_file("qwen2", "Q4_K")
    model, _ = load_gguf(written.path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.dtype == torch.bfloat16
    got = _logits(model).float()
    want = _logits(reference_model(source, written))
    assert (got - want).norm() < 0.05 * want.norm()
