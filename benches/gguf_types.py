"""Every quantized type on files llama.cpp itself wrote: make them, then check each one.

``make``: ``convert_hf_to_gguf.py`` writes an F16 GGUF of a Hugging Face checkpoint and
``llama-quantize`` writes one file per type from it (a type it refuses is reported, skipped).
``check FILE``: the tensor types the file holds; every quantized matrix's compiled
dequantization against ``gguf.quants.dequantize`` (bit for bit) and its kernel product against
the fp32 product of those values; then greedy parity: ``Engine(FILE)`` on the reference
products and on the kernels, each prompt's tokens against an fp32 transformers model of the
file's dequantized weights (``from_pretrained(gguf_file=...)``, gguf-py's dequantization),
each prompt run alone. ``speed FILE...``: single-stream decode of ferrobatch and llama-bench,
interleaved, on the cores the process is pinned to.

    export LLAMACPP_BIN=/path/to/llama.cpp/build/bin LLAMACPP_SRC=/path/to/llama.cpp
    .venv/bin/python benches/gguf_types.py make --hf CHECKPOINT --name qwen --out DIR \\
        --types Q8_0 Q6_K Q4_0
    .venv/bin/python benches/gguf_types.py check DIR/qwen-q4_0.gguf
    taskset -c 1 .venv/bin/python benches/gguf_types.py speed DIR/qwen-*.gguf
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from ferrobatch.gguf import modules  # noqa: E402, I001  (before torch: OpenMP settings)
from ferrobatch.gguf.formats import QUANT_TYPES, QuantWeight  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

CHATS = ["Write a Python function that reverses a string.",
         "What is the capital of France? Answer in one sentence.",
         "Explain what a hash map is to a beginner."]


def _llamacpp(tool: str) -> Path:
    """A llama.cpp binary under ``$LLAMACPP_BIN``; exits with what is missing."""
    bins = os.environ.get("LLAMACPP_BIN")
    path = Path(bins or "") / tool
    if not bins or not path.is_file():
        raise SystemExit(f"llama.cpp's {tool} not found: set LLAMACPP_BIN to its build/bin "
                         "(benches/peers/setup_llamacpp.sh builds it)")
    return path


def make(args: argparse.Namespace) -> None:
    """The F16 file of ``--hf`` and one ``llama-quantize`` file per ``--types``."""
    quantize = _llamacpp("llama-quantize")
    src = Path(os.environ.get("LLAMACPP_SRC", ""))
    convert = src / "convert_hf_to_gguf.py"
    if not convert.is_file():
        raise SystemExit("convert_hf_to_gguf.py not found: set LLAMACPP_SRC to llama.cpp's "
                         "source tree")
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"{args.name}-f16.gguf"
    if not f16.is_file():
        subprocess.run([sys.executable, str(convert), args.hf, "--outtype", "f16",
                        "--outfile", str(f16)], check=True)
    for qtype in args.types:
        out = args.out / f"{args.name}-{qtype.lower()}.gguf"
        if out.is_file():
            print(f"{qtype}: {out} (already there)")
            continue
        res = subprocess.run([str(quantize), str(f16), str(out), qtype, str(args.threads)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{qtype}: llama-quantize refused (rc {res.returncode}): "
                  f"{res.stderr.strip().splitlines()[-1:]}")
        else:
            print(f"{qtype}: {out} ({out.stat().st_size / 2**20:.0f} MiB)")


def held_types(path: Path) -> dict[str, int]:
    """Tensor type name -> how many tensors of the file hold it."""
    return dict(collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors))


def check_tensors(path: Path) -> dict[str, tuple[int, float, float]]:
    """Per quantized type: (matrices, max |compiled - gguf-py| dequantized value, worst
    relative error of the kernel product against the fp32 product on random rows)."""
    ops = modules.kernel_ops()
    gen = torch.Generator().manual_seed(0)
    seen: dict[str, list] = {}
    for t in GGUFReader(path).tensors:
        qtype = t.tensor_type.name
        if qtype not in QUANT_TYPES or len(t.shape) != 2:
            continue
        k, n = (int(d) for d in t.shape)
        data = torch.from_numpy(np.array(t.data).reshape(n, -1))
        w = QuantWeight(qtype, n, k, data)
        want = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(n, k).astype(
            np.float32))
        got = ops.dequantize(w)
        entry = seen.setdefault(qtype, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] = max(entry[1], float((got - want).abs().max()))
        x = torch.randn(3, k, generator=gen)
        exact = x @ want.T
        rel = float((ops.linear(x, w) - exact).norm() / exact.norm())
        entry[2] = max(entry[2], rel)
    return {q: tuple(v) for q, v in seen.items()}


def oracle_tokens(path: Path, prompts: list[list[int]], n: int
                  ) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens of each prompt, alone, on transformers' fp32 model of the file, and at
    each step the margin of the chosen token's logit over the runner-up's."""
    import transformers  # local: only the oracle needs transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs, margins = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 return_dict_in_generate=True, output_logits=True)
            outs.append(out.sequences[0, len(ids):].tolist())
            top2 = [step[0].float().topk(2).values for step in out.logits]
            margins.append([float(t[0] - t[1]) for t in top2])
    del model
    return outs, margins


def engine_tokens(path: Path, backend: str, prompts: list[list[int]], n: int
                  ) -> list[list[int]]:
    """Greedy tokens of all prompts, batched, from ``Engine(path)`` on ``backend``."""
    from ferrobatch import Engine, SamplingParams  # local: the engine after the kernels' check

    with modules.backend(backend), Engine(str(path)) as engine:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=n), progress=False)
    return [o.token_ids for o in outs]


def chat_prompts(path: Path) -> list[list[int]]:
    from ferrobatch.gguf.loader import load_gguf  # local: the tokenizer of the file

    _, tok = load_gguf(path)
    return [list(tok.apply_chat_template([{"role": "user", "content": c}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False))
            for c in CHATS]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def check(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    path = Path(args.gguf)
    print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB, types {held_types(path)}")
    t0 = time.perf_counter()
    for qtype, (count, deq, rel) in check_tensors(path).items():
        print(f"  {qtype}: {count} matrices, max |compiled - gguf-py| {deq:.3g}, "
              f"kernel product rel. error <= {rel:.2e}")
    print(f"  (tensors checked in {time.perf_counter() - t0:.0f} s)")
    prompts = chat_prompts(path)
    want, margins = oracle_tokens(path, prompts, args.new)
    for backend in ("reference", "kernel"):
        got = engine_tokens(path, backend, prompts, args.new)
        diffs = [first_difference(g, w) for g, w in zip(got, want, strict=True)]
        at = [round(m[d], 4) if d is not None and d < len(m) else None
              for d, m in zip(diffs, margins, strict=True)]
        verdict = "equal" if all(d is None for d in diffs) else (
            f"first differences at {diffs} (fp32 top-2 logit margin there: {at})")
        print(f"  greedy, Engine on {backend} products vs fp32 dequantized model, "
              f"{len(prompts)} chats x {args.new} tokens: {verdict}")
        if backend == "reference" and verdict != "equal":
            for g, w in zip(got, want, strict=True):
                print(f"    engine {g}\n    oracle {w}")


def speed(args: argparse.Namespace) -> None:
    """Single-stream decode, interleaved: ferrobatch (one request of ``--new`` tokens after a
    short code prompt, EOS ignored) and ``llama-bench -p 0 -n NEW -t 1`` on this process's
    cores (run it under ``taskset -c CORE``); medians of ``--repeats``. llama-bench's tokens
    per CPU-second count its whole process (loading, its one-token warm-up): a lower bound."""
    sys.path.insert(0, str(ROOT / "benches" / "peers"))
    import llamacpp_compare as lc  # local: the peers' helpers, only for `speed`
    import llamacpp_tools as lt  # local: as above
    from ferrobatch import ContinuousBatchingConfig, Engine  # local: as `engine_tokens`

    bins = _llamacpp("llama-bench").parent
    cpus = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cpus))
    print(f"CPU {lc.cpu_name()}; cores {cpus}; {len(cpus)} thread(s); load "
          f"{os.getloadavg()[0]:.2f}")
    print("| file | decode GB/token | ferrobatch tok/s (tok/CPU-s) | llama-bench tg tok/s "
          "(tok/CPU-s) | runs |\n|---|---|---|---|---|")
    for gguf in args.files:
        ferro = lc.Ferro.__new__(lc.Ferro)  # its `run`, on an engine with a fixed KV cache
        ferro.engine = Engine(gguf, config=ContinuousBatchingConfig(
            num_blocks=64, allow_block_sharing=False))
        code = [int(t) for t in ferro.engine.tokenizer(lc.CODE_PROMPT).input_ids]
        ferro.run([code], 4)
        wall, cpu, tg, tg_cpu = [], [], [], []
        for r in range(args.repeats):
            for side in ("ferro", "llama") if r % 2 == 0 else ("llama", "ferro"):
                if side == "ferro":
                    got = ferro.run([code], args.new)
                    wall.append(got["tokens"] / got["wall_s"])
                    cpu.append(got["tokens"] / got["cpu_s"])
                else:
                    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    tg.append(lt.llama_bench(bins, gguf, cpus, len(cpus), 0, args.new)["tg"])
                    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    busy = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
                    tg_cpu.append(args.new / busy)
        ferro.engine.close()
        gb = lc.weight_bytes(gguf)["decode_bytes"] / 1e9
        med = statistics.median
        print(f"| {Path(gguf).name} | {gb:.3f} | {med(wall):.2f} ({med(cpu):.2f}) | "
              f"{med(tg):.2f} ({med(tg_cpu):.2f}) | ferrobatch {[round(w, 2) for w in wall]}, "
              f"llama-bench {[round(t, 2) for t in tg]}, load {os.getloadavg()[0]:.2f} |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="convert a checkpoint and quantize it per type")
    mk.add_argument("--hf", required=True, help="Hugging Face checkpoint directory")
    mk.add_argument("--name", required=True, help="file name stem")
    mk.add_argument("--out", type=Path, required=True)
    mk.add_argument("--types", nargs="+", required=True, help="llama-quantize type names")
    mk.add_argument("--threads", type=int, default=2)
    ck = sub.add_parser("check", help="types held, dequantization, products, greedy parity")
    ck.add_argument("gguf")
    ck.add_argument("--new", type=int, default=16)
    ck.add_argument("--threads", type=int, default=2)
    sp = sub.add_parser("speed", help="single-stream decode against llama-bench")
    sp.add_argument("files", nargs="+")
    sp.add_argument("--new", type=int, default=128)
    sp.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    {"make": make, "check": check, "speed": speed}[args.cmd](args)


if __name__ == "__main__":
    main()
