"""gpt-oss GGUF files (`gpt-oss`, as llama.cpp's converter writes them): MXFP4 expert blocks
kept as they are and run on the kernels, the experts' biases and clamped SwiGLU,
attention sinks, every other layer sliding, YaRN; the logits equal the dequantized oracle,
the engine's greedy tokens equal the model's own, and what ferrobatch would compute
differently from llama.cpp is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine
from ferrobatch.cpu import quant_ops
from ferrobatch.errors import FieldError
from ferrobatch.gguf import loader
from ferrobatch.gguf.experts import OssQuantExperts
from ferrobatch.gguf.loader import load_gguf
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_files import (
    assert_greedy_as_generate,
    assert_plan_refused,
    reference_model,
    tiny_model,
    write_gguf,
)

IDS = torch.tensor([[3, 17, 99, 5, 200, 7, 8, 9, 11, 400, 13, 14]])
PROMPTS = [[3, 17, 99, 5, 200], [7, 8, 9, 11, 400, 12, 13, 14, 15, 16, 17, 18], [21]]
#: the experts' tensors of the tiny model's two layers
EXPERTS = tuple(f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down"))
MXFP4_EXPERTS = dict.fromkeys(EXPERTS, "MXFP4")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits[0]


def _mxfp4(rng: np.random.Generator, blocks: int, e: np.ndarray | int) -> np.ndarray:
    out = rng.integers(0, 256, size=(blocks, 17), dtype=np.uint8)
    out[:, 0] = e
    return out


def test_mxfp4_products_at_every_exponent_the_kernels_hold() -> None:
    """MXFP4 blocks at every exponent 104 .. 143 (2^-24 .. 2^15, what the packed panels'
    fp16 `d` holds): the kernels' dequantization is gguf-py's bit for bit, and a product
    is within the activations' int8 rounding of the dequantized weights' product."""
    rng = np.random.default_rng(0)
    blocks = _mxfp4(rng, 40 * 8, np.repeat(np.arange(104, 144), 8)).reshape(8, -1)
    want = dequantize(blocks, GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(quant_ops.dequantize("MXFP4", blocks, 8, 40 * 32), want)
    x = torch.from_numpy(rng.standard_normal((3, 40 * 32)).astype(np.float32))
    got = quant_ops.linear(x, quant_ops.pack("MXFP4", blocks, 8, 40 * 32))
    exact = x.double() @ torch.from_numpy(want).double().T
    step = torch.from_numpy(np.abs(want).astype(np.float64)).sum(1) * x.abs().max() / 127
    assert ((got.double() - exact).abs() <= step).all()


def test_mxfp4_tiny_blocks_are_zero_and_huge_ones_refused() -> None:
    """Below exponent 104 (every weight under 12 * 2^-25) a block counts as zero, as fp16
    rounds its `d`; above 143 (weights of 2^16 and more) packing refuses it by name."""
    rng = np.random.default_rng(1)
    tiny = _mxfp4(rng, 1, 103)
    tiny[:, 1:] = 0x11  # (code 1 everywhere: 2^-25 each)
    assert not quant_ops.dequantize("MXFP4", tiny, 1, 32).any()
    assert dequantize(tiny, GGMLQuantizationType.MXFP4).any()  # (gguf-py: 2^-25)
    huge = np.concatenate([_mxfp4(rng, 2, 120), _mxfp4(rng, 1, 150)]).reshape(1, -1)
    with pytest.raises(FieldError, match=r"MXFP4 block 2 has exponent 150") as err:
        quant_ops.pack("MXFP4", huge, 1, 96)
    assert err.value.field == "blocks"


@pytest.mark.parametrize(("qtype", "types"), [("Q8_0", MXFP4_EXPERTS), ("Q8_0", None),
                                              ("Q4_K", MXFP4_EXPERTS)],
                         ids=["mxfp4-experts", "q8_0", "q4_k-mxfp4-experts"])
def test_logits_equal_the_dequantized_oracle(gguf_file, qtype: str, types: dict | None) -> None:
    written, source = gguf_file("gpt-oss", qtype, types=types)
    model, _ = load_gguf(written.path)
    torch.testing.assert_close(_logits(model), _logits(reference_model(source, written)),
                               rtol=1e-5, atol=1e-5)
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert all(isinstance(e, OssQuantExperts) for e in experts)
    kept = "MXFP4" if types else qtype
    assert {e.down_proj[0].qtype for e in experts} == {kept}
    info = model.ferrobatch_gguf
    f = loader.GGUFFile(written.path)
    assert info.types.get("MXFP4", 0) == (6 if types else 0)
    # (every quantized tensor, MXFP4's too, a view of the file's map)
    assert info.quantized_bytes == info.mapped_bytes == sum(
        t.nbytes for t in f.tensors.values() if t.qtype in ("MXFP4", qtype, "Q8_0"))


def test_float_experts_fill_the_fused_module(gguf_file) -> None:
    """An F32 file: the experts stay `GptOssExperts`, gate and up interleaved, transposed."""
    written, source = gguf_file("gpt-oss", "F32")
    model, _ = load_gguf(written.path)
    assert not any(isinstance(m, OssQuantExperts) for m in model.modules())
    torch.testing.assert_close(_logits(model), _logits(source), rtol=0, atol=0)


def test_config_from_the_metadata(gguf_file) -> None:
    written, source = gguf_file("gpt-oss", "Q8_0", types=MXFP4_EXPERTS)
    c = loader.plan(written.path).config
    want = source.config
    assert (c.model_type, c.head_dim, c.intermediate_size, c.num_local_experts,
            c.num_experts_per_tok, c.sliding_window) == ("gpt_oss", 64, 256, 4, 2, 8)
    assert c.layer_types == want.layer_types == ["sliding_attention", "full_attention"]
    assert (c.swiglu_limit, c.swiglu_alpha) == (7.0, 1.702)
    rope = {k: v for k, v in c.rope_parameters.items() if v is not None}
    assert rope == {k: v for k, v in want.rope_parameters.items() if v is not None}


@pytest.mark.parametrize(("pattern", "slides"), [(3, [True, True, False, True, True, False]),
                                                 (1, [False] * 6), (0, [True] * 6)])
def test_sliding_pattern_as_llama_cpp_reads_it(tmp_path, pattern: int,
                                               slides: list[bool]) -> None:
    written = write_gguf(tmp_path / "p.gguf", tiny_model("gpt-oss", num_hidden_layers=6),
                         "gpt-oss", "Q8_0",
                         extra_metadata={"gpt-oss.attention.sliding_window_pattern": pattern})
    c = loader.plan(written.path).config
    assert c.layer_types == ["sliding_attention" if s else "full_attention" for s in slides]


@pytest.mark.kernel_products
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_engine_greedy_equals_model_generate(gguf_file, qtype: str) -> None:
    """Through the engine on the kernels' products: each request's tokens are the model's
    own greedy tokens, alone and batched."""
    written, _ = gguf_file("gpt-oss", qtype, types=MXFP4_EXPERTS)
    with Engine(str(written.path), config=ContinuousBatchingConfig(num_blocks=64,
                                                                   page_size=16)) as engine:
        assert_greedy_as_generate(engine, PROMPTS)


def _refused(path, match: str) -> None:
    assert_plan_refused(path, match)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(drop=("blk.1.ffn_up_exps.bias",)),
     r"no ffn_up_exps\.bias tensor for model\.layers\.1\.mlp\.experts"),
    (dict(extra_metadata={"gpt-oss.rope.freq_base_swa": 1000.0}),
     r"rope\.freq_base_swa 1000\.0 != rope\.freq_base"),
    (dict(extra_metadata={"gpt-oss.rope.scaling.yarn_log_multiplier": 0.1}),
     r"yarn_log_multiplier 0\.1"),
    (dict(drop_metadata=("gpt-oss.attention.sliding_window",)),
     r"sliding_window must be a positive number"),
    (dict(types={"blk.0.ffn_down_exps.weight": "F32"}), r"mix quantized and float"),
], ids=["bias", "swa-base", "yarn-log", "window", "mixed"])
def test_refused(tmp_path, kw: dict, match: str) -> None:
    written = write_gguf(tmp_path / "r.gguf", tiny_model("gpt-oss"), "gpt-oss", "Q8_0", **kw)
    _refused(written.path, match)


def test_tensor_parallel_refused(gguf_file) -> None:
    """The experts are not split across ranks (as for the other mixtures of experts)."""
    written, _ = gguf_file("gpt-oss", "Q8_0", types=MXFP4_EXPERTS)
    with pytest.raises(FieldError) as err:
        Engine(str(written.path), tensor_parallel_size=2)
    assert err.value.field == "tensor_parallel_size"


@pytest.mark.kernel_products
def test_one_call_a_layer_on_the_kernels(gguf_file, monkeypatch) -> None:
    """Where the kernels run, gpt-oss's experts are one `_core.QuantExperts` call with the
    biases and the clamped SwiGLU: the per-expert loop's outputs to the rounding of the
    sigmoid (and so of the int8 inputs of down), each token's rows the same alone as
    batched. A small clamp makes the clamp matter on the tiny model's outputs."""
    from ferrobatch.gguf import modules

    written, _ = gguf_file("gpt-oss", "Q8_0", types=MXFP4_EXPERTS)
    model, _ = load_gguf(written.path)
    experts = model.model.layers[0].mlp.experts
    experts.limit = 0.02
    torch.manual_seed(0)
    x = torch.randn(6, experts.hidden_dim)
    ids = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [0, 1], [2, 3]])
    w = torch.rand(6, 2)
    with modules.backend("kernel"):
        fused = experts(x, ids, w)
        alone = torch.cat([experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1]) for i in range(6)])
    assert experts._op is not None
    torch.testing.assert_close(alone, fused, rtol=0, atol=0)
    with modules.backend("kernel"), monkeypatch.context() as m:
        m.setattr(type(experts), "_kernels_run", lambda self: False)
        looped = experts(x, ids, w)
        gate = torch.stack([experts.gate_proj[e](x) for e in range(4)])
    assert (gate > experts.limit).float().mean() > 0.2  # (the clamp is exercised)
    scale = looped.abs().max().item()
    torch.testing.assert_close(fused, looped, rtol=0, atol=2e-3 * scale)
