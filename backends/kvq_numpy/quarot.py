"""NumPy kernels of ``quarot``: Hadamard per head, then per-token asymmetric INT-b (group = head_dim)."""
from __future__ import annotations

import numpy as np

from kvq_core.kernels import KernelContext
from kvq_core.methods.quarot import QuaRotSpec
from kvq_numpy import intquant
from kvq_numpy.attention import softmax_attend
from kvq_numpy.rotation import hadamard

CHANNEL_AXIS = 3


def _rotate(x: np.ndarray, ctx: KernelContext) -> np.ndarray:
    """x H by the fast transform (its own inverse, so this also un-rotates); identity without rotation."""
    x = np.asarray(x, np.float32)
    return hadamard(x) if "hadamard" in ctx.consts else x


class QuaRotKernels:
    def __init__(self, spec: QuaRotSpec) -> None:
        self.spec = spec

    def _encode_rotated(self, y: np.ndarray) -> dict[str, np.ndarray]:
        d = self.spec.head_dim
        return intquant.encode_fields(y, self.spec.bits, d, CHANNEL_AXIS, clip_ratio=self.spec.clip_ratio)

    def _decode_rotated(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        d = self.spec.head_dim
        return intquant.decode_fields(fields, self.spec.bits, d, d, CHANNEL_AXIS)

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        return self._encode_rotated(_rotate(k, ctx))

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return _rotate(self._decode_rotated(fields), ctx)

    encode_values = encode_keys
    decode_values = decode_keys

    def attend(
        self, q: np.ndarray, kfields: dict[str, np.ndarray], vfields: dict[str, np.ndarray], ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Score H q against the rotated-domain keys (H orthonormal keeps q.k), rotate the output back once."""
        out, lse = softmax_attend(_rotate(q, ctx), self._decode_rotated(kfields), self._decode_rotated(vfields), scale)
        return _rotate(out, ctx), lse
