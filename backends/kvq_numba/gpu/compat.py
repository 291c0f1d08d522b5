"""A guarded shim for numba-cuda on NumPy >= 2.5, applied before the CUDA target is first built.

numba-cuda 0.30.4's ``numba/cuda/np/arrayobj.py`` registers an overload for ``np.row_stack``
whenever NumPy >= 2.0 (``overload(np.row_stack)(impl_np_vstack)``); NumPy 2.5 removed that alias,
so importing the module raises AttributeError and the CUDA target never initialises: every kernel
launch or ``compile_ptx`` fails. numba (the CPU target) guards the same line itself.

:func:`import_array_overloads` imports that module once with a placeholder ``np.row_stack`` (a
distinct function, so numba-cuda's overload registers for the placeholder, never twice for
``np.vstack``) and removes it again: NumPy is left as it was. Only when ``np.row_stack`` is
missing and the simulator is off; a numba-cuda that no longer has the line is unaffected.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import numpy as np

_ARRAY_OVERLOADS = "numba.cuda.np.arrayobj"


def _row_stack_placeholder(tup: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for the ``np.row_stack`` alias NumPy 2.5 removed, only while numba-cuda imports."""
    return np.vstack(tup, *args, **kwargs)


def import_array_overloads() -> None:
    """Imports numba-cuda's NumPy array overloads, with the ``np.row_stack`` shim when NumPy lacks it."""
    from numba import config

    if config.ENABLE_CUDASIM or hasattr(np, "row_stack") or importlib.util.find_spec(_ARRAY_OVERLOADS) is None:
        return
    np.row_stack = _row_stack_placeholder  # type: ignore[attr-defined]
    try:
        importlib.import_module(_ARRAY_OVERLOADS)
    finally:
        del np.row_stack
