"""`ferrobatch.cpu.f32_ops` (AVX-512F products over packed fp32 weights): the fp32 product of
the weight, a row's result independent of the call's row count and thread count, and bad
arguments refused naming the field with the output untouched; the same of `_core.i16_linear`
(exact int16 products over the same packing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrobatch import FieldError
from ferrobatch.cpu import f32_ops
from isa_helpers import needs_isa, require_or_skip

pytestmark = needs_isa(f32_ops.available(), "avx512f", what="f32_linear")


@pytest.mark.parametrize("n,k", [(1, 1), (16, 64), (70, 33), (960, 576), (200, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_the_fp32_product(n, k, bias):
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen) * 0.1
    b = torch.randn(n, generator=gen) if bias else None
    packed = f32_ops.pack(w, b)
    for rows in (1, 5, 6, 7, 64, 200):
        x = torch.randn(rows, k, generator=gen)
        got = f32_ops.linear(x, packed)
        want = (x.double() @ w.double().t() + (0 if b is None else b.double())).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_a_row_does_not_depend_on_its_batch_nor_the_threads():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 100, generator=gen), torch.randn(50, 100, generator=gen)
    packed = f32_ops.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([f32_ops.linear(x[i:i + 1], packed) for i in range(50)])
        torch.set_num_threads(2)
        together = f32_ops.linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


def test_half_weights_are_widened_exactly_and_inputs_too():
    w = torch.randn(40, 24).bfloat16()
    x = torch.randn(3, 24).bfloat16()
    got = f32_ops.linear(x, f32_ops.pack(w))
    torch.testing.assert_close(got, f32_ops.torch_linear(x, w), rtol=1e-6, atol=1e-6)


def _call(x, packed, out, **kw):
    from ferrobatch import _core

    args = dict(n=4, k=3)
    args.update(kw)
    _core.f32_linear(x, packed, out, **args)


@pytest.mark.parametrize("field,change", [
    ("x", dict(x=np.zeros((2, 4), np.float32))),
    ("x", dict(x=np.zeros((2, 3), np.float64))),
    ("packed", dict(packed=np.zeros(10, np.float32))),
    ("out", dict(out=np.zeros((2, 5), np.float32))),
    ("bias", dict(bias=np.zeros(3, np.float32))),
])
def test_bad_arguments_name_the_field_and_write_nothing(field, change):
    from ferrobatch import _core

    args = dict(x=np.ones((2, 3), np.float32),
                packed=np.zeros(_core.f32_packed_len(4, 3), np.float32),
                out=np.full((2, 4), 7, np.float32))
    extra = {"bias": change.pop("bias")} if "bias" in change else {}
    args.update(change)
    before = args["out"].copy()
    with pytest.raises(FieldError) as e:
        _call(args["x"], args["packed"], args["out"], **extra)
    assert e.value.field == field
    assert np.array_equal(args["out"], before)


def test_pack_refuses_what_is_not_a_matrix():
    with pytest.raises(ValueError, match="2-D"):
        f32_ops.pack(torch.zeros(3))


def _i16_available() -> bool:
    from ferrobatch import _core

    return bool(_core.i16_linear_available())


@pytest.mark.parametrize("n,k", [(1, 2), (16, 64), (70, 34), (300, 576)])
def test_i16_linear_is_the_exact_integer_product(n, k):
    require_or_skip(_i16_available(), "avx512_vnni", what="i16_linear")
    from ferrobatch import _core

    rng = np.random.default_rng(n + k)
    amp = int(np.sqrt((2**31 - 1) // k))  # every partial sum fits an int32
    w = rng.integers(-amp, amp + 1, (n, k), dtype=np.int16)
    packed = np.zeros(_core.i16_packed_len(n, k), np.int16)
    _core.i16_pack(w, packed)
    for rows in (1, 6, 7, 64):
        x = rng.integers(-amp, amp + 1, (rows, k), dtype=np.int16)
        out = np.zeros((rows, n), np.int32)
        _core.i16_linear(x, packed, out, n=n, k=k, threads=2)
        assert np.array_equal(out.astype(np.int64), x.astype(np.int64) @ w.T.astype(np.int64))


@pytest.mark.parametrize("field,change", [
    ("x", dict(x=np.zeros((2, 6), np.int16))),
    ("x", dict(x=np.zeros((2, 4), np.int32))),
    ("packed", dict(packed=np.zeros(10, np.int16))),
    ("out", dict(out=np.zeros((2, 5), np.int32))),
    ("out", dict(out=np.zeros((2, 3), np.float32))),
    ("k", dict(x=np.zeros((2, 3), np.int16), k=3)),
])
def test_i16_bad_arguments_name_the_field_and_write_nothing(field, change):
    require_or_skip(_i16_available(), "avx512_vnni", what="i16_linear")
    from ferrobatch import _core

    args = dict(x=np.ones((2, 4), np.int16),
                packed=np.zeros(_core.i16_packed_len(3, 4), np.int16),
                out=np.full((2, 3), 7, np.int32), k=4)
    args.update(change)
    before = args["out"].copy()
    with pytest.raises(FieldError) as e:
        _core.i16_linear(args["x"], args["packed"], args["out"], n=3, k=args["k"])
    assert e.value.field == field
    assert np.array_equal(args["out"], before)
