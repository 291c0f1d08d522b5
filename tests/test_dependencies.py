"""Every third-party import of kvq's own code is declared in pyproject.toml.

A fresh ``pip install kvq-core`` (or ``kvq-core[extra]``) must not hit an undeclared import: one in a
method module emptied every backend. The sources of ``kvq_core`` and ``backends/`` are parsed
(not imported, so a missing package cannot hide a module), every absolute import is collected
(also those inside functions), module names are mapped to distributions, and each module may
use only the core requirements plus the extras :data:`EXTRAS_BY_PREFIX` allows for it.
An import guarded by ``try: ... except ImportError:`` whose handler does not re-raise is an
optional dependency (the module works without it) and is allowed anywhere.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT / "kvq_core", ROOT / "backends")

#: Module path prefix (relative to the repo root, "/"-separated) -> the extras a user installs
#: to use it. The longest matching prefix wins; ``kvq_core`` alone means the core requirements
#: only (numpy, pluggy). A backend package ``backends/kvq_<name>`` not listed here may use the
#: extra ``<name>`` when pyproject declares one (so a new backend needs no entry here).
EXTRAS_BY_PREFIX: dict[str, tuple[str, ...]] = {
    "kvq_core": (),
    "kvq_core/integrations/hf": ("hf", "torch"),
    "kvq_core/tools/eval": ("hf", "torch"),
    "kvq_core/tools/eval/caches.py": ("hf", "torch", "bench"),  # + the PyPI turboquant cache `kvq bench decode` compares
    "kvq_core/tools/bench": ("bench", "torch"),
    "kvq_core/tools/bench/decode.py": ("bench", "hf", "torch"),  # decodes SmolLM2 through transformers caches
    "kvq_core/testing": ("dev",),
    "kvq_core/tools/warmup.py": ("hf", "torch"),  # --model reads the model's transformers config
    "kvq_core/training.py": ("torch",),  # fake-quantized attention for training: torch tensors and autograd
    "kvq_core/tools/tune.py": ("hf", "torch"),  # kvq tune: a transformers model, its gradients, tqdm bars
    "kvq_core/testing/paged.py": ("dev", "torch"),  # kvq::attend_paged cases are torch tensors
    "kvq_core/torch_ops": ("torch",),  # the kvq:: op dispatch for torch-tensor backends (main's restructure)
    "backends/kvq_numpy": (),
    "backends/kvq_torch": ("torch",),
    "backends/kvq_triton": ("triton", "torch"),
    "backends/kvq_numba": ("numba",),
    "backends/kvq_numba/paged.py": ("numba", "torch"),  # kvq::attend_paged (a torch op) on the numba kernels
    "backends/kvq_numba/paged_write.py": ("numba", "torch"),  # kvq::write_paged (a torch op) on the numba kernels
    "kvq_core/integrations/onnx": ("onnx", "torch"),
}

#: Import names whose distribution is named differently, for packages not installed here
#: (installed ones are looked up with importlib.metadata.packages_distributions()).
DIST_ALIASES = {"sklearn": "scikit-learn", "yaml": "PyYAML", "PIL": "Pillow", "cv2": "opencv-python",
                "google": "protobuf", "numba_cuda": "numba-cuda"}


def _norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(core distributions, extra -> distributions) from pyproject.toml; self-references
    such as ``kvq-core[torch,...]`` are expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    raw = project.get("optional-dependencies", {})
    extras: dict[str, set[str]] = {}
    for extra, reqs in raw.items():
        names: set[str] = set()
        for req in reqs:
            m = re.match(rf"\s*{re.escape(project['name'])}\[([^\]]*)\]", req)
            if m:
                for sub in m.group(1).split(","):
                    names |= {_requirement_name(r) for r in raw.get(sub.strip(), [])}
            else:
                names.add(_requirement_name(req))
        extras[extra] = names
    return core, extras


def first_party() -> set[str]:
    """Top-level names of kvq's own packages (kvq_core and every backends/kvq_* package)."""
    return {"kvq_core"} | {p.name for p in (ROOT / "backends").iterdir() if (p / "__init__.py").is_file()}


def _is_soft(handlers: list[ast.ExceptHandler]) -> bool:
    """A try whose ImportError handler carries on without re-raising (an optional import)."""
    for h in handlers:
        names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
        catches = h.type is None or any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception")
                                        for n in names)
        if catches and not any(isinstance(n, ast.Raise) for n in ast.walk(ast.Module(body=h.body, type_ignores=[]))):
            return True
    return False


def hard_imports(source: str) -> list[tuple[int, str]]:
    """(line, top-level module) of every absolute import not guarded as optional."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, soft: bool) -> None:
        if isinstance(node, ast.Try):
            body_soft = soft or _is_soft(node.handlers)
            for child in node.body:
                visit(child, body_soft)
            for child in (*node.handlers, *node.orelse, *node.finalbody):
                visit(child, soft)
            return
        if not soft and isinstance(node, ast.Import):
            found.extend((node.lineno, a.name.split(".")[0]) for a in node.names)
        elif not soft and isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        for child in ast.iter_child_nodes(node):
            visit(child, soft)

    visit(ast.parse(source), False)
    return found


@functools.lru_cache(maxsize=1)
def installed_distributions() -> dict[str, list[str]]:
    """Top-level module -> installed distributions (scanning them all is slow: once)."""
    return importlib.metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    """Distributions that may provide top-level ``module`` (normalised names)."""
    installed = installed_distributions().get(module)
    if installed:
        return {_norm(d) for d in installed}
    return {_norm(DIST_ALIASES.get(module, module))}


def allowed_extras(rel: str, extras: dict[str, set[str]]) -> tuple[str, ...]:
    """The extras a module at ``rel`` (repo-relative path) may rely on."""
    matches = [p for p in EXTRAS_BY_PREFIX if rel == p or rel.startswith(p + "/")]
    if matches:
        return EXTRAS_BY_PREFIX[max(matches, key=len)]
    m = re.match(r"backends/kvq_([A-Za-z0-9_]+)/", rel)
    if m and m.group(1) in extras:
        return (m.group(1),)
    raise AssertionError(f"{rel}: no entry in EXTRAS_BY_PREFIX and no extra named after its backend; "
                         "add one saying which extras its users install")


def undeclared_imports() -> list[str]:
    """One line per import that pyproject.toml does not declare for the importing module."""
    core, extras = declared()
    ours = first_party()
    stdlib = set(sys.stdlib_module_names)
    problems = []
    for base in SOURCES:
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            names = allowed_extras(rel, extras)
            unknown = [e for e in names if e not in extras]
            assert not unknown, f"EXTRAS_BY_PREFIX names extras {unknown} that pyproject.toml does not declare"
            allowed = core.union(*(extras[e] for e in names))
            for line, module in hard_imports(path.read_text(encoding="utf-8")):
                if module in stdlib or module in ours or module == "__future__":
                    continue
                dists = distributions_of(module)
                if not dists & allowed:
                    where = "the core dependencies" + (f" or the extras {list(names)}" if names else "")
                    problems.append(f"{rel}:{line} imports {module!r} (distribution {'/'.join(sorted(dists))}), "
                                    f"which {where} of pyproject.toml do not declare")
    return problems


def test_every_import_is_declared() -> None:
    problems = undeclared_imports()
    assert not problems, "undeclared imports:\n  " + "\n  ".join(problems)


def test_the_walk_sees_imports_in_functions_and_skips_optional_ones() -> None:
    src = (
        "import numpy as np\n"
        "from os import path\n"
        "from . import sibling\n"
        "def f():\n"
        "    from scipy.special import gammaln\n"
        "    try:\n"
        "        import tqdm\n"
        "    except ImportError:\n"
        "        tqdm = None\n"
        "    try:\n"
        "        import hypothesis\n"
        "    except ImportError as exc:\n"
        "        raise ImportError('needs hypothesis') from exc\n"
    )
    assert hard_imports(src) == [(1, "numpy"), (2, "os"), (5, "scipy"), (11, "hypothesis")]


def test_an_undeclared_import_is_reported(tmp_path, monkeypatch) -> None:
    """The check is live: a core module importing scipy (an undeclared dependency), an hf module
    importing triton inside a function, and a torch backend importing triton are reported."""
    core = tmp_path / "kvq_core"
    (core / "methods").mkdir(parents=True)
    (core / "methods" / "qjl.py").write_text("import math\nfrom scipy.special import gammaln\n", encoding="utf-8")
    (core / "tools" / "eval").mkdir(parents=True)
    (core / "tools" / "eval" / "text.py").write_text("def f():\n    import transformers\n    import triton\n", encoding="utf-8")
    (tmp_path / "backends" / "kvq_torch").mkdir(parents=True)
    (tmp_path / "backends" / "kvq_torch" / "ops.py").write_text("import torch\nimport triton\n", encoding="utf-8")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", (tmp_path / "kvq_core", tmp_path / "backends"))
    problems = undeclared_imports()
    assert [p.split(" ")[0] for p in problems] == [
        "kvq_core/methods/qjl.py:2", "kvq_core/tools/eval/text.py:3", "backends/kvq_torch/ops.py:2"]
    assert "'scipy'" in problems[0] and "the core dependencies" in problems[0]
    assert "extras ['hf', 'torch']" in problems[1]


@pytest.mark.parametrize(("rel", "extras"), [
    ("kvq_core/methods/qjl.py", ()),
    ("kvq_core/integrations/hf/cache.py", ("hf", "torch")),
    ("backends/kvq_triton/intcodes.py", ("triton", "torch")),
])
def test_module_to_extras_table(rel: str, extras: tuple[str, ...]) -> None:
    assert allowed_extras(rel, declared()[1]) == extras
