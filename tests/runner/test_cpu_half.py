"""The CPU half-precision path: packed linears (`ferrobatch.runner.cpu_linear`), fp32 residual
stream, the in-place decode attention kernel, dtype resolution, and bf16 quality under
every scheduling mode."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams, _core
from ferrobatch.cpu import amx_ops
from ferrobatch.cpu.arrays import numpy_view
from ferrobatch.models import resolve_dtype
from ferrobatch.runner.cpu_linear import PackedLinears, packing_available
from ferrobatch.runner.model_runner import ModelRunner
from ferrobatch.workloads import agreement
from ref_planner import drive_runner

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not packing_available(), reason="no oneDNN packed linears")



def _half(name: str, dtype: torch.dtype = torch.bfloat16):
    return tm.BUILDERS[name]().to(dtype)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gemma3", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_the_gathered_sdpa_path(name, dtype):
    """The in-place kernel (full and sliding windows, softcap, GQA) against the gather +
    SDPA path on the same steps: fp32 to rounding, bf16 to bf16 rounding."""
    model = tm.BUILDERS[name]().to(dtype)
    prompts = tm.random_prompts(3, 5, 2, 40)
    got = {}
    for kernel in (True, False):
        runner = ModelRunner(model, num_blocks=128, page_size=4)
        assert runner.decode_kernel  # on by default on CPU
        runner.decode_kernel = kernel
        got[kernel] = drive_runner(runner, prompts, 6, forced=True)
        runner.close()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_decode_kernel_refuses_bad_arguments():
    q = torch.zeros(2, 4, 8)
    k = torch.zeros(4 * 4, 2, 8, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    table = np.array([[1, 2], [3, 9]], dtype=np.int32)  # chunk 9 is outside a 4-chunk cache
    kw = dict(q_dtype="float32", cache_dtype="bfloat16", out_dtype="float32", page=4,
              window=0, scale=1.0, softcap=0.0, threads=1)
    with pytest.raises(ValueError, match="outside the cache"):
        _core.paged_decode_attention(q.numpy(), numpy_view(k), numpy_view(k), table,
                                     np.array([3, 6], dtype=np.int32), out.numpy(), **kw)
    with pytest.raises(ValueError, match="dtype"):
        _core.paged_decode_attention(q.numpy(), numpy_view(k), numpy_view(k), table,
                                     np.array([3, 3], dtype=np.int32), out.numpy(),
                                     **{**kw, "cache_dtype": "int4"})


def test_packed_linears_group_and_leave_the_model_as_it_was():
    model = _half("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    runner = ModelRunner(model, num_blocks=64, page_size=4)
    lin = runner.activations.linears
    assert lin is not None and lin.weight_dtype == torch.bfloat16
    assert lin.num_groups == 2 * model.config.num_hidden_layers  # q/k/v and gate/up
    assert runner.activation_dtype == torch.float32  # the fp32 residual stream holds here
    drive_runner(runner, tm.random_prompts(1, 3, 3, 9), 3)
    assert not any("forward" in m.__dict__ for m in model.modules())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    torch.testing.assert_close(model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits, ref,
                               atol=0, rtol=0)
    runner.close()


def test_packed_linears_run_the_own_forward_on_other_threads():
    model = _half("llama")
    ids = torch.tensor([[9, 10, 11]])
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
    main = threading.current_thread()
    lin = PackedLinears.of(model, activation_dtype=torch.float32,
                           in_thread=lambda: threading.current_thread() is main)
    got = {}

    def other_thread() -> None:
        with torch.inference_mode():
            got["x"] = model(input_ids=ids).logits

    with lin.active():  # the gate says "inside" only for this thread's forwards here
        for layer in lin._layers:
            assert "forward" in layer.__dict__
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert torch.equal(got["x"], ref)


def test_weights_changed_in_place_are_packed_again():
    model = _half("llama")
    runner = ModelRunner(model, num_blocks=64, page_size=4)
    prompts = tm.random_prompts(2, 2, 4, 8)
    first = drive_runner(runner, prompts, 1)[0]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3)
    runner2 = ModelRunner(model, num_blocks=64, page_size=4)
    want = drive_runner(runner2, prompts, 1)[0]
    got = drive_runner(runner, prompts, 1)[0]
    assert not torch.allclose(first, want)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_weights_replaced_are_packed_again():
    """A linear's or a norm's weight replaced by another parameter between steps: the next
    step computes with the new one (packed again; the lean layers read the new norm)."""
    model = _half("llama")
    runner = ModelRunner(model, num_blocks=64, page_size=4)
    assert runner.activations.lean is not None  # the norm is read by the lean layers
    prompts = tm.random_prompts(2, 2, 4, 8)
    first = drive_runner(runner, prompts, 1)[0]
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.mlp.down_proj.weight = torch.nn.Parameter(layer.mlp.down_proj.weight * -3)
        layer.input_layernorm.weight = torch.nn.Parameter(layer.input_layernorm.weight * 2)
    runner2 = ModelRunner(model, num_blocks=64, page_size=4)
    want = drive_runner(runner2, prompts, 1)[0]
    got = drive_runner(runner, prompts, 1)[0]
    assert not torch.allclose(first, want)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_model_activations_keep_the_model_dtype():
    model = _half("llama")
    runner = ModelRunner(model, num_blocks=64, page_size=4, activations="model")
    assert runner.activation_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="activations"):
        ModelRunner(model, num_blocks=64, page_size=4, activations="fp8")


def _generate_each(model, prompts, new):
    return [tm.generate_greedy(model, p, new, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("setup", list(tm.SCHEDULING_SETUPS))
def test_bf16_engine_is_at_least_as_close_to_fp32_as_bf16_generate(setup):
    """bf16 outputs against the fp32 greedy reference: the batch (chunking, preemption,
    offload, shared prefixes) must not make them worse than the model's own bf16
    `generate` on each prompt alone."""
    new = 16
    bf16, prompts, ref = tm.bf16_quality_case(setup, new)
    own = agreement(_generate_each(bf16, prompts, new), ref)
    cfg = ContinuousBatchingConfig(**tm.SCHEDULING_SETUPS[setup])
    with Engine(bf16, config=cfg) as engine:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True),
                               progress=False)
        stats = engine.stats()
    ours = agreement([o.token_ids for o in outs], ref)
    assert ours["tokens"] >= own["tokens"] - 0.05, (ours, own)
    if setup in ("preempt", "offload"):
        assert stats["num_preemptions"] > 0, stats


def test_dtype_names_and_auto(tmp_path):
    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype(torch.float16, cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cpu)
    with pytest.raises(ValueError, match="floating"):
        resolve_dtype(torch.int8, cpu)
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    native = amx_ops.available()  # AMX tiles or AVX512-BF16, as the kernel crate sees it
    assert resolve_dtype("auto", cpu, tmp_path) == (torch.bfloat16 if native else torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert resolve_dtype("auto", cpu, tmp_path) == torch.float32


def test_a_loaded_model_is_never_converted(caplog):
    model = tm.llama()
    with caplog.at_level("WARNING", logger="ferrobatch"):
        engine = Engine(model, dtype="bfloat16", config=ContinuousBatchingConfig(num_blocks=32))
    assert engine.dtype == torch.float32 and model.dtype == torch.float32
    assert "never converted" in caplog.text
    engine.close()
