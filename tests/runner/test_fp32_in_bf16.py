"""fp32 weights that are all bf16 values (a bf16 checkpoint run in fp32, the CPU default):
`f32_ops` holds them as bf16 (`f32_ops.pack_bf16_exact`, format `FP32_IN_BF16`), with the
same outputs bit for bit at half the bytes, at every row count and with no oneDNN fp32 copy;
greedy parity with `model.generate` holds, and a weight that stops being bf16 values is
packed as fp32 again."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams, _core
from ferrobatch.cpu import f32_ops
from ferrobatch.runner import cpu_linear, linear_policy
from ferrobatch.runner.linear_policy import FP32_IN_BF16, Backend
from isa_helpers import needs_isa

torch.set_num_threads(1)
pytestmark = needs_isa(f32_ops.available(), "avx512f", what="f32_linear")


def _bf16_valued(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (fp32) with every parameter rounded to a bf16 value, kept in fp32."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def _linears(engine: Engine) -> cpu_linear.PackedLinears:
    linears = engine.runner.activations.linears
    assert linears is not None
    return linears


@pytest.mark.parametrize("n,k", [(1, 1), (70, 33), (200, 577)])
def test_bf16_valued_weights_pack_as_bf16_with_the_same_bits(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16().float()
    b = torch.randn(n, generator=gen)
    narrow, wide = f32_ops.pack_bf16_exact(w, b), f32_ops.pack(w, b)
    assert narrow is not None and narrow.dtype == torch.bfloat16
    assert narrow.nbytes * 2 == wide.nbytes
    threads = torch.get_num_threads()
    try:
        for rows, t in ((1, 1), (7, 2), (300, 2)):
            torch.set_num_threads(t)
            x = torch.randn(rows, k, generator=gen)
            assert torch.equal(f32_ops.linear(x, narrow), f32_ops.linear(x, wide))
    finally:
        torch.set_num_threads(threads)


def test_a_weight_with_one_value_off_bf16_is_not_narrowed():
    w = torch.randn(16, 64).bfloat16().float()
    assert cpu_linear.bf16_exact(w)
    w[3, 5] += 1e-6
    assert not cpu_linear.bf16_exact(w)
    assert f32_ops.pack_bf16_exact(w) is None
    assert not cpu_linear.bf16_exact(w.bfloat16())  # not fp32: not this format


def test_bad_arguments_are_refused_naming_the_field():
    w = torch.randn(8, 16).bfloat16().float()
    with pytest.raises(ValueError, match="float32"):
        f32_ops.pack_bf16_exact(w.bfloat16())
    short = torch.empty(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out"):
        _core.f32_pack_bf16_exact(w.numpy(), short.view(torch.int16).numpy().view("uint16"))


def test_the_policy_runs_the_format_on_f32_ops_at_every_row_count():
    isa = linear_policy.Isa.detect()
    probe = linear_policy.Probe()
    for rows in (1, 64, 129, 512, 4096):
        assert linear_policy.choose(FP32_IN_BF16, rows, isa, probe) is Backend.F32_OPS
    assert linear_policy.reachable(FP32_IN_BF16, isa, probe) == {Backend.F32_OPS}
    assert linear_policy.choose_invariant(FP32_IN_BF16, isa) is Backend.F32_OPS
    # plain fp32 weights keep oneDNN's packed product beyond f32_ops' rows
    if isa.has("onednn:float32"):
        assert linear_policy.choose("float32", 512, isa, probe) is Backend.ONEDNN


@pytest.mark.parametrize("build", [tm.llama, tm.qwen3])
@pytest.mark.parametrize("config", [
    {},
    {"max_batch_tokens": 16},                 # chunked prefill
    {"num_blocks": 6, "page_size": 8},        # preemption
])
def test_greedy_parity_on_bf16_valued_weights(build, config):
    model = _bf16_valued(build())
    prompts = tm.random_prompts(7, 5, 3, 40)
    with Engine(model, config=ContinuousBatchingConfig(**config)) as engine:
        linears = _linears(engine)
        assert linears.weight_format == FP32_IN_BF16
        assert all(p.f32 is None or p.f32.dtype == torch.bfloat16 for p in linears._packs)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=10))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == tm.generate_greedy(model, prompt, 10)


def test_logprobs_are_those_of_fp32_panels_bit_for_bit(monkeypatch):
    # batch-invariant mode: every product on f32_ops on both sides, and the output head's
    # product fixed (by default it is chosen by a timing)
    model = _bf16_valued(tm.llama())
    prompts = tm.random_prompts(3, 4, 5, 30)
    sampling = SamplingParams(max_new_tokens=8, logprobs=3)
    config = ContinuousBatchingConfig(max_batch_tokens=64)

    def run() -> tuple[str, list]:
        with Engine(model, config=config, batch_invariant=True) as engine:
            outs = engine.generate(prompts, sampling)
            return _linears(engine).weight_format, [o.logprobs for o in outs]

    narrow = run()
    monkeypatch.setattr(cpu_linear, "bf16_exact", lambda w: False)
    plain = run()
    assert (narrow[0], plain[0]) == (FP32_IN_BF16, "float32")
    assert narrow[1] == plain[1]


def test_random_fp32_weights_keep_the_fp32_format():
    with Engine(tm.llama()) as engine:
        linears = _linears(engine)
        assert linears.weight_format == "float32"
        assert all(p.f32 is None or p.f32.dtype == torch.float32 for p in linears._packs)


def test_a_weight_changed_off_bf16_is_packed_as_fp32_again():
    model = _bf16_valued(tm.llama())
    prompt = tm.random_prompts(5, 1, 8, 20)[0]
    with Engine(model) as engine:
        engine.generate([prompt], SamplingParams(max_new_tokens=2))
        layer = model.model.layers[0].mlp.down_proj
        with torch.no_grad():
            layer.weight.add_(torch.randn_like(layer.weight) * 1e-4)  # off bf16 values
        out = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0]
        linears = _linears(engine)
        packed = linears.packed_of([layer])
        assert packed is not None and packed.f32 is not None
        assert packed.f32.dtype == torch.float32
        x = torch.randn(3, layer.in_features)
        torch.testing.assert_close(packed.f32_product(x), F.linear(x, layer.weight),
                                   rtol=1e-5, atol=1e-5)
    assert out.token_ids == tm.generate_greedy(model, prompt, 8)


def test_the_output_head_runs_on_its_bf16_panels_with_no_copy_of_its_own():
    model = _bf16_valued(tm.llama())
    prompts = tm.random_prompts(9, 4, 5, 20)
    with Engine(model) as engine:
        head = engine.runner.head
        assert head.backend is None and head._packed._value is None \
            and head._transposed._value is None
        assert _linears(engine).only_on_bf16_panels(model.get_output_embeddings())
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == tm.generate_greedy(model, prompt, 8)
    with Engine(tm.llama()) as engine:  # fp32 values: its own copy, as probed
        assert not _linears(engine).only_on_bf16_panels(engine.model.get_output_embeddings())
