"""The core's layers point one way: a reader can go bottom-up, errors -> math, host arrays ->
layout -> packed blocks, token join/split, spec -> methods -> registry -> torch_ops (the ``kvq::``
ops) -> api, validate -> integrations -> tools, and no module imports one above it (in-function imports
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
    "kvq_core.contract": 3,
    "kvq_core.hookspecs": 3,
    "kvq_core.methods": 4,
    "kvq_core.constants": 4,
    "kvq_core.window_plan": 4,  # blocks checked once for many fused window calls
    "kvq_core.registry": 5,
    "kvq_core.torch_ops": 6,  # the kvq:: ops a Quantizer on a torch_ops backend calls
    "kvq_core.validate": 7,
    "kvq_core.api": 7,
    "kvq_core": 8,  # library modules above the API: paged (serving engines), training, plan, testing
    "kvq_core.integrations": 9,  # hf (transformers), onnx
    "kvq_core.tools": 10,  # on top: what the ``kvq`` command runs (bench, eval, tune, warmup, demo, cli)
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


#: another library's underscored attributes that are its documented switch, with why kvq may set them
FOREIGN_SWITCHES = {
    "_attn_implementation": "transformers' attention implementation: a PretrainedConfig property whose setter "
                            "also sets the sub-configs, read by the model's attention modules at every call",
}


def _private_writes(tree: ast.AST) -> list[str]:
    """Assignments (``=``, ``+=``, annotated, ``del``, ``setattr``) to a private attribute of an
    object other than ``self``/``cls``, e.g. ``layer._x = ...`` or ``layer._x[i] = ...``."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in FOREIGN_SWITCHES

    def foreign(node: ast.AST) -> bool:
        return not (isinstance(node, ast.Name) and node.id in ("self", "cls"))

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, (ast.Assign, ast.Delete)):
            return node.targets
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    def flat(t: ast.AST):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from flat(e)
        elif isinstance(t, ast.Starred):
            yield from flat(t.value)
        else:
            yield t

    out = []
    for node in ast.walk(tree):
        for t in (x for target in targets(node) for x in flat(target)):
            cur = t
            while isinstance(cur, (ast.Attribute, ast.Subscript)):
                if isinstance(cur, ast.Attribute) and private(cur.attr) and foreign(cur.value):
                    out.append((node.lineno, ast.unparse(t)))
                    break
                cur = cur.value
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and private(node.args[1].value) and foreign(node.args[0])):
            out.append((node.lineno, ast.unparse(node)))
    return [f"line {line}: {what}" for line, what in sorted(out)]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(CORE)))
def test_no_module_writes_another_objects_private_attributes(path: Path) -> None:
    """A class's private state changes only through its own methods: a module writes the
    private attributes of ``self``/``cls`` only, never another object's (use a public method)."""
    bad = _private_writes(ast.parse(path.read_text()))
    assert not bad, f"{_module_name(path)} writes private attributes of other objects: {bad}"


def test_the_private_write_check_sees_writes() -> None:
    src = "layer._a = 1\nlayer._b += 1\nlayer._c[0] = 1\nx.y._d: int = 1\ndel x._e\nsetattr(o, '_f', 1)\n" \
          "self._ok = 1\ncls._ok = 1\nfn.__doc__ = ''\nlayer.public = 1\nself.x._g = 1\n"
    found = _private_writes(ast.parse(src))
    assert [f.split(": ")[1] for f in found] == ["layer._a", "layer._b", "layer._c[0]", "x.y._d", "x._e",
                                                 "setattr(o, '_f', 1)", "self.x._g"]
