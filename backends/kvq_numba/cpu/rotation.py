"""Numba CPU row transforms around the integer codes: the Hadamard rotation of head vectors and
OScaR's omni-token norm, with the reference's float32 arithmetic (kvq_numpy.intcodes)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu.common import fwht_heads, sum_squares


def rotate(x: np.ndarray, inv_sqrt_d: np.float32) -> np.ndarray:
    """``x H`` for C-contiguous float32 ``x`` [b, h, t, d]: every row multiplied by H (its own inverse)."""
    return fwht_heads(x, np.empty_like(x), inv_sqrt_d)


@njit(parallel=True, cache=True)
def unit_keys(kr):
    """OTS: (kr / n_t, n_t) with n_t the float32 L2 norm of token t over every head and channel
    (1 where not > 0), for rotated keys kr float32 [b, h, t, d]; norms are float32 [b, t], summed
    per head in NumPy's pairwise order, heads in sequence (bitwise the reference's)."""
    nb, nh, nt, d = kr.shape
    norm = np.zeros((nb, nt), np.float32)
    u = np.empty_like(kr)
    for b in range(nb):
        for t in prange(nt):
            ss = np.float32(0)
            for h in range(nh):
                ss += sum_squares(kr[b, h, t], d)
            n = np.sqrt(ss)
            norm[b, t] = n if n > 0 else np.float32(1)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        for t in range(nt):
            n = norm[b, t]
            for c in range(d):
                u[b, h, t, c] = kr[b, h, t, c] / n
    return u, norm


@njit(parallel=True, cache=True)
def scale_tokens(x, norm):
    """In place: ``x[b, h, t, :] *= norm[b, t]`` (undoing OTS on decoded unit keys)."""
    nb, nh, nt, d = x.shape
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        for t in range(nt):
            n = norm[b, t]
            for c in range(d):
                x[b, h, t, c] *= n
