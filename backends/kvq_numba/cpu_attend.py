"""Fused Numba CPU decode-attention over integer codes: keys grouped along tokens (per channel
scale/offset per token group, an optional per-token logit factor), values grouped along channels.
This is the general kernel (any bit width and group size); 2- and 4-bit rows of whole 8-byte chunks
take :mod:`kvq_numba.cpu_attend_planes`. Its online softmax serves every CPU attend kernel.

Per (batch, KV head), for the query rows that share the head (GQA folded into rows):

- each key token group folds its per-channel scale into the queries once (``qs = q * s``) and its
  offsets into one bias per row (``q . o``), so a key code row costs one dot product per row;
- code rows are unpacked once per KV head and reused by all its query rows;
- online softmax over blocks of :data:`BLOCK` tokens with a vectorisable exp;
- value codes are never dequantized: each token's weight times its group scale multiplies the
  unpacked codes (a small ``P @ V``, four rows by two tokens per pass), and the group offsets add
  ``sum_i p_i * offset_i`` once per row and group at the end.

Each step is its own small function with plain loops, which LLVM vectorises (one large loop nest
defeated it), inlined into the drivers (calls per 32-token block cost 5-15%). ``fastmath`` lets
it reassociate the dot products; the conformance tolerances bound the difference to the float64
reference.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu_common import halves_to_floats, unpack_rows

#: tokens per online-softmax block
BLOCK = 32
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)


@njit(fastmath=True, cache=True, inline="always")
def _exp_nonpositive(x, out, ebits) -> None:
    """``out[i] = exp(x[i])`` for ``x <= 0`` (float32, ~1 ulp; below -87 gives ~1e-38, not 0).

    Cody-Waite range reduction, a degree-6 polynomial, and 2**n built in an int32 view of
    ``ebits`` so that every loop vectorises (libm's expf does not).
    """
    n = x.shape[0]
    ef = ebits.view(np.float32)
    for i in range(n):
        v = max(x[i], np.float32(-87.0))
        k = np.rint(v * _LOG2E)
        r = v - k * _LN2_HI - k * _LN2_LO
        poly = np.float32(1.0 / 720)
        poly = poly * r + np.float32(1.0 / 120)
        poly = poly * r + np.float32(1.0 / 24)
        poly = poly * r + np.float32(1.0 / 6)
        poly = poly * r + np.float32(0.5)
        poly = poly * r + np.float32(1.0)
        out[i] = poly * r + np.float32(1.0)
        ebits[i] = (np.int32(k) + 127) << 23
    for i in range(n):
        out[i] *= ef[i]


@njit(fastmath=True, cache=True, inline="always")
def _fold_key_group(qh, s, o, qs, bias) -> None:
    """``qs = q * scale`` per channel and ``bias = q . offset`` per row, for one key token group."""
    nr, d = qh.shape
    for r in range(nr):
        acc = np.float32(0)
        for c in range(d):
            qs[r, c] = qh[r, c] * s[c]
            acc += qh[r, c] * o[c]
        bias[r] = acc


@njit(fastmath=True, cache=True, inline="always")
def _logits(qs, kbuf, n, bias, tok, p) -> None:
    """``p[r, i] = (qs[r] . kbuf[i] + bias[r]) * tok[i]`` for the block's n tokens.

    Rows and tokens go in pairs (four dot products per pass over d) to reuse every load twice.
    """
    nr, d = qs.shape
    for r0 in range(0, nr, 2):
        r1 = min(r0 + 1, nr - 1)  # an odd last row is computed twice, harmlessly
        qa = qs[r0]
        qb = qs[r1]
        for i0 in range(0, n, 2):
            i1 = min(i0 + 1, n - 1)
            ka = kbuf[i0]
            kb = kbuf[i1]
            aa = np.float32(0)
            ab = np.float32(0)
            ba = np.float32(0)
            bb = np.float32(0)
            for c in range(d):
                aa += qa[c] * ka[c]
                ab += qa[c] * kb[c]
                ba += qb[c] * ka[c]
                bb += qb[c] * kb[c]
            p[r0, i0] = (aa + bias[r0]) * tok[i0]
            p[r0, i1] = (ab + bias[r0]) * tok[i1]
            p[r1, i0] = (ba + bias[r1]) * tok[i0]
            p[r1, i1] = (bb + bias[r1]) * tok[i1]


@njit(fastmath=True, cache=True, inline="always")
def online_softmax(p, n, m, l, acc, vbias, ebits) -> None:
    """Online softmax step: logits ``p[:, :n]`` become weights; running max/sum/output (``acc``
    and the per-row value-offset sums ``vbias``) rescaled.

    The exp runs over the whole (contiguous) ``p`` buffer in one vectorised call; entries past
    ``n`` hold stale finite values and are never read as weights.
    """
    nr, d = acc.shape
    for r in range(nr):
        mx = m[r]
        for i in range(n):
            mx = max(mx, p[r, i])
        corr = np.exp(m[r] - mx)
        m[r] = mx
        for i in range(p.shape[1]):
            p[r, i] = min(p[r, i] - mx, np.float32(0))
        l[r] *= corr
        if corr != 1:
            a = acc[r]
            for c in range(d):
                a[c] *= corr
            for g in range(vbias.shape[1]):
                vbias[r, g] *= corr
    flat = p.reshape(p.size)
    _exp_nonpositive(flat, flat, ebits)
    for r in range(nr):
        tot = np.float32(0)
        for i in range(n):
            tot += p[r, i]
        l[r] += tot


@njit(fastmath=True, cache=True, inline="always")
def _value_offsets(p, n, vo, vbias) -> None:
    """``vbias[r, g] += sum_i p[r, i] * vo[i, g]``: the value offsets' share of the output."""
    nr, ng = vbias.shape
    for r in range(nr):
        for i in range(n):
            w = p[r, i]
            for g in range(ng):
                vbias[r, g] += w * vo[i, g]


@njit(fastmath=True, cache=True, inline="always")
def _accumulate(p, vbuf, n, vs, acc) -> None:
    """``acc[r, c] += sum_i p[r, i] * vs[i, g(c)] * vbuf[i, c]``, with ``vs`` [>= n, groups] one
    scale per token and channel group (``g(c) = c // (d // groups)``), so value codes are never
    dequantized. Four rows by two tokens per pass over a group (each value load feeds 8 FMAs),
    then two rows by two tokens, then single rows.

    Groups are addressed as views (``[rows, groups, group]``) so every index is a loop counter
    from 0: computed offsets would get numba's negative-index fix-up, which blocks vectorising.
    """
    nr, d = acc.shape
    ng = vs.shape[1]
    gs = d // ng
    acc3 = acc.reshape((nr, ng, gs))
    v3 = vbuf.reshape((vbuf.shape[0], ng, gs))
    n2 = n - n % 2
    for r0 in range(0, nr - nr % 4, 4):
        for g in range(ng):
            a0, a1, a2, a3 = acc3[r0, g], acc3[r0 + 1, g], acc3[r0 + 2, g], acc3[r0 + 3, g]
            for i0 in range(0, n2, 2):
                v0, v1 = v3[i0, g], v3[i0 + 1, g]
                s0, s1 = vs[i0, g], vs[i0 + 1, g]
                w00, w01 = p[r0, i0] * s0, p[r0, i0 + 1] * s1
                w10, w11 = p[r0 + 1, i0] * s0, p[r0 + 1, i0 + 1] * s1
                w20, w21 = p[r0 + 2, i0] * s0, p[r0 + 2, i0 + 1] * s1
                w30, w31 = p[r0 + 3, i0] * s0, p[r0 + 3, i0 + 1] * s1
                for c in range(gs):
                    x = v0[c]
                    y = v1[c]
                    a0[c] += w00 * x + w01 * y
                    a1[c] += w10 * x + w11 * y
                    a2[c] += w20 * x + w21 * y
                    a3[c] += w30 * x + w31 * y
    r = nr - nr % 4
    if nr % 4 >= 2:  # two rows by two tokens (GQA 2, 3, 6, ...)
        for g in range(ng):
            a0, a1 = acc3[r, g], acc3[r + 1, g]
            for i0 in range(0, n2, 2):
                v0, v1 = v3[i0, g], v3[i0 + 1, g]
                s0, s1 = vs[i0, g], vs[i0 + 1, g]
                w00, w01 = p[r, i0] * s0, p[r, i0 + 1] * s1
                w10, w11 = p[r + 1, i0] * s0, p[r + 1, i0 + 1] * s1
                for c in range(gs):
                    x = v0[c]
                    y = v1[c]
                    a0[c] += w00 * x + w01 * y
                    a1[c] += w10 * x + w11 * y
        r += 2
    for r in range(r, nr):
        _accumulate_row(p[r], v3, 0, n2, vs, acc3[r])
    if n2 < n:
        for r in range(nr):
            _accumulate_row(p[r], v3, n2, n, vs, acc3[r])


@njit(fastmath=True, cache=True, inline="always")
def _accumulate_row(pr, v3, i_lo, i_hi, vs, a3) -> None:
    """One row of :func:`_accumulate` (``a3`` [groups, group]) over tokens ``i_lo .. i_hi``."""
    ng, gs = a3.shape
    for g in range(ng):
        a = a3[g]
        for i in range(i_lo, i_hi):
            w = pr[i] * vs[i, g]
            v = v3[i, g]
            for c in range(gs):
                a[c] += w * v[c]


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
        m = np.full(nr, -np.inf, np.float32)
        l = np.zeros(nr, np.float32)
        acc = np.zeros((nr, d), np.float32)
        qs = np.empty((nr, d), np.float32)
        bias = np.empty(nr, np.float32)
        ks = np.empty(d, np.float32)
        ko = np.empty(d, np.float32)
        kbuf = np.empty((BLOCK, d), np.float32)
        vbuf = np.empty((BLOCK, d), np.float32)
        vs = np.empty((BLOCK, nvg), np.float32)
        vo = np.empty((BLOCK, nvg), np.float32)
        vbias = np.zeros((nr, nvg), np.float32)
        p = np.zeros((nr, BLOCK), np.float32)
        tok = np.empty(BLOCK, np.float32)
        ebits = np.empty(nr * BLOCK, np.int32)
        vsc = vscale[b, h].reshape(nt * nvg)
        voc = voffset[b, h].reshape(nt * nvg)
        for g in range(nkg):
            halves_to_floats(kscale[b, h, g], ks)
            halves_to_floats(koffset[b, h, g], ko)
            _fold_key_group(q[b, h], ks, ko, qs, bias)
            t_end = min(nt, (g + 1) * kgroup)
            for t0 in range(g * kgroup, t_end, BLOCK):
                n = min(BLOCK, t_end - t0)
                unpack_rows(kcodes[b, h], t0, n, bits, d, kbuf)
                for i in range(n):
                    tok[i] = scale * knorm[b, t0 + i] if use_norm else scale
                _logits(qs, kbuf, n, bias, tok, p)
                online_softmax(p, n, m, l, acc, vbias, ebits)
                unpack_rows(vcodes[b, h], t0, n, bits, d, vbuf)
                halves_to_floats(vsc[t0 * nvg:(t0 + n) * nvg], vs.reshape(BLOCK * nvg)[:n * nvg])
                halves_to_floats(voc[t0 * nvg:(t0 + n) * nvg], vo.reshape(BLOCK * nvg)[:n * nvg])
                _value_offsets(p, n, vo, vbias)
                _accumulate(p, vbuf, n, vs, acc)
        for r in range(nr):
            inv = np.float32(1) / l[r]
            for c in range(d):
                out[b, h, r, c] = (acc[r, c] + vbias[r, c // vgroup]) * inv
            lse[b, h, r] = m[r] + np.log(l[r])
    return out, lse
