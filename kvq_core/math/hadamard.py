"""Orthonormal (block) Sylvester Walsh-Hadamard matrices and the fast transform that applies them.

Rotating a head vector by ``H_d`` spreads its energy evenly over its coordinates, which is what
makes per-coordinate codebooks work; the fast transform does this in O(d log d).

For a head_dim ``d`` that is not a power of two (80, 96, 112, 160, 192, ...), ``H_d`` is the
block-diagonal matrix ``I_{d/B} (x) H_B`` with ``B = hadamard_block(d)``, the largest power of two
dividing ``d``: each run of ``B`` consecutive coordinates is rotated by the Sylvester ``H_B``.
It is still symmetric, orthonormal and its own inverse, and a power-of-two ``d`` gives the
plain ``H_d`` (``B = d``). The cost is weaker mixing: energy spreads over ``B`` coordinates,
not ``d`` (``kvq bench fidelity`` measures it at head_dim 96 against 128).
"""
from __future__ import annotations

import functools
import operator

import numpy as np

from kvq_core.errors import InputError, SpecError

__all__ = ["is_power_of_two", "hadamard_block", "dense_hadamard_block", "sylvester_hadamard", "fwht", "MAX_DENSE_HADAMARD"]

#: Largest Hadamard block handed to kernels as a dense matrix (64 KiB in float32): kernels that
#: rotate by a matmul (:func:`dense_hadamard_block`) multiply each run of that many coordinates by
#: it and finish the larger blocks with butterfly stages, so no d x d matrix is ever built.
MAX_DENSE_HADAMARD = 128


def is_power_of_two(n: int) -> bool:
    """True iff ``n`` is an integer (not a bool) equal to 2**k for some k >= 0."""
    if isinstance(n, bool):
        return False
    try:
        n = operator.index(n)
    except TypeError:
        return False
    return n >= 1 and (n & (n - 1)) == 0


def _check_dim(d: int) -> int:
    if isinstance(d, bool):
        raise SpecError("hadamard", "d", d, "a positive integer")
    try:
        d = operator.index(d)
    except TypeError:
        raise SpecError("hadamard", "d", d, "a positive integer") from None
    if d < 1:
        raise SpecError("hadamard", "d", d, "a positive integer")
    return d


def hadamard_block(d: int) -> int:
    """The Hadamard block size of dimension ``d``: the largest power of two dividing ``d``."""
    d = _check_dim(d)
    return d & -d


def dense_hadamard_block(d: int) -> int:
    """The dense factor of ``H_d`` for matmul kernels: ``min(hadamard_block(d), MAX_DENSE_HADAMARD)``.

    Sylvester matrices factor as ``H_B = H_{B/m} (x) H_m``, so ``x @ H_d`` is ``x @ H_m`` on each run
    of ``m`` coordinates followed by the butterfly stages of half-width m, 2m, ..., B/2."""
    return min(hadamard_block(d), MAX_DENSE_HADAMARD)


def sylvester_hadamard(d: int) -> np.ndarray:
    """Return the read-only float64 ``(d, d)`` matrix ``I_{d/B} (x) H_B``, ``B = hadamard_block(d)``,
    with ``H_B[i, j] = (-1)**popcount(i & j) / sqrt(B)`` (the plain Sylvester matrix when ``d`` is
    a power of two).

    It is symmetric, orthonormal and its own inverse. Results are cached per ``d``.
    """
    return _sylvester_hadamard(_check_dim(d))


@functools.lru_cache(maxsize=16)
def _sylvester_hadamard(d: int) -> np.ndarray:
    h = fwht(np.eye(d))  # rows of I @ H
    h.flags.writeable = False
    return h


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """float32 for half/single precision floats, float64 for everything else that is real."""
    if dtype.kind == "f" and dtype.itemsize <= 4:
        return np.dtype(np.float32)
    if dtype.kind in "fiub":
        return np.dtype(np.float64)
    raise InputError(f"fwht: expected a real array, got dtype {dtype}")


def fwht(x: np.ndarray) -> np.ndarray:
    """Orthonormal fast Walsh-Hadamard transform along the last axis: ``x @ sylvester_hadamard(d)``.

    Uses log2(B) vectorised butterfly stages, ``B = hadamard_block(d)`` (each block of ``B``
    coordinates transformed on its own). float64 (and integer) input gives float64;
    float32/float16 input gives float32. The transform is its own inverse.
    """
    a = np.asarray(x)
    if a.ndim == 0:
        raise InputError("fwht: expected an array with at least one axis")
    d = _check_dim(a.shape[-1])
    dtype = _work_dtype(a.dtype)
    lead = a.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    y = a.astype(dtype).reshape(rows, d)
    block = d & -d
    h = 1
    while h < block:
        y = y.reshape(rows, d // (2 * h), 2, h)
        top, bottom = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack((top + bottom, top - bottom), axis=2)
        h *= 2
    y = y.reshape(lead + (d,))
    y *= dtype.type(1.0 / np.sqrt(block))
    return y
