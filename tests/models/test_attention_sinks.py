"""Greedy parity for two attention features beyond plain scaled dot-product attention:

* attention sinks (GPT-OSS `sinks`, passed to the attention function as `s_aux`): one learned
  logit per head in every query's softmax whose probability mass is dropped, on the
  sliding/full hybrid GPT-OSS with its MoE, sinks set to sizeable values as trained models
  have (the random init leaves them near 0, where ignoring them would hardly show);
* decoder layers that drop their **kwargs (Nemotron in transformers 5.24): the step metadata
  reaches the attention function through the runner's thread-local step instead.

Same models, scenarios and reference as tests/models/test_qa_architectures.py.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from ferrobatch.attention import context, paged_step, registry
from ferrobatch.model_config import model_configs
from test_qa_architectures import _build, assert_parity, prompts, reference

torch.set_num_threads(1)

GPT_OSS = (
    "GptOss",
    dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=16),
    (),
)
NEMOTRON = ("Nemotron", dict(head_dim=16, partial_rotary_factor=0.5), ())


@functools.cache
def gpt_oss(sink_values: tuple[float, ...]):
    m = _build(*GPT_OSS)
    with torch.no_grad():
        for layer in m.model.layers:
            heads = layer.self_attn.sinks.shape[0]
            vals = torch.tensor(sink_values).repeat(heads)[:heads]
            layer.self_attn.sinks.copy_(vals + 0.25 * layer.self_attn.layer_idx)
    return m


@functools.cache
def nemotron():
    return _build(*NEMOTRON)


def _parity(m, name: str) -> None:
    assert_parity(m, name, probe_below=1e-4)
    assert getattr(context.STATE, "step", None) is None


def test_gpt_oss_config_is_hybrid_moe() -> None:
    m = gpt_oss((3.0,))
    assert set(m.config.layer_types) == {"sliding_attention", "full_attention"}
    assert m.config.num_local_experts == 4
    assert all(float(layer.self_attn.sinks.detach().min()) >= 3.0 for layer in m.model.layers)


@pytest.mark.parametrize("sinks", [(3.0,), (3.0, -1.0, 5.0, 0.5)], ids=["3.0", "per_head"])
def test_gpt_oss_sinks_parity(sinks: tuple[float, ...]) -> None:
    _parity(gpt_oss(sinks), f"gpt_oss{sinks}")


def test_sinks_change_the_tokens() -> None:
    """The parity above means something: the sinks matter for these tokens."""
    p = prompts(1, 6)[5]
    assert reference(gpt_oss((3.0,)), p) != reference(gpt_oss((-30.0,)), p)


def test_sinks_refused_by_kernel_backends() -> None:
    from ferrobatch.runner.model_runner import ModelRunner

    with pytest.raises(NotImplementedError, match="sinks"):
        ModelRunner(gpt_oss((3.0,)), num_blocks=8, page_size=8, attention_backend="torch")


def test_nemotron_drops_kwargs_parity() -> None:
    _parity(nemotron(), "nemotron")


def test_thread_local_step_is_not_seen_by_other_threads() -> None:
    """Another thread using the model while this thread's ferrobatch forward has the config
    switched (and its step set) runs the model's own attention."""
    m = nemotron()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = m(input_ids=ids).logits
    got: list[torch.Tensor] = []

    def other() -> None:
        with torch.no_grad():
            got.append(m(input_ids=ids).logits)

    sentinel = paged_step.PagedStep(cache=None, groups=[], num_tokens=0)  # type: ignore[arg-type]
    with registry.paged_attention_enabled(model_configs(m), sentinel):
        assert context.STATE.step is sentinel
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert getattr(context.STATE, "step", None) is None
    assert sentinel.calls == 0
    torch.testing.assert_close(got[0], want)
