"""Old import paths of modules that moved in 0.2, kept until 0.3.

Importing an old path (or a module under it: ``kvq_core.hf.cache``) warns once with a
DeprecationWarning naming the new path, and yields the module at the new path itself, so the
old and new names hold the same objects. :func:`install` (run by ``import kvq_core``) puts the
finder that does this first on ``sys.meta_path``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType

#: The release that drops the old paths.
REMOVED_IN = "0.3"

#: Old module path -> new path; the modules under an old path moved with it.
MOVED = {
    "kvq_core.hf": "kvq_core.integrations.hf",
    "kvq_core.onnx": "kvq_core.integrations.onnx",
    "kvq_core.bench": "kvq_core.tools.bench",
    "kvq_core.eval": "kvq_core.tools.eval",
    "kvq_core.tune": "kvq_core.tools.tune",
    "kvq_core.warmup": "kvq_core.tools.warmup",
    "kvq_core.demo": "kvq_core.tools.demo",
    "kvq_core.cli": "kvq_core.tools.cli",
    "kvq_core.results": "kvq_core.tools.results",
    "kvq_core.progress": "kvq_core.tools.progress",
    "kvq_core.synthetic": "kvq_core.tools.synthetic",
    "kvq_core.metrics": "kvq_core.tools.metrics",
    "kvq_core.kernels": "kvq_core.contract",
    "kvq_core.dispatch": "kvq_core.torch_ops",
}


def new_path(old: str) -> str | None:
    """Where the module ``old`` lives now, or None if it did not move."""
    for before, after in MOVED.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    return None


def _deprecated(old: str) -> str:
    """Warn that ``old`` is deprecated, naming its new path, and return that path."""
    new = new_path(old)
    # stacklevel 3: past this function and the loader's method to the importing line (the import
    # system's own frames are skipped)
    warnings.warn(f"{old} is deprecated and will be removed in {REMOVED_IN}; import {new}", DeprecationWarning,
                  stacklevel=3)
    return new


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths; loading one imports the new path and puts that module under the old name."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if new_path(fullname) else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder, replaced by the new module in exec_module

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(_deprecated(module.__name__))

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m`` with an old path (``python -m kvq_core.eval.ppl``)."""
        new = _deprecated(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)


def install() -> None:
    """Serve the old paths in this process (once; ``import kvq_core`` calls this)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
