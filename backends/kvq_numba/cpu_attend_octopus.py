"""Fused Numba CPU decode attention over OCTOPUS triplet codes.

Per (batch, KV head, tile of four query rows): each block of :data:`BLOCK` key rows is decoded
to rotated unit vectors (:func:`kvq_numba.cpu_octopus.decode_rows`: one table move per triplet)
and scored by the register tiles of :mod:`kvq_numba.cpu_tiles` (``logit = gamma_t <q, v_hat_t> *
scale``); online softmax; the value rows (``gamma * v_hat`` in the rotated domain, or float16
rows in the original domain) are decoded the same way and weighted in registers. Rows past the
query count in the last tile are zeros; their results are dropped. Decoded blocks stay in L1.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu_attend import online_softmax
from kvq_numba.cpu_octopus import decode_rows
from kvq_numba.cpu_simd import halves
from kvq_numba.cpu_tiles import ROWS, logits, tile_of, tile_queries, weighted_rows, write_tile

#: tokens per online-softmax block (two decoded [BLOCK, d] blocks stay in L1 at d = 128)
BLOCK = 32


@njit(parallel=True, fastmath=True, cache=True)
def attend_octopus(q, kcodes, kgamma, vcodes, vgamma, vhalf, values_fp16, bits, table, scale):
    """OCTOPUS attention of rotated queries ``q`` float32 [b, hk, rows, d] over triplet codes.

    Values: ``vgamma * v_hat`` (rotated domain; the caller un-rotates the output) or, when
    ``values_fp16``, the float16 rows ``vhalf`` (uint16 bits [b, hk, t, d], original domain).
    Returns (out float32 [b, hk, rows, d], lse float32 [b, hk, rows]).
    """
    nb, nhk, nr, d = q.shape
    nt = kcodes.shape[2]
    out = np.empty((nb, nhk, nr, d), np.float32)
    lse = np.empty((nb, nhk, nr), np.float32)
    for job in prange(nb * nhk * ((nr + ROWS - 1) // ROWS)):
        b, h, r0, nrt = tile_of(job, nhk, nr)
        qf, m, l, acc = tile_queries(q, b, h, r0, nrt)
        no_vbias = np.zeros((ROWS, 0), np.float32)
        kbuf = np.empty((BLOCK, d), np.float32)
        vbuf = np.empty((BLOCK, d), np.float32)
        p = np.zeros((ROWS, BLOCK), np.float32)
        pw = np.empty(ROWS * BLOCK, np.float32)
        tok = np.empty(BLOCK, np.float32)
        ebits = np.empty(ROWS * BLOCK, np.int32)
        kflat = kbuf.reshape(BLOCK * d)
        vflat = vbuf.reshape(BLOCK * d)
        vh = vhalf[b, h].reshape(vhalf.shape[2] * vhalf.shape[3]) if values_fp16 else vhalf[0, 0, 0]
        for t0 in range(0, nt, BLOCK):
            n = min(BLOCK, nt - t0)
            decode_rows(kcodes[b, h], t0, n, bits, table, kbuf)
            for i in range(n):
                tok[i] = scale * kgamma[b, h, t0 + i]
            logits(qf, kflat, d, n, tok, p)
            online_softmax(p, n, m, l, acc.reshape((ROWS, d)), no_vbias, ebits)
            if values_fp16:
                halves(vh, t0 * d, n * d, vflat)
                for r in range(ROWS):
                    for i in range(n):
                        pw[r * BLOCK + i] = p[r, i]
            else:
                decode_rows(vcodes[b, h], t0, n, bits, table, vbuf)
                for r in range(ROWS):
                    for i in range(n):
                        pw[r * BLOCK + i] = p[r, i] * vgamma[b, h, t0 + i]
            weighted_rows(pw, BLOCK, vflat, d, n, acc)
        write_tile(acc, m, l, b, h, r0, nrt, out, lse)
    return out, lse
