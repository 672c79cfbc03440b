"""The ``ferrobatch`` command: ``serve``, ``generate`` and ``bench``.

    ferrobatch serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY]
    ferrobatch generate [MODEL] --prompt "The capital of France is" --max-new-tokens 16
    ferrobatch generate [MODEL] --file prompts.jsonl --format jsonl > out.jsonl
    ferrobatch bench [MODEL]

MODEL is a local checkpoint directory; without it, the bundled SmolLM2-135M-Instruct. The
cache and scheduler flags map one-to-one onto ``ContinuousBatchingConfig`` fields; a flag
left out keeps the field's default.

Modules: ``flags`` (the parser), ``build`` (config, engine and sampling from flags), one
module per command (``serve``, ``generate``, ``bench``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from ferrobatch import __version__
from ferrobatch.cli.bench import cmd_bench, format_table
from ferrobatch.cli.build import build_config, build_engine, build_sampling
from ferrobatch.cli.flags import CONFIG_FLAGS, SAMPLING_FLAGS, build_parser
from ferrobatch.cli.generate import cmd_generate
from ferrobatch.cli.serve import cmd_serve

__all__ = [
    "CONFIG_FLAGS",
    "SAMPLING_FLAGS",
    "build_config",
    "build_engine",
    "build_parser",
    "build_sampling",
    "format_table",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ferrobatch`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"ferrobatch {__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    commands = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench}
    try:
        return commands[args.command](args)
    except ValueError as exc:  # bad flag values, prompt files, sampling parameters
        print(f"ferrobatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head -1`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (nothing more to flush at exit)
        return 141
    except OSError as exc:  # a checkpoint that can't be read, an output that can't be written
        print(f"ferrobatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
