"""Numba CPU kernels of OCTOPUS (kvq_numpy.octopus): per head vector, the norm gamma, the seeded
signed Hadamard rotation ``v = H diag(s) x / gamma``, and one code per triplet of v (octahedral
direction xi/eta and triplet norm rho, nearest centroid; "joint" rounding tries the 3x3 index
neighbourhood of (xi, eta) and keeps the one with the largest projection).

Encode repeats the reference's float32 steps without fastmath (norms in NumPy's pairwise order),
so codes are bitwise the reference's.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu_common import FWHT_ROWS, fwht_rows, pack_row, sum_squares
from kvq_numba.rules import triplet_code

@njit(parallel=True, cache=True)
def encode(x, signs, inv_sqrt_d, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, bits, joint):
    """Codes uint8 [b, h, t, row_bytes] and norms gamma float32 [b, h, t] of float32 x [b, h, t, d]."""
    nb, nh, nt, d = x.shape
    ntrip = (d + 2) // 3
    nbytes = (ntrip * bits + 7) // 8
    codes = np.zeros((nb, nh, nt, nbytes), np.uint8)
    gamma = np.empty((nb, nh, nt), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        su = np.empty((FWHT_ROWS, d), np.float32)
        v = np.zeros((FWHT_ROWS, 3 * ntrip), np.float32)  # zero tail: the padded triplet
        tb = np.zeros((d, FWHT_ROWS), np.float32)
        row = np.empty(ntrip, np.int32)
        for t0 in range(0, nt, FWHT_ROWS):
            n = min(FWHT_ROWS, nt - t0)
            for i in range(n):
                g = np.sqrt(sum_squares(x[b, h, t0 + i], d))
                gamma[b, h, t0 + i] = g
                g = g if g > 0 else np.float32(1)
                for c in range(d):
                    su[i, c] = signs[h, c] * (x[b, h, t0 + i, c] / g)
            fwht_rows(su, 0, n, inv_sqrt_d, v[:, :d], tb)
            for i in range(n):
                for j in range(ntrip):
                    row[j] = triplet_code(v[i, 3 * j], v[i, 3 * j + 1], v[i, 3 * j + 2], xi_th, eta_th, rho_th, dirs,
                                           n_xi, n_eta, eta_bits, rho_bits, joint)
                pack_row(row, bits, codes[b, h, t0 + i])
    return codes, gamma


@njit(inline="always", cache=True)
def _code_at(row, j, bits, mask, nbytes) -> int:
    """Code ``j`` (``bits`` <= 16) of a packed row: up to three bytes from bit ``j * bits``."""
    p = j * bits
    k = p >> 3
    v = np.int32(row[k])
    if k + 1 < nbytes:
        v |= np.int32(row[k + 1]) << 8
    if k + 2 < nbytes:
        v |= np.int32(row[k + 2]) << 16
    return (v >> (p & 7)) & mask


@njit(inline="always", cache=True)
def decode_rows(codes2d, t0, n, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs, cbuf, out) -> None:
    """Rows ``out[0 .. n]`` [.., d] = the rotated unit vectors (rho * direction per triplet, gamma
    not applied) of code rows ``t0 .. t0+n``; ``cbuf`` int32 [>= n, n_triplets] is scratch.

    Each code is read on its own (no serial bitstream), so the loops pipeline."""
    d = out.shape[1]
    ntrip = cbuf.shape[1]
    nbytes = codes2d.shape[1]
    full = d // 3
    mask = (1 << bits) - 1
    eta_mask = (1 << eta_bits) - 1
    rho_mask = (1 << rho_bits) - 1
    shift = eta_bits + rho_bits
    for i in range(n):
        row = codes2d[t0 + i]
        for j in range(ntrip):
            cbuf[i, j] = _code_at(row, j, bits, mask, nbytes)
        for j in range(full):
            c = cbuf[i, j]
            r = rho_cb[c & rho_mask]
            pair = (c >> shift) * n_eta + ((c >> rho_bits) & eta_mask)
            out[i, 3 * j] = r * dirs[pair, 0]
            out[i, 3 * j + 1] = r * dirs[pair, 1]
            out[i, 3 * j + 2] = r * dirs[pair, 2]
        for j in range(full, ntrip):  # the zero-padded last triplet
            c = cbuf[i, j]
            r = rho_cb[c & rho_mask]
            pair = (c >> shift) * n_eta + ((c >> rho_bits) & eta_mask)
            for k in range(d - 3 * j):
                out[i, 3 * j + k] = r * dirs[pair, k]


@njit(parallel=True, cache=True)
def decode(codes, gamma, signs, inv_sqrt_d, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs, d):
    """``gamma * diag(s) H v_hat``: decoded vectors float32 [b, h, t, d] in the original domain."""
    nb, nh, nt = codes.shape[:3]
    ntrip = (d + 2) // 3
    out = np.empty((nb, nh, nt, d), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        cbuf = np.empty((FWHT_ROWS, ntrip), np.int32)
        vr = np.empty((FWHT_ROWS, d), np.float32)
        tb = np.zeros((d, FWHT_ROWS), np.float32)
        y = out[b, h]
        for t0 in range(0, nt, FWHT_ROWS):
            n = min(FWHT_ROWS, nt - t0)
            decode_rows(codes[b, h], t0, n, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs, cbuf, vr)
            fwht_rows(vr, 0, n, inv_sqrt_d, y[t0:t0 + n], tb)
            for i in range(n):
                g = gamma[b, h, t0 + i]
                for c in range(d):
                    y[t0 + i, c] = g * (signs[h, c] * y[t0 + i, c])
    return out


@njit(parallel=True, cache=True)
def signed_rotate(x, signs, inv_sqrt_d):
    """``H diag(s_h) x`` per row of float32 x [b, h, n, d] (queries grouped by KV head)."""
    nb, nh, nt, d = x.shape
    y = np.empty_like(x)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        su = np.empty((FWHT_ROWS, d), np.float32)
        tb = np.zeros((d, FWHT_ROWS), np.float32)
        for t0 in range(0, nt, FWHT_ROWS):
            n = min(FWHT_ROWS, nt - t0)
            for i in range(n):
                for c in range(d):
                    su[i, c] = signs[h, c] * x[b, h, t0 + i, c]
            fwht_rows(su, 0, n, inv_sqrt_d, y[b, h, t0:t0 + n], tb)
    return y


@njit(parallel=True, cache=True)
def signed_unrotate(y, signs, inv_sqrt_d):
    """``diag(s_h) H y`` per row of float32 y [b, h, n, d], the inverse of :func:`signed_rotate`."""
    nb, nh, nt, d = y.shape
    x = np.empty_like(y)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        tb = np.zeros((d, FWHT_ROWS), np.float32)
        for t0 in range(0, nt, FWHT_ROWS):
            n = min(FWHT_ROWS, nt - t0)
            fwht_rows(y[b, h], t0, n, inv_sqrt_d, x[b, h], tb)
            for i in range(n):
                for c in range(d):
                    x[b, h, t0 + i, c] *= signs[h, c]
    return x
