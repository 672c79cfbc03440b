"""Quantize on load: `Engine(path, quantization=...)` / `load_model(..., quantization=...)`
over a float checkpoint (Q8_0 / Q4_0 / Q4_1 with gguf-py's quantizers; K-types refused
until the kernels bring a quantizer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
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


@pytest.mark.parametrize("name", ["q8_0", "Q4_0", "q4_1"])
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


def test_engine_greedy_equals_model_generate(checkpoint) -> None:
    path, _ = checkpoint
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16)
    with Engine(str(path), config=config, quantization="q4_0") as engine:
        assert isinstance(engine.model.lm_head, QuantLinear)
        prompts = [[5, 6, 7, 8], [100, 3, 9]]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=8), progress=False)
        for prompt, out in zip(prompts, outs, strict=True):
            with torch.inference_mode():
                ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=8,
                                            do_sample=False)[0, len(prompt):].tolist()
            assert out.token_ids == ref


def test_refusals(checkpoint) -> None:
    path, source = checkpoint
    for bad in ("q4_k", "q6_k", "Q5_K"):
        with pytest.raises(FieldError, match="K-type quantizer") as err:
            load_model(path, quantization=bad)
        assert err.value.field == "quantization"
    with pytest.raises(FieldError, match="one of") as err:
        load_model(path, quantization="int4")
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

    args = build_parser().parse_args(["generate", "some/dir", "--quantization", "q8_0",
                                      "--prompt", "x"])
    assert args.quantization == "q8_0"
