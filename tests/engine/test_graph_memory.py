"""Cache sizing on CUDA (free device memory, graph pool, bf16), checked on CPU with
`torch.cuda.mem_get_info` monkeypatched."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from ferrobatch.config import ContinuousBatchingConfig
from ferrobatch.engine import memory

GiB = 2**30


@pytest.fixture
def fake_gpu(monkeypatch):
    free = {"bytes": 40 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * GiB))
    return free


def _cfg():
    return tm.bench_llama().config  # hidden 256, 4 layers, 4/2 heads, vocab 32000


def test_cuda_sizing_arithmetic(fake_gpu):
    cfg = _cfg()
    kw = dict(page_size=32, max_batch_tokens=2048, max_requests_per_batch=256,
              device="cuda", dtype=torch.bfloat16, max_model_len=10**9)
    n, why = memory.choose_num_blocks(cfg, max_memory_percent=0.5, use_cuda_graph=False, **kw)
    hidden, inter, heads, kv, dim, vocab = 256, 1024, 4, 2, 64, 32000
    inter = int(cfg.intermediate_size)
    per_token = 6 * hidden + 3 * inter + 2 * (heads + 2 * kv) * dim
    activations = 2 * 2048 * per_token * 2
    logits = 256 * vocab * (12 + 2)
    kv_chunk = 4 * 2 * 32 * kv * dim * 2
    per_chunk = kv_chunk + int(1.5 * kv_chunk / 4)
    budget = 20 * GiB - activations - logits - memory.BOOKKEEPING
    assert n == int(budget // per_chunk) - 2
    assert "50% of free 40.00 GiB" in why and "graph" not in why
    # Graphs on (None = auto): the pool is counted and named.
    pool, note = memory.graph_pool_bytes(cfg, max_requests_per_batch=256, dtype=torch.bfloat16)
    rows = 256
    assert pool == (2 * rows * per_token * 2 + rows * heads * 16 * (dim + 2) * 4
                    + 32 * rows * (hidden * 2 + 32))
    n_graph, why_graph = memory.choose_num_blocks(cfg, max_memory_percent=0.5, **kw)
    assert n_graph == int((budget - pool) // per_chunk) - 2
    assert "CUDA graph pool" in why_graph and note in why_graph
    # bf16 chunks are half the fp32 ones: about twice the chunks (less the fixed costs).
    n32, _ = memory.choose_num_blocks(cfg, max_memory_percent=0.5, use_cuda_graph=False,
                                      **{**kw, "dtype": torch.float32})
    assert 1.9 < n / n32 < 2.1
    # Free memory drives it; the default share on CUDA is 90%.
    fake_gpu["bytes"] = 10 * GiB
    n10, why10 = memory.choose_num_blocks(cfg, use_cuda_graph=False, **kw)
    assert "90% of free 10.00 GiB" in why10
    assert n10 == int((9 * GiB - activations - logits - memory.BOOKKEEPING) // per_chunk) - 2


def test_graph_pool_from_the_engine_config(fake_gpu):
    """The config's use_cuda_graph and padding interval reach the sizing."""
    cfg = _cfg()
    base = dict(page_size=32, max_batch_tokens=512, max_requests_per_batch=100,
                max_memory_percent=0.5)
    on = ContinuousBatchingConfig(**base, q_padding_interval_size=64)
    off = ContinuousBatchingConfig(**base, use_cuda_graph=False)
    n_on, why = memory.choose_num_blocks(cfg, config=on, device="cuda", dtype=torch.bfloat16,
                                         max_model_len=10**9)
    n_off, _ = memory.choose_num_blocks(cfg, config=off, device="cuda", dtype=torch.bfloat16,
                                        max_model_len=10**9)
    assert n_on < n_off and "decode step of 128 rows" in why  # 100 rows padded to 64s
    n_cpu, why_cpu = memory.choose_num_blocks(cfg, config=on, device="cpu",
                                              dtype=torch.float32, free_bytes=8 * GiB)
    assert "graph" not in why_cpu
    with pytest.raises(ValueError, match="not enough memory"):
        fake_gpu["bytes"] = 2**24
        memory.choose_num_blocks(cfg, config=on, device="cuda", dtype=torch.bfloat16)
