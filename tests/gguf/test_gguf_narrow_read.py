"""Tensor-parallel quantize on load reads a bf16 / fp16 checkpoint in its own dtype
(`gguf.narrow_read`): the model is the one an fp32 read gives, tensor for tensor and bit for
bit, and models whose buffers a half-precision read would round are read in fp32. Matrices
widen to fp32 a share of rows at a time, and each float weight is freed once quantized.
(One process quantizes each matrix as it is read instead: `test_gguf_stream_quantize`.)"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from ferrobatch.errors import FieldError
from ferrobatch.gguf import narrow_read, quantize
from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear
from ferrobatch.models import load_model
from gguf_files import tiny_model


def _saved(tmp_path: Path, arch: str, dtype: torch.dtype) -> Path:
    model = tiny_model(arch).to(dtype)
    model.save_pretrained(tmp_path)
    return tmp_path


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    return {name: t for name, t in named}


def assert_same_tensors(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every parameter and buffer of `model` is `reference`'s: same names, dtypes, bits."""
    got, want = _state(model), _state(reference)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def _fp32_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(narrow_read, "read_dtype", lambda path, wanted: (wanted, {}))


def _quantized_load(path: Path, qtype: str) -> torch.nn.Module:
    """`path` read (narrow where `read_dtype` says so), quantized, widened: a rank's load."""
    def load(read_in: torch.dtype, wanted: torch.dtype) -> tuple[torch.nn.Module, None]:
        model, _ = load_model(path, dtype=read_in)
        quantize.quantize_model(model, qtype, dtype=wanted)
        return model, None

    return narrow_read.quantized_load(path, None, load)[0]


#: (architecture, stored dtype, type) of the bit-equality tests of reading then quantizing
HALF_CHECKPOINTS = [
    ("llama", torch.bfloat16, "q4_k"),
    ("qwen2", torch.bfloat16, "q8_0"),   # tied embeddings, q/k/v biases
    ("mistral", torch.float16, "q4_0"),
    ("qwen3", torch.bfloat16, "q6_k"),   # q/k norms
    ("phi3", torch.bfloat16, "q5_k"),    # fused qkv and gate/up
]


@pytest.mark.parametrize(("arch", "stored", "qtype"), HALF_CHECKPOINTS)
def test_half_checkpoint_read_narrow_is_the_fp32_read(tmp_path: Path, arch: str,
                                                      stored: torch.dtype, qtype: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _saved(tmp_path, arch, stored)
    read_in, wide = narrow_read.read_dtype(path, torch.float32)
    assert read_in == stored and wide
    narrow = _quantized_load(path, qtype)
    with monkeypatch.context() as m:
        _fp32_read(m)
        reference = _quantized_load(path, qtype)
    assert_same_tensors(narrow, reference)
    assert narrow.dtype == torch.float32 and narrow.config.dtype == torch.float32
    quantized = [m for m in narrow.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
    assert quantized and all(q.qdata.dtype == torch.uint8 for q in quantized)
    embed = narrow.get_input_embeddings()
    assert isinstance(embed, QuantEmbedding) and embed.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        assert torch.equal(narrow(ids).logits, reference(ids).logits)


def test_buffers_that_follow_the_default_dtype_keep_the_fp32_read(tmp_path: Path) -> None:
    # Gemma3 builds `embed_scale` in the default dtype: a bf16 read would round sqrt(256)'s
    # neighbours (here exact, but the rule is the buffer's dtype, not its value)
    path = _saved(tmp_path, "gemma3", torch.bfloat16)
    assert narrow_read.read_dtype(path, torch.float32) == (torch.float32, {})
    model = _quantized_load(path, "q8_0")
    embed = model.get_input_embeddings()
    assert embed.embed_scale.dtype == torch.float32


def test_other_reads_are_as_asked(tmp_path: Path) -> None:
    half = _saved(tmp_path / "half", "llama", torch.bfloat16)
    assert narrow_read.read_dtype(half, torch.bfloat16) == (torch.bfloat16, {})
    full = _saved(tmp_path / "full", "llama", torch.float32)
    assert narrow_read.read_dtype(full, torch.float32) == (torch.float32, {})
    # a config naming bf16 over fp32 files: the files decide
    config = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert narrow_read.read_dtype(full, torch.float32) == (torch.float32, {})
    # pickled weights: no header to read
    pickled = tmp_path / "pickled"
    tiny_model("llama").to(torch.bfloat16).save_pretrained(pickled, safe_serialization=False)
    if not list(pickled.glob("*.safetensors")):
        assert narrow_read.read_dtype(pickled, torch.float32) == (torch.float32, {})


def test_float_weights_are_freed_while_quantizing(tmp_path: Path) -> None:
    # each replaced nn.Linear's weight is gone once its module is: nothing in the loop
    # holds it (the ids of freed weights may be reused by new tensors: no wrong sharing)
    path = _saved(tmp_path, "llama", torch.bfloat16)
    model, _ = load_model(path, dtype=torch.bfloat16)
    refs = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    quantize.quantize_model(model, "q8_0", dtype=torch.float32)
    assert refs and all(r() is None for r in refs)
    embed = model.get_input_embeddings()
    assert isinstance(embed, QuantEmbedding) and embed.dtype == torch.float32


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_rows_quantized_a_share_at_a_time_are_the_whole_matrix(
        qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w = 0.02 * torch.randn(10, 512, generator=torch.Generator().manual_seed(1))
    whole = quantize.quantize_weight(w.to(torch.bfloat16), qtype)
    monkeypatch.setattr(quantize, "ROWS_AT_ONCE", 3)
    shared = quantize.quantize_weight(w.to(torch.bfloat16), qtype)
    assert torch.equal(shared.data, whole.data) and shared.data.shape == whole.data.shape
    if qtype == "Q4_K":  # the kernels' quantizer names the row in the whole matrix
        w[7, 100] = float("nan")
        with pytest.raises(FieldError, match=r"row 7, column 100 is NaN"):
            quantize.quantize_weight(w, qtype)
