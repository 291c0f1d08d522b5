"""NumPy kernels of the ``fp16`` identity codec."""
from __future__ import annotations

import numpy as np

from kvq_core.contract import KernelContext
from kvq_core.methods.fp16 import Fp16Spec
from kvq_numpy.attention import softmax_attend


class Fp16Kernels:
    def __init__(self, spec: Fp16Spec) -> None:
        self.spec = spec

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        return {"data": np.asarray(k, dtype=self.spec.storage)}

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return fields["data"].astype(np.float32)

    encode_values = encode_keys
    decode_values = decode_keys

    def attend(self, q, kfields, vfields, ctx: KernelContext, scale: float):
        return softmax_attend(q, kfields["data"], vfields["data"], scale)
