"""Quality of ferrobatch's and llama.cpp's quantized products on one GGUF file, against the
same reference: mean KL divergence of the next-token distribution and top-1 agreement.

The reference is the file's own weights, dequantized, in fp32: for llama.cpp, an F32 GGUF
that ``llama-quantize --allow-requantize`` writes from the quantized file (the K-quant blocks
expanded exactly), run through ``llama-perplexity --kl-divergence-base``, which stores the
evaluated token ids and, for the second half of every ``--ctx`` window, the compressed log
probabilities of each position (16 bits over the top 16 nats). llama.cpp's side is then
``llama-perplexity --kl-divergence`` on the quantized file. ferrobatch's side reads the same
token ids back from that file and runs ``gguf_quality.py``'s two forwards over the same
windows: its kernels (int8 activations) and its fp32 reference over the dequantized weights.
With ``--ref-gguf REF`` (say the F16 file every quantized file was made from), both
engines are scored against REF's F32 logits instead (made once, kept in ``--work``), the
file's own dequantization left out: only llama.cpp's and ferrobatch's quantized products are
run. Reported: ferrobatch's kernels against llama.cpp's F32 logits, at the very positions and with
the very formula llama-perplexity uses (so the two engines are scored on one yardstick),
ferrobatch's kernels against its own fp32 forward (as ``gguf_quality.py``, on these positions
and on all), and the two fp32 references against each other.

    .venv/bin/python benches/peers/llamacpp_quality.py --gguf model.gguf --threads 2
    .venv/bin/python benches/peers/llamacpp_quality.py --gguf model-q4_0.gguf \\
        --ref-gguf model-f16.gguf --chunks 4 --work DIR
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "benches" / "peers"))

from ferrobatch.gguf import modules  # noqa: E402, I001  (before torch: OpenMP settings)
from ferrobatch.models import load_model  # noqa: E402
import gguf_quality  # noqa: E402
import llamacpp_tools as lt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def read_base(path: Path) -> dict[str, object]:
    """A ``--kl-divergence-base`` file: n_ctx, the token ids, and per scored position the
    (scale, min log prob, uint16 codes) of its base log probabilities."""
    blob = path.read_bytes()
    if blob[:8] != b"_logits_":
        raise SystemExit(f"{path} is not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(blob, np.int32, 3, 8)
    tokens = np.frombuffer(blob, np.int32, n_ctx * n_chunk, 20)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.frombuffer(blob, np.uint16, offset=20 + 4 * tokens.size).reshape(-1, nv)
    head = rows[:, :4].copy().view(np.float32)  # (scale, min_log_prob) per row
    return {"n_ctx": int(n_ctx), "n_chunk": int(n_chunk), "tokens": tokens.astype(np.int64),
            "scale": head[:, 0], "min_lp": head[:, 1], "codes": rows[:, 4:4 + n_vocab]}


def scored(logits: torch.Tensor, n_ctx: int, n_chunk: int) -> torch.Tensor:
    """The rows llama-perplexity scores: positions n_ctx/2 .. n_ctx-2 of every window."""
    first = n_ctx // 2
    return torch.cat([logits[c * n_ctx + first: (c + 1) * n_ctx - 1] for c in range(n_chunk)])


def kl_vs_base(base: dict, logits: torch.Tensor) -> tuple[float, float]:
    """(mean KL, top-1 agreement) of ``logits`` against the base file, computed as
    llama-perplexity does (base log probs below -16 left out, its argmax on the codes)."""
    kls, same = [], 0
    logp = logits.log_softmax(-1)
    for i in range(logits.shape[0]):
        lp_base = torch.from_numpy(base["codes"][i].astype(np.float32)) * float(
            base["scale"][i]) + float(base["min_lp"][i])
        keep = lp_base > -16.0
        kls.append(float((lp_base[keep].exp() * (lp_base[keep] - logp[i][keep])).sum()))
        same += int(lp_base.argmax() == logits[i].argmax())
    return float(np.mean(kls)), same / len(kls)


def kl_pair(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || got), top-1 agreement) of two logit tables."""
    lr, lg = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lr.exp() * (lr - lg)).sum(-1)
    return float(kl.mean()), float((ref.argmax(-1) == got.argmax(-1)).float().mean())


def llama_side(bins: Path, args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    """The F32 GGUF, the base logits and llama.cpp's KL statistics (from its log)."""
    source = args.ref_gguf or args.gguf
    f32 = work / (Path(source).stem + "-dequant-f32.gguf")
    if not f32.is_file():
        lt.run_tool([str(bins / "llama-quantize"), "--allow-requantize", source, str(f32),
                     "F32"], timeout=1800)
    base = work / f"base-{Path(source).stem}-{args.ctx}x{args.chunks}.kld"
    common = ["-f", args.text, "-c", str(args.ctx), "--chunks", str(args.chunks),
              "-b", str(args.ctx), "-t", str(args.threads)]
    if args.ref_gguf is None or not base.is_file():  # one shared reference is made once
        lt.run_tool([str(bins / "llama-perplexity"), "-m", str(f32), *common,
                     "--kl-divergence-base", str(base)], timeout=3600)
    res = subprocess.run([str(bins / "llama-perplexity"), "-m", args.gguf, *common,
                          "--kl-divergence-base", str(base), "--kl-divergence"],
                         capture_output=True, text=True, timeout=3600)
    log = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError("llama-perplexity --kl-divergence failed:\n" + log[-3000:])
    stats = {}
    for key, pat in {"mean_kl": r"Mean\s+KLD:\s+([-\d.]+)", "max_kl": r"Maximum KLD:\s+([\d.]+)",
                     "p99_kl": r"99\.0%\s+KLD:\s+([\d.]+)", "same_top": r"Same top p:\s+([\d.]+)"
                     }.items():
        m = re.search(pat, log)
        stats[key] = float(m.group(1)) if m else None
    if stats["same_top"] is not None:
        stats["same_top"] /= 100
    return base, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--text", default=str(ROOT / "README.md"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None,
                    help="where the F32 GGUF and base logits go (default: next to the binaries)")
    ap.add_argument("--llamacpp-bin", default=None)
    ap.add_argument("--ref-gguf", default=None,
                    help="score both engines against this file's F32 logits (e.g. the F16 "
                         "file the quantized one was made from), not the file's own")
    args = ap.parse_args()
    bins = lt.bin_dir(args.llamacpp_bin)
    work = args.work or bins.parents[1] / "quality"
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    base_path, llama = llama_side(bins, args, work)
    base = read_base(base_path)
    n_ctx, n_chunk = base["n_ctx"], base["n_chunk"]
    model, tokenizer = load_model(args.gguf)
    ids = torch.from_numpy(base["tokens"]).unsqueeze(0)
    own = tokenizer(Path(args.text).read_text()).input_ids[: ids.shape[1]]
    same_ids = sum(int(a == b) for a, b in zip(own, base["tokens"].tolist(), strict=False))
    with modules.backend("kernel"):
        got = gguf_quality.logits(model, ids, n_ctx)
    got_s = scored(got, n_ctx, n_chunk)
    f32_name = "llama.cpp F32" + (f" of {Path(args.ref_gguf).name}" if args.ref_gguf else "")
    rows = [
        (f"llama.cpp quantized vs {f32_name} (llama-perplexity)", llama["mean_kl"],
         llama["same_top"]),
        (f"ferrobatch kernels vs {f32_name}", *kl_vs_base(base, got_s)),
    ]
    if args.ref_gguf is None:
        with modules.backend("reference"):
            ref = gguf_quality.logits(model, ids, n_ctx)
        ref_s = scored(ref, n_ctx, n_chunk)
        rows += [
            ("ferrobatch fp32 reference vs llama.cpp F32", *kl_vs_base(base, ref_s)),
            ("ferrobatch kernels vs ferrobatch fp32 reference", *kl_pair(ref_s, got_s)),
            (f"  same, all {ids.shape[1]} positions (gguf_quality.py)", *kl_pair(ref, got)),
        ]
    print(f"{args.text}: {ids.shape[1]} tokens ({same_ids} equal to ferrobatch's own "
          f"tokenization), {got_s.shape[0]} scored positions (the second half of each "
          f"{n_ctx}-token window); llama-perplexity also: max KL {llama['max_kl']}, p99 "
          f"{llama['p99_kl']}\n")
    print("| logits | against | mean KL | top-1 agreement |\n|---|---|---|---|")
    for name, kl, top in rows:
        what, _, against = name.partition(" vs ")
        print(f"| {what} | {against or 'ferrobatch fp32 reference'} | {kl:.6f} | "
              f"{100 * top:.2f}% |")


if __name__ == "__main__":
    main()
