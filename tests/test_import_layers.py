"""The package's import layers, read from the source (ARCHITECTURE.md §5, "Layers").

A *room* is a top-level module or subpackage of ``ferrobatch`` (``ferrobatch`` itself is the
room of its ``__init__.py``, the public facade; ``_core`` is the compiled extension). Every
import counts, function-local ones too; only ``if TYPE_CHECKING:`` blocks are left out.

* The rooms' import graph has no cycle, and each room imports only rooms at or below it in
  `LAYERS`.
* A function-local import (anything imported inside a function) carries a one-line
  ``# local: <reason>`` comment: on the import itself, or on the line above it (or above the
  run of imports it belongs to). Module-level imports are the rule; a local one is worth it
  only for a heavy or optional dependency (fastapi / uvicorn, llguidance, triton, torch for
  the CLI's instant ``--help``).
"""

from __future__ import annotations

import ast
import itertools
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "ferrobatch"
ROOT = "ferrobatch"

# Bottom to top: a room may import rooms at or below its own place.
LAYERS = [
    "_core",
    "errors",
    "defaults",
    "config",
    "model_config",
    "model_dtype",
    "core",
    "cpu",
    "cuda",
    "gguf",
    "models",
    "lora",
    "attention",
    "sampling",
    "runner",
    "spec",
    "distributed",
    "engine",
    "metrics",
    "server",
    "workloads",
    ROOT,
    "cli",
    "demo",
]

# Function-local imports allowed without a `# local:` comment: (file, function) -> reason.
ALLOWED_LOCAL = {
    ("__init__.py", "__getattr__"): "the package's lazy attributes (PEP 562): `import "
    "ferrobatch` loads no torch",
}

# Rooms exempt from the `# local:` rule (none: every room follows it).
LOCAL_CHECK_PENDING: set[str] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str | None]]:
    """Every import outside `if TYPE_CHECKING:` blocks, with its enclosing function's name
    (None at module or class level)."""

    def walk(node: ast.AST, func: str | None) -> Iterator[tuple[ast.AST, str | None]]:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for stmt in child.orelse:  # `else:` of TYPE_CHECKING runs
                    yield from walk(stmt, func)
                continue
            inner = func
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = func or getattr(child, "name", "<lambda>")
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, func
            yield from walk(child, inner)

    yield from walk(tree, None)  # type: ignore[misc]


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The `ferrobatch` modules `node` imports (a name imported from a package counts as
    its submodule when there is one, else as the package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == ROOT]
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    if pkg.split(".")[0] != ROOT:
        return []
    out = []
    for alias in node.names:
        sub = f"{pkg}.{alias.name}"
        out.append(sub if sub in MODULES or alias.name == "_core" else pkg)
    return out


def _graph() -> dict[str, dict[str, list[str]]]:
    """room -> imported room -> the import sites ("file:line")."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, _ in _imports(tree):
            for target in _targets(module, path, node):
                a, b = _room(module), _room(target)
                if a != b:
                    edges[a][b].append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return edges


def _find_cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of rooms (first room repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(room: str) -> list[str] | None:
        state[room] = 1
        path.append(room)
        for nxt in sorted(edges.get(room, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[room] = 2
        return None

    for room in sorted(edges):
        if room not in state:
            found = visit(room)
            if found:
                return found
    return None


def test_no_import_cycle_between_rooms() -> None:
    edges = _graph()
    cycle = _find_cycle(edges)
    if cycle is not None:
        sites = "\n".join(
            f"  {a} -> {b}: {', '.join(edges[a][b][:3])}" for a, b in itertools.pairwise(cycle)
        )
        raise AssertionError(f"import cycle: {' -> '.join(cycle)}\n{sites}")


def test_every_room_has_a_layer() -> None:
    rooms = {_room(m) for m in MODULES} | {"_core"}  # _core: the compiled extension
    assert rooms - set(LAYERS) == set(), "place new rooms in LAYERS (and ARCHITECTURE.md §5)"
    assert set(LAYERS) - rooms == set(), "LAYERS names rooms that no longer exist"
    assert len(LAYERS) == len(set(LAYERS))


def test_rooms_import_only_downward() -> None:
    level = {room: i for i, room in enumerate(LAYERS)}
    bad = [
        f"  {a} -> {b}: {', '.join(sites[:3])}"
        for a, targets in sorted(_graph().items())
        for b, sites in sorted(targets.items())
        if level[b] > level[a]
    ]
    assert not bad, "imports of a room above (LAYERS, bottom to top):\n" + "\n".join(bad)


def _import_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _has_reason(lines: list[str], import_lines: set[int], node: ast.AST) -> bool:
    """A `# local:` comment on the import, or on the line above it or above its run of
    imports (blank lines between them allowed)."""
    end = node.end_lineno or node.lineno
    if any("# local:" in lines[n - 1] for n in range(node.lineno, end + 1)):
        return True
    n = node.lineno - 1
    while n >= 1 and (not lines[n - 1].strip() or n in import_lines):
        n -= 1
    return n >= 1 and lines[n - 1].strip().startswith("# local:")


def test_function_local_imports_say_why() -> None:
    missing = []
    for module, path in MODULES.items():
        if _room(module) in LOCAL_CHECK_PENDING:
            continue
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        lines = text.splitlines()
        import_lines = _import_lines(tree)
        rel = str(path.relative_to(PACKAGE))
        for node, func in _imports(tree):
            if func is None or (rel, func) in ALLOWED_LOCAL:
                continue
            if not _has_reason(lines, import_lines, node):
                missing.append(f"  {rel}:{node.lineno} ({func}): {ast.unparse(node)}")
    assert not missing, (
        "function-local imports without a `# local: <reason>` comment (import at module "
        "level unless a heavy or optional dependency makes it worth it):\n" + "\n".join(missing)
    )


def test_the_local_imports_keep_these_imports_light() -> None:
    """What the `# local:` reasons promise: `import ferrobatch` loads neither torch nor
    transformers, the CLI (for --help / --version) no torch, the server module no uvicorn."""
    code = (
        "import sys\n"
        "import ferrobatch\n"
        "a = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "import ferrobatch.cli\n"
        "b = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "import ferrobatch.server\n"
        "print(a, b, 'uvicorn' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(PACKAGE.parent), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "[]", "False"], out.stdout


def test_the_checks_see_what_they_check() -> None:
    """The graph is read from real source: known arrows are there, TYPE_CHECKING ones are
    not, and a planted cycle is found with its path."""
    edges = _graph()
    assert "distributed" in edges["engine"] and "spec" in edges["engine"]
    assert "engine" not in edges.get("spec", {})  # spec/draft.py: TYPE_CHECKING only
    planted = {"a": {"b": ["x:1"]}, "b": {"c": ["y:2"]}, "c": {"a": ["z:3"]}}
    assert _find_cycle(planted) == ["a", "b", "c", "a"]
