"""Mixture-of-experts GGUF files (`qwen3moe`, `qwen2moe`, and Mixtral: `llama` with experts):
the experts' 3-D tensors stay
quantized (one `QuantLinear` an expert, views of the file's blocks), the logits equal the
dequantized oracle, the config takes llama.cpp's MoE metadata, the engine's greedy tokens
equal the model's own, and what llama.cpp would compute otherwise is refused by name."""

from __future__ import annotations

import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine
from ferrobatch.errors import FieldError
from ferrobatch.gguf import loader
from ferrobatch.gguf.experts import QuantExperts
from ferrobatch.gguf.loader import load_gguf
from ferrobatch.gguf.modules import QuantLinear
from gguf_files import (
    assert_greedy_as_generate,
    assert_plan_refused,
    reference_model,
    tiny_model,
    write_gguf,
)

IDS = torch.tensor([[3, 17, 99, 5, 200, 7, 8, 9, 11, 400, 13, 14]])
PROMPTS = [[3, 17, 99, 5, 200], [7, 8, 9, 11, 400, 12, 13, 14, 15, 16, 17, 18], [21]]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits[0]


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.experts for layer in model.model.layers]


@pytest.mark.parametrize(("arch", "qtype"), [("qwen3moe", "Q4_K"), ("qwen3moe", "Q8_0"),
                                             ("qwen2moe", "Q6_K"), ("qwen2moe", "Q4_0"),
                                             ("mixtral", "Q5_K"), ("mixtral", "Q8_0")])
def test_quantized_experts_equal_the_dequantized_oracle(gguf_file, arch: str,
                                                        qtype: str) -> None:
    written, source = gguf_file(arch, qtype)
    model, _ = load_gguf(written.path)
    torch.testing.assert_close(_logits(model), _logits(reference_model(source, written)),
                               rtol=1e-5, atol=1e-5)
    f = loader.GGUFFile(written.path)
    for i, experts in enumerate(_experts(model)):
        assert isinstance(experts, QuantExperts) and experts.num_experts == 4
        stacked = f.raw(f"blk.{i}.ffn_down_exps.weight").nbytes
        first = experts.down_proj[0].weight_q.data
        for e, down in enumerate(experts.down_proj):
            # expert e: its rows of the file's stacked tensor, a view of one storage
            assert isinstance(down, QuantLinear) and down.qtype == qtype
            data = down.weight_q.data
            assert data.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            assert data.data_ptr() - first.data_ptr() == e * stacked // 4
    info = model.ferrobatch_gguf
    # (Q8_0: llama.cpp's type for rows that are not whole blocks of `qtype`)
    assert info.quantized_bytes == sum(t.nbytes for t in f.tensors.values()
                                       if t.qtype in (qtype, "Q8_0"))
    # (a `llama` file's q/k rows are reordered: a copy, not a view of the map)
    permuted = sum(t.nbytes for t in f.tensors.values()
                   if arch == "mixtral" and (".attn_q." in t.name or ".attn_k." in t.name))
    assert info.mapped_bytes == info.quantized_bytes - permuted


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral"])
def test_float_experts_fill_the_fused_module(gguf_file, arch: str) -> None:
    """An F16 file: the experts stay transformers' fused module, gate and up side by side."""
    written, source = gguf_file(arch, "F16")
    model, _ = load_gguf(written.path)
    assert not any(isinstance(m, QuantExperts) for m in model.modules())
    torch.testing.assert_close(_logits(model), _logits(reference_model(source, written)),
                               rtol=1e-5, atol=1e-5)


def test_shared_expert_gate_as_a_matrix(tmp_path) -> None:
    """llama.cpp's converter now writes Qwen2-MoE's shared expert gate as [1, hidden] (older
    files: a vector); both load as the model's [1, hidden] gate, with the same logits."""
    source = tiny_model("qwen2moe")
    names = [f"blk.{i}.ffn_gate_inp_shexp.weight" for i in range(2)]
    gates = {name: layer.mlp.shared_expert_gate.weight.detach().numpy().copy()
             for name, layer in zip(names, source.model.layers, strict=True)}
    assert all(g.shape == (1, 256) for g in gates.values())
    matrix = write_gguf(tmp_path / "matrix.gguf", source, "qwen2moe", "Q4_0", drop=tuple(names),
                        extra_tensors=gates)
    vector = write_gguf(tmp_path / "vector.gguf", source, "qwen2moe", "Q4_0")
    assert loader.GGUFFile(matrix.path).tensors[names[0]].shape == (1, 256)
    assert loader.GGUFFile(vector.path).tensors[names[0]].shape == (256,)
    a, _ = load_gguf(matrix.path)
    b, _ = load_gguf(vector.path)
    assert a.model.layers[0].mlp.shared_expert_gate.weight.shape == (1, 256)
    torch.testing.assert_close(_logits(a), _logits(b), rtol=0, atol=0)


def test_moe_config_from_the_metadata(gguf_file) -> None:
    """transformers' mapping drops the experts' width and llama.cpp's renormalization."""
    w, _ = gguf_file("qwen3moe", "Q8_0")
    c = loader.plan(w.path).config
    assert (c.model_type, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == \
        ("qwen3_moe", 4, 2, 256)
    assert c.norm_topk_prob and c.decoder_sparse_step == 1 and c.mlp_only_layers == []
    w, _ = gguf_file("qwen2moe", "Q8_0")
    c = loader.plan(w.path).config
    assert (c.model_type, c.shared_expert_intermediate_size) == ("qwen2_moe", 512)
    assert not c.norm_topk_prob
    # Mixtral: a `llama` file with experts, `feed_forward_length` wide, whole context
    w, _ = gguf_file("mixtral", "Q8_0")
    c = loader.plan(w.path).config
    assert (c.model_type, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size,
            c.head_dim, c.sliding_window) == ("mixtral", 4, 2, 512, 64, None)


@pytest.mark.parametrize(("arch", "qtype"), [("qwen3moe", "Q4_K"), ("qwen2moe", "Q8_0"),
                                             ("mixtral", "Q4_K")])
def test_engine_greedy_equals_model_generate(gguf_file, arch: str, qtype: str) -> None:
    """Through the engine (the kernels' products): each request's tokens are the model's own
    greedy tokens, and the same alone as batched. The layers run lean (their attention on
    the fused kernels, the MoE block as its module, Qwen2-MoE's float shared-expert gate
    inside it)."""
    written, _ = gguf_file(arch, qtype)
    with Engine(str(written.path), config=ContinuousBatchingConfig(num_blocks=64,
                                                                   page_size=16)) as engine:
        assert engine.runner.activations.lean is not None
        assert_greedy_as_generate(engine, PROMPTS)


def _refused(path, match: str) -> None:
    assert_plan_refused(path, match)


def test_missing_expert_tensor_refused(tmp_path) -> None:
    written = write_gguf(tmp_path / "noup.gguf", tiny_model("qwen3moe"), "qwen3moe", "Q8_0",
                         drop=("blk.1.ffn_up_exps.weight",))
    _refused(written.path, r"no ffn_up_exps\.weight tensor for model\.layers\.1\.mlp\.experts")


def test_mixed_expert_types_refused(tmp_path) -> None:
    written = write_gguf(tmp_path / "mixed.gguf", tiny_model("qwen3moe"), "qwen3moe", "Q8_0",
                         types={"blk.0.ffn_down_exps.weight": "F32"})
    _refused(written.path, r"experts of model\.layers\.0\.mlp\.experts mix quantized and float")


@pytest.mark.parametrize(("extra", "match"), [
    ({"qwen3moe.expert_gating_func": 2}, r"expert_gating_func 2 is not supported"),
    ({"qwen3moe.expert_weights_scale": 2.5}, r"expert_weights_scale 2\.5 is not supported"),
])
def test_other_routing_refused(tmp_path, extra: dict, match: str) -> None:
    written = write_gguf(tmp_path / "route.gguf", tiny_model("qwen3moe"), "qwen3moe", "Q8_0",
                         extra_metadata=extra)
    _refused(written.path, match)


def test_missing_expert_width_refused(tmp_path) -> None:
    written = write_gguf(tmp_path / "nowidth.gguf", tiny_model("qwen3moe"), "qwen3moe",
                         "Q8_0", drop_metadata=("qwen3moe.expert_feed_forward_length",))
    _refused(written.path, r"lacks qwen3moe\.expert_feed_forward_length")


def test_tensor_parallel_refused(gguf_file) -> None:
    written, _ = gguf_file("qwen3moe", "Q8_0")
    with pytest.raises(FieldError) as err:
        Engine(str(written.path), tensor_parallel_size=2)
    assert err.value.field == "tensor_parallel_size"


@pytest.mark.kernel_products
def test_one_call_a_layer_on_the_kernels(gguf_file, monkeypatch) -> None:
    """Where the kernels run, each MoE layer's experts are one `_core.QuantExperts` call:
    the per-expert `QuantLinear` loop's outputs on the same kernels to the rounding of
    `silu` (and so of the int8 inputs of down), each token's rows the same alone as
    batched; an engine packs the experts for it and no copy of their gate and up rows of
    their own."""
    from ferrobatch.gguf import modules

    written, _ = gguf_file("qwen3moe", "Q4_K")
    model, _ = load_gguf(written.path)
    experts = _experts(model)[0]
    torch.manual_seed(0)
    x = torch.randn(6, experts.hidden_dim)
    ids = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [0, 1], [2, 3]])
    w = torch.rand(6, 2)
    with modules.backend("kernel"):
        fused = experts(x, ids, w)
        alone = torch.cat([experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1]) for i in range(6)])
    assert experts._op is not None
    torch.testing.assert_close(alone, fused, rtol=0, atol=0)
    with modules.probe_weights([m for m in model.modules() if isinstance(m, QuantLinear)], []):
        assert not experts._kernels_run()  # (probes: the per-expert loop, their stand-ins)
    with modules.backend("kernel"), monkeypatch.context() as m:
        m.setattr(type(experts), "_kernels_run", lambda self: False)
        looped = experts(x, ids, w)
    scale = looped.abs().max().item()
    torch.testing.assert_close(fused, looped, rtol=0, atol=2e-3 * scale)

    with Engine(str(written.path), config=ContinuousBatchingConfig(num_blocks=64,
                                                                   page_size=16)) as engine:
        for layer in _experts(engine.model):
            assert layer._op is not None and layer._op.num_experts == 4
            for own in (*layer.gate_proj, *layer.up_proj):
                assert id(own.weight_q.data) not in modules.kernel_ops()._packed
            assert all(id(d.weight_q.data) in modules.kernel_ops()._packed
                       for d in layer.down_proj)


def test_one_call_refuses_bad_routes_naming_the_field(gguf_file) -> None:
    from ferrobatch import _core
    from ferrobatch.gguf import modules

    written, _ = gguf_file("qwen3moe", "Q8_0")
    model, _ = load_gguf(written.path)
    with modules.backend("kernel"):
        op = _experts(model)[0]._fused_op()
    x = torch.zeros(2, 256).numpy()
    out = torch.zeros(2, 256).numpy()
    w = torch.ones(2, 2).numpy()
    for ids, field in ((torch.tensor([[0, 7], [1, 2]]), "ids"),
                       (torch.tensor([[0, 1]]), "ids"),
                       (torch.tensor([[0, 1], [1, 2]], dtype=torch.int32), "ids")):
        with pytest.raises(FieldError) as err:
            op.forward(x, ids.numpy(), w, out)
        assert err.value.field == field
    with pytest.raises(FieldError) as err:
        op.forward(x, torch.tensor([[0, 1], [1, 2]]).numpy(), w, torch.zeros(2, 3).numpy())
    assert err.value.field == "out"
    with pytest.raises(FieldError) as err:
        _core.QuantExperts(gate_up=[], down=[], hidden=256, inter=256)
    assert err.value.field == "gate_up"


def test_mixtral_without_used_count_refused(tmp_path) -> None:
    written = write_gguf(tmp_path / "noused.gguf", tiny_model("mixtral"), "mixtral", "Q8_0",
                         drop_metadata=("llama.expert_used_count",))
    _refused(written.path, r"lacks llama\.expert_used_count")
