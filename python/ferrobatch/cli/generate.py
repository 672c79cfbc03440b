"""``ferrobatch generate``: prompts from flags or a JSONL file, written as text or JSONL."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from ferrobatch.cli.build import build_engine, build_sampling, check_readable, check_writable

__all__ = ["cmd_generate"]


def _read_prompt_file(path: Path) -> list[tuple[Any, str | list[dict[str, Any]]]]:
    """(kind, value) per line: ("text", str) or ("chat", messages)."""
    stream: IO[str]
    if str(path) == "-":
        stream = sys.stdin
        lines = stream.read().splitlines()
    else:
        lines = path.read_text(encoding="utf-8").splitlines()
    out: list[tuple[Any, Any]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"prompt", "messages"})
            if unknown or len(item) != 1:
                raise ValueError(
                    f"{path}:{lineno}: a line holds exactly one of \"prompt\" or "
                    f"\"messages\"{f', not {unknown}' if unknown else ''} (sampling comes "
                    "from the flags, for every line)")
        if isinstance(item, str):
            out.append(("text", item))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            out.append(("text", item["prompt"]))
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            out.append(("chat", item["messages"]))
        else:
            raise ValueError(
                f'{path}:{lineno}: expected a JSON string, {{"prompt": str}} or '
                '{"messages": [...]}'
            )
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for every prompt and write text or JSONL."""
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (it is the chat's system message)")
    items: list[tuple[str, Any]] = [("text", p) for p in args.prompt]
    if args.file is not None and str(args.file) != "-":
        check_readable(args.file, "--file")
    if args.output is not None:
        check_writable(args.output, "--output")
    if args.file is not None:
        items.extend(_read_prompt_file(args.file))
    if not items:
        raise ValueError("no prompts: give --prompt TEXT (repeatable) or --file PROMPTS.jsonl")
    sampling = build_sampling(args)
    engine = build_engine(args)
    try:
        prompts = []
        for i, (kind, value) in enumerate(items):
            try:
                prompts.append(engine.check_request(_encode_item(engine, kind, value, args),
                                                    sampling))
            except ValueError as exc:  # which prompt, then why
                raise ValueError(f"prompt {i} ({_where(args, i)}): {exc}") from None
        t0 = time.perf_counter()
        outputs = engine.generate(prompts, sampling, progress=not args.no_progress)
        elapsed = time.perf_counter() - t0
    finally:
        engine.close()
    out_stream: IO[str]
    with contextlib.ExitStack() as stack:
        if args.output is not None:
            out_stream = stack.enter_context(open(args.output, "w", encoding="utf-8"))
        else:
            out_stream = sys.stdout
        for i, ((kind, value), out) in enumerate(zip(items, outputs, strict=True)):
            if args.format == "jsonl":
                out_stream.write(_jsonl_record(i, kind, value, out) + "\n")
            else:
                out_stream.write(_text_block(i, kind, value, out, several=len(items) > 1))
    total = sum(len(o.token_ids) for o in outputs)
    if not args.no_progress:
        print(
            f"ferrobatch: {len(outputs)} prompts, {total} tokens in {elapsed:.2f} s "
            f"({total / max(elapsed, 1e-9):.1f} tok/s)",
            file=sys.stderr,
        )
    return 0


def _where(args: argparse.Namespace, index: int) -> str:
    """Where prompt `index` came from: its --prompt or its --file entry."""
    if index < len(args.prompt):
        return f"--prompt #{index + 1}"
    return f"--file entry {index - len(args.prompt) + 1}"


def _encode_item(engine: Any, kind: str, value: Any, args: argparse.Namespace) -> Any:
    """The prompt to generate for: chat messages (and --chat text) through the template."""
    if kind == "chat":
        return engine.encode_chat(value)
    if args.chat:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        msgs.append({"role": "user", "content": value})
        return engine.encode_chat(msgs)
    return value


def _jsonl_record(index: int, kind: str, value: Any, out: Any) -> str:
    """One output as a JSON line (without the newline)."""
    record: dict[str, Any] = {
        "index": index,
        ("messages" if kind == "chat" else "prompt"): value,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "token_ids": list(out.token_ids),
        "ttft_s": out.ttft,
    }
    if out.logprobs is not None:
        record["logprobs"] = [{str(k): v for k, v in d.items()} for d in out.logprobs]
    return json.dumps(record, ensure_ascii=False)


def _text_block(index: int, kind: str, value: Any, out: Any, *, several: bool) -> str:
    """One output as text; with several prompts, under a header and followed by a blank line."""
    if not several:
        return out.text + "\n"
    shown = value if kind == "text" else value[-1].get("content", "")
    shown = str(shown).replace("\n", " ")
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"=== [{index}] {shown}\n{out.text}\n\n"
