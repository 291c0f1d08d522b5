"""One line on stderr when Numba compiles a kvq kernel, and one when it is done.

The first call of a kernel with a new argument type compiles it (seconds to a minute); the disk
cache (``cache=True``) makes later processes skip that. Without a word, that pause looks like a
hang, so a listener on numba's compile events announces each top-level compile of a
``kvq_numba`` function (nested compiles of its helpers are part of it). Cache loads are silent.
"""
from __future__ import annotations

import sys
import time
from typing import Any

from numba.core import event

PREFIX = "kvq numba:"


class CompileNotice(event.Listener):
    """Prints the start and duration of each outermost kvq kernel compile."""

    def __init__(self) -> None:
        self.depth = 0
        self.current: tuple[str, float] | None = None

    def on_start(self, ev: Any) -> None:
        self.depth += 1
        func = ev.data["dispatcher"].py_func
        if self.depth == 1 and func.__module__.startswith("kvq_numba"):
            name = f"{func.__module__.removeprefix('kvq_numba.')}.{func.__name__}"
            self.current = (name, time.perf_counter())
            print(f"{PREFIX} compiling {name} for a new argument type (first use; cached on disk, so later runs "
                  "skip this)...", file=sys.stderr, flush=True)

    def on_end(self, ev: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and self.current is not None:
            name, t0 = self.current
            self.current = None
            print(f"{PREFIX} compiled {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


_installed: CompileNotice | None = None


def install() -> None:
    """Register the listener once per process (idempotent)."""
    global _installed
    if _installed is None:
        _installed = CompileNotice()
        event.register("numba:compile", _installed)
