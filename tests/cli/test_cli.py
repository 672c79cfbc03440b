"""Tests of the ``ferrobatch`` command (python/ferrobatch/cli/).

Flag parsing runs everywhere; generate / serve / bench run on a tiny random-init Llama
saved to a temporary directory, and are skipped when the engine's extension is not built.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ferrobatch import cli
from ferrobatch.config import ContinuousBatchingConfig
from server_helpers import build_model, build_tokenizer, free_port, wait_healthy

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
needs_engine = pytest.mark.skipif(
    importlib.util.find_spec("ferrobatch._core") is None,
    reason="the ferrobatch._core extension is not built",
)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_every_config_field_has_a_flag_with_help() -> None:
    fields = [f.name for f in dataclasses.fields(ContinuousBatchingConfig) if f.name != "extra"]
    parser = cli.build_parser()
    subs = _subparsers(parser)
    assert set(subs) == {"serve", "generate", "bench"}
    for name, sub in subs.items():
        dests = {a.dest: a for a in sub._actions}
        for field in fields:
            assert field in dests, f"{name}: no flag for ContinuousBatchingConfig.{field}"
            flag = "--" + field.replace("_", "-")
            assert flag in dests[field].option_strings
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
        text = sub.format_help()
        assert "ContinuousBatchingConfig" in text


def test_config_flags_map_one_to_one() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        [
            "generate",
            "--prompt",
            "x",
            "--page-size",
            "16",
            "--num-blocks",
            "64",
            "--max-batch-tokens",
            "512",
            "--max-memory-percent",
            "0.2",
            "--max-requests-per-batch",
            "8",
            "--scheduler-type",
            "prefill_first",
            "--safety-margin",
            "0.1",
            "--no-allow-block-sharing",
            "--cpu-offload-space",
            "0.5",
            "--q-padding-interval-size",
            "8",
            "--kv-padding-interval-size",
            "16",
            "--no-use-cuda-graph",
            "--use-async-batching",
            "--max-queue-size",
            "100",
        ]
    )
    cfg = cli.build_config(args)
    assert cfg == ContinuousBatchingConfig(
        page_size=16,
        num_blocks=64,
        max_batch_tokens=512,
        max_memory_percent=0.2,
        max_requests_per_batch=8,
        scheduler_type="prefill_first",
        safety_margin=0.1,
        allow_block_sharing=False,
        cpu_offload_space=0.5,
        q_padding_interval_size=8,
        kv_padding_interval_size=16,
        use_cuda_graph=False,
        use_async_batching=True,
        max_queue_size=100,
    )
    # flags left out keep the config's defaults
    assert cli.build_config(parser.parse_args(["serve"])) == ContinuousBatchingConfig()
    # --batch-invariant on every command that builds an engine
    for cmd in ("serve", "generate", "bench"):
        cfg = cli.build_config(parser.parse_args([cmd, "--batch-invariant"]))
        assert cfg == ContinuousBatchingConfig(batch_invariant=True)


def test_bad_values_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--prompt", "x", "--page-size", "2"]) == 2
    assert "page_size" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert cli.main(["generate"]) == 2
    assert "no prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--scheduler-type", "lifo"])
    assert "invalid choice" in capsys.readouterr().err
    for port in ("70000", "-1"):
        with pytest.raises(SystemExit):
            cli.main(["serve", "--port", port])
        assert "a port is 0..65535" in capsys.readouterr().err


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("ferrobatch ")
    for command in ("serve", "generate", "bench"):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"])
        assert exc.value.code == 0
        assert "--page-size" in capsys.readouterr().out


def test_format_table() -> None:
    text = cli.format_table(
        [{"method": "ferrobatch", "tok_s": 1234.5}, {"method": "x", "tok_s": 2.0}],
        [("method", "method"), ("tok_s", "tok/s")],
    )
    lines = text.splitlines()
    assert lines[0].split() == ["method", "tok/s"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["ferrobatch", "1234.5"]
    assert lines[3].split() == ["x", "2.00"]


# ---------------------------------------------------------------------------------------
# with the real engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = build_tokenizer()
    build_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@needs_engine
def test_generate_text_and_jsonl(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ferrobatch import Engine, SamplingParams

    common = ["--max-new-tokens", "6", "--num-blocks", "64", "--page-size", "16", "--no-progress"]
    rc = cli.main(
        [
            "generate",
            str(model_dir),
            "--prompt",
            "Hello world",
            "--prompt",
            "The capital of France",
            "--format",
            "jsonl",
            *common,
        ]
    )
    assert rc == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello world", "The capital of France"]
    with Engine(
        str(model_dir), config=ContinuousBatchingConfig(num_blocks=64, page_size=16)
    ) as engine:
        ref = engine.generate(
            ["Hello world", "The capital of France"],
            SamplingParams(max_new_tokens=6),
            progress=False,
        )
        chat_ref = engine.chat(
            [{"role": "user", "content": "Hi there"}],
            SamplingParams(max_new_tokens=6),
            progress=False,
        )
    for rec, out in zip(records, ref, strict=True):
        assert rec["text"] == out.text
        assert rec["token_ids"] == out.token_ids
        assert rec["completion_tokens"] == len(out.token_ids) <= 6
        assert rec["finish_reason"] in ("stop", "length")

    # a prompts file with a plain prompt and a chat conversation, text output to a file
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Hello world"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi there"}]})
        + "\n"
    )
    out_file = tmp_path / "out.txt"
    rc = cli.main(
        ["generate", str(model_dir), "--file", str(prompts), "--output", str(out_file), *common]
    )
    assert rc == 0
    text = out_file.read_text()
    assert "=== [0] Hello world" in text and "=== [1] Hi there" in text
    assert ref[0].text in text and chat_ref[0].text in text

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    assert cli.main(["generate", str(model_dir), "--file", str(bad), *common]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


@needs_engine
def test_bench_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    rc = cli.main(
        [
            "bench",
            "--prompts",
            "3",
            "--min-len",
            "8",
            "--max-len",
            "24",
            "--max-new-tokens",
            "4",
            "--repeats",
            "1",
            "--num-blocks",
            "64",
            "--page-size",
            "16",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    header, rule, row = out.strip().splitlines()[:3]
    assert "tok/s" in header and set(rule) <= {"-", " "}
    assert row.split()[0] == "ferrobatch"
    data = json.loads(out_json.read_text())
    assert data["results"][0]["tokens"] == 12


@needs_engine
def test_serve_command(model_dir: Path, tmp_path: Path) -> None:
    """`ferrobatch serve` as a real process: 503 or 200 on /health, then a completion."""
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "ferrobatch.cli",
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--num-blocks",
        "64",
        "--page-size",
        "16",
        "--threads",
        "1",
        "--api-key",
        "k",
        "--served-model-name",
        "tiny",
    ]
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_healthy(proc, url, 90) == 200, "server never became healthy"
        headers = {"Authorization": "Bearer k"}
        r = httpx.post(
            url + "/v1/completions",
            headers=headers,
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 3},
        )
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        assert body["usage"]["completion_tokens"] <= 3
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text(errors="replace")


def test_serve_exits_when_the_model_fails_to_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken-model"  # a config and no weights: the path check passes
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    rc = cli.main(["serve", str(broken), "--port", str(free_port()), "--num-blocks", "8"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "the model failed to load" in err


def test_file_flags_and_devices_are_checked_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # each a one-line error (exit 2), never a traceback, and before a model loads or a
    # benchmark runs
    keys = tmp_path / "keys.jsonl"  # per-line sampling keys are not read: refused
    keys.write_text('{"prompt": "a", "max_new_tokens": 3}\n')
    broken = tmp_path / "broken"  # a config, no weights: transformers' OSError, one line
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    cases = [
        (["generate", "--prompt", "x", "--output", str(tmp_path / "no" / "o.jsonl")],
         "does not exist"),
        (["generate", "--prompt", "x", "--output", str(tmp_path)], "is a directory"),
        (["generate", "--file", str(tmp_path / "missing.jsonl")], "no such file"),
        (["bench", "--prompts", "2", "--json", str(tmp_path / "no" / "x.json")],
         "does not exist"),
        (["generate", "--prompt", "x", "--device", "meta"], "device 'meta'"),
        (["generate", "--prompt", "x", "--device", "gpu"], "names no torch device"),
        (["generate", str(tmp_path / "nowhere"), "--prompt", "x"], "no such file"),
        (["serve", str(tmp_path / "nowhere"), "--port", str(free_port())], "no such file"),
        (["generate", "--prompt", "x", "--system", "be brief"], "--system needs --chat"),
        (["generate", "--file", str(keys)], "exactly one of"),
        (["generate", str(broken), "--prompt", "x"], "model.safetensors"),
    ]
    for argv, fragment in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, (argv, err)
