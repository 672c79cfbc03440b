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

    taskset is applied by the driver itself (``--pin``, default: the first --threads cores)
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


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def figures(recs: list[dict[str, Any]], w: dict[str, Any], wb: dict[str, float],
            bw: float) -> dict[str, Any]:
    """Medians over repeats of every figure of the table."""
    pp_n = len(w["pp"])

    def rate(key: str, n_key: str = "tokens", per: str = "wall_s") -> float:
        return med([r[key][n_key] / r[key][per] for r in recs])

    f = {
        "f_single": rate("f_single"), "f_single_cpu": rate("f_single", per="cpu_s"),
        "s_single": rate("s_single"), "s_single_cpu": rate("s_single", per="cpu_s"),
        "s_single_decode": med([r["s_single"]["outs"][0]["timings"]["predicted_per_second"]
                                for r in recs]),
        "b_tg": med([r["bench"]["tg"] for r in recs]),
        "f_offline": rate("f_offline"), "f_offline_cpu": rate("f_offline", per="cpu_s"),
        "s_offline": rate("s_offline"), "s_offline_cpu": rate("s_offline", per="cpu_s"),
        "b_offline": med([r["batched"]["gen_tok_s"] for r in recs]),
        "f_pp": med([pp_n / r["f_pp"]["wall_s"] for r in recs]),
        "s_pp": med([r["s_pp"]["outs"][0]["timings"]["prompt_per_second"] for r in recs]),
        "b_pp": med([r["bench"]["pp"] for r in recs]),
    }
    for k in ("f_single", "s_single", "s_single_decode", "b_tg"):
        f[k + "_bw"] = f[k] * wb["decode_bytes"] / (bw * 1e9)
    for k in ("f_pp", "s_pp", "b_pp"):
        f[k + "_gops"] = 2 * wb["prompt_weights"] * f[k] / 1e9
    return f


def table(f: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown table of the medians."""
    n, new, pp = meta["prompts"], meta["new"], meta["pp"]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}"

    rows = [
        ("| measure | ferrobatch | llama.cpp | ferrobatch / llama.cpp |"),
        ("|---|---|---|---|"),
        (f"| single stream, {meta['single_new']} tokens, tok/s (wall) | {f['f_single']:.2f} | "
         f"server {f['s_single']:.2f} (decode alone {f['s_single_decode']:.2f}); llama-bench "
         f"tg{meta['single_new']} {f['b_tg']:.2f} | {ratio(f['f_single'], f['s_single'])} / "
         f"{ratio(f['f_single'], f['b_tg'])} |"),
        (f"| single stream, tok per CPU-s | {f['f_single_cpu']:.2f} | server "
         f"{f['s_single_cpu']:.2f} | {ratio(f['f_single_cpu'], f['s_single_cpu'])} |"),
        (f"| single stream, share of the bandwidth limit ({meta['decode_gb']:.3f} GB a token / "
         f"{meta['bw_gbs']:.1f} GB/s) | {100 * f['f_single_bw']:.0f}% | server "
         f"{100 * f['s_single_bw']:.0f}% (decode alone {100 * f['s_single_decode_bw']:.0f}%), "
         f"tg {100 * f['b_tg_bw']:.0f}% | |"),
        (f"| {n} chat prompts x {new} tokens, tok/s (wall) | {f['f_offline']:.1f} | server "
         f"-np {n} {f['s_offline']:.1f}; batched-bench npp {meta['mean_len']} npl {n} "
         f"{f['b_offline']:.1f} | {ratio(f['f_offline'], f['s_offline'])} / "
         f"{ratio(f['f_offline'], f['b_offline'])} |"),
        (f"| {n} x {new}, tok per CPU-s | {f['f_offline_cpu']:.1f} | server "
         f"{f['s_offline_cpu']:.1f} | {ratio(f['f_offline_cpu'], f['s_offline_cpu'])} |"),
        (f"| prefill {pp} tokens, tok/s (GOP/s) | {f['f_pp']:.1f} ({f['f_pp_gops']:.0f}) | "
         f"server {f['s_pp']:.1f} ({f['s_pp_gops']:.0f}); llama-bench pp{pp} {f['b_pp']:.1f} "
         f"({f['b_pp_gops']:.0f}) | {ratio(f['f_pp'], f['s_pp'])} / "
         f"{ratio(f['f_pp'], f['b_pp'])} |"),
        (f"| RSS, MiB (anonymous + file) | {meta['f_rss']['VmRSS']:.0f} "
         f"({meta['f_rss']['RssAnon']:.0f} + {meta['f_rss']['RssFile']:.0f}), peak "
         f"{meta['f_rss']['VmHWM']:.0f} | server {meta['s_rss'].get('VmRSS', 0):.0f} "
         f"({meta['s_rss'].get('RssAnon', 0):.0f} + {meta['s_rss'].get('RssFile', 0):.0f}), "
         f"peak {meta['s_rss'].get('VmHWM', 0):.0f} | |"),
    ]
    agree = meta["agreement"]
    rows.append(f"| greedy outputs identical (ferrobatch vs server, {n} x {new}) | "
                f"{100 * agree['requests']:.0f}% of requests, "
                f"{100 * agree['tokens']:.0f}% of tokens before the first divergence | | |")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pin", default=None, metavar="CPUS",
                    help="cores for both engines (default: the first --threads cores)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--single-new", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--llamacpp-bin", default=None, help="default: $LLAMACPP_BIN or the "
                    "set-up script's build/bin")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    args.cpus = (compare_cpu.parse_cpus(args.pin) if args.pin
                 else sorted(os.sched_getaffinity(0))[: args.threads])
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
    fig = figures(recs, w, wb, bw)
    meta = {"cpu": cpu, "cpus": args.cpus, "threads": args.threads, "prompts": len(w["chat"]),
            "new": args.new, "single_new": args.single_new, "pp": args.pp,
            "mean_len": w["mean_len"], "decode_gb": wb["decode_bytes"] / 1e9, "bw_gbs": bw,
            "bw_probes": probes, "f_rss": f_rss, "f_rss_built": ferro.rss_built,
            "s_rss": s_rss, "ferro_build_s": ferro.build_s,
            "agreement": agreement(recs[0]["f_offline"]["ids"],
                                   [o["tokens"] for o in recs[0]["s_offline"]["outs"]]),
            "loads": [(r["load_before"], r["load_after"]) for r in recs],
            "steal_s": [r["steal_s"] for r in recs], "source": compare_cpu.source_state()}
    md = table(fig, meta)
    head = (f"{cpu}, cores {args.cpus}, {args.threads} thread(s), medians of {args.repeats}; "
            f"load average {min(min(x) for x in meta['loads']):.2f}-"
            f"{max(max(x) for x in meta['loads']):.2f}")
    print("\n" + head + "\n\n" + md)
    if args.md:
        args.md.write_text(head + "\n\n" + md + "\n")
    if args.json:
        for r in recs:
            for k in ("f_single", "f_offline", "f_pp"):
                r[k].pop("ids", None)
            for k in ("s_single", "s_offline", "s_pp"):
                for o in r[k]["outs"]:
                    o.pop("tokens", None)
        args.json.write_text(json.dumps({"figures": fig, "meta": meta, "repeats": recs},
                                        indent=1, default=str))
    ferro.engine.close()


if __name__ == "__main__":
    main()
