"""`--tensor-parallel-size` on every command, handed to the Engine."""

from __future__ import annotations

import pytest
from ferrobatch import cli


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_flag_parses_on_every_command(command: str) -> None:
    parser = cli.build_parser()
    extra = ["--prompt", "x"] if command == "generate" else []
    args = parser.parse_args([command, *extra, "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
    assert parser.parse_args([command, *extra]).tensor_parallel_size == 1
    with pytest.raises(SystemExit):
        parser.parse_args([command, *extra, "--tensor-parallel-size", "0"])


def test_build_engine_passes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferrobatch.cli import build
    from ferrobatch.engine import llm_engine

    seen = {}

    class Fake:
        def __init__(self, model, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(llm_engine, "Engine", Fake)
    args = cli.build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    build.build_engine(args)
    assert seen["tensor_parallel_size"] == 2
