"""Split GGUF files (`NAME-00001-of-0000N.gguf` and siblings, as llama.cpp's `gguf-split`
and its converter's `--split-max-tensors` write them): the reader merges the shards' tables,
the loader and the engine take the first shard or the shards' directory, and a set that is
named by another shard, misses one, or is renamed is refused naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from ferrobatch import Engine, SamplingParams
from ferrobatch.errors import FieldError
from ferrobatch.gguf.loader import load_gguf
from ferrobatch.gguf.reader import GGUFFile
from ferrobatch.gguf.source import gguf_path_of
from gguf import GGUFReader
from gguf_files import tiny_model, write_gguf

IDS = torch.tensor([[3, 17, 99, 5, 200, 7, 8, 9, 11, 400, 13, 14]])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny untied Llama (its `output.weight` in the last shard) written whole,
    split three tensors a shard, and split with a metadata-only first shard."""
    model = tiny_model("llama")
    out = {}
    for kind, kw in {"whole": {}, "split": {"split_max_tensors": 3},
                     "small_first": {"split_max_tensors": 5, "small_first_shard": True}}.items():
        d = tmp_path_factory.mktemp(kind)
        out[kind] = write_gguf(d / "tiny-llama-q4_k.gguf", model, "llama", "Q4_K",
                               tokenizer=True, **kw).path
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits[0]


@pytest.mark.parametrize("kind", ["split", "small_first"])
def test_reader_merges_the_shards(files, kind: str) -> None:
    first = files[kind]
    shards = sorted(first.parent.glob("*.gguf"))
    assert len(shards) > 2 and first == shards[0] and first.name.endswith(
        f"-00001-of-{len(shards):05d}.gguf")
    whole, split = GGUFFile(files["whole"]), GGUFFile(first)
    assert split.paths == shards
    assert list(split.tensors) == list(whole.tensors)
    assert {t.shard for t in split.tensors.values()} == set(range(
        1 if kind == "small_first" else 0, len(shards)))
    for name, t in whole.tensors.items():
        s = split.tensors[name]
        assert (s.shape, s.ggml_type, s.nbytes) == (t.shape, t.ggml_type, t.nbytes)
        assert np.array_equal(split.raw(name), whole.raw(name))
        # each entry's offset is where gguf-py finds it in its own shard
        theirs = next(x for x in GGUFReader(shards[s.shard]).tensors if x.name == name)
        assert theirs.data_offset == s.offset
    assert split.file_size == sum(p.stat().st_size for p in shards)
    assert split.metadata["general.architecture"] == "llama"
    raw = split.raw("output.weight")
    assert split.maps(raw.ctypes.data, raw.nbytes)


@pytest.mark.parametrize("kind", ["split", "small_first"])
def test_split_loads_as_the_whole_file(files, kind: str) -> None:
    whole, _ = load_gguf(files["whole"])
    split, tok = load_gguf(files[kind])
    assert not split.config.tie_word_embeddings  # (the head is in the last shard)
    assert split.get_output_embeddings().weight_q is not split.get_input_embeddings().weight_q
    torch.testing.assert_close(_logits(split), _logits(whole), rtol=0, atol=0)
    assert tok is not None and tok.eos_token_id == 2
    assert split.ferrobatch_gguf.file_bytes == GGUFFile(files[kind]).file_size


def test_engine_on_the_shards_directory(files) -> None:
    prompts = [[1, 5, 9, 200, 31], [1, 77, 3]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in Engine(files["whole"]).generate(prompts, params,
                                                                 progress=False)]
    assert gguf_path_of(files["split"].parent) == files["split"]
    engine = Engine(files["split"].parent)
    try:
        got = [o.token_ids for o in engine.generate(prompts, params, progress=False)]
    finally:
        engine.close()
    assert got == want


def _copy(first: Path, to: Path) -> list[Path]:
    to.mkdir()
    return [Path(shutil.copy(p, to)) for p in sorted(first.parent.glob("*.gguf"))]


def test_another_shard_named(files) -> None:
    second = sorted(files["split"].parent.glob("*.gguf"))[1]
    with pytest.raises(FieldError, match=r"shard 2 of \d+ of a split GGUF file; name its "
                                         r"first shard \(tiny-llama-q4_k-00001-of") as err:
        load_gguf(second)
    assert err.value.field == "model"


def test_missing_shard(files, tmp_path) -> None:
    shards = _copy(files["split"], tmp_path / "set")
    shards[-1].unlink()
    with pytest.raises(FieldError, match=rf"shard {len(shards)} of {len(shards)}, "
                                         rf"{shards[-1].name}, is missing"):
        load_gguf(shards[0])
    # (a directory of an incomplete set is no split file: its files are named)
    with pytest.raises(FieldError, match="holds .* GGUF files"):
        gguf_path_of(shards[0].parent)


def test_renamed_first_shard(files, tmp_path) -> None:
    shards = _copy(files["split"], tmp_path / "set")
    renamed = shards[0].rename(shards[0].with_name("model.gguf"))
    with pytest.raises(FieldError, match="not named as one"):
        load_gguf(renamed)


def test_shard_of_another_set(files, tmp_path) -> None:
    shards = _copy(files["split"], tmp_path / "set")
    # the second shard replaced by the other set's second shard (its split metadata then
    # disagrees: that set has another count)
    other = sorted(files["small_first"].parent.glob("*.gguf"))
    assert len(other) != len(shards)
    shutil.copy(other[1], shards[1])
    with pytest.raises(FieldError, match=f"not shard 2 of {len(shards)}"):
        load_gguf(shards[0])
