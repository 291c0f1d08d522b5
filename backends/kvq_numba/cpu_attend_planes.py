"""Fused decode attention over 2- and 4-bit integer codes in explicit 8-lane vectors
(:mod:`kvq_numba.cpu_simd`): the fast path of :func:`kvq_numba.cpu_attend.attend_int_codes`
for the code rows that split into whole 8-byte chunks (:func:`fits`).

Eight code bytes of a row, zero-extended to eight int32 lanes, hold ``8 // bits`` *planes*:
plane ``s`` (``(byte >> s * bits) & mask``) is channels ``(8 j + l) * P + s`` for lanes l. The
kernel works in that plane order throughout: queries and key scales are permuted once per head and
key group, the output once at the end, so a code is never stored unpacked. Codes are centred on
``mid = mask / 2`` (``s * code + o = s * (code - mid) + (o + mid * s)``): summed uncentred, the
codes' share and the offsets' share of an output are each ~50x the output and cancel, which left
errors near 1e-5 against the float64 reference at 32k tokens; centred, near 3e-8, for ~8% more
time. Per (batch, KV head, tile of :data:`ROWS` query rows):

- logits: two tokens by four rows per pass, eight accumulators in registers, the key group's
  per-channel scale folded into the queries and its offsets into one bias per row;
- online softmax over blocks of up to :data:`BLOCK` tokens (whole key groups);
- ``P @ V`` straight from the value codes: each token's weight times its channel-group scale, four
  rows by two planes per pass, accumulators in registers over the whole block; value offsets add
  ``sum_i p_i * offset_i`` per row and group.

Rows past the query count in the last tile are zeros; their results are dropped.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu_attend import online_softmax
from kvq_numba.cpu_tiles import ROWS, tile_of, tile_queries
from kvq_numba.cpu_simd import bytes8, halves, plane, vaccumulate, vfma, vhsum, vload, vmul, vsplat, vstore, vzero

#: most tokens per online-softmax block (rounded down to whole key groups, at least one group)
BLOCK = 128


def fits(bits: int, head_dim: int, value_group: int) -> bool:
    """Whether code rows split into 8-byte chunks of whole planes inside one value channel group."""
    if bits not in (2, 4):
        return False
    chunk_channels = 8 * (8 // bits)
    return (head_dim * bits) % 64 == 0 and value_group % chunk_channels == 0


@njit(cache=True)
def plane_order(d, bits):
    """``order[pos]`` = the channel at plane-order position ``pos`` of a ``d``-channel code row."""
    planes = 8 // bits
    order = np.empty(d, np.int64)
    for ch in range(d // (8 * planes)):
        for s in range(planes):
            for lane in range(8):
                order[(ch * planes + s) * 8 + lane] = (ch * 8 + lane) * planes + s
    return order


@njit(fastmath=True, cache=True, inline="always")
def _logits(qs, d, kc, t0, ilo, ihi, rb, bits, bias, tok, p) -> None:
    """``p[r, i] = (qs[r] . k[t0 + i] + bias[r]) * tok[i]`` for ``i`` in ``ilo .. ihi``: four rows
    (``qs`` [4 * d], plane order) by two tokens per pass; an odd last token is computed twice."""
    mask = (1 << bits) - 1
    mid = np.float32(mask) * np.float32(0.5)
    planes = 8 // bits
    for i in range(ilo, ihi, 2):
        i1 = min(i + 1, ihi - 1)
        a00, a01, a10, a11 = vzero(), vzero(), vzero(), vzero()
        a20, a21, a30, a31 = vzero(), vzero(), vzero(), vzero()
        o0 = (t0 + i) * rb
        o1 = (t0 + i1) * rb
        for ch in range(rb // 8):
            x0 = bytes8(kc, o0 + ch * 8)
            x1 = bytes8(kc, o1 + ch * 8)
            for s in range(planes):
                k0 = plane(x0, s * bits, mask, mid)
                k1 = plane(x1, s * bits, mask, mid)
                pos = (ch * planes + s) * 8
                q = vload(qs, pos)
                a00, a01 = vfma(q, k0, a00), vfma(q, k1, a01)
                q = vload(qs, d + pos)
                a10, a11 = vfma(q, k0, a10), vfma(q, k1, a11)
                q = vload(qs, 2 * d + pos)
                a20, a21 = vfma(q, k0, a20), vfma(q, k1, a21)
                q = vload(qs, 3 * d + pos)
                a30, a31 = vfma(q, k0, a30), vfma(q, k1, a31)
        ta, tb = tok[i], tok[i1]
        p[0, i], p[0, i1] = (vhsum(a00) + bias[0]) * ta, (vhsum(a01) + bias[0]) * tb
        p[1, i], p[1, i1] = (vhsum(a10) + bias[1]) * ta, (vhsum(a11) + bias[1]) * tb
        p[2, i], p[2, i1] = (vhsum(a20) + bias[2]) * ta, (vhsum(a21) + bias[2]) * tb
        p[3, i], p[3, i1] = (vhsum(a30) + bias[3]) * ta, (vhsum(a31) + bias[3]) * tb


@njit(fastmath=True, cache=True, inline="always")
def _weighted_values(pw, sb, vc, t0, n, rb, bits, chunks_per_group, acc, d) -> None:
    """``acc[r, pos] += sum_i pw[g, r, i] * code[t0 + i, pos]`` (plane order, ``acc`` [4 * d],
    ``pw`` [groups, 4, sb]): four rows by two planes per pass over the block's tokens."""
    mask = (1 << bits) - 1
    mid = np.float32(mask) * np.float32(0.5)
    planes = 8 // bits
    for ch in range(rb // 8):
        w0 = (ch // chunks_per_group) * ROWS * sb
        w1, w2, w3 = w0 + sb, w0 + 2 * sb, w0 + 3 * sb
        for s in range(0, planes, 2):
            a00, a01, a10, a11 = vzero(), vzero(), vzero(), vzero()
            a20, a21, a30, a31 = vzero(), vzero(), vzero(), vzero()
            for i in range(n):
                x = bytes8(vc, (t0 + i) * rb + ch * 8)
                v0 = plane(x, s * bits, mask, mid)
                v1 = plane(x, (s + 1) * bits, mask, mid)
                w = vsplat(pw[w0 + i])
                a00, a01 = vfma(w, v0, a00), vfma(w, v1, a01)
                w = vsplat(pw[w1 + i])
                a10, a11 = vfma(w, v0, a10), vfma(w, v1, a11)
                w = vsplat(pw[w2 + i])
                a20, a21 = vfma(w, v0, a20), vfma(w, v1, a21)
                w = vsplat(pw[w3 + i])
                a30, a31 = vfma(w, v0, a30), vfma(w, v1, a31)
            pos = (ch * planes + s) * 8
            vaccumulate(acc, pos, a00)
            vaccumulate(acc, pos + 8, a01)
            vaccumulate(acc, d + pos, a10)
            vaccumulate(acc, d + pos + 8, a11)
            vaccumulate(acc, 2 * d + pos, a20)
            vaccumulate(acc, 2 * d + pos + 8, a21)
            vaccumulate(acc, 3 * d + pos, a30)
            vaccumulate(acc, 3 * d + pos + 8, a31)


@njit(fastmath=True, cache=True, inline="always")
def _fold_key_group(qo, qp, ks, ko, mid, order, qs, bias, ksp) -> None:
    """``qs = qp * ks`` in plane order and ``bias[r] = qo[r] . (ko + mid * ks)`` (channel order),
    four rows: the key group's scale and offset for codes centred on ``mid``."""
    d = ks.shape[0]
    vmid = vsplat(mid)
    for j in range(d):
        ksp[j] = ks[order[j]]
    for r in range(ROWS):
        a = vzero()
        for j in range(0, d, 8):
            vstore(qs, r * d + j, vmul(vload(qp, r * d + j), vload(ksp, j)))
            a = vfma(vload(qo, r * d + j), vfma(vmid, vload(ks, j), vload(ko, j)), a)
        bias[r] = vhsum(a)


@njit(parallel=True, fastmath=True, cache=True)
def attend_planes(q, kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset, bits, kgroup, vgroup,
                  scale):
    """:func:`kvq_numba.cpu_attend.attend_int_codes` (same arguments and results) for code rows
    that :func:`fits`."""
    nb, nhk, nr, d = q.shape
    nt, rb = kcodes.shape[2], kcodes.shape[3]
    nkg = kscale.shape[2]
    nvg = d // vgroup
    chunks_per_group = vgroup // (64 // bits)
    sb = kgroup * max(1, BLOCK // kgroup)
    mid = np.float32((1 << bits) - 1) * np.float32(0.5)
    order = plane_order(d, bits)
    out = np.empty((nb, nhk, nr, d), np.float32)
    lse = np.empty((nb, nhk, nr), np.float32)
    for job in prange(nb * nhk * ((nr + ROWS - 1) // ROWS)):
        b, h, r0, nrt = tile_of(job, nhk, nr)
        qo, m, l, acc = tile_queries(q, b, h, r0, nrt)  # channel order
        qp = np.zeros(ROWS * d, np.float32)  # plane order
        for r in range(nrt):
            for j in range(d):
                qp[r * d + j] = qo[r * d + order[j]]
        qs = np.empty(ROWS * d, np.float32)
        bias = np.empty(ROWS, np.float32)
        ks = np.empty(d, np.float32)
        ko = np.empty(d, np.float32)
        ksp = np.empty(d, np.float32)
        vsf = np.empty(sb * nvg, np.float32)
        vof = np.empty(sb * nvg, np.float32)
        vst = np.empty(nvg * sb, np.float32)
        vot = np.empty(nvg * sb, np.float32)
        pw = np.empty(nvg * ROWS * sb, np.float32)
        vbias = np.zeros((ROWS, nvg), np.float32)
        p = np.zeros((ROWS, sb), np.float32)
        tok = np.empty(sb, np.float32)
        ebits = np.empty(ROWS * sb, np.int32)
        ksc = kscale[b, h].reshape(nkg * d)
        koc = koffset[b, h].reshape(nkg * d)
        vsc = vscale[b, h].reshape(nt * nvg)
        voc = voffset[b, h].reshape(nt * nvg)
        kc = kcodes[b, h].reshape(nt * rb)
        vc = vcodes[b, h].reshape(nt * rb)
        for t0 in range(0, nt, sb):
            n = min(sb, nt - t0)
            for i in range(n):
                tok[i] = scale * knorm[b, t0 + i] if use_norm else scale
            i = 0
            while i < n:  # one key group at a time
                g = (t0 + i) // kgroup
                i_end = min((g + 1) * kgroup - t0, n)
                halves(ksc, g * d, d, ks)
                halves(koc, g * d, d, ko)
                _fold_key_group(qo, qp, ks, ko, mid, order, qs, bias, ksp)
                _logits(qs, d, kc, t0, i, i_end, rb, bits, bias, tok, p)
                i = i_end
            online_softmax(p, n, m, l, acc.reshape((ROWS, d)), vbias, ebits)
            halves(vsc, t0 * nvg, n * nvg, vsf)
            halves(voc, t0 * nvg, n * nvg, vof)
            for g in range(nvg):  # scales and offsets to [group, token]
                for i in range(n):
                    vst[g * sb + i] = vsf[i * nvg + g]
                    vot[g * sb + i] = vof[i * nvg + g]
            for g in range(nvg):
                for r in range(ROWS):
                    a = np.float32(0)
                    base = (g * ROWS + r) * sb
                    for i in range(n):
                        pw[base + i] = p[r, i] * vst[g * sb + i]
                        a += p[r, i] * (vot[g * sb + i] + mid * vst[g * sb + i])
                    vbias[r, g] += a
            _weighted_values(pw, sb, vc, t0, n, rb, bits, chunks_per_group, acc, d)
        for r in range(nrt):
            inv = np.float32(1) / l[r]
            for j in range(d):
                c = order[j]
                out[b, h, r0 + r, c] = (acc[r * d + j] + vbias[r, c // vgroup]) * inv
            lse[b, h, r0 + r] = m[r] + np.log(l[r])
    return out, lse
