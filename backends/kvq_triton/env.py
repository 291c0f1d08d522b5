"""Whether Triton runs in its CPU interpreter, read without importing Triton (the plugin asks it
at registration, when importing Triton would make ``import kvq_core`` pay for it)."""
from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
