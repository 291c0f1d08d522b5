"""Torch kernels of ``polarquant`` (mirrors ``kvq_numpy/polarquant.py``): rotate, recursive polar
transform, per-level angle codebooks.

Vectorised over batch, heads, tokens and coordinates; the only loop runs over the L <= log2(d)
levels of the polar tree. Angles and radii are float32 values computed through float64
(``atan2``, ``sqrt(x^2 + y^2)``) and rounded once: correctly rounded in practice, so eager and
inductor agree bit for bit (their float32 ``atan2`` differ by an ulp on vector tails), and the
radii equal NumPy's ``hypot``. NumPy's float32 ``arctan2`` is not correctly rounded and depends
on the platform (AVX-512 SIMD vs libm), so an angle code can differ from the reference where the
angle is within an ulp of a codebook threshold: mostly exact ties such as ``|even| == |odd|``
(an angle of k pi/4, on a threshold of the level-1 grid and of every level >= 2 codebook).
"""
from __future__ import annotations

import math

import torch

from kvq_core.methods.polarquant import PolarQuantSpec
from kvq_torch.common import (
    Consts,
    Fields,
    TorchContext,
    TorchMethod,
    codebook_quantize,
    pack_codes,
    softmax_attend,
    unpack_codes,
)
from kvq_torch.rotation import rotate, rotate_queries, unrotate, unrotate_output

#: float32(2 pi) as a Python float: level-1 angles are taken modulo it, in float32.
TWO_PI = float(torch.tensor(2 * math.pi, dtype=torch.float32))


def _pairs(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The even and odd entries of the last axis: the two children of each tree node."""
    return a[..., 0::2], a[..., 1::2]


def angle_of(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """float32 ``atan2(odd, even)`` in [-pi, pi], computed in float64 and rounded once."""
    return torch.atan2(odd.to(torch.float64), even.to(torch.float64)).to(torch.float32)


def radius_of(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """float32 ``hypot(even, odd)`` as libm's hypotf: ``sqrt`` of the exact squares' sum in float64."""
    e, o = even.to(torch.float64), odd.to(torch.float64)
    return torch.sqrt(e * e + o * o).to(torch.float32)


def wrap_angle(angle: torch.Tensor) -> torch.Tensor:
    """``np.mod(angle, float32(2 pi))`` for angle in [-pi, pi]: [0, 2 pi), adding 2 pi in float32."""
    return torch.where(angle < 0, angle + TWO_PI, angle)


def unit_circle(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) of a codebook's angles, through float64: one table lookup per code, and
    the same bits eager and compiled (their float32 ``cos``/``sin`` differ by an ulp)."""
    a = angles.to(torch.float64)
    return torch.cos(a).to(torch.float32), torch.sin(a).to(torch.float32)


def polar_encode(y: torch.Tensor, spec: PolarQuantSpec, consts: Consts) -> Fields:
    """Angle codes per level and block radii of rotated vectors ``y [..., d]``."""
    fields: Fields = {}
    radius = y
    for level, bits in enumerate(spec.level_bits, start=1):
        even, odd = _pairs(radius)
        angle = angle_of(even, odd)
        if level == 1:
            angle = wrap_angle(angle)  # [0, 2 pi); level >= 2 pairs radii, so it is in [0, pi/2]
        fields[f"level{level}"] = pack_codes(codebook_quantize(angle, consts[f"level{level}_thresholds"]), bits)
        radius = radius_of(even, odd)
    fields["radius"] = radius.to(getattr(torch, spec.radius_dtype))
    return fields


def polar_decode(fields: Fields, spec: PolarQuantSpec, consts: Consts) -> torch.Tensor:
    """Rotated-domain vectors ``[..., d]`` (float32): walk the polar tree from the radii down."""
    radius = fields["radius"].to(torch.float32)
    for level in range(spec.levels, 0, -1):
        codes = unpack_codes(fields[f"level{level}"], spec.level_bits[level - 1], spec.angles_at(level))
        cos, sin = unit_circle(consts[f"level{level}_centroids"])
        radius = torch.stack((radius * cos[codes], radius * sin[codes]), dim=-1).flatten(-2)
    return radius


class PolarQuantTorch(TorchMethod):
    """Rotate (R = H diag(s) per kv head, or none) in float32, then polar-code; same codec for values."""

    spec: PolarQuantSpec

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return polar_encode(rotate(k, ctx.consts), self.spec, ctx.consts)

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return unrotate(polar_decode(fields, self.spec, ctx.consts), ctx.consts)

    def attend(
        self, q: torch.Tensor, kfields: Fields, vfields: Fields, ctx: TorchContext, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score R q against the rotated-domain keys (R orthogonal keeps q.k); un-rotate the output once."""
        kv_heads = kfields["radius"].shape[1]
        k_rot = polar_decode(kfields, self.spec, ctx.consts)
        v_rot = polar_decode(vfields, self.spec, ctx.consts)
        out, lse = softmax_attend(rotate_queries(q, ctx.consts, kv_heads), k_rot, v_rot, scale)
        return unrotate_output(out, ctx.consts, kv_heads), lse
