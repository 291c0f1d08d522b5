"""Fused Numba CPU decode attention over integer codes, for any bit width and group size: keys
grouped along tokens (per channel scale/offset per token group, an optional per-token logit
factor), values grouped along channels. 2- and 4-bit rows of whole 8-byte chunks take the faster
:mod:`kvq_numba.cpu.attend_planes`, which never unpacks a code to memory.

Per (batch, KV head, tile of four query rows): each block of :data:`BLOCK` tokens is unpacked
and dequantized once per tile (keys per channel, values per channel group) into rows that stay in
L1, then scored and weighted by the register tiles of :mod:`kvq_numba.cpu.tiles`; online softmax
with a vectorisable exp (:func:`online_softmax`, which every CPU attend kernel shares). Rows
past the query count in the last tile are zeros; their results are dropped. ``fastmath`` lets
LLVM reassociate; the conformance tolerances bound the difference to the float64 reference.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu.common import fwht_block, unpack_rows
from kvq_numba.cpu.simd import LANES, halves, vfma, vhmax, vload, vmax, vmul, vpow2, vrint, vsplat, vstore
from kvq_numba.cpu.tiles import ROWS, logits, tile_of, tile_queries, weighted_rows, write_tile

#: tokens per online-softmax block
BLOCK = 32
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
#: the exp polynomial's coefficients after the leading 1/720 (:func:`_exp_nonpositive`), highest degree first
_EXP_POLY = (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)


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
def vexp_nonpositive(x):
    """:func:`_exp_nonpositive` of eight lanes ``x <= 0`` in explicit vectors, for loops that LLVM
    would not vectorise (or only at a narrower width)."""
    v = vmax(x, vsplat(-87.0))
    k = vrint(vmul(v, vsplat(_LOG2E)))
    r = vfma(k, vsplat(-_LN2_LO), vfma(k, vsplat(-_LN2_HI), v))
    poly = vsplat(1.0 / 720)
    for c in _EXP_POLY:
        poly = vfma(poly, r, vsplat(c))
    return vmul(poly, vpow2(k))


@njit(fastmath=True, cache=True, inline="always")
def row_max(flat, lo, n, start):
    """The largest of ``start`` and ``flat[lo:lo+n]``, kept in lanes (a scalar max chain costs a
    compare's latency per logit)."""
    vm = vsplat(start)
    i = 0
    while i + LANES <= n:
        vm = vmax(vm, vload(flat, lo + i))
        i += LANES
    mx = vhmax(vm)
    for j in range(i, n):
        mx = max(mx, flat[lo + j])
    return mx


@njit(fastmath=True, cache=True, inline="always")
def rescale_row(r, mx, m, l, acc, lo, d, vbias) -> None:
    """Row ``r``'s running max becomes ``mx``: its running sum, output ``acc[lo:lo+d]`` and
    value-offset sums ``vbias[r]`` scaled by ``exp(m[r] - mx)``."""
    corr = np.exp(m[r] - mx)
    m[r] = mx
    l[r] *= corr
    if corr != 1:
        for c in range(d):
            acc[lo + c] *= corr
        for g in range(vbias.shape[1]):
            vbias[r, g] *= corr


@njit(fastmath=True, cache=True, inline="always")
def online_softmax(p, n, m, l, acc, vbias, ebits) -> None:
    """Online softmax step: logits ``p[:, :n]`` become weights; running max/sum/output (``acc``
    and the per-row value-offset sums ``vbias``) rescaled.

    The exp runs over the whole (contiguous) ``p`` buffer in one vectorised call; entries past
    ``n`` hold stale finite values and are never read as weights.
    """
    nr, d = acc.shape
    sb = p.shape[1]
    flat = p.reshape(p.size)
    for r in range(nr):
        mx = row_max(flat, r * sb, n, m[r])
        rescale_row(r, mx, m, l, acc[r], 0, d, vbias)
        for i in range(p.shape[1]):
            p[r, i] = min(p[r, i] - mx, np.float32(0))
    _exp_nonpositive(flat, flat, ebits)
    for r in range(nr):
        tot = np.float32(0)
        for i in range(n):
            tot += p[r, i]
        l[r] += tot


@njit(fastmath=True, cache=True, inline="always")
def _dequantize_key_rows(buf, n, s, o) -> None:
    """``buf[i] = buf[i] * s + o`` for the block's ``n`` unpacked key rows (per-channel ``s``, ``o``)."""
    d = buf.shape[1]
    flat = buf.reshape(buf.size)
    for i in range(n):
        for c in range(0, d, 8):
            vstore(flat, i * d + c, vfma(vload(flat, i * d + c), vload(s, c), vload(o, c)))


@njit(fastmath=True, cache=True, inline="always")
def _dequantize_value_rows(buf, n, s, o) -> None:
    """``buf[i, c] = buf[i, c] * s[i, g] + o[i, g]`` with ``g`` the channel group of ``c``
    (``s``, ``o`` [>= n, groups]); rows viewed as [groups, group] so loops index from 0."""
    ng = s.shape[1]
    v3 = buf.reshape((buf.shape[0], ng, buf.shape[1] // ng))
    for i in range(n):
        for g in range(ng):
            sg, og = s[i, g], o[i, g]
            row = v3[i, g]
            for c in range(row.shape[0]):
                row[c] = row[c] * sg + og


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
    nkg = kscale.shape[2]
    nvg = d // vgroup
    out = np.empty((nb, nhk, nr, d), np.float32)
    lse = np.empty((nb, nhk, nr), np.float32)
    for job in prange(nb * nhk * ((nr + ROWS - 1) // ROWS)):
        b, h, r0, nrt = tile_of(job, nhk, nr)
        qf, m, l, acc = tile_queries(q, b, h, r0, nrt)
        no_vbias = np.zeros((ROWS, 0), np.float32)
        ks = np.empty(d, np.float32)
        ko = np.empty(d, np.float32)
        kbuf = np.empty((BLOCK, d), np.float32)
        vbuf = np.empty((BLOCK, d), np.float32)
        vs = np.empty((BLOCK, nvg), np.float32)
        vo = np.empty((BLOCK, nvg), np.float32)
        p = np.zeros((ROWS, BLOCK), np.float32)
        tok = np.empty(BLOCK, np.float32)
        ebits = np.empty(ROWS * BLOCK, np.int32)
        ksc = kscale[b, h].reshape(nkg * d)
        koc = koffset[b, h].reshape(nkg * d)
        vsc = vscale[b, h].reshape(nt * nvg)
        voc = voffset[b, h].reshape(nt * nvg)
        for g in range(nkg):
            halves(ksc, g * d, d, ks)
            halves(koc, g * d, d, ko)
            t_end = min(nt, (g + 1) * kgroup)
            for t0 in range(g * kgroup, t_end, BLOCK):
                n = min(BLOCK, t_end - t0)
                unpack_rows(kcodes[b, h], t0, n, bits, d, kbuf)
                _dequantize_key_rows(kbuf, n, ks, ko)
                for i in range(n):
                    tok[i] = scale * knorm[b, t0 + i] if use_norm else scale
                logits(qf, kbuf.reshape(BLOCK * d), d, n, tok, p, nrt)
                online_softmax(p, n, m, l, acc.reshape((ROWS, d)), no_vbias, ebits)
                unpack_rows(vcodes[b, h], t0, n, bits, d, vbuf)
                halves(vsc, t0 * nvg, n * nvg, vs.reshape(BLOCK * nvg))
                halves(voc, t0 * nvg, n * nvg, vo.reshape(BLOCK * nvg))
                _dequantize_value_rows(vbuf, n, vs, vo)
                weighted_rows(p.reshape(ROWS * BLOCK), BLOCK, vbuf.reshape(BLOCK * d), d, n, acc, nrt)
        write_tile(acc, m, l, b, h, r0, nrt, out, lse)
    return out, lse


@njit(cache=True)
def attend_int_codes_rotated(q, inv_sqrt_d, kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset,
                             bits, kgroup, vgroup, scale):
    """:func:`attend_int_codes` over Hadamard-rotated codes for C-contiguous queries ``q`` in the original
    domain: ``q H`` in, the output brought back by ``H``, in one compiled call (a short block's attend
    is then a single dispatch from Python)."""
    d = q.shape[3]
    qr = np.empty_like(q)
    fwht_block(q.reshape(-1, d), qr.reshape(-1, d), inv_sqrt_d)
    out, lse = attend_int_codes(qr, kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset,
                                bits, kgroup, vgroup, scale)
    rows = out.reshape(-1, d)
    fwht_block(rows, rows, inv_sqrt_d)
    return out, lse

