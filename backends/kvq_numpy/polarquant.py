"""NumPy kernels of ``polarquant``: rotate, recursive polar transform, per-level angle codebooks.

Everything is vectorised over batch, heads, tokens and coordinates; the only loop runs over the
L <= log2(head_dim) levels of the polar tree. Math is float32, the precision GPU kernels use.
"""
from __future__ import annotations

import numpy as np

from kvq_core.kernels import KernelContext
from kvq_core.layout import pack_codes, unpack_codes
from kvq_core.math.hadamard import fwht
from kvq_core.methods.polarquant import PolarQuantSpec
from kvq_numpy.attention import softmax_attend

TWO_PI = np.float32(2 * np.pi)


def _signs(ctx: KernelContext, heads: int) -> np.ndarray | None:
    """Per-head signs of R broadcast to ``[1, heads, 1, d]`` (GQA: q head j uses kv head j // g)."""
    s = ctx.consts.get("signs")
    if s is None:
        return None
    return np.repeat(s, heads // s.shape[0], axis=0)[None, :, None, :]


def rotate(x: np.ndarray, ctx: KernelContext) -> np.ndarray:
    """y = R x = H (s * x) per head, float32 (identity when the spec has no rotation)."""
    x = np.asarray(x, np.float32)
    s = _signs(ctx, x.shape[1])
    return x if s is None else fwht(x * s)


def unrotate(y: np.ndarray, ctx: KernelContext) -> np.ndarray:
    """x = R^T y = s * (H y) per head, float32."""
    y = np.asarray(y, np.float32)
    s = _signs(ctx, y.shape[1])
    return y if s is None else s * fwht(y)


def _pairs(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The even and odd entries of the last axis: the two children of each tree node."""
    return a[..., 0::2], a[..., 1::2]


def polar_encode(y: np.ndarray, spec: PolarQuantSpec, ctx: KernelContext) -> dict[str, np.ndarray]:
    """Angle codes per level and block radii of rotated vectors ``y [..., d]``."""
    fields: dict[str, np.ndarray] = {}
    radius = y
    for level, bits in enumerate(spec.level_bits, start=1):
        even, odd = _pairs(radius)
        angle = np.arctan2(odd, even)
        if level == 1:
            angle = np.mod(angle, TWO_PI)  # [0, 2 pi); level >= 2 pairs radii, so it is in [0, pi/2]
        codes = np.searchsorted(ctx.consts[f"level{level}_thresholds"], angle, side="right")
        fields[f"level{level}"] = pack_codes(codes, bits)
        radius = np.hypot(even, odd)
    fields["radius"] = radius.astype(spec.radius_dtype)
    return fields


def polar_decode(fields: dict[str, np.ndarray], spec: PolarQuantSpec, ctx: KernelContext) -> np.ndarray:
    """Rotated-domain vectors ``[..., d]`` (float32): walk the polar tree from the radii down."""
    radius = np.asarray(fields["radius"], np.float32)
    for level in range(spec.levels, 0, -1):
        codes = unpack_codes(fields[f"level{level}"], spec.level_bits[level - 1], spec.angles_at(level))
        angle = ctx.consts[f"level{level}_centroids"][codes]
        radius = np.stack((radius * np.cos(angle), radius * np.sin(angle)), axis=-1).reshape(*codes.shape[:-1], -1)
    return radius


class PolarQuantKernels:
    def __init__(self, spec: PolarQuantSpec) -> None:
        self.spec = spec

    def encode_keys(self, k: np.ndarray, ctx: KernelContext) -> dict[str, np.ndarray]:
        return polar_encode(rotate(k, ctx), self.spec, ctx)

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return unrotate(polar_decode(fields, self.spec, ctx), ctx)

    encode_values = encode_keys
    decode_values = decode_keys

    def attend(
        self, q: np.ndarray, kfields: dict[str, np.ndarray], vfields: dict[str, np.ndarray], ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Score R q against the rotated-domain keys (R orthogonal keeps q.k); un-rotate the output once."""
        k_rot = polar_decode(kfields, self.spec, ctx)
        v_rot = polar_decode(vfields, self.spec, ctx)
        out, lse = softmax_attend(rotate(q, ctx), k_rot, v_rot, scale)
        return unrotate(out, ctx), lse
