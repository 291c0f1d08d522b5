"""Torch kernels of ``quarot`` (mirrors ``kvq_numpy/quarot.py``): Hadamard per head (the core's
dense factor by :func:`~kvq_torch.common.hadamard_rotate`), then per-token asymmetric INT-b with group = head_dim and
QuaRot's clipping of the range (``clip_ratio``)."""
from __future__ import annotations

import torch

from kvq_torch.common import (
    Fields,
    TorchContext,
    TorchMethod,
    asym_dequantize,
    asym_quantize,
    group_channels,
    group_range,
    hadamard_rotate,
    pack_codes,
    softmax_attend,
    unpack_codes,
)


def _rotate(x: torch.Tensor, ctx: TorchContext) -> torch.Tensor:
    """x H (symmetric, its own inverse) by the fast transform; identity without rotation."""
    return hadamard_rotate(x, ctx.consts["hadamard"]) if "hadamard" in ctx.consts else x.to(torch.float32)


class QuaRotTorch(TorchMethod):
    def _encode_rotated(self, y: torch.Tensor) -> Fields:
        d = self.spec.head_dim
        codes, scale, offset = asym_quantize(group_channels(y, d), self.spec.bits, 4, clip_ratio=self.spec.clip_ratio)
        return {"codes": pack_codes(codes.reshape(y.shape), self.spec.bits), "scale": scale, "offset": offset}

    def _decode_rotated(self, fields: Fields) -> torch.Tensor:
        d = self.spec.head_dim
        codes = group_channels(unpack_codes(fields["codes"], self.spec.bits, d, torch.uint8), d)
        y = asym_dequantize(codes, fields["scale"], fields["offset"], dim=4)
        return y.reshape(*y.shape[:-2], d)

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        return self._encode_rotated(_rotate(k, ctx))

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return _rotate(self._decode_rotated(fields), ctx)

    def clips(self, kind: str) -> bool:
        """``clip_ratio`` < 1 cuts each token's rotated range (QuaRot's clipping)."""
        return self.spec.clip_ratio < 1.0

    def ste_grad(self, x: torch.Tensor, grad: torch.Tensor, ctx: TorchContext, kind: str) -> torch.Tensor:
        """Straight-through: exact through the rotation, zero for rotated coordinates outside
        their token's clipped range (``H`` is its own inverse: ``H (m * H g)``)."""
        y = group_channels(_rotate(x, ctx), self.spec.head_dim)
        mn, mx = group_range(y, 4, self.spec.clip_ratio)
        kept = ((y >= mn) & (y <= mx)).reshape(x.shape)
        return _rotate(_rotate(grad, ctx) * kept, ctx)

    def attend(self, q, kfields: Fields, vfields: Fields, ctx: TorchContext, scale):
        """Score H q against rotated-domain keys; rotate the output back once."""
        out, lse = softmax_attend(_rotate(q, ctx), self._decode_rotated(kfields), self._decode_rotated(vfields), scale)
        return _rotate(out, ctx), lse
