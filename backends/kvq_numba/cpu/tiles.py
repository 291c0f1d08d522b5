"""Register tiles of four query rows over float32 rows (decoded codes) in 8-lane vectors
(:mod:`kvq_numba.cpu.simd`), for the kernels that decode a block of rows before attending
(OCTOPUS: rho * direction per triplet).

Both keep eight accumulators in registers: logits four rows by two tokens per pass over ``d``;
``P @ V`` four rows by two 8-channel vectors per pass over the block's tokens. ``d`` is a
multiple of 16. On AVX-512 hosts the 16-lane tiles (:func:`logits16`, :func:`weighted_rows16`; ``d`` a
multiple of 32) take four rows by four tokens per logits pass and two 16-channel vectors per ``P @ V`` pass. A tile computes only its real rows (``nr``): each is compiled once per row count
1-4, the count a constant in each copy, so a GQA group of 3 (SmolLM2, Qwen) or 1 (multi-head
attention) does not pay for the padding rows' multiplies (the planes kernel does the same,
:mod:`kvq_numba.cpu.attend_planes`).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kvq_numba.cpu.simd import (vaccumulate, vaccumulate16, vbroadcast, vbroadcast16, vfma, vhsum, vload, vload16, vmul,
                                vrepeat4, vstore_rows4, vsums4x4, vzero, vzero16)

#: query rows per tile
ROWS = 4


@njit(cache=True, inline="always")
def tile_of(job, nhk, nr):
    """(batch, KV head, first query row, rows) of the ``prange`` job ``job`` over (batch, KV
    head, tile of :data:`ROWS` of the ``nr`` query rows)."""
    ntile = (nr + ROWS - 1) // ROWS
    bh, tile = job // ntile, job % ntile
    r0 = tile * ROWS
    return bh // nhk, bh % nhk, r0, min(ROWS, nr - r0)


@njit(cache=True, inline="always")
def tile_queries(q, b, h, r0, nrt):
    """The tile's query rows ``q[b, h, r0:r0 + nrt]`` flat [ROWS * d], zero rows after them, and
    its zeroed softmax state: running max ``m``, sum ``l`` and output ``acc`` [ROWS * d]."""
    d = q.shape[3]
    qf = np.zeros(ROWS * d, np.float32)
    for r in range(nrt):
        for c in range(d):
            qf[r * d + c] = q[b, h, r0 + r, c]
    return qf, np.full(ROWS, -np.inf, np.float32), np.zeros(ROWS, np.float32), np.zeros(ROWS * d, np.float32)


@njit(cache=True, inline="always")
def write_tile(acc, m, l, b, h, r0, nrt, out, lse) -> None:
    """``out[b, h, r0 + r] = acc[r] / l[r]`` and ``lse = m + log(l)`` for the tile's real rows."""
    d = out.shape[3]
    for r in range(nrt):
        inv = np.float32(1) / l[r]
        for c in range(d):
            out[b, h, r0 + r, c] = acc[r * d + c] * inv
        lse[b, h, r0 + r] = m[r] + np.log(l[r])


@njit(fastmath=True, cache=True, inline="always")
def _logits(qf, kf, d, n, tok, p, nr) -> None:
    """``p[r, i] = (qf[r] . kf[i]) * tok[i]`` for ``i < n``: ``qf`` [4 * d] and ``kf`` [>= n * d]
    flat rows; rows from ``nr`` on (zero queries) get 0 without a multiply (``nr`` is a constant in
    each inlined copy, :func:`logits`); an odd last token is computed twice."""
    for i in range(0, n, 2):
        i1 = min(i + 1, n - 1)
        a00, a01, a10, a11 = vzero(), vzero(), vzero(), vzero()
        a20, a21, a30, a31 = vzero(), vzero(), vzero(), vzero()
        o0, o1 = i * d, i1 * d
        for c in range(0, d, 8):
            k0 = vload(kf, o0 + c)
            k1 = vload(kf, o1 + c)
            q = vload(qf, c)
            a00, a01 = vfma(q, k0, a00), vfma(q, k1, a01)
            if nr > 1:
                q = vload(qf, d + c)
                a10, a11 = vfma(q, k0, a10), vfma(q, k1, a11)
            if nr > 2:
                q = vload(qf, 2 * d + c)
                a20, a21 = vfma(q, k0, a20), vfma(q, k1, a21)
            if nr > 3:
                q = vload(qf, 3 * d + c)
                a30, a31 = vfma(q, k0, a30), vfma(q, k1, a31)
        ta, tb = tok[i], tok[i1]
        p[0, i], p[0, i1] = vhsum(a00) * ta, vhsum(a01) * tb
        p[1, i], p[1, i1] = vhsum(a10) * ta, vhsum(a11) * tb
        p[2, i], p[2, i1] = vhsum(a20) * ta, vhsum(a21) * tb
        p[3, i], p[3, i1] = vhsum(a30) * ta, vhsum(a31) * tb


@njit(fastmath=True, cache=True)
def logits(qf, kf, d, n, tok, p, nr) -> None:
    """:func:`_logits` for a tile whose first ``nr`` rows are real: one inlined copy per row count, so
    a tile of fewer than four rows (GQA groups of 1-3, the last tile of a group of 5-7) multiplies
    only those (a called function, not inlined: four copies inlined into every kernel doubled its
    compile time)."""
    if nr >= 4:
        _logits(qf, kf, d, n, tok, p, 4)
    elif nr == 3:
        _logits(qf, kf, d, n, tok, p, 3)
    elif nr == 2:
        _logits(qf, kf, d, n, tok, p, 2)
    else:
        _logits(qf, kf, d, n, tok, p, 1)


@njit(fastmath=True, cache=True, inline="always")
def _weighted_rows(pw, sb, vf, d, n, acc, nr) -> None:
    """``acc[r, c] += sum_i pw[r * sb + i] * vf[i, c]`` for ``i < n`` and rows ``r < nr`` (``acc``
    [4 * d], ``vf`` [>= n * d] flat rows; ``nr`` a constant per inlined copy, :func:`weighted_rows`)."""
    for c in range(0, d, 16):
        a00, a01, a10, a11 = vzero(), vzero(), vzero(), vzero()
        a20, a21, a30, a31 = vzero(), vzero(), vzero(), vzero()
        for i in range(n):
            v0 = vload(vf, i * d + c)
            v1 = vload(vf, i * d + c + 8)
            w = vbroadcast(pw, i)
            a00, a01 = vfma(w, v0, a00), vfma(w, v1, a01)
            if nr > 1:
                w = vbroadcast(pw, sb + i)
                a10, a11 = vfma(w, v0, a10), vfma(w, v1, a11)
            if nr > 2:
                w = vbroadcast(pw, 2 * sb + i)
                a20, a21 = vfma(w, v0, a20), vfma(w, v1, a21)
            if nr > 3:
                w = vbroadcast(pw, 3 * sb + i)
                a30, a31 = vfma(w, v0, a30), vfma(w, v1, a31)
        vaccumulate(acc, c, a00)
        vaccumulate(acc, c + 8, a01)
        vaccumulate(acc, d + c, a10)
        vaccumulate(acc, d + c + 8, a11)
        vaccumulate(acc, 2 * d + c, a20)
        vaccumulate(acc, 2 * d + c + 8, a21)
        vaccumulate(acc, 3 * d + c, a30)
        vaccumulate(acc, 3 * d + c + 8, a31)


@njit(fastmath=True, cache=True)
def weighted_rows(pw, sb, vf, d, n, acc, nr) -> None:
    """:func:`_weighted_rows` for a tile whose first ``nr`` rows are real, one inlined copy per row count
    (as :func:`logits`)."""
    if nr >= 4:
        _weighted_rows(pw, sb, vf, d, n, acc, 4)
    elif nr == 3:
        _weighted_rows(pw, sb, vf, d, n, acc, 3)
    elif nr == 2:
        _weighted_rows(pw, sb, vf, d, n, acc, 2)
    else:
        _weighted_rows(pw, sb, vf, d, n, acc, 1)


@njit(fastmath=True, cache=True, inline="always")
def _logits16(qf, kf, d, n, tok, pf, sb, nr) -> None:
    """``pf[r * sb + i] = (qf[r] . kf[i]) * tok[i]`` for ``i < n`` (``qf`` [4 * d], ``kf`` [>= n * d] flat rows,
    ``d`` a multiple of 16): four rows by four tokens per pass in 16-lane vectors, the sixteen dot products
    reduced by one transposing tree (:func:`vsums4x4`) and stored as four rows of four. Tokens past ``n`` up to
    the pass's end repeat the last one, times their stale (finite) ``tok``; rows from ``nr`` on get 0 (``nr`` a
    constant per inlined copy, :func:`logits16`)."""
    for i in range(0, n, 4):
        o0, o1, o2, o3 = i * d, min(i + 1, n - 1) * d, min(i + 2, n - 1) * d, min(i + 3, n - 1) * d
        a00, a01, a02, a03 = vzero16(), vzero16(), vzero16(), vzero16()
        a10, a11, a12, a13 = vzero16(), vzero16(), vzero16(), vzero16()
        a20, a21, a22, a23 = vzero16(), vzero16(), vzero16(), vzero16()
        a30, a31, a32, a33 = vzero16(), vzero16(), vzero16(), vzero16()
        for c in range(0, d, 16):
            k0, k1, k2, k3 = vload16(kf, o0 + c), vload16(kf, o1 + c), vload16(kf, o2 + c), vload16(kf, o3 + c)
            q = vload16(qf, c)
            a00, a01, a02, a03 = vfma(q, k0, a00), vfma(q, k1, a01), vfma(q, k2, a02), vfma(q, k3, a03)
            if nr > 1:
                q = vload16(qf, d + c)
                a10, a11, a12, a13 = vfma(q, k0, a10), vfma(q, k1, a11), vfma(q, k2, a12), vfma(q, k3, a13)
            if nr > 2:
                q = vload16(qf, 2 * d + c)
                a20, a21, a22, a23 = vfma(q, k0, a20), vfma(q, k1, a21), vfma(q, k2, a22), vfma(q, k3, a23)
            if nr > 3:
                q = vload16(qf, 3 * d + c)
                a30, a31, a32, a33 = vfma(q, k0, a30), vfma(q, k1, a31), vfma(q, k2, a32), vfma(q, k3, a33)
        sums = vsums4x4(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)
        vstore_rows4(pf, i, sb, vmul(sums, vrepeat4(tok, i)))


@njit(fastmath=True, cache=True)
def logits16(qf, kf, d, n, tok, pf, sb, nr) -> None:
    """:func:`_logits16` for a tile whose first ``nr`` rows are real, one inlined copy per row count (as
    :func:`kvq_numba.cpu.tiles.logits`)."""
    if nr >= 4:
        _logits16(qf, kf, d, n, tok, pf, sb, 4)
    elif nr == 3:
        _logits16(qf, kf, d, n, tok, pf, sb, 3)
    elif nr == 2:
        _logits16(qf, kf, d, n, tok, pf, sb, 2)
    else:
        _logits16(qf, kf, d, n, tok, pf, sb, 1)


@njit(fastmath=True, cache=True, inline="always")
def _weighted_rows16(pw, sb, vf, d, n, acc, nr) -> None:
    """``acc[r, c] += sum_i pw[r * sb + i] * vf[i, c]`` for ``i < n`` and rows ``r < nr`` (``acc`` [4 * d], ``vf``
    [>= n * d] flat rows, ``d`` a multiple of 32): four rows by two 16-channel vectors per pass over the tokens,
    accumulators in registers (``nr`` a constant per inlined copy, :func:`weighted_rows16`)."""
    for c in range(0, d, 32):
        a00, a01, a10, a11 = vzero16(), vzero16(), vzero16(), vzero16()
        a20, a21, a30, a31 = vzero16(), vzero16(), vzero16(), vzero16()
        for i in range(n):
            v0, v1 = vload16(vf, i * d + c), vload16(vf, i * d + c + 16)
            w = vbroadcast16(pw, i)
            a00, a01 = vfma(w, v0, a00), vfma(w, v1, a01)
            if nr > 1:
                w = vbroadcast16(pw, sb + i)
                a10, a11 = vfma(w, v0, a10), vfma(w, v1, a11)
            if nr > 2:
                w = vbroadcast16(pw, 2 * sb + i)
                a20, a21 = vfma(w, v0, a20), vfma(w, v1, a21)
            if nr > 3:
                w = vbroadcast16(pw, 3 * sb + i)
                a30, a31 = vfma(w, v0, a30), vfma(w, v1, a31)
        vaccumulate16(acc, c, a00)
        vaccumulate16(acc, c + 16, a01)
        if nr > 1:
            vaccumulate16(acc, d + c, a10)
            vaccumulate16(acc, d + c + 16, a11)
        if nr > 2:
            vaccumulate16(acc, 2 * d + c, a20)
            vaccumulate16(acc, 2 * d + c + 16, a21)
        if nr > 3:
            vaccumulate16(acc, 3 * d + c, a30)
            vaccumulate16(acc, 3 * d + c + 16, a31)


@njit(fastmath=True, cache=True)
def weighted_rows16(pw, sb, vf, d, n, acc, nr) -> None:
    """:func:`_weighted_rows16` for a tile whose first ``nr`` rows are real, one inlined copy per row count."""
    if nr >= 4:
        _weighted_rows16(pw, sb, vf, d, n, acc, 4)
    elif nr == 3:
        _weighted_rows16(pw, sb, vf, d, n, acc, 3)
    elif nr == 2:
        _weighted_rows16(pw, sb, vf, d, n, acc, 2)
    else:
        _weighted_rows16(pw, sb, vf, d, n, acc, 1)
