"""Modules that moved in 0.2 still import from their old paths until 0.3: each old path warns once
with a DeprecationWarning naming the new path and yields the new module itself."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kvq_core
from kvq_core import moved

ROOT = Path(__file__).resolve().parents[1]


def _new_module(new: str):
    try:
        return importlib.import_module(new)
    except ImportError as exc:  # an extra this environment lacks (torch for kvq_core.torch_ops)
        pytest.skip(f"{new} needs an extra: {exc}")


def _import_old(old: str, monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[warnings.WarningMessage]]:
    """Import ``old`` afresh with an import statement's machinery; return the module and the warnings."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        __import__(old)
    return sys.modules[old], [w for w in seen if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_an_old_path_warns_once_naming_the_new_one_and_is_the_new_module(old: str, monkeypatch) -> None:
    new = moved.MOVED[old]
    target = _new_module(new)
    module, seen = _import_old(old, monkeypatch)
    assert module is target
    assert [str(w.message) for w in seen] == [f"{old} is deprecated and will be removed in 0.3; import {new}"]
    assert seen[0].filename == __file__  # attributed to the importing line, not to kvq's import machinery
    with warnings.catch_warnings(record=True) as twice:
        warnings.simplefilter("always")
        assert importlib.import_module(old) is target  # imported already: no second warning
    assert not twice


def test_a_module_under_an_old_path_is_the_moved_module(monkeypatch) -> None:
    cache = _new_module("kvq_core.integrations.hf.cache")
    module, seen = _import_old("kvq_core.hf.cache", monkeypatch)
    assert module is cache
    assert "import kvq_core.integrations.hf.cache" in str(seen[-1].message)
    from kvq_core.hf import KVQCache

    assert KVQCache is cache.KVQCache


def test_paths_that_did_not_move_are_left_alone() -> None:
    assert moved.new_path("kvq_core.integrations.hf") is None and moved.new_path("kvq_core.hfx") is None
    assert moved.new_path("kvq_core.eval.ppl") == "kvq_core.tools.eval.ppl"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvq_core.no_such_module")


@pytest.mark.slow  # slow tier: a fresh interpreter
def test_the_warning_shows_by_default_in_a_script() -> None:
    """Python shows a DeprecationWarning raised in ``__main__`` by default: a script importing an old
    path sees it without ``-W``; ``python -m`` with an old path still runs the module."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")])}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-c", "import kvq_core.kernels"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "DeprecationWarning: kvq_core.kernels is deprecated and will be removed in 0.3; import " \
           "kvq_core.contract" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kvq_core.cli", "--version"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == kvq_core.__version__
