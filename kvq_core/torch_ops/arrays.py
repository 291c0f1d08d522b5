"""The torch array adapter the core uses to talk to torch-tensor backends."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


class TorchArrays:
    """Tensors stay where they are (device and dtype kept); NumPy arrays become CPU tensors.

    ``all_finite`` and ``max_abs`` are the data-dependent checks the core makes. Under ``torch.compile`` /
    ``torch.export`` (``torch.compiler.is_compiling()``) they are skipped (True / None), since
    reading a tensor's values would break the graph: compiled callers are responsible for
    finite input. Eager calls always check.
    """

    def asarray(self, x: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x
        a = np.asarray(x)
        if not a.flags.writeable or not a.flags.c_contiguous or not a.dtype.isnative:
            a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
            a = a.copy() if not a.flags.writeable else a
        return torch.from_numpy(a)

    def to_numpy(self, x: Any) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            if x.dtype == torch.bfloat16:  # no NumPy bfloat16: widen exactly
                x = x.float()
            return x.numpy()
        return np.asarray(x)

    def all_finite(self, x: Any) -> bool:
        if isinstance(x, torch.Tensor):
            if torch.compiler.is_compiling():
                return True
            return bool(torch.isfinite(x).all())
        return bool(np.isfinite(np.asarray(x)).all())

    def max_abs(self, x: Any) -> float | None:
        """Largest |x| (for the core's underflow check); None under torch.compile, like ``all_finite``."""
        if isinstance(x, torch.Tensor):
            if torch.compiler.is_compiling():
                return None
            lo, hi = torch.aminmax(x)  # one pass, no |x| temporary
            return max(0.0, -float(lo), float(hi))
        return float(np.abs(np.asarray(x, dtype=np.float64)).max())

    def concat(self, xs: list[Any], axis: int) -> torch.Tensor:
        return torch.cat([self.asarray(x) for x in xs], dim=axis)

    def device_of(self, x: Any) -> str | None:
        """The tensor's device type ("cpu", "cuda"); None for NumPy input (it becomes a CPU tensor)."""
        return x.device.type if isinstance(x, torch.Tensor) else None

    def cast(self, x: Any, dtype: str) -> Any:
        target = getattr(torch, dtype, None)
        if not isinstance(target, torch.dtype):
            return x
        if isinstance(x, torch.Tensor):
            return x if x.dtype == target else x.to(target)
        return self.asarray(x).to(target)
