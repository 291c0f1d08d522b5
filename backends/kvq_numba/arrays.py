"""The array adapter of the Numba backend, and how its kernels tell CUDA input from CPU input.

CPU data is NumPy (CPU torch tensors are taken as NumPy views; bfloat16 is widened to float32,
which NumPy lacks). CUDA data is anything exposing ``__cuda_array_interface__`` (CUDA torch
tensors, CuPy, numba device arrays) or a numba simulator device array; it stays on the device.
numba.cuda is never imported here: a CUDA array can only exist once its library is loaded, nor numba
itself until the first finiteness test (the plugin imports this module to register the backend).
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from kvq_core.host_arrays import host_all_finite, to_host

#: :mod:`kvq_numba.cpu.finite`, imported on the first finiteness test
_finite: Any = None
_F32 = np.dtype(np.float32)


def is_cuda_input(x: Any) -> bool:
    """True for device arrays (real or the numba CUDA simulator's), False for host arrays."""
    if isinstance(x, np.ndarray) or getattr(x, "is_cpu", False) is True:
        return False  # NumPy, or a CPU torch tensor (whose __cuda_array_interface__ raises: slow)
    if getattr(getattr(x, "device", None), "type", None) == "cpu":
        return False
    if hasattr(x, "__cuda_array_interface__"):
        return True
    cuda = sys.modules.get("numba.cuda")
    return cuda is not None and bool(cuda.devicearray.is_cuda_ndarray(x))


def as_float32(x: Any) -> np.ndarray:
    """Host input as a C-contiguous float32 array (no copy when it already is one)."""
    if type(x) is np.ndarray and x.dtype is _F32 and x.flags.c_contiguous:  # NumPy's native float32 descriptor
        return x
    return np.ascontiguousarray(to_host(x), dtype=np.float32)


def _finite_kernels() -> Any:
    """:mod:`kvq_numba.cpu.finite`, imported (with numba) on first use."""
    global _finite
    if _finite is None:
        from kvq_numba.cpu import finite as _finite
    return _finite


@functools.lru_cache(maxsize=32)
def _host_dtype(name: str) -> np.dtype:
    """The NumPy dtype a host array of dtype ``name`` is kept in: bfloat16, which NumPy lacks, as float32."""
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(np.float32)


class NumbaArrays:
    """Host arrays become NumPy; device arrays stay device arrays (numba's, or the caller's)."""

    def asarray(self, x: Any) -> Any:
        if type(x) is np.ndarray:  # the common case first (every field of every attend call)
            return x
        if is_cuda_input(x):
            return x
        return to_host(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        if is_cuda_input(x):
            if hasattr(x, "copy_to_host"):
                return x.copy_to_host()
            if hasattr(x, "detach"):
                return to_host(x)
            from numba import cuda

            return cuda.as_cuda_array(x).copy_to_host()
        return to_host(x)

    def all_finite(self, x: Any) -> bool:
        """No NaN or Inf in ``x``: float32/float64/float16 host data in one compiled pass
        (:mod:`kvq_numba.cpu.finite`), other dtypes through NumPy."""
        a = x if type(x) is np.ndarray else self.to_numpy(x)
        char = a.dtype.char
        if char != "f" and char != "d" and char != "e":
            return host_all_finite(a)
        finite = _finite_kernels()
        flat = a.ravel()  # contiguous (a copy only when a is not): one compiled signature per dtype
        return bool(finite.all_finite(flat) if char != "e" else finite.half_bits_finite(flat.view(np.uint16)))

    def max_abs(self, x: Any) -> float:
        """Largest |x|, for the core's underflow check of each encoded block: float32/float64 host data in one
        compiled pass (NumPy's min and max are two, plus their conversions: most of a 1-token encode's checks)."""
        a = x if type(x) is np.ndarray else self.to_numpy(x)
        char = a.dtype.char
        if char != "f" and char != "d":
            return max(0.0, -float(a.min()), float(a.max()))
        return float(_finite_kernels().max_abs(a.ravel()))

    def cast(self, x: Any, dtype: str) -> Any:
        """``x`` as ``dtype`` (bfloat16, which NumPy lacks, stays float32), on the device it came from."""
        target = _host_dtype(dtype)
        if type(x) is np.ndarray:  # every host kernel's output
            return x.astype(target, copy=False)
        if is_cuda_input(x):
            if getattr(x, "dtype", None) == target:
                return x
            from numba import cuda

            return cuda.to_device(np.ascontiguousarray(self.to_numpy(x), dtype=target))
        return np.asarray(x).astype(target, copy=False)

    def concat(self, xs: list[Any], axis: int) -> Any:
        if xs and is_cuda_input(xs[0]):
            from numba import cuda

            return cuda.to_device(np.concatenate([self.to_numpy(x) for x in xs], axis=axis))
        return np.concatenate([to_host(x) for x in xs], axis=axis)
