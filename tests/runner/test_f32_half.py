"""`ferrobatch.cpu.f32_ops` over bf16 / fp16 weights packed as they are stored: every output bit
for bit the product of the same weights widened to fp32 and packed (at any rows and threads),
half the bytes, and bad arguments of `_core.f32_linear_half` refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrobatch import FieldError
from ferrobatch.cpu import f32_ops
from ferrobatch.cpu.arrays import numpy_view
from isa_helpers import needs_isa

pytestmark = needs_isa(f32_ops.available(), "avx512f", what="f32_linear")

HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("n,k", [(1, 1), (70, 33), (200, 577), (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_half_panels_give_the_bits_of_the_widened_weights(dtype, n, k, bias):
    gen = torch.Generator().manual_seed(n + 3 * k)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    half, wide = f32_ops.pack(w, b), f32_ops.pack(w.float(), b)
    assert half.dtype == dtype and wide.dtype == torch.float32
    assert half.nbytes * 2 == wide.nbytes
    threads = torch.get_num_threads()
    try:
        for rows, t in ((1, 1), (6, 2), (7, 1), (64, 2), (300, 2)):
            torch.set_num_threads(t)
            x = torch.randn(rows, k, generator=gen)
            got = f32_ops.linear(x, half)
            assert torch.equal(got, f32_ops.linear(x, wide))
            torch.testing.assert_close(got, f32_ops.torch_linear(x, w, b), rtol=1e-4,
                                       atol=1e-5 * k ** 0.5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", HALVES)
def test_a_row_does_not_depend_on_its_batch(dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(130, 47, generator=gen).to(dtype)
    x = torch.randn(40, 47, generator=gen)
    packed = f32_ops.pack(w)
    alone = torch.cat([f32_ops.linear(x[i:i + 1], packed) for i in range(40)])
    assert torch.equal(alone, f32_ops.linear(x, packed))


def test_fp16_subnormals_and_extremes_are_widened_exactly():
    bits = torch.tensor([0x0001, 0x03ff, 0x8001, 0x7bff, 0xfbff, 0x3c00, 0, 0x8000],
                        dtype=torch.int32).to(torch.int16).view(torch.float16)
    w = bits.repeat(3, 2)  # [3, 16]
    x = torch.eye(16)
    got = f32_ops.linear(x, f32_ops.pack(w))
    assert torch.equal(got, w.float().t())


def _half_args(**change):
    from ferrobatch import _core  # local: the raw binding under test

    args = dict(x=np.ones((2, 3), np.float32),
                packed=np.zeros(_core.f32_packed_len(4, 3), np.uint16),
                out=np.full((2, 4), 7, np.float32), dtype="bfloat16")
    args.update(change)
    return args


@pytest.mark.parametrize("field,change", [
    ("x", dict(x=np.zeros((2, 4), np.float32))),
    ("packed", dict(packed=np.zeros(10, np.uint16))),
    ("packed", dict(packed=np.zeros(64, np.float32))),
    ("out", dict(out=np.zeros((2, 5), np.float32))),
    ("dtype", dict(dtype="float32")),
    ("dtype", dict(dtype="int8")),
])
def test_bad_half_arguments_name_the_field_and_write_nothing(field, change):
    from ferrobatch import _core  # local: the raw binding under test

    args = _half_args(**change)
    before = args["out"].copy()
    with pytest.raises(FieldError) as e:
        _core.f32_linear_half(args["x"], args["packed"], args["out"], n=4, k=3,
                              dtype=args["dtype"])
    assert e.value.field == field
    assert np.array_equal(args["out"], before)


def test_pack_half_refuses_a_wrong_length():
    from ferrobatch import _core  # local: the raw binding under test

    w = numpy_view(torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(FieldError) as e:
        _core.f32_pack_half(w, np.zeros(5, np.uint16), dtype="bfloat16")
    assert e.value.field == "out"
