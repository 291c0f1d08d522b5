"""Octahedral map between unit 3-vectors and the square [-1, 1]^2 (Cigolle et al., JCGT 2014).

OCTOPUS stores a triplet's direction as two scalars (xi, eta). ``sgn`` here is "sign not zero"
(+1 at 0, also at -0.0). The map is *not* equal-area: see :func:`oct_density`.
"""
from __future__ import annotations

import numpy as np

from kvq_core.errors import InputError

__all__ = ["JOINT_NEIGHBOURS", "oct_encode", "oct_decode", "oct_point_norm", "oct_density"]

#: (xi, eta) codebook index offsets OCTOPUS's joint rounding tries, in this order in every backend:
#: the centre first, so that ties (e.g. an all-zero triplet, where every candidate scores 0) keep
#: the plain indices.
JOINT_NEIGHBOURS = ((0, 0),) + tuple((a, b) for a in (-1, 0, 1) for b in (-1, 0, 1) if (a, b) != (0, 0))


def _float(a: np.ndarray) -> np.ndarray:
    """View ``a`` as float32 if it already is, else as float64."""
    a = np.asarray(a)
    return a if a.dtype == np.float32 else a.astype(np.float64)


def _sgn(x: np.ndarray) -> np.ndarray:
    """Sign-not-zero: +1 where x >= 0 (including -0.0), else -1, in x's dtype."""
    return np.where(x >= 0, x.dtype.type(1), x.dtype.type(-1))


def oct_encode(n: np.ndarray) -> np.ndarray:
    """Map ``(..., 3)`` nonzero vectors to ``(..., 2)`` points (xi, eta) in [-1, 1]^2.

    The upper hemisphere goes to the diamond |xi|+|eta| <= 1, the lower one to the four corners.
    The zero vector is treated as (0, 0, 1) and maps to (0, 0).
    """
    v = _float(n)
    if v.ndim == 0 or v.shape[-1] != 3:
        raise InputError(f"oct_encode: expected shape (..., 3), got {v.shape}")
    l1 = np.abs(v).sum(axis=-1, keepdims=True)
    zero = l1 == 0
    p = np.where(zero, np.asarray([0, 0, 1], dtype=v.dtype), v) / np.where(zero, l1.dtype.type(1), l1)
    px, py, pz = p[..., 0], p[..., 1], p[..., 2]
    lower = pz < 0
    xi = np.where(lower, _sgn(px) * (1 - np.abs(py)), px)
    eta = np.where(lower, _sgn(py) * (1 - np.abs(px)), py)
    return np.stack((xi, eta), axis=-1)


def _oct_point(xi: np.ndarray, eta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Point p on the octahedron |x|+|y|+|z| = 1 that (xi, eta) encodes."""
    z = 1 - np.abs(xi) - np.abs(eta)
    lower = z < 0
    x = np.where(lower, _sgn(xi) * (1 - np.abs(eta)), xi)
    y = np.where(lower, _sgn(eta) * (1 - np.abs(xi)), eta)
    return x, y, z


def oct_decode(e: np.ndarray) -> np.ndarray:
    """Map ``(..., 2)`` points (xi, eta) in [-1, 1]^2 to ``(..., 3)`` unit vectors."""
    v = _float(e)
    if v.ndim == 0 or v.shape[-1] != 2:
        raise InputError(f"oct_decode: expected shape (..., 2), got {v.shape}")
    p = np.stack(_oct_point(v[..., 0], v[..., 1]), axis=-1)
    return p / np.linalg.norm(p, axis=-1, keepdims=True)


def oct_point_norm(xi: np.ndarray, eta: np.ndarray) -> np.ndarray:
    """Euclidean norm of the octahedron point encoded by (xi, eta); lies in [1/sqrt(3), 1]."""
    xi, eta = np.broadcast_arrays(_float(xi), _float(eta))
    dtype = np.result_type(xi, eta)
    x, y, z = _oct_point(xi.astype(dtype), eta.astype(dtype))
    return np.sqrt(x * x + y * y + z * z)


def oct_density(xi: np.ndarray, eta: np.ndarray) -> np.ndarray:
    """Density on [-1, 1]^2 of (xi, eta) for a uniform direction: ``1 / (4 pi |p|^3)``.

    Each octahedron face projects onto the square without area change, and a face patch of
    area dA at p subtends a solid angle dA / |p|^3 (in square coordinates), hence the formula.
    Its max/min ratio is 3*sqrt(3).
    """
    r = oct_point_norm(xi, eta)
    return 1 / (4 * np.pi * r**3)
