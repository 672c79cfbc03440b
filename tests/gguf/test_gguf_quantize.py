"""Quantize on load: `Engine(path, quantization=...)` / `load_model(..., quantization=...)`
over a float checkpoint (Q8_0 / Q4_0 / Q4_1 with gguf-py's quantizers, the K-types with the
kernels' `quant_ops.quantize`)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.cpu import quant_ops
from ferrobatch.errors import FieldError
from ferrobatch.gguf import quantize as quant
from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear
from ferrobatch.models import load_model
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_files import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model = tiny_model("qwen2")  # tied embeddings, q/k/v biases
    d = Path(tmp_path_factory.mktemp("qwen2-ckpt"))
    model.save_pretrained(d)
    return d, model


@pytest.mark.parametrize("name", ["q8_0", "Q4_0", "q4_1", "q5_0", "Q5_1"])
def test_values_are_gguf_quantized(checkpoint, name: str) -> None:
    path, source = checkpoint
    model, _ = load_model(path, quantization=name)
    qtype = name.upper()
    gt = GGMLQuantizationType[qtype]
    layer = model.model.layers[1].self_attn.q_proj
    assert isinstance(layer, QuantLinear) and layer.qtype == qtype
    w = source.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    assert np.array_equal(layer.qdata.numpy(), quantize(w, gt))
    torch.testing.assert_close(layer.bias, source.model.layers[1].self_attn.q_proj.bias)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, QuantEmbedding) and head.weight_q is emb.weight_q  # tied
    e = source.model.embed_tokens.weight.detach().numpy()
    want = dequantize(quantize(e, gt), gt).reshape(e.shape)
    assert np.array_equal(emb(torch.arange(e.shape[0])).numpy(), want)
    assert model.ferrobatch_quantization["qtype"] == qtype
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear]


#: relative RMS error bounds of the K-type quantizers on normal weights (the kernels' tests)
K_BOUNDS = {"Q4_K": 0.10, "Q5_K": 0.05, "Q6_K": 0.028}


def _dequantized_twin(model: torch.nn.Module, source: torch.nn.Module) -> torch.nn.Module:
    """`source` (a copy) with every weight `model` quantized replaced by its dequantized
    values (`gguf.quants.dequantize`, the oracle): the float model the quantized one is."""
    twin = copy.deepcopy(source).eval()
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear | QuantEmbedding):
            qw = m.weight_q
            values = dequantize(qw.data.numpy(), GGMLQuantizationType[qw.qtype])
            with torch.no_grad():
                twin.get_submodule(name).weight.copy_(
                    torch.from_numpy(values.reshape(qw.n, qw.k)))
    return twin


@pytest.mark.parametrize("name", ["q4_k", "Q5_K", "q6_k"])
def test_k_types_are_the_kernels_quantization(checkpoint, name: str) -> None:
    path, source = checkpoint
    model, _ = load_model(path, quantization=name)
    qtype = name.upper()
    layer = model.model.layers[1].mlp.down_proj  # k = 512: two blocks a row
    assert isinstance(layer, QuantLinear) and layer.qtype == qtype
    w = source.model.layers[1].mlp.down_proj.weight.detach()
    assert torch.equal(layer.qdata, quant_ops.quantize(w, name))
    got = dequantize(layer.qdata.numpy(), GGMLQuantizationType[qtype]).reshape(w.shape)
    err = np.sqrt(((got - w.numpy()) ** 2).sum() / (w.numpy() ** 2).sum())
    assert err < K_BOUNDS[qtype]
    assert model.ferrobatch_quantization["float_layers"] == []
    # the model is its dequantized twin (reference products: fp32 on dequantized weights)
    twin = _dequantized_twin(model, source)
    ids = torch.tensor([[5, 6, 7, 8, 100, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=1e-5, atol=1e-5)


def _assert_greedy_equals(engine: Engine, reference: torch.nn.Module) -> None:
    """The engine's greedy tokens for two prompts are `reference.generate`'s, each alone."""
    prompts = [[5, 6, 7, 8], [100, 3, 9]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8), progress=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = reference.generate(torch.tensor([prompt]), max_new_tokens=8,
                                     do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_engine_q4_k_greedy_equals_its_dequantized_twin(checkpoint) -> None:
    path, source = checkpoint
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16)
    with Engine(str(path), config=config, quantization="q4_k") as engine:
        _assert_greedy_equals(engine, _dequantized_twin(engine.model, source))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k",
                                  "q6_k"])
def test_bad_weights_are_refused_naming_the_tensor(tmp_path: Path, name: str) -> None:
    model = tiny_model("qwen2")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[3, 7] = float("nan")
        model.model.layers[1].mlp.up_proj.weight[5, 40] = 1e9  # past every fp16 scale
    model.save_pretrained(tmp_path / "nan")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[3, 7] = 0.0
    model.save_pretrained(tmp_path / "large")
    with pytest.raises(FieldError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: "
                                         r"w: row 3, column 7 is NaN") as err:
        load_model(tmp_path / "nan", quantization=name)
    assert err.value.field == "quantization"
    large = (r"model\.layers\.1\.mlp\.up_proj\.weight: w: row 5, columns (32\.\.64|0\.\.256): "
             rf"weights too large for {name}'s")
    with pytest.raises(FieldError, match=large) as err:
        load_model(tmp_path / "large", quantization=name)
    assert err.value.field == "quantization"


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_engine_greedy_equals_model_generate(checkpoint, name: str) -> None:
    path, _ = checkpoint
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16)
    with Engine(str(path), config=config, quantization=name) as engine:
        assert isinstance(engine.model.lm_head, QuantLinear)
        _assert_greedy_equals(engine, engine.model)


def test_refusals(checkpoint, monkeypatch) -> None:
    path, source = checkpoint
    with monkeypatch.context() as m:  # kernels without the K-type quantizer
        m.setattr(quant, "kernel_ops", lambda: None)
        for bad in ("q4_k", "q6_k", "Q5_K"):
            with pytest.raises(FieldError, match="K-type quantizer") as err:
                load_model(path, quantization=bad)
            assert err.value.field == "quantization"
    with pytest.raises(FieldError, match="iq4_nl") as err:
        load_model(path, quantization="iq4_nl")
    assert err.value.field == "quantization"
    with pytest.raises(FieldError, match="one of") as err:
        load_model(path, quantization="int4")
    assert err.value.field == "quantization"
    for served in ("q3_k", "Q2_K", "iq4_xs"):  # GGUF files' types with no quantizer here
        with pytest.raises(FieldError, match="served from GGUF files only") as err:
            load_model(path, quantization=served)
        assert err.value.field == "quantization"
    with pytest.raises(FieldError, match="never converted"):
        load_model(source, quantization="q8_0")
    with pytest.raises(FieldError) as err:
        load_model(path, quantization="q8_0", device="meta")
    assert err.value.field == "device"


def test_kernel_quantizer_used_for_k_types(checkpoint, monkeypatch) -> None:
    """With a K-type quantizer from the kernels (`quant_ops.quantize`), K-types load."""
    from types import SimpleNamespace

    from ferrobatch.gguf import modules
    from gguf_files import _random_k_blocks

    rng = np.random.default_rng(0)

    def fake_quantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
        return torch.from_numpy(_random_k_blocks(qtype, w.shape[0], w.shape[1], rng))

    fake = SimpleNamespace(quantize=fake_quantize, linear=None, dequantize=None)
    monkeypatch.setattr(quant, "kernel_ops", lambda: fake)
    monkeypatch.setattr(modules, "kernel_ops", lambda: None)  # products: the reference
    path, _ = checkpoint
    model, _ = load_model(path, quantization="q4_k")
    assert model.model.layers[0].mlp.down_proj.qtype == "Q4_K"
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_cli_flag() -> None:
    from ferrobatch.cli.flags import build_parser

    for name in ("q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "Q4_K"):
        args = build_parser().parse_args(["generate", "some/dir", "--quantization", name,
                                          "--prompt", "x"])
        assert args.quantization == name.lower()


@pytest.mark.parametrize(("name", "fallback"), [("q4_k", "Q5_0"), ("q5_k", "Q5_1"),
                                                ("q6_k", "Q8_0")])
def test_k_type_widths_not_whole_blocks_take_llama_cpp_fallback(tmp_path: Path, name: str,
                                                                  fallback: str) -> None:
    """A 224-wide model (not whole 256-weight blocks): the matrices that take 224 inputs get
    llama.cpp's fallback type (gguf-py's quantizer), the 512-wide down projections the K-type;
    the engine's greedy tokens are the dequantized twin's."""
    source = tiny_model("qwen2", hidden_size=224)
    source.save_pretrained(tmp_path)
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16)
    with Engine(str(tmp_path), config=config, quantization=name) as engine:
        model = engine.model
        summary = model.ferrobatch_quantization
        assert summary["float_layers"] == []
        assert "model.layers.0.self_attn.q_proj" in summary["fallback_layers"]
        q, down = model.model.layers[1].self_attn.q_proj, model.model.layers[1].mlp.down_proj
        assert (q.qtype, down.qtype) == (fallback, name.upper())
        w = source.model.layers[1].self_attn.q_proj.weight.detach().numpy()
        assert np.array_equal(q.qdata.numpy(), quantize(w, GGMLQuantizationType[fallback]))
        assert model.get_input_embeddings().weight_q.qtype == fallback
        _assert_greedy_equals(engine, _dequantized_twin(model, source))


def test_type_for_width() -> None:
    assert quant.type_for_width("Q4_K", 512) == "Q4_K"
    assert quant.type_for_width("Q4_K", 576) == "Q5_0"
    assert quant.type_for_width("Q6_K", 896) == "Q8_0"
    assert quant.type_for_width("Q4_K", 100) is None  # not whole 32-weight blocks either
    assert quant.type_for_width("Q8_0", 576) == "Q8_0"
    assert quant.type_for_width("Q4_0", 48) is None
