"""`--speculative-*` flags and the speculative-decoding metrics."""

from __future__ import annotations

import pytest
from ferrobatch.cli.flags import build_parser
from ferrobatch.errors import FieldError
from ferrobatch.metrics import ServerMetrics
from ferrobatch.spec.cli import spec_config_from_args


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_flags_build_the_config(command) -> None:
    p = build_parser()
    args = p.parse_args([command, "--speculative-method", "ngram", "--num-speculative-tokens",
                         "3", "--prompt-lookup-max", "5", "--speculative-min-acceptance",
                         "0.3"])  # fmt: skip
    cfg = spec_config_from_args(args)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 3, 5)
    assert cfg.min_acceptance_rate == 0.3
    assert spec_config_from_args(p.parse_args([command])) is None
    with pytest.raises(FieldError) as e:
        spec_config_from_args(p.parse_args([command, "--num-speculative-tokens", "2"]))
    assert e.value.field == "num_speculative_tokens"
    with pytest.raises(FieldError) as e:
        spec_config_from_args(p.parse_args([command, "--speculative-method", "draft"]))
    assert e.value.field == "draft_model"
    args = p.parse_args([command, "--speculative-method", "draft",
                         "--speculative-draft-model", "/x"])  # fmt: skip
    assert spec_config_from_args(args).draft_model == "/x"


def test_metrics_export_acceptance() -> None:
    text = ServerMetrics().render({"spec_acceptance_rate": 0.5, "spec_tokens_per_step": 2.5})
    assert "ferrobatch_spec_decode_acceptance_rate 0.5" in text
    assert "ferrobatch_spec_decode_tokens_per_step 2.5" in text
