"""NumPy reference kernels of QJL (the codec is described in :mod:`kvq_core.methods.qjl`).

The sign-sketch helpers here are shared with TurboQuant_prod, whose residual is a QJL code.
Arrays are [batch, kv_heads, rows, ...]; each kv head has its own sketch S (kv_heads, m, d).
"""
from __future__ import annotations

import math

import numpy as np

from kvq_core.kernels import KernelContext
from kvq_core.layout import pack_codes, unpack_codes
from kvq_core.methods.qjl import QJLSpec
from kvq_numpy.attention import by_kv_head, from_kv_head, softmax_over_logits
from kvq_numpy.kivi import KiviKernels

Fields = dict[str, np.ndarray]


def sketch(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """S x for x [b, h, n, d] and per-head S [h, m, d]: [b, h, n, m]."""
    return x @ np.swapaxes(s, -1, -2)


def encode_signs(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The packed 1-bit codes of sign(S x), bit 1 meaning +1 (sign(0) = +1)."""
    return pack_codes(sketch(x, s) >= 0, 1)


def decode_signs(packed: np.ndarray, m: int) -> np.ndarray:
    """The +-1 signs (float32, [..., m]) of packed 1-bit codes."""
    return 2 * unpack_codes(packed, 1, m).astype(np.float32) - 1


def estimator_scale(m: int) -> float:
    """sqrt(pi/2) / m: E[sqrt(pi/2) <g, q> sign<g, k>] = <q, k/||k||> for g ~ N(0, I)."""
    return math.sqrt(math.pi / 2) / m


def qjl_scores(q_sketch: np.ndarray, packed: np.ndarray, norm: np.ndarray) -> np.ndarray:
    """sqrt(pi/2)/m * norm_t * <S q, h_t>, the unbiased estimate of <q, k_t>: [b, h, n, t] float64."""
    m = q_sketch.shape[-1]
    dots = q_sketch.astype(np.float64) @ np.swapaxes(decode_signs(packed, m), -1, -2)
    return estimator_scale(m) * dots * norm.astype(np.float64)[:, :, None, :]


def qjl_reconstruct(packed: np.ndarray, norm: np.ndarray, s: np.ndarray) -> np.ndarray:
    """sqrt(pi/2)/m * norm * S^T h, the vector whose inner products are the estimator: [b, h, t, d]."""
    m = s.shape[1]
    back = decode_signs(packed, m) @ s
    return (estimator_scale(m) * norm[..., None] * back).astype(np.float32)


class QJLKernels:
    """Keys: signs of S k and ||k||, scored by the QJL estimator; values: KIVI's per-token INT codec."""

    def __init__(self, spec: QJLSpec) -> None:
        self.spec = spec
        self.values = KiviKernels(spec.value_codec)

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> Fields:
        k = np.asarray(k, dtype=np.float32)
        return {"qjl": encode_signs(k, ctx.consts["sketch"]), "norm": np.linalg.norm(k, axis=-1)}

    def decode_keys(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        """The unbiased-in-expectation reconstruction sqrt(pi/2)/m ||k|| S^T h: <q, k_hat> is the score."""
        return qjl_reconstruct(fields["qjl"], fields["norm"], ctx.consts["sketch"])

    def encode_values(self, v: np.ndarray, ctx: KernelContext) -> Fields:
        return self.values.encode_values(v, ctx)

    def decode_values(self, fields: Fields, ctx: KernelContext) -> np.ndarray:
        return self.values.decode_values(fields, ctx)

    def attend(
        self, q: np.ndarray, kfields: Fields, vfields: Fields, ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sketch the query once, score every key by the estimator, softmax over decoded values."""
        s = ctx.consts["sketch"]
        q_sketch = sketch(by_kv_head(np.asarray(q, np.float64), ctx.shape[1]), s)
        logits = qjl_scores(q_sketch, kfields["qjl"], kfields["norm"])
        out, lse = softmax_over_logits(logits, self.decode_values(vfields, ctx), scale)
        return from_kv_head(out, q.shape), from_kv_head(lse, q.shape)
