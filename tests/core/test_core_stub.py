"""The stub `python/ferrobatch/_core.pyi` and the compiled `ferrobatch._core` agree: the same
public names, the same members per class (properties as properties, methods as methods), the
same parameters, and a docstring on everything the stub declares."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

_core = pytest.importorskip("ferrobatch._core")

STUB = Path(__file__).resolve().parents[2] / "python" / "ferrobatch" / "_core.pyi"
# Runtime dunders a stub must declare when the class defines them (protocols, construction);
# `__repr__` and the like are typed by `object` already.
PROTOCOL_DUNDERS = {"__new__", "__len__", "__getitem__", "__iter__", "__next__", "__contains__"}


def public(name: str) -> bool:
    """Names the stub must mirror: non-underscore names and `__version__` (`_`-prefixed stub
    names are typing-only aliases)."""
    return not name.startswith("_") or name == "__version__"


def stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def stub_top_level() -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in stub_tree().body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return {k: v for k, v in out.items() if public(k)}


def is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def stub_members(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def runtime_members(cls: type) -> dict[str, object]:
    out = {}
    for name, value in vars(cls).items():
        if name.startswith("__") and name.endswith("__"):
            if name in PROTOCOL_DUNDERS:
                out[name] = value
        elif public(name):
            out[name] = value
    return out


def stub_params(fn: ast.FunctionDef) -> list[tuple[str, str, bool]]:
    """(name, kind, has default) per parameter after self / cls."""
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [False] * (len(pos) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(p.arg, "positional", d) for p, d in zip(pos, defaults, strict=True)]
    out += [(p.arg, "keyword", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults,
                                                              strict=True)]
    if out and out[0][0] in ("self", "cls"):
        out = out[1:]
    return out


def runtime_params(obj: object) -> list[tuple[str, str, bool]]:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
    }
    sig = inspect.signature(obj)
    out = [(p.name, kinds[p.kind], p.default is not inspect.Parameter.empty)
           for p in sig.parameters.values()]
    if out and out[0][0] in ("self", "cls", "$self"):
        out = out[1:]
    return out


def test_stub_and_typed_marker_exist():
    assert STUB.is_file()
    assert (STUB.parent / "py.typed").is_file()


def test_same_public_names():
    stub = set(stub_top_level())
    runtime = {n for n in dir(_core) if public(n)}
    assert stub - runtime == set(), "in the stub but not in ferrobatch._core"
    assert runtime - stub == set(), "in ferrobatch._core but not in the stub"


def test_kinds_of_top_level_names():
    for name, node in stub_top_level().items():
        obj = getattr(_core, name)
        if isinstance(node, ast.ClassDef):
            assert isinstance(obj, type), name
        elif isinstance(node, ast.FunctionDef):
            assert callable(obj) and not isinstance(obj, type), name
        else:
            assert not callable(obj), name
            ann = ast.unparse(node.annotation)
            assert type(obj).__name__ == ann, f"{name}: stub says {ann}, runtime {type(obj)}"


@pytest.mark.parametrize("cls_name", sorted(
    n for n, v in stub_top_level().items() if isinstance(v, ast.ClassDef)))
def test_class_members(cls_name):
    cls = getattr(_core, cls_name)
    stub = stub_members(stub_top_level()[cls_name])
    runtime = runtime_members(cls)
    assert set(stub) - set(runtime) == set(), f"{cls_name}: in the stub only"
    assert set(runtime) - set(stub) == set(), f"{cls_name}: in ferrobatch._core only"
    for name, fn in stub.items():
        value = inspect.getattr_static(cls, name)
        runtime_is_property = inspect.isdatadescriptor(value)
        assert is_property(fn) == runtime_is_property, (
            f"{cls_name}.{name}: stub property={is_property(fn)}, runtime={runtime_is_property}")


def methods_with_signatures():
    for name, node in stub_top_level().items():
        if isinstance(node, ast.FunctionDef):
            yield name, node, getattr(_core, name)
        elif isinstance(node, ast.ClassDef):
            cls = getattr(_core, name)
            for m, fn in stub_members(node).items():
                if is_property(fn) or (m.startswith("__") and m != "__new__"):
                    continue
                yield f"{name}.{m}", fn, cls if m == "__new__" else getattr(cls, m)


@pytest.mark.parametrize("name,fn,obj", [pytest.param(*m, id=m[0])
                                          for m in methods_with_signatures()])
def test_parameters(name, fn, obj):
    assert stub_params(fn) == runtime_params(obj), name


def test_everything_has_a_docstring():
    tree = stub_tree()
    assert ast.get_docstring(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            assert ast.get_docstring(node), f"{node.name} has no docstring in the stub"
