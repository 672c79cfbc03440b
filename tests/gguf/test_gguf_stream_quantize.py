"""Quantize on load in one process, where the read converts tensors, quantizes each matrix
as transformers reads it (`gguf.stream_quantize`): the model is, tensor for tensor and bit
for bit, the fp32 read of the checkpoint quantized afterwards, every matrix arrives already
quantized (no converted matrix of the model is ever held whole), and a refused matrix fails
the load naming it. Reads that map the files as stored take the plain load instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ferrobatch.errors import FieldError
from ferrobatch.gguf import narrow_read, quantize, stream_quantize
from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear
from ferrobatch.models import load_model
from gguf_files import tiny_model
from test_gguf_narrow_read import HALF_CHECKPOINTS, assert_same_tensors


@pytest.fixture
def streamed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every quantize-on-load streamed, whatever the checkpoint's dtypes."""
    monkeypatch.setattr(narrow_read, "in_place_read", lambda path, wanted: None)


def _read_then_quantized(path: Path, qtype: str) -> torch.nn.Module:
    model, _ = load_model(path, dtype=torch.float32)
    quantize.quantize_model(model, qtype)
    return model


@pytest.mark.parametrize(("arch", "stored", "qtype"), [
    *HALF_CHECKPOINTS,
    ("gemma3", torch.bfloat16, "q8_0"),  # scaled embedding, its buffer in the default dtype
    ("gemma2", torch.float32, "q4_1"),
])
def test_streamed_model_is_the_read_model_quantized(tmp_path: Path, arch: str,
                                                    stored: torch.dtype, qtype: str,
                                                    streamed: None) -> None:
    tiny_model(arch).to(stored).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, quantization=qtype)
    reference = _read_then_quantized(tmp_path, qtype)
    assert_same_tensors(model, reference)
    pairs = [(a, b) for a, b in zip(model.modules(), reference.modules(), strict=True)
             if isinstance(b, QuantLinear | QuantEmbedding)]
    assert pairs
    for a, b in pairs:
        assert type(a) is type(b) and a.qtype == b.qtype and torch.equal(a.qdata, b.qdata)
    assert model.ferrobatch_quantization == reference.ferrobatch_quantization
    assert not getattr(model, "is_quantized", False)  # transformers' marks are gone
    assert getattr(model.config, "quantization_config", None) is None
    assert model.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_every_matrix_arrives_quantized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        streamed: None) -> None:
    # when the modules are swapped, each quantizable module's weight is already a stand-in
    # holding its quantized matrix: no float matrix was kept to be quantized afterwards
    tiny_model("qwen2").to(torch.bfloat16).save_pretrained(tmp_path)
    swap = quantize.quantize_model
    seen: list[bool] = []

    def checked(model: torch.nn.Module, *args, **kwargs):
        for m in model.modules():
            if quantize.quantizable(m):
                held = quantize.pre_quantized(m.weight)
                seen.append(held is not None and m.weight.numel() == 0)
        return swap(model, *args, **kwargs)

    monkeypatch.setattr(quantize, "quantize_model", checked)
    model, _ = load_model(tmp_path, quantization="q4_k")
    assert seen and all(seen)
    assert any(isinstance(m, QuantEmbedding) for m in model.modules())
    # the tied head shares the embedding's quantized matrix
    assert model.lm_head.weight_q is model.get_input_embeddings().weight_q


def test_fallback_and_float_layers_as_after_a_read(tmp_path: Path, streamed: None) -> None:
    # MLP width 320: down_proj's input is not whole 256-weight blocks of Q4_K but whole
    # 32-weight ones of its fallback Q5_0; width 40 (q4_0): no type, the layer stays float
    for intermediate, qtype, key in ((320, "q4_k", "fallback_layers"),
                                     (40, "q4_0", "float_layers")):
        path = tmp_path / str(intermediate)
        tiny_model("llama", intermediate_size=intermediate).to(torch.bfloat16) \
            .save_pretrained(path)
        model, _ = load_model(path, quantization=qtype)
        reference = _read_then_quantized(path, qtype)
        assert model.ferrobatch_quantization == reference.ferrobatch_quantization
        assert model.ferrobatch_quantization[key]
        assert_same_tensors(model, reference)


def test_a_refused_matrix_fails_the_load_naming_it(tmp_path: Path, streamed: None) -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 7] = float("inf")
    model.save_pretrained(tmp_path)
    with pytest.raises(FieldError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*row 3, "
                                         r"column 7") as caught:
        load_model(tmp_path, quantization="q4_k")
    assert caught.value.field == "quantization"


def test_registration_is_idempotent() -> None:
    stream_quantize._register()
    stream_quantize._register()
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
    assert AUTO_QUANTIZER_MAPPING[stream_quantize.METHOD] is stream_quantize.StreamQuantizer


@pytest.mark.parametrize(("arch", "stored", "dtype", "streams"), [
    ("llama", torch.bfloat16, None, False),             # read narrow: mapped as stored
    ("llama", torch.float32, None, False),              # read as stored
    ("llama", torch.bfloat16, torch.bfloat16, False),
    ("llama", torch.float32, torch.bfloat16, True),     # converted as read
    ("gemma3", torch.bfloat16, None, True),             # narrow read refused: converted
])
def test_converting_reads_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                 stored: torch.dtype, dtype: torch.dtype | None,
                                 streams: bool) -> None:
    tiny_model(arch).to(stored).save_pretrained(tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(stream_quantize.StreamQuantizer, "get_quantize_ops",
                        lambda self, ops=stream_quantize.StreamQuantizer.get_quantize_ops:
                        calls.append("streamed") or ops(self))
    model, _ = load_model(tmp_path, quantization="q8_0", dtype=dtype)
    assert bool(calls) == streams
    assert model.ferrobatch_quantization["quantized_modules"] > 0
    assert next(p for p in model.parameters()).dtype == (dtype or torch.float32)
