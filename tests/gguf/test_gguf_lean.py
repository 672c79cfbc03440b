"""The pieces of a GGUF model's lean path: stacked quantized products (`QuantProduct`) bit
for bit their members' own `QuantLinear` products, on the kernels and on the reference path,
and the construction checks' stand-in weights (`few_layers`, `probe_weights`)."""

from __future__ import annotations

import pytest
import torch
from ferrobatch.gguf import modules
from ferrobatch.gguf.loader import load_gguf
from ferrobatch.gguf.modules import QuantLinear
from ferrobatch.runner.quant_linears import QuantLinears

# value projection of the first layer in another type than q/k (as Q4_K_M files do)
MIXED = {"blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_up.weight": "Q8_0"}


def _model(gguf_file) -> torch.nn.Module:
    written, _ = gguf_file("qwen2", "Q4_K", types=MIXED)
    return load_gguf(written.path)[0]


def _own(layers: list[QuantLinear], x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([m(x) for m in layers], dim=1)


@pytest.mark.kernel_products
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_stacked_products_equal_their_members(gguf_file, rows: int, backend: str) -> None:
    model = _model(gguf_file)
    quant = QuantLinears.of(model)
    assert quant is not None
    gen = torch.Generator().manual_seed(rows)
    with modules.backend(backend):
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for members in ([attn.q_proj, attn.k_proj, attn.v_proj],
                            [mlp.gate_proj, mlp.up_proj], [attn.o_proj], [mlp.down_proj]):
                product = quant.packed_of(members)
                assert product is not None and product.sizes == [m.out_features
                                                                 for m in members]
                x = torch.randn(rows, members[0].in_features, generator=gen)
                got = quant.wide_product(product, x)
                assert torch.equal(got, _own(members, x)), [m.qtype for m in members]
                # into a caller's buffer (the lean layers' gate/up one): the same values
                out = torch.full((rows, quant.width(product)), float("nan"))
                into = quant.wide_product(product, x, out)
                assert into.data_ptr() == out.data_ptr() and torch.equal(into, got)
    q = model.model.layers[0].self_attn
    # q/k of one type stacked into one part, v (Q6_K) a part of its own
    assert [len(p.members) for p in quant.packed_of([q.q_proj, q.k_proj, q.v_proj]).parts] \
        == [2, 1]
    assert quant.packed_of([q.q_proj, torch.nn.Linear(256, 4)]) is None


def test_few_layers_stand_ins(gguf_file) -> None:
    """The first layer of each kind keeps its weights (dequantized), the others give their
    biases, the head its first rows; all restored after the block."""
    model = _model(gguf_file)
    layers = model.model.layers
    head = model.get_output_embeddings()
    x = torch.randn(3, 256)
    kept, zeroed = layers[0].self_attn.q_proj, layers[1].self_attn.q_proj
    with torch.inference_mode():
        before = [kept(x), zeroed(x), head(x)]
        with modules.backend("reference"):
            exact = [kept(x), head(x)]
        with modules.few_layers(model, ["full", "full"], head_rows=100):
            assert modules.probing()
            assert torch.equal(kept(x), exact[0])
            assert torch.equal(zeroed(x), zeroed.bias.expand(3, -1))
            logits = head(x)
            assert torch.equal(logits[:, :100], exact[1][:, :100])
            assert not logits[:, 100:].any()
        assert not modules.probing()
        after = [kept(x), zeroed(x), head(x)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with torch.inference_mode(), modules.few_layers(model, None):
        assert not head(x).any() and torch.equal(kept(x), kept.bias.expand(3, -1))


def test_mixed_files_keep_the_packed_linears(gguf_file) -> None:
    """A plain `nn.Linear` next to quantized ones: no `QuantLinears` (the packed linears
    take the plain layers; the lean layers need one kind of product)."""
    written, _ = gguf_file("llama", "Q4_0", types={"blk.0.attn_q.weight": "F32"})
    assert QuantLinears.of(load_gguf(written.path)[0]) is None


def test_few_layers_keeps_one_layer_of_each_kind(gguf_file) -> None:
    """Gemma 3 (five sliding layers, then a full one): the stand-ins keep the weights of the
    first sliding and the first full layer, every other decoder layer's products give
    their biases only."""
    written, _ = gguf_file("gemma3", "Q8_0")
    model = load_gguf(written.path)[0]
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    layers = model.model.layers
    with modules.few_layers(model, kinds):
        for i, layer in enumerate(layers):
            for m in layer.modules():
                if isinstance(m, QuantLinear):
                    stand_in = modules._probe_weights[id(m)]
                    assert stand_in.rows == (m.out_features if i in (0, 5) else 0), (i, m)
    assert not modules.probing()
