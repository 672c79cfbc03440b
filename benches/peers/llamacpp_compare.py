"""ferrobatch vs llama.cpp on the same GGUF file, cores and threads, repeats interleaved.

Runs in the project's venv; llama.cpp's binaries come from ``benches/peers/setup_llamacpp.sh``
(``$LLAMACPP_BIN``, see ``llamacpp_tools.bin_dir``). ferrobatch builds one ``Engine(gguf)``
(prefix caching off, as in every llama.cpp run here) and keeps it for all repeats; one
``llama-server`` (as many slots as requests, one unified KV cache, no prompt cache) is
started once and SIGSTOPped while ferrobatch runs. Each repeat measures, in alternating
engine order:

* single-stream decode: one request of ``--single-new`` (128) tokens after a short code
  prompt; ferrobatch ``generate`` vs ``llama-server`` ``/completion`` of the same token ids,
  and ``llama-bench`` tg128 (which starts from an empty context);
* offline throughput: ``--prompts`` (32) chat prompts (the GGUF's chat template,
  ``ferrobatch.workloads.chat_prompts``) x ``--new`` (64) tokens, greedy, EOS ignored;
  ferrobatch ``generate`` vs all prompts at once at ``llama-server`` (same token ids) and
  ``llama-batched-bench`` with the same shape (``-npl`` prompts of the mean prompt length);
* prefill: the first ``--pp`` (512) tokens of README.md as one prompt, one token generated;
  ferrobatch vs ``llama-server`` (the same ids; its own prompt timing) and ``llama-bench``
  pp512; GOP/s = 2 x (weights of the matrices a prompt token passes through) x tokens / s.

Also: the read bandwidth of the pinned cores (the best of a torch sum of a 1 GiB array on
``--threads`` threads and numpy's max on one), the bytes of matrices a decode step reads
(every matrix but the token embedding), so each decode figure's share of the bandwidth
limit; resident memory of both engines; the greedy agreement of the two engines' outputs.
The driver pins itself and every llama.cpp process with ``taskset`` (``--pin``, default: the
first ``--threads`` cores). The table (``llamacpp_table.py``, which also renders a saved
``--json`` again) gives medians over repeats and medians of the per-repeat ratios.

    .venv/bin/python benches/peers/llamacpp_compare.py --gguf model.gguf --threads 1 --repeats 3
    .venv/bin/python benches/peers/llamacpp_compare.py --gguf model.gguf --threads 2 --md out.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "benches" / "peers"))

# ferrobatch first: it sets its OpenMP wait policy before torch loads the runtime
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams  # noqa: E402, I001
from ferrobatch.gguf.reader import GGUFFile  # noqa: E402
from ferrobatch.workloads import agreement, chat_prompts  # noqa: E402
import compare_cpu  # noqa: E402  (pinning, steal time, source state)
import llamacpp_table  # noqa: E402
import llamacpp_tools as lt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

CODE_PROMPT = "def fibonacci(n):"


def read_bandwidth(threads: int, repeats: int = 5) -> dict[str, float]:
    """GB/s reading a 1 GiB array on this process's (pinned) cores: torch's sum on
    ``threads`` threads and numpy's max (one thread); the best time of ``repeats``."""
    a = np.ones(1 << 27)
    t = torch.from_numpy(a)
    out = {}
    for name, fn in {"torch.sum": t.sum, "np.max": a.max}.items():
        fn()
        best = min(_timed(fn) for _ in range(repeats))
        out[name] = a.nbytes / best / 1e9
    return out


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(gguf: str) -> dict[str, float]:
    """Bytes of matrices one decode step reads (all 2-D tensors but the token embedding) and
    the weights a prompt token multiplies (the same, less the output head)."""
    tensors = GGUFFile(gguf).tensors.values()
    mats = [t for t in tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    body = [t for t in mats if t.name != "output.weight"]
    return {"decode_bytes": float(sum(t.nbytes for t in mats)),
            "prompt_weights": float(sum(t.shape[0] * t.shape[1] for t in body))}


def rss_mib() -> dict[str, float]:
    """This process's VmRSS, RssAnon, RssFile and peak (VmHWM), MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    return out


def cpu_name() -> str:
    """The CPU's model name with its CPUID family and model (a VM may show a generic name)."""
    info: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
            if not line.strip():
                break
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')})")


class Ferro:
    """One engine for all repeats; each call times one ``generate``."""

    def __init__(self, gguf: str) -> None:
        t0 = time.perf_counter()
        cfg = ContinuousBatchingConfig(allow_block_sharing=False)
        self.engine = Engine(gguf, config=cfg)
        self.build_s = time.perf_counter() - t0
        self.rss_built = rss_mib()

    def run(self, prompts: list[list[int]], new: int) -> dict[str, Any]:
        """Generated tokens, wall and CPU seconds, token ids of one ``generate``."""
        sp = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0)
        c0, t0 = time.process_time(), time.perf_counter()
        outs = self.engine.generate(prompts, sp, progress=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        ids = [list(o.token_ids) for o in outs]
        return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(map(len, ids)), "ids": ids}


def workload(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """The token ids both engines get: a code prompt, the chat prompts, the prefill prompt."""
    tok = engine.tokenizer
    readme = tok((ROOT / "README.md").read_text()).input_ids[: args.pp]
    if len(readme) < args.pp:
        raise SystemExit(f"README.md has {len(readme)} tokens, fewer than --pp {args.pp}")
    return {"code": [int(t) for t in tok(CODE_PROMPT).input_ids],
            "chat": chat_prompts(engine.encode_chat, args.prompts),
            "pp": [int(t) for t in readme]}


def warm_up(ferro: Ferro, server: lt.LlamaServer, w: dict[str, Any]) -> None:
    """One untimed pass of each shape on both engines (short generations)."""
    ferro.run([w["code"]], 4)
    ferro.run(w["chat"], 2)
    ferro.run([w["pp"]], 1)
    lt.fire(server, [w["code"]], 4)
    lt.fire(server, w["chat"], 2)
    lt.fire(server, [w["pp"]], 1)


def one_repeat(r: int, ferro: Ferro, server: lt.LlamaServer, w: dict[str, Any],
               args: argparse.Namespace, bins: Path) -> dict[str, Any]:
    """Every measurement once; ferrobatch first on even repeats, llama.cpp first on odd."""
    rec: dict[str, Any] = {"load_before": os.getloadavg()[0],
                           "steal0": compare_cpu.steal_seconds(args.cpus)}

    def ferro_side() -> None:
        server.pause(True)
        try:
            rec["f_single"] = ferro.run([w["code"]], args.single_new)
            rec["f_offline"] = ferro.run(w["chat"], args.new)
            rec["f_pp"] = ferro.run([w["pp"]], 1)
            rec["f_pp"]["pp_tokens"] = len(w["pp"])
        finally:
            server.pause(False)

    def llama_side() -> None:
        rec["s_single"] = lt.fire(server, [w["code"]], args.single_new)
        rec["s_offline"] = lt.fire(server, w["chat"], args.new)
        rec["s_pp"] = lt.fire(server, [w["pp"]], 1)
        server.pause(True)
        try:
            rec["bench"] = lt.llama_bench(bins, args.gguf, args.cpus, args.threads, args.pp,
                                          args.single_new)
            rec["batched"] = lt.batched_bench(bins, args.gguf, args.cpus, args.threads,
                                              w["mean_len"], args.new, len(w["chat"]))
        finally:
            server.pause(False)

    for side in (ferro_side, llama_side) if r % 2 == 0 else (llama_side, ferro_side):
        side()
    rec["load_after"] = os.getloadavg()[0]
    rec["steal_s"] = compare_cpu.steal_seconds(args.cpus) - rec.pop("steal0")
    print(f"repeat {r}: " + summary_line(rec), flush=True)
    return rec


def summary_line(rec: dict[str, Any]) -> str:
    """A one-line progress report of a repeat."""
    def rate(key: str) -> float:
        return rec[key]["tokens"] / rec[key]["wall_s"]

    f_pp = rec["f_pp"]["pp_tokens"] / rec["f_pp"]["wall_s"]
    return (f"single {rate('f_single'):.2f} vs server {rate('s_single'):.2f} / tg "
            f"{rec['bench']['tg']:.2f} tok/s; offline {rate('f_offline'):.1f} vs server "
            f"{rate('s_offline'):.1f} / batched {rec['batched']['gen_tok_s']:.1f}; pp "
            f"{f_pp:.1f} vs bench {rec['bench']['pp']:.1f}; load {rec['load_before']:.2f}->"
            f"{rec['load_after']:.2f}, steal {rec['steal_s']:.1f} s")


def engine_args(ap: argparse.ArgumentParser) -> None:
    """The arguments every llama.cpp comparison takes: the file, threads, cores, binaries."""
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pin", default=None, metavar="CPUS",
                    help="cores for both engines (default: the first --threads cores)")
    ap.add_argument("--llamacpp-bin", default=None, help="default: $LLAMACPP_BIN or the "
                    "set-up script's build/bin")


def cpus_of(args: argparse.Namespace) -> list[int]:
    """The cores `--pin` names, or the first `--threads` this process may run on."""
    return (compare_cpu.parse_cpus(args.pin) if args.pin
            else sorted(os.sched_getaffinity(0))[: args.threads])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    engine_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--single-new", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    args.cpus = cpus_of(args)
    return args


def main() -> None:
    args = parse_args()
    bins = lt.bin_dir(args.llamacpp_bin)
    compare_cpu.pin_self(args.cpus)
    torch.set_num_threads(args.threads)
    cpu = cpu_name()
    print(f"CPU {cpu}; cores {args.cpus}; {args.threads} thread(s); load "
          f"{os.getloadavg()}", flush=True)
    wb = weight_bytes(args.gguf)
    probes = read_bandwidth(args.threads)
    bw = max(probes.values())
    print(f"read bandwidth (GB/s): {probes}; decode reads {wb['decode_bytes'] / 1e9:.3f} GB "
          f"a token", flush=True)
    ferro = Ferro(args.gguf)
    print(f"ferrobatch engine built in {ferro.build_s:.1f} s", flush=True)
    w = workload(ferro.engine, args)
    w["mean_len"] = round(statistics.mean(map(len, w["chat"])))
    longest = max(map(len, w["chat"]))
    ctx = -(-max(len(w["chat"]) * (longest + args.new), args.pp + 64) // 256) * 256
    log = ROOT / "bench-results" / "peers" / f"llama-server-{args.threads}t.log"
    server = lt.LlamaServer(bins, args.gguf, args.cpus, args.threads, len(w["chat"]), ctx, log)
    try:
        print(f"llama-server ready in {server.wait_healthy(600):.1f} s (ctx {ctx})", flush=True)
        warm_up(ferro, server, w)
        recs = []
        for r in range(args.repeats):
            recs.append(one_repeat(r, ferro, server, w, args, bins))
        s_rss = server.status()
    finally:
        server.stop()
    f_rss = rss_mib()
    f_rss["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    meta = {"cpu": cpu, "cpus": args.cpus, "threads": args.threads, "prompts": len(w["chat"]),
            "new": args.new, "single_new": args.single_new, "pp": args.pp,
            "mean_len": w["mean_len"], "decode_gb": wb["decode_bytes"] / 1e9,
            "prompt_weights": wb["prompt_weights"], "bw_gbs": bw, "bw_probes": probes,
            "f_rss": f_rss, "f_rss_built": ferro.rss_built, "s_rss": s_rss,
            "ferro_build_s": ferro.build_s, "gguf": args.gguf,
            "agreement": agreement(recs[0]["f_offline"]["ids"],
                                   [o["tokens"] for o in recs[0]["s_offline"]["outs"]]),
            "loads": [(r["load_before"], r["load_after"]) for r in recs],
            "steal_s": [r["steal_s"] for r in recs], "source": compare_cpu.source_state()}
    text = llamacpp_table.heading(meta) + "\n\n" + llamacpp_table.table(recs, meta)
    print("\n" + text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.json:
        for r in recs:
            for k in ("f_single", "f_offline", "f_pp"):
                r[k].pop("ids", None)
            for k in ("s_single", "s_offline", "s_pp"):
                for o in r[k]["outs"]:
                    o.pop("tokens", None)
        args.json.write_text(json.dumps({"meta": meta, "repeats": recs}, indent=1,
                                        default=str))
    ferro.engine.close()


if __name__ == "__main__":
    main()
