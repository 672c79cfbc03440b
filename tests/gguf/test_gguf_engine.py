"""GGUF models through the engine: greedy `Engine.generate` equal to the loaded model's own
`model.generate`, Llama-style layers run lean over the quantized products (and the packed
oneDNN linears left to plain `nn.Linear` layers), `Engine(dir)`, `chat`, tensor
parallelism refused, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.errors import FieldError
from ferrobatch.gguf import modules
from ferrobatch.gguf.modules import QuantLinear
from ferrobatch.runner import fused_layer, lean_layers, quant_linears
from ferrobatch.runner.direct_forward import DirectForward
from ferrobatch.runner.linear_policy import Backend
from gguf_files import reference_model

CONFIG = ContinuousBatchingConfig(num_blocks=64, page_size=16)
PROMPTS = [[3, 17, 99, 5, 200], [7, 8, 9, 11, 400, 12, 13, 14, 15, 16, 17, 18], [21]]


def _own_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _check_parity(engine: Engine, n: int = 10) -> None:
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=n), progress=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == _own_greedy(engine.model, prompt, n), prompt


#: architectures whose decoder layers the lean layers run (`lean_layers.LAYER_CLASSES`)
LEAN_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3")


@pytest.mark.parametrize(("arch", "qtype"), [
    ("llama", "Q4_K"), ("qwen2", "Q6_K"), ("qwen3", "Q4_0"), ("mistral", "Q8_0"),
    ("gemma2", "Q5_K"), ("gemma3", "Q4_1"), ("phi3", "Q4_K"), ("gpt2", "Q6_K"),
    ("qwen3", "Q5_0"), ("llama", "IQ4_NL"), ("gemma3", "Q5_1"),
    ("llama", "Q3_K"), ("qwen2", "Q2_K"), ("qwen3", "IQ4_XS"), ("gemma2", "Q3_K"),
    ("starcoder2", "Q5_K"), ("nemotron", "Q4_K"),
])
def test_greedy_equals_model_generate(gguf_file, arch: str, qtype: str) -> None:
    written, _ = gguf_file(arch, qtype)
    with Engine(str(written.path), config=CONFIG) as engine:
        assert isinstance(engine.model.get_output_embeddings(), QuantLinear)
        acts = engine.runner.activations
        # a fully quantized model: no plain nn.Linear for the packed linears; Llama-style
        # layers run lean over the quantized products, the others as the model's own
        assert acts.linears is None
        lean = arch in LEAN_ARCHS
        assert (acts.lean is not None) == lean and (acts.quant is not None) == lean
        assert engine.runner.head.greedy is None and not engine.runner.fast_greedy
        _check_parity(engine)


@pytest.mark.parametrize(("arch", "base"), [("qwen2", "Q4_K"), ("llama", "Q5_K")])
def test_k_m_mix_greedy_equals_the_dequantized_reference(k_m_file, arch: str,
                                                         base: str) -> None:
    """A Q4_K_M / Q5_K_M file whose hidden width is not whole 256-weight blocks (K-types,
    Q5_0 / Q5_1 and Q8_0 fallbacks): the engine runs it lean over the quantized products and
    its greedy tokens are those of the fp32 model of the file's dequantized values."""
    written, source = k_m_file(arch, base)
    reference = reference_model(source, written)
    with Engine(str(written.path), config=CONFIG) as engine:
        acts = engine.runner.activations
        assert acts.linears is None and acts.lean is not None and acts.quant is not None
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10), progress=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == _own_greedy(reference, prompt, 10), prompt


@pytest.mark.kernel_products
def test_k_m_mix_on_the_kernels_is_batch_independent(k_m_file) -> None:
    """The same mix on the quantized kernels: each request's tokens alone and batched are
    the same, its first token the model's own greedy token on those kernels."""
    written, _ = k_m_file("qwen2", "Q4_K")
    params = SamplingParams(max_new_tokens=8)
    with Engine(str(written.path), config=CONFIG) as engine:
        assert modules.kernel_ops() is not None
        together = engine.generate(PROMPTS, params, progress=False)
        for prompt, out in zip(PROMPTS, together, strict=True):
            alone = engine.generate([prompt], params, progress=False)[0]
            assert out.token_ids == alone.token_ids, prompt
            assert out.token_ids[0] == _own_greedy(engine.model, prompt, 1)[0], prompt


def _count_calls(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    """Count calls of `cls.name` (wrapped, still called)."""
    calls = [0]
    own = getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return own(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.kernel_products
@pytest.mark.parametrize(("arch", "qtype"), [("qwen2", "Q4_K"), ("llama", "Q6_K")])
def test_quantized_steps_take_the_lean_path(gguf_file, monkeypatch, arch: str,
                                            qtype: str) -> None:
    """On the kernels, a GGUF model's steps run its decoder layers lean: every layer's
    products are stacked `QuantProduct`s (q/k/v and gate/up one call each), a decode step's
    layers one call of `_core.LeanLayer` each, the model's own decoder layer forward and its
    `QuantLinear` layers' forwards never run inside a step but for the head; with the path
    turned off (`FERROBATCH_QUANT_LEAN=0`) the same tokens come from the model's own
    layers."""
    written, _ = gguf_file(arch, qtype)
    params = SamplingParams(max_new_tokens=6)
    # (the stack run directly would bypass the layers' calls counted here)
    monkeypatch.setattr(DirectForward, "ENABLED", False)
    with Engine(str(written.path), config=CONFIG) as engine:
        quant = engine.runner.activations.quant
        assert engine.runner.activations.lean is not None and quant is not None
        layers = engine.runner.activations.lean.num_layers
        assert quant.num_groups == 2 * layers  # q/k/v and gate/up of every layer
        lean_calls, one_calls = [0], [0]
        lean_forward = lean_layers._lean_forward
        one_call = fused_layer.FusedLayer.forward

        def counted_lean(*args, **kwargs):
            lean_calls[0] += 1
            return lean_forward(*args, **kwargs)

        def counted_one_call(*args, **kwargs):
            ran = one_call(*args, **kwargs)
            one_calls[0] += ran is Backend.QUANT_OPS
            return ran

        monkeypatch.setattr(lean_layers, "_lean_forward", counted_lean)
        monkeypatch.setattr(fused_layer.FusedLayer, "forward", counted_one_call)
        own_linear = _count_calls(monkeypatch, QuantLinear, "forward")
        products = _count_calls(monkeypatch, quant_linears.QuantProduct, "__call__")
        buffers: list[int] = []  # where each lean layer's gate/up output went
        gate_up_buffer = lean_layers.LeanLayers._gate_up_buffer

        def recorded(self, product, rows):
            out = gate_up_buffer(self, product, rows)
            buffers.append(out.untyped_storage().data_ptr())
            return out

        monkeypatch.setattr(lean_layers.LeanLayers, "_gate_up_buffer", recorded)
        fast = engine.generate(PROMPTS, params, progress=False)
        forwards = (lean_calls[0] + one_calls[0]) // layers
        assert lean_calls[0] > 0 and one_calls[0] > 0  # the prefill lean, decode steps one call
        assert lean_calls[0] + one_calls[0] == forwards * layers
        assert products[0] == 4 * lean_calls[0]  # q/k/v, o, gate/up, down
        assert own_linear[0] == forwards  # only the head, once a forward
        # one gate/up buffer for all the layers of a forward, dropped when it ends
        assert len(buffers) == lean_calls[0]
        assert all(len(set(buffers[i:i + layers])) == 1 for i in range(0, len(buffers), layers))
        assert engine.runner.activations.lean._gate_up_out is None
    monkeypatch.setenv("FERROBATCH_QUANT_LEAN", "0")
    with Engine(str(written.path), config=CONFIG) as engine:
        assert engine.runner.activations.lean is None
        assert engine.runner.activations.quant is None
        slow = engine.generate(PROMPTS, params, progress=False)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]


def test_mixed_model_packs_only_plain_linears(gguf_file) -> None:
    """Float matrices next to quantized ones: the packed linears take exactly the plain
    `nn.Linear` layers, the lean layers step aside, the output equals `model.generate`."""
    written, _ = gguf_file("llama", "Q4_0", output_qtype="F32", embed_qtype="F16",
                           types={"blk.0.attn_q.weight": "F32", "blk.1.ffn_up.weight": "F16"})
    with Engine(written.path, config=CONFIG) as engine:
        linears = engine.runner.activations.linears
        plain = [m for m in engine.model.modules() if type(m) is torch.nn.Linear]
        assert linears is not None and linears.num_layers == len(plain) == 3
        assert engine.runner.activations.lean is None
        _check_parity(engine)


def test_q3_k_m_like_mix_equals_the_dequantized_reference(gguf_file) -> None:
    """A `Q3_K_M`-like file (Q3_K matrices, Q5_K / Q4_K value and down projections, a Q6_K
    output head): lean over the quantized products (q/k/v stacks of mixed types), greedy
    tokens equal to the dequantized fp32 reference's."""
    types = {"blk.0.attn_v.weight": "Q5_K", "blk.1.attn_v.weight": "Q4_K",
             "blk.0.ffn_down.weight": "Q5_K", "blk.1.ffn_down.weight": "Q4_K"}
    written, source = gguf_file("llama", "Q3_K", output_qtype="Q6_K", types=types)
    assert {written.types[g] for g in types} == {"Q5_K", "Q4_K"}
    assert written.types["output.weight"] == "Q6_K"
    assert written.types["blk.0.attn_q.weight"] == "Q3_K"
    n = 8
    reference = reference_model(source, written)
    with Engine(str(written.path), config=CONFIG) as engine:
        assert engine.runner.activations.lean is not None
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=n), progress=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == _own_greedy(reference, prompt, n), prompt


def test_directory_and_chat(gguf_file) -> None:
    written, _ = gguf_file("llama", "Q4_K", tokenizer=True)
    with Engine(written.path.parent, config=CONFIG) as engine:
        assert engine.tokenizer is not None and 2 in engine.eos_token_ids
        msgs = [{"role": "user", "content": "the"}]
        ids = engine.encode_chat(msgs)
        assert engine.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
        out = engine.chat(msgs, SamplingParams(max_new_tokens=6), progress=False)[0]
        ref = _own_greedy(engine.model, ids, 6)
        cut = ref.index(2) + 1 if 2 in ref else len(ref)
        assert out.token_ids == ref[:cut]


def test_tensor_parallel_refused_off_block_boundaries(gguf_file) -> None:
    """Two query heads of 64 per rank would cut o_proj's Q4_K rows inside a 256-weight
    block: refused before any rank starts (tensor parallelism: tests/distributed)."""
    written, _ = gguf_file("llama", "Q4_K")
    with pytest.raises(FieldError, match=r"o_proj \(Q4_K\).*input column 128") as err:
        Engine(written.path, tensor_parallel_size=2)
    assert err.value.field == "tensor_parallel_size"


def test_cli_generate(gguf_file, capsys: pytest.CaptureFixture[str]) -> None:
    from ferrobatch import cli

    written, _ = gguf_file("llama", "Q4_K", tokenizer=True)
    rc = cli.main(["generate", str(written.path), "--prompt", "the the", "--format", "jsonl",
                   "--max-new-tokens", "5", "--num-blocks", "64", "--page-size", "16",
                   "--no-progress"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    with Engine(written.path, config=CONFIG) as engine:
        ref = engine.generate(["the the"], SamplingParams(max_new_tokens=5), progress=False)[0]
    assert record["text"] == ref.text


@pytest.mark.kernel_products
@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q4_K"), ("qwen2", "Q6_K"),
                                             ("qwen3", "Q8_0"), ("qwen2", "IQ4_NL"),
                                             ("llama", "Q5_1"), ("llama", "Q3_K"),
                                             ("qwen2", "Q2_K"), ("qwen3", "IQ4_XS")])
def test_kernel_products_are_batch_independent(gguf_file, arch: str, qtype: str) -> None:
    """On the quantized kernels every request's tokens are the same alone and batched
    (each row's products depend on that row only), and its first token is the model's own
    greedy token on the same kernels."""
    written, _ = gguf_file(arch, qtype)
    params = SamplingParams(max_new_tokens=8)
    with Engine(str(written.path), config=CONFIG) as engine:
        assert modules.kernel_ops() is not None and modules.get_backend() == "auto"
        together = engine.generate(PROMPTS, params, progress=False)
        for prompt, out in zip(PROMPTS, together, strict=True):
            alone = engine.generate([prompt], params, progress=False)[0]
            assert out.token_ids == alone.token_ids, prompt
            assert out.token_ids[0] == _own_greedy(engine.model, prompt, 1)[0], prompt
