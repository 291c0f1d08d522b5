"""Numba's disk cache of kvq's kernels, dropped when any of kvq_numba's sources changed.

Numba keys a cached kernel on its own source file (a hash of its text), not on the files of the
helpers it inlines: after an edit to a helper in another file (a ``git pull`` in an editable
checkout, an upgrade that changes only that file), the callers' cached machine code still holds
the old helper, and runs it silently. So the package's cache directories carry a stamp, a hash of
every ``.py`` file under ``kvq_numba``; when the sources no longer match it, every cached kernel
there is deleted (the next use compiles afresh, with the first-compile notice) and the new stamp
is written.

The directories are where Numba puts the cache of a file in a writable tree (the ``__pycache__``
beside it: an editable checkout, a virtual environment's site-packages) and, when ``NUMBA_CACHE_DIR``
is set, that directory's entry for the file's folder (Numba's rule: the folder's name, ``_``, the
SHA-1 of its absolute path). A read-only install whose cache Numba keeps in the user-wide folder is
not covered: its sources change only when it is reinstalled.

:class:`NumbaCompileCache` marks, per spec, that a warm-up compiled its kernels into that cache (the
package folder's cache directory, one small file per spec and CPU), so a ``KVQCache`` knows before its
first call whether numba would have to compile; the marks are dropped with the kernels.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

#: the stamp's file name inside each cache directory
STAMP = "kvq_numba_sources.sha256"
#: Numba's index (.nbi) and code (.nbc) files, and the marks of compiled specs (.ready)
CACHE_SUFFIXES = (".nbi", ".nbc", ".ready")
PACKAGE = Path(__file__).resolve().parent


def sources_digest(root: Path) -> str:
    """SHA-256 over the relative path and text of every ``.py`` file under ``root``, in path order."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_dirs(root: Path) -> list[Path]:
    """The directories Numba caches the kernels of ``root``'s source folders in."""
    folders = sorted({p.parent for p in root.rglob("*.py")})
    found = [f / "__pycache__" for f in folders]
    user_dir = os.environ.get("NUMBA_CACHE_DIR")
    if user_dir:
        found += [Path(user_dir) / f"{f.name}_{hashlib.sha1(str(f).encode()).hexdigest()}" for f in folders]
    return found


def drop_stale(root: Path = PACKAGE) -> int:
    """Delete the cached kernels of ``root``'s sources where a cache directory's stamp differs from
    their digest (a missing stamp: a cache made before this check, or none yet), and stamp it.
    Returns the number of files deleted. Never raises for the file system: a directory that cannot
    be written is left as it is (Numba then does not cache there either)."""
    digest = sources_digest(root)
    deleted = 0
    for directory in cache_dirs(root):
        stamp = directory / STAMP
        try:
            directory.mkdir(parents=True, exist_ok=True)  # stamped before Numba's first cache there, not after
            if stamp.is_file() and stamp.read_text() == digest:
                continue
            for f in directory.iterdir():
                if f.suffix in CACHE_SUFFIXES:
                    f.unlink(missing_ok=True)
                    deleted += 1
            tmp = directory / f"{STAMP}.{os.getpid()}"
            tmp.write_text(digest)
            os.replace(tmp, stamp)  # atomic: a process starting beside this one reads the old or the new stamp
        except OSError:
            continue
    return deleted


_checked: set[str] = set()


def check(root: Path = PACKAGE) -> None:
    """:func:`drop_stale` once per process and cache directory (``NUMBA_CACHE_DIR``'s value): before this
    process's first kernel or compile mark is read from there."""
    key = f"{root}:{os.environ.get('NUMBA_CACHE_DIR', '')}"
    if key not in _checked:
        drop_stale(root)
        _checked.add(key)


def package_cache_dir(root: Path = PACKAGE) -> Path:
    """The directory Numba caches the kernels of ``root``'s own folder in (``NUMBA_CACHE_DIR``'s entry, else ``__pycache__``)."""
    user_dir = os.environ.get("NUMBA_CACHE_DIR")
    if user_dir:
        return Path(user_dir) / f"{root.name}_{hashlib.sha1(str(root).encode()).hexdigest()}"
    return root / "__pycache__"


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    """The host CPU as Numba's cache index keys it (name and features): a mark holds on this CPU only."""
    import llvmlite.binding as llvm

    return f"{llvm.get_host_cpu_name()}:{llvm.get_host_cpu_features().flatten()}"


class NumbaCompileCache:
    """kvq_numba's :class:`kvq_core.contract.CompileCache`: a ``.ready`` file per (spec, CPU) in the package's cache directory."""

    def directory(self) -> Path:
        return package_cache_dir()

    def _mark(self, spec: Any) -> Path:
        key = hashlib.sha256(json.dumps([spec.to_dict(), _host_cpu()], sort_keys=True, default=str).encode()).hexdigest()
        return self.directory() / f"{spec.method}-{key[:24]}.ready"

    def ready(self, spec: Any, device: str | None) -> bool:
        """True on a CUDA device (its kernels compile per launch shape, not ahead) or where a warm-up marked ``spec``."""
        if device is not None and str(device).split(":")[0] != "cpu":
            return True
        check()  # a mark made before the sources changed goes with their kernels
        return self._mark(spec).is_file()

    def mark_ready(self, spec: Any) -> None:
        check()
        path = self._mark(spec)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(spec.describe() + "\n")
        except OSError:
            pass  # an unwritable cache: Numba does not cache there either
