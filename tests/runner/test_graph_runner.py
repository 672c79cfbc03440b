"""ModelRunner's padded (CUDA-graph) path on CPU, and inputs taken from the previous step's
samples (`plan.prev_token_index`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch.runner.model_runner import ModelRunner
from ref_planner import RefPlanner

torch.set_num_threads(1)



def _with_prev_index(plan, prev_index: np.ndarray, placeholder: int = 0):
    """A copy of `plan` (a fake plan object) whose input ids at `prev_index >= 0` are
    placeholders, as the core's in-flight plans have them."""
    fields = {k: getattr(plan, k) for k in (
        "request_ids", "positions", "cu_seqlens_q", "seqlens_k", "logits_indices",
        "logits_rows", "slot_mapping", "block_tables", "swap_out", "swap_in")}
    ids = np.array(plan.input_ids, dtype=np.int32)
    ids[prev_index >= 0] = placeholder
    return SimpleNamespace(input_ids=ids, prev_token_index=prev_index.astype(np.int32),
                           **fields)


@pytest.mark.parametrize("backend", [None, "torch", "padded"])
def test_input_ids_from_previous_samples(backend):
    """A decode plan whose input ids are placeholders filled from `prev_tokens` gives the
    logits of the plan with the real ids; without prev_tokens it is refused. "padded": the
    decode steps go through the graph path (ids filled into the static inputs)."""
    model = tm.llama()
    if backend == "padded":
        runner = _padded_runner(model, num_blocks=64)
        backend = None
    else:
        runner = ModelRunner(model, num_blocks=64, page_size=4, attention_backend=backend)
    ref = ModelRunner(model, num_blocks=64, page_size=4, attention_backend=backend)
    planner = RefPlanner(page_size=4, num_blocks=64, layer_types=runner.layer_types,
                         sliding_window=None)
    prompts = tm.random_prompts(0, 3, 3, 9)
    for i, p in enumerate(prompts):
        planner.add(f"r{i}", p)
    first = planner.plan([(f"r{i}", len(p)) for i, p in enumerate(prompts)])
    logits = runner.execute(first)
    ref.execute(first)
    sampled = logits.argmax(-1)  # [N] in logits_indices order (rows r0, r1, r2)
    # Next step: rows in another order, so index j != row; plus a row with a real id.
    order = [2, 0, 1]
    for i in order:
        planner.append(f"r{i}", int(sampled[i]))
    plan = planner.plan([(f"r{i}", 1) for i in order])
    prev_index = np.array(order, dtype=np.int64)
    prev_index[1] = -1  # r0's id stays in input_ids
    fake = _with_prev_index(plan, prev_index)
    fake.input_ids[1] = plan.input_ids[1]
    with pytest.raises(ValueError, match="prev_tokens"):
        runner.execute(fake)
    got = runner.execute(fake, prev_tokens=sampled.to(torch.int32))
    want = ref.execute(plan)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # All -1 (a plan from schedule()): prev_tokens is ignored.
    for i in order:
        planner.append(f"r{i}", int(got[order.index(i)].argmax()))
    plan2 = planner.plan([(f"r{i}", 1) for i in order])
    fake2 = _with_prev_index(plan2, np.full(3, -1))
    torch.testing.assert_close(runner.execute(fake2, prev_tokens=sampled),
                               ref.execute(plan2), atol=1e-5, rtol=1e-5)
    if runner.graphs.cache is not None:
        assert runner.graph_stats()["graph_steps"] == 2
    runner.close()
    ref.close()


def test_use_cuda_graph_on_cpu_warns_and_runs_eager():
    model = tm.llama()
    with pytest.warns(UserWarning, match="CUDA graphs off"):
        runner = ModelRunner(model, num_blocks=16, page_size=4, use_cuda_graph=True)
    assert runner.use_cuda_graph is False
    runner.close()
    assert ModelRunner(model, num_blocks=16, page_size=4).use_cuda_graph is False


# ----------------------------------------------------------------------------- padded path

PAGE = 4


def _padded_runner(model, *, max_graphs=3, num_blocks=128, kv_interval=8):
    """A runner whose decode-only steps take the padded graph path without capture (the
    exact forward a CUDA graph captures, over the same static inputs), torch backend."""
    from ferrobatch.cuda.graphs import GraphBuckets

    runner = ModelRunner(model, num_blocks=num_blocks, page_size=PAGE, attention_backend="torch")
    runner.graphs.setup("eager", max_graphs=max_graphs, buckets=GraphBuckets(
        q_interval=4, kv_interval=kv_interval, max_tokens=64, max_rows=64,
        num_kv_heads=runner.cache.num_kv_heads))
    return runner


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma2", "gemma3"])
def test_padded_decode_steps_match_unpadded_and_generate(name):
    """Greedy decoding where every decode-only step runs padded (rows and kv padded, several
    keys, LRU hits and evictions): logits equal the unpadded runner's each step, tokens equal
    `model.generate` per prompt."""
    model = tm.BUILDERS[name]()
    padded = _padded_runner(model)
    plain = ModelRunner(model, num_blocks=128, page_size=PAGE)
    planner = RefPlanner(page_size=PAGE, num_blocks=128, layer_types=plain.layer_types,
                         sliding_window=plain.sliding_window)
    prompts = tm.random_prompts(5, 5, 2, 30)
    new = 12
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        planner.add(rid, p)
    plen = dict(zip(rids, map(len, prompts), strict=True))
    for step in range(80):
        live = [r for r in rids if len(planner.reqs[r].tokens) - plen[r] < new]
        if not live:
            break
        # Rows sit out in turns, so the row count (and the key) changes between steps.
        rows = [(r, min(planner.remaining(r), 9)) for j, r in enumerate(live)
                if (step + j) % 3 or len(live) == 1]
        plan = planner.plan(rows or [(live[0], min(planner.remaining(live[0]), 9))])
        got = padded.execute(plan)
        want = plain.execute(plan)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for i, b in enumerate(plan.logits_rows):
            planner.append(plan.request_ids[b], int(want[i].argmax()))
    stats = padded.graph_stats()
    assert stats["graph_steps"] >= 10 and stats["eager_steps"] >= 1
    assert stats["hits"] >= 3 and stats["evictions"] >= 1 and stats["graphs"] <= 3, stats
    for rid, p in zip(rids, prompts, strict=True):
        ref = tm.generate_greedy(model, p, new)
        got = planner.reqs[rid].tokens[len(p):len(p) + new]
        eos = model.generation_config.eos_token_id
        if eos in got:
            got = got[: got.index(eos) + 1]
        assert got == ref, (name, rid)
    padded.close()
    plain.close()


def _decode_setup(name: str, num_blocks: int = 64):
    model = tm.BUILDERS[name]()
    runner = _padded_runner(model, num_blocks=num_blocks)
    planner = RefPlanner(page_size=PAGE, num_blocks=num_blocks, layer_types=runner.layer_types,
                         sliding_window=runner.sliding_window)
    prompts = tm.random_prompts(9, 3, 5, 22)
    for i, p in enumerate(prompts):
        planner.add(f"r{i}", p)
    logits = runner.execute(planner.plan([(f"r{i}", len(p)) for i, p in enumerate(prompts)]))
    for i in range(len(prompts)):
        planner.append(f"r{i}", int(logits[i].argmax()))
    return model, runner, planner, len(prompts)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_padding_writes_only_the_scratch_chunk_and_reads_only_the_zero_chunk(name):
    """A dummy (all-padding) step changes no data chunk and leaves the zero chunk zero; in a
    real padded step with every chunk the plan does not name (scratch included) poisoned
    with NaN, real rows get the unpadded logits and the padding rows' hidden states stay
    finite: padding read nothing but the zero chunk."""
    from ferrobatch.cuda import graphs

    model, runner, planner, n = _decode_setup(name)
    plain = ModelRunner(model, num_blocks=64, page_size=PAGE)
    plain.cache.storage.copy_(runner.cache.storage)
    plan = planner.plan([(f"r{i}", 1) for i in range(n)])  # 3 rows -> padded to 4
    padded = graphs.pad_plan(plan, runner.graphs.buckets, page_size=PAGE,
                             sliding_window=runner.sliding_window)
    assert padded.key.tokens > n
    graph = runner.graphs.cache.get(padded.key)
    cache = runner.cache
    store = cache.storage.view(cache.num_layers, 2, cache.num_chunks, PAGE, -1)
    before = store.clone()
    with torch.inference_mode():
        graph.load(graphs.dummy_plan(padded.key))
        graph.run()
    assert torch.equal(store[:, :, 2:], before[:, :, 2:]), "a dummy step wrote a data chunk"
    assert not store[:, :, 0].any(), "the zero chunk was written"

    used = {int(c) for t in plan.block_tables.values() for c in np.asarray(t).ravel()}
    used |= {int(s) // PAGE for t in plan.slot_mapping.values() for s in np.asarray(t)}
    poison = [c for c in range(1, runner.cache.num_chunks) if c not in used]
    assert 1 in poison
    with torch.inference_mode():
        store[:, :, poison] = float("nan")
    want = plain.execute(plan)
    got = runner.execute(plan)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(graph.output).all(), "a padding row read a poisoned chunk"
    assert not store[:, :, 0].any()
    runner.close()
    plain.close()


def test_graph_stats_and_the_eager_bound():
    """Steps with more rows than the buckets allow, and prefill steps, run eager."""
    from ferrobatch.cuda.graphs import GraphBuckets

    _, runner, planner, n = _decode_setup("llama")
    stats = runner.graph_stats()
    assert stats["enabled"] and stats["mode"] == "eager" and stats["eager_steps"] == 1
    runner.graphs.buckets = GraphBuckets(q_interval=2, kv_interval=8, max_tokens=2, max_rows=2,
                                   num_kv_heads=2)
    logits = runner.execute(planner.plan([(f"r{i}", 1) for i in range(n)]))
    assert logits.shape[0] == n
    stats = runner.graph_stats()
    assert stats["eager_steps"] == 2 and stats["graph_steps"] == 0 and stats["captures"] == 0
    runner.close()
    off = ModelRunner(tm.llama(), num_blocks=8, page_size=4).graph_stats()
    assert not off["enabled"] and off["graphs"] == 0


def test_failed_capture_turns_graphs_off_and_runs_eager(caplog):
    """On CUDA a capture that raises must not stop the engine: graphs off, eager logits."""
    model, runner, planner, n = _decode_setup("llama")
    plain = ModelRunner(model, num_blocks=64, page_size=PAGE)
    plain.cache.storage.copy_(runner.cache.storage)

    def broken(key):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner.graphs.cache._capture = broken
    runner.graphs.mode = "cuda"  # the fallback only applies to real captures
    plan = planner.plan([(f"r{i}", 1) for i in range(n)])
    with caplog.at_level("WARNING", logger="ferrobatch"):
        got = runner.execute(plan)
    torch.testing.assert_close(got, plain.execute(plan), atol=1e-4, rtol=1e-4)
    assert "capture failed" in caplog.text
    stats = runner.graph_stats()
    assert not stats["enabled"] and "not permitted" in stats["capture_error"]
    assert runner.use_cuda_graph is False and stats["eager_steps"] == 2
    runner.close()
    plain.close()


def test_packed_sequence_check_bypassed_only_inside_a_ferrobatch_forward():
    from ferrobatch.attention import registry
    from ferrobatch.runner import patches
    from transformers import masking_utils

    patches.install_packed_check_bypass()
    patches.install_packed_check_bypass()  # idempotent
    fn = masking_utils.find_packed_sequence_indices
    original = fn.__wrapped__
    assert getattr(original, "__wrapped__", None) is None
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    assert torch.equal(fn(packed), original(packed))  # outside: the original
    with registry.paged_attention_enabled([]):
        assert fn(packed) is None


def test_a_shape_gets_its_graph_on_its_second_step():
    """capture_after=2 (the CUDA default): a key's first step runs eager, the second captures."""
    from ferrobatch.cuda.graphs import GraphBuckets

    model, runner, planner, n = _decode_setup("llama")
    runner.graphs.setup("eager", capture_after=2, buckets=GraphBuckets(
        q_interval=4, kv_interval=64, max_tokens=64, max_rows=64, num_kv_heads=2))
    plain = ModelRunner(model, num_blocks=64, page_size=PAGE)
    plain.cache.storage.copy_(runner.cache.storage)
    counts = []
    for _ in range(3):
        plan = planner.plan([(f"r{i}", 1) for i in range(n)])
        got = runner.execute(plan)
        torch.testing.assert_close(got, plain.execute(plan), atol=1e-4, rtol=1e-4)
        for i in range(n):
            planner.append(f"r{i}", int(got[i].argmax()))
        st = runner.graph_stats()
        counts.append((st["eager_steps"], st["captures"], st["hits"]))
    assert counts == [(2, 0, 0), (2, 1, 0), (2, 1, 1)], counts
    assert runner.graph_stats()["capture_after"] == 2
    runner.close()
    plain.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_cuda_graph_runner_matches_eager(name):  # pragma: no cover - GPU only
    """Real captures: a graphed runner and an eager one on copies of one cache agree."""
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tm.BUILDERS[name]().to(dev)
    graphed = ModelRunner(model, num_blocks=64, page_size=PAGE, device=dev, use_cuda_graph=True)
    eager = ModelRunner(model, num_blocks=64, page_size=PAGE, device=dev, use_cuda_graph=False)
    assert graphed.use_cuda_graph and graphed.attention_backend in ("triton", "flash_attn")
    planner = RefPlanner(page_size=PAGE, num_blocks=64, layer_types=eager.layer_types,
                         sliding_window=eager.sliding_window)
    prompts = tm.random_prompts(9, 3, 5, 22)
    for i, p in enumerate(prompts):
        planner.add(f"r{i}", p)
    first = planner.plan([(f"r{i}", len(p)) for i, p in enumerate(prompts)])
    graphed.execute(first)
    logits = eager.execute(first)
    for i in range(len(prompts)):
        planner.append(f"r{i}", int(logits[i].argmax()))
    for _ in range(6):
        plan = planner.plan([(f"r{i}", 1) for i in range(len(prompts))])
        got, want = graphed.execute(plan), eager.execute(plan)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        for i in range(len(prompts)):
            planner.append(f"r{i}", int(want[i].argmax()))
    stats = graphed.graph_stats()
    assert stats["captures"] >= 1 and stats["hits"] >= 3 and stats["capture_error"] is None
    graphed.close()
    eager.close()
