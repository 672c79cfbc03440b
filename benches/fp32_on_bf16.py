"""A bf16 checkpoint run in fp32 (the CPU default, `dtype=None`), one arm a process:
"panels" (main: the checkpoint read in bf16, each linear weight held as its bf16 `f32_ops`
panels from the start, `runner.panel_weights`), "kept" (read in fp32, the same panels, the
fp32 weights kept beside them) or "plain" (read in fp32, the fp32 panels and oneDNN's fp32
copy, as before `FP32_IN_BF16`). Prints the build time, RSS after construction (anonymous /
file-backed / peak), a single stream's decode rate, a 16 x 32 batch and a 512-token
prefill. Token-id prompts: the checkpoint needs no tokenizer.

    python benches/fp32_on_bf16.py DIR panels --threads 1
    python benches/fp32_on_bf16.py DIR kept --threads 1
    python benches/fp32_on_bf16.py DIR plain --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.runner import cpu_linear

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("model")
ap.add_argument("arm", choices=("panels", "kept", "plain"))
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--quick", action="store_true",
                help="a large model: one single stream of 16 tokens and 8 prompts x 16 only")
ap.add_argument("--head-ab", type=int, default=0, metavar="N",
                help="then N rounds of a single stream with the output head on its bf16 "
                     "panels (the module's packed product) and on oneDNN's fp32 copy, "
                     "alternated")
args = ap.parse_args()
arm = args.arm
torch.set_num_threads(args.threads)
if arm in ("kept", "plain"):
    Engine._narrow_read = lambda self, *args: None
if arm == "plain":
    cpu_linear.bf16_exact = lambda w: False
if arm == "kept":
    cpu_linear.PackedLinears.hold_in_panels = lambda self: 0


def rss() -> str:
    with open("/proc/self/status") as f:
        d = {line.split(":")[0]: int(line.split()[1]) for line in f
             if line.startswith(("RssAnon", "RssFile", "VmHWM"))}
    return (f"anon {d['RssAnon'] / 2**20:.2f} GiB file {d['RssFile'] / 2**20:.2f} GiB "
            f"peak {d['VmHWM'] / 2**20:.2f} GiB")


t = time.time()
e = Engine(args.model, config=ContinuousBatchingConfig(num_blocks=256))
print(arm, "built in", round(time.time() - t, 1), "s;", rss(), flush=True)
sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
one = [list(range(100, 140))]
e.generate(one, SamplingParams(max_new_tokens=4, ignore_eos=True))
if args.quick:
    quick = SamplingParams(max_new_tokens=16, ignore_eos=True)
    t = time.time()
    e.generate(one, quick)
    print(arm, f"single stream {16 / (time.time() - t):.2f} tok/s", flush=True)
    t = time.time()
    e.generate([list(range(100 + i, 140 + i)) for i in range(8)], quick)
    print(arm, f"8x16 {8 * 16 / (time.time() - t):.2f} tok/s (prefill incl)", rss(), flush=True)
    e.close()
    raise SystemExit(0)
for _ in range(2):
    t = time.time()
    e.generate(one, sp)
    w = time.time() - t
    print(arm, f"single stream {32 / w:.2f} tok/s", flush=True)
batch = [list(range(100 + i, 140 + i)) for i in range(16)]
t = time.time()
e.generate(batch, sp)
w = time.time() - t
print(arm, f"16x32 {16 * 32 / w:.1f} tok/s (prefill incl)", rss(), flush=True)
t = time.time()
e.generate([list(range(5, 517))], SamplingParams(max_new_tokens=1))
w = time.time() - t
print(arm, f"prefill 512 {512 / w:.1f} tok/s", flush=True)
if args.head_ab:
    from ferrobatch.runner.linear_policy import Backend

    head = e.runner.head
    arms = {"panels": None, "onednn fp32 copy": Backend.ONEDNN}
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.head_ab):
        for name, backend in arms.items():
            head.backend = backend
            t = time.time()
            e.generate(one, sp)
            rates[name].append(32 / (time.time() - t))
    for name, got in rates.items():
        print(arm, f"head on {name}: single stream", " / ".join(f"{r:.2f}" for r in got),
              "tok/s", flush=True)
e.close()
