"""Asymmetric min/max integer quantization over groups along one axis (OScaR, KIVI, QuaRot, QJL values).

Formula (specs/oscar.md 1.4, KIVI): with L = 2^bits - 1, per group
``mn, mx = min, max`` (both 0 -> -1, +1); if mx > mn: ``s = (mx - mn) / L`` (float32),
``zq = rint(-mn / s)``, ``q = clip(rint(x / s + zq), 0, L)``; stored ``scale = f16(s)`` and
``offset = f16(-zq * s)``. A constant group stores ``s = 0, q = 0, offset = f16(mn)``.
Decode is ``q * scale + offset`` in float32. ``rint`` rounds half to even.
"""
from __future__ import annotations

import numpy as np


def _split_groups(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """View the last axis as ``(ngroups, group)``, padding the partial last group with NaN.

    Returns the padded float32 array and a boolean mask of real elements.
    """
    n = x.shape[-1]
    ngroups = -(-n // group)
    pad = ngroups * group - n
    xp = np.concatenate([x, np.full((*x.shape[:-1], pad), np.nan, np.float32)], axis=-1) if pad else x
    return xp.reshape(*x.shape[:-1], ngroups, group), pad


def quantize(x: np.ndarray, bits: int, group: int, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``x`` in groups of ``group`` consecutive elements along ``axis``.

    Returns ``codes`` (int64, shape of x), ``scale`` and ``offset`` (float16, ``axis`` replaced
    by the number of groups, the last one possibly partial).
    """
    levels = np.float32(2**bits - 1)
    xm = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = xm.shape[-1]
    g, _ = _split_groups(xm, group)
    mn = np.nanmin(g, axis=-1)
    mx = np.nanmax(g, axis=-1)
    both_zero = (mn == 0) & (mx == 0)
    mn = np.where(both_zero, np.float32(-1), mn)
    mx = np.where(both_zero, np.float32(1), mx)
    varying = mx > mn
    s = np.where(varying, (mx - mn) / levels, np.float32(0)).astype(np.float32)
    safe_s = np.where(varying, s, np.float32(1))
    zq = np.where(varying, np.rint(-mn / safe_s), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(g / safe_s[..., None] + zq[..., None]), 0, levels)
    q = np.where(varying[..., None], q, 0)
    codes = np.nan_to_num(q, nan=0.0).reshape(*xm.shape[:-1], -1)[..., :n].astype(np.int64)
    offset = np.where(varying, -zq * s, mn).astype(np.float16)
    return np.moveaxis(codes, -1, axis), np.moveaxis(s.astype(np.float16), -1, axis), np.moveaxis(offset, -1, axis)


def dequantize(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, group: int, axis: int) -> np.ndarray:
    """Inverse of :func:`quantize`: ``codes * scale + offset`` per group, float32."""
    n = codes.shape[axis]
    s = np.repeat(np.asarray(scale, np.float32), group, axis=axis)
    o = np.repeat(np.asarray(offset, np.float32), group, axis=axis)
    idx = [slice(None)] * codes.ndim
    idx[axis] = slice(0, n)
    return codes.astype(np.float32) * s[tuple(idx)] + o[tuple(idx)]
