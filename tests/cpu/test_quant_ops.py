"""`ferrobatch.cpu.quant_ops` (GGUF quantized products) against the `gguf` package:
`dequantize` is `gguf.quants.dequantize` bit for bit; `linear` is within the bound the
activations' int8 quantization allows of the f64 product of the dequantized weights, the
same bits on every backend, a row's result independent of its batch and of the threads;
bad arguments name the field. K-type blocks are random bytes with sane fp16 `d` / `dmin`,
MXFP4 blocks with a sane exponent (`gguf` cannot quantize K-types; dequantize defines their
values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrobatch import FieldError, _core
from ferrobatch.cpu import quant_ops
from isa_helpers import require_or_skip

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as G  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144),
         "q5_k": (256, 176), "q6_k": (256, 210), "q5_0": (32, 22), "q5_1": (32, 24),
         "iq4_nl": (32, 18), "q3_k": (256, 110), "q2_k": (256, 84), "iq4_xs": (256, 136),
         "mxfp4": (32, 17)}
GGML = {"q8_0": G.Q8_0, "q4_0": G.Q4_0, "q4_1": G.Q4_1, "q4_k": G.Q4_K, "q5_k": G.Q5_K,
        "q6_k": G.Q6_K, "q5_0": G.Q5_0, "q5_1": G.Q5_1, "iq4_nl": G.IQ4_NL, "q3_k": G.Q3_K,
        "q2_k": G.Q2_K, "iq4_xs": G.IQ4_XS, "mxfp4": G.MXFP4}
BACKENDS = [b for b in ("portable", "avx2", "avx512vnni", "amx_int8")
            if _core.quant_backend_available(b)]


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF rows [n, k / block * bytes] of random bytes with sane fp16 factors."""
    block, nbytes = BLOCK[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    d = (rng.choice([-1.0, 1.0], size=(n, k // block)) *
         rng.uniform(1e-3, 5e-2, size=(n, k // block))).astype(np.float16)
    e = rng.uniform(0, 5e-2, size=(n, k // block)).astype(np.float16)
    if qtype in ("q8_0", "q4_0", "q5_0", "iq4_nl"):
        b[..., 0:2] = d[..., None].view(np.uint8)
    elif qtype in ("q4_1", "q5_1"):
        b[..., 0:2] = d[..., None].view(np.uint8)
        b[..., 2:4] = (-e)[..., None].view(np.uint8)
    elif qtype in ("q4_k", "q5_k"):
        b[..., 0:2] = np.abs(d)[..., None].view(np.uint8)
        b[..., 2:4] = e[..., None].view(np.uint8)
    elif qtype == "q6_k":
        b[..., 208:210] = d[..., None].view(np.uint8)
    elif qtype == "q3_k":
        b[..., 108:110] = d[..., None].view(np.uint8)
    elif qtype == "q2_k":
        b[..., 80:82] = np.abs(d)[..., None].view(np.uint8)
        b[..., 82:84] = e[..., None].view(np.uint8)
    elif qtype == "mxfp4":  # an E8M0 exponent: 2^(e - 128) from 2^-18 to 2^-2
        b[..., 0] = rng.integers(110, 127, size=(n, k // block), dtype=np.uint8)
    else:  # iq4_xs
        b[..., 0:2] = d[..., None].view(np.uint8)
    return b.reshape(n, -1)


def random_x(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(m, k, generator=gen) * 2 - 1
    x[:, 96:128] *= 20  # a block of large values
    return x


def bound(qtype: str, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Half an activation step per weight (|x - dx q| <= dx / 2, dx = max|x_block| / 127),
    with f32 rounding slack (the Rust tests hold the exact bound)."""
    block = BLOCK[qtype][0]
    m, k = x.shape
    dx = np.abs(x.reshape(m, k // block, block)).max(-1) / 127.0  # [m, nb]
    wabs = np.abs(w.astype(np.float64)).reshape(w.shape[0], k // block, block).sum(-1)
    quant = dx @ wabs.T  # [m, n]
    slack = (np.abs(x).astype(np.float64) + np.repeat(dx, block, axis=1)) @ np.abs(w).T
    return 0.5001 * quant + 1e-5 * slack + 1e-6


@pytest.mark.parametrize("qtype", quant_ops.QTYPES)
@pytest.mark.parametrize("n,blocks", [(1, 1), (5, 3), (33, 2)])
def test_dequantize_is_gguf_bit_for_bit(qtype, n, blocks):
    k = blocks * BLOCK[qtype][0]
    b = random_blocks(qtype, n, k, seed=n * 31 + blocks)
    want = gguf_dequantize(b, GGML[qtype])
    got = quant_ops.dequantize(qtype, b, n, k)
    assert got.shape == (n, k)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_dequantize_of_gguf_quantized_rows(qtype):
    w = np.random.default_rng(1).standard_normal((40, 128)).astype(np.float32)
    b = gguf_quantize(w, GGML[qtype])
    np.testing.assert_array_equal(quant_ops.dequantize(GGML[qtype], b, 40, 128),
                                  gguf_dequantize(b, GGML[qtype]))


@pytest.mark.parametrize("qtype", quant_ops.QTYPES)
@pytest.mark.parametrize("m,n,blocks", [(1, 1, 1), (1, 40, 2), (3, 17, 3), (9, 64, 2),
                                        (70, 20, 1)])
def test_linear_is_within_the_quantization_bound(qtype, m, n, blocks):
    k = blocks * max(BLOCK[qtype][0], 128)
    b = random_blocks(qtype, n, k, seed=m * 7 + n)
    x = random_x(m, k, seed=n)
    w = gguf_dequantize(b, GGML[qtype]).astype(np.float32)
    want = x.double().numpy() @ w.astype(np.float64).T
    weight = quant_ops.pack(qtype, b, n, k)
    outs = [quant_ops.linear(x, weight, backend=be) for be in BACKENDS]
    err = np.abs(outs[0].double().numpy() - want)
    assert (err <= bound(qtype, w, x.numpy())).all(), err.max()
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int32), outs[0].view(torch.int32))


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2", "amx_int8"])
def test_each_simd_backend_is_the_portable_bits(isa):
    """Skipped where the CPU lacks the backend's ISA, failed instead where
    `FERROBATCH_REQUIRE_ISA` names it (`isa_helpers`). AMX-INT8 gets 65 to 83 rows: Q4_K's
    groups of 16 on the tiles, the rest in registers."""
    # (the ISAs any one of which would make the backend available: AMX-INT8's is the tiles
    # alone, so a CPU with AVX-512 VNNI and no tiles skips it, whatever CI requires)
    isas = {"avx512vnni": ("avx512_vnni",), "avx2": ("avx2",), "amx_int8": ("amx_int8",)}[isa]
    require_or_skip(_core.quant_backend_available(isa), *isas, what=f"the {isa} quant backend")
    rng = np.random.default_rng(21)
    for qtype in quant_ops.QTYPES:
        m, n, blocks = int(rng.integers(1, 20)), int(rng.integers(1, 50)), 3
        m += 64 if isa == "amx_int8" else 0
        k = blocks * BLOCK[qtype][0]
        weight = quant_ops.pack(qtype, random_blocks(qtype, n, k, m), n, k)
        x = random_x(m, k, n) if k >= 128 else torch.randn(m, k)
        a = quant_ops.linear(x, weight, backend="portable")
        b = quant_ops.linear(x, weight, backend=isa)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), qtype


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_gguf_quantized_float_weights(qtype):
    """Quantize-on-load: a float weight through gguf's quantizer, then `linear`, is close to
    the float product (the weights' own quantization dominates)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 256)).astype(np.float32) * 0.05
    x = torch.from_numpy(rng.standard_normal((4, 256)).astype(np.float32))
    weight = quant_ops.pack(qtype, gguf_quantize(w, GGML[qtype]), 96, 256)
    got = quant_ops.linear(x, weight).numpy()
    want = x.numpy() @ w.T
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < {"q8_0": 0.02, "q4_0": 0.15, "q4_1": 0.15, "q5_0": 0.08, "q5_1": 0.08}[qtype], rel


@pytest.mark.parametrize("qtype", ["q4_k", "q3_k", "q2_k", "iq4_xs"])
def test_a_row_does_not_depend_on_its_batch_nor_the_threads(qtype):
    n, k = 300, 512
    weight = quant_ops.pack(qtype, random_blocks(qtype, n, k, 3), n, k)
    x = random_x(40, k, 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant_ops.linear(x[i:i + 1], weight) for i in range(40)])
        torch.set_num_threads(2)
        together = quant_ops.linear(x, weight)
        split = quant_ops.linear(x, weight)  # threads from get_num_threads (2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together) and torch.equal(together, split)


def test_out_is_written_and_inputs_widened():
    qtype, n, k = "q6_k", 20, 256
    weight = quant_ops.pack(G.Q6_K, random_blocks(qtype, n, k, 5), n, k)
    x = random_x(3, k, 6)
    out = torch.full((3, n), 7.0)
    assert quant_ops.linear(x, weight, out=out) is out
    assert torch.equal(out, quant_ops.linear(x.double(), weight))
    assert weight.nbytes == 32 * 210  # 16-row panels: n = 20 padded to 32


def test_packed_bytes_are_the_gguf_bytes():
    for qtype, (block, nbytes) in BLOCK.items():
        # (MXFP4: its exponent byte packed as an fp16 `d`)
        extra = {"q4_k": 4, "q5_k": 4, "q3_k": 4, "iq4_xs": 2, "mxfp4": 1}.get(qtype, 0)
        assert _core.quant_packed_len(qtype, 64, 4 * 256) == 64 * 4 * 256 // block * (
            nbytes + extra)


def _core_call(fn, *args, **kw):
    return getattr(_core, fn)(*args, **kw)


@pytest.mark.parametrize("field,call", [
    ("qtype", lambda: quant_ops.pack("iq2_xs", np.zeros(74, np.uint8), 1, 256)),
    ("blocks", lambda: quant_ops.pack("q8_0", np.zeros(33, np.uint8), 1, 32)),
    ("k", lambda: quant_ops.pack("q4_k", np.zeros(144, np.uint8), 1, 255)),
    ("blocks", lambda: quant_ops.dequantize("q6_k", np.zeros(211, np.uint8), 1, 256)),
    ("x", lambda: _core_call("quant_linear", "q8_0", np.zeros((2, 31), np.float32),
                             np.zeros(544, np.uint8), np.zeros((2, 1), np.float32), n=1, k=32)),
    ("weight", lambda: _core_call("quant_linear", "q8_0", np.zeros((2, 32), np.float32),
                                  np.zeros(543, np.uint8), np.zeros((2, 1), np.float32),
                                  n=1, k=32)),
    ("out", lambda: _core_call("quant_linear", "q8_0", np.zeros((2, 32), np.float32),
                               np.zeros(544, np.uint8), np.zeros((2, 2), np.float32),
                               n=1, k=32)),
    ("backend", lambda: _core_call("quant_linear", "q8_0", np.zeros((2, 32), np.float32),
                                   np.zeros(544, np.uint8), np.zeros((2, 1), np.float32),
                                   n=1, k=32, backend="avx3")),
])
def test_bad_arguments_name_the_field(field, call):
    with pytest.raises((FieldError, ValueError)) as e:
        call()
    if isinstance(e.value, FieldError):
        assert e.value.field == field, e.value
    else:
        assert field == "qtype"


def test_wrong_weight_bytes_message():
    with pytest.raises(FieldError) as e:
        quant_ops.pack("q8_0", np.zeros(35, np.uint8), 1, 32)
    assert str(e.value).startswith("blocks: expected 34*k/32 bytes per row for q8_0"), e.value


def test_out_is_untouched_on_error():
    out = np.full((2, 1), 7, np.float32)
    with pytest.raises(FieldError):
        _core_call("quant_linear", "q8_0", np.zeros((2, 32), np.float32),
                   np.zeros(543, np.uint8), out, n=1, k=32)
    assert (out == 7).all()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k", "q5_0", "q5_1", "iq4_nl", "q3_k",
                                   "q2_k", "iq4_xs"])
def test_a_tensor_read_from_a_gguf_file(qtype, tmp_path):
    """What `gguf.GGUFReader` gives (uint8 rows [n, bytes], shape [k, n], the type) packs
    as it is, and `linear` is the product of the dequantized tensor."""
    n, k = 48, 512
    rows = random_blocks(qtype, n, k, 11)
    path = str(tmp_path / "w.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", rows, raw_dtype=GGML[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = gguf.GGUFReader(path).tensors[0]
    k_file, n_file = (int(v) for v in t.shape)
    assert (n_file, k_file) == (n, k)
    weight = quant_ops.pack(t.tensor_type, t.data, n_file, k_file)
    x = random_x(5, k, 12)
    w = quant_ops.dequantize(t.tensor_type, t.data, n, k)
    want = x.double().numpy() @ w.astype(np.float64).T
    got = quant_ops.linear(x, weight).double().numpy()
    assert (np.abs(got - want) <= bound(qtype, w, x.numpy())).all()


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_quantize_k_types_within_their_bound_of_gguf_values(qtype: str) -> None:
    """`quantize` makes GGUF rows that `gguf.quants.dequantize` reads back within the
    relative RMS bound of the kernels' tests; its threads change no byte."""
    assert qtype in quant_ops.QUANTIZERS
    w = torch.randn(40, 768, generator=torch.Generator().manual_seed(3)) * 0.02
    rows = quant_ops.quantize(w, qtype)
    assert rows.dtype == torch.uint8 and rows.shape == (40, 3 * BLOCK[qtype][1])
    back = gguf_dequantize(rows.numpy(), GGML[qtype]).reshape(40, 768)
    np.testing.assert_array_equal(back, quant_ops.dequantize(qtype, rows, 40, 768))
    err = np.sqrt(((back - w.numpy()) ** 2).sum() / (w.numpy() ** 2).sum())
    assert err < {"q4_k": 0.10, "q5_k": 0.05, "q6_k": 0.028}[qtype]
    one = torch.empty_like(rows)
    _core.quant_quantize(qtype, w.numpy(), one.numpy(), threads=1)
    assert torch.equal(one, rows)


def test_quantize_refusals_name_the_field() -> None:
    assert quant_ops.QUANTIZERS == ("q4_k", "q5_k", "q6_k")
    w = torch.zeros(2, 512)
    w[1, 300] = float("inf")
    with pytest.raises(FieldError, match="row 1, column 300 is inf") as err:
        quant_ops.quantize(w, "q4_k")
    assert err.value.field == "w"
    with pytest.raises(FieldError) as err:
        quant_ops.quantize(torch.zeros(2, 300), "q6_k")
    assert err.value.field == "k"
    for served_only in ("q8_0", "q3_k", "q2_k", "iq4_xs"):
        with pytest.raises(ValueError, match="to quantize"):
            quant_ops.quantize(torch.zeros(2, 256), served_only)
    out = np.zeros((2, 288), dtype=np.uint8)
    with pytest.raises(FieldError) as err:
        _core.quant_quantize("q4_k", np.zeros((2, 512), dtype=np.float32), out[:, :100])
    assert err.value.field == "out"
    with pytest.raises(FieldError) as err:
        _core.quant_quantize("q8_0", np.zeros((1, 32), dtype=np.float32), out)
    assert err.value.field == "qtype"
