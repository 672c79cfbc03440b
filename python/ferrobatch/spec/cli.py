"""The ``--speculative-*`` flags of ``ferrobatch generate|serve|bench``."""

from __future__ import annotations

import argparse

from ferrobatch.errors import FieldError
from ferrobatch.spec.config import SpeculativeConfig

__all__ = ["add_spec_flags", "spec_config_from_args"]


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """Add the speculative-decoding flag group."""
    g = parser.add_argument_group("speculative decoding (SpeculativeConfig)")
    g.add_argument(
        "--speculative-method", choices=("ngram", "draft"), default=None,
        help="Propose tokens and verify them in one forward: ngram (prompt lookup in the "
        "request's own prompt and output) or draft (a smaller model sharing the tokenizer). "
        "Greedy output is unchanged; sampling keeps its distribution. Default: off.",
    )  # fmt: skip
    g.add_argument(
        "--num-speculative-tokens", type=int, default=None, metavar="K",
        help="Tokens proposed per step and request. Default: 4.",
    )  # fmt: skip
    g.add_argument(
        "--speculative-draft-model", default=None, metavar="PATH",
        help="The draft model (--speculative-method draft).",
    )  # fmt: skip
    g.add_argument("--prompt-lookup-min", type=int, default=None, metavar="N",
                   help="Smallest n-gram matched (ngram). Default: 1.")  # fmt: skip
    g.add_argument("--prompt-lookup-max", type=int, default=None, metavar="N",
                   help="Largest n-gram matched, tried first (ngram). Default: 3.")  # fmt: skip
    g.add_argument(
        "--speculative-max-tokens-per-step", type=int, default=None, metavar="N",
        help="No speculation in a step whose speculating rows * (1 + K) exceed N (large "
        "batches are compute-bound). Default: 40 (measured on CPU, benches/spec_decode.py).",
    )  # fmt: skip
    g.add_argument(
        "--speculative-min-acceptance", type=float, default=None, metavar="RATE",
        help="A request whose running acceptance rate falls below RATE pauses speculating "
        "(backoff). Default: 0.15.",
    )  # fmt: skip


_FIELDS = {
    "speculative_method": "method",
    "num_speculative_tokens": "num_speculative_tokens",
    "speculative_draft_model": "draft_model",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "speculative_max_tokens_per_step": "max_spec_tokens_per_step",
    "speculative_min_acceptance": "min_acceptance_rate",
}


def spec_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """A ``SpeculativeConfig`` from the flags (None without ``--speculative-method``; a
    FieldError names the field when a value is bad or a flag is given without the method)."""
    given = {f: getattr(args, a, None) for a, f in _FIELDS.items()}
    given = {k: v for k, v in given.items() if v is not None}
    if "method" not in given:
        if given:
            name = sorted(given)[0]
            raise FieldError(f"{name} needs --speculative-method", field=name)
        return None
    return SpeculativeConfig(**given)
