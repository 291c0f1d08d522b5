"""The NumPy array adapter the core uses to talk to this backend."""
from __future__ import annotations

from typing import Any

import numpy as np

from kvq_core.host_arrays import host_all_finite, to_host


class NumpyArrays:
    """Accepts NumPy arrays (and anything ``np.asarray`` takes, e.g. CPU torch tensors)."""

    def asarray(self, x: Any) -> np.ndarray:
        return to_host(x)  # a torch tensor: detached, on the CPU, bfloat16 widened to float32

    def to_numpy(self, x: Any) -> np.ndarray:
        return self.asarray(x)

    def all_finite(self, x: Any) -> bool:
        return host_all_finite(self.asarray(x))

    def max_abs(self, x: Any) -> float:
        """Largest |x| (for the core's underflow check)."""
        a = self.asarray(x)
        return max(0.0, -float(a.min()), float(a.max()))  # no |x| temporary

    def cast(self, x: Any, dtype: str) -> np.ndarray:
        try:
            return np.asarray(x).astype(np.dtype(dtype), copy=False)
        except TypeError:  # e.g. "bfloat16": no NumPy dtype, keep float32
            return np.asarray(x, dtype=np.float32)

    def concat(self, xs: list[Any], axis: int) -> np.ndarray:
        return np.concatenate([self.asarray(x) for x in xs], axis=axis)
