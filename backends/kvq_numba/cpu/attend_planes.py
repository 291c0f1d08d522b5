"""Fused decode attention over 2- and 4-bit integer codes in explicit 8-lane vectors
(:mod:`kvq_numba.cpu.simd`): the fast path of :func:`kvq_numba.cpu.attend.attend_int_codes`
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
  per-channel scale folded into the queries and its offsets into one bias per row; on AVX-512 hosts
  (:data:`WIDE`) 16-byte chunks in 16-lane vectors, four tokens by four rows per pass, the sixteen dot
  products reduced by one transposing tree (:func:`kvq_numba.cpu.simd.vsums4x4`), queries and key scales
  in that width's plane order;
- online softmax over blocks of up to :data:`BLOCK` tokens (whole key groups), the real rows only, fused
  with the ``P @ V`` weights (:func:`_block_weights`);
- ``P @ V`` straight from the value codes: each token's weight times its channel-group scale, four
  rows by two planes per pass, accumulators in registers over the whole block (on AVX-512 hosts the two
  planes in one 16-lane vector); value offsets add ``sum_i p_i * offset_i`` per row and group.

Rows past the query count in the last tile are zeros; their results are dropped, and the tile's
multiplies run for its real rows only (a copy of the inner loops per row count 1-4: a GQA group of 3
cut the kernel's time at 2k tokens by ~11%, of 1 by ~26%).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from kvq_numba.cpu import page_table
from kvq_numba.cpu.attend import rescale_row, row_max, vexp_nonpositive
from kvq_numba.cpu.common import fwht_block
from kvq_numba.cpu.page_table import (CODES, DESC, GROUP_ROWS, J_HEAD, J_KIND, J_NROWS, J_REQ, J_T0, J_T1, WIDTH,
                                 gather_rows_bytes, heads_f32, row_addr, mask_block, start_job, store_partial,
                                 token_rows)
from kvq_numba.cpu.simd import (LANES, bytes8, bytes8x2, bytes16, halves, plane, prefetch_bytes, split_shifts,
                                vaccumulate, vaccumulate16, vadd, vbroadcast, vbroadcast16, vfma, vhsum, vload, vload16,
                                vmul, vrepeat4, vsplat, vstore, vstore_rows4, vsums4x4, vzero, vzero16)
from kvq_numba.cpu.tiles import ROWS
from kvq_numba.cpu.window import block_plan, finish, group_rows

#: most tokens per online-softmax block (rounded down to whole key groups, at least one group)
BLOCK = 128
#: most blocks :func:`planes_window` takes (a KVQCache layer holds one or two at almost every decode step)
WINDOW_BLOCKS = 2


def fits(bits: int, head_dim: int, value_group: int) -> bool:
    """Whether code rows split into 8-byte chunks of whole planes inside one value channel group."""
    if bits not in (2, 4):
        return False
    chunk_channels = 8 * (8 // bits)
    return (head_dim * bits) % 64 == 0 and value_group % chunk_channels == 0


@njit(cache=True)
def plane_order(d, bits, lanes):
    """``order[pos]`` = the channel at plane-order position ``pos`` of a ``d``-channel code row read
    ``lanes`` bytes at a time."""
    planes = 8 // bits
    order = np.empty(d, np.int64)
    for ch in range(d // (lanes * planes)):
        for s in range(planes):
            for lane in range(lanes):
                order[(ch * planes + s) * lanes + lane] = (ch * lanes + lane) * planes + s
    return order


def wide_keys() -> bool:
    """Whether the logits read 16 code bytes per vector (AVX-512's full width): where the host has
    ``avx512f``; on AVX2 sixteen lanes would be two registers each and the eight accumulators would spill."""
    import llvmlite.binding as llvm

    return bool(llvm.get_host_cpu_features().get("avx512f", False))


#: logits (:func:`_logits16`, where a key code row is whole 16-byte chunks) and ``P @ V``
#: (:func:`_weighted_values16`) in 16-lane vectors
WIDE = wide_keys()


@njit(fastmath=True, cache=True, inline="always")
def _logits(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, nr) -> None:
    """``p[r, i] = (qs[r] . k_i + bias[r]) * tok[i]`` for ``i`` in ``ilo .. ihi``, token ``i``'s code
    row at byte ``ka[i]`` of ``kc``: the first ``nr`` of four rows (``qs`` [4 * d], plane order) by two
    tokens per pass; rows past ``nr`` (zero queries, zero bias) get 0; an odd last token is computed
    twice. ``nr`` is a constant in each inlined copy (:func:`_logits_rows`), so a tile's absent rows
    cost no instructions."""
    mask = (1 << bits) - 1
    mid = np.float32(mask) * np.float32(0.5)
    planes = 8 // bits
    for i in range(ilo, ihi, 2):
        i1 = min(i + 1, ihi - 1)
        a00, a01, a10, a11 = vzero(), vzero(), vzero(), vzero()
        a20, a21, a30, a31 = vzero(), vzero(), vzero(), vzero()
        o0 = ka[i]
        o1 = ka[i1]
        for ch in range(rb // 8):
            x0 = bytes8(kc, o0 + ch * 8)
            x1 = bytes8(kc, o1 + ch * 8)
            for s in range(planes):
                k0 = plane(x0, s * bits, mask, mid)
                k1 = plane(x1, s * bits, mask, mid)
                pos = (ch * planes + s) * 8
                q = vload(qs, pos)
                a00, a01 = vfma(q, k0, a00), vfma(q, k1, a01)
                if nr > 1:
                    q = vload(qs, d + pos)
                    a10, a11 = vfma(q, k0, a10), vfma(q, k1, a11)
                if nr > 2:
                    q = vload(qs, 2 * d + pos)
                    a20, a21 = vfma(q, k0, a20), vfma(q, k1, a21)
                if nr > 3:
                    q = vload(qs, 3 * d + pos)
                    a30, a31 = vfma(q, k0, a30), vfma(q, k1, a31)
        ta, tb = tok[i], tok[i1]
        p[0, i], p[0, i1] = (vhsum(a00) + bias[0]) * ta, (vhsum(a01) + bias[0]) * tb
        p[1, i], p[1, i1] = (vhsum(a10) + bias[1]) * ta, (vhsum(a11) + bias[1]) * tb
        p[2, i], p[2, i1] = (vhsum(a20) + bias[2]) * ta, (vhsum(a21) + bias[2]) * tb
        p[3, i], p[3, i1] = (vhsum(a30) + bias[3]) * ta, (vhsum(a31) + bias[3]) * tb


@njit(fastmath=True, cache=True, inline="always")
def _logits16(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, pf, nr, b16, t4, o16) -> None:
    """:func:`_logits` in 16-lane vectors (``qs`` in the 16-lane plane order, ``rb`` whole 16-byte
    chunks), four tokens by four rows per pass (``pf``: ``p`` flat): half the plane extractions and multiply-adds, and the
    sixteen dot products reduced by one transposing tree (:func:`vsums4x4`) and written as four rows of
    four. ``b16``, ``t4``, ``o16``: scratch (16, 4 and 16 float32)."""
    mask = (1 << bits) - 1
    mid = np.float32(mask) * np.float32(0.5)
    planes = 8 // bits
    sb = p.shape[1]
    for r in range(ROWS):
        for t in range(4):
            b16[4 * r + t] = bias[r]
    vb = vload16(b16, 0)
    for i in range(ilo, ihi, 4):
        i1, i2, i3 = min(i + 1, ihi - 1), min(i + 2, ihi - 1), min(i + 3, ihi - 1)
        a00, a01, a02, a03 = vzero16(), vzero16(), vzero16(), vzero16()
        a10, a11, a12, a13 = vzero16(), vzero16(), vzero16(), vzero16()
        a20, a21, a22, a23 = vzero16(), vzero16(), vzero16(), vzero16()
        a30, a31, a32, a33 = vzero16(), vzero16(), vzero16(), vzero16()
        o0, o1, o2, o3 = ka[i], ka[i1], ka[i2], ka[i3]
        for ch in range(rb // 16):
            x0, x1 = bytes16(kc, o0 + ch * 16), bytes16(kc, o1 + ch * 16)
            x2, x3 = bytes16(kc, o2 + ch * 16), bytes16(kc, o3 + ch * 16)
            for s in range(planes):
                k0, k1 = plane(x0, s * bits, mask, mid), plane(x1, s * bits, mask, mid)
                k2, k3 = plane(x2, s * bits, mask, mid), plane(x3, s * bits, mask, mid)
                pos = (ch * planes + s) * 16
                q = vload16(qs, pos)
                a00, a01, a02, a03 = vfma(q, k0, a00), vfma(q, k1, a01), vfma(q, k2, a02), vfma(q, k3, a03)
                if nr > 1:
                    q = vload16(qs, d + pos)
                    a10, a11, a12, a13 = vfma(q, k0, a10), vfma(q, k1, a11), vfma(q, k2, a12), vfma(q, k3, a13)
                if nr > 2:
                    q = vload16(qs, 2 * d + pos)
                    a20, a21, a22, a23 = vfma(q, k0, a20), vfma(q, k1, a21), vfma(q, k2, a22), vfma(q, k3, a23)
                if nr > 3:
                    q = vload16(qs, 3 * d + pos)
                    a30, a31, a32, a33 = vfma(q, k0, a30), vfma(q, k1, a31), vfma(q, k2, a32), vfma(q, k3, a33)
        sums = vadd(vsums4x4(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33), vb)
        if i + 4 <= ihi:
            vstore_rows4(pf, i, sb, vmul(sums, vrepeat4(tok, i)))
        else:  # the group's last 1-3 tokens (the passes' repeated last token dropped)
            t4[0], t4[1], t4[2], t4[3] = tok[i], tok[i1], tok[i2], tok[i3]
            vstore_rows4(o16, 0, 4, vmul(sums, vrepeat4(t4, 0)))
            for r in range(ROWS):
                for t in range(ihi - i):
                    p[r, i + t] = o16[4 * r + t]


@njit(fastmath=True, cache=True, inline="always")
def _logits_rows8(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, nr) -> None:
    """:func:`_logits` for a tile of ``nr`` real rows, one inlined copy per row count, itself inlined into the
    kernel: called once per key group, its array arguments would cost an atomic reference-count pair each per
    call (~12% of the fused call at OScaR INT2's 32-token groups)."""
    if nr >= 4:
        _logits(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, 4)
    elif nr == 3:
        _logits(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, 3)
    elif nr == 2:
        _logits(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, 2)
    else:
        _logits(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, 1)


@njit(fastmath=True, cache=True, inline="always")
def _logits_rows16(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, pf, nr, b16, t4, o16) -> None:
    """:func:`_logits16` for a tile of ``nr`` real rows (as :func:`_logits_rows8`)."""
    if nr >= 4:
        _logits16(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, pf, 4, b16, t4, o16)
    elif nr == 3:
        _logits16(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, pf, 3, b16, t4, o16)
    elif nr == 2:
        _logits16(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, pf, 2, b16, t4, o16)
    else:
        _logits16(qs, d, kc, ka, ilo, ihi, rb, bits, bias, tok, p, pf, 1, b16, t4, o16)


@njit(cache=True, inline="always")
def _code_centre(bits):
    """A ``bits``-bit code's mask and the centre its planes are read around (float32)."""
    mask = (1 << bits) - 1
    return mask, np.float32(mask) * np.float32(0.5)


@njit(cache=True, inline="always")
def _weight_rows(ch, chunks_per_group, sb):
    """Where four rows' weights start in ``pw`` for 8-byte value chunk ``ch`` (its channel group's)."""
    w0 = (ch // chunks_per_group) * ROWS * sb
    return w0, w0 + sb, w0 + 2 * sb, w0 + 3 * sb


@njit(fastmath=True, cache=True, inline="always")
def _weighted_values(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, nr) -> None:
    """``acc[r, pos] += sum_i pw[g, r, i] * code_i[pos]`` (plane order, ``acc`` [4 * d], ``pw``
    [groups, 4, sb], token ``i``'s code row at byte ``va[i]`` of ``vc``): the first ``nr`` of four rows
    (a constant per inlined copy, :func:`_weighted_values_rows`) by two planes per pass over the block's
    tokens."""
    mask, mid = _code_centre(bits)
    planes = 8 // bits
    for ch in range(rb // 8):
        w0, w1, w2, w3 = _weight_rows(ch, chunks_per_group, sb)
        for s in range(0, planes, 2):
            a00, a01, a10, a11 = vzero(), vzero(), vzero(), vzero()
            a20, a21, a30, a31 = vzero(), vzero(), vzero(), vzero()
            for i in range(n):
                x = bytes8(vc, va[i] + ch * 8)
                v0 = plane(x, s * bits, mask, mid)
                v1 = plane(x, (s + 1) * bits, mask, mid)
                w = vbroadcast(pw, w0 + i)
                a00, a01 = vfma(w, v0, a00), vfma(w, v1, a01)
                if nr > 1:
                    w = vbroadcast(pw, w1 + i)
                    a10, a11 = vfma(w, v0, a10), vfma(w, v1, a11)
                if nr > 2:
                    w = vbroadcast(pw, w2 + i)
                    a20, a21 = vfma(w, v0, a20), vfma(w, v1, a21)
                if nr > 3:
                    w = vbroadcast(pw, w3 + i)
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
def _weighted_values16(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, nr) -> None:
    """:func:`_weighted_values` with a pass's two planes in one 16-lane vector (lanes 8-15 the second): they
    are adjacent in plane order and share their chunk's channel group, so each token takes one broadcast
    weight per row, half the multiply-adds and plane extractions, and ``acc`` keeps its layout. The sums
    are the 8-lane path's, lane for lane."""
    mask, mid = _code_centre(bits)
    planes = 8 // bits
    for ch in range(rb // 8):
        w0, w1, w2, w3 = _weight_rows(ch, chunks_per_group, sb)
        for s in range(0, planes, 2):
            shifts = split_shifts(s * bits, (s + 1) * bits)
            a0, a1, a2, a3 = vzero16(), vzero16(), vzero16(), vzero16()
            for i in range(n):
                v = plane(bytes8x2(vc, va[i] + ch * 8), shifts, mask, mid)
                a0 = vfma(vbroadcast16(pw, w0 + i), v, a0)
                if nr > 1:
                    a1 = vfma(vbroadcast16(pw, w1 + i), v, a1)
                if nr > 2:
                    a2 = vfma(vbroadcast16(pw, w2 + i), v, a2)
                if nr > 3:
                    a3 = vfma(vbroadcast16(pw, w3 + i), v, a3)
            pos = (ch * planes + s) * 8
            vaccumulate16(acc, pos, a0)
            vaccumulate16(acc, d + pos, a1)
            vaccumulate16(acc, 2 * d + pos, a2)
            vaccumulate16(acc, 3 * d + pos, a3)


@njit(fastmath=True, cache=True)
def _weighted_values_rows8(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, nr) -> None:
    """:func:`_weighted_values` for a tile of ``nr`` real rows, one inlined copy per row count (a called
    function: called once per block, its arguments cost little)."""
    if nr >= 4:
        _weighted_values(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, 4)
    elif nr == 3:
        _weighted_values(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, 3)
    elif nr == 2:
        _weighted_values(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, 2)
    else:
        _weighted_values(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, 1)


@njit(fastmath=True, cache=True)
def _weighted_values_rows16(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, nr) -> None:
    """:func:`_weighted_values16` for a tile of ``nr`` real rows (as :func:`_weighted_values_rows8`)."""
    if nr >= 4:
        _weighted_values16(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, 4)
    elif nr == 3:
        _weighted_values16(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, 3)
    elif nr == 2:
        _weighted_values16(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, 2)
    else:
        _weighted_values16(pw, sb, vc, va, n, rb, bits, chunks_per_group, acc, d, 1)


@njit(fastmath=True, cache=True, inline="always")
def _fold_key_group(qo, qp, ks, ko, mid, order, qs, bias, ksp, nr) -> None:
    """``qs = qp * ks`` in plane order and ``bias[r] = qo[r] . (ko + mid * ks)`` (channel order),
    the tile's ``nr`` real rows (the logits read no other ``qs`` row; ``bias`` past them stays 0): the
    key group's scale and offset for codes centred on ``mid``."""
    d = ks.shape[0]
    vmid = vsplat(mid)
    for j in range(d):
        ksp[j] = ks[order[j]]
    for r in range(nr):
        a = vzero()
        for j in range(0, d, 8):
            vstore(qs, r * d + j, vmul(vload(qp, r * d + j), vload(ksp, j)))
            a = vfma(vload(qo, r * d + j), vfma(vmid, vload(ks, j), vload(ko, j)), a)
        bias[r] = vhsum(a)


@njit(fastmath=True, cache=True, inline="always")
def _group_major(vsf, vof, mid, n, nvg, ps, vst, vot) -> None:
    """``vst[g * ps + i]`` = token ``i``'s value scale in group ``g`` (``vsf`` [token, group]) and ``vot``
    its centred offset ``o + mid * s``: two groups (INT2 at head_dim 64) in a loop of constant stride,
    which LLVM vectorises (~6x faster than the general strided loop)."""
    if nvg == 2:
        for i in range(n):
            s0, s1 = vsf[2 * i], vsf[2 * i + 1]
            vst[i], vst[ps + i] = s0, s1
            vot[i], vot[ps + i] = vof[2 * i] + mid * s0, vof[2 * i + 1] + mid * s1
    else:
        for gg in range(nvg):
            for i in range(n):
                s = vsf[i * nvg + gg]
                vst[gg * ps + i] = s
                vot[gg * ps + i] = vof[i * nvg + gg] + mid * s


@njit(fastmath=True, cache=True, inline="always")
def _block_weights(pf, ps, n, nr, m, l, acc, d, vbias, vst, vot, nvg, pw) -> None:
    """Online softmax over a block's logits ``pf`` (``p`` flat, rows ``ps`` apart) for the tile's ``nr``
    real rows, fused with what ``P @ V`` takes from the weights: ``pw[g, r, i]`` = weight times token
    ``i``'s scale in value group ``g`` (``vst`` [group, token], rows ``ps`` apart) and ``vbias[r, g] +=``
    the weights times the centred offsets ``vot``. Explicit 8-lane vectors over whole vectors of tokens
    (tokens past ``n``: weight 0); rows past ``nr`` are never read as weights and are skipped (a quarter
    of the work at GQA groups of 3)."""
    nv = -(-n // LANES) * LANES
    for r in range(nr):
        lo = r * ps
        mx = row_max(pf, lo, n, m[r])
        rescale_row(r, mx, m, l, acc, r * d, d, vbias)
        for j in range(n, nv):  # padding: weight ~1e-38 (1 where the row is all masked), taken out below
            pf[lo + j] = mx - np.float32(100)
        vneg, vt = vsplat(-mx), vzero()
        for i in range(lo, lo + nv, LANES):
            w = vexp_nonpositive(vadd(vload(pf, i), vneg))
            vstore(pf, i, w)
            vt = vadd(vt, w)
        tot = vhsum(vt)
        for j in range(n, nv):
            tot -= pf[lo + j]
            pf[lo + j] = 0
        l[r] += tot
        for gg in range(nvg):
            base, vb = (gg * ROWS + r) * ps, gg * ps
            va = vzero()
            for i in range(0, nv, LANES):
                w = vload(pf, lo + i)
                vstore(pw, base + i, vmul(w, vload(vst, vb + i)))
                va = vfma(w, vload(vot, vb + i), va)
            vbias[r, gg] += vhsum(va)


@njit(cache=True, inline="always")
def key_stats(buf, buf16, table, req, h, grp, desc, d, scratch, scratch16, out) -> None:
    """``out`` = key group ``grp``'s float16 row (scale or offset) of ``d`` channels, read in place when
    one row holds it (contiguous blocks), else gathered from its stripes first (pages). ``buf16`` and
    ``scratch16`` are ``buf`` and ``scratch`` as uint16 (views taken once by the caller)."""
    if desc[WIDTH] >= 2 * d:
        a = row_addr(table, req, h, grp * desc[GROUP_ROWS], desc)
        if a & 1 == 0:
            halves(buf16, a >> 1, d, out)
            return
    gather_rows_bytes(buf, table, req, h, grp * desc[GROUP_ROWS], desc, 2 * d, scratch)
    halves(scratch16, 0, d, out)


@njit(fastmath=True, cache=True, inline="always")
def _token_factors(kn, knw, na, n, desc, scale, nbuf, nval, tok) -> None:
    """``tok[i] = scale *`` token ``i``'s norm (:func:`heads_f32` at byte ``na[i]``): one run of whole
    float32 words where the rows follow one another (contiguous blocks), in a loop that vectorises."""
    if desc[WIDTH] >= 4 and na[0] & 3 == 0 and na[n - 1] - na[0] == 4 * (n - 1):
        w0 = na[0] >> 2
        for i in range(n):
            tok[i] = scale * knw[w0 + i]
    else:
        for i in range(n):
            tok[i] = scale * heads_f32(kn, knw, na[i], desc, nbuf, nval)


@njit(cache=True, inline="always")
def token_halves(buf, addr, n, count, scratch, out) -> None:
    """``out[i * count + j]`` = float32 of the ``j``-th float16 at byte ``addr[i]`` (tokens ``i < n``):
    read in place when the rows follow one another (contiguous blocks), else gathered first (pages)."""
    if addr[n - 1] - addr[0] == (n - 1) * 2 * count:
        halves(buf[addr[0]:addr[0] + 2 * count * n].view(np.uint16), 0, n * count, out)
    else:
        for i in range(n):
            for x in range(2 * count):
                scratch[i * 2 * count + x] = buf[addr[i] + x]
        halves(scratch.view(np.uint16), 0, n * count, out)


#: fields of a planes job, in the order of the buffers and descriptor rows (kvq_numba.cpu.page_table)
F_KC, F_KS, F_KO, F_KN, F_VC, F_VS, F_VO = range(7)


@njit(cache=True)
def block_tokens(kgroup):
    """Tokens per online-softmax block: whole key groups, about :data:`BLOCK` (plans split by it)."""
    return kgroup * max(1, BLOCK // kgroup)


def _jobs_kernel(wide: bool):  # noqa: ANN202
    """:func:`planes_jobs` for one width, ``wide`` (the logits where rows allow, and ``P @ V``, in 16-lane
    vectors) a constant of the compiled kernel: Numba prunes the other width's branches before typing, so
    a host compiles only the width it runs (half the inlined tiles)."""

    @njit(parallel=True, fastmath=True, cache=True)
    def planes_jobs(q, jobs, first, row_lo, g, table, chunks, kc, ks, ko, kn, vc, vs, vo, desc, use_norm, bits, kgroup,
                    vgroup, scale, pm, pl, pacc) -> None:
        """The CODES jobs of a plan (:func:`kvq_numba.cpu.page_table.plan`) over 2- and 4-bit code rows that
        :func:`fits`: partial softmax state of rotated queries ``q`` [kv_heads, rows, d] (channel order)
        over the job's tokens, causal per row, fields read through ``table`` and ``desc`` (one row per
        buffer ``kc .. vo``: key codes, key scale, key offset, token norm, value codes, scale, offset).
        The jobs run as ``chunks`` interleaved chunks, each allocating its scratch once (a decode step's
        jobs are small: allocating per job cost about a third of their time). Compiled per width
        (:func:`jobs_kernel`)."""
        nhk, nrow, d = q.shape
        rb = d * bits // 8
        nvg = d // vgroup
        chunks_per_group = vgroup // (64 // bits)
        sb = block_tokens(kgroup)
        ps = -(-sb // LANES) * LANES  # the row stride of p, pw, vst and vot: whole vectors (_block_weights)
        mid = _code_centre(bits)[1]
        order = plane_order(d, bits, 8)  # values, and the output's channel order
        kwide = False  # the logits' width (the values take any row in 16 lanes)
        korder = order  # queries and key scales
        if wide:  # a constant: the 8-lane kernel compiles no 16-lane code
            if rb % 16 == 0:
                kwide = True
                korder = plane_order(d, bits, 16)
        nch = max(1, min(chunks, jobs.shape[0]))
        for ch in prange(nch):
            lim = np.empty(ROWS, np.int64)
            qo = np.empty(ROWS * d, np.float32)  # channel order
            m = np.empty(ROWS, np.float32)
            l = np.empty(ROWS, np.float32)
            acc = np.empty(ROWS * d, np.float32)
            qp = np.empty(ROWS * d, np.float32)  # plane order
            qs = np.empty(ROWS * d, np.float32)
            bias = np.empty(ROWS, np.float32)
            kstat = np.empty(2 * d, np.uint8)
            nbuf = np.empty(4, np.uint8)
            nval = nbuf.view(np.float32)
            knw = kn[:kn.shape[0] - kn.shape[0] % 4].view(np.float32)
            ksf = np.empty(d, np.float32)
            kof = np.empty(d, np.float32)
            ksp = np.empty(d, np.float32)
            ka = np.empty(sb, np.int64)
            va = np.empty(sb, np.int64)
            sa = np.empty(sb, np.int64)
            oa = np.empty(sb, np.int64)
            na = np.empty(sb, np.int64)
            sbytes = np.empty(2 * nvg * sb, np.uint8)
            obytes = np.empty(2 * nvg * sb, np.uint8)
            vsf = np.empty(nvg * sb, np.float32)
            vof = np.empty(nvg * sb, np.float32)
            vst = np.zeros(nvg * ps, np.float32)  # zeros: padding lanes are read (times weight 0)
            vot = np.zeros(nvg * ps, np.float32)
            pw = np.empty(nvg * ROWS * ps, np.float32)
            vbias = np.empty((ROWS, nvg), np.float32)
            p = np.zeros((ROWS, ps), np.float32)
            tok = np.empty(sb, np.float32)
            out = np.empty(ROWS * d, np.float32)  # channel order, value offsets added
            b16 = np.empty(16, np.float32)  # the 16-lane logits' scratch
            t4 = np.empty(4, np.float32)
            o16 = np.empty(16, np.float32)
            # every view a loop would take, taken once: each view costs an atomic reference count pair
            # (at one per token and key group they were ~12% of the call)
            pf = p.reshape(p.size)
            kstat16 = kstat.view(np.uint16)
            ks16 = ks[:ks.shape[0] - ks.shape[0] % 2].view(np.uint16)
            ko16 = ko[:ko.shape[0] - ko.shape[0] % 2].view(np.uint16)
            dkc, dvc, dvs, dvo = desc[F_KC], desc[F_VC], desc[F_VS], desc[F_VO]
            dkn, dks, dko = desc[F_KN], desc[F_KS], desc[F_KO]
            for job in range(ch, jobs.shape[0], nch):
                if jobs[job, J_KIND] != CODES:
                    continue
                req, h, nr = jobs[job, J_REQ], jobs[job, J_HEAD], jobs[job, J_NROWS]
                start_job(q, jobs, job, first, row_lo, g, lim, qo, m, l, acc)
                vbias[:] = 0
                bias[:] = 0
                for j in range(ROWS * d):  # plane order (zeros past the job's rows, as qo)
                    qp[j] = qo[j - j % d + korder[j % d]]
                for t0 in range(jobs[job, J_T0], jobs[job, J_T1], sb):
                    n = min(sb, jobs[job, J_T1] - t0)
                    token_rows(table, req, h, t0, n, dkc, ka)
                    token_rows(table, req, h, t0, n, dvc, va)
                    token_rows(table, req, h, t0, n, dvs, sa)
                    token_rows(table, req, h, t0, n, dvo, oa)
                    token_halves(vs, sa, n, nvg, sbytes, vsf)
                    token_halves(vo, oa, n, nvg, obytes, vof)
                    _group_major(vsf, vof, mid, n, nvg, ps, vst, vot)
                    if use_norm:
                        token_rows(table, req, 0, t0, n, dkn, na)
                        _token_factors(kn, knw, na, n, dkn, scale, nbuf, nval, tok)
                    else:
                        for i in range(n):
                            tok[i] = scale
                    if t0 + sb < jobs[job, J_T1]:  # the next block's rows, where they follow on (contiguous blocks)
                        prefetch_bytes(kc, ka[n - 1] + rb, n * rb)
                        prefetch_bytes(vc, va[n - 1] + rb, n * rb)
                        prefetch_bytes(vs, sa[n - 1] + 2 * nvg, n * 2 * nvg)
                        prefetch_bytes(vo, oa[n - 1] + 2 * nvg, n * 2 * nvg)
                        if use_norm:
                            prefetch_bytes(kn, na[n - 1] + 4, n * 4)
                    i = 0
                    while i < n:  # one key group at a time
                        grp = (t0 + i) // kgroup
                        i_end = min((grp + 1) * kgroup - t0, n)
                        key_stats(ks, ks16, table, req, h, grp, dks, d, kstat, kstat16, ksf)
                        key_stats(ko, ko16, table, req, h, grp, dko, d, kstat, kstat16, kof)
                        _fold_key_group(qo, qp, ksf, kof, mid, korder, qs, bias, ksp, nr)
                        if wide and kwide:  # the constant first: at 8 lanes the 16-lane call is pruned before typing
                            _logits_rows16(qs, d, kc, ka, i, i_end, rb, bits, bias, tok, p, pf, nr, b16, t4, o16)
                        else:
                            _logits_rows8(qs, d, kc, ka, i, i_end, rb, bits, bias, tok, p, nr)
                        i = i_end
                    mask_block(p, n, t0, lim)
                    _block_weights(pf, ps, n, nr, m, l, acc, d, vbias, vst, vot, nvg, pw)
                    if wide:
                        _weighted_values_rows16(pw, ps, vc, va, n, rb, bits, chunks_per_group, acc, d, nr)
                    else:
                        _weighted_values_rows8(pw, ps, vc, va, n, rb, bits, chunks_per_group, acc, d, nr)
                for r in range(ROWS):
                    for j in range(d):
                        c = order[j]
                        out[r * d + c] = acc[r * d + j] + vbias[r, c // vgroup]
                store_partial(job, m, l, out, pm, pl, pacc)
    return planes_jobs


#: :func:`planes_jobs` in 8-lane and in 16-lane vectors
planes_jobs8, planes_jobs16 = _jobs_kernel(False), _jobs_kernel(True)


def jobs_kernel(wide: bool):  # noqa: ANN201
    """The CODES jobs kernel at a width (:data:`WIDE` on this host; the conformance suite runs both on any host)."""
    return planes_jobs16 if wide else planes_jobs8


def contiguous_block(kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset, bits, kgroup, vgroup, scale):
    """``(buffers, desc)``: one contiguous block's seven field buffers (flat bytes, no copy) and their
    descriptor rows, as :func:`planes_jobs` reads them (the trivial page table: request ``b`` is batch
    element ``b``). Takes a block's whole argument tuple (``IntCodesNumba._block_args``)."""
    bufs = tuple(_bytes(a) for a in (kcodes, kscale, koffset, knorm, vcodes, vscale, voffset))
    return bufs, _contiguous_desc(kcodes.shape[1], kcodes.shape[2], kcodes.shape[3], kscale.shape[2], kscale.shape[3],
                                  vgroup, bool(use_norm))


@functools.lru_cache(maxsize=256)
def _contiguous_desc(nhk: int, nt: int, rb: int, nkg: int, d: int, vgroup: int, use_norm: bool) -> np.ndarray:
    """The descriptor rows of a contiguous block of these shapes, shared by every block of them (never written:
    a read-only flag would give the kernels a second compiled signature)."""
    nvg = d // vgroup
    desc = np.zeros((7, DESC), np.int64)
    #        rows per block, block stride, head stride, row stride, offset, width, group rows
    desc[F_KC] = (nt, nhk * nt * rb, nt * rb, rb, 0, rb, 1)
    desc[F_KS] = desc[F_KO] = (nkg, nhk * nkg * 2 * d, nkg * 2 * d, 2 * d, 0, 2 * d, 1)
    desc[F_KN] = (nt, nt * 4, 0, 4, 0, 4, 1) if use_norm else 0
    desc[F_VC] = desc[F_KC]
    desc[F_VS] = desc[F_VO] = (nt, nhk * nt * 2 * nvg, nt * 2 * nvg, 2 * nvg, 0, 2 * nvg, 1)
    return desc


def contiguous_jobs(kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset, bits, kgroup, vgroup, scale):
    """``(jobs_fn, align)``: :func:`planes_jobs` over one contiguous block (:func:`contiguous_block`),
    for :func:`kvq_numba.cpu.page_table.run` and its kin."""
    bufs, desc = contiguous_block(kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset, bits, kgroup,
                                  vgroup, scale)
    scale = np.float32(scale)

    kernel = jobs_kernel(WIDE)

    def jobs_fn(qh, jobs, first, row_lo, g, table, chunks, pm, pl, pacc):  # noqa: ANN001, ANN202
        kernel(qh, jobs, first, row_lo, g, table, chunks, *bufs, desc, use_norm, bits, kgroup, vgroup, scale, pm, pl, pacc)
    return jobs_fn, int(block_tokens(kgroup))


def _window_kernel(wide: bool):  # noqa: ANN202
    """:func:`planes_window` for one width (a constant, as in :func:`_jobs_kernel`)."""

    @njit(cache=True)
    def planes_window(q, tk, tv, rotate, inv_sqrt_d, bufs, desc, tokens, use_norm, bits, kgroup, vgroup, scale, split,
                      chunks):
        """``(out [b, q_heads, q_len, d], lse [b, q_heads, q_len])``: a decode step over up to two contiguous
        blocks then the exact window ``tk`` / ``tv`` float32 [b, kv_heads, w, d], in one compiled call.
        Block ``s`` (``s < 2``) has ``tokens[s]`` tokens (0: absent), its seven field buffers in
        ``bufs[s]`` and its descriptor rows in ``desc[s]`` (:func:`contiguous_block`). It does what
        :func:`kvq_numba.cpu.window.run` does for a list of blocks (group the queries, rotate them into the
        keys' domain when ``rotate``, plan, CODES jobs (:func:`jobs_kernel`), their partials rotated back, TAIL
        jobs, combine, ungroup) without its Python-level steps and their kernel launches (~120 us a call). A KVQCache layer
        holds one or two blocks at almost every step (:data:`kvq_core.integrations.hf.flush.JOIN_RATIO`).
        Compiled per width (:func:`window_kernel`)."""
        b, hq, lq, d = q.shape
        nhk, w = tk.shape[1], tk.shape[2]
        g = hq // nhk
        qo = group_rows(q, nhk)
        qc = qo.copy()
        if rotate:
            fwht_block(qc.reshape(nhk * b * lq * g, d), qc.reshape(nhk * b * lq * g, d), inv_sqrt_d)
        nseg = 2 if tokens[1] > 0 else 1
        coded, jobs, groups, local, first, row_lo, table, pm, pl, pacc = block_plan(b, lq, g, nhk, d, tokens, nseg, w, split)
        for s in range(nseg):
            kc, ks, ko, kn, vc, vs, vo = bufs[s]
            if wide:  # a constant, as in _jobs_kernel
                planes_jobs16(qc, local[s], first, row_lo, g, table, chunks, kc, ks, ko, kn, vc, vs, vo, desc[s], use_norm,
                              bits, kgroup, vgroup, scale, pm, pl, pacc)
            else:
                planes_jobs8(qc, local[s], first, row_lo, g, table, chunks, kc, ks, ko, kn, vc, vs, vo, desc[s], use_norm,
                             bits, kgroup, vgroup, scale, pm, pl, pacc)
        if rotate:  # partials from the values' domain back to the original one (linear: unnormalised is fine)
            flat = pacc.reshape(jobs.shape[0] * ROWS, d)
            fwht_block(flat, flat, inv_sqrt_d)
        return finish(qo, jobs, groups, first, row_lo, g, chunks, coded, tk, tv, scale, pm, pl, pacc, b, lq)
    return planes_window


#: :func:`planes_window` in 8-lane and in 16-lane vectors
planes_window8, planes_window16 = _window_kernel(False), _window_kernel(True)


def window_kernel(wide: bool):  # noqa: ANN201
    """The fused decode step at a width (:data:`WIDE` on this host; the conformance suite runs both on any host)."""
    return planes_window16 if wide else planes_window8


def attend_planes(q, kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset, bits, kgroup, vgroup, scale):
    """:func:`kvq_numba.cpu.attend.attend_int_codes` (same arguments and results) for code rows that
    :func:`fits`: the contiguous blocks as the trivial page table of :func:`planes_jobs`."""
    return page_table.run_trivial(q, kcodes.shape[2], *contiguous_jobs(
        kcodes, kscale, koffset, knorm, use_norm, vcodes, vscale, voffset, bits, kgroup, vgroup, scale))


def _bytes(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, flat (no copy)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
