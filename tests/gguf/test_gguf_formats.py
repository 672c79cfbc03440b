"""`QuantWeight`, the reference dequantization and `QuantLinear` / `QuantEmbedding` against
`gguf.quants` (the oracle), and the kernel / reference backend switch."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ferrobatch.gguf import modules
from ferrobatch.gguf.formats import QUANT_TYPES, QuantWeight, dequantize_reference, row_bytes
from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear, backend, quant_linear
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_files import K_TYPES, _random_k_blocks, quantize_iq4_nl


def random_weight(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    rng = np.random.default_rng(seed)
    if qtype in K_TYPES:  # (no gguf-py quantizer)
        data = _random_k_blocks(qtype, n, k, rng)
    elif qtype == "IQ4_NL":  # (gguf-py cannot quantize it)
        data = quantize_iq4_nl(rng.standard_normal((n, k)).astype(np.float32) * 0.1)
    else:
        data = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1,
                        GGMLQuantizationType[qtype])
    return QuantWeight(qtype, n, k, torch.from_numpy(np.ascontiguousarray(data)))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_reference_dequantize_is_gguf(qtype: str) -> None:
    w = random_weight(qtype, 24, 512)
    want = dequantize(w.data.numpy(), GGMLQuantizationType[qtype]).reshape(24, 512)
    got = dequantize_reference(w)
    assert got.dtype == torch.float32 and got.shape == (24, 512)
    assert np.array_equal(got.numpy(), want)
    assert w.row_bytes == row_bytes(qtype, 512) and w.nbytes == 24 * w.row_bytes


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quant_linear_matches_dequantized_product(qtype: str) -> None:
    w = random_weight(qtype, 40, 256, seed=1)
    bias = torch.randn(40)
    layer = QuantLinear(w, bias)
    x = torch.randn(3, 5, 256)
    want = F.linear(x, dequantize_reference(w), bias)
    got = layer(x)
    assert got.shape == (3, 5, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # computes in fp32 whatever the input, returns the input's dtype
    half = layer(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    # nothing dequantized is kept: the module holds the blocks and the bias only
    assert [b.dtype for b in layer.buffers()] == [torch.uint8]
    assert [p.shape for p in layer.parameters()] == [(40,)]


def test_reference_chunks_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond `REFERENCE_CHUNK` weights the reference dequantizes row slices: same result."""
    w = random_weight("Q4_K", 100, 256, seed=2)
    x = torch.randn(4, 256)
    whole = quant_linear(x, w)
    monkeypatch.setattr(modules, "REFERENCE_CHUNK", 256 * 7)
    torch.testing.assert_close(quant_linear(x, w), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_quant_embedding_rows(qtype: str) -> None:
    w = random_weight(qtype, 64, 256, seed=3)
    table = dequantize_reference(w)
    emb = QuantEmbedding(w, torch.float32)
    ids = torch.tensor([[5, 0, 5, 63], [1, 2, 3, 4]])
    assert torch.equal(emb(ids), F.embedding(ids, table))
    scaled = QuantEmbedding(w, torch.bfloat16, embed_scale=torch.tensor(16.0))
    want = F.embedding(ids, table).to(torch.bfloat16) * torch.tensor(16.0).to(torch.bfloat16)
    assert torch.equal(scaled(ids), want)
    # one token (a decode step's lookup, without the sort and gather): same rows, shapes
    for one in (torch.tensor([[63]]), torch.tensor([7]), torch.tensor(5)):
        assert torch.equal(emb(one), F.embedding(one, table))
        assert torch.equal(scaled(one), F.embedding(one, table).to(torch.bfloat16)
                           * torch.tensor(16.0).to(torch.bfloat16))


def test_quant_weight_checks() -> None:
    with pytest.raises(ValueError, match="qtype"):
        QuantWeight("TQ2_0", 1, 256, torch.zeros(1, 66, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shape"):
        QuantWeight("Q8_0", 2, 32, torch.zeros(2, 33, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole blocks"):
        QuantWeight("Q4_K", 2, 32, torch.zeros(2, 18, dtype=torch.uint8))


class FakeKernels(types.SimpleNamespace):
    """A stand-in for `ferrobatch.cpu.quant_ops`: the reference, counting its calls."""

    def __init__(self, supported: tuple[str, ...] = QUANT_TYPES) -> None:
        super().__init__(calls=[], supported=supported)

    def supports(self, qtype: str) -> bool:
        return qtype in self.supported

    def linear(self, x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2
        assert isinstance(weight, QuantWeight)
        self.calls.append(("linear", weight.qtype, tuple(x.shape)))
        return F.linear(x, dequantize_reference(weight))

    def dequantize(self, weight: QuantWeight) -> torch.Tensor:
        self.calls.append(("dequantize", weight.qtype, weight.n))
        return dequantize_reference(weight)


@pytest.mark.kernel_products
def test_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    w = random_weight("Q4_0", 8, 64)
    layer, x = QuantLinear(w), torch.randn(2, 3, 64)
    with backend("reference"):
        want = layer(x)
    fake = FakeKernels(supported=("Q4_0",))
    monkeypatch.setattr(modules, "kernel_ops", lambda: fake)
    torch.testing.assert_close(layer(x), want)  # auto: the kernels
    assert fake.calls == [("linear", "Q4_0", (6, 64))]
    QuantEmbedding(w)(torch.tensor([1, 1, 7]))
    assert fake.calls[-1] == ("dequantize", "Q4_0", 2)  # the looked-up rows only
    with backend("reference"):
        layer(x)
    assert len(fake.calls) == 2
    other = QuantLinear(random_weight("Q8_0", 8, 64))
    other(torch.randn(1, 64))  # a type the kernels lack: the reference under "auto"
    assert len(fake.calls) == 2
    with backend("kernel"), pytest.raises(RuntimeError, match="Q8_0"):
        other(torch.randn(1, 64))
    monkeypatch.setattr(modules, "kernel_ops", lambda: None)
    with backend("kernel"), pytest.raises(RuntimeError, match="not available"):
        layer(x)
    with pytest.raises(ValueError, match="backend"):
        modules.set_backend("fast")
