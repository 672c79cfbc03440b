"""The engine (Rust scheduler, sync and async pipelines) with decode-only steps through the
padded graph forward, run without capture on CPU: greedy output equals `model.generate`."""

from __future__ import annotations

import random

import pytest
import tiny_models as tm
import torch
from ferrobatch import Engine, SamplingParams
from ferrobatch.config import ContinuousBatchingConfig
from ferrobatch.core import Scheduler

torch.set_num_threads(1)


@pytest.mark.parametrize(("name", "use_async"), [("llama", False), ("llama", True),
                                                 ("gemma3", True)])
def test_engine_with_padded_graph_steps_matches_generate(name, use_async):
    if use_async and not hasattr(Scheduler, "schedule_ahead"):
        pytest.skip("the built core has no schedule_ahead (one step in flight) yet")
    model = tm.BUILDERS[name]()
    cfg = ContinuousBatchingConfig(num_blocks=96, page_size=8, max_batch_tokens=48,
                                   max_requests_per_batch=8, kv_padding_interval_size=16,
                                   q_padding_interval_size=4, use_cuda_graph=False,
                                   use_async_batching=use_async)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, tm.VOCAB) for _ in range(rng.randint(2, 30))]
               for _ in range(7)]
    new = 10
    with Engine(model, config=cfg) as engine:
        engine.runner.graphs.setup("eager", config=cfg, max_graphs=4)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True),
                               progress=False)
        stats = engine.runner.graph_stats()
        est = engine.stats()
        assert bool(est.get("async_batching")) == use_async
        if use_async:  # plans made ahead, their input ids filled from the previous samples
            assert est["ahead_steps"] >= 5, est
    assert stats["graph_steps"] >= 5 and stats["eager_steps"] >= 1, stats
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.token_ids) == tm.generate_greedy(model, p, new, ignore_eos=True)
