"""llama.cpp as a benchmark peer: where its binaries are, its benchmark tools run under
``taskset`` with their JSON output parsed, and ``llama-server`` driven with token-id prompts.

The binaries come from ``benches/peers/setup_llamacpp.sh``: ``$LLAMACPP_BIN``, else the
script's default ``${FERROBATCH_CACHE:-~/.cache/ferrobatch}/peers/llama.cpp-0.3.36/build/bin``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches" / "peers"))

from serve_compare import Server, free_port  # noqa: E402  (server process, pause/stop, CPU)

VERSION = "0.3.36"
SETUP = "bash benches/peers/setup_llamacpp.sh"
TOOLS = ("llama-server", "llama-batched-bench", "llama-bench", "llama-perplexity",
         "llama-quantize", "llama-tokenize")


def bin_dir(arg: str | None = None) -> Path:
    """The directory holding the llama.cpp binaries (argument, ``$LLAMACPP_BIN``, default);
    raises with the set-up command when a binary is missing."""
    if arg is None:
        arg = os.environ.get("LLAMACPP_BIN")
    if arg is None:
        cache = Path(os.environ.get("FERROBATCH_CACHE", Path.home() / ".cache" / "ferrobatch"))
        home = Path(os.environ.get("LLAMACPP_HOME", cache / "peers" / f"llama.cpp-{VERSION}"))
        arg = str(home / "build" / "bin")
    path = Path(arg)
    missing = [t for t in TOOLS if not (path / t).is_file()]
    if missing:
        raise SystemExit(f"llama.cpp binaries {missing} not in {path}: run `{SETUP}` "
                         "(and set LLAMACPP_BIN / LLAMACPP_HOME if it built elsewhere)")
    return path


def pinned(cpus: list[int], cmd: list[str]) -> list[str]:
    """``cmd`` under ``taskset -c CPUS``."""
    return ["taskset", "-c", ",".join(map(str, cpus)), *cmd]


def run_tool(cmd: list[str], timeout: float) -> tuple[str, float]:
    """Run a benchmark tool; (stdout, wall seconds). Raises with its stderr tail on failure."""
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[0]} {' '.join(cmd[1:4])}... failed (rc {res.returncode}):\n"
                           + "\n".join(res.stderr.splitlines()[-15:]))
    return res.stdout, time.perf_counter() - t0


def llama_bench(bins: Path, gguf: str, cpus: list[int], threads: int, pp: int,
                tg: int) -> dict[str, float]:
    """One ``llama-bench`` invocation (one repetition after its warm-up) of ``pp<pp>`` and
    ``tg<tg>``: {"pp": tok/s, "tg": tok/s}."""
    cmd = pinned(cpus, [str(bins / "llama-bench"), "-m", gguf, "-t", str(threads),
                        "-p", str(pp), "-n", str(tg), "-r", "1", "-o", "json"])
    out, _ = run_tool(cmd, timeout=900)
    got: dict[str, float] = {}
    for row in json.loads(out):
        key = "pp" if row["n_gen"] == 0 else "tg"
        got[key] = float(row["avg_ts"])
    return got


def batched_bench(bins: Path, gguf: str, cpus: list[int], threads: int, pp: int, tg: int,
                  pl: int) -> dict[str, float]:
    """One ``llama-batched-bench`` run of ``pl`` sequences of ``pp`` random prompt tokens and
    ``tg`` generated each: its times and generated tokens per second of the whole run."""
    ctx = -(-pl * (pp + tg) // 256) * 256
    cmd = pinned(cpus, [str(bins / "llama-batched-bench"), "-m", gguf, "-t", str(threads),
                        "-tb", str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512",
                        "-npp", str(pp), "-ntg", str(tg), "-npl", str(pl),
                        "--output-format", "jsonl"])
    out, _ = run_tool(cmd, timeout=1800)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no result:\n{out[-2000:]}")
    row = rows[-1]
    return {"t_pp_s": row["t_pp"], "t_tg_s": row["t_tg"], "t_s": row["t"],
            "gen_tok_s": pl * tg / row["t"], "ctx": ctx}


class LlamaServer(Server):
    """``llama-server`` on 127.0.0.1 under ``taskset``: ``slots`` parallel slots over one
    unified KV cache of ``ctx`` tokens, no web UI."""

    def __init__(self, bins: Path, gguf: str, cpus: list[int], threads: int, slots: int,
                 ctx: int, log_path: Path) -> None:
        port = free_port()
        cmd = pinned(cpus, [str(bins / "llama-server"), "-m", gguf, "--host", "127.0.0.1",
                            "--port", str(port), "-t", str(threads), "-tb", str(threads),
                            "-np", str(slots), "-c", str(ctx), "-kvu", "--no-webui",
                            "--cache-ram", "0"])
        super().__init__("llama-server", cmd, dict(os.environ), port, log_path)

    def status(self) -> dict[str, float]:
        """VmRSS, VmHWM, RssAnon, RssFile of the server process (the taskset child), MiB."""
        out: dict[str, float] = {}
        for p in [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]:
            if "llama-server" not in p.name():
                continue
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    key = line.split(":")[0]
                    if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                        out[key] = int(line.split()[1]) / 1024
        return out


def complete(client: httpx.Client, url: str, prompt: list[int], new: int) -> dict[str, Any]:
    """One greedy ``/completion`` of token ids: exactly ``new`` tokens (EOS ignored), no
    prompt cache; its generated token ids, the server's timings and the request's wall."""
    body = {"prompt": prompt, "n_predict": new, "ignore_eos": True, "cache_prompt": False,
            "temperature": 0.0, "return_tokens": True, "stream": False}
    t0 = time.perf_counter()
    resp = client.post(url + "/completion", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"{url}/completion: HTTP {resp.status_code}: {resp.text[:500]}")
    data = resp.json()
    return {"tokens": [int(t) for t in data.get("tokens") or []],
            "timings": data.get("timings") or {}, "wall_s": time.perf_counter() - t0}


def fire(server: LlamaServer, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """All ``prompts`` at once (one client thread each); wall, the server's CPU seconds,
    generated tokens and every request's result."""
    c0, t0 = server.tree_cpu(), time.perf_counter()
    with httpx.Client(timeout=1800) as client, ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: complete(client, server.url, p, new), prompts))
    wall, cpu = time.perf_counter() - t0, server.tree_cpu() - c0
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(len(o["tokens"]) for o in outs),
            "outs": outs}
