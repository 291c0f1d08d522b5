"""Asymmetric min/max integer quantization over groups along one axis (OScaR, KIVI, QuaRot, QJL values).

The zero-point kinds are those of :mod:`kvq_core.methods.intcodes`. With L = 2^bits - 1 and, per group, ``mn, mx = clip_ratio * (min, max)``:

- ``zero_point="integer"`` (OScaR, QuaRot; specs/oscar.md 1.4): both 0 -> -1, +1; if mx > mn:
  ``s = (mx - mn) / L``, ``zq = rint(-mn / s)``, ``q = clip(rint(x / s + zq), 0, L)``,
  stored ``scale = f16(s)``, ``offset = f16(-zq * s)`` (0 is exactly representable);
- ``zero_point="min"`` (KIVI's official code): ``q = clip(rint((x - mn) / s), 0, L)``,
  ``offset = f16(mn)`` (the group minimum is exactly representable).

A constant group (mx == mn, incl. all-zero under "min") stores ``scale = 0, q = 0, offset = f16(mn)``.
Decode is ``q * scale + offset`` in float32. ``s`` is float32 arithmetic; ``rint`` rounds half to even.
``clip_ratio`` < 1 shrinks the range towards 0 (QuaRot's clipping): mn, mx = ρ·min(x_min, 0), ρ·max(x_max, 0).
"""
from __future__ import annotations

import numpy as np

from kvq_core.layout import pack_codes, unpack_codes
from kvq_core.methods.intcodes import ZERO_INTEGER


def _split_groups(x: np.ndarray, group: int) -> np.ndarray:
    """View the last axis as ``(ngroups, group)``, padding the partial last group with NaN."""
    n = x.shape[-1]
    ngroups = -(-n // group)
    pad = ngroups * group - n
    xp = np.concatenate([x, np.full((*x.shape[:-1], pad), np.nan, np.float32)], axis=-1) if pad else x
    return xp.reshape(*x.shape[:-1], ngroups, group)


def _group_range(g: np.ndarray, zero_point: str, clip_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    mn, mx = np.nanmin(g, axis=-1), np.nanmax(g, axis=-1)
    if clip_ratio != 1.0:
        ratio = np.float32(clip_ratio)
        mn, mx = ratio * np.minimum(mn, 0), ratio * np.maximum(mx, 0)
    if zero_point == ZERO_INTEGER:
        both_zero = (mn == 0) & (mx == 0)
        mn = np.where(both_zero, np.float32(-1), mn)
        mx = np.where(both_zero, np.float32(1), mx)
    return mn.astype(np.float32), mx.astype(np.float32)


def quantize(
    x: np.ndarray, bits: int, group: int, axis: int, zero_point: str = ZERO_INTEGER, clip_ratio: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``x`` in groups of ``group`` consecutive elements along ``axis``.

    Returns ``codes`` (int64, shape of x), ``scale`` and ``offset`` (float16, ``axis`` replaced
    by the number of groups, the last one possibly partial).
    """
    levels = np.float32(2**bits - 1)
    xm = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = xm.shape[-1]
    g = _split_groups(xm, group)
    mn, mx = _group_range(g, zero_point, clip_ratio)
    varying = mx > mn
    s = np.where(varying, (mx - mn) / levels, np.float32(0)).astype(np.float32)
    safe_s = np.where(varying, s, np.float32(1))[..., None]
    if zero_point == ZERO_INTEGER:
        zq = np.where(varying, np.rint(-mn / safe_s[..., 0]), np.float32(0)).astype(np.float32)
        q = np.rint(g / safe_s + zq[..., None])
        offset = np.where(varying, -zq * s, mn)
    else:
        q = np.rint((g - mn[..., None]) / safe_s)
        offset = mn
    q = np.where(varying[..., None], np.clip(q, 0, levels), 0)
    codes = np.nan_to_num(q, nan=0.0).reshape(*xm.shape[:-1], -1)[..., :n].astype(np.int64)
    return (np.moveaxis(codes, -1, axis), np.moveaxis(s.astype(np.float16), -1, axis),
            np.moveaxis(offset.astype(np.float16), -1, axis))


def dequantize(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, group: int, axis: int) -> np.ndarray:
    """Inverse of :func:`quantize`: ``codes * scale + offset`` per group, float32."""
    n = codes.shape[axis]
    s = np.repeat(np.asarray(scale, np.float32), group, axis=axis)
    o = np.repeat(np.asarray(offset, np.float32), group, axis=axis)
    idx = [slice(None)] * codes.ndim
    idx[axis] = slice(0, n)
    return codes.astype(np.float32) * s[tuple(idx)] + o[tuple(idx)]


def encode_fields(
    x: np.ndarray, bits: int, group: int, axis: int, zero_point: str = ZERO_INTEGER, clip_ratio: float = 1.0
) -> dict[str, np.ndarray]:
    """:func:`quantize` as stored fields: ``codes`` bit-packed along the last axis, ``scale``, ``offset``."""
    codes, scale, offset = quantize(x, bits, group, axis, zero_point, clip_ratio)
    return {"codes": pack_codes(codes, bits), "scale": scale, "offset": offset}


def decode_fields(fields: dict[str, np.ndarray], bits: int, head_dim: int, group: int, axis: int) -> np.ndarray:
    """Inverse of :func:`encode_fields` for blocks whose last axis has ``head_dim`` entries (float32)."""
    codes = unpack_codes(fields["codes"], bits, head_dim)
    return dequantize(codes, fields["scale"], fields["offset"], group, axis)
