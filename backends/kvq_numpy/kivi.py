"""NumPy kernels of ``kivi``: keys per channel over token groups, values per token over channel groups."""
from __future__ import annotations

import numpy as np

from kvq_core.kernels import KernelContext
from kvq_core.methods.kivi import KiviSpec
from kvq_numpy import intquant
from kvq_numpy.attention import softmax_attend

TOKEN_AXIS, CHANNEL_AXIS = 2, 3


class KiviKernels:
    def __init__(self, spec: KiviSpec) -> None:
        self.spec = spec

    def _encode(self, x: np.ndarray, axis: int) -> dict[str, np.ndarray]:
        return intquant.encode_fields(x, self.spec.bits, self.spec.group, axis, zero_point="min")

    def _decode(self, fields: dict[str, np.ndarray], axis: int) -> np.ndarray:
        return intquant.decode_fields(fields, self.spec.bits, self.spec.head_dim, self.spec.group, axis)

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        return self._encode(k, TOKEN_AXIS)

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return self._decode(fields, TOKEN_AXIS)

    def encode_values(self, v: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        return self._encode(v, CHANNEL_AXIS)

    def decode_values(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return self._decode(fields, CHANNEL_AXIS)

    def attend(
        self, q: np.ndarray, kfields: dict[str, np.ndarray], vfields: dict[str, np.ndarray], ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """KIVI's fused kernel is dequantize-then-matmul, so the reference is exactly that."""
        return softmax_attend(q, self.decode_keys(kfields, ctx), self.decode_values(vfields, ctx), scale)
