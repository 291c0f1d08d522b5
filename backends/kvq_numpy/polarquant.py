"""NumPy kernels of ``polarquant``: rotate, recursive polar transform, per-level angle codebooks.

Everything is vectorised over batch, heads, tokens and coordinates; the only loop runs over the
L <= log2(head_dim) levels of the polar tree. Math is float32, the precision GPU kernels use.
"""
from __future__ import annotations

import numpy as np

from kvq_core.contract import KernelContext
from kvq_core.layout import pack_codes, unpack_codes
from kvq_core.methods.polarquant import PolarQuantSpec
from kvq_numpy.attention import softmax_attend
from kvq_numpy.rotation import rotate, rotate_queries, unrotate, unrotate_output

TWO_PI = np.float32(2 * np.pi)


def _pairs(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The even and odd entries of the last axis: the two children of each tree node."""
    return a[..., 0::2], a[..., 1::2]


def polar_encode(y: np.ndarray, spec: PolarQuantSpec, ctx: KernelContext) -> dict[str, np.ndarray]:
    """Angle codes per level and block radii of rotated vectors ``y [..., d]``."""
    fields: dict[str, np.ndarray] = {}
    radius = y
    for level, bits in enumerate(spec.level_bits, start=1):
        even, odd = _pairs(radius)
        # float64 then one rounding: float32 arctan2 is not correctly rounded (platform-dependent)
        angle = np.arctan2(odd.astype(np.float64), even.astype(np.float64)).astype(np.float32)
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
        """Rotate (R = H diag(s) per kv head, or none) in float32, then polar-code."""
        return polar_encode(rotate(np.asarray(k, np.float32), ctx.consts), self.spec, ctx)

    def decode_keys(self, fields: dict[str, np.ndarray], ctx: KernelContext) -> np.ndarray:
        return unrotate(polar_decode(fields, self.spec, ctx), ctx.consts)

    encode_values = encode_keys
    decode_values = decode_keys

    def attend(
        self, q: np.ndarray, kfields: dict[str, np.ndarray], vfields: dict[str, np.ndarray], ctx: KernelContext, scale: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Score R q against the rotated-domain keys (R orthogonal keeps q.k); un-rotate the output once."""
        k_rot = polar_decode(kfields, self.spec, ctx)
        v_rot = polar_decode(vfields, self.spec, ctx)
        kv_heads = ctx.shape[1]
        q_rot = rotate_queries(np.asarray(q, np.float32), ctx.consts, kv_heads)
        out, lse = softmax_attend(q_rot, k_rot, v_rot, scale)
        return unrotate_output(out, ctx.consts, kv_heads), lse
