"""What `load_model` (and so `Engine`) says about a model or device argument that names
nothing it can load: a `FieldError` naming the field, before transformers or torch fail
somewhere deeper (a hub error for a mistyped path, a driver error for a missing GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ferrobatch.errors import FieldError
from ferrobatch.models import check_model_path, load_model, parse_device


@pytest.mark.parametrize("name", ["/no/such/dir", "/no/such/model.gguf", "./missing",
                                  "~/missing-ferrobatch-model", "missing.gguf"])
def test_missing_paths_are_named(name: str) -> None:
    for quantization in (None, "q4_0"):
        with pytest.raises(FieldError, match="no such file or directory") as err:
            load_model(name, quantization=quantization)
        assert err.value.field == "model"


def test_repository_ids_are_left_to_the_local_cache() -> None:
    # ("org/name" may be in the local Hugging Face cache: transformers decides)
    check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    check_model_path("gpt2")


def test_directories_and_files_that_hold_no_model(tmp_path: Path) -> None:
    with pytest.raises(FieldError, match="neither a config.json") as err:
        load_model(tmp_path)
    assert err.value.field == "model"
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(FieldError, match="is a file but no GGUF file") as err:
        load_model(weights)
    assert err.value.field == "model"


def test_devices_that_name_nothing_usable() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(FieldError, match="names no torch device") as err:
        load_model(None, device="gpu")
    assert err.value.field == "device"
    if not torch.cuda.is_available():
        with pytest.raises(FieldError, match="CUDA is not available") as err:
            parse_device("cuda:0")
        assert err.value.field == "device"
