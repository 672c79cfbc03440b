"""Multi-LoRA: PEFT adapters applied per request in shared steps, greedy tokens equal to PEFT's
own model with that adapter (and to the base model without one), prefix blocks never shared
across adapters, the `max_loras` cap, loading and unloading at run time, bad input."""

from __future__ import annotations

import copy
import json
import random
import shutil

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, FieldError, SamplingParams

peft = pytest.importorskip("peft")

torch.set_num_threads(1)

TARGETS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "b": dict(r=8, lora_alpha=16, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
              use_rslora=True),
    "c": dict(r=2, lora_alpha=4, target_modules=["q_proj"]),
}


def _make_adapter(base, name: str, path, seed: int) -> None:
    """The PEFT adapter `TARGETS[name]` with random (non-zero) A and B, saved to `path`."""
    _save_adapter(base, path, seed, **TARGETS[name])


def _save_adapter(base, path, seed: int, **lora: object) -> None:
    """A PEFT adapter of `lora`'s `LoraConfig` fields, random (non-zero) A and B, saved."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(init_lora_weights=False, **lora)
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():  # large enough to change greedy tokens
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(20.0)
    model.save_pretrained(str(path))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tiny_models.llama()
    paths = {}
    for i, name in enumerate(TARGETS):
        paths[name] = tmp_path_factory.mktemp(f"lora-{name}")
        _make_adapter(base, name, paths[name], seed=10 + i)
    return base, {k: str(v) for k, v in paths.items()}


def peft_greedy(base, paths: dict[str, str], adapter: str | None, prompt: list[int],
                new: int) -> list[int]:
    """The oracle: PEFT's model with `adapter` (None: the base model) generating alone."""
    if adapter is None:
        return tiny_models.generate_greedy(base, prompt, new, ignore_eos=True)
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), paths[adapter]).eval()
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def prompts(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, tiny_models.VOCAB) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def run(eng, reqs, new=10):
    sps = [SamplingParams(max_new_tokens=new, ignore_eos=True, lora=a) for _, a in reqs]
    return [o.token_ids for o in eng.generate([p for p, _ in reqs], sps, progress=False)]


def test_mixed_adapters_in_one_batch_match_peft(setup):
    base, paths = setup
    ps = prompts(9, seed=1)
    adapters = ["a", "b", None, "a", "c", None, "b", "c", "a"]
    cfg = ContinuousBatchingConfig(num_blocks=128, page_size=4, max_batch_tokens=40)
    with Engine(base, config=cfg, lora_modules={k: paths[k] for k in ("a", "b")},
                enable_lora=True) as eng:
        eng.load_lora("c", paths["c"])
        assert eng.lora_adapters == ["a", "b", "c"]
        got = run(eng, list(zip(ps, adapters, strict=True)))
    want = [peft_greedy(base, paths, a, p, 10) for p, a in zip(ps, adapters, strict=True)]
    assert got == want
    # and to PEFT's merged model (W + scale * B @ A), the form adapters are shipped merged in
    for name in ("a", "b"):
        merged = peft.PeftModel.from_pretrained(copy.deepcopy(base), paths[name])
        merged = merged.merge_and_unload().eval()
        for p, a, g in zip(ps, adapters, got, strict=True):
            if a == name:
                assert g == tiny_models.generate_greedy(merged, p, 10, ignore_eos=True)
    # the adapters do change the tokens (the test would be empty otherwise)
    plain = [peft_greedy(base, paths, None, p, 10) for p in ps]
    assert sum(g != w for g, w, a in zip(got, plain, adapters, strict=True) if a) >= 4


def test_prefix_blocks_never_shared_across_adapters(setup):
    base, paths = setup
    shared = prompts(1, seed=2, lo=17, hi=17)[0]  # 4 full blocks of 4
    cfg = ContinuousBatchingConfig(num_blocks=128, page_size=4)
    with Engine(base, config=cfg, lora_modules=paths) as eng:
        order = [None, "a", "b", None, "a"]
        got = [run(eng, [(shared, a)])[0] for a in order]
        hits = eng.stats()["prefix_hit_tokens"]
    assert got == [peft_greedy(base, paths, a, shared, 10) for a in order]
    # the repeats (base, then "a") hit their own earlier blocks, nothing else does
    assert hits == 2 * 16


@pytest.mark.parametrize("async_batching", [False, True])
def test_max_loras_caps_active_adapters(setup, async_batching):
    base, paths = setup
    ps = prompts(8, seed=3)
    adapters = ["a", "b", "c", None, "c", "b", "a", None]
    cfg = ContinuousBatchingConfig(num_blocks=128, page_size=4, max_batch_tokens=64,
                                   use_async_batching=async_batching)
    with Engine(base, config=cfg, lora_modules=paths, max_loras=1) as eng:
        seen = []
        original = eng.lora.bind

        def spy(salts, cu):
            seen.append(len({s for s in salts if s}))
            return original(salts, cu)

        eng.lora.bind = spy
        got = run(eng, list(zip(ps, adapters, strict=True)), new=6)
        assert eng.lora.active == 0
    assert max(seen) == 1
    assert got == [peft_greedy(base, paths, a, p, 6) for p, a in zip(ps, adapters, strict=True)]


def test_unload_and_bad_input(setup, tmp_path):
    base, paths = setup
    with Engine(base, config=ContinuousBatchingConfig(num_blocks=64, page_size=4),
                lora_modules={"a": paths["a"]}) as eng:
        with pytest.raises(FieldError) as e:
            eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, lora="zz"))
        assert e.value.field == "lora"
        with pytest.raises(FieldError) as e:
            eng.load_lora("a", paths["b"])
        assert e.value.field == "lora_name"
        with pytest.raises(FieldError) as e:
            eng.load_lora("x", str(tmp_path))  # no adapter files there
        assert e.value.field == "lora_modules"
        (tmp_path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "use_dora": True}))
        with pytest.raises(FieldError, match="use_dora"):
            eng.load_lora("x", str(tmp_path))
        eng.unload_lora("a")
        with pytest.raises(FieldError) as e:
            eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, lora="a"))
        assert e.value.field == "lora"
        with pytest.raises(FieldError):
            eng.unload_lora("a")
        # still serving
        assert len(eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2
    with Engine(base, config=ContinuousBatchingConfig(num_blocks=32)) as eng:
        with pytest.raises(FieldError) as e:
            eng.generate([[5, 6]], SamplingParams(max_new_tokens=2, lora="a"))
        assert e.value.field == "lora"
        with pytest.raises(FieldError):
            eng.load_lora("a", paths["a"])
    with pytest.raises(FieldError) as e:
        SamplingParams(lora="")
    assert e.value.field == "lora"


@pytest.mark.parametrize("quantized", [dict(quantization="q8_0"), dict(gguf=True)])
def test_quantized_weights_refuse_lora_before_loading(tmp_path, quantized):
    # (refused up front, naming LoRA's field, before the model is read or quantized)
    model = tmp_path / "model.gguf" if quantized.pop("gguf", False) else tmp_path / "ckpt"
    if model.suffix == ".gguf":
        model.write_bytes(b"GGUF")
    with pytest.raises(FieldError, match="quantized weights") as err:
        Engine(str(model), enable_lora=True, **quantized)
    assert err.value.field == "lora_modules"


def test_unloading_an_adapter_fails_only_its_waiting_requests(setup):
    # a request held back by `max_loras` when its adapter is unloaded fails alone; the
    # running one finishes with its adapter and the engine keeps serving
    base, paths = setup
    with Engine(base, config=ContinuousBatchingConfig(num_blocks=64, page_size=4),
                lora_modules={"a": paths["a"], "b": paths["b"]}, max_loras=1) as eng:
        running = eng.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=200,
                                                               ignore_eos=True, lora="a"))
        held = eng.add_request([9, 10, 11], SamplingParams(max_new_tokens=5, lora="b"))
        eng.unload_lora("b")
        with pytest.raises(FieldError, match="unloaded") as e:
            eng.get_output(held, timeout=60)
        assert e.value.field == "lora"
        assert eng.get_output(running, timeout=60).finish_reason == "length"
        assert len(eng.generate([[3, 4, 5]], SamplingParams(max_new_tokens=2),
                                progress=False)[0].token_ids) == 2


def test_adapter_hooks_act_only_in_the_steps_own_thread(setup):
    # the caller's model stays its own while the engine binds adapter rows in its thread
    import threading

    base, paths = setup
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        want = base(prompt).logits
    with Engine(base, config=ContinuousBatchingConfig(num_blocks=64, page_size=4),
                lora_modules={"a": paths["a"]}) as eng:
        salt = eng.lora.salt("a")
        bound, release = threading.Event(), threading.Event()

        def step() -> None:
            with eng.lora.bind([salt], [0, 4]):
                bound.set()
                release.wait(30)

        worker = threading.Thread(target=step)
        worker.start()
        try:
            assert bound.wait(30)
            with torch.inference_mode():
                got = base(prompt).logits
        finally:
            release.set()
            worker.join(30)
    assert torch.equal(got, want)


def test_alpha_pattern_keys_match_as_peft_matches_them(setup, tmp_path):
    # a key with alternation is one group (PEFT: `(.*\.)?(key)$`)
    base, _ = setup
    _save_adapter(base, tmp_path, 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                  alpha_pattern={"q_proj|v_proj": 64})
    ps = prompts(2, 41)
    with Engine(base, config=ContinuousBatchingConfig(num_blocks=64, page_size=4),
                lora_modules={"p": str(tmp_path)}) as eng:
        got = run(eng, [(p, "p") for p in ps])
    for p, g in zip(ps, got, strict=True):
        assert g == peft_greedy(base, {"p": str(tmp_path)}, "p", p, 10)


@pytest.mark.parametrize("config", [
    [1, 2], {"peft_type": "LORA", "lora_alpha": "16"}, {"peft_type": "LORA", "lora_alpha": None},
    {"peft_type": "LORA", "alpha_pattern": {"q_proj(": 4}},
    {"peft_type": "LORA", "alpha_pattern": ["q_proj"]},
])
def test_malformed_adapter_configs_name_the_field(setup, tmp_path, config):
    base, paths = setup
    adapter = tmp_path / "bad"
    shutil.copytree(paths["a"], adapter)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with Engine(base, config=ContinuousBatchingConfig(num_blocks=32), enable_lora=True) as eng:
        with pytest.raises(FieldError) as e:
            eng.load_lora("bad", str(adapter))
        assert e.value.field == "lora_modules"
        with pytest.raises(FieldError) as e:
            eng.load_lora("none", None)
        assert e.value.field == "lora_modules"


def test_held_requests_go_in_by_priority(setup):
    base, paths = setup
    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=4, scheduling_policy="priority")
    with Engine(base, config=cfg, lora_modules=paths, max_loras=1) as eng:
        def submit(prompt, adapter, priority, new):
            sp = SamplingParams(max_new_tokens=new, ignore_eos=True, lora=adapter,
                                priority=priority)
            req = eng._make_request(prompt, sp, None)
            eng._submit(req)
            return req

        first = submit([5, 6, 7], "a", 50, 10)
        eng._drive_once()
        late = submit([8, 9, 10], "b", 50, 30)
        urgent = submit([11, 12, 13], "c", -100, 5)
        order: list[str] = []
        named = {"first": first, "late": late, "urgent": urgent}
        while not all(r.done.is_set() for r in named.values()):
            eng._drive_once()
            order += [n for n, r in named.items() if r.done.is_set() and n not in order]
    assert order == ["first", "urgent", "late"]
