"""Numba's disk cache never runs a kernel built from older sources (:mod:`kvq_numba.cache_stamp`).

A kernel cached with ``cache=True`` that inlines a helper from another file keeps the old helper after
that file changes (Numba stamps only the kernel's own file). The guard deletes the cached kernels when
the package's sources differ from the stamp. Checked end to end in fresh interpreters on a two-file
package, with and without the guard, and on kvq_numba's own cache directories.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")

from kvq_numba import cache_stamp  # noqa: E402

pytestmark = pytest.mark.slow  # slow tier: fresh interpreters compiling a kernel

KERNEL = """\
from numba import njit
from {pkg}.helper import helper

@njit(cache=True)
def f():
    return helper()
"""
HELPER = """\
from numba import njit

@njit
def helper():
    return {value}
"""
GUARD = """\
from pathlib import Path
from kvq_numba.cache_stamp import drop_stale
drop_stale(Path(__file__).resolve().parent)
"""


def _package(tmp: Path, pkg: str, guarded: bool) -> Path:
    root = tmp / pkg
    root.mkdir()
    (root / "__init__.py").write_text(GUARD if guarded else "")
    (root / "kernel.py").write_text(KERNEL.format(pkg=pkg))
    (root / "helper.py").write_text(HELPER.format(value=1))
    return root


def _run(tmp: Path, pkg: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run([sys.executable, "-c", f"from {pkg}.kernel import f; print(f())"], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("guarded", [False, True], ids=["numba alone", "with the stamp"])
def test_edited_helper_reaches_cached_kernel(tmp_path: Path, guarded: bool) -> None:
    pkg = f"stamp_pkg_{int(guarded)}"
    root = _package(tmp_path, pkg, guarded)
    assert _run(tmp_path, pkg) == 1
    assert list((root / "__pycache__").glob("kernel.f-*.nbi")), "the kernel was not cached; nothing is tested"
    (root / "helper.py").write_text(HELPER.format(value=2))  # the kernel's own file is unchanged
    # Numba alone runs the stale cached kernel (why the stamp exists); with the stamp, the edit is seen
    assert _run(tmp_path, pkg) == (2 if guarded else 1)
    if guarded:
        assert _run(tmp_path, pkg) == 2  # and the cache made afresh is kept and right on the next run


def test_stamp_keeps_a_current_cache_and_drops_a_stale_one(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "sub" / "__pycache__").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("y = 1\n")
    assert cache_stamp.drop_stale(root) == 0  # first look: both folders stamped (their caches made after)
    cached = [root / "__pycache__" / "a.f-3.py311.nbi", root / "sub" / "__pycache__" / "b.g-1.py311.1.nbc"]
    for f in cached:
        f.write_bytes(b"code")
    (root / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"bytecode")
    assert cache_stamp.drop_stale(root) == 0 and all(f.exists() for f in cached)  # sources unchanged: kept
    (root / "sub" / "b.py").write_text("y = 2\n")
    assert cache_stamp.drop_stale(root) == 2 and not any(f.exists() for f in cached)  # any file edited: all go
    assert (root / "__pycache__" / "a.cpython-311.pyc").exists()  # Python's own cache is not Numba's


def test_numba_cache_dir_is_covered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "a.py").write_text("x = 1\n")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    dirs = cache_stamp.cache_dirs(root)
    assert dirs[0] == root / "__pycache__"
    # Numba's rule for a user cache directory: the folder's name, "_", SHA-1 of the folder's absolute path
    from numba.core.caching import _CacheLocator
    assert dirs[1] == tmp_path / "cache" / _CacheLocator.get_suitable_cache_subpath(str(root / "a.py"))


def test_kvq_numba_caches_are_stamped_with_its_sources() -> None:
    digest = cache_stamp.sources_digest(cache_stamp.PACKAGE)
    for directory in cache_stamp.cache_dirs(cache_stamp.PACKAGE):
        stamp = directory / cache_stamp.STAMP
        if os.access(directory.parent, os.W_OK):
            assert stamp.read_text() == digest, directory
