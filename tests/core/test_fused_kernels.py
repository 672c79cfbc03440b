"""The fused elementwise kernels of `ferrobatch._core` (rms_norm, silu_mul, rope, write_rows)
against the torch ops they replace, on numpy views of torch tensors, and their argument
checks (`FieldError` naming the argument)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ferrobatch.errors import FieldError

_core = pytest.importorskip("ferrobatch._core")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# tolerance of a result rounded once to each type: 1 ulp of an f32 result differing by a
# few ulp (summation order, exp), or 1 ulp of the rounded type
RTOL = {torch.float32: 2e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def view(t: torch.Tensor) -> np.ndarray:
    """The numpy view the kernels take: f32 as float32, bf16 / fp16 as uint16 bits."""
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.uint16).numpy()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(bits(got), bits(want)), (got - want).abs().max()


def assert_rounded_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1 ulp of the output type (f32: a few ulp); a bf16 / fp16 output mostly
    bit-equal (an f32 row is off by an ulp as a whole when its norm is)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=RTOL[got.dtype], atol=1e-30)
    if got.dtype != torch.float32:
        assert (bits(got) == bits(want)).float().mean() > 0.95


def field_of(fn, *args, **kwargs) -> str | None:
    """Call `fn`, expecting a FieldError; return its `.field`."""
    with pytest.raises(FieldError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value.field


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0,
          seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# -- rms_norm ---------------------------------------------------------------------------------

def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    x = x.float()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    wf = w.float() + offset if offset else w.float()
    return (wf * h).to(out_dtype)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 576), (1, 576), (5, 37)])
def test_rms_norm_matches_torch(x_dtype, w_dtype, out_dtype, shape):
    x = randn(*shape, dtype=x_dtype, scale=3.0, seed=1)
    w = randn(shape[1], dtype=w_dtype, seed=2)
    for offset in (0.0, 1.0):
        out = torch.empty(shape, dtype=out_dtype)
        _core.rms_norm(view(x), view(w), view(out), x_dtype=NAME[x_dtype],
                       weight_dtype=NAME[w_dtype], out_dtype=NAME[out_dtype], eps=1e-5,
                       weight_offset=offset)
        assert_rounded_close(out, torch_rms_norm(x, w, 1e-5, offset, out_dtype))


@pytest.mark.parametrize("r_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_adds_the_residual_in_place(r_dtype, out_dtype, threads):
    shape = (1900, 577)  # past the 1M-element threshold for threads
    x = randn(*shape, scale=2.0, seed=3)
    r = randn(*shape, dtype=r_dtype, seed=4)
    w = randn(shape[1], dtype=torch.bfloat16, seed=5)
    want_x = x + r.float()
    out = torch.empty(shape, dtype=out_dtype)
    _core.rms_norm(view(x), view(w), view(out), x_dtype="float32", weight_dtype="bfloat16",
                   out_dtype=NAME[out_dtype], eps=1e-6, residual=view(r),
                   residual_dtype=NAME[r_dtype], threads=threads)
    assert_bit_equal(x, want_x)
    assert_rounded_close(out, torch_rms_norm(want_x, w, 1e-6, 0.0, out_dtype))


# -- silu_mul ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 1536), (1, 1536), (3, 17)])
def test_silu_mul_matches_torch(dtype, out_dtype, shape):
    rows, inter = shape
    gu = randn(rows, 2 * inter, dtype=dtype, scale=4.0, seed=6)
    out = torch.empty(rows, inter, dtype=out_dtype)
    _core.silu_mul(view(gu), view(out), dtype=NAME[dtype], out_dtype=NAME[out_dtype])
    g, u = gu[:, :inter].float(), gu[:, inter:].float()
    assert_rounded_close(out, (F.silu(g) * u).to(out_dtype))


def test_silu_mul_extremes():
    g = torch.tensor([0.0, 1e-30, -100.0, 100.0, 88.0, -88.0, 30.0, -30.0])
    gu = torch.cat([g, torch.ones_like(g)])[None]
    out = torch.empty(1, g.numel())
    _core.silu_mul(view(gu), view(out), dtype="float32", out_dtype="float32", threads=2)
    torch.testing.assert_close(out[0], F.silu(g), rtol=2e-6, atol=1e-37)


# -- rope -------------------------------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' `rotate_half`."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_case(src_dtype, rows=64, heads=9, kv=3, dim=64, seed=7):
    src = randn(rows, (heads + 2 * kv) * dim, dtype=src_dtype, scale=2.0, seed=seed)
    pos = torch.arange(rows, dtype=torch.float32)[:, None] * 3.0
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    emb = torch.cat([pos * inv, pos * inv], dim=-1)
    return src, emb.cos().contiguous(), emb.sin().contiguous()


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("rows", [64, 1])
@pytest.mark.parametrize("part", ["q", "k"])
def test_rope_is_the_fp32_formula(src_dtype, out_dtype, rows, part):
    heads, kv, dim = 9, 3, 64
    src, cos, sin = rope_case(src_dtype, rows, heads, kv, dim)
    n, off = (heads, 0) if part == "q" else (kv, heads * dim)
    out = torch.empty(rows, n, dim, dtype=out_dtype)
    _core.rope(view(src), cos.numpy(), sin.numpy(), view(out), src_dtype=NAME[src_dtype],
               out_dtype=NAME[out_dtype], col_offset=off, heads=n, dim=dim,
               threads=2 if rows > 1 else 1)
    q = src[:, off:off + n * dim].float().view(rows, n, dim)
    c, s = cos[:, None, :], sin[:, None, :]
    assert_bit_equal(out, (q * c + rotate_half(q) * s).to(out_dtype))


def test_rope_odd_head_size_at_the_row_end():
    rows, w, dim = 3, 29, 6
    src = randn(rows, w, seed=8)
    cos, sin = randn(rows, dim, seed=9), randn(rows, dim, seed=10)
    out = torch.empty(rows, 2, dim)
    _core.rope(view(src), cos.numpy(), sin.numpy(), view(out), src_dtype="float32",
               out_dtype="float32", col_offset=w - 2 * dim, heads=2, dim=dim)
    q = src[:, w - 2 * dim:].reshape(rows, 2, dim)
    assert_bit_equal(out, q * cos[:, None] + rotate_half(q) * sin[:, None])


# -- write_rows -------------------------------------------------------------------------------

@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("three_d", [False, True])
def test_write_rows_is_index_copy(src_dtype, dst_dtype, three_d):
    rows, kv, dim, n_slots = 64, 3, 64, 500
    src = randn(rows, 15 * dim, dtype=src_dtype, seed=11)
    slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(12))[:rows]
    for off in (9 * dim, 12 * dim):  # k, then v (at the row's end)
        dst = randn(n_slots, kv, dim, dtype=dst_dtype, seed=13)
        want = dst.clone().view(n_slots, kv * dim)
        want.index_copy_(0, slots, src[:, off:off + kv * dim].to(dst_dtype))
        target = dst if three_d else dst.view(n_slots, kv * dim)
        _core.write_rows(view(src), view(target), slots.numpy(), src_dtype=NAME[src_dtype],
                         dst_dtype=NAME[dst_dtype], col_offset=off, width=kv * dim)
        assert_bit_equal(dst.view(n_slots, kv * dim), want)


def test_write_rows_repeated_slot_keeps_the_last_row():
    src = torch.arange(12, dtype=torch.float32).view(4, 3)
    dst = torch.zeros(3, 2)
    _core.write_rows(view(src), view(dst), np.array([1, 2, 1, 1]), src_dtype="float32",
                     dst_dtype="float32", col_offset=1, width=2)
    assert dst.tolist() == [[0, 0], [10, 11], [4, 5]]


# -- argument checks --------------------------------------------------------------------------

def readonly(shape, dtype=np.float32) -> np.ndarray:
    a = np.zeros(shape, dtype)
    a.setflags(write=False)
    return a


def f32(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


def norm_call(**over):
    x = over.pop("x", f32(4, 8))
    w = over.pop("weight", np.ones(8, np.float32))
    out = over.pop("out", f32(4, 8))
    kw = dict(x_dtype="float32", weight_dtype="float32", out_dtype="float32", eps=1e-6) | over
    return lambda: _core.rms_norm(x, w, out, **kw)


def silu_call(**over):
    gu, out = over.pop("gate_up", f32(4, 8)), over.pop("out", f32(4, 4))
    kw = dict(dtype="float32", out_dtype="float32") | over
    return lambda: _core.silu_mul(gu, out, **kw)


def rope_call(**over):
    src, out = over.pop("src", f32(4, 40)), over.pop("out", f32(4, 2, 8))
    cos, sin = over.pop("cos", f32(4, 8)), over.pop("sin", f32(4, 8))
    kw = dict(src_dtype="float32", out_dtype="float32", col_offset=24, heads=2, dim=8) | over
    return lambda: _core.rope(src, cos, sin, out, **kw)


def rows_call(**over):
    src, dst = over.pop("src", f32(3, 40)), over.pop("dst", f32(10, 16))
    slots = over.pop("slots", np.array([0, 9, 3]))
    kw = dict(src_dtype="float32", dst_dtype="float32", col_offset=24, width=16) | over
    return lambda: _core.write_rows(src, dst, slots, **kw)


SHARED = f32(4, 8)
BF = np.zeros((4, 8), np.uint16)

BAD = [
    ("x", norm_call(x=np.zeros((4, 8), np.float64))),
    ("x", norm_call(x=f32(8))),
    ("x", norm_call(x=f32(8, 4).T)),
    ("x", norm_call(x=readonly((4, 8)), residual=f32(4, 8))),
    ("x_dtype", norm_call(x_dtype="float64")),
    ("x_dtype", norm_call(x=BF, x_dtype="bfloat16", residual=BF, residual_dtype="bfloat16")),
    ("weight", norm_call(weight=np.ones(7, np.float32))),
    ("weight", norm_call(weight=np.ones(8, np.uint16))),
    ("weight_dtype", norm_call(weight_dtype="int8")),
    ("out", norm_call(out=f32(4, 9))),
    ("out", norm_call(out=BF)),
    ("out", norm_call(out=readonly((4, 8)))),
    ("x", norm_call(x=SHARED, out=SHARED)),  # out is borrowed first
    ("out_dtype", norm_call(out_dtype="bf16")),
    ("residual", norm_call(residual=f32(4, 7))),
    ("residual", norm_call(residual=np.zeros((4, 8), np.float16), residual_dtype="bfloat16")),
    ("residual_dtype", norm_call(residual=BF, residual_dtype="half")),
    ("eps", norm_call(eps=-1.0)),
    ("eps", norm_call(eps=float("nan"))),
    ("weight_offset", norm_call(weight_offset=float("inf"))),
    ("threads", norm_call(threads=0)),
    ("threads", norm_call(threads=-2)),
    ("gate_up", silu_call(gate_up=f32(4, 7))),
    ("gate_up", silu_call(gate_up=f32(32))),
    ("gate_up", silu_call(gate_up=BF)),
    ("dtype", silu_call(dtype="float")),
    ("out", silu_call(out=f32(4, 8))),
    ("out", silu_call(out=f32(8, 4).T)),
    ("out_dtype", silu_call(out_dtype="x")),
    ("threads", silu_call(threads=0)),
    ("src", rope_call(src=f32(40))),
    ("src", rope_call(src=np.zeros((4, 40), np.uint16))),
    ("src_dtype", rope_call(src_dtype="fp32")),
    ("cos", rope_call(cos=f32(4, 6))),
    ("cos", rope_call(cos=np.zeros((4, 8), np.float64))),
    ("sin", rope_call(sin=f32(3, 8))),
    ("out", rope_call(out=f32(4, 16))),
    ("out", rope_call(out=f32(4, 3, 8))),
    ("col_offset", rope_call(col_offset=25)),
    ("col_offset", rope_call(col_offset=-1)),
    ("dim", rope_call(dim=7, cos=f32(4, 7), sin=f32(4, 7), out=f32(4, 2, 7))),
    ("heads", rope_call(heads=-1)),
    ("src", rows_call(src=f32(120))),
    ("slots", rows_call(slots=np.array([0, 10, 3]))),
    ("slots", rows_call(slots=np.array([0, -1, 3]))),
    ("slots", rows_call(slots=np.array([0, 1, 3], np.int32))),
    ("slots", rows_call(slots=np.array([0, 1]))),
    ("dst", rows_call(dst=f32(10, 15))),
    ("dst", rows_call(dst=f32(160))),
    ("dst", rows_call(dst=readonly((10, 16)))),
    ("dst_dtype", rows_call(dst_dtype="int64")),
    ("col_offset", rows_call(col_offset=25)),
    ("width", rows_call(width=-16)),
]


@pytest.mark.parametrize("field,call", BAD)
def test_bad_arguments_raise_field_error(field, call):
    assert field_of(call) == field


def test_bad_slots_write_nothing():
    dst = f32(10, 16)
    src = np.ones((3, 40), np.float32)
    with pytest.raises(FieldError):
        _core.write_rows(src, dst, np.array([0, 1, 10]), src_dtype="float32",
                         dst_dtype="float32", col_offset=24, width=16)
    assert not dst.any()


def test_outputs_overlapping_inputs_are_refused():
    """Two numpy views of one torch tensor alias without numpy knowing; the bindings check
    the memory ranges themselves."""
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)
    kw = dict(x_dtype="float32", weight_dtype="float32", out_dtype="float32", eps=1e-6)
    assert field_of(_core.rms_norm, x.numpy(), w.numpy(), x.numpy(), **kw) == "out"
    assert field_of(_core.rms_norm, x.numpy(), w.numpy(), r.numpy(), residual=r.numpy(),
                    **kw) == "out"
    assert field_of(_core.rms_norm, x.numpy(), x[0].numpy(), f32(4, 8), residual=r.numpy(),
                    **kw) == "x"
    gu = torch.randn(4, 16)
    assert field_of(_core.silu_mul, gu.numpy(), gu.view(-1)[8:40].view(4, 8).numpy(),
                    dtype="float32", out_dtype="float32") == "out"
    src, cs = torch.randn(4, 40), torch.randn(4, 8)
    assert field_of(_core.rope, src.numpy(), cs.numpy(), cs.numpy(),
                    src.view(-1)[:64].view(4, 2, 8).numpy(), src_dtype="float32",
                    out_dtype="float32", col_offset=0, heads=2, dim=8) == "out"
    assert field_of(_core.write_rows, src.numpy(), src.view(10, 16).numpy(),
                    np.array([0, 1, 2, 3]), src_dtype="float32", dst_dtype="float32",
                    col_offset=0, width=16) == "dst"
