"""What `load_gguf` refuses, each with a `FieldError` naming the problem, raised while
planning: before any weight memory is committed (`loader.fill` never runs)."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from ferrobatch.errors import FieldError
from ferrobatch.gguf import loader
from ferrobatch.gguf.loader import load_gguf
from gguf_files import tiny_model, write_gguf


@pytest.fixture(autouse=True)
def _no_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every refusal here comes from the plan: filling would be a failure."""

    def fill(*args, **kwargs):
        raise AssertionError("weights were filled before the refusal")

    monkeypatch.setattr(loader, "fill", fill)


def _refused(path, match: str, field: str = "model", **kw) -> FieldError:
    with pytest.raises(FieldError, match=match) as err:
        load_gguf(path, **kw)
    assert err.value.field == field
    return err.value


def test_unsupported_tensor_type_named(tmp_path) -> None:
    """A TQ2_0 matrix (a type the kernels do not run) is refused by name and type, though it
    is the last tensor of the file."""
    written = write_gguf(tmp_path / "tq2.gguf", tiny_model("llama"), "llama", "Q4_K",
                         types={"blk.1.ffn_down.weight": "TQ2_0"})
    names = list(written.types)
    assert names.index("blk.1.ffn_down.weight") > len(names) // 2
    _refused(written.path, r"tensor blk\.1\.ffn_down\.weight has type TQ2_0")


def test_unsupported_architecture(tmp_path) -> None:
    path = tmp_path / "stablelm.gguf"
    w = gguf.GGUFWriter(str(path), "stablelm")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(path, "architecture 'stablelm' is not supported")


def test_metadata_and_tensors_disagree(tmp_path) -> None:
    written = write_gguf(tmp_path / "lie.gguf", tiny_model("llama"), "llama", "Q8_0",
                         metadata={"feed_forward_length": 384})
    _refused(written.path, r"ffn_\w+\.weight has shape \[\d+, \d+\], the model's")


def test_missing_tensor(tmp_path) -> None:
    written = write_gguf(tmp_path / "hole.gguf", tiny_model("qwen2"), "qwen2", "Q8_0",
                         drop=("blk.1.ffn_norm.weight",))
    _refused(written.path, r"no tensor for model\.layers\.1\.post_attention_layernorm\.weight")


def test_starcoder2_without_attention_biases(tmp_path) -> None:
    """llama.cpp runs a StarCoder2 file without q/k/v biases; transformers' model has them
    or none, so such a file is refused naming the missing bias, not run with another one."""
    written = write_gguf(tmp_path / "nobias.gguf", tiny_model("starcoder2"), "starcoder2",
                         "Q8_0", drop=("blk.0.attn_q.bias",))
    _refused(written.path, r"no tensor for model\.layers\.0\.self_attn\.q_proj\.bias")


def test_unknown_tensor(tmp_path) -> None:
    """A tensor the model has no place for (here BERT's token types; Phi-3's LongRoPE
    factors outside Phi-3) is refused, not dropped."""
    written = write_gguf(tmp_path / "types.gguf", tiny_model("phi3"), "phi3", "Q8_0",
                         extra_tensors={"token_types.weight": np.ones(32)})
    _refused(written.path, r"tensor token_types\.weight \(F32\) has no place")
    written = write_gguf(tmp_path / "long.gguf", tiny_model("qwen2"), "qwen2", "Q8_0",
                         extra_tensors={"rope_factors_long.weight": np.ones(32)})
    _refused(written.path, r"tensor rope_factors_long\.weight \(F32\) has no place")


def test_unsupported_rope_scaling(tmp_path) -> None:
    written = write_gguf(tmp_path / "yarn.gguf", tiny_model("qwen2"), "qwen2", "Q8_0",
                         extra_metadata={"qwen2.rope.scaling.type": "yarn",
                                         "qwen2.rope.scaling.factor": 4.0})
    _refused(written.path, "rope scaling 'yarn'")


def test_partial_rotary_outside_phi3(tmp_path) -> None:
    written = write_gguf(tmp_path / "rot.gguf", tiny_model("qwen2"), "qwen2", "Q8_0",
                         extra_metadata={"qwen2.rope.dimension_count": 32})
    _refused(written.path, "rotary dimensions 32")


def test_device(gguf_file) -> None:
    written, _ = gguf_file("llama", "Q8_0")
    _refused(written.path, "CPU only", field="device", device="meta")


def test_not_gguf_and_truncated(tmp_path, gguf_file) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a model")
    _refused(bad, "not a GGUF file")
    written, _ = gguf_file("llama", "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(written.path.read_bytes()[:-100])
    _refused(cut, "runs past the end")


def test_alignment_not_a_power_of_two(tmp_path) -> None:
    for align in (0, 3):
        written = write_gguf(tmp_path / f"a{align}.gguf", tiny_model("llama"), "llama", "Q8_0",
                             extra_metadata={"general.alignment": align})
        _refused(written.path, rf"general\.alignment is {align}, not a power of two")


@pytest.mark.parametrize("key", ["context_length", "block_count", "embedding_length",
                                 "attention.head_count", "attention.layer_norm_rms_epsilon"])
def test_required_metadata_missing(tmp_path, key: str) -> None:
    # (llama.cpp refuses these files too; transformers would fill in its defaults)
    written = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama", "Q8_0",
                         drop_metadata=(f"llama.{key}",))
    _refused(written.path, rf"lacks llama\.{key.replace('.', chr(92) + '.')} \(required")


def test_directory_with_two_files(tmp_path, gguf_file) -> None:
    from ferrobatch.models import load_model

    written, _ = gguf_file("llama", "Q8_0")
    shutil.copy(written.path, tmp_path / "a.gguf")
    shutil.copy(written.path, tmp_path / "b.gguf")
    with pytest.raises(FieldError, match=r"2 GGUF files \(a\.gguf, b\.gguf\)"):
        load_model(tmp_path)


def test_quantized_value_changing_processor(tmp_path, monkeypatch) -> None:
    """A conversion that changes a quantized matrix's values (not just its row order) cannot
    keep it quantized: refused, naming the tensor."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, GGUFTensor

    class Shift(TENSOR_PROCESSORS["llama"]):
        def process(self, weights, name, **kwargs):
            if "ffn_up" in name:
                return GGUFTensor(weights + 1, name, {})
            return super().process(weights, name, **kwargs)

    monkeypatch.setitem(TENSOR_PROCESSORS, "llama", Shift)
    written = write_gguf(tmp_path / "s.gguf", tiny_model("llama"), "llama", "Q4_0")
    _refused(written.path, r"ffn_up\.weight \(Q4_0\) cannot stay quantized")


def test_quantization_of_a_gguf_file(gguf_file) -> None:
    from ferrobatch.models import load_model

    written, _ = gguf_file("llama", "Q8_0")
    with pytest.raises(FieldError) as err:
        load_model(written.path, quantization="q8_0")
    assert err.value.field == "quantization"
