"""NumPy reference of the 1-bit sign sketch: QJL's key code and TurboQuant_prod's residual code
(the sketches themselves are drawn in :mod:`kvq_core.math.sketch`). Arrays are
[batch, kv_heads, rows, ...]; each kv head has its own sketch S (kv_heads, m, d).
"""
from __future__ import annotations

import math

import numpy as np

from kvq_core.layout import pack_codes, unpack_codes


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
