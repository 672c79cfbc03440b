"""Fixtures of the GGUF tests: files written once per session, and a cache directory of the
test's own (the loader caches configs and tokenizers under `FERROBATCH_CACHE`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from ferrobatch.gguf import modules
from gguf_files import LLAMA_CPP_FALLBACK, Written, k_m_types, tiny_model, write_gguf

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reference_products(request: pytest.FixtureRequest) -> Iterator[None]:
    """Exact parity with the model's own forward needs the same fp32 products on both
    sides: the kernels quantize each activation row to int8, so a last-bit difference in a
    row (the paged attention's sums against SDPA's) can move a rounding step and, in a
    random tiny model full of near ties, a later greedy token. Tests run the reference
    products (`ferrobatch.gguf.modules`) unless marked `kernel_products`."""
    if request.node.get_closest_marker("kernel_products"):
        yield
        return
    with modules.backend("reference"):
        yield


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERROBATCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Written, object]]:
    """`gguf_file(arch, qtype, **kw)` -> (the written file, its source model), written once
    per session per arguments, each in a directory of its own."""
    made: dict[tuple, tuple[Written, object]] = {}

    def make(arch: str, qtype: str = "Q8_0", **kw: object) -> tuple[Written, object]:
        key = (arch, qtype, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in made:
            d = Path(tmp_path_factory.mktemp(f"{arch}-{qtype}"))
            model = tiny_model(arch)
            made[key] = (write_gguf(d / f"tiny-{arch}-{qtype.lower()}.gguf", model, arch, qtype,
                                    **kw), model)
        return made[key]

    return make


@pytest.fixture(scope="session")
def k_m_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Written, object]]:
    """`k_m_file(arch, base)` -> (file, source model): a llama.cpp `Q4_K_M` (`base` Q4_K) or
    `Q5_K_M` (Q5_K) mix of a model whose hidden width (224) is not whole 256-weight blocks,
    so that every matrix reading the hidden state falls back as llama.cpp's quantizer does
    (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0) and the down projections (input 512) keep
    theirs. Written once per session per arguments."""
    made: dict[tuple[str, str], tuple[Written, object]] = {}

    def make(arch: str, base: str = "Q4_K") -> tuple[Written, object]:
        if (arch, base) not in made:
            d = Path(tmp_path_factory.mktemp(f"{arch}-{base}-m"))
            model = tiny_model(arch, hidden_size=224)
            written = write_gguf(d / f"tiny-{arch}-{base.lower()}-m.gguf", model, arch, base,
                                 types=k_m_types(model.config), fallback=LLAMA_CPP_FALLBACK)
            made[arch, base] = (written, model)
        return made[arch, base]

    return make
