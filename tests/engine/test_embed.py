"""`Engine.embed`: pooled final hidden states equal to the model's own forward pooled the same
way, across architectures, chunked prefills, prefix-cache hits, mixed with generation, and the
checkpoint's sentence-transformers pooling."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import tiny_models
import torch
import torch.nn.functional as F
from ferrobatch import ContinuousBatchingConfig, Engine, FieldError, SamplingParams
from ferrobatch.engine.embedding import pooling_defaults

torch.set_num_threads(1)


def reference(model, prompt: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """The base model's last hidden state pooled as `pooling` (the model's own forward)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = model.base_model(input_ids=ids).last_hidden_state[0].float()
    v = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
    return F.normalize(v, dim=0) if normalize else v


def prompts(n: int, seed: int, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, tiny_models.VOCAB) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def assert_close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [tiny_models.llama, tiny_models.qwen3, tiny_models.mistral,
                                   tiny_models.gemma2, tiny_models.gemma3])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embed_matches_model_forward(build, pooling):
    model = build()
    # small max_batch_tokens: the longer prompts are pooled over several chunks
    cfg = ContinuousBatchingConfig(num_blocks=128, page_size=8, max_batch_tokens=24)
    ps = prompts(6, seed=hash(pooling) % 100)
    with Engine(model, config=cfg) as eng:
        outs = eng.embed(ps, pooling=pooling, normalize=pooling != "cls")
    for p, out in zip(ps, outs, strict=True):
        assert out.prompt_token_ids == p and out.pooling == pooling
        assert out.dimensions == model.config.hidden_size
        assert_close(out.embedding, reference(model, p, pooling, pooling != "cls"))


def test_embed_batches_with_generation_and_prefix_hits():
    model = tiny_models.llama()
    cfg = ContinuousBatchingConfig(num_blocks=128, page_size=4, max_batch_tokens=32)
    shared = prompts(1, seed=5, lo=20, hi=20)[0]
    ps = [shared + tail for tail in prompts(4, seed=6, lo=1, hi=9)]
    with Engine(model, config=cfg) as eng:
        gen = [eng.add_request(p, SamplingParams(max_new_tokens=12)) for p in ps[:2]]
        first = eng.embed(ps, pooling="mean")  # mean: no prefix hits taken
        last = eng.embed(ps, pooling="last")  # last: the shared blocks are hits
        assert eng.stats()["prefix_hit_tokens"] > 0
        for rid, p in zip(gen, ps[:2], strict=True):
            out = eng.get_output(rid)
            want = tiny_models.generate_greedy(model, p, 12)
            assert out.token_ids == want
    for p, a, b in zip(ps, first, last, strict=True):
        assert_close(a.embedding, reference(model, p, "mean", True))
        assert_close(b.embedding, reference(model, p, "last", True))


@pytest.mark.parametrize("offload", [0.0, 0.01])
def test_embed_after_preemption(offload):
    model = tiny_models.llama()
    # a cache this small preempts the embedding requests while generation grows (soft
    # reset, or offload to the swap pool): pooled rows are recorded once
    cfg = ContinuousBatchingConfig(num_blocks=16, page_size=4, max_batch_tokens=16,
                                   cpu_offload_space=offload)
    ps = prompts(6, seed=8, lo=20, hi=40)
    with Engine(model, config=cfg) as eng:
        gen = [eng.add_request(p[:10], SamplingParams(max_new_tokens=40, ignore_eos=True))
               for p in ps[:3]]
        outs = eng.embed(ps, pooling="mean", normalize=False)
        for rid, p in zip(gen, ps, strict=False):
            assert eng.get_output(rid).token_ids == tiny_models.generate_greedy(
                model, p[:10], 40, ignore_eos=True)
        stats = eng.stats()
        assert stats["num_preemptions"] > 0
        assert (stats["num_offloads"] > 0) == bool(offload)
    for p, out in zip(ps, outs, strict=True):
        assert_close(out.embedding, reference(model, p, "mean", False))


def test_aembed_and_async_batching():
    model = tiny_models.llama()
    cfg = ContinuousBatchingConfig(num_blocks=64, page_size=8, max_batch_tokens=24,
                                   use_async_batching=True)
    ps = prompts(4, seed=9)
    with Engine(model, config=cfg) as eng:
        outs = asyncio.run(eng.aembed(ps, pooling="mean"))
    for p, out in zip(ps, outs, strict=True):
        assert_close(out.embedding, reference(model, p, "mean", True))


def test_embed_bad_input_names_the_field():
    with Engine(tiny_models.llama(), config=ContinuousBatchingConfig(num_blocks=32)) as eng:
        with pytest.raises(FieldError) as e:
            eng.embed([[5, 6]], pooling="max")
        assert e.value.field == "pooling"
        with pytest.raises(FieldError) as e:
            eng.embed([[5, 6]], normalize="yes")  # type: ignore[arg-type]
        assert e.value.field == "normalize"
        with pytest.raises(FieldError) as e:
            eng.embed([[5, 100000]])
        assert e.value.field == "prompt"
        with pytest.raises(FieldError) as e:
            eng.embed([])
        assert e.value.field == "prompt"
        # the engine still serves
        assert eng.embed([[5, 6, 7]])[0].dimensions == 64


def _st_dir(tmp_path, pooling_keys: dict, modules: list[str]) -> str:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **pooling_keys}))
    entries = []
    for i, kind in enumerate(modules):
        path = {"Pooling": "1_Pooling", "Normalize": "2_Normalize"}.get(kind, "")
        entries.append({"idx": i, "name": str(i), "path": path,
                        "type": f"sentence_transformers.models.{kind}"})
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    return str(tmp_path)


def test_sentence_transformers_pooling(tmp_path):
    d = _st_dir(tmp_path, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False},
                ["Transformer", "Pooling", "Normalize"])
    got = pooling_defaults(d)
    assert (got.pooling, got.normalize, got.error) == ("mean", True, None)


def test_sentence_transformers_unsupported_module(tmp_path):
    d = _st_dir(tmp_path, {"pooling_mode_max_tokens": True}, ["Transformer", "Pooling"])
    got = pooling_defaults(d)
    assert got.error is not None and "max" in got.error


@pytest.mark.parametrize("modules,pooling", [
    ({"0": "Transformer"}, None), (["Transformer", "Pooling"], None),
    (None, [{"pooling_mode_mean_tokens": True}]),
])
def test_wrongly_typed_sentence_transformers_files_are_an_error_to_report(
        tmp_path, modules, pooling):
    # (recorded for `embed` to name; the checkpoint still opens for generation)
    d = _st_dir(tmp_path, {"pooling_mode_mean_tokens": True}, ["Transformer", "Pooling"])
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    got = pooling_defaults(d)
    assert got.error is not None and got.pooling == "last"


def test_checkpoint_pooling_is_the_default(tmp_path):
    model = tiny_models.llama()
    model.save_pretrained(tmp_path)
    _st_dir(tmp_path, {"pooling_mode_cls_token": True}, ["Transformer", "Pooling"])
    with Engine(str(tmp_path), config=ContinuousBatchingConfig(num_blocks=32)) as eng:
        out = eng.embed([[7, 8, 9, 10]])[0]
        assert (out.pooling, out.normalized) == ("cls", False)
        assert_close(out.embedding, reference(model, [7, 8, 9, 10], "cls", False))
        # an explicit argument wins over the checkpoint's setting
        assert eng.embed([[7, 8, 9, 10]], pooling="last")[0].pooling == "last"


def test_bundled_model_embeddings():
    """The bundled SmolLM2: both poolings equal its own forward pooled the same way."""
    with Engine() as eng:
        texts = ["Paged attention stores keys and values in blocks.", "Hello!"]
        ids = [list(eng.tokenizer(t)["input_ids"]) for t in texts]
        for pooling in ("mean", "last"):
            outs = eng.embed(texts, pooling=pooling)
            for p, out in zip(ids, outs, strict=True):
                assert out.prompt_token_ids == p
                assert out.dimensions == eng.embedding_size == 576
                assert_close(out.embedding, reference(eng.model, p, pooling, True))
