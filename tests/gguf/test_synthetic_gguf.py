"""`benches/synthetic_gguf.py`: random-weight GGUF files of a real model's shapes and
llama.cpp's Q4_K_M type mix (the 8B memory and speed figures come from one)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from gguf_files import add_tiny_tokenizer

_PATH = Path(__file__).resolve().parents[2] / "benches" / "synthetic_gguf.py"


@pytest.fixture(scope="module")
def synthetic() -> object:
    spec = importlib.util.spec_from_file_location("synthetic_gguf", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def donor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("donor") / "donor.gguf"
    w = gguf.GGUFWriter(path, "llama")
    add_tiny_tokenizer(w, 512)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def test_more_bits_layers_as_llama_cpp(synthetic) -> None:
    # Qwen2.5-1.5B's Q4_K_M file: attn_v / ffn_down of 14 of its 28 layers are Q6_K
    assert sum(synthetic._more_bits(i, 28) for i in range(28)) == 14
    layers = [i for i in range(32) if synthetic._more_bits(i, 32)]
    assert layers[:5] == [0, 1, 2, 3, 6] and layers[-4:] == [28, 29, 30, 31]


def test_tiny_file_types_values_and_engine(synthetic, donor: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    size = synthetic.write("tiny", path, donor)
    assert size == path.stat().st_size
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_gate.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 512
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_K", "Q6_K"):
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            assert np.isfinite(values).all() and 1e-4 < np.abs(values).mean() < 0.1
    config = ContinuousBatchingConfig(num_blocks=32, page_size=16)
    with Engine(str(path), config=config) as engine:
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4,
                                                             logprobs=1), progress=False)[0]
    assert len(out.token_ids) == 4
    assert all(math.isfinite(out.logprobs[i][t]) for i, t in enumerate(out.token_ids))


def test_gemma3_shape_falls_back_and_runs_lean(synthetic, donor: Path, tmp_path: Path) -> None:
    """A Gemma 3 shape of width 384 (not whole 256-weight blocks): its K-type matrices of
    that width fall back to Q5_0 (Q4_K) and Q8_0 (Q6_K) as llama.cpp's are; the sandwich
    norms and q/k norms are written; the engine runs its layers lean."""
    path = tmp_path / "gemma3.gguf"
    synthetic.write("tiny-gemma3", path, donor)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.1.attn_v.weight"] == "Q8_0"
    assert types["blk.1.ffn_down.weight"] == "Q6_K" and types["blk.0.attn_output.weight"] \
        == "Q4_K"
    for name in ("post_attention_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm"):
        assert types[f"blk.1.{name}.weight"] == "F32"
    config = ContinuousBatchingConfig(num_blocks=32, page_size=16)
    with Engine(str(path), config=config) as engine:
        assert engine.runner.activations.lean is not None
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4), progress=False)
    assert len(out[0].token_ids) == 4


def test_single_type_mix_and_refusal(synthetic, donor: Path, tmp_path: Path) -> None:
    synthetic.write("tiny", tmp_path / "q8.gguf", donor, mix="Q8_0")
    types = {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors}
    assert types == {"Q8_0", "F32"}
    with pytest.raises(ValueError, match="IQ4_XS"):
        synthetic.random_blocks("IQ4_XS", 1, 256, np.random.default_rng(0))


def test_moe_shape_and_layers(synthetic, donor: Path, tmp_path: Path) -> None:
    """A Qwen3-MoE shape: 3-D expert tensors (ffn_down_exps Q6_K in the more-bits layers),
    the router in F32, `layers` cutting the shape's depth; the engine runs it."""
    path = tmp_path / "moe.gguf"
    synthetic.write("tiny-moe", path, donor, layers=1)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert not any(name.startswith("blk.1.") for name in tensors)
    down = tensors["blk.0.ffn_down_exps.weight"]
    assert down.tensor_type.name == "Q6_K" and list(down.shape) == [256, 256, 4]
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type.name == "Q4_K"
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    config = ContinuousBatchingConfig(num_blocks=32, page_size=16)
    with Engine(str(path), config=config) as engine:
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4), progress=False)
    assert len(out[0].token_ids) == 4


def test_phi3_shape(synthetic, donor: Path, tmp_path: Path) -> None:
    """A Phi-3 shape: one attn_qkv (Q5_K in Q4_K_M, as llama.cpp) and one ffn_up of gate
    and up rows a layer; the engine runs its layers lean."""
    path = tmp_path / "phi3.gguf"
    synthetic.write("tiny-phi3", path, donor)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    qkv, up = tensors["blk.0.attn_qkv.weight"], tensors["blk.0.ffn_up.weight"]
    assert qkv.tensor_type.name == "Q5_K" and list(qkv.shape) == [256, 3 * 256]
    assert list(up.shape) == [256, 2 * 512] and "blk.0.ffn_gate.weight" not in tensors
    config = ContinuousBatchingConfig(num_blocks=32, page_size=16)
    with Engine(str(path), config=config) as engine:
        assert engine.runner.activations.lean is not None
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4), progress=False)
    assert len(out[0].token_ids) == 4


def test_gpt_oss_shape(synthetic, donor: Path, tmp_path: Path) -> None:
    """A gpt-oss shape in llama.cpp's MXFP4_MOE mix: MXFP4 experts with F32 biases, every
    other matrix Q8_0 (a width of 288: not whole 256-blocks), sinks, YaRN; the engine runs
    it on the MXFP4 kernels."""
    path = tmp_path / "oss.gguf"
    synthetic.write("tiny-oss", path, donor, mix="MXFP4_MOE")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert tensors["blk.0.ffn_up_exps.weight"].tensor_type.name == "MXFP4"
    assert tensors["blk.0.ffn_up_exps.bias"].tensor_type.name == "F32"
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "Q8_0"
    assert "blk.0.attn_sinks.weight" in tensors and "blk.0.ffn_norm.weight" not in tensors
    config = ContinuousBatchingConfig(num_blocks=32, page_size=16)
    with Engine(str(path), config=config) as engine:
        assert engine.model.model.layers[0].mlp.experts.down_proj[0].qtype == "MXFP4"
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4), progress=False)
    assert len(out[0].token_ids) == 4
