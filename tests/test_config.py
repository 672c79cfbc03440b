"""ContinuousBatchingConfig: defaults, validation naming the field, transformers conversion."""

from __future__ import annotations

import copy
import math

import pytest
from ferrobatch import ContinuousBatchingConfig, defaults
from tiny_models import transformers_cb_config


def test_defaults_are_valid_and_bounded() -> None:
    cfg = ContinuousBatchingConfig()
    assert cfg.page_size >= 4
    assert cfg.num_blocks is None
    assert cfg.max_batch_tokens > 0 and cfg.max_requests_per_batch > 0
    assert cfg.scheduler_type == "fifo"
    assert cfg.resolved_safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler_type="prefill_first").resolved_safety_margin == 0.0
    # unset max_memory_percent: the engine's shares (`ferrobatch.defaults`)
    assert cfg.max_memory_percent is None
    assert defaults.CPU_MEMORY_PERCENT < 0.6  # never the reference's 60% of RAM
    assert defaults.CPU_MEMORY_CAP == 4 * 2**30
    assert defaults.CUDA_MEMORY_PERCENT == 0.9
    assert cfg.cpu_offload_space == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 3),
        ("page_size", 8.0),
        ("num_blocks", 0),
        ("max_batch_tokens", 0),
        ("max_requests_per_batch", -1),
        ("max_memory_percent", 0.0),
        ("max_memory_percent", 1.5),
        ("max_memory_percent", math.nan),
        ("scheduler_type", "lifo"),
        ("safety_margin", 1.0),
        ("safety_margin", -0.1),
        ("cpu_offload_space", -1.0),
        ("cpu_offload_space", math.inf),
        ("allow_block_sharing", "yes"),
        ("defer_shared_prefixes", 1),
        ("q_padding_interval_size", -4),
        ("use_cuda_graph", "auto"),
        ("batch_invariant", 1),
        ("batch_invariant", None),
        ("max_step_ms", -1.0),
        ("max_step_ms", math.inf),
        ("max_step_ms", "fast"),
    ],
)
def test_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ContinuousBatchingConfig(**{field: value})


def test_max_step_ms_default_and_off() -> None:
    assert ContinuousBatchingConfig().max_step_ms == defaults.MAX_STEP_MS
    assert ContinuousBatchingConfig(max_step_ms=0).max_step_ms is None  # the CLI's "off"
    assert ContinuousBatchingConfig(max_step_ms=None).max_step_ms is None
    assert ContinuousBatchingConfig(max_step_ms=120).max_step_ms == 120.0


def test_from_transformers_converts_without_mutating() -> None:
    tcfg = transformers_cb_config(
        page_size=64,
        num_blocks=100,
        max_batch_tokens=None,
        scheduler_type="prefill_first",
        allow_block_sharing=False,
        cpu_offload_space=0.5,
        use_cuda_graph=(False, True),
    )
    before = copy.deepcopy(vars(tcfg))
    cfg = ContinuousBatchingConfig.coerce(tcfg)
    assert vars(tcfg) == before
    assert cfg.page_size == 64 and cfg.num_blocks == 100
    assert cfg.max_batch_tokens == ContinuousBatchingConfig().max_batch_tokens
    assert cfg.scheduler_type == "prefill_first" and not cfg.allow_block_sharing
    assert cfg.cpu_offload_space == 0.5 and cfg.use_cuda_graph is True
    assert "default_compile_level" in cfg.extra


def test_from_transformers_validates() -> None:
    with pytest.raises(ValueError, match="page_size"):
        ContinuousBatchingConfig.from_transformers(transformers_cb_config(page_size=2))


def test_coerce_dict_and_bad_type() -> None:
    assert ContinuousBatchingConfig.coerce({"page_size": 16}).page_size == 16
    assert ContinuousBatchingConfig.coerce(None) == ContinuousBatchingConfig()
    with pytest.raises(TypeError):
        ContinuousBatchingConfig.coerce(42)
