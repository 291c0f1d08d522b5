"""NumPy kernels of ``fp8`` (the reference the torch kernels are proven equal to)."""
from __future__ import annotations

import numpy as np

from kvq_core.contract import KernelContext
from kvq_fp8.formats import FORMATS
from kvq_fp8.spec import Fp8Spec
from kvq_numpy.attention import softmax_attend


class Fp8Kernels:
    def __init__(self, spec: Fp8Spec) -> None:
        self.spec = spec
        self.format = FORMATS[spec.format]
        # the axes one scale covers in [b, h, t, d]: a token's head_dim, or a head's whole block
        self.axes = (3,) if spec.scale == "token" else (2, 3)

    def _expand(self, scale: np.ndarray) -> np.ndarray:
        return scale[..., None] if self.spec.scale == "token" else scale[..., None, None]

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        x = np.asarray(k, dtype=np.float32)
        scale = np.abs(x).max(axis=self.axes) / np.float32(self.format.max)
        safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
        return {"codes": self.format.encode(x / self._expand(safe)), "scale": scale.astype(np.float32)}

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return self.format.decode(fields["codes"]) * self._expand(np.asarray(fields["scale"], np.float32))

    encode_values = encode_keys
    decode_values = decode_keys

    def attend(self, q, kfields, vfields, ctx: KernelContext, scale: float):
        return softmax_attend(q, self.decode_keys(kfields, ctx), self.decode_values(vfields, ctx), scale)
