"""Fused Numba CPU decode-attention over integer codes: keys grouped along tokens (per channel
scale/offset per token group, an optional per-token logit factor), values grouped along channels.

Per (batch, KV head), for the G query rows that share the head (GQA folded into rows):

- each key token group folds its per-channel scale into the queries once (``qs = q * s``) and its
  offsets into one bias per row (``q . o``), so a key code row costs one dot product per row;
- code rows are unpacked once per KV head and reused by all its query rows;
- online softmax over blocks of :data:`BLOCK` tokens; values accumulate ``p * scale`` times the
  codes plus ``p * offset`` per channel group, applied once at the end.

``fastmath`` lets LLVM vectorise the dot products (reassociation); the conformance tolerances
bound the difference to the float64 reference.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu_common import half_to_float, unpack_row

#: tokens per online-softmax block
BLOCK = 32


@njit(parallel=True, fastmath=True, cache=True)
def attend_int_codes(q, kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset,
                     bits, kgroup, vgroup, scale):
    """Attention of ``q`` float32 [b, hk, rows, d] (already grouped by KV head and rotated as the
    keys are) over code blocks; returns (out float32 [b, hk, rows, d], lse float32 [b, hk, rows]).

    kcodes/vcodes uint8 [b, hk, t, row_bytes]; kscale/koffset uint16 (float16 bits)
    [b, hk, ceil(t / kgroup), d]; vscale/voffset uint16 [b, hk, t, d // vgroup]; knorm float32
    [b, t] multiplies each token's logit when ``use_norm``.
    """
    nb, nhk, nr, d = q.shape
    nt = kcodes.shape[2]
    nkg = (nt + kgroup - 1) // kgroup
    nvg = d // vgroup
    out = np.empty((nb, nhk, nr, d), np.float32)
    lse = np.empty((nb, nhk, nr), np.float32)
    for bh in prange(nb * nhk):
        b, h = bh // nhk, bh % nhk
        qh = q[b, h]
        m = np.full(nr, -np.inf, np.float32)
        l = np.zeros(nr, np.float32)
        acc = np.zeros((nr, d), np.float32)
        acco = np.zeros((nr, nvg), np.float32)
        qs = np.empty((nr, d), np.float32)
        bias = np.empty(nr, np.float32)
        kbuf = np.empty((BLOCK, d), np.float32)
        vrow = np.empty(d, np.float32)
        p = np.empty((nr, BLOCK), np.float32)
        tok = np.empty(BLOCK, np.float32)
        for g in range(nkg):
            for r in range(nr):
                bias[r] = 0
            for c in range(d):
                s = half_to_float(kscale[b, h, g, c])
                o = half_to_float(koffset[b, h, g, c])
                for r in range(nr):
                    qs[r, c] = qh[r, c] * s
                    bias[r] += qh[r, c] * o
            t_end = min(nt, (g + 1) * kgroup)
            for t0 in range(g * kgroup, t_end, BLOCK):
                n = min(BLOCK, t_end - t0)
                for i in range(n):
                    unpack_row(kcodes[b, h, t0 + i], bits, d, kbuf[i])
                    tok[i] = scale * knorm[b, t0 + i] if use_norm else scale
                for r in range(nr):
                    mx = m[r]
                    for i in range(n):
                        acc_dot = np.float32(0)
                        for c in range(d):
                            acc_dot += qs[r, c] * kbuf[i, c]
                        z = (acc_dot + bias[r]) * tok[i]
                        p[r, i] = z
                        mx = max(mx, z)
                    corr = np.exp(m[r] - mx)
                    m[r] = mx
                    tot = l[r] * corr
                    for i in range(n):
                        e = np.exp(p[r, i] - mx)
                        p[r, i] = e
                        tot += e
                    l[r] = tot
                    if corr != 1:
                        for c in range(d):
                            acc[r, c] *= corr
                        for j in range(nvg):
                            acco[r, j] *= corr
                for i in range(n):
                    t = t0 + i
                    unpack_row(vcodes[b, h, t], bits, d, vrow)
                    for j in range(nvg):
                        vs = half_to_float(vscale[b, h, t, j])
                        vo = half_to_float(voffset[b, h, t, j])
                        for r in range(nr):
                            w = p[r, i] * vs
                            acco[r, j] += p[r, i] * vo
                            for c in range(j * vgroup, (j + 1) * vgroup):
                                acc[r, c] += w * vrow[c]
        for r in range(nr):
            inv = np.float32(1) / l[r]
            for c in range(d):
                out[b, h, r, c] = (acc[r, c] + acco[r, c // vgroup]) * inv
            lse[b, h, r] = m[r] + np.log(l[r])
    return out, lse
