"""Torch helpers shared by the rotation codecs (mirrors ``kvq_numpy/rotation.py`` and the GQA
grouping of ``kvq_numpy/attention.py``).

Vectors sit on the last axis of ``[b, kv_heads, n, d]``; per-head rotations take their kv head's
R_h. A method's constants describe its rotation:

- ``signs`` ``[kv_heads, d]``: the randomized Hadamard R_h = H diag(s_h) (OCTOPUS, PolarQuant, TurboQuant);
- ``rotation`` ``[kv_heads, d, d]``: dense orthogonal (Haar) matrices R_h (TurboQuant ``rotation="haar"``);
- neither: no rotation (PolarQuant ``rotation="none"``).

Queries ``[b, q_heads, q_len, d]`` are grouped as ``[b, kv_heads, g * q_len, d]`` (query head i
reads kv head i // g) so each row meets its kv head's rotation: rotate a query once, score in
the rotated domain, un-rotate the output once.

Norms reproduce ``np.linalg.norm`` bit for bit: :func:`numpy_sum` adds in NumPy's pairwise
order and :func:`sqrt_rn` rounds the square root correctly (eager CPU ``torch.sqrt`` on float32
may be 1 ulp off, inductor's is exact). Both are elementwise only, so eager, inductor and the
reference agree. Pure tensor code: no NumPy, no branches on tensor values.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kvq_torch.common import Consts, fwht

#: NumPy's pairwise summation: 8 accumulators up to this many terms, halving above it.
_PW_BLOCK = 128
_PW_LANES = 8


# --------------------------------------------------------------------------------------------
# float32 sums and norms in the reference's order
# --------------------------------------------------------------------------------------------
def numpy_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis in the order of NumPy's float32 ``np.add.reduce`` (pairwise_sum)."""
    n = x.shape[-1]
    if n < _PW_LANES:
        total = x[..., 0]
        for i in range(1, n):
            total = total + x[..., i]
        return total
    if n <= _PW_BLOCK:
        whole = n - n % _PW_LANES
        r = x[..., :_PW_LANES]
        for i in range(_PW_LANES, whole, _PW_LANES):
            r = r + x[..., i : i + _PW_LANES]
        total = ((r[..., 0] + r[..., 1]) + (r[..., 2] + r[..., 3])) + ((r[..., 4] + r[..., 5]) + (r[..., 6] + r[..., 7]))
        for i in range(whole, n):
            total = total + x[..., i]
        return total
    half = n // 2
    half -= half % _PW_LANES
    return numpy_sum(x[..., :half]) + numpy_sum(x[..., half:])


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (through float64), as NumPy's ``np.sqrt``."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def norm(x: torch.Tensor) -> torch.Tensor:
    """float32 Euclidean norm over the last axis, bit-identical to ``np.linalg.norm(x, axis=-1)``."""
    x = x.to(torch.float32)
    return sqrt_rn(numpy_sum(x * x))


# --------------------------------------------------------------------------------------------
# rotations of [b, kv_heads, n, d] blocks
# --------------------------------------------------------------------------------------------
def _per_head(signs: torch.Tensor) -> torch.Tensor:
    """Signs ``[kv_heads, d]`` as ``[kv_heads, 1, d]``, to broadcast over ``[b, kv_heads, n, d]``."""
    return signs.reshape(signs.shape[0], 1, signs.shape[-1])


def signed_hadamard(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R x = H diag(s) x per kv head, for signs ``[kv_heads, d]``."""
    return fwht(_per_head(signs) * x)


def signed_hadamard_inverse(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R^T y = diag(s) H y per kv head, the inverse of :func:`signed_hadamard`."""
    return _per_head(signs) * fwht(y)


def orthogonal(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """R x per kv head for orthogonal matrices ``[kv_heads, d, d]`` (row vectors: ``x @ R^T``)."""
    return torch.matmul(x, mats.transpose(-1, -2))


def orthogonal_inverse(y: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """R^T y per kv head (row vectors: ``y @ R``), the inverse of :func:`orthogonal`."""
    return torch.matmul(y, mats)


def rotate(x: torch.Tensor, consts: Consts) -> torch.Tensor:
    """R x (float32) for ``x [b, kv_heads, n, d]`` with the rotation the constants describe."""
    x = x.to(torch.float32)
    if "rotation" in consts:
        return orthogonal(x, consts["rotation"])
    if "signs" in consts:
        return signed_hadamard(x, consts["signs"])
    return x


def unrotate(y: torch.Tensor, consts: Consts) -> torch.Tensor:
    """R^T y (float32), the inverse of :func:`rotate`."""
    y = y.to(torch.float32)
    if "rotation" in consts:
        return orthogonal_inverse(y, consts["rotation"])
    if "signs" in consts:
        return signed_hadamard_inverse(y, consts["signs"])
    return y


@functools.lru_cache(maxsize=32)
def _hadamard_matrix(d: int, device: str) -> torch.Tensor:
    """``H_d`` as the float32 matrix ``fwht(I)``, so ``x @ H_d`` uses exactly the entries :func:`fwht` applies."""
    return fwht(torch.eye(d, dtype=torch.float32, device=device))


def rotation_rows(consts: Consts, d: int, device: torch.device) -> torch.Tensor:
    """R as ``[kv_heads, d, d]`` matrices acting on row vectors (``x @ rows = R x`` per kv head; ``rows``'
    transpose un-rotates): one matmul rotates a decode step's few rows, where :func:`rotate`'s butterfly
    would cost its per-op overhead. Eager code only (the Hadamard matrix is cached per device)."""
    if "rotation" in consts:
        return consts["rotation"].transpose(-1, -2).to(torch.float32)
    if "signs" in consts:
        return consts["signs"].to(torch.float32).unsqueeze(-1) * _hadamard_matrix(d, str(device))
    return torch.eye(d, dtype=torch.float32, device=device).unsqueeze(0)


def normalize_rotate(x: torch.Tensor, consts: Consts) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, v): the float32 norms ||x|| and the rotated unit vectors R x / n (zero for a zero x)."""
    x = x.to(torch.float32)
    n = norm(x)
    return n, rotate(x / torch.where(n > 0, n, 1.0).unsqueeze(-1), consts)


# --------------------------------------------------------------------------------------------
# GQA grouping of queries and outputs
# --------------------------------------------------------------------------------------------
def by_kv_head(q: torch.Tensor, kv_heads: Any) -> torch.Tensor:
    """Queries ``[b, q_heads, q_len, d]`` as ``[b, kv_heads, g * q_len, d]`` (a reshape)."""
    return q.reshape(q.shape[0], kv_heads, -1, q.shape[-1])


def from_kv_head(x: torch.Tensor, q_shape: tuple[Any, ...]) -> torch.Tensor:
    """Inverse of :func:`by_kv_head`: ``[b, kv_heads, g * q_len, ...]`` as ``[b, q_heads, q_len, ...]``."""
    return x.reshape(*q_shape[:3], *x.shape[3:])


def rotate_queries(q: torch.Tensor, consts: Consts, kv_heads: Any) -> torch.Tensor:
    """R q (float32) for queries ``[b, q_heads, q_len, d]``, each head rotated by its kv head's R."""
    return from_kv_head(rotate(by_kv_head(q, kv_heads), consts), tuple(q.shape))


def unrotate_output(out: torch.Tensor, consts: Consts, kv_heads: Any) -> torch.Tensor:
    """R^T out for an attention output ``[b, q_heads, q_len, d]`` computed in the rotated domain."""
    return from_kv_head(unrotate(by_kv_head(out, kv_heads), consts), tuple(out.shape))
