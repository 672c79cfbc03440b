"""A bf16 checkpoint the engine loads in fp32 (the CPU default) keeps its linear weights only
as the bf16 panels `f32_ops` reads (`runner.panel_weights`): the module's fp32 weights are
let go, yet every read of them (a forward outside the engine, `state_dict()`) gets the same
values, greedy parity holds, writing in place is refused, and a model the caller passed in
is never changed."""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.cpu import f32_ops
from ferrobatch.models import load_model
from ferrobatch.runner import cpu_linear
from ferrobatch.runner.greedy_head import GreedyHead
from ferrobatch.runner.panel_weights import WRITE_REFUSED, NarrowWeight, PanelWeight
from isa_helpers import needs_isa

torch.set_num_threads(1)
pytestmark = needs_isa(f32_ops.available(), "avx512f", what="f32_linear")


def _saved_bf16(tmp_path: Path, build=tm.llama) -> Path:
    build().to(torch.bfloat16).save_pretrained(tmp_path)
    return tmp_path


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}


@pytest.mark.parametrize("n,k", [(1, 1), (70, 33), (200, 577)])
def test_unpack_gives_the_packed_weight_back(n, k):
    w = torch.randn(n, k)
    for dtype in (torch.bfloat16, torch.float16):
        back = f32_ops.unpack(f32_ops.pack(w.to(dtype)))
        assert back.dtype == dtype and torch.equal(back.view(torch.int16),
                                                   w.to(dtype).view(torch.int16))
    assert torch.equal(f32_ops.unpack(f32_ops.pack_bf16_exact(w.bfloat16().float())).float(),
                       w.bfloat16().float())
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        f32_ops.unpack(f32_ops.pack(w))


def test_a_panel_weight_reads_as_the_weight_and_refuses_writes():
    w = torch.randn(40, 33).bfloat16().float()
    rows = PanelWeight(f32_ops.pack_bf16_exact(w), 8, 30)
    assert rows.shape == (22, 33) and rows.dtype == torch.float32
    x = torch.randn(3, 33)
    # the engine's product (`f32_ops`) on the panels: its columns 8:30 bit for bit, and
    # torch's product of the rows to rounding (whose bits depend on the CPU's BLAS path:
    # on AMD Zen 4 they differ from f32_ops')
    got = F.linear(x, rows)
    assert torch.equal(got, f32_ops.linear(x, f32_ops.pack_bf16_exact(w))[:, 8:30])
    torch.testing.assert_close(got, F.linear(x, w[8:30]))
    assert torch.equal(rows.detach(), w[8:30]) and torch.equal(rows * 1, w[8:30])
    out = torch.empty(22, 33)
    out.copy_(rows)  # read: allowed
    assert torch.equal(out, w[8:30])
    for write in (lambda: rows.add_(1), lambda: rows.copy_(out),
                  lambda: torch.add(x[:1], 1, out=rows)):
        with pytest.raises(RuntimeError, match="cannot be written or converted"):
            write()
    with pytest.raises(ValueError, match="bf16 pack"):
        PanelWeight(f32_ops.pack(w), 0, 4)
    with pytest.raises(ValueError, match="rows 30:50"):
        PanelWeight(f32_ops.pack_bf16_exact(w), 30, 50)


@pytest.mark.parametrize("read", ["narrow", "fp32"])
@pytest.mark.parametrize("build", [tm.llama, tm.qwen3, tm.qwen2_sliding],
                         ids=["llama", "qwen3", "qwen2-biases"])
def test_an_engine_loaded_bf16_checkpoint_in_fp32_holds_its_linears_in_panels(
        tmp_path, build, read, monkeypatch):
    """Read narrow (the default: bf16, each matrix held as its panels from the start) or
    in fp32 (the fp32 weights let go once packed)."""
    path = _saved_bf16(tmp_path, build)
    reference, _ = load_model(path)  # fp32, what `Engine(path)` computes with
    assert reference.dtype == torch.float32
    prompts = tm.random_prompts(11, 5, 4, 30)
    let_go: list[weakref.ref] = []
    hold = cpu_linear.PackedLinears.hold_in_panels

    def watched(self: cpu_linear.PackedLinears) -> int:
        let_go.extend(weakref.ref(m.weight) for m in self.layers
                      if not isinstance(m.weight, PanelWeight))
        return hold(self)

    monkeypatch.setattr(cpu_linear.PackedLinears, "hold_in_panels", watched)
    if read == "fp32":
        monkeypatch.setattr(Engine, "_narrow_read", lambda self, *args: None)
    with Engine(str(path), tokenizer=None) as engine:
        gc.collect()
        held = _linears(engine.model)
        head = engine.model.get_output_embeddings()
        panels = [n for n, m in held.items() if isinstance(m.weight, PanelWeight)]
        if read == "fp32":
            # the fp32 weights let go are gone from memory (the head's is still held)
            assert sum(ref() is None for ref in let_go) == len(held) - 1
            assert set(panels) == {n for n, m in held.items() if m is not head}
        else:  # nothing in fp32 to let go; the packed products read the weights' panels
            assert not let_go and set(panels) == set(held)
            linears = engine.runner.activations.linears
            for packed in linears._packs:
                assert all(m.weight.panels is packed.f32 or
                           m.weight.panels.packed is packed.f32.packed
                           for m in packed.layers)
            assert linears.only_on_bf16_panels(head) and engine.runner.head.greedy is None
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == tm.generate_greedy(reference, prompt, 12)
        # every read of a let-go weight gets the fp32 weight's values
        state = engine.model.state_dict()
        for name, t in reference.state_dict().items():
            assert torch.equal(state[name], t), name
        engine.model.save_pretrained(tmp_path / "again")
        again, _ = load_model(tmp_path / "again")
        for name, t in reference.state_dict().items():
            assert torch.equal(again.state_dict()[name], t), name
        with torch.inference_mode():  # (a plain tensor there too)
            assert torch.equal(held[panels[0]].weight.detach(),
                               dict(reference.named_modules())[panels[0]].weight)
        # the model's own forward on the caller's thread, outside the engine's steps
        assert tm.generate_greedy(engine.model, prompts[0], 6) == \
            tm.generate_greedy(reference, prompts[0], 6)
        with torch.no_grad(), pytest.raises(RuntimeError, match=WRITE_REFUSED[:40]):
            held[panels[0]].weight.mul_(2)
        again = engine.generate(prompts[:2], SamplingParams(max_new_tokens=12))
        assert [o.token_ids for o in again] == [o.token_ids for o in outs[:2]]


@pytest.mark.parametrize("read", ["narrow", "fp32"])
@pytest.mark.parametrize("greedy", [False, True], ids=["full-head", "greedy-screen"])
def test_a_tied_head_and_embedding_are_held_as_bf16_unless_the_greedy_screen_keeps_them(
        tmp_path, monkeypatch, greedy, read):
    """Read in fp32, a greedy screen that won its timing keeps the tied weight (its
    reference); read narrow, the weight is bf16 from the start and no screen is made over
    it (its rescoring would rebuild the whole weight)."""
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: greedy)
    if read == "fp32":
        monkeypatch.setattr(Engine, "_narrow_read", lambda self, *args: None)
    else:
        greedy = False
    model = tm.llama(tie_word_embeddings=True)
    model.tie_weights()
    path = _saved_bf16(tmp_path, lambda: model)
    reference, _ = load_model(path)
    prompts = tm.random_prompts(3, 3, 5, 12)
    with Engine(str(path)) as engine:
        emb, head = engine.model.get_input_embeddings(), engine.model.get_output_embeddings()
        assert head.weight is emb.weight and not isinstance(head.weight, PanelWeight)
        assert isinstance(emb.weight, NarrowWeight) is not greedy
        assert (engine.runner.head.greedy is not None) is greedy
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=10))
        assert torch.equal(emb.weight.detach(), reference.get_input_embeddings().weight)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == tm.generate_greedy(reference, prompt, 10)


def test_a_narrow_weight_gathers_bf16_rows_and_reads_as_the_weight():
    w = torch.randn(50, 12).bfloat16()
    narrow = NarrowWeight(w)
    wide = w.float()
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(F.embedding(ids, narrow), F.embedding(ids, wide))
    assert torch.equal(F.embedding(ids, narrow, padding_idx=7), F.embedding(ids, wide, 7))
    assert torch.equal(narrow.index_select(0, ids[0]), wide.index_select(0, ids[0]))
    assert torch.equal(narrow[ids[1]], wide[ids[1]]) and torch.equal(narrow * 2, wide * 2)
    x = torch.randn(2, 12)
    assert torch.equal(F.linear(x, narrow), F.linear(x, wide))
    with pytest.raises(RuntimeError, match="cannot be written or converted"):
        narrow.zero_()
    with pytest.raises(ValueError, match="bfloat16"):
        NarrowWeight(wide)


def test_a_model_the_caller_passes_in_is_never_changed(tmp_path):
    model, _ = load_model(_saved_bf16(tmp_path))
    weights = {n: m.weight for n, m in _linears(model).items()}
    with Engine(model) as engine:
        engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3))
    assert {n: m.weight for n, m in _linears(model).items()} == weights
    assert not any(isinstance(w, PanelWeight) for w in weights.values())


def test_an_fp32_checkpoint_keeps_its_weights(tmp_path):
    tm.llama().save_pretrained(tmp_path)
    with Engine(str(tmp_path)) as engine:
        assert not any(isinstance(m.weight, PanelWeight)
                       for m in _linears(engine.model).values())


def test_batch_invariant_mode_holds_them_too_with_the_same_logprobs(tmp_path):
    path = _saved_bf16(tmp_path)
    prompts = tm.random_prompts(5, 3, 4, 20)
    sampling = SamplingParams(max_new_tokens=8, logprobs=2)
    config = ContinuousBatchingConfig(batch_invariant=True)
    runs = []
    for load in (lambda: str(path), lambda: load_model(path)[0]):  # held, then kept
        with Engine(load(), config=config) as engine:
            held = any(isinstance(m.weight, PanelWeight)
                       for m in _linears(engine.model).values())
            outs = engine.generate(prompts, sampling)
        runs.append((held, [(o.token_ids, o.logprobs) for o in outs]))
    assert runs[0][0] and not runs[1][0]
    assert runs[0][1] == runs[1][1]


def test_what_a_user_does_with_the_held_model(tmp_path, monkeypatch):
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: False)
    path = _saved_bf16(tmp_path)
    reference, _ = load_model(path)
    with Engine(str(path)) as engine:
        model = engine.model
        name = "model.layers.0.self_attn.q_proj.weight"
        w = model.get_parameter(name)  # held weights count as parameters
        assert isinstance(w, PanelWeight) and isinstance(w, torch.nn.Parameter)
        want = reference.get_parameter(name)
        assert torch.equal(torch.from_numpy(w.numpy()), want) and w.tolist() == want.tolist()
        copied = copy.deepcopy(model)  # plain fp32 parameters, the caller's to change
        assert type(copied.get_parameter(name)) is torch.nn.Parameter
        assert torch.equal(copied.get_parameter(name), want)
        model.float()  # (nothing to convert)
        emb = model.get_input_embeddings().weight
        assert isinstance(emb, NarrowWeight)
        for write in (lambda: w.data.mul_(0), lambda: emb.data.zero_(),
                      lambda: setattr(w, "data", torch.zeros(w.shape)),
                      lambda: model.to(torch.bfloat16), lambda: model.half(),
                      lambda: model.share_memory()):
            with pytest.raises(RuntimeError, match="cannot be written or converted"):
                write()
        # a refused conversion changed nothing
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert copied.to(torch.bfloat16).dtype == torch.bfloat16  # the copy converts
        prompt = tm.random_prompts(2, 1, 5, 12)[0]
        out = engine.generate([prompt], SamplingParams(max_new_tokens=6))[0]
    assert out.token_ids == tm.generate_greedy(reference, prompt, 6)


def test_an_untied_embedding_is_narrowed_beside_a_greedy_screen(tmp_path, monkeypatch):
    monkeypatch.setattr(GreedyHead, "wins", lambda self, *a, **k: True)
    monkeypatch.setattr(Engine, "_narrow_read", lambda self, *args: None)  # (fp32 head)
    path = _saved_bf16(tmp_path)
    with Engine(str(path)) as engine:
        assert engine.runner.head.greedy is not None
        assert isinstance(engine.model.get_input_embeddings().weight, NarrowWeight)


def test_a_linear_on_rows_of_a_stacked_pack_with_biases_takes_its_own_bias_once():
    w = torch.randn(40, 33).bfloat16().float()
    b = torch.randn(40)
    stacked = f32_ops.pack_bf16_exact(w, b)  # (a group's pack holds the group's biases)
    rows = PanelWeight(stacked, 8, 30)
    x = torch.randn(2, 3, 33)
    with torch.inference_mode():
        got = F.linear(x, rows, b[8:30])
    torch.testing.assert_close(got, F.linear(x, w[8:30], b[8:30]), rtol=1e-5, atol=1e-5)


def test_f_linear_takes_its_keyword_arguments_on_a_held_weight():
    w = torch.randn(40, 33).bfloat16().float()
    rows = PanelWeight(f32_ops.pack_bf16_exact(w), 0, 40)
    x, b = torch.randn(3, 33), torch.randn(40)
    with torch.inference_mode():
        torch.testing.assert_close(F.linear(input=x, weight=rows), F.linear(x, w),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(F.linear(x, weight=rows, bias=b), F.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(F.linear(input=x, weight=rows, bias=b), F.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)


def test_the_narrow_read_keeps_no_view_of_the_checkpoint_and_guards_conversions(tmp_path):
    path = _saved_bf16(tmp_path, lambda: tm.llama(tie_word_embeddings=True))
    with Engine(str(path)) as engine:
        assert isinstance(engine.model.get_input_embeddings().weight, NarrowWeight)
        with open("/proc/self/maps") as maps:
            assert str(path) not in maps.read()  # overwriting the files changes nothing
        assert "_apply" in engine.model.__dict__
        with pytest.raises(RuntimeError, match="converting the model"):
            engine.model.half()
        assert all(p.dtype == torch.float32 for p in engine.model.parameters())
