"""Launch sizes: large tiles under the interpreter (it pays per program and per op, not per
element), GPU-sized ones on a device."""
from __future__ import annotations

import triton.language as tl

from kvq_triton.env import interpreting


def tile() -> int:
    """Elements per program of the elementwise kernels (a power of two)."""
    return 16384 if interpreting() else 4096


#: ``interpreting()`` as a kernel constant, read once at import (TRITON_INTERPRET must be set
#: before kvq_triton is imported). Kernels whose loops have run-time bounds branch on it: the
#: interpreter of Triton < 3.9 cannot take a tensor as a ``range`` bound on NumPy >= 2.5 (it
#: calls ``int()`` on a 1-element array), so there they loop with ``while``; compiled, ``range``
#: keeps the loop a counted one (software pipelining).
INTERPRETER = tl.constexpr(interpreting())
