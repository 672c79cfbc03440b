"""The GPU check (run it with `benches/gpu_check.sh`).

Needs only torch, transformers, triton and the ferrobatch package (the prebuilt abi3 wheel or
`python/` with its `_core.abi3.so`); no Rust toolchain, no network, no hub: every model is
random-init from a config under a fixed seed. Sections, each with its own time budget, all
results written to one JSON report (rewritten after every section, so a kill keeps what was
done):

  env         versions, device, which ferrobatch was imported, the config's GPU fields
  kernels     Triton paged decode (1 and several splits) / varlen prefill vs the torch
              reference on CUDA, fp32 and bf16, GQA, sliding window, softcap; flash-attn
              when installed; a CUDA graph captured through ferrobatch.cuda.graphs replayed
              vs eager; decode-kernel time for the 135M shape at 256 requests
  parity      greedy fp32 ferrobatch vs per-prompt `generate` for random-init Llama, Qwen3
              and Gemma3-shaped models, eager and with use_cuda_graph / use_async_batching
              requested (the report says whether the engine used them)
  decode_step one 135M-shape decode step at 256 requests through ModelRunner: wall time vs
              summed device-kernel time (the <= 1.5x target is for graphs)
  throughput  bf16 generated tok/s of ferrobatch vs transformers `generate_batch` vs static
              padded `generate` on the same 512 mixed-length prompts, SmolLM2-135M shape and
              a ~1B Llama shape; ratios, peak memory, engine stats
  offload     a cache too small for the batch with cpu_offload_space > 0: swaps must
              happen, outputs must match an unconstrained run
  tensor_parallel  TP=2 over NCCL (needs >= 2 GPUs, else skipped with the reason): greedy
              fp32 parity with per-prompt `generate` (eager, and CUDA graphs per rank), bf16
              tok/s of TP=2 vs TP=1 on the ~1B Llama shape; with --smoke on CPU, TP=2 over
              gloo on the tiny Llama (parity only)

    bash benches/gpu_check.sh                          # on a GPU (one H200: < 9 minutes)
    python benches/gpu_check.py --smoke                # CPU, tiny shapes, ~1 minute
    python benches/gpu_check.py --only kernels parity  # some sections
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("env", "kernels", "parity", "throughput", "offload", "decode_step", "tensor_parallel")


def _early_args() -> None:
    # The smoke run exercises the Triton code paths through triton's interpreter on CPU;
    # that must be decided before triton is imported.
    if "--smoke" in sys.argv and "--device" not in " ".join(sys.argv):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


_early_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    import ferrobatch  # noqa: F401
except ImportError:  # not installed: the repository's own package (with its built _core)
    sys.path.insert(0, str(REPO / "python"))
    import ferrobatch  # noqa: F401

import transformers  # noqa: E402
from ferrobatch.workloads import agreement, left_padded  # noqa: E402

transformers.logging.set_verbosity_error()


# ----------------------------------------------------------------------------- helpers


class SectionTimeout(BaseException):
    """A section or method ran past its budget. A BaseException, so that no `except
    Exception` on the way (the runner turns a failed capture into eager steps) swallows it."""


_CHECKPOINT: list[Callable[[str, dict[str, Any]], None]] = []


def checkpoint(section: str, partial: dict[str, Any]) -> None:
    """Rewrite the report with `section`'s results so far (a kill keeps them)."""
    for fn in _CHECKPOINT:
        fn(section, partial)


@contextlib.contextmanager
def recorded_warnings() -> Iterator[list[str]]:
    """Warnings (`warnings.warn`) and ferrobatch's WARNING+ log records raised in the block:
    an automatic downgrade (CUDA graphs or async batching off, a failed capture) must show
    in the report, not only in a log nobody reads."""
    import logging
    import warnings

    got: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(f"{record.levelname}: {record.getMessage()}"[:500])

    handler = _Handler(level=logging.WARNING)
    log = logging.getLogger("ferrobatch")
    log.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield got
        finally:
            log.removeHandler(handler)
            got.extend(f"{w.category.__name__}: {w.message}"[:500] for w in caught
                       if "ferrobatch" in str(w.message))


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after `seconds` (SIGALRM; Unix only)."""
    if seconds <= 0:
        raise SectionTimeout("no time left")

    def handler(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"ran past {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


def prompts_for(n: int, lo: int, hi: int, vocab: int, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ----------------------------------------------------------------------------- models


def build(kind: str, *, tiny: bool, seed: int = 0) -> torch.nn.Module:
    """Random-init causal LM of a named shape (EOS off). `tiny` shrinks every shape."""
    common: dict[str, Any] = dict(eos_token_id=None, bos_token_id=1, pad_token_id=0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=1024, hidden_size=128 if not tiny else 64, intermediate_size=256,
            num_hidden_layers=4 if not tiny else 2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, **common,
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(
            vocab_size=1024, hidden_size=128 if not tiny else 64, intermediate_size=256,
            num_hidden_layers=4 if not tiny else 2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32 if not tiny else 16,
            max_position_embeddings=4096, **common,
        )
        cls = transformers.Qwen3ForCausalLM
    elif kind == "gemma3":
        layers = 4 if not tiny else 2
        cfg = transformers.Gemma3TextConfig(
            vocab_size=1024, hidden_size=128 if not tiny else 64, intermediate_size=256,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32 if not tiny else 16, sliding_window=32 if not tiny else 8,
            query_pre_attn_scalar=32, max_position_embeddings=4096,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(layers)],
            **common,
        )
        cls = transformers.Gemma3ForCausalLM
    elif kind == "smollm2_135m":
        cfg = transformers.LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
            rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, **common,
        ) if not tiny else transformers.LlamaConfig(
            vocab_size=2048, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=True, **common,
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "llama_1b":
        cfg = transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rope_theta=500000.0, tie_word_embeddings=True, **common,
        ) if not tiny else transformers.LlamaConfig(
            vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common,
        )
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    return cls(cfg).eval()


# ----------------------------------------------------------------------------- runners


def same_lengths(prompts: list[list[int]], vocab: int, seed: int = 4321) -> list[list[int]]:
    """Prompts of exactly `prompts`' lengths with other random tokens: a warm-up that gives
    the engine the same plan shapes (so the same Triton variants and CUDA graphs) as the
    timed run, without leaving it prefix-cache hits on the timed prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in p] for p in prompts]


def triton_variants() -> int | None:
    """Compiled variants of ferrobatch's Triton kernels so far (None when they do not
    compile here: no triton, or its interpreter). A timed window in which this number
    grows timed a compile."""
    from ferrobatch.cuda import triton_attention as ta

    if not ta.HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    total = 0
    try:
        for name in ("_decode_kernel", "_reduce_kernel", "_prefill_kernel"):
            fn = getattr(ta, name)
            for entry in getattr(fn, "device_caches", {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                total += len(cache)
    except Exception:  # noqa: BLE001 - a triton whose JIT keeps its cache elsewhere
        return None
    return total


def run_ferrobatch(model: Any, prompts: list[list[int]], new: int, cfg: Any, *,
                   warm_prompts: list[list[int]] | None = None) -> tuple[
    list[list[int]], dict[str, Any]
]:
    """Greedy ferrobatch outputs and the engine's stats, with `cuda_graphs` (the runner's
    graph counters), `use_cuda_graph` / `async_batching` (what the engine resolved),
    `cache_gib` (the KV cache's device memory) and `warnings` (downgrades: graphs or async
    off, failed captures) added.

    `warm_prompts` (prompts of the same lengths as `prompts`, other tokens: `same_lengths`):
    the engine, built outside the timed window, first runs them (Triton compiles the
    variants and graphs are captured for exactly the plan shapes the timed run has, with no
    prefix-cache hit left for it), then `prompts` are timed: `seconds`, and
    `first_pass_seconds` for the warm-up. `compiles_in_timed_pass` (Triton variants,
    None where they are interpreted) and `captures_in_timed_pass` (CUDA graphs) say whether
    anything was still compiled inside the timed window."""
    from ferrobatch import Engine, SamplingParams

    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    dev = next(model.parameters()).device
    with recorded_warnings() as warned:
        engine = Engine(model, config=cfg)
    try:
        runner = engine.runner
        with recorded_warnings() as warned_run:
            first = None
            if warm_prompts is not None:
                t0 = time.perf_counter()
                engine.generate(warm_prompts, sp, progress=False)
                sync(dev)
                first = time.perf_counter() - t0
            variants = triton_variants()
            captures = runner.graph_stats()["captures"]
            t0 = time.perf_counter()
            outs = engine.generate(prompts, sp, progress=False)
            sync(dev)
            seconds = time.perf_counter() - t0
        stats = engine.stats()
        stats["seconds"] = seconds
        if first is not None:
            stats["first_pass_seconds"] = round(first, 3)
            after = triton_variants()
            stats["compiles_in_timed_pass"] = (None if variants is None or after is None
                                               else after - variants)
            stats["captures_in_timed_pass"] = runner.graph_stats()["captures"] - captures
        stats["warnings"] = warned + warned_run
        stats["use_cuda_graph"] = bool(runner.use_cuda_graph)
        stats["async_batching"] = bool(engine.async_batching)
        stats["cuda_graphs"] = runner.graph_stats()
        stats["split_head_error"] = getattr(getattr(runner, "head", None), "split_error", None)
        stats["cache_gib"] = round(runner.cache.nbytes / 2**30, 3)
        stats["attention_backend"] = runner.attention_backend
    finally:
        engine.close()
    return [list(o.token_ids) for o in outs], stats


def run_generate_each(model: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy `generate` one prompt at a time (no padding: the parity reference)."""
    dev = next(model.parameters()).device
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=dev)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def run_padded_generate(model: Any, prompts: list[list[int]], new: int, bs: int) -> list[
    list[int]
]:
    dev = next(model.parameters()).device
    outs: list[list[int]] = []
    with torch.inference_mode():
        for start in range(0, len(prompts), bs):
            chunk = prompts[start : start + bs]
            ids, mask = left_padded(chunk)
            width = ids.shape[1]
            gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.extend(gen[:, width:].tolist())
    return outs


def generate_batch_config(model: Any, prompts: list[list[int]], new: int) -> Any:
    """transformers' continuous-batching config for `generate_batch`: None on CUDA (it sizes
    its cache from free GPU memory, its own best); off CUDA an explicit cache just big
    enough for `prompts` (left to itself on CPU, transformers 5.17 sizes it at 80% of RAM,
    and the smoke run was OOM-killed)."""
    if next(model.parameters()).device.type == "cuda":
        return None
    from transformers import ContinuousBatchingConfig as HfConfig

    block = 32
    blocks = sum(-(-(len(p) + new) // block) for p in prompts) + 8
    return HfConfig(block_size=block, num_blocks=blocks, max_batch_tokens=256,
                    max_requests_per_batch=max(1, len(prompts)))


def run_generate_batch(model: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    from transformers import GenerationConfig

    gc_ = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    kw: dict[str, Any] = {}
    cb = generate_batch_config(model, prompts, new)
    if cb is not None:
        kw["continuous_batching_config"] = cb
    res = model.generate_batch(inputs=prompts, generation_config=gc_, progress_bar=False, **kw)
    by_id = sorted(res.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    return [list(r.generated_tokens) for r in by_id]


# ----------------------------------------------------------------------------- sections


def section_env(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    import dataclasses

    from ferrobatch.config import ContinuousBatchingConfig
    from ferrobatch.cuda import triton_attention as ta

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ferrobatch_from": str(Path(ferrobatch.__file__).parent),
        "triton": None,
        "flash_attn": ta.flash_attn_available(),
        "device": str(dev),
        "backend_page32": ta.select_backend(dev, page_size=32),
        "config_fields": [f.name for f in dataclasses.fields(ContinuousBatchingConfig)],
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    with contextlib.suppress(Exception):
        import triton

        out["triton"] = triton.__version__
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out.update(gpu=props.name, sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    return out


def _kernel_case(dev: torch.device, dtype: torch.dtype, *, heads: int, kv_heads: int,
                 dim: int, page: int, window: int | None, softcap: float | None,
                 splits: int, rows: int, seed: int, small: bool = False,
                 backend: str = "triton") -> dict[str, Any]:
    """Random plan (chunked prefill with cached context + decode rows) through the Triton
    path and the reference; max abs error of each."""
    from ferrobatch.cuda import triton_attention as ta

    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = 4 * rows * 8
    slots = (num_blocks + 2) * page
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dev, dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dev, dtype)
    k_cache[:page] = 0
    v_cache[:page] = 0
    ring = -(-window // page) + 1 if window else 0
    free_chunks = list(range(2, num_blocks + 2))
    rng.shuffle(free_chunks)
    cu, lens, tables, slot_map = [0], [], [], []
    width = ring or 0
    plans = []
    for _ in range(rows):
        q_len = rng.choice([1, 1, 5, 20] if small else [1, 1, 1, 5, 37, 130])
        ctx = rng.randint(0, 40 if small else 300)
        total = ctx + q_len
        if window:
            row = [free_chunks.pop() for _ in range(ring)]
        else:
            row = [free_chunks.pop() for _ in range(-(-total // page))]
        plans.append((q_len, total, row))
        width = max(width, len(row))
    for q_len, total, row in plans:
        cu.append(cu[-1] + q_len)
        lens.append(total)
        tables.append(row + [0] * (width - len(row)))
        for p in range(total - q_len, total):
            col = (p // page) % ring if window else p // page
            keep = not window or p >= total - window
            slot_map.append(row[col] * page + p % page if keep else page + p % page)
    t = cu[-1]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    table, cu_t, lens_t, sm = i32(tables), i32(cu), i32(lens), i32(slot_map)
    q = torch.randn(t, heads, dim, generator=g).to(dev, dtype)
    kn = torch.randn(t, kv_heads, dim, generator=g).to(dev, dtype)
    vn = torch.randn(t, kv_heads, dim, generator=g).to(dev, dtype)
    kw = dict(page_size=page, scale=dim**-0.5, softcap=softcap, sliding_window=window)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = ta.reference_paged_attention(q, kn, vn, k_ref, v_ref, table, cu_t, lens_t, **kw)
    got = ta.paged_attention(q, kn, vn, k_cache, v_cache, sm, table, cu_t, lens_t,
                             max_seqlen_q=int(max(np.diff(cu))), max_seqlen_k=max(lens),
                             num_splits=splits, backend=backend, **kw)
    err = (got.float() - ref.float()).abs().max().item()
    return {"max_abs_err": err, "tokens": t, "rows": rows}


def section_kernels(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    from ferrobatch.cuda import triton_attention as ta

    out: dict[str, Any] = {"cases": []}
    if not ta.HAS_TRITON:
        out["skipped"] = "triton not importable"
        return out
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        out["skipped"] = "no CUDA and TRITON_INTERPRET is not 1"
        return out
    rows = 12 if dev.type == "cuda" else 3
    cases = [
        dict(heads=32, kv_heads=8, dim=64, page=32, window=None, softcap=None, splits=1),
        dict(heads=32, kv_heads=8, dim=64, page=32, window=None, softcap=None, splits=4),
        dict(heads=9, kv_heads=3, dim=64, page=16, window=None, softcap=None, splits=2),
        dict(heads=8, kv_heads=4, dim=256, page=32, window=64, softcap=None, splits=2),
        dict(heads=8, kv_heads=2, dim=128, page=16, window=100, softcap=50.0, splits=1),
    ]
    if dev.type != "cuda":  # interpreter: one small case of each kind
        cases = [dict(c, heads=4, kv_heads=2, dim=16, page=4, window=c["window"] and 9)
                 for c in cases[1::2]]
    # Most of this section's time is Triton compiling (the fp32 prefill variants spill and
    # take up to ~30 s each), so the order is by value: bf16 (what runs in production), the
    # graph replay, the 135M decode timing, flash-attn, then fp32. Each result is recorded
    # (and the report rewritten) as it finishes; a timeout keeps what finished.
    dtypes = [torch.bfloat16, torch.float32] if dev.type == "cuda" else [torch.float32]
    steps: list[tuple[str, Callable[[], Any]]] = []

    def case_step(dtype: torch.dtype, i: int, case: dict[str, Any]) -> Callable[[], Any]:
        def run() -> None:
            tol = 2e-3 if dtype == torch.float32 else 3e-2
            t0 = time.perf_counter()
            try:
                res = _kernel_case(dev, dtype, rows=rows, seed=i, small=dev.type != "cuda",
                                   **case)
                res.update(ok=res["max_abs_err"] <= tol)
            except SectionTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - report the case, run the others
                res = {"error": repr(exc)[:500], "ok": False}
            res.update(case, dtype=str(dtype), seconds=round(time.perf_counter() - t0, 2))
            out["cases"].append(res)
        return run

    def guarded(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> None:
            t0 = time.perf_counter()
            try:
                out[name] = fn()
            except SectionTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - report, don't stop the check
                out[name] = {"error": repr(exc)[:500], "ok": False}
            out[name]["seconds"] = round(time.perf_counter() - t0, 2)
        return run

    def flash() -> dict[str, Any]:
        res = _kernel_case(dev, torch.bfloat16, heads=8, kv_heads=2, dim=128, page=256,
                           window=None, softcap=None, splits=1, rows=rows, seed=99,
                           backend="flash_attn")
        return {**res, "ok": res["max_abs_err"] <= 3e-2}

    for dtype in dtypes:
        steps += [(f"case {dtype} {i}", case_step(dtype, i, c)) for i, c in enumerate(cases)]
        if dtype == torch.bfloat16:
            steps.append(("graph_replay", guarded("graph_replay",
                                                  lambda: _graph_replay_check(dev))))
            steps.append(("decode_kernel_135m", guarded("decode_kernel_135m",
                                                        lambda: _decode_kernel_timing(dev))))
            if ta.flash_attn_available():
                steps.append(("flash_attn", guarded("flash_attn", flash)))
    out["planned"] = [name for name, _ in steps]
    done: list[str] = []
    try:
        for name, fn in steps:
            fn()
            done.append(name)
            out["all_ok"] = all(c["ok"] for c in out["cases"])
            checkpoint("kernels", out)
    except SectionTimeout as exc:  # keep what finished
        out["timeout"] = str(exc)
    out["not_run"] = [name for name, _ in steps if name not in done]
    out["all_ok"] = bool(out["cases"]) and all(c["ok"] for c in out["cases"]) and all(
        out.get(k, {}).get("ok", True) for k in ("graph_replay", "flash_attn"))
    return out


def _graph_replay_check(dev: torch.device) -> dict[str, Any]:
    """Capture the Triton decode (splits from the key) in a CUDA graph through GraphCache
    and CapturedGraph; replay two padded decode plans of different kv buckets vs eager."""
    from ferrobatch.cuda import graphs
    from ferrobatch.cuda import triton_attention as ta

    page, heads, kv_heads, dim = 16, 8, 2, 64
    num_blocks = 800  # 13 rows of up to 700 keys fit
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn((num_blocks + 2) * page, kv_heads, dim, generator=g).to(dev)
    v_cache = torch.randn((num_blocks + 2) * page, kv_heads, dim, generator=g).to(dev)
    k_cache[:page] = 0
    v_cache[:page] = 0
    q_all = torch.randn(64, heads, dim, generator=g).to(dev)
    kn = torch.randn(64, kv_heads, dim, generator=g).to(dev)
    vn = torch.randn(64, kv_heads, dim, generator=g).to(dev)
    state = {"q": torch.zeros(64, heads, dim, device=dev)}
    buckets = graphs.GraphBuckets(q_interval=8, kv_interval=128, num_kv_heads=kv_heads)

    def capture(key: graphs.GraphKey) -> graphs.CapturedGraph:
        splits = dict(key.num_splits)["full_attention"]

        def fn(a: dict[str, torch.Tensor]) -> torch.Tensor:
            q = state["q"][: key.tokens]
            return ta.paged_attention(
                q, kn[: key.tokens], vn[: key.tokens], k_cache, v_cache,
                a["slot_mapping/full_attention"], a["block_tables/full_attention"],
                a["cu_seqlens_q"], a["seqlens_k"], max_seqlen_q=1, page_size=page,
                scale=dim**-0.5, num_splits=splits,
            ).clone()

        return graphs.CapturedGraph.for_plan(fn, key, dev)

    cache = graphs.GraphCache(capture, max_graphs=4)
    rng = random.Random(0)
    results = []
    chunks = list(range(2, num_blocks + 2))
    for max_len in (100, 700, 90):
        rows = 13
        lens = [rng.randint(1, max_len) for _ in range(rows)]
        lens[0] = max_len
        rng.shuffle(chunks)
        it = iter(chunks)
        table = [[next(it) for _ in range(-(-n // page))] for n in lens]
        width = max(len(r) for r in table)
        plan = SimpleNamespace(
            cu_seqlens_q=np.arange(rows + 1, dtype=np.int32),
            seqlens_k=np.array(lens, np.int32),
            input_ids=np.zeros(rows, np.int32), positions=np.array(lens, np.int32) - 1,
            logits_indices=np.arange(rows, dtype=np.int32),
            logits_rows=np.arange(rows, dtype=np.int32),
            slot_mapping={"full_attention": np.array(
                [table[r][(n - 1) // page] * page + (n - 1) % page for r, n in enumerate(lens)],
                np.int32)},
            block_tables={"full_attention": np.array(
                [r + [0] * (width - len(r)) for r in table], np.int32)},
        )
        padded = graphs.pad_plan(plan, buckets, page_size=page)
        state["q"].copy_(q_all)
        k0, v0 = k_cache.clone(), v_cache.clone()
        eager = ta.paged_attention(
            q_all[:rows], kn[:rows], vn[:rows], k0, v0,
            torch.from_numpy(plan.slot_mapping["full_attention"]).to(dev),
            torch.from_numpy(plan.block_tables["full_attention"]).to(dev),
            torch.from_numpy(plan.cu_seqlens_q).to(dev), torch.from_numpy(plan.seqlens_k).to(dev),
            max_seqlen_q=1, page_size=page, scale=dim**-0.5, backend="torch",
        )
        got = cache.get(padded.key).replay(padded)[:rows]
        sync(dev)
        results.append({"max_len": max_len, "key": str(padded.key),
                        "max_abs_err": (got - eager).abs().max().item()})
    return {"replays": results, **cache.stats(),
            "ok": all(r["max_abs_err"] < 2e-3 for r in results)}


def _decode_kernel_timing(dev: torch.device) -> dict[str, Any]:
    """One layer's decode attention for the 135M shape (9/3 heads, dim 64), 256 rows of
    512 keys, page 32, bf16: Triton (best split count of 1/2/4/8) vs the reference gather
    + SDPA path of `static_decode_attention`, CUDA-event timed."""
    from ferrobatch.cuda import triton_attention as ta

    rows, ctx, page, heads, kv_heads, dim = 256, 512, 32, 9, 3, 64
    per_row = ctx // page
    num_blocks = rows * per_row
    dt = torch.bfloat16
    k_cache = torch.randn((num_blocks + 2) * page, kv_heads, dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    table = (torch.randperm(num_blocks, device=dev) + 2).view(rows, per_row).int()
    cu = torch.arange(rows + 1, device=dev, dtype=torch.int32)
    lens = torch.full((rows,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(rows, heads, dim, device=dev, dtype=dt)

    def timed(fn: Callable[[], Any], n: int = 50) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        sync(dev)
        return start.elapsed_time(end) / n * 1000.0  # us

    out: dict[str, Any] = {}
    for splits in (1, 2, 4, 8):
        out[f"triton_splits{splits}_us"] = timed(lambda s=splits: ta.paged_decode_attention(
            q, k_cache, v_cache, table, cu, lens, page_size=page, scale=0.125, num_splits=s))
    out["static_torch_us"] = timed(lambda: ta.static_decode_attention(
        q, k_cache, v_cache, table, cu, lens, max_seqlen_k=ctx, page_size=page, scale=0.125))
    out["chosen_splits"] = ta.choose_num_splits(
        rows, kv_heads, ctx, num_sms=torch.cuda.get_device_properties(dev).multi_processor_count)
    kv_bytes = 2 * rows * ctx * kv_heads * dim * 2
    best = min(v for k, v in out.items() if k.startswith("triton"))
    out["triton_best_GBps"] = kv_bytes / (best * 1e-6) / 1e9
    return out


def section_parity(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    import dataclasses

    from ferrobatch.config import ContinuousBatchingConfig

    n, new = (16, 32) if not args.smoke else (4, 6)
    out: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    modes = {"eager": dict(use_cuda_graph=False, use_async_batching=False)}
    if dev.type == "cuda":
        modes["graphs"] = dict(use_cuda_graph=True, use_async_batching=False)
        modes["graphs_async"] = dict(use_cuda_graph=True, use_async_batching=True)
    modes = {m: {k: v for k, v in kw.items() if k in fields} for m, kw in modes.items()}
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        for kind in ("llama", "qwen3", "gemma3"):
            _parity_model(args, dev, kind, n, new, modes, out)
    except SectionTimeout as exc:  # keep what finished
        out["timeout"] = str(exc)
    out["all_identical"] = "timeout" not in out and all(
        m.get("requests") == 1.0 for r in out.values() if isinstance(r, dict)
        for m in r.values())
    return out


def _parity_model(args: argparse.Namespace, dev: torch.device, kind: str, n: int, new: int,
                  modes: dict[str, dict[str, Any]], out: dict[str, Any]) -> None:
    from ferrobatch.config import ContinuousBatchingConfig

    model = build(kind, tiny=args.smoke).to(dev, torch.float32)
    try:
        prompts = prompts_for(n, 4, 90 if not args.smoke else 20, 1024, seed=7)
        ref = run_generate_each(model, prompts, new)
        res: dict[str, Any] = {}
        out[kind] = res
        for mode, extra in modes.items():
            # A mode that fails (async batching not built yet, a capture error) is reported
            # and the others still run.
            try:
                cfg = ContinuousBatchingConfig(page_size=16, max_batch_tokens=256,
                                               num_blocks=1024, **extra)
                t0 = time.perf_counter()
                got, stats = run_ferrobatch(model, prompts, new, cfg)
            except SectionTimeout:
                raise
            except Exception as exc:  # noqa: BLE001 - report the mode, run the others
                res[mode] = {"error": repr(exc)[:500], "requests": 0.0,
                             "traceback": traceback.format_exc()[-1500:]}
                continue
            res[mode] = {
                **agreement(ref, got),
                "seconds": round(time.perf_counter() - t0, 2),
                "use_cuda_graph": stats.get("use_cuda_graph"),
                "async_batching": stats.get("async_batching"),
                "cuda_graphs": stats.get("cuda_graphs"),
                "attention_backend": stats.get("attention_backend"),
                "warnings": stats.get("warnings"),
            }
            if mode != "eager":
                graphs = (stats.get("cuda_graphs") or {}).get("graph_steps", 0)
                res[mode]["graphs_used"] = bool(graphs)
    finally:
        del model
        free(dev)


@contextlib.contextmanager
def graphs_off(runner: Any) -> Iterator[None]:
    """Run `runner`'s steps eager for the block (its graph cache set aside)."""
    saved = runner.graphs.cache
    runner.graphs.cache = None
    try:
        yield
    finally:
        runner.graphs.cache = saved


def _device_times(events: Any) -> tuple[float, float]:
    """(kernel µs, all device µs incl. copies) summed over the device events of a profile's
    `key_averages()`. Only events whose `device_type` is CUDA count, as torch's own table
    does: a CPU op's `self_device_time_total` is the time of the kernels it launched, which
    are entries of their own, so summing every entry counts each kernel twice."""
    from torch.autograd import DeviceType

    kernel = total = 0.0
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        t = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        total += t
        if not e.key.lower().startswith(("memcpy", "memset")):
            kernel += t
    return kernel, total


def section_decode_step(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """One ModelRunner decode step, 135M shape, 256 requests of ~256 cached tokens (bf16 on
    CUDA), eager and through its CUDA graph on the same cache: wall time per step (host
    included, synchronized) and device time of back-to-back steps (CUDA events) vs the
    step's summed kernel time (profiler, eager step). Target: the graph step <= 1.5x
    the pure kernel time. On CPU (smoke) the padded graph forward runs without capture and
    its logits are compared with eager's."""
    sys.path.insert(0, str(REPO / "tests"))
    from ferrobatch.runner.model_runner import ModelRunner
    from ref_planner import FULL, RefPlanner

    rows, ctx, page = (256, 256, 32) if not args.smoke else (8, 24, 8)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build("smollm2_135m", tiny=args.smoke).to(dev, dtype)
    num_blocks = rows * (ctx // page + 2) + 8
    with recorded_warnings() as warned:
        runner = ModelRunner(model, num_blocks=num_blocks, page_size=page, device=dev,
                             dtype=dtype)
    if dev.type != "cuda":
        # The padded graph forward without capture; through the Triton kernels when they
        # run here (the interpreter), else the torch reference.
        from ferrobatch.cuda import triton_attention as ta

        interp = ta.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
        runner.graphs.setup("eager", max_graphs=4, backend="triton" if interp else "torch")
    planner = RefPlanner(page_size=page, num_blocks=num_blocks, layer_types=[FULL],
                         sliding_window=None)
    rng = random.Random(0)
    vocab = int(model.config.vocab_size)
    for r in range(rows):
        planner.add(f"r{r}", [rng.randrange(3, vocab) for _ in range(ctx)])
    step = max(1, 4096 // ctx)
    for s in range(0, rows, step):
        runner.execute(planner.plan([(f"r{r}", ctx) for r in range(s, min(rows, s + step))]))
    for r in range(rows):
        planner.append(f"r{r}", 5)
    plan = planner.plan([(f"r{r}", 1) for r in range(rows)])
    out: dict[str, Any] = {"rows": rows, "ctx": ctx, "dtype": str(dtype),
                           "attention_backend": runner.attention_backend,
                           "graph_backend": getattr(runner, "_graph_backend", None),
                           "use_cuda_graph": runner.use_cuda_graph,
                           "graph_off_reason": getattr(runner, "cuda_graph_off_reason", None),
                           "warnings": warned}

    reps = 20 if not args.smoke else 2

    def wall_us(n: int = reps) -> float:
        for _ in range(3 if not args.smoke else 1):
            runner.execute(plan)  # same slots rewritten: fine for timing
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            runner.execute(plan)
        sync(dev)
        return (time.perf_counter() - t0) / n * 1e6

    def event_us(n: int = reps) -> float | None:
        if dev.type != "cuda":
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            runner.execute(plan)
        end.record()
        sync(dev)
        return start.elapsed_time(end) / n * 1000.0

    def profiled() -> tuple[float, float] | None:
        if dev.type != "cuda":
            return None
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(plan)
            sync(dev)
        return _device_times(prof.key_averages())

    with graphs_off(runner):
        out["eager_wall_us"] = wall_us()
        out["eager_event_us"] = event_us()
        eager_prof = profiled()
        eager_logits = runner.execute(plan).float().cpu()
    if eager_prof:
        out["kernel_us"], out["eager_device_us"] = eager_prof
    if runner.graphs.cache is not None:
        out["graph_wall_us"] = wall_us()
        out["graph_event_us"] = event_us()
        graph_prof = profiled()
        if graph_prof:
            out["graph_kernel_us"], out["graph_device_us"] = graph_prof
        got = runner.execute(plan).float().cpu()
        out["graph_vs_eager_max_abs_logit_diff"] = (got - eager_logits).abs().max().item()
        out["graph_vs_eager_same_argmax"] = float(
            (got.argmax(-1) == eager_logits.argmax(-1)).float().mean())
        out["graph_stats"] = runner.graph_stats()
        kernel = out.get("kernel_us")
        if kernel:
            out["graph_wall_over_kernel"] = round(out["graph_wall_us"] / kernel, 3)
            if out["graph_event_us"]:
                out["graph_event_over_kernel"] = round(out["graph_event_us"] / kernel, 3)
            out["eager_wall_over_kernel"] = round(out["eager_wall_us"] / kernel, 3)
            # The kernels of a step cannot take longer than the step on the device: if the
            # sum says so, it counts something twice and the ratio would pass falsely.
            ev = out.get("eager_event_us")
            out["kernel_us_le_eager_event_us"] = ev is None or kernel <= ev * 1.02
            out["target_1_5x_met"] = (out["graph_wall_over_kernel"] <= 1.5
                                      and out["kernel_us_le_eager_event_us"])
    runner.close()  # main() frees device memory after the section
    return out


_LAST_STATS: list[dict[str, Any]] = []


def _keep_stats(result: tuple[list[list[int]], dict[str, Any]]) -> list[list[int]]:
    _LAST_STATS.append(result[1])
    return result[0]


def section_throughput(args: argparse.Namespace, dev: torch.device, deadline: float) -> dict[
    str, Any
]:
    from ferrobatch.config import ContinuousBatchingConfig

    n = args.prompts if not args.smoke else 8
    new = args.max_new_tokens if not args.smoke else 8
    hi = 512 if not args.smoke else 24
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out: dict[str, Any] = {"prompts": n, "max_new_tokens": new, "prompt_len": [16, hi],
                           "dtype": str(dtype), "padded_batch": args.padded_batch,
                           "timing": "ferrobatch: one engine built untimed runs a warm-up pass "
                                     "of prompts of the same lengths (other tokens: same "
                                     "plan shapes, no prefix-cache hits on the timed "
                                     "prompts; it compiles the Triton variants and captures "
                                     "the graphs, first_pass_seconds), then the timed pass "
                                     "(compiles_in_timed_pass / captures_in_timed_pass "
                                     "should be 0); peers: after a 4-prompt warm-up"}
    for shape in ("smollm2_135m", "llama_1b"):
        model = build(shape, tiny=args.smoke).to(dev, dtype)
        vocab = int(model.config.vocab_size)
        prompts = prompts_for(n, 16, hi, vocab)
        warm = prompts_for(4, 8, 32, vocab, seed=5)
        res: dict[str, Any] = {}
        outputs: dict[str, list[list[int]]] = {}
        page = ContinuousBatchingConfig().page_size
        need = sum(-(-(len(p) + new) // page) for p in prompts)
        cfg = ContinuousBatchingConfig(
            max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=256,
            num_blocks=args.num_blocks or int(need * 1.1) + 16,
        )
        res["ferrobatch_config"] = {"page_size": cfg.page_size, "num_blocks": cfg.num_blocks,
                                    "max_batch_tokens": cfg.max_batch_tokens}
        fb_warm = same_lengths(prompts, vocab)  # ferrobatch's untimed pass: the same shapes
        methods: dict[str, Callable[[list[list[int]], int], list[list[int]]]] = {
            "ferrobatch": lambda p, k, m=model, c=cfg, w=fb_warm: (
                _keep_stats(run_ferrobatch(m, p, k, c, warm_prompts=w))),
        }
        for bs in args.padded_batch:  # the peer at its best batch: each reported
            methods[f"padded_generate_bs{bs}"] = (
                lambda p, k, m=model, b=bs: run_padded_generate(m, p, k, b))
        # Last: the slowest; a method that finishes early leaves its budget to the rest.
        methods["generate_batch"] = lambda p, k, m=model: run_generate_batch(m, p, k)
        for i, (name, fn) in enumerate(methods.items()):
            left = deadline - time.monotonic()
            methods_left = (len(methods) - i) + (len(methods) if shape == "smollm2_135m" else 0)
            budget = min(args.method_budget, left / methods_left)
            free(dev)
            try:
                with time_limit(budget):
                    if name == "ferrobatch":  # timed inside: its second pass
                        toks = fn(prompts, new)
                        sec = _LAST_STATS[-1]["seconds"]
                    else:
                        fn(warm, 4)
                        sync(dev)
                        t0 = time.perf_counter()
                        toks = fn(prompts, new)
                        sync(dev)
                        sec = time.perf_counter() - t0
                got = sum(len(t) for t in toks)
                outputs[name] = toks
                res[name] = {"tok_s": got / sec, "seconds": round(sec, 2),
                             "generated_tokens": got, "peak_gib": peak_gib(dev)}
                if len(toks) != len(prompts) or got != len(prompts) * new:
                    # A timeout swallowed inside the method returns partial results.
                    res[name]["incomplete"] = f"{len(toks)} of {len(prompts)} requests"
                    res[name].pop("tok_s")
            except SectionTimeout as exc:
                res[name] = {"timeout": str(exc)}
            except Exception as exc:  # noqa: BLE001 - report and go on
                res[name] = {"error": repr(exc)[:500]}
            print(f"  {shape} {name}: {res[name]}", flush=True)
            out[shape] = res
            checkpoint("throughput", out)
        if "tok_s" in res.get("ferrobatch", {}) and _LAST_STATS:
            st = _LAST_STATS[-1]
            for k in ("first_pass_seconds", "compiles_in_timed_pass", "captures_in_timed_pass"):
                res["ferrobatch"][k] = st.get(k)
            res["ferrobatch"]["engine"] = {k: st.get(k) for k in (
                "use_cuda_graph", "async_batching", "attention_backend", "cuda_graphs",
                "split_head_error", "warnings", "cache_gib", "num_blocks", "steps",
                "ahead_steps", "pipeline_drains", "num_preemptions", "num_offloads") if k in st}
        padded = {k: v for k, v in res.items() if k.startswith("padded_generate_bs")
                  and "tok_s" in v}
        if padded:
            best = max(padded, key=lambda k: padded[k]["tok_s"])
            res["padded_generate"] = {**padded[best], "batch": int(best.rsplit("bs", 1)[1])}
            outputs["padded_generate"] = outputs[best]
        fb = res.get("ferrobatch", {}).get("tok_s")
        for other in ("generate_batch", "padded_generate"):
            ot = res.get(other, {}).get("tok_s")
            if fb and ot:
                res[f"ferrobatch_x_{other}"] = round(fb / ot, 2)
        if "ferrobatch" in outputs:
            for other in ("generate_batch", "padded_generate"):
                if other in outputs:
                    res[f"agreement_{other}"] = agreement(outputs["ferrobatch"], outputs[other])
        out[shape] = res
        del model, methods, outputs
        free(dev)
    return out


def section_offload(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    from ferrobatch.config import ContinuousBatchingConfig

    n, new = (48, 48) if not args.smoke else (12, 12)
    model = build("llama", tiny=args.smoke).to(dev, torch.float32)
    prompts = prompts_for(n, 40, 120 if not args.smoke else 50, 1024, seed=11)
    base = ContinuousBatchingConfig(page_size=16, max_batch_tokens=512)
    need = sum(-(-(len(p) + new) // 16) for p in prompts)
    tight = base.replace(num_blocks=max(24, need // 6), cpu_offload_space=0.25)
    free_out, _ = run_ferrobatch(model, prompts, new, base)
    off_out, stats = run_ferrobatch(model, prompts, new, tight)
    keys = ("num_blocks", "num_offloads", "num_preemptions", "num_soft_resets",
            "cpu_offload_blocks", "steps")
    res = {k: stats.get(k) for k in keys}
    res["blocks_needed_unconstrained"] = need
    res["engine_modes"] = {k: stats.get(k) for k in (
        "use_cuda_graph", "async_batching", "attention_backend", "cuda_graphs")}
    res["agreement_with_unconstrained"] = agreement(free_out, off_out)
    res["ok"] = bool(stats.get("num_offloads")) and res["agreement_with_unconstrained"][
        "requests"] == 1.0
    del model
    free(dev)
    return res


def _tp_run(path: Path, prompts: list[list[int]], new: int, cfg: Any, tp: int,
            dtype: str) -> tuple[list[list[int]], dict[str, Any], float]:
    """Greedy outputs, rank 0's stats and the timed seconds of one engine of `tp` ranks
    (built and warmed up outside the timer)."""
    from ferrobatch import Engine, SamplingParams

    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    with Engine(str(path), config=cfg, device="cuda", dtype=dtype,
                tensor_parallel_size=tp) as eng:
        eng.generate(prompts[:4], SamplingParams(max_new_tokens=4, ignore_eos=True),
                     progress=False)
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp, progress=False)
        seconds = time.perf_counter() - t0
        stats = eng.stats()
        stats["use_cuda_graph"] = eng.runner.use_cuda_graph
    return [o.token_ids for o in outs], stats, seconds


def section_tensor_parallel(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """TP=2 (see the module docstring). Skipped cleanly with fewer than two GPUs."""
    import tempfile

    from ferrobatch.config import ContinuousBatchingConfig

    if dev.type == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"needs >= 2 CUDA devices, {torch.cuda.device_count()} visible"}
    if dev.type != "cuda" and not args.smoke:
        return {"skipped": "no CUDA device (run with --smoke for the CPU / gloo path)"}
    out: dict[str, Any] = {"devices": torch.cuda.device_count() if dev.type == "cuda" else 0}
    tmp = tempfile.TemporaryDirectory()
    try:
        n, new = (16, 32) if not args.smoke else (4, 6)
        model = build("llama", tiny=args.smoke)
        path = Path(tmp.name) / "llama"
        model.save_pretrained(path)
        prompts = prompts_for(n, 4, 90 if not args.smoke else 20, 1024, seed=7)
        ref = run_generate_each(model.to(dev, torch.float32), prompts, new)
        del model
        free(dev)
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        modes = {"eager": dict(use_cuda_graph=False)}
        if dev.type == "cuda":
            modes["graphs"] = dict(use_cuda_graph=True)
        else:  # the smoke run: gloo on the CPU
            modes = {"eager_gloo": {}}
        for mode, extra in modes.items():
            cfg = ContinuousBatchingConfig(page_size=16, max_batch_tokens=256, num_blocks=512,
                                           **extra)
            try:
                if dev.type == "cuda":
                    got, stats, secs = _tp_run(path, prompts, new, cfg, 2, "float32")
                else:
                    from ferrobatch import Engine, SamplingParams

                    t0 = time.perf_counter()
                    with Engine(str(path), config=cfg, tensor_parallel_size=2) as eng:
                        got = [o.token_ids for o in eng.generate(
                            prompts, SamplingParams(max_new_tokens=new, ignore_eos=True),
                            progress=False)]
                        stats = {**eng.stats(), "use_cuda_graph": eng.runner.use_cuda_graph}
                    secs = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - report the mode, run the others
                out[mode] = {"error": repr(exc)[:500], "traceback": traceback.format_exc()[-1500:]}
                continue
            graphs = (stats.get("cuda_graphs") or {}).get("graph_steps", 0)
            out[mode] = {**agreement(ref, got), "seconds": round(secs, 2),
                         "use_cuda_graph": stats.get("use_cuda_graph"), "graph_steps": graphs}
        if dev.type == "cuda":
            shape = "llama_1b"
            big = build(shape, tiny=False).to(torch.bfloat16)
            bpath = Path(tmp.name) / shape
            big.save_pretrained(bpath)
            del big
            tp_prompts = prompts_for(128, 32, 512, 2048, seed=3)
            cfg = ContinuousBatchingConfig(page_size=16, max_batch_tokens=4096)
            rates = {}
            for tp in (1, 2):
                try:
                    _, stats, secs = _tp_run(bpath, tp_prompts, 64, cfg, tp, "bfloat16")
                    rates[f"tp{tp}"] = {"tok_s": round(128 * 64 / secs, 1),
                                        "seconds": round(secs, 2),
                                        "use_cuda_graph": stats.get("use_cuda_graph")}
                except Exception as exc:  # noqa: BLE001
                    rates[f"tp{tp}"] = {"error": repr(exc)[:500]}
                free(dev)
            if all("tok_s" in r for r in rates.values()):
                rates["tp2_over_tp1"] = round(rates["tp2"]["tok_s"] / rates["tp1"]["tok_s"], 3)
            out[f"throughput_{shape}_bf16"] = rates
        out["all_identical"] = all(out[m].get("requests") == 1.0 for m in modes)
    finally:
        tmp.cleanup()
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, few prompts (CPU by default): checks the script runs")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--out", type=Path, default=None,
                    help="report path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--padded-batch", type=int, nargs="+", default=[128, 256, 512],
                    help="batch sizes of the padded `generate` peer; the best one is "
                         "`padded_generate` in the ratios")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="ferrobatch cache blocks in the throughput runs (default: what the "
                         "512 prompts need, +10%%)")
    ap.add_argument("--method-budget", type=float, default=75.0,
                    help="max seconds per throughput method (warm-up included); the section "
                         "shares what is left of the total budget among its methods")
    ap.add_argument("--total-budget", type=float, default=450.0,
                    help="seconds for the whole check; later sections are skipped past it")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    path = args.out
    if path is None:
        path = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path(
            "gpu_check.json")
    start = time.monotonic()
    deadline = start + args.total_budget
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "sections": {}}
    budgets = {"env": 30, "kernels": 110, "parity": 110, "decode_step": 60, "offload": 60,
               "tensor_parallel": 150}

    def write(name: str, result: dict[str, Any]) -> None:
        report["sections"][name] = result
        report["total_seconds"] = round(time.monotonic() - start, 2)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))

    _CHECKPOINT[:] = [lambda name, partial: write(name, {**partial, "partial": True})]
    for name in args.only:
        left = deadline - time.monotonic()
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ({left:.0f} s left)", flush=True)
        try:
            if name == "throughput":
                # Leave the sections after it their budgets.
                after = args.only[args.only.index(name) + 1 :]
                reserve = sum(min(budgets[n], 45) for n in after if n in budgets)
                result = section_throughput(args, dev, deadline - reserve)
            else:
                with time_limit(min(budgets[name], left)):
                    result = globals()[f"section_{name}"](args, dev)
        except SectionTimeout as exc:
            result = {"timeout": str(exc)}
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide others
            result = {"error": repr(exc)[:1000], "traceback": traceback.format_exc()[-3000:]}
        result["section_seconds"] = round(time.perf_counter() - t0, 2)
        write(name, result)
        print(json.dumps({name: result}, indent=1, default=str)[:3000], flush=True)
        free(dev)
    print(f"[gpu_check] report: {path} ({report['total_seconds']} s)", flush=True)
    failed = [n for n, r in report["sections"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
