"""Where ``kvq bench`` and ``kvq eval`` write their results unless ``--out`` says otherwise:
``$KVQ_RESULTS``, else ``./kvq-results/`` in the working directory.

Outside the package tree on purpose: a quick run in a checkout must never rewrite the measured
results under ``bench/results/`` that the docs quote; regenerating those takes ``--out bench/results``.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "KVQ_RESULTS"
DEFAULT_DIR = "kvq-results"


def results_dir() -> Path:
    """``$KVQ_RESULTS``, else ``./kvq-results`` (relative to the working directory)."""
    return Path(os.environ.get(ENV) or DEFAULT_DIR)


def out_help(what: str, default: Path) -> str:
    """``--out`` help naming the default path and where it comes from."""
    return f"{what} (default {default}; the folder is ${ENV} when set, else ./{DEFAULT_DIR}/)"
