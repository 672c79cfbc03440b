"""bf16 products with fp32 outputs (`ferrobatch.cpu.amx_ops`: AMX tiles, or AVX-512 BF16 where
the CPU has no AMX) against their torch reference, the binding's argument checks, and their
use by the packed linears."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from ferrobatch import _core
from ferrobatch.cpu import amx_ops
from ferrobatch.cpu.arrays import numpy_view
from ferrobatch.runner import linear_policy
from ferrobatch.runner.cpu_linear import PackedLinears, packing_available
from ferrobatch.runner.linear_policy import Backend
from isa_helpers import needs_isa

needs_amx = needs_isa(amx_ops.available(), "avx512_bf16", "amx_bf16",
                      what="bf16 products with fp32 outputs")


def _max_rows(isa: linear_policy.Isa, threads: int) -> int | None:
    """The most rows the policy sends to `amx_ops` (None: any up to 4096; 0: none)."""
    took = [rows for rows in (1, 2, 63, 64, 65, 256, 4096)
            if linear_policy.choose(torch.bfloat16, rows, isa, linear_policy.Probe(),
                                    fp32_outputs=True, threads=threads) is Backend.AMX_OPS]
    return 0 if not took else None if took[-1] == 4096 else took[-1]


def test_backend_is_named_and_sets_the_row_limit() -> None:
    name = amx_ops.backend()
    assert name in ("amx", "avx512_bf16", "none")
    assert amx_ops.available() == (name != "none")
    isa = linear_policy.Isa.detect()
    assert _max_rows(isa, 1) == {"amx": 64, "avx512_bf16": None, "none": 0}[name]
    assert _max_rows(isa, 2) == {"amx": 64, "avx512_bf16": 64, "none": 0}[name]
    # the row limit per backend whatever this CPU is
    for backend, one, more in (("amx", 64, 64), ("avx512_bf16", None, 64)):
        other = linear_policy.Isa(frozenset({backend, "onednn:bfloat16"}))
        assert (_max_rows(other, 1), _max_rows(other, 2)) == (one, more)
    # only for callers that take fp32 outputs
    assert linear_policy.choose(torch.bfloat16, 1, isa, linear_policy.Probe()) \
        is not Backend.AMX_OPS


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).bfloat16()


@needs_amx
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (7, 40, 70), (64, 96, 576), (65, 33, 64),
                                   (300, 48, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_the_fp32_product_of_bf16_inputs(m: int, n: int, k: int, bias: bool) -> None:
    w = _weight(n, k)
    b = torch.randn(n) if bias else None
    x = torch.randn(m, k)
    got = amx_ops.linear(x, amx_ops.pack(w, b))
    want = amx_ops.torch_linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bf16 inputs are taken as they are: the same sums
    assert torch.equal(amx_ops.linear(x.bfloat16(), amx_ops.pack(w, b)), got)
    # and far closer to the exact product than oneDNN's bf16-rounded outputs
    exact = x.bfloat16().double() @ w.double().t() + (b.double() if bias else 0)
    rounded = torch.nn.functional.linear(x.bfloat16(), w, None if b is None else b.bfloat16())
    assert (got.double() - exact).abs().max() < 0.05 * (rounded.double() - exact).abs().max()


@needs_amx
def test_linear_on_two_threads_is_the_one_thread_result() -> None:
    w, x = _weight(256, 576), torch.randn(64, 576)
    packed = amx_ops.pack(w)
    out1, out2 = torch.empty(64, 256), torch.empty(64, 256)
    for out, threads in ((out1, 1), (out2, 2)):
        _core.amx_linear(x.numpy(), numpy_view(packed.packed), out.numpy(), x_dtype="float32",
                         n=256, k=576, threads=threads)
    assert torch.equal(out1, out2)


def test_binding_names_the_wrong_argument() -> None:
    w = _weight(16, 32)
    packed = torch.empty(_core.amx_packed_len(16, 32), dtype=torch.int16)
    _core.amx_pack(numpy_view(w), numpy_view(packed))
    p = numpy_view(packed)
    out = torch.empty(2, 16).numpy()
    kw = dict(x_dtype="float32", n=16, k=32)
    with pytest.raises(ValueError, match="x has 31 columns"):
        _core.amx_linear(torch.zeros(2, 31).numpy(), p, out, **kw)
    with pytest.raises(ValueError, match="packed"):
        _core.amx_linear(torch.zeros(2, 32).numpy(), p[1:], out, **kw)
    with pytest.raises(ValueError, match="out"):
        _core.amx_linear(torch.zeros(3, 32).numpy(), p, out, **kw)
    with pytest.raises(ValueError, match="x_dtype"):
        _core.amx_linear(torch.zeros(2, 32).numpy(), p, out, **{**kw, "x_dtype": "float16"})
    with pytest.raises(ValueError, match="bias"):
        _core.amx_linear(torch.zeros(2, 32).numpy(), p, out, **kw,
                         bias=torch.zeros(3).numpy())
    with pytest.raises(ValueError, match="out"):
        _core.amx_pack(numpy_view(w), p[:-1].copy())
    with pytest.raises(ValueError, match="bfloat16"):
        amx_ops.pack(w.float())


@needs_amx
@pytest.mark.skipif(not packing_available(), reason="no oneDNN packed linears")
def test_packed_linears_widen_products_of_up_to_max_rows() -> None:
    model = tm.llama(0).to(torch.bfloat16).eval()
    lin = PackedLinears.of(model, activation_dtype=torch.float32, in_thread=lambda: True,
                           hidden_size=model.config.hidden_size, amx=True)
    assert lin is not None and lin.amx
    layer = model.model.layers[0].mlp.down_proj
    packed = lin.packed_of([layer])
    assert packed is not None
    limit = _max_rows(linear_policy.Isa.detect(), torch.get_num_threads())
    for rows in (1, 300 if limit is None else limit):
        x = torch.randn(rows, layer.in_features)
        got = lin.wide_product(packed, x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, amx_ops.torch_linear(x, layer.weight), rtol=1e-5,
                                   atol=1e-5)
    if limit is not None:
        # longer calls keep oneDNN's product, in the weight dtype
        long = lin.wide_product(packed, torch.randn(limit + 1, layer.in_features))
        assert long.dtype == torch.bfloat16
    # without `amx` the wide product is the plain one
    plain = PackedLinears.of(model, activation_dtype=torch.float32, in_thread=lambda: True)
    assert plain is not None and not plain.amx
    p2 = plain.packed_of([layer])
    assert p2 is not None
    assert plain.wide_product(p2, torch.randn(2, layer.in_features)).dtype == torch.bfloat16


@needs_amx
def test_linear_rounds_other_input_dtypes_to_bf16_first() -> None:
    """An fp16 input (the attention output over an fp16 cache) is converted, not read as
    bf16 bits."""
    w, x = _weight(32, 64), torch.randn(3, 64).half()
    got = amx_ops.linear(x, amx_ops.pack(w))
    torch.testing.assert_close(got, amx_ops.torch_linear(x.bfloat16(), w), rtol=1e-5, atol=1e-5)
