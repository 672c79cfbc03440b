"""The one adapter around oneDNN's private packed-linear ops (`ferrobatch.cpu.onednn`): the
products it runs, the clear error naming the op and the torch version when an op is missing
or takes other arguments, and the callers' fall back then."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F
from ferrobatch.cpu import onednn
from ferrobatch.runner import linear_policy
from ferrobatch.runner.cpu_linear import PackedLinears
from ferrobatch.runner.greedy_head import GreedyHead
from ferrobatch.runner.model_runner import ModelRunner
from ref_planner import RefPlanner

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="no oneDNN packed linears")


@pytest.fixture
def stand_in(monkeypatch):
    """Replace `torch.ops.mkldnn` as the adapter sees it (`set(**ops)`), checks forgotten
    before and after (and the policy's detection, which asked the adapter)."""

    def forget() -> None:
        onednn.reset()
        linear_policy.Isa.detect.__func__.cache_clear()
        linear_policy.fp32_from_rows.cache_clear()

    def set_ops(**ops) -> None:
        monkeypatch.setattr(onednn, "_namespace", lambda: SimpleNamespace(**ops))
        forget()

    yield set_ops
    monkeypatch.undo()
    forget()


class _Arg:
    """A schema argument as torch's `FunctionSchema.arguments` lists them."""

    def __init__(self, name: str, type_: str, default: bool = False) -> None:
        self.name, self.type, self._default = name, type_, default

    def has_default_value(self) -> bool:
        return self._default


def _op(*args: _Arg) -> SimpleNamespace:
    return SimpleNamespace(default=SimpleNamespace(_schema=SimpleNamespace(arguments=args)))


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_and_linear_are_the_product(dtype):
    if not onednn.packing_available(dtype):
        pytest.skip(f"oneDNN does not run {dtype} weights here")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(5, 24, generator=gen).to(dtype)
    got = onednn.linear(x, onednn.pack(w), b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()),
                               rtol=tol, atol=tol)
    assert onednn.check() is None and onednn.unavailable_reason() is None


@needs_onednn
def test_a_missing_op_is_reported_with_its_name_and_the_torch_version(stand_in):
    stand_in(_reorder_linear_weight=torch.ops.mkldnn._reorder_linear_weight)
    assert not onednn.available()
    reason = onednn.unavailable_reason()
    assert "torch.ops.mkldnn._linear_pointwise" in reason and torch.__version__ in reason
    with pytest.raises(onednn.OneDNNUnavailable, match="_linear_pointwise") as err:
        onednn.pack(torch.ones(4, 4))
    assert torch.__version__ in str(err.value)
    with pytest.raises(onednn.OneDNNUnavailable):
        onednn.linear(torch.ones(1, 4), torch.ones(4, 4))
    assert not onednn.packing_available(torch.float32)


@needs_onednn
def test_an_op_with_other_arguments_is_reported(stand_in):
    stand_in(
        _reorder_linear_weight=torch.ops.mkldnn._reorder_linear_weight,
        _linear_pointwise=_op(_Arg("X", "Tensor"), _Arg("W", "Tensor"),
                              _Arg("B", "Optional[Tensor]"), _Arg("attr", "str"),
                              _Arg("scalars", "List[Optional[number]]"),
                              _Arg("algorithm", "Optional[str]"), _Arg("new", "int")),
    )
    reason = onednn.unavailable_reason()
    assert reason is not None and "torch.ops.mkldnn._linear_pointwise takes (" in reason
    assert torch.__version__ in reason
    # a further argument with a default is accepted (ferrobatch does not pass it)
    stand_in(
        _reorder_linear_weight=_op(_Arg("self", "Tensor"), _Arg("batch_size", "Optional[int]"),
                                   _Arg("extra", "bool", default=True)),
        _linear_pointwise=torch.ops.mkldnn._linear_pointwise,
    )
    assert onednn.available()
    # a different type is not
    stand_in(_reorder_linear_weight=_op(_Arg("self", "Tensor"), _Arg("batch_size", "str")),
             _linear_pointwise=torch.ops.mkldnn._linear_pointwise)
    assert "_reorder_linear_weight takes (Tensor, str)" in onednn.unavailable_reason()


@needs_onednn
def test_without_the_ops_the_callers_fall_back(stand_in):
    """No packed linears, lean layers, packed head or greedy screen: the runner still gives
    the model's logits."""
    stand_in()
    model = tm.llama()
    assert PackedLinears.of(model, in_thread=lambda: True, dtypes=(torch.float32,)) is None
    assert not GreedyHead.supported(model.lm_head.weight)
    runner = ModelRunner(model, num_blocks=32, page_size=4)
    assert runner.activations.linears is None and runner.activations.lean is None
    assert runner.head.backend is not linear_policy.Backend.ONEDNN
    assert runner.head.greedy is None and not runner.fast_greedy
    planner = RefPlanner(page_size=4, num_blocks=32, layer_types=runner.layer_types,
                         sliding_window=runner.sliding_window)
    prompt = [5, 6, 7, 8, 9]
    planner.add("a", prompt)
    got = runner.execute(planner.plan([("a", len(prompt))]))
    with torch.inference_mode():
        want = model(torch.tensor([prompt])).logits[0, -1:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    runner.close()
