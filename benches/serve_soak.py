"""A soak run of `ferrobatch serve`: many streaming chat clients for minutes, every response
checked, the server's memory sampled.

Starts ``ferrobatch serve MODEL`` on a free loopback port (its own process group, log under
``--log-dir``), then runs ``--clients`` clients for ``--minutes``. Each client loops: a chat
question (`ferrobatch.workloads.CHAT_QUESTIONS`) with a random ``max_tokens`` in
``--max-tokens``, streamed with usage; one request in ``--cancel-every`` is dropped by its
client after a few chunks (a user closing the tab), which must not disturb anyone else.

A response counts as good when: HTTP 200; the stream ends with ``[DONE]``; exactly one choice
ends, with ``finish_reason`` ``stop`` or ``length``; the usage chunk is there; its
``completion_tokens`` is at least 1, equals ``max_tokens`` when the reason is ``length`` and
is at most ``max_tokens`` otherwise; and no content arrives after the end. Anything else is an
error, kept with its message. The server's resident memory (its process tree, from
/proc via psutil) is sampled every 5 s: the report gives the median of the run's second
tenth (after warm-up) and of its last tenth, and the slope over its last half. The KV
cache's pages are first touched when a block is first written, and the allocator hands out
never-used blocks before it evicts cached prefixes, so resident memory climbs until the
whole pool has been written once, then stays put: a pool small enough to be filled early
(`--serve-args "--num-blocks 256"`) shows the plateau within minutes.

    .venv/bin/python benches/serve_soak.py /path/model.gguf --clients 64 --minutes 10 \\
        --threads 2 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE.parent / "python")]

from ferrobatch.workloads import CHAT_QUESTIONS  # noqa: E402
from serve_compare import ROOT, Server, free_port  # noqa: E402


class Tally:
    """What the clients saw: good responses, errors, cancellations, tokens."""

    def __init__(self) -> None:
        self.good = 0
        self.cancelled = 0
        self.tokens = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []


def check_stream(events: list[dict[str, Any]], done: bool, max_tokens: int) -> str | None:
    """Why a finished stream is not a whole response (None when it is)."""
    if not done:
        return "stream ended without [DONE]"
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices") or []
               if c.get("finish_reason")]
    if len(reasons) != 1 or reasons[0] not in ("stop", "length"):
        return f"finish reasons {reasons}"
    usage = [e["usage"] for e in events if e.get("usage")]
    if not usage:
        return "no usage chunk"
    n = int(usage[-1].get("completion_tokens") or 0)
    if n < 1 or n > max_tokens or (reasons[0] == "length" and n != max_tokens):
        return f"completion_tokens {n} with finish_reason {reasons[0]} and max_tokens {max_tokens}"
    end = next(i for i, e in enumerate(events)
               if any(c.get("finish_reason") for c in e.get("choices") or []))
    late = [e for e in events[end + 1:]
            if any((c.get("delta") or {}).get("content") for c in e.get("choices") or [])]
    if late:
        return "content after the finish reason"
    return None


async def one_chat(client: Any, url: str, model: str, rng: random.Random, max_tokens: int,
                   cancel: bool, tally: Tally) -> None:
    """One streamed chat completion, checked (or dropped after a few chunks: `cancel`)."""
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(CHAT_QUESTIONS)}],
            "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.7]),
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    events: list[dict[str, Any]] = []
    done = False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                tally.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    done = True
                    break
                events.append(json.loads(data))
                if cancel and len(events) >= 3:
                    tally.cancelled += 1
                    return
    except Exception as exc:  # noqa: BLE001 - every failure is a finding of the soak
        tally.errors.append(f"{type(exc).__name__}: {exc}")
        return
    why = check_stream(events, done, max_tokens)
    if why is not None:
        tally.errors.append(why)
        return
    tally.good += 1
    tally.tokens += int(next(e["usage"] for e in reversed(events) if e.get("usage"))
                        ["completion_tokens"])
    tally.latencies.append(time.perf_counter() - t0)


async def client_loop(client: Any, url: str, model: str, seed: int, deadline: float,
                      args: Any, tally: Tally) -> None:
    rng = random.Random(seed)
    count = 0
    while time.perf_counter() < deadline:
        count += 1
        cancel = args.cancel_every > 0 and count % args.cancel_every == 0
        await one_chat(client, url, model, rng, rng.randint(*args.max_tokens), cancel, tally)


async def sample_memory(server: Server, deadline: float, samples: list[tuple[float, float]]
                        ) -> None:
    import psutil

    t0 = time.perf_counter()
    while time.perf_counter() < deadline:
        try:
            root = psutil.Process(server.proc.pid)
            rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            samples.append((time.perf_counter() - t0, rss / 2**20))
        except psutil.NoSuchProcess:
            return
        await asyncio.sleep(5.0)


async def soak(server: Server, args: Any) -> tuple[Tally, list[tuple[float, float]]]:
    import httpx

    tally = Tally()
    samples: list[tuple[float, float]] = []
    deadline = time.perf_counter() + 60.0 * args.minutes
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        model = (await client.get(server.url + "/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(
            sample_memory(server, deadline, samples),
            *(client_loop(client, server.url, model, i, deadline, args, tally)
              for i in range(args.clients)))
    return tally, samples


def report(tally: Tally, samples: list[tuple[float, float]], wall: float) -> dict[str, Any]:
    rss = [m for _, m in samples]
    tenth = max(1, len(rss) // 10)
    early = statistics.median(rss[tenth:2 * tenth]) if len(rss) >= 2 * tenth else rss[0]
    late = statistics.median(rss[-tenth:])
    half = samples[len(samples) // 2:]
    slope = 0.0
    if len(half) >= 2:
        tm = statistics.mean(t for t, _ in half)
        mm = statistics.mean(m for _, m in half)
        var = sum((t - tm) ** 2 for t, _ in half)
        slope = 60.0 * sum((t - tm) * (m - mm) for t, m in half) / var if var else 0.0
    lat = sorted(tally.latencies) or [0.0]
    return {"good": tally.good, "errors": len(tally.errors), "error_samples": tally.errors[:10],
            "cancelled": tally.cancelled, "tokens": tally.tokens,
            "tok_per_s": tally.tokens / wall, "latency_median_s": statistics.median(lat),
            "latency_max_s": lat[-1], "rss_mib_early": early, "rss_mib_late": late,
            "rss_mib_max": max(rss, default=0.0), "rss_mib_per_min_last_half": slope,
            "rss_samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF file or checkpoint directory")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[16, 160])
    ap.add_argument("--cancel-every", type=int, default=10,
                    help="each client drops its every n-th request early (0: never)")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--serve-args", default="", help="more `ferrobatch serve` flags")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/ferrobatch-soak"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    port = free_port()
    cmd = [str(ROOT / ".venv" / "bin" / "ferrobatch"), "serve", args.model,
           "--port", str(port), "--threads", str(args.threads), *args.serve_args.split()]
    server = Server("ferrobatch", cmd, dict(os.environ), port,
                    args.log_dir / f"soak-{int(time.time())}.log")
    try:
        print(f"server up in {server.wait_healthy(600):.1f} s", flush=True)
        t0 = time.perf_counter()
        tally, samples = asyncio.run(soak(server, args))
        out = report(tally, samples, time.perf_counter() - t0)
    finally:
        server.stop()
    shown = {k: v for k, v in out.items() if k != "rss_samples"}
    print(json.dumps(shown, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json),
                                                               "log_dir": str(args.log_dir)},
                                         **out}, indent=1))


if __name__ == "__main__":
    main()
