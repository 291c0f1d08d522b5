"""The Triton backend's array adapter (imported, with torch, on first use: see the plugin)."""
from __future__ import annotations

from typing import Any

from kvq_core.torch_ops.arrays import TorchArrays
from kvq_triton.env import interpreting
from kvq_triton.plugin import _cuda


class TritonArrays(TorchArrays):
    """Torch tensors as they are; NumPy arrays become tensors on the device the kernels run on
    (CUDA, or the CPU under the interpreter)."""

    def asarray(self, x: Any) -> Any:
        t = super().asarray(x)
        if t.device.type == "cpu" and not isinstance(x, type(t)) and not interpreting() and _cuda():
            return t.cuda()
        return t
