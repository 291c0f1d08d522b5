"""The core's layers point one way: a reader can go bottom-up, errors -> math, host arrays ->
layout -> packed blocks, token join/split, spec -> methods -> registry -> dispatch (the ``kvq::``
ops) -> api, validate -> integrations, and no module imports one above it (in-function imports
included; type-only imports under ``if TYPE_CHECKING`` are exempt)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "kvq_core"

#: module-name prefix -> rank (longest prefix wins); a module may import only ranks <= its own.
RANKS = {
    "kvq_core.errors": 0,
    "kvq_core.math": 1,
    "kvq_core.host_arrays": 1,
    "kvq_core.layout": 2,
    "kvq_core.packed": 3,
    "kvq_core.tokens": 3,
    "kvq_core.spec": 3,
    "kvq_core.kernels": 3,
    "kvq_core.hookspecs": 3,
    "kvq_core.methods": 4,
    "kvq_core.constants": 4,
    "kvq_core.registry": 5,
    "kvq_core.dispatch": 6,  # the kvq:: ops a Quantizer on a torch_ops backend calls
    "kvq_core.validate": 7,
    "kvq_core.api": 7,
    "kvq_core": 8,  # integrations: hf, eval, bench, testing, cli, demo, metrics, ...
}


def _rank(module: str) -> int:
    best = max((p for p in RANKS if module == p or module.startswith(p + ".")), key=len)
    return RANKS[best]


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every kvq_core import outside ``if TYPE_CHECKING:`` blocks."""
    out = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kvq_core":
                out.extend((node.lineno, f"kvq_core.{a.name}") for a in node.names)
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(line, m) for line, m in out if m == "kvq_core" or m.startswith("kvq_core.")]


MODULES = sorted(p for p in CORE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(CORE)))
def test_no_upward_imports(path: Path) -> None:
    me = _module_name(path)
    if me == "kvq_core":  # the package's front door re-exports from every layer
        return
    bad = [f"line {line}: {m} (rank {_rank(m)})" for line, m in _imports(ast.parse(path.read_text()))
           if m != "kvq_core" and _rank(m) > _rank(me)]
    assert not bad, f"{me} (rank {_rank(me)}) imports upward: {bad}"


def test_backends_use_no_private_core_names() -> None:
    backends = CORE.parent / "backends"
    offenders = []
    for path in backends.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvq_core"):
                offenders += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not offenders, offenders
