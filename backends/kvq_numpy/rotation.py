"""The orthogonal rotations R of head vectors that the NumPy reference methods apply before coding.

Vectors sit on the last axis of ``[b, kv_heads, n, d]``; per-head rotations take their kv head's
R_h (queries are grouped first, see :func:`kvq_numpy.attention.by_kv_head`). A method's
constants describe its rotation:

- ``signs`` ``[kv_heads, d]``: the randomized Hadamard R_h = H diag(s_h) (OCTOPUS, PolarQuant, TurboQuant);
- ``rotation`` ``[kv_heads, d, d]``: dense orthogonal (Haar) matrices R_h (TurboQuant ``rotation="haar"``);
- neither: no rotation (PolarQuant ``rotation="none"``).

OScaR and QuaRot apply the plain Hadamard H, the same for every head (:func:`hadamard`).
H is the orthonormal Sylvester matrix: symmetric, so it is its own inverse.
"""
from __future__ import annotations

import numpy as np

from kvq_core.math.hadamard import fwht
from kvq_numpy.attention import by_kv_head, from_kv_head

Consts = dict[str, np.ndarray]


def hadamard(x: np.ndarray) -> np.ndarray:
    """x H on the last axis, by the fast transform; its own inverse."""
    return fwht(x)


def _per_head(signs: np.ndarray) -> np.ndarray:
    """Signs ``[kv_heads, d]`` (or already ``[kv_heads, 1, d]``) as ``[kv_heads, 1, d]``, to broadcast over ``[b, kv_heads, n, d]``."""
    return np.reshape(signs, (signs.shape[0], 1, signs.shape[-1]))


def signed_hadamard(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """R x = H diag(s) x per kv head, for signs ``[kv_heads, d]``."""
    return fwht(_per_head(signs) * x)


def signed_hadamard_inverse(y: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """R^T y = diag(s) H y per kv head, the inverse of :func:`signed_hadamard`."""
    return _per_head(signs) * fwht(y)


def orthogonal(x: np.ndarray, mats: np.ndarray) -> np.ndarray:
    """R x per kv head for orthogonal matrices ``[kv_heads, d, d]`` (row vectors: ``x @ R^T``)."""
    return x @ np.swapaxes(mats, -1, -2)


def orthogonal_inverse(y: np.ndarray, mats: np.ndarray) -> np.ndarray:
    """R^T y per kv head (row vectors: ``y @ R``), the inverse of :func:`orthogonal`."""
    return y @ mats


def rotate(x: np.ndarray, consts: Consts) -> np.ndarray:
    """R x for ``x [b, kv_heads, n, d]`` with the rotation the constants describe (identity if none)."""
    if "rotation" in consts:
        return orthogonal(x, consts["rotation"])
    if "signs" in consts:
        return signed_hadamard(x, consts["signs"])
    return x


def unrotate(y: np.ndarray, consts: Consts) -> np.ndarray:
    """R^T y, the inverse of :func:`rotate`."""
    if "rotation" in consts:
        return orthogonal_inverse(y, consts["rotation"])
    if "signs" in consts:
        return signed_hadamard_inverse(y, consts["signs"])
    return y


def normalize_rotate(x: np.ndarray, consts: Consts) -> tuple[np.ndarray, np.ndarray]:
    """(n, v): the float32 norms ||x|| and the rotated unit vectors R x / n (zero for a zero x)."""
    x = np.asarray(x, dtype=np.float32)
    n = np.linalg.norm(x, axis=-1)
    return n, rotate(x / np.where(n > 0, n, 1)[..., None], consts)


def rotate_queries(q: np.ndarray, consts: Consts, kv_heads: int) -> np.ndarray:
    """R q for queries ``[b, q_heads, q_len, d]``, each query head rotated by its kv head's R."""
    return from_kv_head(rotate(by_kv_head(q, kv_heads), consts), q.shape)


def unrotate_output(out: np.ndarray, consts: Consts, kv_heads: int) -> np.ndarray:
    """R^T out for an attention output ``[b, q_heads, q_len, d]`` computed in the rotated domain."""
    return from_kv_head(unrotate(by_kv_head(out, kv_heads), consts), out.shape)
