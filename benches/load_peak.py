"""Peak anonymous and file-backed memory while a checkpoint is quantized on load.

A sampler thread reads the process's `RssAnon` and `RssFile` every 20 ms during
`load_model(path, quantization=...)`: file pages are the checkpoint mapped from disk (the
kernel can drop them), anonymous memory is what the load really holds. `--make-gemma3 DIR`
first writes a random bf16 Gemma3-shaped checkpoint (0.94B parameters), whose fp32 read
converts every tensor (`gguf/stream_quantize.py`).

    python benches/load_peak.py /tmp/gemma3-bf16 --make-gemma3 --quantization q4_k
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import threading
import time
from pathlib import Path

import torch
import transformers


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) // 1024
    return 0


class Peaks:
    """The largest anonymous and file RSS seen since `start()`, sampled every 20 ms."""

    def __init__(self) -> None:
        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.anon = max(self.anon, _status_mib("RssAnon:"))
            self.file = max(self.file, _status_mib("RssFile:"))
            time.sleep(0.02)

    def start(self) -> Peaks:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def make_gemma3(path: Path) -> None:
    """A random bf16 Gemma3 text checkpoint (hidden 2048, 12 layers, vocab 65536)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=65536, hidden_size=2048, intermediate_size=8192, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=4096, dtype="bfloat16")
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM._from_config(config, dtype=torch.bfloat16) \
        .save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a checkpoint directory")
    parser.add_argument("--quantization", default="q4_k")
    parser.add_argument("--dtype", default=None, help="the dtype asked for (default fp32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--make-gemma3", action="store_true",
                        help="first write a random Gemma3-shaped checkpoint at MODEL")
    args = parser.parse_args()
    if args.make_gemma3:
        make_gemma3(args.model)
    torch.set_num_threads(args.threads)
    from ferrobatch.models import load_model

    peaks = Peaks().start()
    start = time.perf_counter()
    model, _ = load_model(args.model, quantization=args.quantization, dtype=args.dtype)
    seconds = time.perf_counter() - start
    peaks.stop()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    summary = model.ferrobatch_quantization
    print(f"{args.quantization}: load {seconds:.1f} s, {args.threads} threads; peak anonymous "
          f"{peaks.anon} MiB, peak file {peaks.file} MiB; after load (trimmed) anonymous "
          f"{_status_mib('RssAnon:')} MiB, file {_status_mib('RssFile:')} MiB; "
          f"{summary['quantized_bytes'] / 2**20:.0f} MiB quantized")


if __name__ == "__main__":
    main()
