"""The plugin's tests need it *installed* (kvq finds plugins through installed entry points)."""
from __future__ import annotations

import importlib.metadata

import pytest


def pytest_configure(config: pytest.Config) -> None:
    try:
        importlib.metadata.distribution("kvq-fp8")
    except importlib.metadata.PackageNotFoundError:
        raise pytest.UsageError("kvq-fp8 is not installed; run: pip install -e plugins/kvq-fp8") from None
