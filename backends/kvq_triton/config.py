"""Launch sizes: large tiles under the interpreter (it pays per program and per op, not per
element), GPU-sized ones on a device."""
from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tile() -> int:
    """Elements per program of the elementwise kernels (a power of two)."""
    return 16384 if interpreting() else 4096
