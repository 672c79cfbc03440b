"""`gguf.modules.probe_cache`: the construction checks dequantize each stand-in weight once."""

from __future__ import annotations

import torch
from ferrobatch.gguf import modules
from ferrobatch.gguf.formats import QuantWeight
from gguf import GGMLQuantizationType
from gguf.quants import quantize


def _linear(seed: int) -> modules.QuantLinear:
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)).numpy()
    data = torch.from_numpy(quantize(w, GGMLQuantizationType.Q8_0).copy())
    return modules.QuantLinear(QuantWeight("Q8_0", 64, 64, data))


def test_each_weight_dequantized_once_inside_and_dropped_after(monkeypatch) -> None:
    calls: list[int] = []
    real = modules._dequantized

    def counting(weight: QuantWeight) -> torch.Tensor:
        calls.append(weight.n)
        return real(weight)

    monkeypatch.setattr(modules, "_dequantized", counting)
    a, b = _linear(0), _linear(1)
    x = torch.randn(3, 64)
    with modules.probe_cache():
        with modules.probe_weights([a], [b]):
            first = a(x)
        with modules.probe_cache():  # nested: the same cache
            with modules.probe_weights([a], [b]):
                assert torch.equal(a(x), first)
        assert len(calls) == 1 and modules._probe_cache.weights
    assert not modules._probe_cache.weights  # dropped with the last block
    with modules.probe_weights([a], [b]):  # outside any block: no cache
        assert torch.equal(a(x), first)
    assert len(calls) == 2
    assert torch.allclose(first, x @ real(a.weight_q).T)
