"""The markdown table of ``llamacpp_compare.py``'s figures; run alone, it renders the table of
a run saved with ``--json`` again.

    .venv/bin/python benches/peers/llamacpp_table.py bench-results/peers/llamacpp-1t.json

Every figure is the median over repeats; every ratio is the median of the repeats' own
ratios (the two engines of one repeat ran minutes apart, under the same load). Tokens per
CPU-second count the engine's process CPU time only, so on a shared machine they move less
than the wall-time figures: with one pinned thread they are the rate the engine would reach
with the core to itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))


def rates(rec: dict[str, Any], pp: int) -> dict[str, float]:
    """One repeat's rates: ``f_`` ferrobatch, ``s_`` llama-server, ``b_`` llama-bench and
    llama-batched-bench; ``_cpu`` per CPU-second of the engine's process."""
    out: dict[str, float] = {}
    for eng in ("f", "s"):
        for shape in ("single", "offline", "pp"):
            run = rec[f"{eng}_{shape}"]
            n = pp if shape == "pp" else run["tokens"]
            out[f"{eng}_{shape}"] = n / run["wall_s"]
            out[f"{eng}_{shape}_cpu"] = n / run["cpu_s"]
    timings = rec["s_pp"]["outs"][0]["timings"]
    out["s_pp_own"] = timings["prompt_per_second"]
    out["s_single_decode"] = rec["s_single"]["outs"][0]["timings"]["predicted_per_second"]
    out["b_tg"], out["b_pp"] = rec["bench"]["tg"], rec["bench"]["pp"]
    out["b_offline"] = rec["batched"]["gen_tok_s"]
    return out


def figures(recs: list[dict[str, Any]], pp: int) -> dict[str, float]:
    """Medians of every rate, and ``a/b`` medians of the per-repeat ratios the table shows."""
    per = [rates(r, pp) for r in recs]
    fig = {k: statistics.median(p[k] for p in per) for k in per[0]}
    pairs = [("f_single", "s_single"), ("f_single", "b_tg"), ("f_single_cpu", "s_single_cpu"),
             ("f_offline", "s_offline"), ("f_offline", "b_offline"),
             ("f_offline_cpu", "s_offline_cpu"), ("f_pp", "s_pp"), ("f_pp", "b_pp"),
             ("f_pp_cpu", "s_pp_cpu")]
    for a, b in pairs:
        fig[f"{a}/{b}"] = statistics.median(p[a] / p[b] for p in per)
    return fig


def table(recs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The table: single stream, offline, prefill, memory, agreement."""
    f = figures(recs, meta["pp"])
    n, new, pp = meta["prompts"], meta["new"], meta["pp"]
    gops = 2 * meta["prompt_weights"] / 1e9

    def share(rate: float) -> str:
        return f"{100 * rate * meta['decode_gb'] / meta['bw_gbs']:.0f}%"

    def r(a: str, b: str) -> str:
        return f"{f[f'{a}/{b}']:.2f}"

    fr, sr = meta["f_rss"], meta["s_rss"]
    agree = meta["agreement"]
    return "\n".join([
        "| measure | ferrobatch | llama.cpp | ferrobatch / llama.cpp |",
        "|---|---|---|---|",
        f"| single stream, {meta['single_new']} tokens: tok/s (wall) | {f['f_single']:.2f} | "
        f"server {f['s_single']:.2f}; llama-bench tg{meta['single_new']} {f['b_tg']:.2f} | "
        f"{r('f_single', 's_single')} / {r('f_single', 'b_tg')} |",
        f"| single stream: tok per CPU-s | **{f['f_single_cpu']:.2f}** | server "
        f"**{f['s_single_cpu']:.2f}** | **{r('f_single_cpu', 's_single_cpu')}** |",
        share_row(f, meta, share),
        f"| {n} chat prompts x {new} tokens: tok/s (wall) | {f['f_offline']:.1f} | server "
        f"-np {n} {f['s_offline']:.1f}; batched-bench -npp {meta['mean_len']} -npl {n} "
        f"{f['b_offline']:.1f} | {r('f_offline', 's_offline')} / "
        f"{r('f_offline', 'b_offline')} |",
        f"| {n} x {new}: tok per CPU-s | **{f['f_offline_cpu']:.1f}** | server "
        f"**{f['s_offline_cpu']:.1f}** | **{r('f_offline_cpu', 's_offline_cpu')}** |",
        f"| prefill {pp} tokens: tok/s (GOP/s), wall | {f['f_pp']:.1f} "
        f"({gops * f['f_pp']:.0f}) | server {f['s_pp']:.1f} ({gops * f['s_pp']:.0f}; its own "
        f"timing {f['s_pp_own']:.1f}); llama-bench pp{pp} {f['b_pp']:.1f} "
        f"({gops * f['b_pp']:.0f}) | {r('f_pp', 's_pp')} / {r('f_pp', 'b_pp')} |",
        f"| prefill: tok per CPU-s (GOP per CPU-s) | **{f['f_pp_cpu']:.1f}** "
        f"({gops * f['f_pp_cpu']:.0f}) | server **{f['s_pp_cpu']:.1f}** "
        f"({gops * f['s_pp_cpu']:.0f}) | **{r('f_pp_cpu', 's_pp_cpu')}** |",
        f"| RSS at the end, MiB (anonymous + file), peak | {fr['VmRSS']:.0f} "
        f"({fr['RssAnon']:.0f} + {fr['RssFile']:.0f}), {fr['VmHWM']:.0f} | server "
        f"{sr.get('VmRSS', 0):.0f} ({sr.get('RssAnon', 0):.0f} + {sr.get('RssFile', 0):.0f}), "
        f"{sr.get('VmHWM', 0):.0f} | |",
        f"| greedy outputs, ferrobatch vs server ({n} x {new}, first repeat) | "
        f"{100 * agree['requests']:.0f}% of requests identical, {100 * agree['tokens']:.0f}% "
        f"of tokens before the first divergence | | |",
    ])


def share_row(f: dict[str, float], meta: dict[str, Any], share: Any) -> str:
    """Single-stream decode's share of the bandwidth limit: at the wall rate, and with one
    thread also at the CPU-time rate (the core to itself). With more threads the CPU-time
    rate says nothing of the wall rate (ferrobatch's governor may run fewer threads)."""
    cpu = meta["threads"] == 1
    return (f"| single stream: share of the bandwidth limit ({meta['decode_gb']:.2f} GB a token, "
            f"{meta['bw_gbs']:.1f} GB/s), {'at the CPU-time rate / ' if cpu else ''}at the wall "
            f"rate | {share(f['f_single_cpu']) + ' / ' if cpu else ''}{share(f['f_single'])} | "
            f"server {share(f['s_single_cpu']) + ' / ' if cpu else ''}{share(f['s_single'])}; "
            f"tg {share(f['b_tg'])} (wall) | |")


def heading(meta: dict[str, Any]) -> str:
    """CPU, cores, threads, repeats and the load seen."""
    loads = [x for pair in meta["loads"] for x in pair]
    return (f"{meta['cpu']}, cores {meta['cpus']}, {meta['threads']} thread(s), medians of "
            f"{len(meta['loads'])} repeats; 1-minute load average {min(loads):.2f}-"
            f"{max(loads):.2f}, steal {sum(meta['steal_s']):.1f} s in all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--gguf", default=None,
                    help="the model file, for runs saved without its matrix sizes")
    args = ap.parse_args()
    data = json.loads(args.json.read_text())
    meta = data["meta"]
    if "prompt_weights" not in meta:
        from llamacpp_compare import weight_bytes  # local: needs the model file, rarely

        if args.gguf is None:
            raise SystemExit("this run was saved without prompt_weights: pass --gguf")
        meta["prompt_weights"] = weight_bytes(args.gguf)["prompt_weights"]
    print(heading(meta) + "\n\n" + table(data["repeats"], meta))


if __name__ == "__main__":
    main()
