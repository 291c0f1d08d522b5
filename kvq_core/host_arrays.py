"""Host arrays: NumPy views of host or torch arrays, their finiteness test and dtype names.

Shared by the core's block checks and the host backends' array adapters (NumPy, numba).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np


def to_host(x: Any) -> np.ndarray:
    """NumPy view of a host or torch array (torch tensors are detached and moved to the CPU;
    bfloat16, which NumPy lacks, is widened exactly to float32)."""
    if type(x) is np.ndarray:  # the usual case (every stored field on the host backends): nothing to convert
        return x
    if hasattr(x, "detach"):
        try:
            return x.numpy()  # a CPU tensor needing no grad, in a dtype NumPy has: the same view, 3 calls fewer
        except (RuntimeError, TypeError):  # requires grad, on a device, or bfloat16
            pass
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def host_all_finite(a: np.ndarray) -> bool:
    """True when the host array ``a`` holds no NaN or Inf. float16 is tested on its exponent bits
    (NumPy's float16 ``isfinite`` is scalar code, slower than a compiled encode of the block)."""
    if a.dtype == np.float16:
        return not bool(np.any((np.ascontiguousarray(a).view(np.uint16) & 0x7C00) == 0x7C00))
    return bool(np.isfinite(a).all())


@functools.lru_cache(maxsize=64)
def dtype_name(dtype: Any) -> str:
    """A NumPy or torch dtype's short name ("float16"); cached, since ``str`` of a NumPy dtype
    costs microseconds and every attend call validates each field."""
    return str(dtype).replace("torch.", "")
