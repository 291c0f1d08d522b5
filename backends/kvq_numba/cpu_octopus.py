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

from kvq_numba.cpu_common import FWHT_ROWS, fwht_rows, pack_row, sum_squares, unpack_rows

#: (xi, eta) index offsets joint rounding tries, centre first (kvq_numpy.octopus._NEIGHBOURS)
NEIGHBOURS = np.array([(0, 0)] + [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1) if (a, b) != (0, 0)], np.int64)


@njit(inline="always", cache=True)
def _bucket(thresholds, x) -> int:
    """Nearest-centroid index: how many thresholds are <= x (searchsorted side="right")."""
    k = 0
    for j in range(thresholds.shape[0]):
        if thresholds[j] <= x:
            k += 1
    return k


@njit(inline="always", cache=True)
def _sgn(x):
    return np.float32(1) if x >= 0 else np.float32(-1)


@njit(inline="always", cache=True)
def _triplet_code(x, y, z, xi_th, eta_th, rho_th, dirs, n_xi, n_eta, eta_bits, rho_bits, joint) -> int:
    """The code ``(i_xi << (eta_bits + rho_bits)) | (i_eta << rho_bits) | i_rho`` of one triplet."""
    l1 = abs(x) + abs(y) + abs(z)
    if l1 == 0:
        px, py, pz = np.float32(0), np.float32(0), np.float32(1)
    else:
        px, py, pz = x / l1, y / l1, z / l1
    if pz < 0:
        xi = _sgn(px) * (np.float32(1) - abs(py))
        eta = _sgn(py) * (np.float32(1) - abs(px))
    else:
        xi, eta = px, py
    i_xi = _bucket(xi_th, xi)
    i_eta = _bucket(eta_th, eta)
    if joint:
        best_s = np.float32(-np.inf)
        bx, be = i_xi, i_eta
        for k in range(NEIGHBOURS.shape[0]):
            cx = min(max(i_xi + NEIGHBOURS[k, 0], 0), n_xi - 1)
            ce = min(max(i_eta + NEIGHBOURS[k, 1], 0), n_eta - 1)
            dv = dirs[cx * n_eta + ce]
            s = x * dv[0] + y * dv[1] + z * dv[2]
            if s > best_s:
                best_s, bx, be = s, cx, ce
        i_xi, i_eta = bx, be
        i_rho = _bucket(rho_th, max(best_s, np.float32(0)))
    else:
        i_rho = _bucket(rho_th, np.sqrt(x * x + y * y + z * z))
    return (i_xi << (eta_bits + rho_bits)) | (i_eta << rho_bits) | i_rho


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
                    row[j] = _triplet_code(v[i, 3 * j], v[i, 3 * j + 1], v[i, 3 * j + 2], xi_th, eta_th, rho_th, dirs,
                                           n_xi, n_eta, eta_bits, rho_bits, joint)
                pack_row(row, bits, codes[b, h, t0 + i])
    return codes, gamma


@njit(inline="always", cache=True)
def decode_rows(codes2d, t0, n, bits, eta_bits, rho_bits, n_eta, rho_cb, dirs, cbuf, out) -> None:
    """Rows ``out[0 .. n]`` [.., d] = the rotated unit vectors (rho * direction per triplet, gamma
    not applied) of code rows ``t0 .. t0+n``; ``cbuf`` int32 [>= n, n_triplets] is scratch."""
    d = out.shape[1]
    ntrip = cbuf.shape[1]
    unpack_rows(codes2d, t0, n, bits, ntrip, cbuf)
    eta_mask = (1 << eta_bits) - 1
    rho_mask = (1 << rho_bits) - 1
    for i in range(n):
        for j in range(ntrip):
            c = cbuf[i, j]
            r = rho_cb[c & rho_mask]
            pair = (c >> (eta_bits + rho_bits)) * n_eta + ((c >> rho_bits) & eta_mask)
            for k in range(3):
                if 3 * j + k < d:
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
