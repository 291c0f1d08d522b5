"""Shared test setup (keep small). Inductor's on-disk cache persists across runs, so compiled
tests pay the ~30 s cold compile once per machine, not per run. A KVQCache's backend="auto" is the
compiled one from the first call (KVQ_COMPILE=foreground: the tests say which backend serves; no
background compile competes with them); tests/test_compile_ahead.py covers the background path."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("KVQ_COMPILE", "foreground")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "kvq-inductor"))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Tests call numba's CPU kernels directly too: its stale-cache check runs before any of them
    (a kernel class does it when constructed)."""
    try:
        from kvq_numba.startup import prepare
    except ImportError:  # numba not installed
        return
    prepare()


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """torch.compile tests (``compile``) belong to the slow tier: inductor's cold compile is ~20 s a graph."""
    for item in items:
        if item.get_closest_marker("compile") is not None:
            item.add_marker(pytest.mark.slow)
