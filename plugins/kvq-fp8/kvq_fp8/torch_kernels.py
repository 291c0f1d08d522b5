"""Torch kernels of ``fp8`` (mirror :mod:`kvq_fp8.numpy_kernels`): torch's native float8 dtypes.

torch rounds float32 to ``float8_e4m3fn`` / ``float8_e5m2`` to nearest, ties to even, but does
not saturate (e4m3fn overflows to NaN, e5m2 to Inf), so values are clamped to the format's
largest finite value first: the same codes as the reference, bit for bit.
"""
from __future__ import annotations

import torch

from kvq_fp8.formats import FORMATS
from kvq_torch.common import Fields, TorchContext, TorchMethod

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class Fp8Torch(TorchMethod):
    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.dtype = DTYPES[spec.format]
        self.max = FORMATS[spec.format].max
        self.dims = (-1,) if spec.scale == "token" else (-2, -1)

    def _expand(self, scale: torch.Tensor) -> torch.Tensor:
        return scale[..., None] if len(self.dims) == 1 else scale[..., None, None]

    def encode_keys(self, k: torch.Tensor, ctx: TorchContext) -> Fields:
        x = k.to(torch.float32)
        scale = x.abs().amax(dim=self.dims) / self.max
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = torch.clamp(x / self._expand(safe), -self.max, self.max)
        return {"codes": y.to(self.dtype).view(torch.uint8), "scale": scale}

    def decode_keys(self, fields: Fields, ctx: TorchContext) -> torch.Tensor:
        return fields["codes"].view(self.dtype).to(torch.float32) * self._expand(fields["scale"].to(torch.float32))
