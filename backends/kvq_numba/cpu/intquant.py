"""Numba CPU kernels of the asymmetric min/max integer quantizer (kvq_numpy.intquant), for blocks
``[batch, heads, tokens, head_dim]`` grouped along tokens (per channel: OScaR/KIVI keys) or along
channels (per token: values).

Encode mirrors the reference's float32 arithmetic op for op without fastmath (``x / s + zq``, not
a multiply by 1/s; round half to even), so codes equal the reference's. Scales and offsets come
back float32; callers round them to float16 with NumPy, as the reference does. Decode takes the
stored float16 fields as uint16 bits (:func:`kvq_numba.cpu.common.half_bits`).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvq_numba.cpu.common import half_to_float, pack_row, unpack_rows
from kvq_numba.rules import group_params, int_code, row_bytes

@njit(parallel=True, cache=True)
def encode_token_groups(x, bits, group, zero_mode):
    """Codes per (head, channel) over groups of ``group`` tokens; x float32 [b, h, t, d].

    Returns (codes uint8 [b, h, t, row_bytes], scale float32 [b, h, ngroups, d], offset likewise).
    """
    nb, nh, nt, d = x.shape
    ng = (nt + group - 1) // group
    nbytes = row_bytes(d, bits)
    levels = np.float32((1 << bits) - 1)
    codes = np.zeros((nb, nh, nt, nbytes), np.uint8)
    scale = np.empty((nb, nh, ng, d), np.float32)
    offset = np.empty((nb, nh, ng, d), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        mn = np.empty(d, np.float32)
        mx = np.empty(d, np.float32)
        s = np.empty(d, np.float32)
        zq = np.empty(d, np.float32)
        var = np.empty(d, np.bool_)
        row = np.empty(d, np.uint8)
        for g in range(ng):
            t0, t1 = g * group, min(nt, (g + 1) * group)
            for c in range(d):
                mn[c] = x[b, h, t0, c]
                mx[c] = x[b, h, t0, c]
            for t in range(t0 + 1, t1):
                for c in range(d):
                    v = x[b, h, t, c]
                    mn[c] = min(mn[c], v)
                    mx[c] = max(mx[c], v)
            for c in range(d):
                s[c], zq[c], offset[b, h, g, c], var[c] = group_params(mn[c], mx[c], levels, zero_mode)
                scale[b, h, g, c] = s[c]
            for t in range(t0, t1):
                for c in range(d):
                    row[c] = np.uint8(int_code(x[b, h, t, c], s[c], zq[c], mn[c], levels, zero_mode)) if var[c] else 0
                pack_row(row, bits, codes[b, h, t])
    return codes, scale, offset


@njit(parallel=True, cache=True)
def encode_channel_groups(x, bits, group, zero_mode):
    """Codes per token over groups of ``group`` channels (``group`` divides d); x float32 [b, h, t, d].

    Returns (codes uint8 [b, h, t, row_bytes], scale float32 [b, h, t, d // group], offset likewise).
    """
    nb, nh, nt, d = x.shape
    ng = d // group
    nbytes = row_bytes(d, bits)
    levels = np.float32((1 << bits) - 1)
    codes = np.zeros((nb, nh, nt, nbytes), np.uint8)
    scale = np.empty((nb, nh, nt, ng), np.float32)
    offset = np.empty((nb, nh, nt, ng), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        row = np.empty(d, np.uint8)
        rowg = row.reshape((ng, group))
        for t in range(nt):
            xg = x[b, h, t].reshape((ng, group))  # group views: loop indices from 0 vectorise
            for g in range(ng):
                xv = xg[g]
                rv = rowg[g]
                mn = xv[0]
                mx = xv[0]
                for c in range(1, group):
                    mn = min(mn, xv[c])
                    mx = max(mx, xv[c])
                s, zq, off, var = group_params(mn, mx, levels, zero_mode)
                scale[b, h, t, g] = s
                offset[b, h, t, g] = off
                if var:
                    for c in range(group):
                        rv[c] = np.uint8(int_code(xv[c], s, zq, mn, levels, zero_mode))
                else:
                    rv[:] = 0
            pack_row(row, bits, codes[b, h, t])
    return codes, scale, offset


@njit(parallel=True, cache=True)
def decode_token_groups(codes, scale_bits, offset_bits, bits, group, d):
    """float32 [b, h, t, d] = code * scale + offset, stats per (token group, channel)."""
    nb, nh, nt = codes.shape[:3]
    out = np.empty((nb, nh, nt, d), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        x = out[b, h]
        unpack_rows(codes[b, h], 0, nt, bits, d, x)
        s = np.empty(d, np.float32)
        o = np.empty(d, np.float32)
        for t in range(nt):
            if t % group == 0:
                for j in range(d):
                    s[j] = half_to_float(scale_bits[b, h, t // group, j])
                    o[j] = half_to_float(offset_bits[b, h, t // group, j])
            for j in range(d):
                x[t, j] = x[t, j] * s[j] + o[j]
    return out


@njit(parallel=True, cache=True)
def decode_channel_groups(codes, scale_bits, offset_bits, bits, group, d):
    """float32 [b, h, t, d] = code * scale + offset, stats per (token, channel group)."""
    nb, nh, nt = codes.shape[:3]
    out = np.empty((nb, nh, nt, d), np.float32)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        x = out[b, h]
        unpack_rows(codes[b, h], 0, nt, bits, d, x)
        xg = x.reshape((nt, d // group, group))
        for t in range(nt):
            for g in range(d // group):
                s = half_to_float(scale_bits[b, h, t, g])
                o = half_to_float(offset_bits[b, h, t, g])
                for j in range(group):
                    xg[t, g, j] = xg[t, g, j] * s + o
    return out
